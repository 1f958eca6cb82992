"""Type stubs for the compiled core (``pagedrs._core``). Import these names from ``pagedrs``."""

__version__: str

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

class KVCacheManager:
    """Block tables of live requests over a pool of ``num_blocks`` blocks of ``block_size``
    token slots, with exact prefix caching (keyed by ``namespace`` and each request's
    ``cache_salt``).

    Raises ``InvalidArgumentError`` (a ``ValueError``) for ``num_blocks`` or ``block_size``
    below 1.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        namespace: str = "",
    ) -> None: ...
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
    def __contains__(self, request_id: str) -> bool: ...
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], cache_salt: str | None = None
    ) -> None:
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
