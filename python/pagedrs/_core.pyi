"""Type stubs for the compiled core (``pagedrs._core``). Import these names from ``pagedrs``."""

from typing import final

import numpy as np
import numpy.typing as npt

from pagedrs.config import EngineConfig
from pagedrs.spec_decode import SpeculativeConfig

__all__ = [
    "GrammarMatchers",
    "KVCacheManager",
    "KVCacheStats",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
    "StepUpdates",
    "FINISH_REASONS",
    "MAX_SPECULATIVE_TOKENS",
    "__version__",
]

__version__: str

@final
class KVCacheStats:
    """A snapshot of the KV cache counters."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one request."""
    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable cached prefix."""
    @property
    def num_free_blocks(self) -> int:
        """Blocks referenced by no request (cached-free ones included)."""
    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache."""
    @property
    def prefix_cache_hits(self) -> int:
        """Prompt tokens found cached."""
    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted for reuse."""

@final
class KVCacheManager:
    """Block tables of live requests over a pool of ``num_blocks`` blocks of ``block_size``
    token slots, with exact prefix caching (keyed by ``namespace`` and each request's
    ``cache_salt``).

    Raises ``InvalidArgumentError`` (a ``ValueError``) for ``num_blocks`` or ``block_size``
    below 1.
    """

    def __new__(
        cls,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: str = "",
    ) -> KVCacheManager: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def num_requests(self) -> int: ...
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (cached-free blocks count as free)."""
    def stats(self) -> KVCacheStats: ...
    def __contains__(self, request_id: str, /) -> bool: ...
    def add_request(self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None = None) -> None:
        """Registers a request. Raises ``DuplicateRequestError`` for a live id and
        ``InvalidArgumentError`` for an empty prompt or a token id outside [0, 2**32)."""
    def append_token_ids(self, request_id: str, token_ids: list[int]) -> None:
        """Appends sampled tokens to the request's known tokens."""
    def get_computed_blocks(self, request_id: str) -> tuple[list[int], int]:
        """Finds the request's cached prefix (full blocks, never its last token): returns the
        hit blocks and the number of cached tokens. The next ``allocate_slots`` claims them."""
    def allocate_slots(self, request_id: str, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Reserves slots for the next ``num_new_tokens`` tokens (after the computed ones and
        the prefix hit), marks them computed and caches the full blocks they fill.

        Returns the ``(src, dst)`` block copies (copy-on-write) to do before the forward
        pass, or ``None`` when there are not enough free blocks (nothing changes then)."""
    def free(self, request_id: str) -> None:
        """Releases the request's blocks (tail first) and forgets it. Raises
        ``UnknownRequestError`` (a ``KeyError``) if it is not live, e.g. freed twice."""
    def fork(self, parent_id: str, child_id: str) -> None:
        """Makes ``child_id`` share all of ``parent_id``'s blocks (for ``n > 1``)."""
    def block_table(self, request_id: str) -> list[int]: ...
    def num_computed_tokens(self, request_id: str) -> int: ...
    def check_invariants(self) -> None:
        """Raises ``InternalError`` if the block pool is inconsistent."""
    def _force_hash_collisions(self, bits: int) -> None:
        """Test hook: keep only ``bits`` bits of each block key, forcing collisions."""

@final
class SchedulerOutput:
    """One step's batch. Arrays are fresh numpy arrays (``torch.from_numpy`` shares them)."""

    @property
    def request_ids(self) -> list[str]:
        """Request id of each scheduled sequence, in batch order."""
    @property
    def choice_indices(self) -> npt.NDArray[np.int32]:
        """Choice index (0..n-1) of each scheduled sequence. ``[num_seqs]``"""
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]:
        """Tokens each sequence computes this step. ``[num_seqs]``"""
    @property
    def input_token_ids(self) -> npt.NDArray[np.int64]:
        """Token ids of all sequences, concatenated. ``[num_batched_tokens]``"""
    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """Position of each input token in its sequence. ``[num_batched_tokens]``"""
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]:
        """KV cache slot (``block * block_size + offset``) of each new key/value, in each KV
        layer group. ``[num_kv_groups, num_batched_tokens]``"""
    @property
    def query_start_loc(self) -> npt.NDArray[np.int32]:
        """Start of each sequence's tokens in the inputs, plus the total. ``[num_seqs + 1]``"""
    @property
    def context_lens(self) -> npt.NDArray[np.int32]:
        """Tokens each sequence attends to, this step's included. ``[num_seqs]``"""
    @property
    def prompt_lens(self) -> npt.NDArray[np.int32]:
        """Prompt length of each sequence's request. ``[num_seqs]``"""
    @property
    def block_tables(self) -> npt.NDArray[np.int32]:
        """Block tables of each KV layer group, zero-padded past each row's blocks (and zero
        where a sliding group released a block out of its window).
        ``[num_kv_groups, num_seqs, max_blocks]``"""
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]:
        """Input rows to sample from; a prompt with ``n > 1`` appears ``n`` times."""
    @property
    def logits_request_indices(self) -> npt.NDArray[np.int32]:
        """For each logits row, its sequence's row in ``request_ids``. ``[num_logits]``"""
    @property
    def logits_choice_indices(self) -> npt.NDArray[np.int32]:
        """For each logits row, the choice (0..n-1) its token goes to: the ``n`` rows of a
        prompt with ``n > 1`` are for choices ``0..n-1``, in order. ``[num_logits]``"""
    @property
    def logits_draft_token_ids(self) -> npt.NDArray[np.int64]:
        """For each logits row, the proposed token it verifies; -1 where none (a bonus row, or
        no speculation). ``[num_logits]``"""
    @property
    def num_draft_tokens(self) -> npt.NDArray[np.int32]:
        """Proposed tokens of each sequence: the last of its ``num_scheduled_tokens``
        (placeholders 0 under the ``draft_model`` method, for the caller to fill). ``[num_seqs]``"""
    @property
    def block_copies(self) -> npt.NDArray[np.int64]:
        """Copy-on-write ``(src, dst)`` block copies to do before the forward pass. ``[k, 2]``"""
    @property
    def num_seqs(self) -> int: ...
    @property
    def num_batched_tokens(self) -> int: ...
    @property
    def num_prefill_tokens(self) -> int: ...
    @property
    def num_decode_tokens(self) -> int: ...
    @property
    def num_spec_tokens(self) -> int:
        """Proposed tokens in the batch."""
    @property
    def preempted(self) -> list[tuple[str, int]]:
        """``(request_id, choice_index)`` of sequences preempted while building this batch."""
    def __len__(self) -> int: ...

@final
class SchedulerStats:
    """A snapshot of the scheduler's counters."""

    num_running: int
    num_waiting: int
    num_preempted_waiting: int
    num_preemptions_total: int
    num_fair_share_requeues_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_used_blocks: int
    num_cached_free_blocks: int
    num_blocks: int
    num_evictions: int
    kv_cache_usage: float
    step_num_prefill_tokens: int
    step_num_decode_tokens: int
    num_prefill_tokens_total: int
    num_generated_tokens_total: int
    num_drafts_total: int
    num_draft_tokens_total: int
    num_accepted_tokens_total: int
    num_accepted_tokens_per_pos: list[int]
    """`MAX_SPECULATIVE_TOKENS` entries: accepted proposals by position in the proposal."""

MAX_SPECULATIVE_TOKENS: int
"""The most tokens a sequence may propose per step (``num_speculative_tokens``' limit)."""

FINISH_REASONS: tuple[str, ...]
"""``("stop", "length", "abort", "capacity")``: ``StepUpdates.finish_codes`` code ``c > 0``
is ``FINISH_REASONS[c - 1]``."""

_UpdateRow = tuple[str, int, int | None, str | None]
"""``(request_id, choice_index, new_token_id, finish_reason)``; ``finish_reason`` is one of
``"stop"``, ``"length"``, ``"capacity"`` or ``None``."""

@final
class StepUpdates:
    """What ``update_from_output`` did, as columns of ``k`` rows: first the sequences
    ``schedule`` ended on its own (no token), then one row per token appended, in
    logits-row order (a speculating sequence may get several rows, in order). Finishes the
    caller decided (``abort_request``, ``finish_request``) are never reported. The engine
    reads the columns; ``to_list()`` is for tests and debugging."""

    @property
    def request_ids(self) -> list[str]:
        """Request id of each row (the very string given to ``add_request``)."""
    @property
    def choice_indices(self) -> npt.NDArray[np.int32]:
        """Choice index (0..n-1) of each row. ``[k]``"""
    @property
    def token_ids(self) -> npt.NDArray[np.int64]:
        """The token appended this step; -1 where none. ``[k]``"""
    @property
    def logits_rows(self) -> npt.NDArray[np.int32]:
        """Row of ``sampled_token_ids`` (and of the last schedule's ``logits_indices``) the
        token came from, to index the sampler's other outputs (logprobs); -1 where the
        sequence got no token (``schedule`` ended it, e.g. for capacity). ``[k]``"""
    @property
    def finish_codes(self) -> npt.NDArray[np.uint8]:
        """0 while running, else ``1 + FINISH_REASONS.index(reason)``. ``[k]``"""
    @property
    def num_cached_tokens(self) -> npt.NDArray[np.int64]:
        """Prompt tokens of the row's request served from the prefix cache (whole blocks),
        found when the request was first scheduled: the same on every row of a request,
        whatever its choice, and never changed by preemption or recomputation; 0 for a
        request never scheduled (ended for capacity while waiting). vLLM's
        ``RequestOutput.num_cached_tokens``. ``[k]``"""
    def __len__(self) -> int: ...
    def to_list(self) -> list[_UpdateRow]:
        """The rows as ``(request_id, choice_index, token | None, reason | None)`` tuples."""

@final
class Scheduler:
    """The per-step scheduler: continuous batching, chunked prefill, preemption.

    Each step: ``out = schedule()``, run the model on ``out``'s arrays, sample one token per
    ``out.logits_indices`` row, then ``update_from_output(tokens)`` (always, even for an
    empty batch). Raises ``InvalidArgumentError`` (a ``ValueError``) for a bad setting.
    """

    def __new__(
        cls,
        config: EngineConfig,
        *,
        num_blocks: int,
        max_model_len: int,
        namespace: str = "",
        speculative: SpeculativeConfig | None = None,
        kv_group_windows: list[int | None] | None = None,
    ) -> Scheduler:
        """Reads these attributes of ``config`` (any object that has them): ``block_size``,
        ``max_num_batched_tokens``, ``max_num_seqs``, ``scheduling_policy`` (``"fcfs"`` or
        ``"priority"``), ``enable_prefix_caching``, ``long_prefill_token_threshold``,
        ``max_num_partial_prefills`` and ``max_seqs_per_request`` (``None``: no fair share).

        - ``num_blocks``: KV blocks in the cache; ``max_model_len``: the longest sequence,
          prompt and output together;
        - ``namespace``: the model's identity, keying the prefix cache;
        - ``speculative``: ``None`` (off), or an object with the attributes of
          `pagedrs.spec_decode.SpeculativeConfig` (``method``: ``"ngram"``, ``"suffix"``, or
          ``"draft_model"``, whose proposals the caller writes into the batch), its defaults resolved:
          ``prompt_lookup_min``/``prompt_lookup_max`` ints (as ``SpeculativeConfig.parse``
          leaves them), ``disable_by_batch_size`` the device's (``None`` or 0: never steps
          aside);
        - ``kv_group_windows``: the window of each KV layer group (``None``: full
          attention), group 0 first and full attention when there are several; each group
          has its own block table per sequence over the one pool, and a sliding group
          releases the blocks that fall out of its window. Default: one full group.
        """
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        max_tokens: int = 16,
        min_tokens: int = 0,
        eos_token_id: int | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        n: int = 1,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        speculate: bool = True,
        prompt_logprobs: bool = False,
    ) -> None:
        """Queues a request.

        - ``speculate``: whether its choices may propose tokens when the scheduler speculates;
        - ``prompt_logprobs``: the caller needs every prompt position's logits, so the request
          takes no cached prefix and computes its whole prompt (its blocks are still cached
          for the requests after it).

        ``DuplicateRequestError`` for a live id; ``InvalidArgumentError``
        (a ``ValueError``) for an empty prompt, one that leaves no room for output,
        ``max_tokens < 1``, ``min_tokens > max_tokens`` or ``n`` outside ``[1, max_num_seqs]``.

        The length rule: prompt and output together hold at most ``max_model_len`` tokens and
        the output at least one, so a prompt may have up to ``max_model_len - 1`` tokens;
        generation ends with ``"length"`` when the sequence reaches ``max_model_len`` tokens."""
    def abort_request(self, request_id: str) -> None:
        """Ends the request and all its choices now, freeing every block."""
    def finish_request(self, request_id: str, reason: str = "stop", index: int = 0) -> None:
        """Ends one choice for a reason the caller decided (e.g. a stop string matched),
        freeing its blocks. Not reported back: ``update_from_output`` says nothing more of
        this choice. ``reason`` must be one of ``FINISH_REASONS``."""
    def schedule(self) -> SchedulerOutput: ...
    def update_from_output(
        self,
        sampled_token_ids: npt.NDArray[np.integer] | list[int],
        draft_token_ids: npt.NDArray[np.integer] | list[int] | None = None,
    ) -> StepUpdates:
        """Appends one sampled token per ``logits_indices`` row of the last ``schedule`` (row
        ``i`` goes to choice ``logits_choice_indices[i]`` of sequence
        ``logits_request_indices[i]``), applies stop conditions, frees what finished. A
        speculating sequence gets the rows that sampled their proposal, then one more (one
        update row per token). ``draft_token_ids``: the proposals the caller wrote into the
        batch (``draft_model`` method), in row order. ``InvalidArgumentError`` when a count does not
        match."""
    def request_status(self, request_id: str, index: int = 0) -> str:
        """``"waiting"``, ``"running"`` or ``"preempted"``; ``UnknownRequestError`` once the
        request has ended, ``InvalidArgumentError`` once that choice has."""
    def held_blocks(self, request_id: str, index: int = 0) -> list[int]:
        """Blocks one choice of a live request holds in each KV layer group."""
    @property
    def num_kv_groups(self) -> int:
        """KV layer groups (the leading dimension of a step's ``slot_mapping`` and
        ``block_tables``)."""
    def has_unfinished_requests(self) -> bool: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    def stats(self) -> SchedulerStats: ...
    def check_invariants(self) -> None:
        """Raises ``InternalError`` if the scheduler or its KV cache is inconsistent."""

@final
class GrammarMatchers:
    """Structured-output state for every constrained sequence of an engine: compiled
    grammars (cached by kind and spec) and one matcher per sequence, over llguidance.

    ``token_bytes[i]`` is the text token ``i`` stands for (``pagedrs.structured_vocab.
    token_bytes(tokenizer)``); ``b""`` for special tokens, which a grammar never produces.
    Ids from ``len(token_bytes)`` up to ``vocab_size`` (the model's logits width: padding)
    are never allowed. ``eos_token_id`` never stands for text: it is allowed exactly where
    the output may end. At most ``max_cached_grammars`` compiled grammars are kept (least
    recently used dropped first; live matchers are unaffected).

    JSON output is compact: no whitespace outside strings, ``,`` between items and ``:``
    after keys (``json.dumps(value, separators=(",", ":"))``). ``oneOf`` is compiled as
    ``anyOf``. Raises ``InvalidArgumentError`` (a ``ValueError``) for a bad vocabulary.

    Not thread-safe: one thread at a time (a call while ``fill_bitmask`` runs on another
    thread raises ``RuntimeError``).
    """

    def __new__(
        cls,
        token_bytes: list[bytes],
        eos_token_id: int,
        vocab_size: int,
        *,
        max_cached_grammars: int = 256,
    ) -> GrammarMatchers: ...
    def compile(self, kind: str, spec: str) -> int:
        """Compiles a grammar and returns its id; the same ``(kind, spec)`` again is a cache
        hit. ``kind``:

        - ``"json_schema"``: ``spec`` is a JSON schema's text;
        - ``"json_object"``: any JSON object (``spec`` ignored);
        - ``"regex"``: the whole output matches ``spec`` (Rust ``regex`` syntax; ``\\d``,
          ``\\w``, ``\\s`` are Unicode classes, as in Python's ``re``);
        - ``"choice"``: ``spec`` is a JSON list of strings; the output is exactly one;
        - ``"grammar"``: a Lark grammar as llguidance reads it (start rule ``start``; GBNF,
          recognized by ``::=``, is refused).

        ``InvalidArgumentError`` (a ``ValueError``) names what is wrong: the JSON, an
        unsupported JSON-schema keyword, the regex or grammar syntax error, or a grammar no
        token of the vocabulary can start. Runs with the GIL released."""
    def add(self, grammar_id: int) -> int:
        """Starts a sequence at the beginning of a compiled grammar; returns its handle.
        ``KeyError`` for a grammar id not (or no longer) in the cache: compile again."""
    def fill_bitmask(self, handles: list[int]) -> npt.NDArray[np.int32]:
        """The next-token masks, shape ``[len(handles), ceil(vocab_size / 32)]``: bit ``j``
        of word ``w`` of row ``r`` is set iff token ``32 * w + j`` may be sampled next by
        ``handles[r]``. EOS is allowed where the output may end; once nothing else can
        follow (or the matcher failed, see ``error``) EOS is the only allowed token.

        Computed with the GIL released and in parallel across sequences (rayon's pool), so
        it can run on a thread during the forward pass. ``KeyError`` for an unknown handle,
        ``InvalidArgumentError`` for a handle listed twice."""
    def advance(self, handle: int, token_id: int) -> bool:
        """Consumes a sampled token. ``False`` when the grammar does not allow it here (the
        state is unchanged). EOS is accepted where the output may end, and by a finished
        matcher. ``InvalidArgumentError`` for a token id at or past ``vocab_size``."""
    def is_finished(self, handle: int) -> bool:
        """Whether the grammar has ended: EOS was consumed, nothing but EOS can follow, or
        the matcher failed."""
    def error(self, handle: int) -> str | None:
        """Why the matcher failed (a grammar past llguidance's limits), or ``None``."""
    def remove(self, handle: int) -> None:
        """Frees a matcher. ``KeyError`` for an unknown handle."""
    def __len__(self) -> int:
        """Live matchers."""
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_id(self) -> int: ...
    @property
    def num_cached_grammars(self) -> int: ...
    @property
    def num_compiled(self) -> int:
        """Grammars compiled (cache misses that compiled)."""
    @property
    def cache_hits(self) -> int:
        """``compile`` calls answered from the cache."""
    @property
    def compile_seconds_total(self) -> float:
        """Wall-clock seconds spent compiling, failed compiles included."""
    @property
    def mask_seconds_total(self) -> float:
        """Wall-clock seconds spent in ``fill_bitmask`` (all rows of a call together)."""
    @property
    def num_masks(self) -> int:
        """Mask rows filled."""
