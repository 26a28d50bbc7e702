"""The per-tenant KV block count that ``stats()`` reuses from the step log, kept right by the KV manager's
``table_changes`` marker.

``LLMEngine._tenant_blocks`` hands back the count the step log took when the running requests are the same ones
and ``KVCacheManager.table_changes`` has not moved since.  Two things must hold for that to be right:

1. every change to a block table moves the marker -- checked at the KV manager itself: each of its methods is
   watched, and a call after which some request's table differs from a snapshot taken before it must have moved
   the marker (the oracle is the snapshot, not the manager's word), with every kind of change reached;
2. ``stats()``'s ``kv_blocks`` equals a brute-force recount (the union of each tenant's running tables) at every
   point a caller can read it: after a step, after an abort or an add between steps, after an abort deferred
   from inside a step, between the stages of a step walked by hand (lab 1; lab 2's checker runs ``allocate`` on
   its own), under swap and recompute preemption, with prefix hits, forks and copy-on-write -- and on a
   learner's pool (lab 2) as on the engine's.

And a read after a step costs no pass over any table (what the marker is for).  Everything runs on the simulated
executor, in a few seconds.
"""

from __future__ import annotations

import random

import pytest

import minivllm.engine.llm_engine as llm_engine
from minivllm import EngineConfig, LLMEngine
from minivllm.config import TenantConfig
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.kv_cache_manager import KVCacheManager
from minivllm.labs.check_lab02 import install_pool
from minivllm.request import Request
from tests.learner_pools import LearnersPool
from minivllm.sampling_params import SamplingParams

from tests.invariants import KVContents, assert_no_leak, check_both_tiers

TENANTS = "abc"


def recount(engine: LLMEngine) -> dict[str, int]:
    """Each tenant's distinct device blocks, from its running requests' tables, counted from scratch."""
    held: dict[str, set[int]] = {}
    for r in engine.scheduler.running:
        held.setdefault(r.tenant, set()).update(r.block_ids)
    return {t: len(b) for t, b in held.items()}


def kv_blocks(engine: LLMEngine) -> dict[str, int]:
    return {t: row["kv_blocks"] for t, row in engine.stats()["per_tenant"].items() if row["num_running"]}


class AbortsInsideAStep(KVContents):
    """:class:`KVContents`, plus an abort asked from inside the step (as a callback or a finalizer would): the engine
    defers it to the step's end, after the step log has kept its count."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.engine: LLMEngine | None = None
        self.abort_next: str | None = None
        self.copies = 0
        self.deferred = 0

    def execute(self, batch):
        self.copies += len(batch.moves.copies)
        if self.abort_next is not None and self.engine._in_step:  # (a step walked by hand is not "in" one)
            self.engine.abort_request(self.abort_next)
            self.abort_next = None
            self.deferred += 1
        return super().execute(batch)


def engine_for(mode: str, max_kv_share: float | None = None) -> LLMEngine:
    """A small pool (it preempts every few steps), prefix caching, three tenants, 4-token blocks.  ``max_kv_share``:
    a KV cap per tenant, under which the scheduler grows each table through ``allocate_slots`` (without caps,
    full tables grow in one batch loop first: ``grow_full_tables``)."""
    tenants = {t: TenantConfig(max_kv_share=max_kv_share) for t in TENANTS}
    cfg = EngineConfig(num_gpu_blocks_override=44, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                       max_model_len=96, device="cpu", enable_prefix_caching=True, preemption_mode=mode,
                       num_cpu_blocks_override=64, tenants=tenants)
    executor = AbortsInsideAStep(4)
    engine = LLMEngine(cfg, executor=executor, model_max_len=96, eos_token_ids=set())
    executor.engine = engine
    return engine


def add_workload(engine: LLMEngine, rng: random.Random, count: int, prefix: str = "q") -> None:
    """Prompts behind a shared 3-block system prompt (prefix hits), of lengths that often end inside a block
    (``n > 1`` samples fork onto a partly filled last block: copy-on-write)."""
    system = list(range(40, 52))
    for i in range(count):
        engine.add_request({"prompt_token_ids": system + [60 + i] * rng.randint(1, 9)},
                           SamplingParams(max_tokens=rng.randint(4, 24), n=rng.choice([1, 1, 2, 3])),
                           f"{prefix}{i}", tenant=rng.choice(TENANTS))


class Reads:
    """``stats()`` reads checked against the recount, and how many of them reused the step log's count."""

    def __init__(self, engine: LLMEngine, monkeypatch) -> None:
        self.engine, self.reads, self.fresh = engine, 0, 0
        counted = llm_engine.tenant_blocks

        def counting(*args, **kwargs):
            self.fresh += 1
            return counted(*args, **kwargs)

        monkeypatch.setattr(llm_engine, "tenant_blocks", counting)  # the engine's read-side count only

    def __call__(self, where: str) -> None:
        engine = self.engine
        got, want = kv_blocks(engine), recount(engine)
        self.reads += 1
        assert got == want, (where, engine.scheduler.stats.num_steps, got, want)

    @property
    def reused(self) -> int:
        return self.reads - self.fresh


def walk_by_hand(engine: LLMEngine, read: Reads) -> None:
    """One step stage by stage, as lab 1 walks it, ``stats()`` read after each stage."""
    s = engine.scheduler
    s.admit()
    read("admit")
    batch = s.build_batch()
    read("build_batch")
    batch = s.allocate(batch)
    read("allocate")
    sampled = engine.execute(batch)
    read("execute")
    grew = engine.append(batch, sampled)
    read("append")
    engine.finish(engine.emit(grew), batch)
    read("finish")
    engine.log_step(batch)
    read("log_step")


def run_with_every_kind_of_change(engine: LLMEngine, read: Reads, seed: int) -> None:
    """Steps, hand-walked steps, a lab-2 style ``allocate`` alone, aborts (whole, one sample, waiting, deferred
    from inside a step) and late adds, with a read after each."""
    rng = random.Random(seed)
    add_workload(engine, rng, 24)
    ids = sorted(engine._groups) + sorted(engine.requests)
    for k in range(3000):
        if not engine.has_unfinished_requests():
            break
        kind = k % 7
        if kind == 3:
            walk_by_hand(engine, read)
        elif kind == 5 and engine.scheduler.running:
            # lab 2's checker: allocate a built batch on its own, no step log after it (the step finishes next)
            s = engine.scheduler
            s.admit()
            batch = s.allocate(s.build_batch())
            read("allocate alone")
            grew = engine.append(batch, engine.execute(batch))
            engine.finish(engine.emit(grew), batch)
            read("finish")
        else:
            engine.step()
            read("step")
        if isinstance(engine.kv.pool, BlockPool):  # (the recount reads the engine pool's free list)
            check_both_tiers(engine)
        if k % 9 == 4 and ids:
            engine.abort_request(ids.pop(rng.randrange(len(ids))))  # a whole group, one sample, or a waiting one
            read("abort")
        if k % 9 == 7 and rng.random() < 0.5:
            victim = next((r.request_id for r in engine.scheduler.running), None)
            if victim is not None:
                engine.executor.abort_next = victim  # asked from inside the next step: deferred to its end
        if k == 20:
            add_workload(engine, rng, 6, prefix="late")
            read("add")
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("mode,cap,seed", [("swap", None, 7), ("recompute", None, 11), ("swap", 0.5, 7),
                                           ("recompute", 0.5, 11)])
def test_kv_blocks_equal_a_recount_after_every_kind_of_change(mode, cap, seed, monkeypatch):
    engine = engine_for(mode, cap)
    read = Reads(engine, monkeypatch)
    run_with_every_kind_of_change(engine, read, seed)
    stats = engine.stats()
    assert stats[f"num_{mode}_preemptions"] > 0  # the cases were reached
    assert engine.executor.copies > 0  # copy-on-write of a forked sample's last block
    assert engine.prefix_cache.stats.hits_tokens > 0 and engine.executor.deferred > 0
    assert read.reused > read.reads // 4, (read.reused, read.reads)  # the kept count was really read back
    assert_no_leak(engine)


class SubclassedPool(BlockPool):
    """A learner's subclass of the engine's pool (overrides ``incref``): ``may_share`` no longer trusts its count."""

    def incref(self, block_id: int) -> None:
        super().incref(block_id)


@pytest.mark.parametrize("pool", ["learner", "subclass"])
def test_kv_blocks_equal_a_recount_on_a_learners_pool(pool, monkeypatch):
    """The marker lives in the KV manager, where tables change, so a pool the engine runs on cannot make the kept
    count stale, whatever it does with its own bookkeeping."""
    engine = engine_for("recompute")
    install_pool(engine, LearnersPool(44, lifo=True) if pool == "learner" else SubclassedPool(44))
    assert engine.kv.may_share()  # an unknown pool: every step keeps a set union
    read = Reads(engine, monkeypatch)
    run_with_every_kind_of_change(engine, read, seed=5)
    assert engine.stats()["num_recompute_preemptions"] > 0 and engine.executor.copies > 0
    assert read.reused > read.reads // 4, (read.reused, read.reads)
    assert engine.pool.num_free + engine.prefix_cache.num_cached_blocks == engine.pool.num_blocks


# -- the marker itself ------------------------------------------------------------------------------------------

# Every KVCacheManager method that changes a table, watched one by one (a nested call is watched on its own too)
CHANGERS = ("share_prefix", "fork", "allocate_slots", "_copy_on_write_last", "grow_full_tables", "free",
            "swap_out", "swap_in")


def test_every_change_to_a_block_table_moves_the_marker(monkeypatch):
    """Oracle: a snapshot of every table the call could touch (the engine's requests and any request passed in),
    before and after each call of each public or table-changing method of the KV manager.  A call after which a
    table differs must have moved ``table_changes``; every kind of change must have happened at least once."""
    seen_changes = dict.fromkeys(CHANGERS, 0)
    engines: list[LLMEngine] = []

    def watch(kv: KVCacheManager, name: str, engine_of) -> None:
        method = getattr(kv, name)

        def watched(*args, **kwargs):
            engine = engine_of()
            reqs = {id(r): r for r in engine.requests.values()} if engine is not None else {}
            for a in args:
                for r in a if isinstance(a, list) else (a,):
                    r = getattr(r, "request", r)  # (a ScheduledSeq)
                    if isinstance(r, Request):
                        reqs[id(r)] = r
            before, mark = {k: tuple(r.block_ids) for k, r in reqs.items()}, kv.table_changes
            out = method(*args, **kwargs)
            if any(tuple(r.block_ids) != before[k] for k, r in reqs.items()):
                assert kv.table_changes != mark, f"{name} changed a block table without moving table_changes"
                if name in seen_changes:
                    seen_changes[name] += 1
            return out

        setattr(kv, name, watched)  # (an instance attribute: the manager's own self.<name>() calls find it too)

    names = [n for n in dir(KVCacheManager) if callable(getattr(KVCacheManager, n)) and not n.startswith("__")
             and not isinstance(KVCacheManager.__dict__.get(n), staticmethod)]
    assert set(CHANGERS) <= set(names)
    for mode, cap, seed in (("swap", None, 7), ("recompute", None, 11), ("recompute", 0.5, 11)):
        engine = engine_for(mode, cap)
        engines.append(engine)
        for name in names:
            watch(engine.kv, name, lambda e=engine: e)
        run_with_every_kind_of_change(engine, lambda where: None, seed)
    assert all(seen_changes.values()), seen_changes  # each kind of change was reached


def test_a_read_after_a_step_reads_no_block_table():
    """What the marker buys: a ``stats()`` read right after a step reuses the step log's count without a pass over
    any table (the copy-and-compare it replaces read every table at each step and each read).  Oracle: tables that
    count the calls made on them.  On the old code every running table was compared at the read."""

    class Watched(list):
        reads = 0

        def __eq__(self, other):
            Watched.reads += 1
            return list.__eq__(self, other)

        def __ne__(self, other):
            Watched.reads += 1
            return list.__ne__(self, other)

        __hash__ = None

    engine = engine_for("recompute")
    rng = random.Random(3)
    add_workload(engine, rng, 6)
    kv_blocks(engine)  # a first read: from now on each step keeps its count
    for _ in range(4):
        engine.step()
    assert engine.kv.may_share() and engine.scheduler.running
    for r in engine.scheduler.running:  # the same ids in a list that counts comparisons (no table change)
        r.block_ids = Watched(r.block_ids)
    engine.step()
    assert all(isinstance(r.block_ids, Watched) for r in engine.scheduler.running)
    Watched.reads = 0
    assert kv_blocks(engine) == recount(engine)
    assert Watched.reads == 0
