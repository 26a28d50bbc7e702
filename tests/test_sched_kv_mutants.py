"""Tests from a second hand mutation pass over the scheduler and the KV cache manager (``scheduler.py``,
``kv_cache_manager.py``, ``block_pool.py``, ``sched/output.py``): each pins a behaviour that a planted bug
changed while every existing test still passed.

Everything runs on the simulated executor.  The oracles are independent of the counters under test: a
recount of what each step's rows really (re)computed, made from the batches the executor receives, and a
hand-built batch.

The tests from ``test_kv_cache_usage_...`` on (KV usage, the pool adapter, the pool's boundaries, a forked
sample's copy) come from a third pass, over the KV manager, the pool and the prefix caches only; their oracles are
recounts of the blocks the live tables hold, a five-method pool written plainly here, and hand counts.
"""

from __future__ import annotations

import random

import pytest

from minivllm.sampling_params import SamplingParams

from tests.invariants import KVContents, assert_no_leak, drain, tiny_engine
from tests.learner_pools import LearnersPool


class RecountsRecompute(KVContents):
    """Counts, from the rows it runs, the tokens computed a second time: a row's positions below the furthest
    position its request had already computed.  And, on the step a request starts over after a recompute
    preemption, checks that the request knows how far it had got (``num_tokens_computed_once``, which WFQ reads
    so that a re-prefill is not charged as service twice)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.reached: dict[str, int] = {}
        self.recomputed = 0
        self.restarts = 0
        self.forgot: list[str] = []

    def execute(self, batch):
        for s in batch.seqs:
            rid, end = s.request.request_id, s.start + s.num_tokens
            reached = self.reached.get(rid, 0)
            self.recomputed += max(0, min(end, reached) - s.start)
            if s.start == 0 and reached:
                self.restarts += 1
                if s.request.num_tokens_computed_once != reached:
                    self.forgot.append(f"{rid}: knows {s.request.num_tokens_computed_once}, reached {reached}")
            self.reached[rid] = max(reached, end)
        return super().execute(batch)


def test_recomputed_tokens_and_the_furthest_point_reached_match_a_recount_of_the_rows_run():
    """Kills: a recompute preemption that does not add the victim's computed tokens to ``recomputed_tokens``
    (the ``vllm:num_recomputed_tokens`` counter; the labs' cost of recompute reads it).  It also fails when a
    preemption does not keep ``num_tokens_computed_once`` (WFQ then charges each re-prefill as new service; a
    WFQ test in test_fairness.py catches that one only through its effect on fairness).  Oracle: the rows the
    executor ran -- every position a request computes again is below the furthest it reached before."""
    ex = RecountsRecompute(4)
    engine = tiny_engine(num_blocks=6, max_seqs=3, max_len=20)
    engine.executor = ex
    for i in range(3):
        engine.add_request({"prompt_token_ids": [10 + i] * 7}, SamplingParams(max_tokens=10, ignore_eos=True))
    drain(engine)
    stats = engine.stats()
    assert stats["num_recompute_preemptions"] > 0 and ex.restarts > 0, "the workload must preempt by recompute"
    assert stats["recomputed_tokens"] == ex.recomputed
    assert not ex.forgot, ex.forgot
    assert_no_leak(engine)


def test_a_one_token_prefill_row_is_not_counted_as_a_decode_token():
    """Kills: ``ScheduledBatch.num_decode_tokens`` counting one-token rows instead of decode rows.  A forked
    ``n > 1`` sample's first row (its last prompt token) and the last one-token chunk of a prompt are prefill
    work; the step log and the prefill/decode split of a step's cost read this count.  Hand-built batch: one
    decode row, one one-token prefill row, one 3-token prefill row."""
    from minivllm.request import Request
    from minivllm.sched.output import ScheduledBatch, ScheduledSeq

    reqs = [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=4), 0.0) for i in range(3)]
    batch = ScheduledBatch([ScheduledSeq(reqs[0], 1, 4, True), ScheduledSeq(reqs[1], 1, 3, False),
                            ScheduledSeq(reqs[2], 3, 0, False)])
    assert batch.num_decode_tokens == 1
    assert batch.num_prefill_tokens == 4
    assert batch.num_tokens == 5


class RecountsCacheHits(KVContents):
    """Reads the prefix cache's work off the rows it runs: a request's first row starts at the tokens its first
    lookup found (``prefix_cache_hits``), and the first row after each recompute preemption (the step's
    ``batch.preempted`` names the victims) starts at the tokens it found again (``recompute_hit_tokens``)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.seen: set[str] = set()
        self.restarting: set[str] = set()
        self.first_hits = 0
        self.restart_hits = 0
        self.restarts = 0

    def execute(self, batch):
        for s in batch.seqs:
            rid = s.request.request_id
            if rid not in self.seen:
                self.seen.add(rid)
                self.first_hits += s.start
            elif rid in self.restarting:
                self.restarting.discard(rid)
                self.restarts += 1
                self.restart_hits += s.start
        self.restarting.update(r.request_id for r in batch.preempted)
        return super().execute(batch)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_tokens_a_preempted_request_finds_again_are_counted_exactly_as_recompute_hits(kind):
    """Kills: ``record_admission`` crediting a re-admitted request with anything but the tokens its lookup
    found again (its prompt length, one block, nothing); the other tests only asked for "more than zero".
    Lab 4 weighs recompute against swap with this count.  Oracle: where each restarted request's first row
    begins, as the executor sees it; and the same for a first admission's hits.  Two requests share a 12-token
    prefix so that both kinds of hit occur."""
    ex = RecountsCacheHits(4)
    engine = tiny_engine(num_blocks=14, max_seqs=3, max_len=40, prefix=kind)
    engine.executor = ex
    shared = list(range(50, 62))
    for i in range(3):
        engine.add_request({"prompt_token_ids": shared + [10 + i] * 5}, SamplingParams(max_tokens=14, ignore_eos=True))
    drain(engine)
    stats = engine.stats()
    assert ex.restarts > 0 and stats["num_recompute_preemptions"] >= ex.restarts, "the workload must restart requests"
    assert ex.restart_hits > 0 and ex.first_hits > 0, "both kinds of hit must occur for the test to mean anything"
    assert stats["recompute_hit_tokens"] == ex.restart_hits
    assert stats["prefix_cache_hits"] == ex.first_hits
    assert_no_leak(engine)

class SeesForkRestarts(RecountsCacheHits):
    """:class:`RecountsCacheHits`, also noting each restarted sample whose first row starts past what the prefix
    cache holds of its tokens at that moment (the cache's own ``peek``): tokens it got back from its leader."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.engine = None
        self.beyond_cache: list[tuple[str, int, int]] = []

    def execute(self, batch):
        kv = self.engine.kv
        for s in batch.seqs:
            req = s.request
            if req.request_id in self.restarting and req.leader is not None:
                cached = kv.prefix_cache.peek(req.all_token_ids[:-1], kv.namespace(req)) * kv.block_size
                if s.start > cached:
                    self.beyond_cache.append((req.request_id, s.start, cached))
        return super().execute(batch)


def test_recompute_hits_count_what_a_restarted_sample_shares_again_with_its_leader():
    """``recompute_hit_tokens`` counts the tokens a restarted request did not compute again, and a sample
    re-admitted while its leader runs gets its prompt back from the leader's blocks (``fork``: all but the last
    prompt token), part of which no cache lookup would give it.  The stat's comment said "got back from the
    cache", which this workload shows false.  Oracle: where each restarted request's first row begins, as the
    executor sees it, and the cache's own ``peek`` of the restarted sample's tokens at that moment.  (A mixed
    workload of n = 1..3 requests sharing a prefix; the seed is one where such a restart happens.)"""
    rnd = random.Random(4)
    ex = SeesForkRestarts(4)
    engine = tiny_engine(num_blocks=10, max_len=40, prefix="radix")
    ex.engine, engine.executor = engine, ex
    base = [rnd.randrange(1, 50) for _ in range(12)]
    for i in range(14):
        prompt = base[:rnd.randrange(0, 13)] + [rnd.randrange(1, 50) for _ in range(rnd.randrange(1, 14))]
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(n=rnd.choice([1, 2, 3]),
                           max_tokens=rnd.randrange(1, 14), temperature=1.0, seed=i), request_id=f"r{i}")
        for _ in range(rnd.randrange(0, 3)):
            engine.step()
    drain(engine)
    assert ex.beyond_cache, "the workload must restart a sample past what the cache holds of it"
    assert engine.stats()["recompute_hit_tokens"] == ex.restart_hits
    assert_no_leak(engine)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_kv_cache_usage_counts_the_blocks_requests_hold_not_the_idle_cached_ones(kind):
    """Kills: ``KVCacheManager.usage`` reading the free list alone, so that blocks only the prefix cache keeps
    count as used.  ``usage`` is ``kv_cache_usage`` in ``stats()`` and the ``vllm:kv_cache_usage_perc`` gauge;
    its promise is "blocks held by requests (cached-only blocks count as free)": with a warm cache and nothing
    running it must read 0, not the cache's size.  Oracle: a recount of the distinct blocks in the live
    requests' tables after every step.  Requests run one after another (each hits the one before), so every
    cached block a request does not hold has nothing locked below it and is evictable."""
    engine = tiny_engine(num_blocks=16, max_len=40, prefix=kind)
    system = list(range(50, 62))
    seen = []

    def recount(e):
        held = {b for r in list(e.scheduler.running) + list(e.scheduler.waiting) for b in r.block_ids}
        seen.append(len(held))
        assert e.stats()["kv_cache_usage"] == pytest.approx(len(held) / e.pool.num_blocks)

    for i in range(3):
        engine.add_request({"prompt_token_ids": system + [10 + i] * 3}, SamplingParams(max_tokens=6, ignore_eos=True))
        drain(engine, each=recount)
    assert max(seen) > 0 and engine.prefix_cache.num_cached_blocks > 0, "the cache must be warm for this to mean anything"
    assert engine.stats()["kv_cache_usage"] == 0.0
    assert_no_leak(engine)


@pytest.mark.parametrize("seed", range(4))
def test_the_pool_adapter_and_the_engines_pool_agree_on_every_answer(seed):
    """Kills, in :class:`PoolAdapter` (lab 2 runs the engine on a learner's pool through it): a copy-on-write
    that keeps the caller's reference on the shared block (a leak), a ``free_all`` that frees head-first (the
    block ids a later request gets change, so the learner's step log parts from the reference one), and an
    ``allocate_many`` that refuses an exact fit.  The lab's own check compares only the step log's request ids,
    which none of these change.  Oracle: the engine's :class:`BlockPool`, driven with the same random calls,
    and a recount of the holders each call adds or drops."""
    import random
    from collections import Counter

    from minivllm.kv.block_pool import BlockPool, OutOfBlocksError, PoolAdapter

    rng = random.Random(seed)
    n = 6
    ref, ada = BlockPool(n), PoolAdapter(LearnersPool(n), n)
    tables: list[list[int]] = []
    for _ in range(300):
        op = rng.choice(["many", "many", "share", "cow", "free"])
        if op == "many":
            k = rng.randint(0, n)
            if k > ref.num_free:
                for pool in (ref, ada):
                    with pytest.raises(OutOfBlocksError):
                        pool.allocate_many(k)
                continue
            got = ref.allocate_many(k)
            assert ada.allocate_many(k) == got
            tables.append(got)
        elif op == "share" and tables:
            t = list(rng.choice(tables))
            for b in t:
                ref.incref(b)
                ada.incref(b)
            tables.append(t)
        elif op == "cow" and tables and ref.num_free:
            t = rng.choice(tables)
            if t:
                i = rng.randrange(len(t))
                got = ref.copy_on_write(t[i])
                assert ada.copy_on_write(t[i]) == got
                t[i] = got[0]
        elif op == "free" and tables:
            t = tables.pop(rng.randrange(len(tables)))
            ref.free_all(t)
            ada.free_all(t)
        holders = Counter(b for t in tables for b in t)
        assert [ada.refcount(b) for b in range(n)] == [holders[b] for b in range(n)]
        assert [ref.refcount(b) for b in range(n)] == [holders[b] for b in range(n)]
        assert ada.num_free == ref.num_free == sum(1 for b in range(n) if not holders[b])
        assert ada.num_used == ref.num_used
    for t in tables:
        ref.free_all(t)
        ada.free_all(t)
    # the free lists' order is the allocate/free history: both must hand out the same ids next
    assert ada.allocate_many(n) == ref.allocate_many(n)


@pytest.mark.parametrize("adapted", [False, True], ids=["BlockPool", "PoolAdapter"])
def test_copy_on_write_on_a_dry_pool_raises_with_the_callers_reference_still_held(adapted):
    """Kills a copy-on-write that drops the caller's reference on the shared block before it takes the copy
    (in :class:`BlockPool` or :class:`PoolAdapter`).  On a dry pool the allocation then raises after the
    reference is gone, yet the caller's block table still lists the block: its later free drops a reference
    that belongs to another holder, and the block returns to the free list while that holder still reads it.
    The random agreement test above never copies on a dry pool, so it cannot see the order.
    Oracle: a hand count of holders (two before the call, two after the refused call)."""
    from minivllm.kv.block_pool import BlockPool, OutOfBlocksError, PoolAdapter

    pool = PoolAdapter(LearnersPool(2), 2) if adapted else BlockPool(2)
    shared = pool.allocate()
    pool.incref(shared)  # two holders: the caller and, say, a sibling sample
    pool.allocate()  # the pool is dry now
    with pytest.raises(OutOfBlocksError):
        pool.copy_on_write(shared)
    assert pool.refcount(shared) == 2 and pool.num_free == 0


def test_block_pool_takes_an_exact_fit_and_refuses_a_reference_on_a_free_block():
    """Kills: ``allocate_many`` refusing ``n == num_free`` (a request needing exactly the free blocks would
    wait forever in a learner's replay), and ``incref`` accepting a free block -- that reference would sit on a
    block the free list still hands out, the double-free guard's mirror image.  Oracle: hand counts."""
    from minivllm.kv.block_pool import BlockPool

    pool = BlockPool(3)
    assert pool.allocate_many(3) == [0, 1, 2] and pool.num_free == 0
    pool.free_all([0, 1, 2])
    with pytest.raises(ValueError, match="free block"):
        pool.incref(1)
    assert pool.refcount(1) == 0 and pool.num_free == 3


@pytest.mark.parametrize("new_tokens, free_left", [(1, 0), (4, 1)], ids=["copy-only", "copy-and-a-block"])
def test_allocate_slots_counts_the_private_copy_and_changes_nothing_when_it_is_short(new_tokens, free_left):
    """Kills: ``allocate_slots`` checking room for its new blocks but not for the copy of a shared last block.
    Its promise is all or nothing: short of room it returns False and changes nothing, so the scheduler can
    preempt and retry.  Counting without the copy it went ahead and hit an empty free list half way
    (``OutOfBlocksError`` out of the step, a table half grown).  Oracle: hand counts -- a sample forked from a
    6-token prompt (block size 4) shares both prompt blocks and writes its 6th token into the second, so it needs
    one private copy, plus one block when it also takes tokens 7 to 9."""
    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.kv_cache_manager import KVCacheManager
    from minivllm.request import Request

    pool = BlockPool(3 + free_left)
    kv = KVCacheManager(pool, 4)
    params = SamplingParams(max_tokens=4)
    parent = Request("p", list(range(6)), params, 0.0)
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = Request("c", list(range(6)), params, 0.0)
    kv.fork(parent, child)
    other = Request("o", [7], params, 0.0)
    assert kv.allocate_slots(other, 1)  # takes the third block: exactly ``free_left`` stay free
    assert pool.num_free == free_left
    before = (list(child.block_ids), [pool.refcount(b) for b in range(pool.num_blocks)], pool.num_free)
    assert kv.allocate_slots(child, new_tokens) is False
    assert (list(child.block_ids), [pool.refcount(b) for b in range(pool.num_blocks)], pool.num_free) == before
    assert not kv.take_block_moves()
    kv.free(other)  # one more block: now the copy (and the new block) fit
    assert kv.allocate_slots(child, new_tokens)
    assert kv.take_block_moves().copies == [(parent.block_ids[1], child.block_ids[1])]
    for r in (parent, child):
        kv.free(r)
    assert pool.num_free == pool.num_blocks


def _prefix_run(kind: str, plain: bool) -> list:
    """A tight pool, a shared prefix and a warm cache: what the scheduler saw after every step."""
    from minivllm.kv.block_pool import PoolAdapter
    from minivllm.labs import workloads

    engine = tiny_engine(num_blocks=12, max_seqs=3, max_len=40, prefix=kind)
    if plain:
        engine.kv.replace_pool(PoolAdapter(LearnersPool(12), 12))
    system = list(range(50, 58))
    for i in range(6):
        engine.add_request({"prompt_token_ids": system + [10 + i] * (3 + i % 3)},
                           SamplingParams(max_tokens=8, ignore_eos=True), f"r{i}")
    seen = []

    def record(e):
        assert not e.executor.wrong, e.executor.wrong[0]
        seen.append(([(r.request_id, tuple(r.block_ids)) for r in e.scheduler.running],
                     e.kv.num_available_blocks, e.pool.num_free))

    finals = workloads.drain(engine, max_steps=2000, each=record)
    assert len(finals) == 6
    engine.prefix_cache.reset()
    assert engine.pool.num_free == 12
    return seen


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_learner_pool_with_prefix_caching_runs_step_for_step_like_the_engines_pool(kind):
    """Kills: the recount of pinned cached blocks (used for a pool that cannot report sharing, as a lab 2
    learner's pool behind :class:`PoolAdapter` cannot) counting every cached block as pinned: the cache then
    reports nothing evictable, admission waits for blocks eviction would give, and the learner's run parts
    from the reference run.  Also fails for an adapter that frees head-first (the block ids part).
    Oracle: the same workload on the engine's own :class:`BlockPool`, whose evictable count the prefix cache
    keeps from the pool's sharing reports (checked against a brute-force model in test_prefix_cache.py):
    every step's running tables, available blocks and free blocks must match."""
    reference = _prefix_run(kind, plain=False)
    assert any(avail > free for _, avail, free in reference), "cached blocks must be evictable at some step"
    assert _prefix_run(kind, plain=True) == reference
