//! Which worker gets a request: the routing policies, with no I/O.
//!
//! The caller passes the workers a request may go to (healthy, not yet tried for it), in
//! registration order, with their loads and prefix trees; the policy picks one and says why.
//!
//! `cache_aware` (SGLang's router), for a request with routing key `key`:
//! 1. If the loads are imbalanced (`max - min > balance_abs_threshold` and
//!    `max > min * balance_rel_threshold`), the least-loaded worker ("balance").
//! 2. Else the worker whose tree holds the longest prefix of `key`, if that prefix covers more
//!    than `cache_threshold` of the key ("cache_hit").
//! 3. Else the worker whose tree holds the fewest chars, the one with the most room
//!    ("cache_miss").
//!
//! Ties go to the lower load, then to the earlier worker. The key is then inserted into the
//! chosen worker's tree. A request without a key goes to the least-loaded worker.

use crate::prefix_tree::PrefixTree;
use crate::worker::WorkerId;

/// The routing policies, as named on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Prefix-cache affinity, balanced by load (see the module docs).
    CacheAware,
    /// Each worker in turn.
    RoundRobin,
    /// The worker with the fewest requests in flight.
    LeastLoad,
}

impl std::str::FromStr for PolicyKind {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, Self::Err> {
        match name {
            "cache_aware" => Ok(PolicyKind::CacheAware),
            "round_robin" => Ok(PolicyKind::RoundRobin),
            "least_load" => Ok(PolicyKind::LeastLoad),
            other => Err(format!(
                "unknown policy '{other}': expected cache_aware, round_robin or least_load"
            )),
        }
    }
}

/// Why a worker was chosen; counted in `pagedrs_router_routing_decisions_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoutingReason {
    /// Loads were imbalanced; the least-loaded worker took it.
    Balance,
    /// The chosen worker's tree held more than `cache_threshold` of the key.
    CacheHit,
    /// No tree held enough of the key; the emptiest tree took it.
    CacheMiss,
    /// The next worker in turn.
    RoundRobin,
    /// The least-loaded worker (that policy, or a request without a routing key).
    LeastLoad,
}

impl RoutingReason {
    /// Every reason, in the order `/metrics` lists them.
    pub const ALL: [RoutingReason; 5] = [
        RoutingReason::Balance,
        RoutingReason::CacheHit,
        RoutingReason::CacheMiss,
        RoutingReason::RoundRobin,
        RoutingReason::LeastLoad,
    ];

    /// The label value in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            RoutingReason::Balance => "balance",
            RoutingReason::CacheHit => "cache_hit",
            RoutingReason::CacheMiss => "cache_miss",
            RoutingReason::RoundRobin => "round_robin",
            RoutingReason::LeastLoad => "least_load",
        }
    }
}

/// The thresholds of `cache_aware` (see the module docs for how they combine).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheAwareThresholds {
    /// A match must cover more than this fraction of the key to count as a hit.
    pub cache_threshold: f64,
    /// Loads are imbalanced only if max and min differ by more than this many requests...
    pub balance_abs_threshold: usize,
    /// ...and the max is more than this many times the min.
    pub balance_rel_threshold: f64,
}

/// A worker the request may go to, as the policy sees it.
#[derive(Debug)]
pub struct Candidate<'a> {
    /// The worker's id; candidates come in increasing id (registration) order.
    pub worker_id: WorkerId,
    /// Requests the router has in flight to the worker.
    pub num_in_flight: usize,
    /// The keys routed to the worker so far.
    pub tree: &'a mut PrefixTree,
}

/// The policy's choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// Index of the chosen worker in the candidates passed in.
    pub candidate_index: usize,
    /// Why it was chosen.
    pub reason: RoutingReason,
    /// Chars of the key the chosen worker's tree held before the insert (0 unless the
    /// policy is cache-aware).
    pub num_matched_chars: usize,
}

/// A routing policy with its state (the round-robin position).
#[derive(Debug)]
pub struct Policy {
    /// Which policy.
    kind: PolicyKind,
    /// The thresholds `cache_aware` uses.
    thresholds: CacheAwareThresholds,
    /// The worker chosen last by round robin; the next is the first one after it.
    last_round_robin_id: Option<WorkerId>,
}

impl Policy {
    /// A policy of `kind`; `thresholds` matter only to `cache_aware`.
    pub fn new(kind: PolicyKind, thresholds: CacheAwareThresholds) -> Self {
        Policy { kind, thresholds, last_round_robin_id: None }
    }

    /// Picks one of `candidates` for a request with routing key `key` (empty: none) and, for
    /// `cache_aware`, inserts the key into its tree. `None` when there is no candidate.
    pub fn choose(&mut self, candidates: &mut [Candidate<'_>], key: &[char]) -> Option<Decision> {
        if candidates.is_empty() {
            return None;
        }
        debug_assert!(candidates.windows(2).all(|pair| pair[0].worker_id < pair[1].worker_id));
        let decision = match self.kind {
            PolicyKind::RoundRobin => self.next_in_turn(candidates),
            PolicyKind::LeastLoad => least_loaded(candidates, RoutingReason::LeastLoad),
            PolicyKind::CacheAware if key.is_empty() => {
                least_loaded(candidates, RoutingReason::LeastLoad)
            }
            PolicyKind::CacheAware => {
                let decision = self.cache_aware(candidates, key);
                candidates[decision.candidate_index].tree.insert(key);
                decision
            }
        };
        Some(decision)
    }

    /// The first candidate after the one chosen last time, wrapping around.
    fn next_in_turn(&mut self, candidates: &[Candidate<'_>]) -> Decision {
        let candidate_index = self
            .last_round_robin_id
            .and_then(|last_id| candidates.iter().position(|c| c.worker_id > last_id))
            .unwrap_or(0);
        self.last_round_robin_id = Some(candidates[candidate_index].worker_id);
        Decision { candidate_index, reason: RoutingReason::RoundRobin, num_matched_chars: 0 }
    }

    /// Steps 1 to 3 of the module docs, for a non-empty `key`.
    fn cache_aware(&self, candidates: &[Candidate<'_>], key: &[char]) -> Decision {
        if self.is_imbalanced(candidates) {
            return least_loaded(candidates, RoutingReason::Balance);
        }
        let num_matched_per_candidate: Vec<usize> =
            candidates.iter().map(|c| c.tree.longest_prefix_chars(key)).collect();
        // The longest match; on a tie the lower load, then the earlier worker.
        let best_match_index = (0..candidates.len())
            .min_by_key(|&i| {
                (std::cmp::Reverse(num_matched_per_candidate[i]), candidates[i].num_in_flight, i)
            })
            .expect("candidates is not empty");
        let num_matched_chars = num_matched_per_candidate[best_match_index];
        let match_fraction = num_matched_chars as f64 / key.len() as f64;
        if match_fraction > self.thresholds.cache_threshold {
            return Decision {
                candidate_index: best_match_index,
                reason: RoutingReason::CacheHit,
                num_matched_chars,
            };
        }
        let emptiest_index = (0..candidates.len())
            .min_by_key(|&i| (candidates[i].tree.num_chars(), candidates[i].num_in_flight, i))
            .expect("candidates is not empty");
        Decision {
            candidate_index: emptiest_index,
            reason: RoutingReason::CacheMiss,
            num_matched_chars: num_matched_per_candidate[emptiest_index],
        }
    }

    /// Whether the loads differ by more than both balance thresholds.
    fn is_imbalanced(&self, candidates: &[Candidate<'_>]) -> bool {
        let loads = candidates.iter().map(|c| c.num_in_flight);
        let (Some(max_load), Some(min_load)) = (loads.clone().max(), loads.min()) else {
            return false;
        };
        max_load - min_load > self.thresholds.balance_abs_threshold
            && max_load as f64 > min_load as f64 * self.thresholds.balance_rel_threshold
    }
}

/// The candidate with the fewest requests in flight (the earlier one on a tie).
fn least_loaded(candidates: &[Candidate<'_>], reason: RoutingReason) -> Decision {
    let candidate_index = (0..candidates.len())
        .min_by_key(|&i| (candidates[i].num_in_flight, i))
        .expect("candidates is not empty");
    Decision { candidate_index, reason, num_matched_chars: 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thresholds the command line defaults to.
    const DEFAULT_THRESHOLDS: CacheAwareThresholds = CacheAwareThresholds {
        cache_threshold: 0.5,
        balance_abs_threshold: 32,
        balance_rel_threshold: 1.5,
    };

    /// A worker as a test sets it up: its load and the keys already routed to it.
    struct TestWorker {
        /// Requests in flight.
        num_in_flight: usize,
        /// Its prefix tree.
        tree: PrefixTree,
    }

    /// Workers with the given loads and the given keys in their trees.
    fn test_workers(loads_and_keys: &[(usize, &[&str])]) -> Vec<TestWorker> {
        loads_and_keys
            .iter()
            .map(|&(num_in_flight, keys)| {
                let mut tree = PrefixTree::new(usize::MAX);
                for key in keys {
                    tree.insert(&chars(key));
                }
                TestWorker { num_in_flight, tree }
            })
            .collect()
    }

    /// `text` as a routing key.
    fn chars(text: &str) -> Vec<char> {
        text.chars().collect()
    }

    /// Runs `policy` over `workers` (ids 0, 1, …) for `key`.
    fn choose(policy: &mut Policy, workers: &mut [TestWorker], key: &str) -> Decision {
        let mut candidates: Vec<Candidate<'_>> = workers
            .iter_mut()
            .enumerate()
            .map(|(i, w)| Candidate {
                worker_id: WorkerId(i as u64),
                num_in_flight: w.num_in_flight,
                tree: &mut w.tree,
            })
            .collect();
        policy.choose(&mut candidates, &chars(key)).expect("there are candidates")
    }

    /// A `cache_aware` policy with the default thresholds.
    fn cache_aware() -> Policy {
        Policy::new(PolicyKind::CacheAware, DEFAULT_THRESHOLDS)
    }

    #[test]
    fn a_match_above_the_threshold_goes_to_the_worker_holding_the_prefix() {
        let mut workers =
            test_workers(&[(0, &["unrelated text"]), (5, &["You are a helpful assistant. Hi"])]);
        let decision = choose(&mut cache_aware(), &mut workers, "You are a helpful assistant. Bye");
        assert_eq!(decision.candidate_index, 1);
        assert_eq!(decision.reason, RoutingReason::CacheHit);
        assert_eq!(decision.num_matched_chars, 29);
    }

    #[test]
    fn a_match_at_or_below_the_threshold_is_a_miss_that_goes_to_the_emptiest_tree() {
        // "abcd" matches 2 of 4 chars on worker 0: exactly 0.5 is not above the threshold.
        let mut workers = test_workers(&[(0, &["abxx"]), (3, &["zzzzzz"]), (3, &["q"])]);
        let decision = choose(&mut cache_aware(), &mut workers, "abcd");
        assert_eq!(decision.reason, RoutingReason::CacheMiss);
        assert_eq!(decision.candidate_index, 2);
    }

    #[test]
    fn a_miss_between_equal_trees_goes_to_the_lower_load_then_the_earlier_worker() {
        let mut workers = test_workers(&[(4, &[]), (2, &[]), (2, &[])]);
        let decision = choose(&mut cache_aware(), &mut workers, "fresh prompt");
        assert_eq!((decision.candidate_index, decision.reason), (1, RoutingReason::CacheMiss));
    }

    #[test]
    fn imbalanced_loads_go_to_the_least_loaded_worker_even_on_a_cache_hit() {
        let mut workers = test_workers(&[(100, &["shared system prompt"]), (10, &[])]);
        let decision = choose(&mut cache_aware(), &mut workers, "shared system prompt");
        assert_eq!((decision.candidate_index, decision.reason), (1, RoutingReason::Balance));
    }

    #[test]
    fn imbalance_needs_both_the_absolute_and_the_relative_threshold() {
        // 100 - 67 = 33 > 32, but 100 is not more than 67 * 1.5: still balanced.
        let mut workers = test_workers(&[(100, &["shared system prompt"]), (67, &[])]);
        let decision = choose(&mut cache_aware(), &mut workers, "shared system prompt");
        assert_eq!((decision.candidate_index, decision.reason), (0, RoutingReason::CacheHit));
        // 20 > 0 * 1.5, but 20 - 0 is not more than 32: still balanced.
        let mut workers = test_workers(&[(20, &["shared system prompt"]), (0, &[])]);
        let decision = choose(&mut cache_aware(), &mut workers, "shared system prompt");
        assert_eq!(decision.reason, RoutingReason::CacheHit);
    }

    #[test]
    fn the_routed_key_is_inserted_into_the_chosen_tree_so_a_repeat_is_a_hit() {
        let mut workers = test_workers(&[(0, &[]), (0, &[])]);
        let mut policy = cache_aware();
        let first = choose(&mut policy, &mut workers, "a long shared prefix, then more");
        assert_eq!(first.reason, RoutingReason::CacheMiss);
        assert_eq!(workers[first.candidate_index].tree.num_chars(), 31);
        let second = choose(&mut policy, &mut workers, "a long shared prefix, then other");
        assert_eq!(second.reason, RoutingReason::CacheHit);
        assert_eq!(second.candidate_index, first.candidate_index);
    }

    #[test]
    fn a_request_without_a_key_goes_to_the_least_loaded_worker_and_grows_no_tree() {
        let mut workers = test_workers(&[(3, &[]), (1, &[])]);
        let decision = choose(&mut cache_aware(), &mut workers, "");
        assert_eq!((decision.candidate_index, decision.reason), (1, RoutingReason::LeastLoad));
        assert_eq!(workers[1].tree.num_chars(), 0);
    }

    #[test]
    fn round_robin_cycles_through_the_workers_in_order() {
        let mut policy = Policy::new(PolicyKind::RoundRobin, DEFAULT_THRESHOLDS);
        let mut workers = test_workers(&[(9, &[]), (0, &[]), (0, &[])]);
        let chosen: Vec<usize> =
            (0..7).map(|_| choose(&mut policy, &mut workers, "same").candidate_index).collect();
        assert_eq!(chosen, [0, 1, 2, 0, 1, 2, 0]);
        assert!(workers.iter().all(|w| w.tree.num_chars() == 0));
    }

    #[test]
    fn round_robin_continues_after_the_last_worker_when_others_drop_out() {
        let mut policy = Policy::new(PolicyKind::RoundRobin, DEFAULT_THRESHOLDS);
        let mut trees: Vec<PrefixTree> = (0..3).map(|_| PrefixTree::new(10)).collect();
        let mut pick = |ids: &[u64], trees: &mut [PrefixTree]| {
            let mut candidates: Vec<Candidate<'_>> = trees
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| ids.contains(&(*i as u64)))
                .map(|(i, tree)| Candidate {
                    worker_id: WorkerId(i as u64),
                    num_in_flight: 0,
                    tree,
                })
                .collect();
            let decision = policy.choose(&mut candidates, &[]).expect("there are candidates");
            candidates[decision.candidate_index].worker_id
        };
        assert_eq!(pick(&[0, 1, 2], &mut trees), WorkerId(0));
        // Worker 1 is down: the turn passes to 2.
        assert_eq!(pick(&[0, 2], &mut trees), WorkerId(2));
        assert_eq!(pick(&[0, 1, 2], &mut trees), WorkerId(0));
        assert_eq!(pick(&[0, 1, 2], &mut trees), WorkerId(1));
    }

    #[test]
    fn least_load_picks_the_fewest_in_flight_and_the_earlier_worker_on_a_tie() {
        let mut policy = Policy::new(PolicyKind::LeastLoad, DEFAULT_THRESHOLDS);
        let mut workers = test_workers(&[(5, &["x"]), (2, &[]), (2, &[]), (7, &[])]);
        let decision = choose(&mut policy, &mut workers, "x");
        assert_eq!((decision.candidate_index, decision.reason), (1, RoutingReason::LeastLoad));
    }

    #[test]
    fn no_candidate_means_no_decision() {
        let mut policy = cache_aware();
        assert_eq!(policy.choose(&mut [], &chars("anything")), None);
    }

    #[test]
    fn policy_names_parse_and_unknown_ones_say_what_is_accepted() {
        assert_eq!("least_load".parse::<PolicyKind>(), Ok(PolicyKind::LeastLoad));
        let error = "random".parse::<PolicyKind>().unwrap_err();
        assert!(error.contains("cache_aware, round_robin or least_load"), "{error}");
    }
}
