"""Scheduler edges a mutation pass over ``minivllm/sched`` found unpinned (every existing test still passed with
the planted bug): a second recompute preemption partway through a re-prefill, a whole prompt that exactly fills
the token budget left with chunked prefill off (or falls short of it in step 2), the prefill-rate fit's trust
guards at their edges, a victim of preempt-to-admit taken from the same admission pass, a victim with nothing
computed (no preemption in the counts), and the blocks auto mode prices a part-filled victim's swap by.  Each test
names the bug it kills.

Oracles: the rows the executor receives (how far each request's computation really reached, recounted from
them), a brute-force count of the service WFQ must charge, schedules worked out by hand, and an ordinary least
squares fit written out plainly here.  Everything runs on the simulated executor, in about a second.
"""

from __future__ import annotations

import math

import pytest

from minivllm import EngineConfig, LLMEngine
from minivllm.config import TenantConfig
from minivllm.request import RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.sched.fairness import WFQAdmission
from minivllm.sched.policies import FCFSAdmission, PriorityAdmission
from minivllm.sched.scheduler import PrefillRateFit
from minivllm.sim import SimulatedExecutor

from tests.invariants import assert_no_leak, drain, tiny_engine
from tests.test_sched_caps_ranks_tenant_metrics import RecordsRows
from tests.test_sched_kv_mutants import RecountsRecompute


class RecordsRuns(RecountsRecompute):
    """Also notes each request's *runs* (from a start at position 0 to the next one): a restart after a run that
    ended short of the furthest an earlier run had reached is a second preemption partway through a re-prefill."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.run_end: dict[str, int] = {}
        self.short_runs: list[tuple[str, int, int]] = []  # (request, where the run ended, the furthest reached)

    def execute(self, batch):
        for s in batch.seqs:
            rid = s.request.request_id
            reached = self.reached.get(rid, 0)
            if s.start == 0 and reached and self.run_end[rid] < reached:
                self.short_runs.append((rid, self.run_end[rid], reached))
            self.run_end[rid] = s.start + s.num_tokens
        return super().execute(batch)


def test_a_second_preemption_partway_through_a_re_prefill_keeps_the_furthest_point_reached():
    """Kills: a recompute preemption *overwriting* ``num_tokens_computed_once`` with the victim's computed tokens
    instead of keeping the furthest any computation reached.  WFQ charges a prompt token once, however often a
    recompute makes the engine compute it again (the fairness module's promise); it reads that field to tell new
    prompt tokens from recomputed ones.  Overwritten by a second, shorter run, the tokens between the two points
    were charged a second time.

    Hand-worked run (8 blocks of 4 tokens, 16-token budget, 8-token chunks): B (12-token prompt) prefills 4 + 8
    tokens and samples an output; the pool runs dry and B, the newest, is preempted with 12 tokens computed.
    Readmitted, it re-prefills 8 of its 13 tokens and is preempted again at 8.  Its third run must still know it
    had reached 12.  Oracles: the furthest position the executor saw B's rows reach, and a brute-force count of
    the service (one tenant: each prompt token once at ``wfq_prefill_weight``, each output once at
    ``wfq_decode_weight``)."""
    ex = RecordsRuns(4)
    engine = tiny_engine(num_blocks=8, max_seqs=4, max_len=32, budget=16, long_prefill_token_threshold=8,
                         scheduling_policy="wfq")
    engine.executor = ex
    work = {"A": (8, 20), "C": (4, 8), "B": (12, 8)}
    for rid, (prompt, outputs) in work.items():
        engine.add_request({"prompt_token_ids": [ord(rid)] * prompt}, SamplingParams(max_tokens=outputs, ignore_eos=True),
                           rid)
    finals = drain(engine)
    assert {rid: len(out.outputs[0].token_ids) for rid, out in finals.items()} == {r: w[1] for r, w in work.items()}
    assert ("B", 8, 12) in ex.short_runs, ex.short_runs  # the premise: B's second run stopped short of its first
    assert not ex.forgot, ex.forgot
    cfg = engine.config
    charged = sum(cfg.wfq_prefill_weight * prompt + cfg.wfq_decode_weight * outputs for prompt, outputs in work.values())
    assert engine.scheduler.admission_policy.counter("default") == pytest.approx(charged)
    assert_no_leak(engine)


def test_with_chunking_off_a_whole_prompt_that_exactly_fills_the_budget_left_starts_at_once():
    """Kills: a whole prompt refused when it *equals* the token budget left rather than only when it is over it.
    Hand-worked: chunked prefill off, a 32-token budget; A's 20-token prompt leaves 12, and B's 12-token prompt
    fits them exactly, so both prefill in the first step.  Refused, B waited a step for nothing."""
    ex = RecordsRows(4)
    engine = tiny_engine(num_blocks=64, budget=32, max_len=32, chunked=False, max_seqs=4)
    engine.executor = ex
    engine.add_request({"prompt_token_ids": [1] * 20}, SamplingParams(max_tokens=3, ignore_eos=True), "A")
    engine.add_request({"prompt_token_ids": [2] * 12}, SamplingParams(max_tokens=3, ignore_eos=True), "B")
    drain(engine)
    assert ex.rows[:3] == [{"A": 20, "B": 12}, {"A": 1, "B": 1}, {"A": 1, "B": 1}]
    assert_no_leak(engine)


class ArrivalOrderRankedByPriority(FCFSAdmission):
    """A caller's admission policy whose order is not its rank: it admits in arrival order, but ranks (and may
    preempt) by priority, as :class:`PriorityAdmission` does.  The scheduler takes both as given: the order says
    whom to try first, the rank who gets a batch's prefill budget first."""

    rank = PriorityAdmission.rank
    may_preempt_for = staticmethod(PriorityAdmission.may_preempt_for)


def test_with_chunking_off_a_prompt_left_short_of_the_budget_in_a_step_waits_for_the_next_rather_than_split():
    """Kills: step 2 giving a prefill a partial chunk with chunked prefill off.  Admission counts against a
    request's budget only the prefills ranked at or ahead of it, so a policy that admits in an order other than
    its rank can admit two whole prompts that do not fit one step together; step 2 then serves the better-ranked
    one first.  Hand-worked: a 32-token budget, ``low`` (priority 5) and ``high`` (priority 0), 20-token prompts,
    both admitted in the first step; ``high`` prefills its 20, and ``low``, with 12 left for it, must wait a step
    for all 20 -- not be split 12 + 8, which ``enable_chunked_prefill=False`` promises never happens."""
    ex = RecordsRows(4)
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                       max_model_len=32, enable_chunked_prefill=False, device="cpu")
    engine = LLMEngine(cfg, executor=ex, model_max_len=32, eos_token_ids=set(),
                       admission_policy=ArrivalOrderRankedByPriority())
    engine.add_request({"prompt_token_ids": [1] * 20}, SamplingParams(max_tokens=3, ignore_eos=True), "low", priority=5)
    engine.add_request({"prompt_token_ids": [2] * 20}, SamplingParams(max_tokens=3, ignore_eos=True), "high", priority=0)
    drain(engine)
    assert ex.rows[:2] == [{"high": 20}, {"high": 1, "low": 20}]
    assert_no_leak(engine)


def least_squares_slope_and_t(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Ordinary least squares of ``y = a + b x``, written out plainly: the slope and its t-statistic (the slope
    over its standard error, the noise variance estimated with ``n - 2`` degrees of freedom)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    a = my - b * mx
    s2 = sum((y - a - b * x) ** 2 for x, y in points) / (n - 2)
    return b, b / math.sqrt(s2 / sxx)


def test_the_prefill_rate_fit_trusts_a_slope_only_beyond_three_standard_errors():
    """Kills: the fit's t-test comparing ``b`` rather than ``b**2`` (with the spread) to ``min_t**2`` times the
    noise: ``b`` is about a thousandth of a second per token, so it let a slope within two standard errors of zero
    pass, and auto mode priced recomputes by a rate the steps do not support.  Oracle: an ordinary least squares
    fit of the same steps (the decode rows are constant, so the fit is of ``T = a + b P``): at t ~ 2 the fit
    says nothing; with the noise a tenth as large (t ~ 20) it gives ``1 / b``."""
    def steps(noise: float) -> list[tuple[float, float]]:
        # 28 steps: P runs over 0, 10, .. 60 four times; the noise alternates in sign, so it is uncorrelated with P
        return [(10.0 * (i % 7), 0.05 + 1e-3 * 10 * (i % 7) + noise * (-1) ** i) for i in range(28)]

    for noise, trusted in ((0.05, False), (0.005, True)):
        points = steps(noise)
        b, t = least_squares_slope_and_t(points)
        fit = PrefillRateFit(1000.0, decay=1.0)
        for p, seconds in points:
            fit.add(p, 4, seconds)
        assert (t > 3) is trusted, t  # the premise: one set within three standard errors of 0, one far beyond
        assert b > 0 and 1000.0 / 20 < 1 / b < 1000.0 * 20  # ...each with a positive slope near the prior
        assert fit.rate() == (pytest.approx(1 / b, rel=1e-9) if trusted else None)


def test_the_prefill_rate_fit_says_nothing_when_no_step_is_left_to_measure_the_noise():
    """Kills: the degrees-of-freedom guard off by one (``w < params``): with as many steps as the fit has
    parameters (two steps, ``T = a + b P``) the line passes through both exactly, so nothing is left to estimate
    the noise and the slope cannot be judged against it; the fit must say nothing (it divided by zero).  Hand
    count: ``min_steps`` lowered to 2 so that the weight guard does not answer first (the engine's fit keeps the
    default of 10, where it always does; the class takes ``min_steps`` as an argument)."""
    fit = PrefillRateFit(1000.0, decay=1.0, min_steps=2.0)
    fit.add(10, 4, 0.06)
    fit.add(50, 4, 0.10)
    assert fit.rate() is None
    fit.add(30, 4, 0.0801)  # a third step: one degree of freedom for the noise, and a clear slope of ~1e-3
    assert fit.rate() == pytest.approx(1000.0, rel=1e-2)


def test_a_victim_with_nothing_computed_still_pauses_the_next_admission():
    """The pause's reason is that the pool ran dry while allocating, so admitting next step would only preempt
    again; whether the victim had computed anything does not change that.  A batch builder (a supported seam) can
    make such a victim: it holds ``r`` back, admitted but given no rows, while ``a`` and ``c`` decode into the
    blocks ``r``'s admission counted on; when it lets ``r`` in, ``a`` and ``c`` (full tables, served first) take
    the last two blocks and ``r`` finds none: it gives way itself, the newest, still at 0 computed.  ``c``
    finishes in that step, so at the next admission ``r`` fits again.  Oracle: the rule as :meth:`Scheduler.admit` states
    it, counted by hand: the step after the preemption admits no one, the one after admits ``r``.
    Kills: the pause set only for a victim that had computed tokens (``r`` then came back the very next step).
    And ``r`` lost no work, so it is no preemption in the counts (their total is by recompute + by swap, and
    neither happened to it): kills a give-way with nothing computed counted as a preemption of ``r``, of its
    tenant and of the engine (it would also count toward ``r``'s protection from later preemptions)."""
    release = {"r": False}

    def holds_r_back(running, budget, threshold):
        """Every request's whole remaining tokens, in running order, but none for ``r`` until it is released."""
        rows = []
        for q in running:
            n = min(q.num_uncomputed_tokens, budget)
            if n > 0 and (q.request_id != "r" or release["r"]):
                rows.append((q, n))
                budget -= n
        return rows

    cfg = EngineConfig(num_gpu_blocks_override=6, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=24, enable_prefix_caching=False, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=24, eos_token_ids=set(),
                       batch_builder=holds_r_back)
    engine.add_request({"prompt_token_ids": [11] * 4}, SamplingParams(max_tokens=16, ignore_eos=True), "a")
    engine.add_request({"prompt_token_ids": [12] * 4}, SamplingParams(max_tokens=6, ignore_eos=True), "c")
    engine.add_request({"prompt_token_ids": [13] * 8}, SamplingParams(max_tokens=2, ignore_eos=True), "r")
    sched, r = engine.scheduler, engine.requests["r"]
    # by hand: step 0 prefills a and c (1 block each) and admits r with no row; step 1 writes their 5th tokens
    # (a 2nd block each: 2 free); steps 2-4 fill those blocks; step 5 writes their 9th tokens and c's last
    for _ in range(5):
        engine.step()
    assert r in sched.running and r.num_computed_tokens == 0 and engine.pool.num_free == 2
    release["r"] = True
    engine.step()  # step 5: a and c take the 2 free blocks, r finds none and gives way; c finishes (3 back)
    assert engine.step_log[-1].preempted == ("r",)
    assert r.num_computed_tokens == 0 and r in sched.waiting and "c" not in engine.requests
    stats = engine.stats()
    assert r.num_preemptions == 0 and sched.tenant(r.tenant).preemptions == 0
    assert stats["num_preemptions"] == stats["num_recompute_preemptions"] + stats["num_swap_preemptions"] == 0
    engine.step()  # step 6: paused, although r now fits (3 free, a needs none)
    assert r in sched.waiting, "admitted in the step right after a preemption made while allocating"
    engine.step()  # step 7: r comes back
    assert r in sched.running and r.num_computed_tokens == 8
    finals = drain(engine)
    assert len(finals["a"].outputs[0].token_ids) == 16 and len(finals["r"].outputs[0].token_ids) == 2
    assert_no_leak(engine)


def test_admission_never_preempts_a_request_it_admitted_earlier_in_the_same_pass():
    """Kills: preempt-to-admit taking, as its victim, a request admitted earlier in the same admission pass.

    The rule (:mod:`minivllm.sched.scheduler`): a ranking policy preempts a *worse-ranked* running request to seat
    a better-ranked one.  A request admitted earlier in the pass was handed out earlier in the policy's order, so
    it ranks at or ahead of every later one.  WFQ is where this bites: whom it may preempt for whom reads the
    tenants' counters (more than a margin apart), its order the counters plus the prompts handed out so far.
    Hand-worked: budget 64 (margin 64), tenant ``y`` of weight 0.25 at counter 0, ``x`` at 70; 12-token prompts,
    so each of y's requests charges y 48.  The merge hands out y1 (0), y2 (48), x1 (70), y3 (96).  The pool (10
    blocks of 4) seats y1, y2 and x1 (3 blocks each); y3 does not fit.  x's counter is 70 ahead of y's, past the
    margin, but x1 ranks ahead of y3 in this very order: it keeps its seat and y3 waits.  With the guard gone,
    x1 was preempted before it ran a token and y3 took its place."""
    cfg = EngineConfig(num_gpu_blocks_override=10, block_size=4, max_num_batched_tokens=64, max_num_seqs=6,
                       max_model_len=16, scheduling_policy="wfq", tenants={"y": TenantConfig(weight=0.25)},
                       device="cpu")
    ex = RecordsRows(4)
    engine = LLMEngine(cfg, executor=ex, model_max_len=16, eos_token_ids=set())
    policy = engine.scheduler.admission_policy
    policy.counters.update(y=0.0, x=70.0)
    for rid, tenant in [("y1", "y"), ("y2", "y"), ("x1", "x"), ("y3", "y")]:
        engine.add_request({"prompt_token_ids": [9] * 12}, SamplingParams(max_tokens=2, ignore_eos=True), rid,
                           tenant=tenant)
    twin = WFQAdmission(cfg)  # the hand count, on a policy of its own (ordering moves a policy's state)
    twin.counters.update(policy.counters)
    assert [r.request_id for r in twin.order(list(engine.scheduler.waiting), [])] == ["y1", "y2", "x1", "y3"]
    assert policy.may_preempt_for(engine.requests["y3"], engine.requests["x1"])  # the counters alone would allow it
    engine.step()
    assert ex.rows == [{"y1": 12, "y2": 12, "x1": 12}]
    assert engine.step_log[-1].preempted == ()
    assert engine.requests["x1"].status is RequestStatus.RUNNING
    assert engine.requests["y3"].status is RequestStatus.WAITING
    drain(engine)
    assert_no_leak(engine)


def test_auto_mode_prices_a_swap_by_every_block_the_victim_fills_a_part_filled_last_one_too():
    """Auto mode asks its cost model about a victim with the blocks its computed tokens occupy -- what a swap
    copies out and back in -- counting a part-filled last block as a block: that block is what tips a short
    victim toward recompute.  Kills the count rounded down (a victim of 5 tokens in 4-token blocks priced as
    one block, so swapping it looked cheaper than it is).  Oracle: hand computation, ``ceil(tokens / 4)``, for
    every question the engine asks; the cost model answers "recompute", so no host tier is involved."""
    import random

    asked: list[tuple[int, int]] = []

    class RecordsQuestions:
        def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
            asked.append((num_tokens, num_blocks))
            return False

    cfg = EngineConfig(num_gpu_blocks_override=16, num_cpu_blocks_override=64, block_size=4, max_num_batched_tokens=64,
                       max_num_seqs=6, max_model_len=64, preemption_mode="auto", device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64, eos_token_ids=set(),
                       preemption_cost_model=RecordsQuestions())
    rng = random.Random(0)
    for _ in range(10):
        engine.add_request({"prompt_token_ids": [rng.randrange(10, 900) for _ in range(rng.randrange(5, 30))]},
                           SamplingParams(max_tokens=30, ignore_eos=True))
    drain(engine)
    assert_no_leak(engine)
    assert any(tokens % 4 for tokens, _ in asked), "some victim must end inside a block"
    assert all(blocks == math.ceil(tokens / 4) for tokens, blocks in asked)
