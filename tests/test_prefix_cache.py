"""Tests for the prefix caches (radix tree and hash index).

The unit tests pin down each rule of the :class:`PrefixCache` contract on
tiny hand-built examples.  The stateful tests then drive a real
:class:`BlockPool` and a cache with random operations and compare every
answer against a brute-force model that simply stores every cached token
prefix, so the clever structures are checked against the obvious one.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix import (
    InsertResult,
    PrefixCache,
    make_prefix_cache,
    sha256_block_hash,
)
from minivllm.kv.prefix.radix import RadixCache
from tests.fuzz import examples

from invariants import block_tokens as toks  # noqa: E402 (tests/ is on sys.path)
from prefix_model import BruteForceModel  # noqa: E402

BS = 4
KINDS = ["radix", "hash"]


# -- helpers: how the engine uses a cache --------------------------------------


def run_request(
    cache: PrefixCache, pool: BlockPool, tokens: Sequence[int], namespace: Hashable = ()
) -> list[int]:
    """Admit a request the way the engine does and return its block table.

    Match, take references on the hit blocks, allocate the rest, insert,
    and swap any duplicate for the canonical block.  The caller owns one
    reference on every block of the returned table.
    """
    table = list(cache.match(tokens, namespace))
    for block_id in table:
        pool.incref(block_id)
    table += pool.allocate_many(len(tokens) // BS - len(table))
    result = cache.insert(tokens, table, namespace)
    return swap_duplicates(pool, table, result)


def swap_duplicates(pool: BlockPool, table: list[int], result: InsertResult) -> list[int]:
    for i, (own, canonical) in enumerate(zip(table, result.block_ids)):
        if own != canonical:
            pool.incref(canonical)
            pool.decref(own)
            table[i] = canonical
    return table


def cache_only(cache: PrefixCache, pool: BlockPool, tokens: Sequence[int], ns: Hashable = ()) -> list[int]:
    """Run a request to completion: afterwards only the cache holds its blocks."""
    table = run_request(cache, pool, tokens, ns)
    pool.free_all(table)
    return table


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def new_cache(kind: str, num_blocks: int = 32, **kwargs) -> tuple[PrefixCache, BlockPool]:
    pool = BlockPool(num_blocks)
    return make_prefix_cache(kind, pool, BS, **kwargs), pool


def test_radix_drops_a_namespace_root_once_its_last_block_is_evicted():
    """One root per tenant or salt: a root left behind after its last block goes is a slow leak."""
    cache, pool = new_cache("radix", num_blocks=16)
    for salt in ("a", "b", "c"):
        blocks = pool.allocate_many(2)
        cache.insert(list(range(2 * BS)), blocks, namespace=(salt, None))
        pool.free_all(blocks)  # the request finishes: only the cache holds them
    assert len(cache._roots) == 3
    assert cache.evict(6) == 6
    assert cache._roots == {} and pool.num_free == 16


def test_an_emptied_namespace_leaves_no_eviction_queue_behind(kind):
    """Each quota group has its own LRU of leaves (what its quota evicts from).  With a namespace per cache
    salt, a queue kept after its group's last block is gone is a slow leak: it would also keep its evicted
    leaves alive through its stale heap entries.  Three salts, all evicted: no queue may remain."""
    cache, pool = new_cache(kind, num_blocks=16)
    for salt in ("a", "b", "c"):
        blocks = pool.allocate_many(2)
        cache.insert(list(range(2 * BS)), blocks, namespace=(salt, None))
        pool.free_all(blocks)  # the request finishes: only the cache holds them
    assert len(cache._leaves.by_namespace) == 3
    assert cache.evict(6) == 6
    assert cache._leaves.by_namespace == {} and pool.num_free == 16


class _QuietIncrefPool(BlockPool):
    """A pool subclass whose own ``incref`` keeps the count and nothing else (as a learner's might): it
    never reports a block becoming shared, so it must not be taken at its word that it will."""

    def incref(self, block_id: int) -> None:
        self._refcount[block_id] += 1


def test_a_pool_overriding_only_incref_is_recounted_not_followed(kind):
    """``watch_sharing`` must refuse a subclass that overrides ``incref`` alone, not only one that overrides
    both: followed anyway, the cache would hear of every block going back to one holder and of none going to
    two, and count locked blocks as evictable.  Oracle: hand counts -- blocks the request still holds are
    locked (none evictable), once it lets them go both are, and a later request that takes the cached
    prefix (its references come through the quiet ``incref``) locks both again."""
    pool = _QuietIncrefPool(8)
    cache = make_prefix_cache(kind, pool, BS)
    blocks = pool.allocate_many(2)
    cache.insert(toks(1, 2), blocks)
    assert [pool.refcount(b) for b in blocks] == [2, 2]
    assert cache.num_evictable_blocks() == 0
    pool.free_all(blocks)
    assert cache.num_evictable_blocks() == 2
    table = run_request(cache, pool, toks(1, 2))  # a hit on both blocks: the request holds them again
    assert table == blocks and [pool.refcount(b) for b in blocks] == [2, 2]
    assert cache.num_evictable_blocks() == 0
    pool.free_all(table)
    assert cache.num_evictable_blocks() == 2


# -- matching -------------------------------------------------------------------


def test_match_on_empty_cache(kind: str) -> None:
    cache, _ = new_cache(kind)
    assert cache.match(toks(1, 2)) == []
    assert cache.match([]) == []


def test_exact_block_boundary_and_one_past(kind: str) -> None:
    cache, pool = new_cache(kind)
    table = cache_only(cache, pool, toks(1, 2))
    assert cache.match(toks(1, 2)) == table
    assert cache.match(toks(1, 2, extra=[7])) == table  # boundary + 1
    assert cache.match(toks(1, 2)[:-1]) == table[:1]  # boundary - 1
    assert cache.match(toks(1, 3)) == table[:1]
    assert cache.match(toks(2, 1)) == []


def test_partial_block_is_never_cached(kind: str) -> None:
    cache, pool = new_cache(kind)
    [block] = pool.allocate_many(1)
    result = cache.insert(toks(1, extra=[5, 5]), [block])
    assert result == InsertResult(0, [block])
    assert cache.num_cached_blocks == 1
    assert cache.match(toks(1, extra=[5, 5, 5, 5])) == [block]
    with pytest.raises(ValueError):
        cache.insert(toks(1, extra=[5]), pool.allocate_many(2))


def test_insert_takes_one_reference_per_new_block(kind: str) -> None:
    cache, pool = new_cache(kind)
    table = pool.allocate_many(2)
    cache.insert(toks(1, 2), table)
    assert [pool.refcount(b) for b in table] == [2, 2]
    cache.insert(toks(1, 2), table)  # inserting again changes nothing
    assert [pool.refcount(b) for b in table] == [2, 2]
    assert cache.stats.inserted_blocks == 2


def test_duplicate_insert_returns_canonical_blocks(kind: str) -> None:
    cache, pool = new_cache(kind)
    first = pool.allocate_many(2)
    cache.insert(toks(1, 2), first)
    second = pool.allocate_many(3)  # computed the same prefix concurrently
    result = cache.insert(toks(1, 2, 3), second)
    assert result.num_already_cached_tokens == 2 * BS
    assert result.block_ids == first + second[2:]
    assert pool.refcount(second[0]) == 1  # the duplicate was not taken
    duplicates = second[:2]
    swap_duplicates(pool, second, result)
    assert all(pool.is_free(b) for b in duplicates)
    assert second == result.block_ids


def test_inserting_a_block_cached_elsewhere_or_free_is_an_error(kind: str) -> None:
    cache, pool = new_cache(kind)
    table = pool.allocate_many(1)
    cache.insert(toks(1), table)
    with pytest.raises(ValueError, match="already cached"):
        cache.insert(toks(2), table)
    with pytest.raises(ValueError, match="is free"):
        cache.insert(toks(3, 4), [pool.allocate(), pool.num_blocks - 1])
    assert cache.num_cached_blocks == 1 and pool.num_free == pool.num_blocks - 2


def test_a_refused_insert_leaves_the_lru_order_as_it_was(kind: str) -> None:
    """An insert whose new blocks fail the check (here a free block) changes nothing a later eviction reads:
    the prefix it would have extended stays the oldest.  It used to touch that prefix first, then refuse."""
    cache, pool = new_cache(kind)
    a = cache_only(cache, pool, toks(1))
    b = cache_only(cache, pool, toks(2))
    with pytest.raises(ValueError, match="is free"):
        cache.insert(toks(1, 3), [a[0], pool.num_blocks - 1])
    assert cache.evict(1) == 1 and not cache.is_cached(a[0]) and cache.is_cached(b[0])


def test_match_only_refreshes_the_blocks_it_used(kind: str) -> None:
    """A hit on the head of a long prefix leaves its tail old (radix: edge split)."""
    cache, pool = new_cache(kind)
    a = cache_only(cache, pool, toks(1, 2, 3))
    b = cache_only(cache, pool, toks(4))
    assert cache.match(toks(1, 2)) == a[:2]  # a[2] was not used: still older than b
    assert cache.evict(1) == 1 and not cache.is_cached(a[2])
    assert cache.evict(1) == 1 and not cache.is_cached(b[0])  # a[1] is newer than b
    assert cache.is_cached(a[0]) and cache.is_cached(a[1])


def test_a_peek_counts_what_match_would_and_leaves_recency_and_edges_alone(kind: str) -> None:
    """The hand-worked twin of the test above, with ``peek`` first: it counts the two blocks ``match`` returns,
    but a[1] stays older than b (evicted before it), and a radix edge is not split."""
    cache, pool = new_cache(kind)
    a = cache_only(cache, pool, toks(1, 2, 3))
    b = cache_only(cache, pool, toks(4))
    nodes = getattr(cache, "num_nodes", None)
    assert cache.peek(toks(1, 2, 9)) == 2 and cache.peek(toks(5)) == 0
    assert getattr(cache, "num_nodes", None) == nodes  # (radix: still one edge of three blocks)
    assert cache.evict(1) == 1 and not cache.is_cached(a[2])
    assert cache.evict(1) == 1 and not cache.is_cached(a[1])  # a peek made nothing recent
    assert cache.is_cached(b[0]) and cache.peek(toks(4)) == 1
    assert cache.peek(toks(1, 2, 9)) == 1 and cache.match(toks(1, 2, 9)) == a[:1]


def test_radix_edges_split_and_extend() -> None:
    pool = BlockPool(32)
    cache = RadixCache(pool, BS)
    cache_only(cache, pool, toks(1, 2, 3))
    assert cache.num_nodes == 1  # one edge of three blocks
    cache.match(toks(1, 2, 9))
    assert cache.num_nodes == 2  # split after two blocks
    cache_only(cache, pool, toks(1, 5))
    assert cache.num_nodes == 4  # [1] -> {[2] -> [3], [5]}
    table = run_request(cache, pool, toks(1, 5, 6, 7))
    assert cache.num_nodes == 4  # the leaf [5] grew into [5, 6, 7]
    assert cache.match(toks(1, 5, 6, 7)) == table
    pool.free_all(table)
    cache.reset()
    assert cache.num_nodes == 0 and pool.num_free == 32


# -- namespaces and quotas -----------------------------------------------------------


def test_namespaces_are_isolated(kind: str) -> None:
    cache, pool = new_cache(kind)
    table = cache_only(cache, pool, toks(1, 2), "tenant-a")
    assert cache.match(toks(1, 2), "tenant-a") == table
    assert cache.match(toks(1, 2), "tenant-b") == []
    assert cache.match(toks(1, 2)) == []
    other = cache_only(cache, pool, toks(1, 2), "tenant-b")
    assert set(other).isdisjoint(table)


def test_quota_evicts_only_the_tenants_own_blocks(kind: str) -> None:
    cache, pool = new_cache(kind, quota_blocks=4)
    b_blocks = cache_only(cache, pool, toks(1, 2, 3, 4), "b")
    a_old = cache_only(cache, pool, toks(1, 2, 3, 4), "a")
    a_new = cache_only(cache, pool, toks(5, 6, 7), "a")
    assert cache.stats.quota_evictions == 3
    assert all(cache.is_cached(b) for b in b_blocks + a_new)
    assert [cache.is_cached(b) for b in a_old] == [True, False, False, False]


def test_quota_full_of_locked_blocks_caches_nothing_more(kind: str) -> None:
    cache, pool = new_cache(kind, quota_blocks=2)
    cache_only(cache, pool, toks(9, 9), "b")
    held = run_request(cache, pool, toks(1, 2), "a")  # still running: locked
    own = pool.allocate_many(2)
    result = cache.insert(toks(3, 4), own, "a")
    assert result == InsertResult(0, own)
    assert [pool.refcount(b) for b in own] == [1, 1]
    assert not any(cache.is_cached(b) for b in own)
    assert all(cache.is_cached(b) for b in held)
    assert cache.num_cached_blocks == 4  # tenant b untouched


def test_quota_keeps_the_prefix_being_extended(kind: str) -> None:
    """Making room must not evict the cached prefix the new blocks hang from."""
    cache, pool = new_cache(kind, quota_blocks=2)
    prefix = cache_only(cache, pool, toks(1, 2))  # only the cache holds these
    own = pool.allocate_many(3)  # a duplicate computed without matching
    result = cache.insert(toks(1, 2, 3), own)
    assert result == InsertResult(2 * BS, prefix + own[2:])
    assert all(cache.is_cached(b) for b in prefix)  # not evicted to make room
    assert not cache.is_cached(own[2])  # no room left: the tail is not cached
    assert [pool.refcount(b) for b in prefix] == [1, 1]  # the pin was released


# -- eviction ---------------------------------------------------------------------------


def test_eviction_is_lru_and_leaves_first(kind: str) -> None:
    cache, pool = new_cache(kind)
    p = cache_only(cache, pool, toks(1, 2))
    x = cache_only(cache, pool, toks(1, 2, 3))[2]
    q = cache_only(cache, pool, toks(4))[0]
    order = []
    for _ in range(4):
        assert cache.evict(1) == 1
        order.append(next(b for b in [*p, x, q] if pool.is_free(b) and b not in order))
    assert order == [x, p[1], p[0], q]
    assert cache.evict(1) == 0
    assert cache.stats.evicted_blocks == 4


def test_locked_blocks_are_never_evicted(kind: str) -> None:
    cache, pool = new_cache(kind)
    held = run_request(cache, pool, toks(1, 2))
    free = cache_only(cache, pool, toks(3, 4))
    pool.incref(free[1])  # a lone extra reference on a tail block
    assert cache.num_evictable_blocks() == 0
    assert cache.evict(10) == 0
    pool.decref(free[1])
    assert cache.num_evictable_blocks() == 2
    assert cache.evict(10) == 2
    assert all(cache.is_cached(b) for b in held)
    pool.free_all(held)
    assert cache.num_evictable_blocks() == 2


def test_lock_in_the_middle_pins_the_prefix_only(kind: str) -> None:
    cache, pool = new_cache(kind)
    table = cache_only(cache, pool, toks(1, 2, 3))
    pool.incref(table[1])
    assert cache.num_evictable_blocks() == 1
    assert cache.evict(3) == 1
    assert not cache.is_cached(table[2]) and cache.is_cached(table[1])
    pool.decref(table[1])


def test_reset_keeps_locked_blocks_and_frees_the_rest(kind: str) -> None:
    cache, pool = new_cache(kind, num_blocks=16)
    held = run_request(cache, pool, toks(1, 2))
    cache_only(cache, pool, toks(3, 4))
    cache_only(cache, pool, toks(1, 5))
    cache.reset()
    assert cache.num_cached_blocks == 2
    pool.free_all(held)
    cache.reset()
    assert cache.num_cached_blocks == 0 and pool.num_free == 16


# -- stats and factory ---------------------------------------------------------------


def test_stats_hit_rate(kind: str) -> None:
    cache, _ = new_cache(kind)
    assert cache.stats.hit_rate == 0.0
    cache.record_lookup(100, 25)
    cache.record_lookup(100, 75)
    assert cache.stats.hit_rate == 0.5
    cache.match(toks(1))  # match alone does not count
    assert cache.stats.queries_tokens == 200


def test_factory_rejects_bad_arguments() -> None:
    pool = BlockPool(4)
    with pytest.raises(ValueError, match="unknown prefix cache kind"):
        make_prefix_cache("lru", pool, BS)
    with pytest.raises(ValueError):
        make_prefix_cache("radix", pool, BS, hash_fn=hash)
    with pytest.raises(ValueError):
        make_prefix_cache("hash", pool, 0)


# -- hash collisions ---------------------------------------------------------------------


def test_total_hash_collision_never_returns_wrong_blocks() -> None:
    cache, pool = new_cache("hash", hash_fn=lambda key: 0)
    a = cache_only(cache, pool, toks(1, 2))
    assert cache.num_cached_blocks == 1  # block 2's key is taken by block 1
    assert cache.match(toks(1, 2)) == a[:1]  # correct hits still work
    assert cache.match(toks(2, 1)) == []
    # Same key, same tokens, same namespace -- but the second "1" block follows another prefix, so its KV differs:
    # only the parent check tells them apart (the longest cached prefix of 1,1 is one block).
    assert cache.match(toks(1, 1)) == a[:1]
    assert cache.match(toks(1), "other") == []
    b = pool.allocate_many(2)
    assert cache.insert(toks(3, 4), b) == InsertResult(0, b)
    assert not cache.is_cached(b[0]) and pool.refcount(b[0]) == 1
    assert cache.match(toks(3, 4)) == []


def test_a_colliding_insert_evicts_nothing_for_blocks_it_will_not_cache() -> None:
    """Under a quota, an insert first makes room -- but a block whose key a colliding entry holds is never
    cached, so no valid block may be evicted for it.  Oracle: hand-written; every first block hashes alike."""
    pool = BlockPool(8)
    cache = make_prefix_cache("hash", pool, 2, quota_blocks=2, hash_fn=lambda key: "root" if key[0] is None else hash(key))
    a = pool.allocate_many(2)
    cache.insert([1, 1, 2, 2], a)  # a 2-block chain fills the quota
    pool.free_all(a)  # only the cache holds it: evictable
    b = pool.allocate_many(1)
    cache.insert([7, 7], b)  # its first (only) key is the chain's root's
    assert not cache.is_cached(b[0])
    assert cache.match([1, 1, 2, 2, 9]) == a and cache.num_cached_blocks == 2
    assert cache.stats.evicted_blocks == 0 and cache.stats.quota_evictions == 0


def _self_colliding_hash_cache():
    """A hash cache under a quota of 2 whose keys for blocks (5, 5) and (6, 6) collide, holding one evictable block
    ``x`` (cached, no request holds it): the scene of the two self-collision tests below."""
    pool = BlockPool(8)
    cache = make_prefix_cache("hash", pool, 2, quota_blocks=2,
                              hash_fn=lambda key: "same" if key[1] in ((5, 5), (6, 6)) else hash(key))
    x = pool.allocate_many(1)
    cache.insert([1, 1], x)
    pool.free_all(x)  # only the cache holds it: evictable
    return pool, cache, x


def test_a_chain_colliding_with_itself_evicts_nothing_for_the_block_it_will_not_cache() -> None:
    """Two new blocks of one insert whose keys collide with each other (not with the table): only the first is
    cached, so the quota needs room for one -- and there is room for one without evicting anything.  Making room
    for both evicted a valid, evictable block for a block the insert then did not cache.  Oracle: hand count
    (quota 2, one cached block, one new block cached)."""
    pool, cache, x = _self_colliding_hash_cache()
    b = pool.allocate_many(2)
    cache.insert([5, 5, 6, 6], b)  # block (6, 6)'s key is block (5, 5)'s
    assert cache.is_cached(b[0]) and not cache.is_cached(b[1])
    assert cache.is_cached(x[0]) and cache.num_cached_blocks == 2
    assert cache.stats.evicted_blocks == 0 and cache.stats.quota_evictions == 0


def test_a_chain_colliding_with_itself_caches_nothing_past_the_collision() -> None:
    """A self-collision in the middle of a longer run: blocks (5, 5) and (6, 6) share a key, (7, 7) follows.  Only
    (5, 5) is cached.  Why a third block: the run's keys are a dict, so a duplicate key alone never counts twice;
    skipping it and going on instead filed block (6, 6) under (7, 7)'s key, evicting the quota's other block for
    an entry no prompt can use.  Oracle: hand count (quota 2, one cached block, one new block cached)."""
    pool, cache, x = _self_colliding_hash_cache()
    b = pool.allocate_many(3)
    cache.insert([5, 5, 6, 6, 7, 7], b)
    assert [cache.is_cached(i) for i in b] == [True, False, False]
    assert cache.match([5, 5, 7, 7]) == [b[0]]  # (7, 7) was never cached: no block of it is reused
    assert cache.is_cached(x[0]) and cache.stats.evicted_blocks == 0


def test_sha256_hash_works_as_hash_fn() -> None:
    cache, pool = new_cache("hash", hash_fn=sha256_block_hash)
    table = cache_only(cache, pool, toks(1, 2, 3))
    assert cache.match(toks(1, 2, 3, 4)) == table


# -- stateful test against a brute-force model ----------------------------------------

SBS = 2  # tiny blocks and a tiny alphabet make prefixes collide a lot
POOL_BLOCKS = 16
NAMESPACES = ((), ("a", None), ("b", "salt"))
NAMESPACE = st.sampled_from(NAMESPACES[:2]) | st.sampled_from(NAMESPACES)  # mostly two


# Random tails after a few common heads: requests share prefixes of every length.
COMMON_HEADS = [(), (0, 1, 2, 3), (0, 1, 2, 3, 0, 0, 1, 1), (0, 1, 3, 3), (2, 2), (2, 2, 2, 2)]
SEQUENCES = st.builds(
    lambda head, tail: head + tuple(tail),
    st.sampled_from(COMMON_HEADS),
    st.lists(st.integers(0, 3), max_size=5),
)


@dataclass
class Request:
    namespace: Hashable
    tokens: tuple[int, ...]
    table: list[int]


class PrefixCacheMachine(RuleBasedStateMachine):
    """Random engine traffic against a real pool, checked after every step.

    With ``exact`` the brute-force model must agree on every answer.  Without
    it (a deliberately weak hash that collides often) only the safety
    properties are checked: hits hold the right KV, isolation, quotas,
    refcounts and no leaks.
    """

    def __init__(self, kind: str, quota: int | None, hash_fn=None, exact: bool = True) -> None:
        super().__init__()
        self.pool = BlockPool(POOL_BLOCKS)
        self.cache = make_prefix_cache(kind, self.pool, SBS, quota_blocks=quota, hash_fn=hash_fn)
        self.quota = quota
        self.model = BruteForceModel(self.pool, quota, SBS) if exact else None
        self.requests: list[Request] = []
        self.pins: list[int] = []
        # What KV each block in use holds: (namespace, token prefix it ends).
        self.content: dict[int, tuple[str, tuple[int, ...]]] = {}

    # -- checks shared by the rules -----------------------------------------------
    def check_hit(self, ns: str, tokens: Sequence[int], hit: list[int]) -> None:
        for i, block_id in enumerate(hit):
            assert self.content[block_id] == (ns, tuple(tokens[: (i + 1) * SBS])), "wrong KV"

    def do_match(self, ns: str, tokens: Sequence[int]) -> list[int]:
        hit = self.cache.match(tokens, ns)
        if self.model is not None:
            assert hit == self.model.match(ns, tokens)
        self.check_hit(ns, tokens, hit)
        return hit

    def do_evict(self, n: int) -> None:
        expected = self.model.evict(n) if self.model is not None else None
        freed = self.cache.evict(n)
        if expected is not None:
            assert freed == len(expected)

    def others_cached(self, ns: str) -> set[int]:
        return {b for b in range(POOL_BLOCKS) if self.cache.is_cached(b) and self.content[b][0] != ns}

    # -- rules ----------------------------------------------------------------------
    @rule(tokens=SEQUENCES, ns=NAMESPACE)
    def match(self, tokens: tuple[int, ...], ns: str) -> None:
        self.do_match(ns, tokens)

    @rule(tokens=SEQUENCES, ns=NAMESPACE)
    def peek(self, tokens: tuple[int, ...], ns: str) -> None:
        """``peek`` counts the blocks ``match`` would return and changes nothing (WFQ reads it for requests that
        are not admitted).  The model is not told of it: a peek that made its path recent, as ``match`` does,
        shows up as a later eviction the model did not predict."""
        refs = [self.pool.refcount(b) for b in range(POOL_BLOCKS)]
        n = self.cache.peek(tokens, ns)
        assert refs == [self.pool.refcount(b) for b in range(POOL_BLOCKS)], "a peek took a reference"
        if self.model is not None:
            assert n == len(self.model.path(ns, tokens, len(tokens) // SBS))
        else:  # (a colliding hash: the answer of a match on a copy, which may touch what it likes)
            assert n == len(copy.deepcopy(self.cache).match(tokens, ns))

    def admit(self, tokens: tuple[int, ...], ns: str) -> Request | None:
        """Match, reference the hits, allocate the rest (evicting if needed)."""
        table = self.do_match(ns, tokens)
        for block_id in table:
            self.pool.incref(block_id)
        need = len(tokens) // SBS - len(table)
        if need > self.pool.num_free:
            self.do_evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            self.pool.free_all(table)
            return None
        for i in range(len(table), len(table) + need):
            block_id = self.pool.allocate()
            self.content[block_id] = (ns, tokens[: (i + 1) * SBS])
            table.append(block_id)
        return Request(ns, tokens, table)

    def do_insert(self, req: Request) -> None:
        before = self.others_cached(req.namespace)
        # The model predicts first: it reads pool refcounts, which the real insert changes.
        expected = self.model.insert(req.namespace, req.tokens, req.table) if self.model else None
        result = self.cache.insert(req.tokens, req.table, req.namespace)
        assert expected is None or result == expected
        self.check_hit(req.namespace, req.tokens, result.block_ids)
        assert before == self.others_cached(req.namespace), "insert touched another namespace"
        swap_duplicates(self.pool, req.table, result)

    @rule(tokens=SEQUENCES, ns=NAMESPACE)
    def serve_request(self, tokens: tuple[int, ...], ns: str) -> None:
        """The common life cycle in one step: admit, insert, finish."""
        req = self.admit(tokens, ns)
        if req is not None:
            self.do_insert(req)
            self.pool.free_all(req.table)

    @rule(tokens=SEQUENCES, ns=NAMESPACE)
    def start_request(self, tokens: tuple[int, ...], ns: str) -> None:
        """A request that keeps running: its blocks stay locked."""
        req = self.admit(tokens, ns)
        if req is not None:
            self.requests.append(req)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def insert_request(self, index: int) -> None:
        """Insert a running request; a second request may have cached the same blocks."""
        self.do_insert(self.requests[index % len(self.requests)])

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 100))
    def finish_request(self, index: int) -> None:
        req = self.requests.pop(index % len(self.requests))
        self.pool.free_all(req.table)

    @rule(index=st.integers(0, POOL_BLOCKS - 1))
    def pin_cached_block(self, index: int) -> None:
        """A lone extra reference, e.g. on a block in the middle of an edge."""
        cached = [b for b in range(POOL_BLOCKS) if self.cache.is_cached(b)]
        if cached:
            block_id = cached[index % len(cached)]
            self.pool.incref(block_id)
            self.pins.append(block_id)

    @precondition(lambda self: self.pins)
    @rule(index=st.integers(0, 100))
    def unpin(self, index: int) -> None:
        self.pool.decref(self.pins.pop(index % len(self.pins)))

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        self.do_evict(n)

    # -- invariants -------------------------------------------------------------------
    @invariant()
    def refcounts_add_up(self) -> None:
        holds = [0] * POOL_BLOCKS
        for req in self.requests:
            for block_id in req.table:
                holds[block_id] += 1
        for block_id in self.pins:
            holds[block_id] += 1
        cached = 0
        for block_id in range(POOL_BLOCKS):
            in_cache = self.cache.is_cached(block_id)
            cached += in_cache
            assert self.pool.refcount(block_id) == holds[block_id] + in_cache
            if self.pool.is_free(block_id):
                self.content.pop(block_id, None)
        assert cached == self.cache.num_cached_blocks
        stats = self.cache.stats
        assert stats.inserted_blocks - stats.evicted_blocks == cached
        assert self.pool.num_free == sum(1 for h in range(POOL_BLOCKS) if self.pool.is_free(h))

    @invariant()
    def quota_respected(self) -> None:
        if self.quota is None:
            return
        for ns in NAMESPACES:
            n = sum(1 for b in range(POOL_BLOCKS) if self.cache.is_cached(b) and self.content[b][0] == ns)
            assert n <= self.quota

    @invariant()
    def agrees_with_model(self) -> None:
        if self.model is None:
            return
        cached = {b for b in range(POOL_BLOCKS) if self.cache.is_cached(b)}
        assert cached == self.model.block_ids()
        assert self.cache.num_evictable_blocks() == self.model.num_evictable()

    def teardown(self) -> None:
        for req in self.requests:
            self.pool.free_all(req.table)
        for block_id in self.pins:
            self.pool.decref(block_id)
        self.cache.reset()
        assert self.cache.num_cached_blocks == 0
        assert self.pool.num_free == POOL_BLOCKS, "blocks leaked"


def weak_hash(key: object) -> int:
    """Only five distinct keys: most blocks collide with some other block."""
    return hash(key) % 5


STATEFUL_CASES = [
    pytest.param("radix", None, None, True, id="radix"),
    pytest.param("radix", 3, None, True, id="radix-quota"),
    pytest.param("hash", None, None, True, id="hash"),
    pytest.param("hash", 3, None, True, id="hash-quota"),
    pytest.param("hash", 3, weak_hash, False, id="hash-collisions"),
]


@pytest.mark.parametrize("kind, quota, hash_fn, exact", STATEFUL_CASES)
def test_against_brute_force_model(kind: str, quota: int | None, hash_fn, exact: bool) -> None:
    run_state_machine_as_test(
        lambda: PrefixCacheMachine(kind, quota, hash_fn, exact),
        settings=settings(
            max_examples=examples(400),  # x 5 cases = 2000 random programs
            stateful_step_count=20,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
