//! A sequence as the scheduler sees it: one choice of a caller's request, with its stop
//! conditions, its ordering key and its state. Its tokens and blocks live in the
//! `KVCacheManager`, under the same `SequenceId`.

use std::cmp::Ordering;

use crate::kv_cache_manager::SequenceId;

/// The scheduler's handle for a caller's request, issued by `Scheduler::add_request` in
/// order (0, 1, 2, ...) and never reused. Every sequence of the request, every update and
/// every batch row names its request by this handle; the binding maps it back to the
/// caller's string id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestHandle(pub u64);

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token (or, from Python, a stop string).
    Stop,
    /// `max_tokens` or the model's `max_model_len` reached.
    Length,
    /// Aborted by the caller (e.g. the client disconnected).
    Abort,
    /// The sequence outgrew the whole KV cache: even alone it cannot get the blocks it
    /// needs, so retrying would loop forever.
    Capacity,
}

impl FinishReason {
    /// Every reason, in code order: `ALL[code - 1]` is the reason of `code`. Python sees
    /// their names as `pagedrs._core.FINISH_REASONS`.
    pub const ALL: [FinishReason; 4] =
        [FinishReason::Stop, FinishReason::Length, FinishReason::Abort, FinishReason::Capacity];

    /// The reason as one byte for columnar outputs: 1 + its index in `ALL`, so that 0 can
    /// mean "still running".
    pub fn code(self) -> u8 {
        match self {
            FinishReason::Stop => 1,
            FinishReason::Length => 2,
            FinishReason::Abort => 3,
            FinishReason::Capacity => 4,
        }
    }

    /// The reason of a code from `code` (`None` for 0 or an unknown code).
    pub fn from_code(code: u8) -> Option<Self> {
        Self::ALL.get(usize::from(code).checked_sub(1)?).copied()
    }

    /// The name Python sees (`"stop"`, `"length"`, `"abort"`, `"capacity"`).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Capacity => "capacity",
        }
    }

    /// Parses a name from `as_str`.
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "stop" => Some(FinishReason::Stop),
            "length" => Some(FinishReason::Length),
            "abort" => Some(FinishReason::Abort),
            "capacity" => Some(FinishReason::Capacity),
            _ => None,
        }
    }
}

/// Where a live sequence is in its life (a finished one is forgotten, its `FinishReason`
/// reported once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceStatus {
    /// Queued, never run.
    Waiting,
    /// Holding blocks and scheduled each step.
    Running,
    /// Was running, lost its blocks to a higher-priority sequence; queued to recompute.
    Preempted,
}

impl SequenceStatus {
    /// The name Python sees (`"waiting"`, `"running"`, `"preempted"`).
    pub fn as_str(self) -> &'static str {
        match self {
            SequenceStatus::Waiting => "waiting",
            SequenceStatus::Running => "running",
            SequenceStatus::Preempted => "preempted",
        }
    }
}

/// When to stop generating; checked by the core after every sampled token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopConditions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Fewest tokens to generate before EOS or a stop token may end the sequence.
    pub min_tokens: usize,
    /// The model's end-of-sequence token, if any.
    pub eos_token_id: Option<u32>,
    /// More tokens that end the sequence (kept in the output).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
}

impl Default for StopConditions {
    fn default() -> Self {
        StopConditions {
            max_tokens: 16,
            min_tokens: 0,
            eos_token_id: None,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
        }
    }
}

impl StopConditions {
    /// Whether generation ends after `token` became the `num_output_tokens`-th output
    /// token of a sequence that now holds `num_tokens` tokens.
    pub fn check(
        &self,
        token: u32,
        num_output_tokens: usize,
        num_tokens: usize,
        max_model_len: usize,
    ) -> Option<FinishReason> {
        if num_output_tokens >= self.min_tokens {
            let is_eos = !self.ignore_eos && self.eos_token_id == Some(token);
            if is_eos || self.stop_token_ids.contains(&token) {
                return Some(FinishReason::Stop);
            }
        }
        if num_output_tokens >= self.max_tokens || num_tokens >= max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }
}

/// Order of admission and (reversed) of preemption: lower priority value first, then
/// earlier arrival, then earlier `add_request` (or fork).
#[derive(Debug, Clone, Copy)]
pub struct QueueKey {
    /// Its request's priority (always 0 under FCFS).
    pub priority: i64,
    /// Caller-given arrival time.
    pub arrival_time: f64,
    /// Position in the order of `add_request` calls and forks; breaks every tie.
    pub arrival_order: u64,
}

impl PartialEq for QueueKey {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for QueueKey {}

impl PartialOrd for QueueKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for QueueKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then(self.arrival_time.total_cmp(&other.arrival_time))
            .then(self.arrival_order.cmp(&other.arrival_order))
    }
}

/// One sequence the scheduler runs: one choice of a caller's request. A request with
/// `n > 1` has one `Sequence` until its prompt is computed, then `n` (the parent is
/// choice 0, forks are choices 1..n).
#[derive(Debug, Clone)]
pub struct Sequence {
    /// Handle shared with the `KVCacheManager`.
    pub id: SequenceId,
    /// The caller's request this sequence is a choice of.
    pub request: RequestHandle,
    /// Which of the request's `n` choices this is.
    pub choice_index: usize,
    /// Choices still to be forked off when the prompt is done (`n - 1`, then 0).
    pub num_pending_forks: usize,
    /// Of those, the choices that hold a seat while the prompt runs (0 unless running; all
    /// of them unless a fair share cut the reservation). Forks past them are requeued as
    /// soon as they are forked.
    pub num_reserved_forks: usize,
    /// Where it sorts in the queues.
    pub key: QueueKey,
    /// Waiting, running or preempted.
    pub status: SequenceStatus,
    /// Prompt length in tokens.
    pub num_prompt_tokens: usize,
    /// Prompt plus generated tokens.
    pub num_tokens: usize,
    /// Tokens whose KV is computed (mirrors the manager, read on every step).
    pub num_computed_tokens: usize,
    /// When to stop.
    pub stop: StopConditions,
    /// Times this sequence was preempted.
    pub num_preemptions: u32,
}

impl Sequence {
    /// Tokens generated so far.
    pub fn num_output_tokens(&self) -> usize {
        self.num_tokens - self.num_prompt_tokens
    }
}

/// Live sequences indexed by their `SequenceId`'s slot: lookups are array accesses.
#[derive(Debug, Default)]
pub struct SequenceTable {
    /// Entry `i` holds the live sequence whose id has slot `i`, if any.
    entries: Vec<Option<Sequence>>,
    /// Live sequences.
    len: usize,
}

impl SequenceTable {
    /// The live sequence `id`, if it is live.
    pub fn get(&self, id: SequenceId) -> Option<&Sequence> {
        self.entries.get(id.index())?.as_ref().filter(|seq| seq.id == id)
    }

    /// The live sequence `id`, mutably.
    pub fn get_mut(&mut self, id: SequenceId) -> Option<&mut Sequence> {
        self.entries.get_mut(id.index())?.as_mut().filter(|seq| seq.id == id)
    }

    /// Whether `id` is live.
    pub fn contains(&self, id: SequenceId) -> bool {
        self.get(id).is_some()
    }

    /// Stores a sequence under its id's slot (which must be free).
    pub fn insert(&mut self, seq: Sequence) {
        let index = seq.id.index();
        if self.entries.len() <= index {
            self.entries.resize_with(index + 1, || None);
        }
        debug_assert!(self.entries[index].is_none(), "slot {index} taken");
        self.entries[index] = Some(seq);
        self.len += 1;
    }

    /// Takes a live sequence out.
    pub fn remove(&mut self, id: SequenceId) -> Option<Sequence> {
        self.get(id)?;
        self.len -= 1;
        self.entries[id.index()].take()
    }

    /// Number of live sequences.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no sequence is live.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Every live sequence, in slot order.
    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.entries.iter().flatten()
    }
}

impl std::ops::Index<SequenceId> for SequenceTable {
    type Output = Sequence;

    /// The live sequence `id`; the scheduler only indexes ids it knows are live.
    fn index(&self, id: SequenceId) -> &Sequence {
        self.get(id).expect("a live sequence id")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eos_stops_only_after_min_tokens_and_not_when_ignored() {
        let stop = StopConditions { eos_token_id: Some(2), min_tokens: 3, ..Default::default() };
        assert_eq!(stop.check(2, 2, 10, 100), None);
        assert_eq!(stop.check(2, 3, 10, 100), Some(FinishReason::Stop));
        let ignoring = StopConditions { ignore_eos: true, ..stop };
        assert_eq!(ignoring.check(2, 3, 10, 100), None);
    }

    #[test]
    fn length_ends_at_max_tokens_or_max_model_len() {
        let stop = StopConditions { max_tokens: 4, stop_token_ids: vec![9], ..Default::default() };
        assert_eq!(stop.check(1, 4, 10, 100), Some(FinishReason::Length));
        assert_eq!(stop.check(1, 1, 100, 100), Some(FinishReason::Length));
        assert_eq!(stop.check(9, 4, 10, 100), Some(FinishReason::Stop));
    }

    #[test]
    fn finish_codes_index_all_reasons_and_zero_means_running() {
        for (index, reason) in FinishReason::ALL.into_iter().enumerate() {
            assert_eq!(usize::from(reason.code()), index + 1);
            assert_eq!(FinishReason::from_code(reason.code()), Some(reason));
            assert_eq!(FinishReason::parse(reason.as_str()), Some(reason));
        }
        assert_eq!(FinishReason::from_code(0), None);
        assert_eq!(FinishReason::from_code(5), None);
    }

    #[test]
    fn queue_key_orders_by_priority_then_arrival_then_add_order() {
        let key = |priority, arrival_time, arrival_order| QueueKey {
            priority,
            arrival_time,
            arrival_order,
        };
        let mut keys = [key(1, 0.0, 0), key(0, 2.0, 1), key(0, 1.0, 3), key(0, 1.0, 2)];
        keys.sort();
        let order: Vec<u64> = keys.iter().map(|k| k.arrival_order).collect();
        assert_eq!(order, vec![2, 3, 1, 0]);
    }
}
