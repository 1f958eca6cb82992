//! The workers behind the router: their health, loads, prefix trees and counters, and the
//! routing policy over them. No I/O: the proxy and the health checker call in under one lock.
//!
//! Accounting: `route` counts a request in flight on the chosen worker and `finish` takes it
//! off again; the proxy's in-flight guard calls `finish` exactly once per `route`, when the
//! response ends or is dropped. A removed worker's requests finish without it.

use serde::Serialize;
use tokio::sync::watch;

use crate::policy::{Candidate, Policy, RoutingReason};
use crate::prefix_tree::PrefixTree;
use crate::worker::{WorkerId, WorkerUrl};

/// One worker in the pool.
#[derive(Debug)]
struct PoolWorker {
    /// Its id, increasing in registration order.
    id: WorkerId,
    /// Where it listens.
    url: WorkerUrl,
    /// Whether it takes requests; a worker that is down is skipped by routing.
    healthy: bool,
    /// Requests routed to it whose responses have not ended.
    num_in_flight: usize,
    /// Requests sent to it so far (retries count once per worker tried).
    num_requests: u64,
    /// The keys routed to it (empty unless the policy is cache-aware).
    tree: PrefixTree,
    /// Publishes `healthy`, so a request waiting for this worker's answer can give up on it
    /// the moment it is marked down.
    healthy_sender: watch::Sender<bool>,
}

/// A request's assignment to a worker, as `route` returns it.
#[derive(Debug)]
pub struct Dispatch {
    /// The chosen worker.
    pub worker_id: WorkerId,
    /// Where it listens.
    pub url: WorkerUrl,
    /// Why it was chosen.
    pub reason: RoutingReason,
    /// Chars of the routing key its tree held (for the debug log).
    pub num_matched_chars: usize,
    /// The worker's health from now on; `false` means it was marked down.
    pub healthy: watch::Receiver<bool>,
}

/// Misuse of the pool, reported to the caller rather than ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// `add` of a URL that is already in the pool.
    AlreadyRegistered(String),
    /// `remove` of a URL that is not in the pool.
    NotRegistered(String),
    /// `finish` of a worker with no request in flight (an accounting bug).
    NothingInFlight(WorkerId),
}

impl std::fmt::Display for PoolError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PoolError::AlreadyRegistered(url) => {
                write!(formatter, "worker {url} is already registered")
            }
            PoolError::NotRegistered(url) => write!(formatter, "worker {url} is not registered"),
            PoolError::NothingInFlight(id) => {
                write!(formatter, "worker {} has no request in flight to finish", id.0)
            }
        }
    }
}

impl std::error::Error for PoolError {}

/// One worker's state, as `/workers`, `/health` and `/metrics` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkerSnapshot {
    /// The worker's base URL.
    pub url: String,
    /// Whether it takes requests.
    pub healthy: bool,
    /// Requests in flight to it.
    pub in_flight: usize,
    /// Chars in its prefix tree.
    pub tree_chars: usize,
    /// Requests sent to it so far.
    pub requests_routed: u64,
}

/// The whole pool's state and counters at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSnapshot {
    /// Every worker, in registration order.
    pub workers: Vec<WorkerSnapshot>,
    /// Decisions made so far, per reason, in [`RoutingReason::ALL`] order.
    pub num_decisions_per_reason: Vec<(RoutingReason, u64)>,
    /// Requests sent again to another worker after a failure.
    pub num_retries: u64,
}

/// The workers and the policy that routes over them.
#[derive(Debug)]
pub struct WorkerPool {
    /// Registered workers, in registration (increasing id) order.
    workers: Vec<PoolWorker>,
    /// The id the next registered worker gets.
    next_worker_id: u64,
    /// The routing policy.
    policy: Policy,
    /// The cap on each worker's tree, in chars.
    max_tree_chars: usize,
    /// Decisions made so far, indexed like [`RoutingReason::ALL`].
    num_decisions_per_reason: [u64; RoutingReason::ALL.len()],
    /// Requests sent again to another worker after a failure.
    num_retries: u64,
}

impl WorkerPool {
    /// An empty pool routing by `policy`, with trees of at most `max_tree_chars` chars.
    pub fn new(policy: Policy, max_tree_chars: usize) -> Self {
        WorkerPool {
            workers: Vec::new(),
            next_worker_id: 0,
            policy,
            max_tree_chars,
            num_decisions_per_reason: [0; RoutingReason::ALL.len()],
            num_retries: 0,
        }
    }

    /// Registers a worker at `url`, healthy until a check or a failed request says otherwise.
    pub fn add(&mut self, url: WorkerUrl) -> Result<WorkerId, PoolError> {
        if self.workers.iter().any(|worker| worker.url == url) {
            return Err(PoolError::AlreadyRegistered(url.to_string()));
        }
        let id = WorkerId(self.next_worker_id);
        self.next_worker_id += 1;
        self.workers.push(PoolWorker {
            id,
            url,
            healthy: true,
            num_in_flight: 0,
            num_requests: 0,
            tree: PrefixTree::new(self.max_tree_chars),
            healthy_sender: watch::Sender::new(true),
        });
        Ok(id)
    }

    /// Unregisters the worker at `url`; its requests in flight run to their end.
    pub fn remove(&mut self, url: &WorkerUrl) -> Result<WorkerId, PoolError> {
        let Some(index) = self.workers.iter().position(|worker| worker.url == *url) else {
            return Err(PoolError::NotRegistered(url.to_string()));
        };
        Ok(self.workers.remove(index).id)
    }

    /// Picks a healthy worker not in `tried` for a request with routing key `key` (empty:
    /// none), and counts the request in flight there. `None` when no worker is eligible.
    pub fn route(&mut self, key: &[char], tried: &[WorkerId]) -> Option<Dispatch> {
        let mut candidates: Vec<Candidate<'_>> = self
            .workers
            .iter_mut()
            .filter(|worker| worker.healthy && !tried.contains(&worker.id))
            .map(|worker| Candidate {
                worker_id: worker.id,
                num_in_flight: worker.num_in_flight,
                tree: &mut worker.tree,
            })
            .collect();
        let decision = self.policy.choose(&mut candidates, key)?;
        let worker_id = candidates[decision.candidate_index].worker_id;
        let reason_index = RoutingReason::ALL
            .iter()
            .position(|&reason| reason == decision.reason)
            .expect("ALL lists every reason");
        self.num_decisions_per_reason[reason_index] += 1;
        let worker = self.worker_mut(worker_id).expect("a candidate is registered");
        worker.num_in_flight += 1;
        worker.num_requests += 1;
        Some(Dispatch {
            worker_id,
            url: worker.url.clone(),
            reason: decision.reason,
            num_matched_chars: decision.num_matched_chars,
            healthy: worker.healthy_sender.subscribe(),
        })
    }

    /// Ends one request routed to `worker_id` (nothing to do if the worker was removed).
    pub fn finish(&mut self, worker_id: WorkerId) -> Result<(), PoolError> {
        let Some(worker) = self.worker_mut(worker_id) else {
            return Ok(());
        };
        worker.num_in_flight =
            worker.num_in_flight.checked_sub(1).ok_or(PoolError::NothingInFlight(worker_id))?;
        Ok(())
    }

    /// Marks `worker_id` up or down and returns whether that changed anything (`false` also
    /// for a removed worker). A worker marked down loses its tree: it was most likely
    /// restarted, with an empty cache.
    pub fn set_healthy(&mut self, worker_id: WorkerId, healthy: bool) -> bool {
        let Some(worker) = self.worker_mut(worker_id) else {
            return false;
        };
        if worker.healthy == healthy {
            return false;
        }
        worker.healthy = healthy;
        worker.healthy_sender.send_replace(healthy);
        if !healthy {
            worker.tree.clear();
        }
        true
    }

    /// Counts one request sent again after a failure.
    pub fn record_retry(&mut self) {
        self.num_retries += 1;
    }

    /// Every registered worker, for the health checker.
    pub fn workers(&self) -> Vec<(WorkerId, WorkerUrl)> {
        self.workers.iter().map(|worker| (worker.id, worker.url.clone())).collect()
    }

    /// The pool's state and counters now.
    pub fn snapshot(&self) -> PoolSnapshot {
        PoolSnapshot {
            workers: self
                .workers
                .iter()
                .map(|worker| WorkerSnapshot {
                    url: worker.url.to_string(),
                    healthy: worker.healthy,
                    in_flight: worker.num_in_flight,
                    tree_chars: worker.tree.num_chars(),
                    requests_routed: worker.num_requests,
                })
                .collect(),
            num_decisions_per_reason: RoutingReason::ALL
                .iter()
                .copied()
                .zip(self.num_decisions_per_reason)
                .collect(),
            num_retries: self.num_retries,
        }
    }

    /// The registered worker `worker_id`, if it still is.
    fn worker_mut(&mut self, worker_id: WorkerId) -> Option<&mut PoolWorker> {
        self.workers.iter_mut().find(|worker| worker.id == worker_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{CacheAwareThresholds, PolicyKind};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    /// The thresholds the command line defaults to.
    const DEFAULT_THRESHOLDS: CacheAwareThresholds = CacheAwareThresholds {
        cache_threshold: 0.5,
        balance_abs_threshold: 32,
        balance_rel_threshold: 1.5,
    };

    /// A pool over `policy` with trees capped at `max_tree_chars`.
    fn pool(policy: PolicyKind, max_tree_chars: usize) -> WorkerPool {
        WorkerPool::new(Policy::new(policy, DEFAULT_THRESHOLDS), max_tree_chars)
    }

    /// The URL of test worker `n`.
    fn url(n: usize) -> WorkerUrl {
        WorkerUrl::parse(&format!("http://127.0.0.1:{}", 9000 + n)).unwrap()
    }

    /// `text` as a routing key.
    fn chars(text: &str) -> Vec<char> {
        text.chars().collect()
    }

    #[test]
    fn a_worker_cannot_be_added_twice_or_removed_when_absent() {
        let mut pool = pool(PolicyKind::CacheAware, 100);
        pool.add(url(0)).unwrap();
        assert_eq!(pool.add(url(0)), Err(PoolError::AlreadyRegistered(url(0).to_string())));
        assert_eq!(pool.remove(&url(1)), Err(PoolError::NotRegistered(url(1).to_string())));
    }

    #[test]
    fn routing_counts_the_request_in_flight_until_it_finishes() {
        let mut pool = pool(PolicyKind::CacheAware, 100);
        let id = pool.add(url(0)).unwrap();
        let dispatch = pool.route(&chars("prompt"), &[]).unwrap();
        assert_eq!(dispatch.worker_id, id);
        assert_eq!(pool.snapshot().workers[0].in_flight, 1);
        assert_eq!(pool.snapshot().workers[0].tree_chars, 6);
        pool.finish(id).unwrap();
        assert_eq!(pool.snapshot().workers[0].in_flight, 0);
        assert_eq!(pool.finish(id), Err(PoolError::NothingInFlight(id)));
    }

    #[test]
    fn a_worker_marked_down_is_skipped_loses_its_tree_and_tells_its_requests() {
        let mut pool = pool(PolicyKind::CacheAware, 100);
        let down_id = pool.add(url(0)).unwrap();
        let up_id = pool.add(url(1)).unwrap();
        let dispatch = pool.route(&chars("prompt"), &[]).unwrap();
        assert_eq!(dispatch.worker_id, down_id);
        assert!(pool.set_healthy(down_id, false));
        assert!(!pool.set_healthy(down_id, false), "no change the second time");
        assert!(!*dispatch.healthy.borrow());
        assert_eq!(pool.snapshot().workers[0].tree_chars, 0);
        assert_eq!(pool.route(&chars("prompt"), &[]).unwrap().worker_id, up_id);
        assert_eq!(pool.route(&chars("prompt"), &[up_id]).map(|d| d.worker_id), None);
    }

    #[test]
    fn a_removed_workers_requests_finish_without_it() {
        let mut pool = pool(PolicyKind::LeastLoad, 100);
        let id = pool.add(url(0)).unwrap();
        pool.route(&[], &[]).unwrap();
        pool.remove(&url(0)).unwrap();
        assert_eq!(pool.finish(id), Ok(()));
        assert!(pool.snapshot().workers.is_empty());
        // Added again, it is a new worker with a new id.
        assert_ne!(pool.add(url(0)).unwrap(), id);
    }

    #[test]
    fn decisions_and_retries_are_counted_per_reason() {
        let mut pool = pool(PolicyKind::CacheAware, 100);
        pool.add(url(0)).unwrap();
        pool.route(&chars("abc"), &[]).unwrap();
        pool.route(&chars("abc"), &[]).unwrap();
        pool.route(&[], &[]).unwrap();
        pool.record_retry();
        let snapshot = pool.snapshot();
        let count = |reason| {
            snapshot.num_decisions_per_reason.iter().find(|(r, _)| *r == reason).unwrap().1
        };
        assert_eq!(count(RoutingReason::CacheMiss), 1);
        assert_eq!(count(RoutingReason::CacheHit), 1);
        assert_eq!(count(RoutingReason::LeastLoad), 1);
        assert_eq!(snapshot.num_retries, 1);
        assert_eq!(snapshot.workers[0].requests_routed, 3);
    }

    #[test]
    fn random_requests_always_go_to_a_live_untried_worker_while_workers_come_and_go() {
        let mut rng = SmallRng::seed_from_u64(2024);
        for policy in [PolicyKind::CacheAware, PolicyKind::RoundRobin, PolicyKind::LeastLoad] {
            let mut pool = pool(policy, 24);
            // The worker of each routed request not finished yet, and their count per worker.
            let mut outstanding: Vec<WorkerId> = Vec::new();
            let mut worker_to_num_outstanding: HashMap<WorkerId, usize> = HashMap::new();
            let mut registered: Vec<(usize, WorkerId)> = Vec::new();
            let mut healthy: Vec<WorkerId> = Vec::new();
            for step in 0..40_000 {
                match rng.gen_range(0..100) {
                    0..=2 => {
                        let n = rng.gen_range(0..6);
                        if let Ok(id) = pool.add(url(n)) {
                            registered.push((n, id));
                            healthy.push(id);
                        }
                    }
                    3..=4 if !registered.is_empty() => {
                        let (n, id) = registered.remove(rng.gen_range(0..registered.len()));
                        assert_eq!(pool.remove(&url(n)), Ok(id));
                        healthy.retain(|&h| h != id);
                    }
                    5..=14 if !registered.is_empty() => {
                        let (_, id) = registered[rng.gen_range(0..registered.len())];
                        let up = rng.gen_bool(0.5);
                        let changed = pool.set_healthy(id, up);
                        assert_eq!(changed, healthy.contains(&id) != up);
                        healthy.retain(|&h| h != id);
                        if up {
                            healthy.push(id);
                        }
                    }
                    15..=59 if !outstanding.is_empty() => {
                        let worker_id =
                            outstanding.swap_remove(rng.gen_range(0..outstanding.len()));
                        pool.finish(worker_id).unwrap();
                        *worker_to_num_outstanding.get_mut(&worker_id).unwrap() -= 1;
                    }
                    _ => {
                        let key: Vec<char> = (0..rng.gen_range(0..8))
                            .map(|_| ['x', 'y', 'ü'][rng.gen_range(0..3)])
                            .collect();
                        let tried: Vec<WorkerId> =
                            healthy.iter().copied().filter(|_| rng.gen_bool(0.2)).collect();
                        let eligible: Vec<WorkerId> =
                            healthy.iter().copied().filter(|id| !tried.contains(id)).collect();
                        match pool.route(&key, &tried) {
                            Some(dispatch) => {
                                assert!(eligible.contains(&dispatch.worker_id), "step {step}");
                                assert!(*dispatch.healthy.borrow());
                                outstanding.push(dispatch.worker_id);
                                *worker_to_num_outstanding
                                    .entry(dispatch.worker_id)
                                    .or_default() += 1;
                            }
                            None => assert!(eligible.is_empty(), "step {step}: refused"),
                        }
                    }
                }
                let snapshot = pool.snapshot();
                for (worker, &(_, id)) in snapshot.workers.iter().zip(&registered) {
                    let expected = worker_to_num_outstanding.get(&id).copied().unwrap_or(0);
                    assert_eq!(worker.in_flight, expected, "step {step}");
                    assert_eq!(worker.healthy, healthy.contains(&id));
                    assert!(worker.tree_chars <= 24);
                }
                assert_eq!(snapshot.workers.len(), registered.len());
            }
        }
    }
}
