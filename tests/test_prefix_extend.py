"""``PrefixCache.extend``: caching a decoding request's newly filled blocks without re-inserting its whole
prefix leaves the cache exactly as the whole insert would.

The oracle is the engine itself with ``extend`` switched off, so that every block a request fills
re-inserts the request's whole prefix (what the engine always did before).  The same seeded workload --
two shared system prompts, two tenants in separate namespaces, one under a quota, ``n = 2`` samples,
arrivals during the run, a pool small enough to evict and preempt (recompute and swap) -- runs through
both engines, and after every step the two caches must hold the same entries with the same LRU ticks and
tie-break stamps, the same stats, and the engines must have emitted the same tokens.
"""

import dataclasses
import random

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.kv import BlockPool, KVCacheManager
from minivllm.kv.prefix import make_prefix_cache
from minivllm.request import Request
from minivllm.sim.executor import SimulatedExecutor

from invariants import steps, tiny_engine  # noqa: E402  (tests/ is on sys.path)


def _dump(cache) -> tuple:
    """Everything that decides the cache's future behaviour, with nodes named by their blocks."""
    def name(leaf):
        return tuple(leaf.block_ids) if hasattr(leaf, "block_ids") else leaf.block_id

    lru = cache._leaves
    leaves = sorted((name(leaf), stamp) for leaf, stamp in lru.all._stamp.items())
    per_ns = sorted((repr(ns), sorted((name(leaf), s) for leaf, s in q._stamp.items()))
                    for ns, q in lru.by_namespace.items())
    if hasattr(cache, "_table"):  # hash index
        # An entry's recency as eviction will read it: the latest tick in its subtree.  (A whole insert
        # stamps every ancestor; extend stamps only the parent, and children hand theirs up as they go.)
        recency = {e.block_id: e.last_used for e in cache._table.values()}
        for e in cache._table.values():
            up = e.parent
            while up is not None:
                recency[up.block_id] = max(recency[up.block_id], e.last_used)
                up = up.parent
        entries = sorted((e.block_id, e.token_ids, e.parent.block_id if e.parent else None, e.num_children,
                          recency[e.block_id], repr(e.namespace)) for e in cache._table.values())
    else:  # radix tree
        entries, stack = [], list(cache._roots.values())
        while stack:
            node = stack.pop()
            entries.append((repr(node.namespace), tuple(node.block_ids), tuple(node.token_blocks), node.last_access,
                            tuple(node.parent.block_ids) if node.parent else None))
            stack.extend(node.children.values())
        entries.sort()
    return entries, leaves, per_ns, dataclasses.asdict(cache.stats)


def _workload(seed: int):
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 500) for _ in range(rng.randrange(9, 23))] for _ in range(2)]
    reqs = []
    for i in range(14):
        prompt = rng.choice(systems) + [rng.randrange(10, 500) for _ in range(rng.randrange(1, 12))]
        n = 2 if i % 5 == 3 else 1
        reqs.append((rng.randrange(0, 40), prompt, n, rng.randrange(8, 60), "a" if i % 3 else "b"))
    return sorted(reqs, key=lambda r: r[0])


def _engine(kind: str, preemption: str, extend: bool) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=40, num_cpu_blocks_override=64, block_size=4, max_model_len=128,
                       max_num_seqs=6, max_num_batched_tokens=32, device="cpu", enable_prefix_caching=True,
                       prefix_cache=kind, preemption_mode=preemption, prefix_cache_quota_blocks=14)
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=128, eos_token_ids=set())
    if not extend:
        engine.kv.prefix_cache.extend = lambda *args, **kwargs: False
    return engine


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("preemption,seed", [("recompute", 0), ("swap", 1), ("recompute", 2)])
def test_extend_leaves_the_cache_as_a_whole_insert_would(kind, preemption, seed):
    work = _workload(seed)
    engines = [_engine(kind, preemption, extend) for extend in (True, False)]
    calls = {"extend_true": 0}
    real = engines[0].kv.prefix_cache.extend

    def counting(*args, **kwargs):
        ok = real(*args, **kwargs)
        calls["extend_true"] += ok
        return ok

    engines[0].kv.prefix_cache.extend = counting
    tokens = [{}, {}]
    step = 0
    pending = list(work)
    while pending or any(e.has_unfinished_requests() for e in engines):
        while pending and pending[0][0] <= step:
            _, prompt, n, max_tokens, tenant = pending.pop(0)
            for e in engines:
                e.add_request({"prompt_token_ids": prompt}, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True,
                              temperature=0 if n == 1 else 1, seed=7), tenant=tenant)
        for e, seen in zip(engines, tokens):
            for out in e.step():
                for o in out.outputs:
                    seen.setdefault((out.request_id, o.index), []).extend(o.token_ids)
        assert _dump(engines[0].kv.prefix_cache) == _dump(engines[1].kv.prefix_cache), f"step {step}"
        step += 1
        assert step < 2000
    assert tokens[0] == tokens[1]
    stats = engines[0].stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["num_preemptions"] > 0, stats
    assert calls["extend_true"] > 20, calls  # the fast path was taken, not only fallen back from


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_extend_never_crosses_into_another_namespace(kind):
    """A block is cached in one namespace (a tenant, a salt); ``extend`` asked to hang new blocks below it in
    another must refuse (False, nothing changed), as a whole insert there would start from that namespace's own
    root.  The engine never asks this (a request's path is in its own namespace), so only a direct call shows
    it: the cache's tenant isolation must not rest on its caller.  Oracle: ``match`` in each namespace."""
    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.prefix import make_prefix_cache

    pool = BlockPool(16)
    cache = make_prefix_cache(kind, pool, 2)
    a, b = ("a", None), ("b", None)
    first = pool.allocate_many(2)
    cache.insert([1, 2, 3, 4], first, a)
    more = pool.allocate_many(1)
    before = _dump(cache)
    assert cache.extend(first[-1], [5, 6], more, b) is False
    assert _dump(cache) == before and not cache.is_cached(more[0])
    assert cache.match([1, 2, 3, 4, 5, 6], b) == [] and cache.match([1, 2, 3, 4, 5, 6], a) == first
    assert cache.extend(first[-1], [5, 6], more, a) is True  # (its own namespace: accepted)
    assert cache.match([1, 2, 3, 4, 5, 6], a) == first + more


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_freed_request_caches_its_blocks_again_from_the_first(kind):
    """``KVCacheManager.free`` resets everything the request had computed, including how many of its blocks it
    has offered to the prefix cache.  A scheduler that recomputes a freed request without looking up the cache
    (a plug-in one may) must still see the recomputed blocks cached.  Oracle: the cache's own ``match``."""
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 4, prefix_cache=make_prefix_cache(kind, pool, 4))
    req = Request("a", list(range(100, 112)), SamplingParams(max_tokens=4), 0.0)
    assert kv.allocate_slots(req, 12)
    req.num_computed_tokens = 12
    kv.cache_full_blocks(req)
    assert kv.prefix_cache.match(req.all_token_ids, kv.namespace(req)) == req.block_ids  # 3 blocks cached
    kv.free(req)
    kv.prefix_cache.reset()  # the cached copies are evicted: the request starts over with nothing
    assert kv.allocate_slots(req, 8)
    req.num_computed_tokens = 8
    kv.cache_full_blocks(req)
    assert kv.prefix_cache.match(req.all_token_ids, kv.namespace(req)) == req.block_ids[:2]
    kv.free(req)
    kv.prefix_cache.reset()
    assert pool.num_free == 8


@pytest.mark.parametrize("prompt_len, queried, hit", [(3, 6, 0), (9, 18, 8), (1, 2, 0)])
def test_a_sample_that_starts_without_its_leader_counts_its_own_lookup(prompt_len, queried, hit):
    """``n = 2`` on one seat: the leader finishes before its sample is admitted, so the sample does not fork; it
    looks the cache up like any request and counts like one, hit or miss.  Hand count, 4-token blocks: a 9-token
    prompt caches 2 full blocks, the sample matches 8 tokens (never the last one); a 3-token prompt caches none.
    (Counted only when it missed, the hit rate was biased down.)  Oracle: the hand count; no sample forked."""
    engine = tiny_engine(prefix="radix", max_seqs=1)
    forked = []
    fork = engine.kv.fork
    engine.kv.fork = lambda parent, child: (forked.append(child.request_id), fork(parent, child))[1]
    params = SamplingParams(max_tokens=1, n=2, ignore_eos=True, temperature=1.0, seed=1)
    engine.add_request({"prompt_token_ids": list(range(100, 100 + prompt_len))}, params, "g")
    for _ in steps(engine):
        pass
    stats = engine.prefix_cache.stats
    assert not forked and (stats.queries_tokens, stats.hits_tokens) == (queried, hit)


def test_every_sample_of_a_group_reports_the_prompts_cached_tokens():
    """An ``n > 1`` request's prompt hits the cache once, through its leader; the samples forked from it must
    report that hit too, as the group's output (and the API's ``cached_tokens``) is whichever sample finished
    last.  Hand count: 30 tokens, blocks of 4, a warm cache holds 7 full blocks = 28 tokens (it said 0)."""
    prompt = list(range(100, 130))
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=64, device="cpu",
                       enable_prefix_caching=True)
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64)
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, ignore_eos=True), request_id="warm")
    for _ in steps(engine):
        pass
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(n=3, max_tokens=2, ignore_eos=True,
                                                                    temperature=1.0, seed=1), request_id="g")
    seen = {}
    while engine.has_unfinished_requests():
        seen.update({rid: r.num_cached_tokens for rid, r in engine.requests.items()})
        outs = engine.step()
    assert seen == {"g#0": 28, "g#1": 28, "g#2": 28}
    assert [o.num_cached_tokens for o in outs if o.request_id == "g"] == [28]


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_request_that_shared_a_cached_prefix_hands_the_cache_only_the_blocks_it_computed(kind):
    """A request that found 3 cached blocks and then fills a 4th offers the cache that one block: ``extend`` from
    the last shared block with its 4 tokens, not a whole insert of all 16 again.  ``share_prefix`` records the
    shared blocks as already offered; counted as none, every hit request re-walked its whole prefix once (the
    cache ends up the same, so only the work shows).  Oracle: a hand count of what crosses into the cache."""
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 4, prefix_cache=make_prefix_cache(kind, pool, 4))
    first = Request("first", list(range(100, 113)), SamplingParams(max_tokens=4), 0.0)
    assert kv.allocate_slots(first, 13)
    first.num_computed_tokens = 13
    kv.cache_full_blocks(first)  # 3 full blocks cached
    second = Request("second", list(range(100, 117)), SamplingParams(max_tokens=4), 0.0)
    hit = kv.match_prefix(second)
    assert hit.num_tokens == 12
    kv.share_prefix(second, hit)
    calls = []
    cache = kv.prefix_cache
    insert, extend = cache.insert, cache.extend
    cache.insert = lambda tokens, blocks, ns=None: (calls.append(("insert", len(tokens))), insert(tokens, blocks, ns))[1]
    cache.extend = lambda parent, tokens, blocks, ns=None: (calls.append(("extend", len(tokens))),
                                                            extend(parent, tokens, blocks, ns))[1]
    assert kv.allocate_slots(second, 5)
    second.num_computed_tokens = 16
    kv.cache_full_blocks(second)
    assert calls == [("extend", 4)]
    assert cache.match(second.all_token_ids, kv.namespace(second)) == second.block_ids[:4]


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_request_that_found_a_twin_caches_nothing_more_and_leaves_the_twin_evictable(kind):
    """Two requests computed the same 8-token prompt side by side; the first cached it, so the second found a twin
    and keeps its own blocks uncached.  Its later blocks must stay out of the cache too: hung below the twin, a
    block the second request holds would pin the twin's blocks (a cached block above a held one cannot go), so
    once the first request has finished they could not be evicted while the second runs.  Hand count: after the
    second request fills a third block, the cache holds the twin's 2 blocks, both evictable, and evicts both."""
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 4, prefix_cache=make_prefix_cache(kind, pool, 4))
    prompt = list(range(200, 208))
    first, second = (Request(rid, prompt + [9], SamplingParams(max_tokens=8), 0.0) for rid in ("first", "second"))
    for req in (first, second):
        assert kv.allocate_slots(req, 9)
        req.num_computed_tokens = 9
        kv.cache_full_blocks(req)
    assert kv.prefix_cache.match(prompt, kv.namespace(first)) == first.block_ids[:2] != second.block_ids[:2]
    kv.free(first)
    second.output_token_ids += [1, 2, 3]  # three decodes fill the request's third block
    assert kv.allocate_slots(second, 3)
    second.num_computed_tokens = 12
    kv.cache_full_blocks(second)
    assert kv.prefix_cache.num_cached_blocks == 2 and not kv.prefix_cache.is_cached(second.block_ids[2])
    assert kv.prefix_cache.evict(2) == 2
