"""The KV hunt's reach past the existing invariant tests: per-tenant cache quotas over salted namespaces,
``extend`` (the one-block-at-a-time path the KV manager takes after a request's first insert), and the two cache
structures run side by side through the engine.

Why these: ``test_prefix_cache``'s brute-force model drives ``insert`` and ``match`` with one quota per namespace,
so the grouping the engine really uses (every salt of a tenant counted in one budget, evicted from one LRU) and
``extend`` were checked only on hand-built cases.  And no test ran the radix tree and the hash index through one
engine workload and compared them, although the engine must serve identically on either: same hits, same
evictions, same schedule, the same tokens.

The hunt found no defect; these tests pin the behaviour so a later change cannot drift unnoticed.  Oracles:

* the brute-force model of :mod:`prefix_model` (every cached prefix spelled out, the policy applied literally),
  here with a tenant's quota over all of its namespaces;
* the other cache structure on the same engine workload, step by step, with hand counts of the hit counters
  (a lookup per request, of its whole prompt; the hits are the cached tokens each request reports) and a
  recount of every KV slot attended (:class:`invariants.KVContents`).
"""

from __future__ import annotations

import random
from collections.abc import Hashable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix import make_prefix_cache
from tests.fuzz import examples

from invariants import KVContents, assert_no_leak, check_both_tiers  # noqa: E402  (tests/ is on sys.path)
from prefix_model import BruteForceModel  # noqa: E402

BS = 2
POOL = 40
TENANT_QUOTAS = {"a": 3}  # tenant "a" has its own quota; "b" falls back to the engine-wide one
NAMESPACES = (("a", None), ("a", "salt"), ("b", None))
HEADS = ((), (0, 1, 2, 3), (0, 1, 2, 3, 0, 0), (0, 1, 3, 3), (2, 2))


def tenant_of(namespace: Hashable) -> Hashable:
    return namespace[0]


class World:
    """One cache on its own pool, its model, and the requests running on it (tables it holds references on)."""

    def __init__(self, kind: str, quota: int | None, grouped: bool) -> None:
        self.pool = BlockPool(POOL)
        groups = dict(quota_group=tenant_of, quota_for=TENANT_QUOTAS.get) if grouped else {}
        self.cache = make_prefix_cache(kind, self.pool, BS, quota_blocks=quota, **groups)
        self.model = BruteForceModel(self.pool, quota, BS, group=tenant_of if grouped else None,
                                     quota_for=TENANT_QUOTAS.get if grouped else None)
        self.content: dict[int, tuple] = {}  # block -> (namespace, the token prefix whose last block it holds)
        self.requests: dict[int, dict] = {}
        self.pins: list[int] = []

    def cached(self) -> list:
        return sorted((self.content[b] for b in range(POOL) if self.cache.is_cached(b)), key=repr)

    def check(self) -> None:
        model = {key: blk.block_id for key, blk in self.model.cached.items()}
        real = {self.content[b]: b for b in range(POOL) if self.cache.is_cached(b)}
        assert real == model
        assert self.cache.num_evictable_blocks() == self.model.num_evictable()
        for ns in NAMESPACES:
            quota = self.model.quota_of(ns)
            assert quota is None or self.model.count(ns) <= quota
        stats = self.cache.stats
        assert stats.inserted_blocks - stats.evicted_blocks == self.cache.num_cached_blocks


def start(w: World, rid: int, tokens: tuple, ns: Hashable) -> list | None:
    hit = w.cache.match(tokens, ns)
    assert hit == w.model.match(ns, tokens)
    for b in hit:
        w.pool.incref(b)
    need = len(tokens) // BS - len(hit)
    if need > w.pool.num_free:
        w.pool.free_all(hit)
        return None
    table = list(hit)
    for i in range(len(hit), len(hit) + need):
        table.append(w.pool.allocate())
        w.content[table[-1]] = (ns, tokens[: (i + 1) * BS])
    w.requests[rid] = {"tokens": tokens, "ns": ns, "table": table, "done": len(hit), "stopped": False}
    return [w.content[b] for b in hit]


def compute(w: World, rid: int, upto: int) -> bool:
    """The KV manager's ``cache_full_blocks``: ``extend`` below the last block cached before, else ``insert``;
    a request whose prefix twin was cached first caches nothing more.  The model inserts the whole prefix."""
    r = w.requests[rid]
    done, table, tokens, ns = r["done"], r["table"], r["tokens"], r["ns"]
    expected = w.model.insert(ns, tokens[: upto * BS], table[:upto]).block_ids
    r["done"] = upto
    if done and w.cache.extend(table[done - 1], tokens[done * BS: upto * BS], table[done:upto], ns):
        assert expected == table[:upto], "extend cached below a prefix the model holds in other blocks"
        return False
    result = w.cache.insert(tokens[: upto * BS], table[:upto], ns)
    assert result.block_ids == expected
    r["stopped"] = result.block_ids != table[:upto]
    return r["stopped"]


def run_program(seed: int) -> None:
    rnd = random.Random(seed)
    quota, grouped = rnd.choice([None, 2, 4]), rnd.random() < 0.7
    worlds = [World(kind, quota, grouped) for kind in ("radix", "hash")]
    for rid in range(60):
        op = rnd.choice(["start", "start", "compute", "compute", "finish", "evict", "match", "pin", "unpin"])
        running = sorted(r for r, req in worlds[0].requests.items() if not req["stopped"])
        if op in ("start", "match"):
            tokens = rnd.choice(HEADS) + tuple(rnd.randint(0, 3) for _ in range(rnd.randint(0, 6)))
            ns = rnd.choice(NAMESPACES)
            if op == "start":
                hits = [start(w, rid, tokens, ns) for w in worlds]
            else:
                hits = [[w.content[b] for b in w.cache.match(tokens, ns)] for w in worlds]
                assert all(h == [w.content[b] for b in w.model.match(ns, tokens)] for h, w in zip(hits, worlds))
            assert hits[0] == hits[1]
        elif op == "compute" and running:
            rid = rnd.choice(running)
            req = worlds[0].requests[rid]
            if req["done"] < len(req["table"]):
                upto = rnd.randint(req["done"] + 1, len(req["table"]))
                assert len({compute(w, rid, upto) for w in worlds}) == 1
        elif op == "finish" and worlds[0].requests:
            rid = rnd.choice(sorted(worlds[0].requests))
            for w in worlds:
                w.pool.free_all(w.requests.pop(rid)["table"])
        elif op == "evict":
            n = rnd.randint(1, 4)
            for w in worlds:
                expected = len(w.model.evict(n))  # (first: the model reads refcounts, which the real eviction changes)
                assert w.cache.evict(n) == expected
        elif op == "pin" and worlds[0].cached():
            target = rnd.choice(worlds[0].cached())  # a lone extra holder, anywhere on a cached path
            for w in worlds:
                block = next(b for b in range(POOL) if w.cache.is_cached(b) and w.content[b] == target)
                w.pool.incref(block)
                w.pins.append(block)
        elif op == "unpin" and worlds[0].pins:
            i = rnd.randrange(len(worlds[0].pins))
            for w in worlds:
                w.pool.decref(w.pins.pop(i))
        for w in worlds:
            w.check()
        assert worlds[0].cached() == worlds[1].cached()
    for w in worlds:
        for r in w.requests.values():
            w.pool.free_all(r["table"])
        for b in w.pins:
            w.pool.decref(b)
        w.cache.reset()
        assert w.pool.num_free == POOL, "blocks leaked"


@settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_both_caches_follow_the_model_with_tenant_quotas_over_salts_and_extend(seed):
    """Random request traffic on a radix tree and a hash index, each against the brute-force model after every
    operation: hits, what is cached (block for block), evictions, the evictable count, each tenant's quota (its
    salted and unsalted namespaces in one budget) -- and against each other."""
    run_program(seed)


# -- recency that only an eviction order shows -------------------------------------------------------------------

A, B, C, D, E = ((t, t) for t in range(5))  # one 2-token block each


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_an_inner_block_is_as_recent_as_the_extension_below_it_once_that_is_evicted(kind):
    """``extend`` hangs a block below a request's last cached one without walking from the root, yet the prefix
    above it was used then too: once the extension is evicted, that prefix must not look older than a leaf used
    in between.  The radix tree makes the whole path recent; the hash index touches only the parent entry and
    hands recency up as children go (``HashEntry.last_used``).  A locked leaf lets the extension go first.

    Hand count, ticks in brackets: A-B [1]; A-C [3] (A becomes inner); D [4], held; C-E by extend [5]; evict 3:
    B [1], then D is held, so E and C [5]; D released; evict 1 must take D [4], not A (used at [5], not [3])."""
    pool = BlockPool(8)
    cache = make_prefix_cache(kind, pool, BS)
    a, b = pool.allocate_many(2)
    cache.insert(A + B, [a, b])  # tick 1
    pool.free_all([a, b])
    assert cache.match(A + C, ()) == [a]  # tick 2: a second request shares A ...
    pool.incref(a)
    c = pool.allocate()
    cache.insert(A + C, [a, c])  # tick 3: ... and caches C below it
    d = pool.allocate()
    cache.insert(D, [d])  # tick 4: another request, still running (D locked)
    e = pool.allocate()
    assert cache.extend(c, E, [e])  # tick 5: the second request fills one more block
    pool.free_all([a, c, e])  # and finishes
    assert cache.evict(3) == 3
    assert [cache.is_cached(x) for x in (a, b, c, d, e)] == [True, False, False, True, False]
    pool.decref(d)  # the first request finishes: D is evictable, last used at tick 4
    assert cache.evict(1) == 1
    assert cache.is_cached(a) and not cache.is_cached(d), "A was used at tick 5, D at tick 4: D goes first"


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_an_insert_that_finds_its_blocks_already_cached_makes_them_recent(kind):
    """Two requests prefill one prompt in the same step (twins): the second's insert finds every block cached
    by the first and caches nothing, but it used that prefix, so the prefix is as recent as the insert -- an
    insert makes its path recent even when it adds no block.  Hand count: twin starts [1], [2]; first inserts
    A-B [3]; D cached [4]; the twin's insert [5]; evict 1 takes D."""
    pool = BlockPool(8)
    cache = make_prefix_cache(kind, pool, BS)
    assert cache.match(A + B, ()) == []  # tick 1
    first = pool.allocate_many(2)
    assert cache.match(A + B, ()) == []  # tick 2
    twin = pool.allocate_many(2)
    cache.insert(A + B, first)  # tick 3
    d = pool.allocate()
    cache.insert(D, [d])  # tick 4
    pool.decref(d)
    result = cache.insert(A + B, twin)  # tick 5: nothing new, the first's blocks are canonical
    assert result.block_ids == first
    pool.free_all(first)
    pool.free_all(twin)
    assert cache.evict(1) == 1
    assert not cache.is_cached(d) and all(map(cache.is_cached, first)), "A-B was used at tick 5, D at tick 4"


# -- the engine on either structure ---------------------------------------------------------------------------


def _engine(kind: str, cfg: dict) -> LLMEngine:
    config = EngineConfig(enable_prefix_caching=True, prefix_cache=kind, block_size=4, device="cpu", max_model_len=32,
                          **cfg)
    return LLMEngine(config, executor=KVContents(4), model_max_len=32, eos_token_ids=set())


ENGINE_HEADS = ([], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [7] * 9)


def serve_on_both(seed: int) -> None:
    rnd = random.Random(seed)
    mode = rnd.choice(["recompute", "swap"])
    cfg = dict(num_gpu_blocks_override=rnd.choice([10, 14, 20]), max_num_batched_tokens=rnd.choice([16, 32]),
               max_num_seqs=rnd.choice([3, 6]), preemption_mode=mode,
               scheduling_policy=rnd.choice(["fcfs", "wfq"]),
               share_prefix_cache_across_tenants=rnd.random() < 0.3,
               prefix_cache_quota_blocks=rnd.choice([None, None, 2, 5]))
    if rnd.random() < 0.5:
        cfg["tenants"] = (("a", TenantConfig(max_cache_share=0.2)),)
    if mode == "swap":
        cfg["num_cpu_blocks_override"] = 30
    engines = [_engine(kind, cfg) for kind in ("radix", "hash")]
    work = [(rnd.randint(0, 6), rnd.choice("ab"), rnd.choice([None, None, "s"]),
             rnd.choice(ENGINE_HEADS) + [rnd.randint(1, 9) for _ in range(rnd.randint(1, 6))],
             rnd.randint(1, 10), rnd.choice([1, 1, 2, 3])) for _ in range(rnd.randint(3, 9))]
    finals: dict = {}
    for step in range(400):
        for i, (at, tenant, salt, prompt, max_tokens, n) in enumerate(work):
            if at == step:
                body = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}
                for e in engines:
                    e.add_request(body, SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True, seed=i), f"r{i}",
                                  tenant=tenant)
        if step > 6 and not any(e.has_unfinished_requests() for e in engines):
            break
        outs = []
        for e in engines:
            outs.append(sorted((o.request_id, [c.token_ids for c in o.outputs], o.finished, o.num_cached_tokens)
                               for o in e.step()))
            check_both_tiers(e)
        assert outs[0] == outs[1], f"step {step}: the two caches served differently"
        finals.update((o[0], o) for o in outs[0] if o[2])
        stats = [e.stats() for e in engines]
        assert stats[0] == stats[1], f"step {step}: the two caches counted differently"
        for e in engines:
            _check_tenant_quotas(e, cfg)
    assert not any(e.has_unfinished_requests() for e in engines)
    st0 = engines[0].stats()
    if all(n == 1 for *_, n in work):  # one lookup per request, of its whole prompt; its hits are its cached tokens
        assert st0["prefix_cache_queries"] == sum(len(prompt) for _, _, _, prompt, _, _ in work)
        assert st0["prefix_cache_hits"] == sum(o[3] for o in finals.values())
    for e in engines:
        assert_no_leak(e)


def _check_tenant_quotas(engine: LLMEngine, cfg: dict) -> None:
    """Recount each tenant's cached blocks, all its salts together, against its quota."""
    cache = engine.prefix_cache
    per_tenant: dict = {}
    holders = cache._node_of_block if hasattr(cache, "_node_of_block") else cache._entry_of_block  # block -> node
    for node in holders.values():
        per_tenant[node.namespace[0]] = per_tenant.get(node.namespace[0], 0) + 1
    for tenant, n in per_tenant.items():
        quota = cfg["prefix_cache_quota_blocks"]
        if tenant == "a" and "tenants" in cfg:
            quota = max(1, int(0.2 * engine.pool.num_blocks))
        assert quota is None or n <= quota, f"tenant {tenant!r} keeps {n} cached blocks over its quota of {quota}"


@pytest.mark.parametrize("seed", range(60))
def test_the_engine_serves_and_counts_alike_on_the_radix_tree_and_the_hash_index(seed):
    """A random workload (shared prefixes, salts, two tenants with cache quotas, ``n > 1``, preemption by
    recompute or swap) on two engines that differ only in the cache structure: every step's outputs, cached
    tokens and ``stats()`` agree, each tenant stays within its quota, every attended KV slot holds its token,
    and with ``n = 1`` the hit counters equal a hand count."""
    serve_on_both(seed)
