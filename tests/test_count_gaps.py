"""Two gaps in the per-tenant counts of ``engine.stats()["per_tenant"]``.

1. ``num_finished`` counts every sample that left the engine, whatever ended it -- a whole request aborted too.
   It used to count an aborted *sample* (it reports its abort in an output, which ``finish`` counts) but not a
   whole request aborted (it leaves with no output), so the same abort counted or not by how it was asked for.
   Oracle: counts worked out by hand from the script below, and the conservation law that every sample added is
   either still in the engine (running or waiting) or finished.
2. ``kv_blocks`` is counted once per step, by the step log, and ``stats()`` reuses that count only while the
   running requests and their block tables are exactly those it was taken from.  Oracle: a from-scratch recount
   of each tenant's distinct blocks, read at every point a caller can read ``stats()`` between the stages of a
   step and after aborts; and a count of how many times the engine counted.

Everything runs on the simulated executor, in about a second.
"""

from __future__ import annotations

import random

import pytest

from minivllm import EngineConfig, LLMEngine
from minivllm.config import TenantConfig
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor

from tests.invariants import KVContents, assert_no_leak, check_both_tiers, drain, steps

EOS = 3  # (the simulator's fake tokens never use ids 0-9)


class StopsOneSample(SimulatedExecutor):
    """The simulated executor, except that sample ``c#1`` samples EOS as its second output token, so it finishes
    ("stop") while its siblings go on."""

    def execute(self, batch):
        out = super().execute(batch)
        for s in batch.seqs:
            req = s.request
            if req.request_id == "c#1" and req.request_id in out and len(req.output_token_ids) == 1:
                out["c#1"] = EOS
        return out


def engine_for(executor, **options) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=96, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                       max_model_len=128, device="cpu", tenants={t: TenantConfig() for t in "abcd"}, **options)
    return LLMEngine(cfg, executor=executor, model_max_len=128, eos_token_ids={EOS})


def add(engine: LLMEngine, rid: str, tenant: str, max_tokens: int, n: int = 1, prompt_len: int = 6) -> None:
    engine.add_request({"prompt_token_ids": list(range(20, 20 + prompt_len))},
                       SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=False), rid, tenant=tenant)


def per_tenant(engine: LLMEngine, key: str) -> dict[str, int]:
    return {t: row[key] for t, row in engine.stats()["per_tenant"].items()}


def test_every_sample_that_leaves_counts_once_in_num_finished_aborted_whole_or_alone():
    """Hand count, per tenant, of the samples that ended (by any reason):

    * a: ``a-done`` finishes by length (1), ``a-run`` is aborted running (1), ``a-wait`` is aborted before any
      step, still waiting (1): 3.
    * b: ``b`` (n=3) is aborted mid-decode, all three samples running: 3.
    * c: ``c`` (n=3): ``c#1`` stops on EOS after two tokens, then the group is aborted: 1 + 2 = 3 (the stopped
      sample not counted again).
    * d: ``d`` (n=2): ``d#0`` is aborted alone (reported, so counted, at the next step), then the whole group is
      aborted: 2 (``d#0`` once).  ``e`` (n=2, tenant d) has ``e#1`` aborted alone and then the group aborted
      before any step reports it: that sample is counted by the group's abort, once -- 2 more, 4 in all.

    On the old code a whole abort counted nothing: a 1, b 0, c 1, d 1.
    """
    engine = engine_for(StopsOneSample())
    added = {"a": 0, "b": 0, "c": 0, "d": 0}

    def enqueue(rid, tenant, max_tokens, n=1):
        add(engine, rid, tenant, max_tokens, n)
        added[tenant] += n

    def conserved():  # every sample added is in the engine or counted as finished
        rows = engine.stats()["per_tenant"]
        for t, n in added.items():
            row = rows.get(t, {"num_finished": 0, "num_running": 0, "num_waiting": 0})
            assert row["num_finished"] + row["num_running"] + row["num_waiting"] == n, (t, row)

    enqueue("a-done", "a", 2)
    enqueue("a-run", "a", 40)
    enqueue("b", "b", 40, n=3)
    enqueue("c", "c", 40, n=3)
    enqueue("d", "d", 40, n=2)
    enqueue("e", "d", 40, n=2)
    for _ in range(4):  # prefill, then three decodes: a-done has finished, c#1 has stopped
        engine.step()
        conserved()
    assert per_tenant(engine, "num_running") == {"a": 1, "b": 3, "c": 2, "d": 4}
    assert per_tenant(engine, "num_finished") == {"a": 1, "b": 0, "c": 1, "d": 0}

    # b's samples' TTFTs, read off the requests before the abort lets them go (the leader's first token comes a
    # step before its forked siblings'); nearest-rank p50 of three is the 2nd smallest
    ttfts = sorted(engine.requests[f"b#{i}"].first_token_time - engine.requests[f"b#{i}"].arrival_time
                   for i in range(3))
    enqueue("a-wait", "a", 40)
    assert per_tenant(engine, "num_waiting")["a"] == 1
    assert engine.abort_request("a-wait")  # waiting: never scheduled
    assert engine.abort_request("a-run")  # running, mid-decode
    assert engine.abort_request("b")  # a whole group mid-decode
    assert engine.abort_request("c")  # a group one of whose samples has stopped already
    assert engine.abort_request("d#0")  # one sample alone: reported at the next step
    assert engine.abort_request("e#1")
    assert engine.abort_request("e")  # ... and its group, before any step reports e#1's abort
    engine.step()
    conserved()
    assert engine.abort_request("d")
    conserved()
    assert per_tenant(engine, "num_finished") == {"a": 3, "b": 3, "c": 3, "d": 4}
    # an aborted request's latencies count like any ending's
    assert engine.stats()["per_tenant"]["b"]["ttft_p50_s"] == pytest.approx(ttfts[1])
    assert not engine.has_unfinished_requests()
    assert_no_leak(engine)


def test_close_counts_what_it_aborts():
    """``close()`` aborts everything in flight: each sample still in the engine is one more ending (hand count:
    3 running + 1 waiting for tenant a, n=2 for tenant b)."""
    engine = engine_for(SimulatedExecutor())
    add(engine, "r1", "a", 40)
    add(engine, "r2", "b", 40, n=2)
    engine.step()
    add(engine, "r3", "a", 40)
    add(engine, "r4", "a", 40)
    engine.step()
    add(engine, "r5", "a", 40)  # waiting
    engine.close()
    assert per_tenant(engine, "num_finished") == {"a": 4, "b": 2}


# -- 2. one block count per step -------------------------------------------------------------------------------

def recount(engine: LLMEngine) -> dict[str, int]:
    """Each tenant's distinct device blocks, from its running requests' tables, from scratch."""
    held: dict[str, set] = {}
    for r in engine.scheduler.running:
        held.setdefault(r.tenant, set()).update(r.block_ids)
    return {t: len(b) for t, b in held.items()}


def kv_blocks(engine: LLMEngine) -> dict[str, int]:
    return {t: row["kv_blocks"] for t, row in engine.stats()["per_tenant"].items() if row["num_running"]}


def sharing_engine() -> LLMEngine:
    """Prefix caching on and n > 1 forks, so tenants' requests share blocks and the count is a set union."""
    return engine_for(SimulatedExecutor(), enable_prefix_caching=True)


def test_stats_between_steps_and_between_stages_equals_a_recount():
    """Read at every point a caller can read it -- after a step, after an abort or an add between steps, and
    between the stages of a step walked by hand (lab 1) -- ``kv_blocks`` is what each tenant holds then.  A
    count kept from the step log past any of these changes fails here (planted: reuse it whenever the running
    list is the same list object, or whenever its members are the same requests)."""
    engine = sharing_engine()
    system = list(range(40, 56))  # 4 shared blocks
    for i, t in enumerate("aabbc"):
        engine.add_request({"prompt_token_ids": system + [60 + i] * 3}, SamplingParams(max_tokens=30, n=1 + i % 2),
                           f"q{i}", tenant=t)
    for k in range(8):
        engine.step()
        assert kv_blocks(engine) == recount(engine)
        if k == 2:
            engine.abort_request("q2")  # blocks go back between steps
            assert kv_blocks(engine) == recount(engine)
            engine.abort_request("q1#0")  # a sample alone: its blocks go back now, its output at the next step
            assert kv_blocks(engine) == recount(engine)
        if k == 4:
            engine.add_request({"prompt_token_ids": system + [70] * 5}, SamplingParams(max_tokens=30), "late",
                               tenant="a")
            assert kv_blocks(engine) == recount(engine)
    # lab 1's walk, with stats() read after each stage that can change a table
    s = engine.scheduler
    s.admit()
    assert kv_blocks(engine) == recount(engine)
    batch = s.allocate(s.build_batch())
    assert kv_blocks(engine) == recount(engine)
    sampled = engine.executor.execute(batch)
    grew = engine.append(batch, sampled)
    assert kv_blocks(engine) == recount(engine)
    engine.finish(engine.emit(grew), batch)
    assert kv_blocks(engine) == recount(engine)
    engine.log_step(batch)
    assert kv_blocks(engine) == recount(engine)
    for _ in range(6):  # each running request's table grows while nothing else changes
        engine.step()
        assert kv_blocks(engine) == recount(engine)
    drain(engine, each=assert_counted_now)
    assert_no_leak(engine)


def assert_counted_now(engine: LLMEngine) -> None:
    got, want = kv_blocks(engine), recount(engine)
    assert got == want, (engine.scheduler.stats.num_steps, got, want)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_kv_blocks_match_a_recount_under_preemption_and_aborts_between_steps(mode):
    """A small pool that preempts (by ``mode``) every few steps, shared prefixes, forks, and aborts between
    steps (one read before the abort, one after): ``kv_blocks`` equals the recount at every read."""
    rng = random.Random(7)
    cfg = EngineConfig(num_gpu_blocks_override=40, block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                       max_model_len=96, device="cpu", enable_prefix_caching=True, preemption_mode=mode,
                       num_cpu_blocks_override=64, tenants={t: TenantConfig() for t in "abc"})
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=96, eos_token_ids=set())
    system = list(range(40, 52))
    for i in range(24):
        engine.add_request({"prompt_token_ids": system + [60 + i] * rng.randint(1, 9)},
                           SamplingParams(max_tokens=rng.randint(4, 24), n=rng.choice([1, 1, 2, 3])), f"q{i}",
                           tenant=rng.choice("abc"))
    aborts = [f"q{i}" for i in rng.sample(range(24), 6)] + ["q20#1", "q21#0"]
    found = 0
    for k, _ in enumerate(steps(engine, max_steps=2000)):  # fails when it does not drain
        check_both_tiers(engine)
        assert_counted_now(engine)
        if k % 5 == 4 and aborts:
            found += engine.abort_request(aborts.pop())
            assert_counted_now(engine)
    assert not aborts
    assert engine.stats()[f"num_{mode}_preemptions"] > 0 and found >= 6  # the cases were reached
    assert_no_leak(engine)


def test_a_step_and_a_stats_read_after_it_count_the_tenants_blocks_once(monkeypatch):
    """The step log counts each tenant's blocks; a ``stats()`` read right after the step reuses that count instead
    of taking the set union again (~0.14 ms at 128 requests of 70 blocks).  Oracle: the number of counts taken,
    seen through the one class both readers count with.  On the old code the read counted again (2 per step)."""
    import minivllm.metrics.step_log as step_log
    from minivllm.kv.sharing import GroupBlocks

    engine = sharing_engine()
    system = list(range(40, 56))
    for i, t in enumerate("abab"):
        engine.add_request({"prompt_token_ids": system + [60 + i] * 3}, SamplingParams(max_tokens=12, n=2),
                           f"q{i}", tenant=t)
    engine.step()
    engine.step()
    assert engine.kv.may_share()  # the case where a count is a set union
    assert engine._kept_tenant_blocks is None  # nothing kept for a driver that has not read stats()
    kv_blocks(engine)  # a first read: from now on each step keeps its count
    counts = []

    class Counted(GroupBlocks):
        def __init__(self, *args, **kwargs):
            counts.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(step_log, "GroupBlocks", Counted)
    for _ in range(3):
        before = len(counts)
        engine.step()
        assert len(counts) == before + 1  # the step log's
        assert kv_blocks(engine) == recount(engine)
        assert len(counts) == before + 1  # ... and the read reused it
    engine.abort_request("q1")
    assert kv_blocks(engine) == recount(engine)
    assert len(counts) == before + 2  # a change since the step: counted again
