"""Five promises of the prefix caches that the other tests did not reach.

The stateful tests in ``test_prefix_cache.py`` run 20 steps against a brute-force model, over single
namespaces without quota groups, and their quota test extends a prefix of one node; the lab-3 adapter's tests
use the public namespace only.  So five things could break with every prefix-cache test green (each found by
planting the bug; see ``tools/mutation_pass.py``; engine tests in the pass's list catch the first two, far from
the cause, and nothing caught the other three):

* the LRU of leaves rebuilds its heap once stale entries outnumber live ones (after ~64 touches): a rebuild
  that loses a leaf means that block is never evicted again, and one that reorders leaves evicts the wrong
  block.  Checked against a plain list kept in LRU order by hand.
* an insert over quota pins the *last* matched block while its namespace evicts its own leaves; a radix path
  of two nodes (after a split) makes pinning another block observable: the prefix being extended would go.
* with quota groups (the engine groups a tenant's salts), each group's eviction queue must go once the group
  holds no block; with one salt per request a queue left behind per group grows without bound.
* the lab-3 adapter (:class:`~minivllm.kv.prefix.learner.LearnerHashCache`) must look a prompt up under the
  namespace it was cached under: the engine never uses the public one, so a lookup there would make every
  request miss; and an insert that meets a key held by a block of another prefix (a collision)
  must stop there, or the blocks after it hang from that other prefix and a lookup of it gets their KV.
"""

from __future__ import annotations

import pytest

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix import InsertResult, make_prefix_cache
from minivllm.kv.prefix.learner import LearnerHashCache
from minivllm.labs.check_lab03 import _ref_hasher, _ref_matcher, _ref_picker

from invariants import block_tokens as toks, cached_then_released  # noqa: E402 (tests/ is on sys.path)

BS = 4


@pytest.fixture(params=["radix", "hash"])
def kind(request) -> str:
    return request.param


def test_lru_order_survives_the_rebuilds_of_the_leaf_heap(kind):
    """A lookup that misses, five one-block prompts, then 300 lookups of four of them in a fixed pseudo-random
    order with a miss every third step (a miss advances the clock and touches no leaf, so a leaf's tick and
    its place in the touch order differ, the oldest leaf's too).  The heap is rebuilt several times (it holds
    at most 2 * 5 + 64 entries); the prompt never looked up again must still go first, then the others in the
    order of their last lookup, as a list moved to the back on each use says.  Every block must go: a leaf
    lost in a rebuild is cached for ever."""
    pool = BlockPool(16)
    cache = make_prefix_cache(kind, pool, BS)
    assert cache.match(toks(9)) == []
    block_of = {k: cached_then_released(cache, pool, toks(k))[0] for k in range(1, 6)}
    lru = [1, 2, 3, 4, 5]  # oldest first
    for i in range(300):
        k = 2 + (i * 7 + i // 5) % 4
        assert cache.match(toks(k)) == [block_of[k]]
        lru.remove(k)
        lru.append(k)
        if i % 3 == 0:
            assert cache.match(toks(9)) == []
    for k in lru:
        assert cache.evict(1) == 1
        assert pool.is_free(block_of[k]), f"expected prompt {k}'s block to go next (LRU order {lru})"
    assert cache.num_cached_blocks == 0 and pool.num_free == 16


def test_the_quota_pins_the_last_block_of_a_prefix_that_spans_two_nodes(kind):
    """Prompts (1, 2) and (1, 3) split the radix edge into (1) -> {(2), (3)}; a running request holds (1, 3),
    so its blocks are locked, and the namespace is at its quota of 3.  Inserting (1, 2, 4) -- a duplicate
    computed without a match, so only the cache holds block (2) -- needs one block of room; the only
    unlocked leaf is (2), the prefix the new block hangs from, which the quota must not evict.  So nothing
    is evicted and the new block is simply not cached (counted by hand: 3 cached, 0 evictions)."""
    pool = BlockPool(16)
    cache = make_prefix_cache(kind, pool, BS, quota_blocks=3)
    prefix = cached_then_released(cache, pool, toks(1, 2))
    running = cache.match(toks(1, 3))  # the running request takes the hit and one block of its own
    for b in running:
        pool.incref(b)
    running += pool.allocate_many(1)
    cache.insert(toks(1, 3), running)
    assert running[0] == prefix[0] and cache.num_cached_blocks == 3
    own = pool.allocate_many(3)
    assert cache.insert(toks(1, 2, 4), own) == InsertResult(2 * BS, prefix + own[2:])
    assert cache.is_cached(prefix[1]), "the prefix being extended was evicted to make room under it"
    assert not cache.is_cached(own[2]) and cache.stats.quota_evictions == 0
    assert cache.num_cached_blocks == 3
    assert [pool.refcount(b) for b in prefix] == [2, 1]  # block (1): cache and running; the pin is released
    assert cache.match(toks(1, 2, 4)) == prefix
    pool.free_all(own)
    pool.free_all(running)
    cache.reset()
    assert pool.num_free == 16


def test_a_quota_group_leaves_no_eviction_queue_once_its_blocks_are_gone(kind):
    """The engine counts a tenant's salted namespaces under one quota group.  Two tenants, three salts each:
    two queues (one per tenant, not per salt) while blocks are cached, none once every block is evicted."""
    pool = BlockPool(32)
    cache = make_prefix_cache(kind, pool, BS, quota_blocks=8, quota_group=lambda ns: ns[0])
    for tenant in ("alice", "bob"):
        for salt in ("a", "b", "c"):
            cached_then_released(cache, pool, toks(1, 2), (tenant, salt))
    assert sorted(cache._leaves.by_namespace) == ["alice", "bob"]
    assert cache.evict(12) == 12
    assert cache._leaves.by_namespace == {} and pool.num_free == 32


def test_the_learners_cache_looks_a_prompt_up_under_the_namespace_it_was_cached_under():
    """The engine hands the lab-3 cache ``(tenant, salt)`` namespaces.  Cached under alice's, a prompt is a
    full hit for alice (both blocks, by hand) and a miss for bob and for the public namespace."""
    pool = BlockPool(8)
    cache = LearnerHashCache(pool, BS, _ref_hasher, _ref_matcher, _ref_picker)
    alice, bob = ("alice", None), ("bob", None)
    table = cached_then_released(cache, pool, toks(1, 2), alice)
    assert cache.match(toks(1, 2), alice) == table
    assert cache.match(toks(1, 2), bob) == [] and cache.match(toks(1, 2)) == []
    assert cache.evict(2) == 2 and pool.num_free == 8


def _parentless_hasher(token_ids, block_size, salt=None):
    """A learner's weak hash: a block's key leaves out the blocks before it, so equal blocks collide."""
    n = len(token_ids) // block_size
    return [hash((tuple(token_ids[i * block_size:(i + 1) * block_size]), salt)) for i in range(n)]


def test_the_learners_insert_stops_at_a_key_another_prefix_holds():
    """With keys that forget the prefix, block (2) of (3, 2, 5) lands on the key of block (2) of (1, 2).  The
    insert must cache (3) only and report its own blocks; had it gone on, block (5) would hang from (1, 2)'s
    entry and a lookup of (1, 2, 5) would get KV computed after (3, 2).  By hand: that lookup hits 2 blocks."""
    pool = BlockPool(8)
    cache = LearnerHashCache(pool, BS, _parentless_hasher, _ref_matcher, _ref_picker)
    first = cached_then_released(cache, pool, toks(1, 2))
    own = pool.allocate_many(3)
    assert cache.insert(toks(3, 2, 5), own) == InsertResult(0, own)
    assert [cache.is_cached(b) for b in own] == [True, False, False]
    pool.free_all(own)
    assert cache.match(toks(1, 2, 5)) == first
    assert cache.evict(8) == 3 and pool.num_free == 8
