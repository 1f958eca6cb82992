"""The scheduler through the binding, driven by a fake model.

The fake model keeps a fake KV cache: each slot holds a fingerprint of the whole prefix
(tokens up to and including that position) whose key/value the slot would hold, in each KV
layer group. Before every step the test checks that every context slot a sequence attends to
(in a sliding group, those inside the window) holds exactly its own prefix, so prefix reuse,
preemption, copy-on-write, block tables and released out-of-window blocks are all checked
against a slow pure-Python recomputation of what the batch must be.
"""

import random

import numpy as np
import pytest

from pagedrs import DuplicateRequestError, InvalidArgumentError, Scheduler, StepUpdates, UnknownRequestError
from pagedrs._core import FINISH_REASONS
from tests.helpers.scheduler import make_scheduler


class FakeModel:
    """Tracks every sequence's tokens and checks each batch against them."""

    def __init__(
        self, scheduler: Scheduler, rng: random.Random, vocab: int = 8, windows: tuple[int | None, ...] = (None,)
    ):
        self.scheduler = scheduler
        self.windows = windows
        """The window of each KV layer group (the scheduler's ``kv_group_windows``)."""
        self.block_size = scheduler.block_size
        self.rng = rng
        self.vocab = vocab
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.computed: dict[tuple[str, int], int] = {}
        self.n: dict[str, int] = {}
        self.kv: list[dict[int, int]] = [{} for _ in windows]  # per group: slot -> fingerprint
        self.finished: dict[tuple[str, int], str] = {}
        self.unforked: set[str] = set()  # requests with n > 1 whose prompt is not done
        self.num_cached_tokens: dict[str, int] = {}  # as first reported, per request

    def add(self, request_id: str, prompt: list[int], n: int = 1, **kwargs) -> None:
        self.scheduler.add_request(request_id, prompt, n=n, **kwargs)
        self.tokens[(request_id, 0)] = list(prompt)
        self.computed[(request_id, 0)] = 0
        self.n[request_id] = n
        if n > 1:
            self.unforked.add(request_id)

    def forget(self, request_id: str) -> None:
        self.num_cached_tokens.pop(request_id, None)
        for key in [key for key in self.tokens if key[0] == request_id]:
            del self.tokens[key]
            del self.computed[key]

    def slot(self, table: np.ndarray, position: int) -> int:
        return int(table[position // self.block_size]) * self.block_size + position % self.block_size

    def step(self) -> list:
        out = self.scheduler.schedule()
        for request_id, index in out.preempted:
            self.computed[(request_id, index)] = 0
        # As in the runner: copy-on-write copies first, then every new key/value of the
        # batch is written, then attention reads. NOTE: a prefix hit may point at blocks
        # that another sequence of the same batch is computing; that is only correct
        # because all writes of a layer happen before its attention.
        assert out.slot_mapping.shape[0] == out.block_tables.shape[0] == len(self.windows)
        for src, dst in out.block_copies:
            for offset in range(self.block_size):
                src_slot = int(src) * self.block_size + offset
                for kv in self.kv:
                    if src_slot in kv:
                        kv[int(dst) * self.block_size + offset] = kv[src_slot]
        starts = self.starts(out)
        for row, position in enumerate(out.positions):
            key = self.row_owner(out, row)
            for kv, slots in zip(self.kv, out.slot_mapping):
                kv[int(slots[row])] = hash(tuple(self.tokens[key][: position + 1]))
        self.check_batch(out, starts)
        for row, request_id in enumerate(out.request_ids):
            self.computed[(request_id, int(out.choice_indices[row]))] += int(out.num_scheduled_tokens[row])
        sampled = np.array([self.rng.randrange(self.vocab) for _ in out.logits_indices], dtype=np.int64)
        updates = self.scheduler.update_from_output(sampled)
        check_columns(updates, out, sampled)
        self.check_num_cached_tokens(updates)
        self.apply(updates.to_list())
        self.scheduler.check_invariants()
        return updates

    def check_num_cached_tokens(self, updates: StepUpdates) -> None:
        """Each request reports one prefix hit, in whole blocks, on all its rows, whatever
        preemptions and recomputations came after its first step."""
        for request_id, num_cached in zip(updates.request_ids, updates.num_cached_tokens.tolist()):
            assert num_cached % self.block_size == 0
            assert self.num_cached_tokens.setdefault(request_id, num_cached) == num_cached

    def row_owner(self, out, token_row: int) -> tuple[str, int]:
        seq = int(np.searchsorted(out.query_start_loc, token_row, side="right")) - 1
        return out.request_ids[seq], int(out.choice_indices[seq])

    def starts(self, out) -> list[int]:
        """Where each scheduled sequence starts computing, from the Python bookkeeping."""
        starts = []
        for row, request_id in enumerate(out.request_ids):
            key = (request_id, int(out.choice_indices[row]))
            start = self.computed[key]
            if start == 0:
                # A fresh (or preempted) sequence may start from a cached prefix: whole
                # blocks, never its last token. The KV check proves the hit exact.
                start = int(out.positions[out.query_start_loc[row]])
                assert start % self.block_size == 0 and start < len(self.tokens[key])
                self.computed[key] = start
            starts.append(start)
        return starts

    def check_batch(self, out, starts: list[int]) -> None:
        """Recomputes every array of the batch from the Python-side bookkeeping."""
        expected_ids, expected_positions, expected_starts = [], [], [0]
        expected_logits = []
        for row, request_id in enumerate(out.request_ids):
            key = (request_id, int(out.choice_indices[row]))
            tokens, start = self.tokens[key], starts[row]
            count = int(out.num_scheduled_tokens[row])
            assert 0 < count and start + count <= len(tokens)
            expected_ids += tokens[start : start + count]
            expected_positions += range(start, start + count)
            expected_starts.append(expected_starts[-1] + count)
            assert out.context_lens[row] == start + count
            # Every slot the sequence attends to holds exactly its own prefix: in a sliding
            # group, from the window of its first query on.
            for kv, tables, window in zip(self.kv, out.block_tables, self.windows):
                first = 0 if window is None else max(0, start + 1 - window)
                for position in range(first, start + count):
                    assert kv.get(self.slot(tables[row], position)) == hash(tuple(tokens[: position + 1])), (
                        f"{key} position {position}: wrong KV in its block table (window {window})"
                    )
            if start + count == len(tokens):
                samples = self.n[request_id] if request_id in self.unforked else 1
                expected_logits += [expected_starts[-1] - 1] * samples
        assert out.input_token_ids.tolist() == expected_ids
        assert out.positions.tolist() == expected_positions
        assert out.query_start_loc.tolist() == (expected_starts if out.request_ids else [])
        assert out.logits_indices.tolist() == expected_logits
        assert out.num_batched_tokens == len(expected_ids) <= self.max_batched_tokens
        every_group = []
        for tables, group_slots in zip(out.block_tables, out.slot_mapping):
            slots = [self.slot(tables[self.row_of(out, i)], p) for i, p in enumerate(out.positions)]
            assert group_slots.tolist() == slots
            assert len(set(slots)) == len(slots), "two tokens written to one slot"
            every_group += slots
        assert len(set(every_group)) == len(every_group), "two groups write one block"

    def row_of(self, out, token_row: int) -> int:
        return int(np.searchsorted(out.query_start_loc, token_row, side="right")) - 1

    def apply(self, updates: list[tuple]) -> None:
        for request_id, index, token, reason in updates:
            key = (request_id, index)
            if request_id in self.unforked:  # choice 0's prompt is done: forks appear
                self.unforked.discard(request_id)
                parent = (request_id, 0)
                for child in range(1, self.n[request_id]):
                    self.tokens[(request_id, child)] = list(self.tokens[parent])
                    self.computed[(request_id, child)] = self.computed[parent]
            if token is not None:
                self.tokens[key].append(token)
            if reason is not None:
                self.finished[key] = reason
                del self.tokens[key]
                del self.computed[key]


def check_columns(updates: StepUpdates, out, sampled: np.ndarray) -> None:
    """The columns agree with ``to_list()``, and each token's logits row is the row of the
    last schedule that sampled it, for the same request and choice."""
    assert updates.choice_indices.dtype == np.int32 and updates.token_ids.dtype == np.int64
    assert updates.logits_rows.dtype == np.int32 and updates.finish_codes.dtype == np.uint8
    assert updates.num_cached_tokens.dtype == np.int64 and len(updates.num_cached_tokens) == len(updates)
    rows = list(
        zip(
            updates.request_ids,
            updates.choice_indices.tolist(),
            updates.token_ids.tolist(),
            updates.logits_rows.tolist(),
            updates.finish_codes.tolist(),
        )
    )
    assert len(updates) == len(rows) == len(updates.to_list())
    for (request_id, index, token, row, code), listed in zip(rows, updates.to_list()):
        reason = FINISH_REASONS[code - 1] if code else None
        assert listed == (request_id, index, None if token == -1 else token, reason)
        assert (token == -1) == (row == -1), "a token always comes from a logits row"
        if row != -1:
            assert token == sampled[row]
            assert out.request_ids[out.logits_request_indices[row]] == request_id
            assert out.logits_choice_indices[row] == index
    sampled_rows = sorted(row for *_, row, _ in rows if row != -1)
    assert sampled_rows == sorted(set(sampled_rows)), "one update per logits row at most"


@pytest.mark.parametrize("windows", [(None,), (None, 5), (None, 3, 9, None), (6,)])
def test_arrays_match_a_pure_python_recomputation_under_a_random_workload(windows):
    """One full KV layer group, and sliding groups that release blocks out of their window
    (with a full group, or alone)."""
    rng = random.Random(1234)
    scheduler = make_scheduler(
        16 * len(windows),
        kv_group_windows=list(windows),
        block_size=4,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        max_model_len=64,
        long_prefill_token_threshold=10,
        max_num_partial_prefills=2,
        scheduling_policy="priority",
    )
    model = FakeModel(scheduler, rng, windows=windows)
    model.max_batched_tokens = 24
    live: list[str] = []
    for step in range(600):
        if step < 450 and rng.random() < 0.3:
            request_id = f"r{step}"
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
            model.add(
                request_id,
                prompt,
                n=rng.choice([1, 1, 1, 2, 3]),
                max_tokens=rng.randrange(1, 30),
                eos_token_id=7,
                min_tokens=1,
                priority=rng.randrange(-1, 2),
                cache_salt=rng.choice([None, None, "tenant"]),
            )
            live.append(request_id)
        if live and rng.random() < 0.03:
            victim = live.pop(rng.randrange(len(live)))
            if any(key[0] == victim for key in model.tokens):
                scheduler.abort_request(victim)
                model.forget(victim)
        model.step()
    while scheduler.has_unfinished_requests():
        model.step()
    stats = scheduler.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_preemptions_total > 0, "memory was never tight"
    assert stats.prefix_cache_hits > 0
    assert set(model.finished.values()) >= {"stop", "length"}


def test_n_choices_share_the_prompt_and_copy_the_partial_block():
    scheduler = make_scheduler(32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request("r", [5, 6, 7, 8, 9, 10], n=3, max_tokens=3)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens.tolist() == [6]
    assert out.logits_indices.tolist() == [5, 5, 5]
    updates = scheduler.update_from_output(np.array([1, 2, 3])).to_list()
    assert sorted((index, token) for _, index, token, _ in updates) == [(0, 1), (1, 2), (2, 3)]
    out = scheduler.schedule()
    assert out.request_ids == ["r", "r", "r"]
    assert sorted(out.input_token_ids.tolist()) == [1, 2, 3]
    assert out.block_copies.shape == (2, 2)
    assert len(set(out.block_tables[0, :, 0].tolist())) == 1, "the full block is shared"
    assert len(set(out.block_tables[0, :, 1].tolist())) == 3, "partial blocks were copied"
    scheduler.update_from_output([4, 4, 4])
    out = scheduler.schedule()
    reasons = scheduler.update_from_output([0, 0, 0]).to_list()
    assert [reason for *_, reason in reasons] == ["length"] * 3
    assert scheduler.stats().num_used_blocks == 0


def test_output_arrays_are_the_cores_buffers_not_copies():
    scheduler = make_scheduler(8, block_size=4)
    scheduler.add_request("a", [1, 2, 3])
    out = scheduler.schedule()
    for name in ("input_token_ids", "positions", "slot_mapping", "block_tables", "logits_indices"):
        array = getattr(out, name)
        # numpy does not own the memory: the Rust vector the core filled does (PyO3's
        # container keeps it alive), and every read of the attribute is that same array.
        assert not array.flags.owndata and type(array.base).__name__ == "PySliceContainer", name
        assert getattr(out, name) is array


def test_stop_conditions_and_python_side_finish():
    scheduler = make_scheduler(16, block_size=4)
    scheduler.add_request("eos", [1, 2], eos_token_id=9, max_tokens=10)
    scheduler.add_request("stop-id", [1, 2], stop_token_ids=[7], max_tokens=10)
    scheduler.add_request("string", [1, 2], max_tokens=10)
    scheduler.schedule()
    assert scheduler.request_status("string") == "running"
    updates = scheduler.update_from_output([9, 7, 3]).to_list()
    assert [(rid, reason) for rid, _, _, reason in updates] == [
        ("eos", "stop"),
        ("stop-id", "stop"),
        ("string", None),
    ]
    scheduler.finish_request("string", "stop")
    assert not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert len(out) == 0
    assert len(scheduler.update_from_output([])) == 0, "the caller's own finish is not echoed"
    # Ended ids are forgotten: they can't be aborted any more, and can be used again.
    with pytest.raises(UnknownRequestError):
        scheduler.abort_request("eos")
    scheduler.add_request("eos", [4, 5], max_tokens=1)
    scheduler.schedule()
    assert scheduler.update_from_output([1]).to_list() == [("eos", 0, 1, "length")]


def test_request_too_big_for_the_cache_ends_with_capacity_not_a_hang():
    scheduler = make_scheduler(2, block_size=4)
    scheduler.add_request("huge", list(range(20)), max_tokens=5)
    scheduler.add_request("ok", [1], max_tokens=1)
    finished = {}
    assert scheduler.request_status("huge") == "waiting"
    for _ in range(5):
        out = scheduler.schedule()
        for rid, _, _, reason in scheduler.update_from_output([0] * len(out.logits_indices)).to_list():
            if reason:
                finished[rid] = reason
    assert finished == {"huge": "capacity", "ok": "length"}
    assert scheduler.stats().num_used_blocks == 0


def test_bad_input_raises_value_errors_and_leaves_the_scheduler_healthy():
    scheduler = make_scheduler(16, block_size=4, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add_request("good", [1, 2, 3], max_tokens=2)
    bad_calls = [
        lambda: scheduler.add_request("x", []),
        lambda: scheduler.add_request("x", [1] * 33),
        lambda: scheduler.add_request("x", [1], max_tokens=0),
        lambda: scheduler.add_request("x", [1], max_tokens=-3),
        lambda: scheduler.add_request("x", [1], min_tokens=5, max_tokens=2),
        lambda: scheduler.add_request("x", [1], n=5),
        lambda: scheduler.add_request("x", [-1]),
        lambda: scheduler.add_request("x", [1], eos_token_id=-2),
        lambda: scheduler.finish_request("good", "bored"),
        lambda: scheduler.finish_request("good", "stop", index=3),
        lambda: make_scheduler(0),
        lambda: make_scheduler(8, scheduling_policy="random"),
        lambda: make_scheduler(8, max_num_seqs=10, max_num_batched_tokens=5),
    ]
    for call in bad_calls:
        with pytest.raises(ValueError):
            call()
    with pytest.raises(DuplicateRequestError):
        scheduler.add_request("good", [1])
    with pytest.raises(UnknownRequestError):
        scheduler.abort_request("missing")
    with pytest.raises(TypeError):
        scheduler.add_request("x", "text")
    assert len(scheduler.schedule().logits_indices) == 1
    with pytest.raises(InvalidArgumentError, match="expected 1 sampled tokens"):
        scheduler.update_from_output([1, 2])
    # Nothing was queued by the failures, and the good request still runs to the end.
    assert scheduler.num_waiting + scheduler.num_running == 1
    scheduler.update_from_output([4])
    scheduler.schedule()
    assert scheduler.update_from_output(np.array([5], dtype=np.int32)).to_list()[0][3] == "length"
    assert scheduler.stats().num_used_blocks == 0


def test_step_updates_are_columns_that_name_each_tokens_logits_row():
    scheduler = make_scheduler(32, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    single, multi = "single", "multi"
    scheduler.add_request(single, [1, 2, 3], max_tokens=2)
    scheduler.add_request(multi, [4, 5, 6, 7, 8], n=3, max_tokens=1)
    out = scheduler.schedule()
    assert out.logits_indices.tolist() == [2, 7, 7, 7]
    assert out.logits_request_indices.tolist() == [0, 1, 1, 1]
    assert out.logits_choice_indices.dtype == np.int32
    assert out.logits_choice_indices.tolist() == [0, 0, 1, 2]
    sampled = np.array([10, 11, 12, 13])
    updates = scheduler.update_from_output(sampled)
    assert isinstance(updates, StepUpdates) and len(updates) == 4
    assert updates.request_ids[0] is single and updates.request_ids[1] is multi, "ids are not copied"
    assert updates.choice_indices.tolist() == [0, 0, 1, 2]
    assert updates.token_ids.tolist() == [10, 11, 12, 13]
    # The forks' tokens come from the rows after their parent's, in choice order.
    assert updates.logits_rows.tolist() == [0, 1, 2, 3]
    length = 1 + FINISH_REASONS.index("length")
    assert updates.finish_codes.tolist() == [0, length, length, length]
    assert updates.to_list() == [
        ("single", 0, 10, None),
        ("multi", 0, 11, "length"),
        ("multi", 1, 12, "length"),
        ("multi", 2, 13, "length"),
    ]
    check_columns(updates, out, sampled)
    # A sequence the scheduler ends itself gets no token: no logits row either.
    scheduler = make_scheduler(2, block_size=4)
    scheduler.add_request("huge", list(range(20)), max_tokens=5)
    scheduler.add_request("small", [1], max_tokens=3)
    out = scheduler.schedule()
    updates = scheduler.update_from_output([20] * len(out.logits_indices))
    assert updates.to_list() == [("huge", 0, None, "capacity"), ("small", 0, 20, None)]
    assert updates.token_ids.tolist() == [-1, 20] and updates.logits_rows.tolist() == [-1, 0]
    assert updates.finish_codes.tolist() == [1 + FINISH_REASONS.index("capacity"), 0]
    assert FINISH_REASONS == ("stop", "length", "abort", "capacity")


def test_a_finish_the_caller_decided_is_not_echoed():
    scheduler = make_scheduler(32, block_size=4)
    scheduler.add_request("r", [1, 2, 3], n=2, max_tokens=10)
    scheduler.add_request("other", [4, 5], max_tokens=10)
    out = scheduler.schedule()
    scheduler.update_from_output([0] * len(out.logits_indices))
    # Between steps: choice 1 ends, choice 0 runs on.
    scheduler.finish_request("r", "stop", index=1)
    out = scheduler.schedule()
    assert sorted(zip(out.request_ids, out.choice_indices.tolist())) == [("other", 0), ("r", 0)]
    updates = scheduler.update_from_output([0] * len(out.logits_indices)).to_list()
    assert sorted((rid, index) for rid, index, *_ in updates) == [("other", 0), ("r", 0)]
    assert all(reason is None for *_, reason in updates)
    # Between schedule and update: its sampled row is dropped, and nothing is reported.
    out = scheduler.schedule()
    scheduler.finish_request("r", "stop", index=0)
    updates = scheduler.update_from_output([0] * len(out.logits_indices))
    assert updates.request_ids == ["other"]
    with pytest.raises(UnknownRequestError):
        scheduler.request_status("r")
    scheduler.abort_request("other")
    assert not scheduler.has_unfinished_requests()
    scheduler.add_request("r", [1], max_tokens=1)  # the id is free again
    out = scheduler.schedule()
    assert scheduler.update_from_output([0] * len(out.logits_indices)).to_list() == [("r", 0, 0, "length")]
    assert scheduler.stats().num_used_blocks == 0


def run_to_end(scheduler: Scheduler) -> list[tuple[str, int, int]]:
    """Runs every request to its end; returns ``(request_id, choice, num_cached_tokens)`` per row."""
    rows = []
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        updates = scheduler.update_from_output([0] * len(out.logits_indices))
        rows += zip(updates.request_ids, updates.choice_indices.tolist(), updates.num_cached_tokens.tolist())
    return rows


def test_num_cached_tokens_reports_each_requests_prefix_hit_on_all_its_rows():
    scheduler = make_scheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(100, 118))  # 18 tokens: 4 full blocks can hit, never the last token
    scheduler.add_request("first", prompt, max_tokens=2)
    assert {cached for *_, cached in run_to_end(scheduler)} == {0}, "nothing was cached yet"
    scheduler.add_request("again", prompt, n=3, max_tokens=2)
    scheduler.add_request("fresh", list(range(500, 518)), max_tokens=2)
    rows = run_to_end(scheduler)
    again = sorted((choice, cached) for request_id, choice, cached in rows if request_id == "again")
    assert again == [(0, 16), (0, 16), (1, 16), (1, 16), (2, 16), (2, 16)]
    assert [cached for request_id, _, cached in rows if request_id == "fresh"] == [0, 0]
    assert scheduler.stats().num_used_blocks == 0


def test_a_prompt_one_short_of_max_model_len_generates_exactly_one_token():
    scheduler = make_scheduler(16, block_size=4, max_model_len=16, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add_request("full", list(range(15)), max_tokens=100)
    out = scheduler.schedule()
    assert out.positions.max() == 14
    assert scheduler.update_from_output([7]).to_list() == [("full", 0, 7, "length")]
    assert not scheduler.has_unfinished_requests()
    message = "the prompt has 16 tokens; max_model_len is 16 (prompt and output together, at least one output token)"
    with pytest.raises(ValueError) as error:
        scheduler.add_request("long", list(range(16)))
    assert str(error.value) == message
    with pytest.raises(InvalidArgumentError):
        scheduler.add_request("long", list(range(16)))
    assert not scheduler.has_unfinished_requests()


def test_a_prompt_logprobs_request_computes_its_whole_prompt_but_shares_its_blocks():
    scheduler = make_scheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    prompt = list(range(100, 118))
    scheduler.add_request("logprobs", prompt, max_tokens=1, prompt_logprobs=True)
    assert scheduler.schedule().num_scheduled_tokens.tolist() == [18]
    scheduler.update_from_output([0])
    scheduler.add_request("ordinary", prompt, max_tokens=1)
    assert scheduler.schedule().num_scheduled_tokens.tolist() == [2], "its blocks were cached"
    scheduler.update_from_output([0])
    scheduler.add_request("again", prompt, max_tokens=1, prompt_logprobs=True)
    out = scheduler.schedule()
    assert out.num_scheduled_tokens.tolist() == [18] and out.positions[0] == 0, "no cached prefix"
    scheduler.update_from_output([0])
    assert scheduler.stats().num_used_blocks == 0
