"""The KV cache manager through the Python binding: what a caller of `pagedrs` sees."""

import random

import pytest

import pagedrs
from pagedrs import (
    DuplicateRequestError,
    InvalidArgumentError,
    KVCacheManager,
    PagedrsError,
    UnknownRequestError,
)


def admit(kv: KVCacheManager, request_id: str, prompt: list[int], salt: str | None = None) -> int:
    """Adds a request, claims its cached prefix, allocates the rest; returns cached tokens."""
    kv.add_request(request_id, prompt, cache_salt=salt)
    blocks, num_cached = kv.get_computed_blocks(request_id)
    assert len(blocks) * kv.block_size == num_cached
    assert kv.allocate_slots(request_id, len(prompt) - num_cached) == []
    kv.check_invariants()
    return num_cached


def test_public_names_are_reexported_from_the_package():
    assert pagedrs.KVCacheManager is pagedrs._core.KVCacheManager
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(DuplicateRequestError, PagedrsError)
    assert pagedrs.__version__


def test_same_prompt_shares_full_blocks_and_hits_are_counted():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    prompt = list(range(100))
    assert admit(kv, "a", prompt) == 0
    used = kv.stats().num_used_blocks
    assert admit(kv, "b", prompt) == 96
    assert kv.block_table("a")[:6] == kv.block_table("b")[:6]
    assert kv.block_table("a")[6] != kv.block_table("b")[6]
    stats = kv.stats()
    assert stats.num_used_blocks == used + 1
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (200, 96)


def test_cache_salt_isolates_identical_prompts():
    kv = KVCacheManager(num_blocks=64, block_size=16)
    prompt = list(range(64))
    admit(kv, "alice-1", prompt, salt="alice")
    assert admit(kv, "bob-1", prompt, salt="bob") == 0
    assert admit(kv, "anon", prompt) == 0
    assert admit(kv, "alice-2", prompt, salt="alice") == 48


def test_freed_prefix_is_reused_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(12))
    admit(kv, "a", prompt)
    kv.free("a")
    assert kv.stats().num_cached_free_blocks == 3
    assert kv.usage() == 0.0
    assert admit(kv, "again", prompt) == 8
    kv.free("again")
    # Three new blocks take the cached tail, the spare and the middle block, in LRU order:
    # only the chain head survives.
    admit(kv, "other", list(range(100, 112)))
    assert kv.stats().num_evictions == 2
    kv.free("other")
    assert admit(kv, "late", prompt) == 4


def test_forced_collisions_never_share_different_tokens():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    kv._force_hash_collisions(0)
    admit(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(kv, "b", [9, 9, 9, 9, 5, 6, 7, 8, 9]) == 0
    assert admit(kv, "c", [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="s") == 0
    assert admit(kv, "d", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 4


def test_out_of_blocks_is_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.add_request("big", list(range(9)))
    kv.get_computed_blocks("big")
    before = kv.stats()
    assert kv.allocate_slots("big", 9) is None
    assert kv.stats().num_used_blocks == before.num_used_blocks
    assert kv.block_table("big") == []
    assert kv.allocate_slots("big", 8) == []
    assert kv.num_computed_tokens("big") == 8


def test_fork_shares_blocks_and_reports_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, "p", [1, 2, 3, 4, 5, 6])
    kv.fork("p", "p/1")
    table = kv.block_table("p")
    assert kv.block_table("p/1") == table
    assert kv.stats().num_used_blocks == 2
    kv.append_token_ids("p/1", [7])
    copies = kv.allocate_slots("p/1", 1)
    assert copies == [(table[1], kv.block_table("p/1")[1])]
    assert kv.block_table("p/1")[0] == table[0]
    kv.append_token_ids("p", [8])
    assert kv.allocate_slots("p", 1) == []  # last holder writes in place
    kv.free("p")
    kv.free("p/1")
    assert kv.num_free_blocks == 8


@pytest.mark.parametrize(
    "make",
    [
        lambda: KVCacheManager(0, 16),
        lambda: KVCacheManager(16, 0),
        lambda: KVCacheManager(-1, 16),
    ],
)
def test_bad_sizes_raise_value_error(make):
    with pytest.raises(ValueError, match="must be"):
        make()


def test_misuse_raises_documented_exceptions_and_leaks_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    admit(kv, "a", [1, 2, 3, 4, 5])
    with pytest.raises(DuplicateRequestError, match='"a"'):
        kv.add_request("a", [1])
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        kv.add_request("empty", [])
    with pytest.raises(InvalidArgumentError, match="token ids"):
        kv.add_request("neg", [1, -5])
    with pytest.raises(InvalidArgumentError, match="only 5 of its tokens are known"):
        kv.allocate_slots("a", 1)
    with pytest.raises(InvalidArgumentError, match="num_new_tokens"):
        kv.allocate_slots("a", -1)
    with pytest.raises(TypeError):
        kv.add_request("typed", "not a list of ints")
    with pytest.raises(TypeError):
        kv.add_request(7, [1])
    with pytest.raises(UnknownRequestError, match='"ghost"'):
        kv.fork("ghost", "child")
    with pytest.raises(DuplicateRequestError):
        kv.fork("a", "a")
    kv.free("a")
    with pytest.raises(UnknownRequestError, match="already freed"):
        kv.free("a")
    with pytest.raises(KeyError):
        kv.block_table("a")
    # None of that left anything behind.
    assert kv.num_requests == 0
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_random_workload_through_the_binding_frees_every_block():
    rng = random.Random(5)
    kv = KVCacheManager(num_blocks=40, block_size=4)
    live: list[str] = []
    for step in range(3000):
        action = rng.random()
        if action < 0.3 or not live:
            request_id = f"r{step}"
            prompt = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
            kv.add_request(request_id, prompt, cache_salt=rng.choice([None, "s"]))
            _, cached = kv.get_computed_blocks(request_id)
            kv.allocate_slots(request_id, len(prompt) - cached)  # may be None: memory is tight
            live.append(request_id)
        elif action < 0.6:
            request_id = rng.choice(live)
            if kv.block_table(request_id):
                kv.append_token_ids(request_id, [rng.randrange(3)])
                kv.allocate_slots(request_id, 1)
        elif action < 0.7:
            parent = rng.choice(live)
            if kv.block_table(parent):
                kv.fork(parent, f"{parent}/{step}")
                live.append(f"{parent}/{step}")
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        kv.check_invariants()
    for request_id in live:
        kv.free(request_id)
    assert kv.num_free_blocks == 40
    assert kv.stats().num_used_blocks == 0
    assert kv.stats().prefix_cache_hits > 0
