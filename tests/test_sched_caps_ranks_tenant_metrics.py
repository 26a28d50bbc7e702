"""Scheduler behaviours a mutation pass over ``minivllm/sched`` found unpinned (every existing test still passed
with the planted bug): a tenant's per-step token cap inside a batch and at admission, decodes before prefills when
caps are on, the rank that blocks admission after two victims in one pass, and the per-tenant latency and peak-KV
counters.  Each test names the bug it kills.

Oracles: schedules worked out by hand from the rule the scheduler's docstring states, read off the rows of the
batches the executor receives; hand-computed percentiles; the pool's use read by the executor in every step.
Everything runs on the simulated executor, in about a second.
"""

from __future__ import annotations

import random

import pytest

from minivllm import EngineConfig, LLMEngine
from minivllm.config import TenantConfig
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.sched.scheduler import TenantCounters

from tests.invariants import KVContents, assert_no_leak, drain, tiny_engine


class RecordsRows(KVContents):
    """Keeps each step's rows as ``{request id: tokens}``: what the scheduler gave whom, read off the batch."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.rows: list[dict[str, int]] = []

    def execute(self, batch):
        self.rows.append({s.request.request_id: s.num_tokens for s in batch.seqs})
        return super().execute(batch)


def capped_engine(policy: str, tenants: dict, budget: int) -> tuple:
    """An engine roomy in KV and seats (64 blocks, 6 seats), so that only the token budget and the caps decide."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_num_batched_tokens=budget, max_num_seqs=6,
                       max_model_len=64, scheduling_policy=policy, tenants=tenants, device="cpu")
    ex = RecordsRows(4)
    return LLMEngine(cfg, executor=ex, model_max_len=64, eos_token_ids=set()), ex


def add_request(engine, rid: str, tenant: str, prompt_len: int, max_tokens: int = 4, **kw) -> None:
    engine.add_request({"prompt_token_ids": [9] * prompt_len}, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       rid, tenant=tenant, **kw)


def test_a_tenant_at_its_per_step_token_cap_leaves_the_rest_of_the_budget_to_other_tenants():
    """Kills: ``build_batch`` stopping at the first request whose tenant used its ``max_tokens_per_step``
    (``break`` for ``continue``).  The cap limits that tenant; another tenant's prefill ranked behind it must
    still get the budget.  Hand-worked schedule (priority policy, budget 32, tenant ``a`` capped at 4 tokens a
    step): step 1 prefills 4 of a1's 6 tokens.  Step 2 admits a2 (priority 0; a's 2 tokens left are under its
    cap) and b1 (priority 9).  Ranked, a2 takes a's 4 tokens, a1 gets none this step, and b1 -- another
    tenant, nothing capped -- prefills its 8 tokens."""
    engine, ex = capped_engine("priority", {"a": TenantConfig(max_tokens_per_step=4)}, budget=32)
    add_request(engine, "a1", "a", 6, priority=5)
    engine.step()
    add_request(engine, "a2", "a", 8, priority=0)
    add_request(engine, "b1", "b", 8, priority=9)
    engine.step()
    assert ex.rows == [{"a1": 4}, {"a2": 4, "b1": 8}]
    drain(engine)
    assert_no_leak(engine)


def test_with_caps_running_decodes_still_come_before_prefill_chunks():
    """Kills: the capped path of ``build_batch`` walking prefills before decodes.  The scheduler's promise is
    "decodes first (one token each, so a running stream never stalls)", whatever the caps.  Hand-worked
    schedule (FCFS, budget 8, a cap on some other tenant so that the capped path runs): d (4-token prompt)
    prefills and samples in step 1; p (a 30-token prompt) arrives, and every later step until p's prefill is
    done gives d its one decode token and p the other 7."""
    engine, ex = capped_engine("fcfs", {"other": TenantConfig(max_running=1)}, budget=8)
    add_request(engine, "d", "t", 4, max_tokens=6)
    engine.step()
    add_request(engine, "p", "t", 30, max_tokens=1)
    for _ in range(4):
        engine.step()
    assert ex.rows == [{"d": 4}, {"d": 1, "p": 7}, {"d": 1, "p": 7}, {"d": 1, "p": 7}, {"d": 1, "p": 7}]
    drain(engine)
    assert_no_leak(engine)


def test_admission_counts_a_capped_tenants_running_prefill_only_up_to_its_cap():
    """Kills: the admission budget counting a capped tenant's running prefill in full rather than up to its
    ``max_tokens_per_step`` (its share of a batch never passes the cap).  Counted in full, tenant ``a``'s long
    prompt looks as if it took the whole budget, and ``b``'s short request waits until that prefill is over,
    although the step has room.  Hand-worked schedule (caps policy, budget 16, ``a`` capped at 4 tokens a
    step): a1 (40 tokens) prefills 4 a step; b1 (10 tokens) arrives after step 1 and prefills whole in step 2,
    next to a1's 4 (14 of 16)."""
    engine, ex = capped_engine("caps", {"a": TenantConfig(max_tokens_per_step=4)}, budget=16)
    add_request(engine, "a1", "a", 40)
    engine.step()
    add_request(engine, "b1", "b", 10)
    engine.step()
    assert ex.rows == [{"a1": 4}, {"a1": 4, "b1": 10}]
    drain(engine)
    assert_no_leak(engine)


def test_admission_counts_a_capped_tenants_request_admitted_in_the_same_pass_only_up_to_its_cap():
    """Kills: admission charging a request of a capped tenant its whole prefill against the step's token
    budget (not the tokens its ``max_tokens_per_step`` lets it take), so that a later request of another tenant
    in the same pass finds the budget gone.  Hand-worked (caps policy, budget 16, ``a`` capped at 4 tokens a
    step): a1 (40 tokens) and b1 (10 tokens) arrive together; step 1 prefills 4 of a1 and all of b1."""
    engine, ex = capped_engine("caps", {"a": TenantConfig(max_tokens_per_step=4)}, budget=16)
    add_request(engine, "a1", "a", 40)
    add_request(engine, "b1", "b", 10)
    engine.step()
    assert ex.rows == [{"a1": 4, "b1": 10}]
    drain(engine)
    assert_no_leak(engine)


def test_after_two_victims_in_one_pass_nothing_ranked_behind_the_better_victim_is_admitted():
    """Kills: admission remembering the *worst* rank among the victims it preempted in a pass (or only the
    first's) instead of the best.  The promise: nothing ranked behind a victim is admitted in the pass that
    preempted it -- it would take the room the victim gave up.  Hand-worked (priority policy, 12 blocks of 4
    tokens, one free seat): va (priority 5) and vb (priority 9), 16 tokens each, hold 8 blocks and will need
    one more each.  Then x1 (priority 0, 12 tokens) preempts vb; x2 (priority 0, 20 tokens) preempts va; 4
    blocks are left, room for r (priority 7, 8 tokens) -- but r ranks behind va, which now waits, so r waits
    too."""
    cfg = EngineConfig(num_gpu_blocks_override=12, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=40, scheduling_policy="priority", device="cpu")
    ex = RecordsRows(4)
    engine = LLMEngine(cfg, executor=ex, model_max_len=40, eos_token_ids=set())
    add_request(engine, "va", "t", 16, max_tokens=8, priority=5)
    add_request(engine, "vb", "t", 16, max_tokens=8, priority=9)
    engine.step()
    add_request(engine, "x1", "t", 12, priority=0)
    add_request(engine, "x2", "t", 20, priority=0)
    add_request(engine, "r", "t", 8, priority=7)
    engine.step()
    assert ex.rows == [{"va": 16, "vb": 16}, {"x1": 12, "x2": 20}]
    assert engine.scheduler.stats.num_preemptions == 2, "both victims must have given way in the one pass"
    assert {r.request_id for r in engine.scheduler.waiting} == {"va", "vb", "r"}
    drain(engine)
    assert_no_leak(engine)


def test_a_second_request_of_a_tenant_at_its_token_cap_does_not_take_a_seat_it_cannot_use():
    """Kills: admission not adding an admitted request's tokens to its tenant's per-step usage, so that the
    same pass admits the tenant's next request although the first already takes all its tokens.  The second
    would hold a seat (and KV) with nothing to run, and another tenant's request would wait for that seat.
    Hand-worked (caps policy, two seats, budget 32, ``a`` capped at 4 tokens a step): a1, a2 and b1 (10
    tokens each) arrive together; a1 takes a's 4 tokens, a2 waits at the cap, b1 gets the second seat and
    prefills whole."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=2,
                       max_model_len=64, scheduling_policy="caps", tenants={"a": TenantConfig(max_tokens_per_step=4)},
                       device="cpu")
    ex = RecordsRows(4)
    engine = LLMEngine(cfg, executor=ex, model_max_len=64, eos_token_ids=set())
    for rid, tenant in (("a1", "a"), ("a2", "a"), ("b1", "b")):
        add_request(engine, rid, tenant, 10)
    engine.step()
    assert ex.rows == [{"a1": 4, "b1": 10}]
    assert [r.request_id for r in engine.scheduler.waiting] == ["a2"]
    drain(engine)
    assert_no_leak(engine)


def test_per_tenant_latency_percentiles_and_queue_time_against_hand_computed_values():
    """Kills: a per-tenant TTFT / ITL percentile taken at the wrong rank, ITLs skipping a gap, a queue time
    measured to the first token instead of the first scheduling, and percentiles cached past a new finish.
    ``stats()["per_tenant"]`` is what an operator reads per tenant; until now only their order (p50 <= p95) was
    checked.  Oracle, by hand: 20 requests with TTFTs 1..20 s (finished in a shuffled order), each with output
    gaps of ``i`` and ``2 i`` s and a queue time of ``i / 10`` s; nearest-rank p50 of 1..20 is the 10th value,
    p95 the 19th.  The gaps are {1..20} and {2..40}: 40 values, p50 the 20th (14), p95 the 38th (36)."""
    order = list(range(1, 21))
    random.Random(0).shuffle(order)
    ts = TenantCounters()
    assert ts.latency_percentiles()["ttft_p50_s"] is None
    for i in order:
        r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=3), 100.0)
        r.first_scheduled_time = 100.0 + i / 10
        r.first_token_time = 100.0 + i
        r.token_times = [100.0 + i, 100.0 + 2 * i, 100.0 + 4 * i]
        ts.record_finished(r)
        if i == order[0]:
            assert ts.latency_percentiles()["ttft_p95_s"] == i  # one sample so far: it is every percentile
    gaps = sorted(list(range(1, 21)) + list(range(2, 41, 2)))
    assert (gaps[19], gaps[37]) == (14, 36)
    assert ts.latency_percentiles() == {"ttft_p50_s": 10.0, "ttft_p95_s": 19.0, "itl_p50_s": 14.0, "itl_p95_s": 36.0}
    assert ts.finished == 20
    assert ts.queue_time_s == pytest.approx(sum(range(1, 21)) / 10)


class RecordsPoolUse(KVContents):
    """Reads the pool's used blocks as each step runs: after allocation, before finished requests free theirs."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.pool = None
        self.used: list[int] = []

    def execute(self, batch):
        self.used.append(self.pool.num_blocks - self.pool.num_free)
        return super().execute(batch)


def test_the_peak_of_used_kv_blocks_is_the_most_any_step_held_not_the_last_steps():
    """Kills: ``peak_used_blocks`` (the CLI's "KV blocks used (peak)") holding the last step's reading instead
    of the largest.  Oracle: the pool's use read by the executor in every step; a long request and a short
    one, so that use climbs and then falls before the run ends."""
    ex = RecordsPoolUse(4)
    engine = tiny_engine(num_blocks=24, max_seqs=3, max_len=40)
    engine.executor = ex
    ex.pool = engine.kv.pool
    engine.add_request({"prompt_token_ids": [3] * 30}, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request({"prompt_token_ids": [4] * 5}, SamplingParams(max_tokens=12, ignore_eos=True))
    drain(engine)
    assert max(ex.used) > ex.used[-1], "use must fall before the end for the test to mean anything"
    assert engine.scheduler.stats.peak_used_blocks == max(ex.used)
    assert_no_leak(engine)
