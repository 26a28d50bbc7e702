"""What the running requests will still claim counts ``k - 1`` copies for ``k`` holders writing into one block.

A leader and the samples forked onto its partly filled last block all write into that block next.  Whichever
writes first copies it; the last holder finds it its own and writes in place: ``k`` holders, ``k - 1`` copies.  The
recounts of what running requests will claim (the pool-wide reservation admission checks against, a cap group's
usage, a cap's retry hint) charged each holder one copy, ``k`` in all: admission turned away, or delayed, a request
that fitted by one block per such block.

Oracles: brute force from the KV state (``invariants.claimed_blocks`` and ``group_claims``: per block, the writers,
and the holders that are not, counted from scratch), itself checked by doing it -- on a copy, every request gets
room for the tokens it has, and the pool's hand-outs and each group's distinct blocks are counted
(``invariants.claimed_by_stepping``).
"""

from __future__ import annotations

import random

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig
from minivllm.kv import BlockPool, KVCacheManager
from minivllm.kv.prefix import make_prefix_cache
from minivllm.request import Request
from minivllm.sched.fairness import CapTable
from minivllm.sched.scheduler import Scheduler

from invariants import (KVContents, assert_no_leak, claimed_blocks, claimed_by_stepping, drain,  # noqa: E402
                        group_claims, tiny_engine)


def _one_group(r):
    return ("g",)


def _forked(prompt_len: int, samples: int, cache: bool = False, tenant: str = "default"):
    """Block size 4.  A leader that prefilled ``prompt_len`` tokens and sampled one (its next write: position
    ``prompt_len``), and ``samples`` samples forked from it (``prompt - 1`` tokens shared, the last one to
    compute: their next write lands in the block holding position ``prompt_len - 1``)."""
    pool = BlockPool(32)
    kv = KVCacheManager(pool, 4, make_prefix_cache("radix", pool, 4) if cache else None)
    params = SamplingParams(n=samples + 1, max_tokens=6, ignore_eos=True)
    leader = Request("L", list(range(1, prompt_len + 1)), params, 0.0, tenant=tenant)
    assert kv.allocate_slots(leader, prompt_len)
    leader.num_computed_tokens = prompt_len
    kv.cache_full_blocks(leader)
    leader.output_token_ids.append(99)
    reqs = [leader]
    for i in range(samples):
        s = Request(f"S{i}", list(leader.prompt_token_ids), params, 0.0, tenant=tenant)
        s.leader = leader
        kv.fork(leader, s)
        reqs.append(s)
    return kv, reqs


@pytest.mark.parametrize("samples", [1, 2, 3])
@pytest.mark.parametrize("prompt_len,cache,copies", [
    (6, False, "k-1"),  # all holders write into the leader's half-full second block: the last writes in place
    (6, True, "k-1"),  # (the cache holds only the full first block)
    (8, False, "k"),  # the block is full for the leader, which writes a new one: every sample copies
    (8, True, "k"),  # ... and the cache holds it too
])
def test_the_oracle_counts_what_the_pool_hands_out(samples, prompt_len, cache, copies):
    """Hand-built scenes, checked three ways: the count by hand, the brute-force oracle, and the blocks the pool
    hands out when every request writes (in two orders); the bulk count agrees.  Where every holder writes into
    the shared block, the old per-request sum (a copy for each) is one too many."""
    kv, reqs = _forked(prompt_len, samples, cache)
    # The leader's next token starts a block at prompt 8; either way each sample copies once: with the leader
    # writing there too, k = samples + 1 holders make k - 1 copies; with the leader (and the cache) only holding
    # it, k = samples writers copy every one.
    by_hand = (1 if prompt_len % 4 == 0 else 0) + samples
    for order in (None, random.Random(samples)):
        stepped = claimed_by_stepping(kv, reqs, _one_group, order)
        assert stepped is not None
        assert stepped[0] == by_hand == claimed_blocks(kv, reqs)
        assert stepped[1] == group_claims(kv, reqs, _one_group)
    assert kv.num_new_blocks_all(reqs) == by_hand
    per_request = sum(kv.num_new_blocks(r, r.num_uncomputed_tokens) + kv.num_copy_on_write_blocks(r) for r in reqs)
    assert per_request == by_hand + (1 if copies == "k-1" else 0)


def test_a_holder_that_already_copied_is_no_writer():
    """Leader and two samples on one half-full block; one sample writes (copies), leaving two holders, both writing
    next: one copy more, not two."""
    kv, (leader, s0, s1) = _forked(6, 2)
    assert kv.allocate_slots(s0, 1)
    s0.num_computed_tokens += 1
    s0.output_token_ids.append(5)
    reqs = [leader, s0, s1]
    assert claimed_by_stepping(kv, reqs, _one_group)[0] == 1 == claimed_blocks(kv, reqs) == kv.num_new_blocks_all(reqs)


def test_reject_mode_counts_the_worst_case_and_the_same_copies():
    kv, reqs = _forked(6, 2)
    worst = sum(-(-(r.num_prompt_tokens + r.max_tokens) // 4) - len(r.block_ids) for r in reqs)
    assert kv.num_new_blocks_all(reqs, worst_case=True) == worst + 2 == claimed_blocks(kv, reqs, worst_case=True)


def test_a_cap_retry_hint_says_a_forked_group_fits_when_it_does():
    """Tenant ``t`` may hold 4 of 16 blocks.  A leader and its sample hold 2 distinct blocks and will copy the
    half-full one once: 3.  A request needing 1 more block fits (3 + 1 = 4): no wait.  Charging both a copy
    (4 + 1 = 5) told it to retry later; needing 2 it does not fit either way."""
    kv, reqs = _forked(6, 1, tenant="t")
    cfg = EngineConfig(scheduling_policy="caps", device="cpu", max_num_batched_tokens=16,
                       tenants={"t": TenantConfig(max_kv_share=0.25, over_cap="reject")})
    caps = CapTable(cfg, num_blocks=16)
    assert group_claims(kv, reqs, lambda r: ("t",)) == {"t": 3}

    def reserved(r):
        return kv.num_new_blocks(r, r.num_uncomputed_tokens) + kv.num_copy_on_write_blocks(r)

    newcomer = Request("N", [1] * 3, SamplingParams(max_tokens=1), 0.0, tenant="t")
    hint = caps.retry_steps(newcomer, reqs, 1, reserved, True, kv.num_copy_on_write_blocks)
    assert hint is None
    assert caps.retry_steps(newcomer, reqs, 2, reserved, True, kv.num_copy_on_write_blocks) is not None


CAPPED = {"a": TenantConfig(max_kv_share=0.35, priority_class="agent"),
          "b": TenantConfig(max_kv_share=0.45, priority_class="batch"),
          "c": TenantConfig(priority_class="interactive")}


def _engine(policy, mode, prefix, tenants=CAPPED):
    """4-token blocks on a small pool, three tenants under caps (``three_class`` adds class caps)."""
    cfg = EngineConfig(num_gpu_blocks_override=44, num_cpu_blocks_override=24, block_size=4, max_num_seqs=10,
                       max_num_batched_tokens=40, max_model_len=96, enable_prefix_caching=prefix,
                       preemption_mode=mode, scheduling_policy=policy, tenants=tenants,
                       three_class=ThreeClassConfig(interactive_kv_reserve=0.2, agent_kv_share=0.5),
                       device="cpu")
    return LLMEngine(cfg, executor=KVContents(4), model_max_len=96, eos_token_ids=set())


def _workload(engine, seed):
    rng = random.Random(seed)
    system = [rng.randrange(10, 900) for _ in range(10)]
    for i in range(36):
        prompt = (system if rng.random() < 0.5 else []) + [rng.randrange(10, 900) for _ in range(rng.randrange(1, 14))]
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(n=rng.choice([1, 2, 3, 4]), max_tokens=rng.randrange(1, 12), ignore_eos=True),
                           tenant="abc"[i % 3], priority=rng.randrange(3), arrival_time=0.0, request_id=f"r{i}")


def _outputs(engine) -> dict:
    """The tokens of every completion that finished by length (not rejected), by request."""
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs if c.finish_reason == "length"]
    return out


def _shared_writers(kv, running) -> bool:
    """Do two running requests write next into one partly filled block (the case the old count got wrong)?"""
    bs, seen = kv.block_size, set()
    for r in running:
        at = r.num_computed_tokens
        if at % bs and at // bs < len(r.block_ids):
            b = r.block_ids[at // bs]
            if b in seen:
                return True
            seen.add(b)
    return False


@pytest.mark.parametrize("policy", ["caps", "three_class", "priority"])
@pytest.mark.parametrize("mode", ["recompute", "swap", "reject"])
@pytest.mark.parametrize("prefix", [True, False])
def test_every_recount_equals_the_oracle_at_every_admission_read(monkeypatch, policy, mode, prefix):
    """Random ``n`` up to 4, a shared system prompt, three tenants under caps, a pool small enough to preempt (or,
    reject mode, to turn requests away).  At every admission of a request, the blocks reserved so far (the
    recount at the pass's start, or after a preemption, plus what each admission added) equal the oracle, and so
    does a fresh recount; at every cap check, each group's usage (kept the same way) equals the group oracle.
    Where two holders write into one block the oracle is checked by doing it.  Outputs equal an uncapped run's."""
    reads = {"admit": 0, "caps": 0, "stepped": 0}
    try_admit, within = Scheduler._try_admit, Scheduler._within_caps
    worst = mode == "reject"
    rng = random.Random(f"{policy}-{mode}-{prefix}")

    def keys(sched):
        return lambda r: [g.key for g in sched.caps.groups(r)] if sched.caps is not None else ["all"]

    def check_by_stepping(sched):
        if worst or not _shared_writers(sched.kv, sched.running):
            return
        stepped = claimed_by_stepping(sched.kv, sched.running, keys(sched), rng)
        if stepped is not None:
            assert stepped[0] == claimed_blocks(sched.kv, sched.running)
            assert stepped[1] == group_claims(sched.kv, sched.running, keys(sched))
            reads["stepped"] += 1

    def checked_try_admit(self, req, budget, reserved):
        want = claimed_blocks(self.kv, self.running, worst_case=worst)
        assert reserved == want == self._reserved_blocks(), (req.request_id, reserved, want)
        check_by_stepping(self)
        reads["admit"] += 1
        return try_admit(self, req, budget, reserved)

    def checked_within(self, req, usage, need_blocks, per_step=True):
        want = group_claims(self.kv, self.running, keys(self), worst_case=worst)
        assert {k: u[1] for k, u in usage.items() if u[0]} == want
        assert {k: u[1] for k, u in self._group_usage()[0].items()} == want
        reads["caps"] += 1
        return within(self, req, usage, need_blocks, per_step)

    monkeypatch.setattr(Scheduler, "_try_admit", checked_try_admit)
    monkeypatch.setattr(Scheduler, "_within_caps", checked_within)
    engine = _engine(policy, mode, prefix)
    _workload(engine, seed=3)
    out = _outputs(engine)
    assert_no_leak(engine)
    assert reads["admit"] > 30 and (policy == "priority" or reads["caps"] > 30), reads
    assert worst or reads["stepped"] > 3, reads
    monkeypatch.undo()
    free = _engine("fcfs", "recompute", prefix, tenants={})
    _workload(free, seed=3)
    want = _outputs(free)
    served = {k: v for k, v in out.items() if v}
    assert len(served) > 10 and served == {k: want[k] for k in served}


def test_a_better_ranked_request_is_seated_in_the_pass_that_has_room_for_it():
    """Hand count, priority policy, 8 blocks of 4 tokens.  ``V`` (priority 2) holds 4 blocks; leader ``L`` (priority
    0, ``n = 2``) prefilled 6 tokens into 2, its second block half full; 2 free.  Next pass: ``L``'s sample forks
    onto that block (both write there next: one copy between them), then ``X`` (priority 1, 20 tokens: 5 blocks)
    finds no room and may preempt ``V``: 2 free + 4 of ``V``'s - 1 copy = 5, exactly ``X``'s need.  ``X`` is seated
    in that pass and the step allocates without preempting again (the pool ends full).  Counting a copy for both
    holders made it 4: ``V`` was not preempted and ``X`` waited a step for room that was there."""
    engine = tiny_engine(num_blocks=8, block_size=4, budget=32, max_len=32, scheduling_policy="priority")
    sched = engine.scheduler

    def params(n=1, max_tokens=3):
        return SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)

    engine.add_request({"prompt_token_ids": list(range(100, 112))}, params(max_tokens=20), priority=2, request_id="V")
    engine.step()
    engine.add_request({"prompt_token_ids": list(range(1, 7))}, params(n=2), priority=0, request_id="L")
    engine.step()
    assert [len(r.block_ids) for r in sched.running] == [4, 2] and engine.pool.num_free == 2
    engine.add_request({"prompt_token_ids": list(range(200, 220))}, params(max_tokens=2), priority=1, request_id="X")
    engine.step()
    assert [r.request_id for r in sched.running] == ["L#0", "L#1", "X"] and [r.request_id for r in sched.waiting] == ["V"]
    assert engine.step_log[-1].preempted == ("V",) and engine.pool.num_free == 0
    drain(engine)
    assert_no_leak(engine)
