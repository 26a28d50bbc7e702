"""Checkers for lab 4 (chunked prefill): a batch builder, ITL percentiles, a budget sweep.

Also the lab's measurement harness, so the notebook, the quiz answers and the
tests compute the same numbers:

* :func:`install_batch_builder` -- the seam (:class:`~minivllm.interfaces.BatchBuilder`): a learner's
  ``build_batch(running, budget, threshold) -> [(request, num_tokens), ...]``
  replaces step 2 of the engine's loop (:meth:`Scheduler.build_batch`);
* :func:`mixed_arrivals` / :func:`serve` -- chat requests decoding while long
  prompts (the lesson's "64K-token prompt", scaled down to 8K) keep arriving,
  run on the engine's virtual clock;
* :func:`summarize`, :func:`throughput_run` -- what the sweeps print.

The fallbacks the notebook uses until a checker passes come from the engine by name
(:func:`engine_build_batch`: the Scheduler's own step 2; :func:`engine_itl_stats`: the engine's gaps
and numpy's nearest rank; :func:`engine_pick_budget`: the load generator's sweep verdict), never the
checkers' private references.  The module ends with the lab's registration (:data:`LAB`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from minivllm.arrival import Arrival, made_up_ids
from minivllm.config import EngineConfig
from minivllm.interfaces import BatchBuilder, check_seam
from minivllm.labs.checkers import Case, CheckResult, run_checks, wrong_container
from minivllm.labs.registry import Exercise, Lab
from minivllm.labs.workloads import GPU_LIKE, random_requests, run_engine, sim_engine
from minivllm.metrics.stats import nearest_rank
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.sched.scheduler import Scheduler
from minivllm.sim.executor import SimulatedExecutor

LONG_PROMPT = 8192  # the lesson's 64K-token prompt, scaled down 8x
NO_CHUNKING = 16384  # a budget above every step's demand (and chunked prefill off): whole prompts in one step

BuildBatch = BatchBuilder  # the learner's function: build_batch(running, budget, threshold) -> [(request, n)]


# -- the seam: a learner's batch builder inside the engine ---------------------------------


@dataclass(frozen=True)
class WithLimits:
    """``fn`` run under another token budget and chunk cap than the engine's own (``budget``, ``threshold``;
    None keeps the engine's): one loaded model serves runs at several budgets without being loaded again.
    Admission (step 1) still reads the engine's budget.  The total is checked against this budget, as the
    engine checks its own."""

    fn: BuildBatch
    budget: int | None = None
    threshold: int | None = None

    def __call__(self, running: list, budget: int, threshold: int) -> list:
        budget = self.budget if self.budget is not None else budget
        rows = list(self.fn(running, budget, self.threshold if self.threshold is not None else threshold))
        total = sum(n for _, n in rows)
        if total > budget:
            raise ValueError(f"build_batch scheduled {total} tokens, over the budget of {budget}")
        return rows


def install_batch_builder(engine, fn: BuildBatch, *, budget: int | None = None, threshold: int | None = None):
    """Make ``engine`` build every batch with ``fn`` from now on: the scheduler's
    :class:`~minivllm.interfaces.BatchBuilder` seam (an engine built for it takes ``batch_builder=fn``).
    ``budget`` and ``threshold``: see :class:`WithLimits`.  Call it before adding requests; returns the engine."""
    check_seam("batch_builder", fn, BatchBuilder)  # the check a new engine makes, before the seam is swapped
    if budget is not None or threshold is not None:
        fn = WithLimits(fn, budget, threshold)
    engine.scheduler.batch_builder = fn
    return engine


def _scheduler(budget: int, threshold: int) -> Scheduler:
    config = EngineConfig(max_num_batched_tokens=budget, long_prefill_token_threshold=threshold, device="cpu")
    return Scheduler(config, kv=None)  # build_batch never touches the KV manager


def engine_build_batch(running: list, budget: int, threshold: int) -> list:
    """The engine's own step 2 (``Scheduler.build_batch``) on ``running``: the fallback and the oracle."""
    s = _scheduler(budget, threshold)
    s.running = list(running)
    return [(q.request, q.num_tokens) for q in s.build_batch().seqs]


# -- request states for the checker ----------------------------------------------------------


def _req(rid: str, prompt: int, computed: int = 0, outputs: int = 0) -> Request:
    r = Request(rid, list(range(10, 10 + prompt)), SamplingParams(max_tokens=max(outputs, 1) + 64), 0.0)
    r.output_token_ids = [5] * outputs
    r.num_computed_tokens = computed
    return r


def decode(rid: str, prompt: int = 12, outputs: int = 3) -> Request:
    """A request whose only uncomputed token is its last sampled one."""
    return _req(rid, prompt, prompt + outputs - 1, outputs)


def prefill(rid: str, prompt: int, computed: int = 0) -> Request:
    return _req(rid, prompt, computed)


def random_running(rng: random.Random, n_max: int = 8) -> list:
    """A running set mixing decodes, fresh and part-done prefills, last-token prefills and recomputes."""
    out = []
    for i in range(rng.randint(0, n_max)):
        kind = rng.choice(["decode", "decode", "fresh", "partial", "last", "recompute"])
        p = rng.randint(2, 80)
        if kind == "decode":
            out.append(decode(f"d{i}", p, rng.randint(1, 9)))
        elif kind == "fresh":
            out.append(prefill(f"f{i}", p))
        elif kind == "partial":
            out.append(prefill(f"p{i}", p, rng.randint(1, p - 1)))
        elif kind == "last":
            out.append(prefill(f"l{i}", p, p - 1))
        else:
            out.append(_req(f"r{i}", p, 0, rng.randint(1, 9)))
    return out


def _as_dict(pairs) -> dict:
    """``{request_id: num_tokens}``; a request listed twice shows as ``('twice', n1, n2)``, so a duplicated row
    fails the comparison instead of the dict quietly keeping its last count."""
    out: dict = {}
    for req, n in pairs:
        rid = req.request_id
        out[rid] = ("twice", out[rid], n) if rid in out else n
    return out


def _random_states_match(fn: BuildBatch, n: int = 300, seed: int = 4) -> str:
    rng = random.Random(seed)
    for i in range(n):
        running = random_running(rng)
        budget = rng.randint(1, 96)
        threshold = rng.choice([0, 0, rng.randint(1, 40)])
        before = [(r.num_computed_tokens, r.num_tokens) for r in running]
        rows = fn(list(running), budget, threshold)
        if (bad := wrong_container(rows, list, f"state {i}")) is not None:  # as in the visible cases
            return bad
        got = _as_dict(rows)
        if [(r.num_computed_tokens, r.num_tokens) for r in running] != before:
            return f"state {i}: your function changed a request (num_computed_tokens or its tokens)"
        want = _as_dict(engine_build_batch(running, budget, threshold))
        if got != want:
            state = [(r.request_id, "decode" if r.is_decode else "prefill", r.num_uncomputed_tokens) for r in running]
            return (f"state {i}: budget={budget}, threshold={threshold}, running (id, kind, uncomputed)={state}: "
                    f"engine {want}, yours {got}")
    return f"all {n} match"


def _sim_trace(fn: BuildBatch | None, seed: int = 7, budget: int = 40, threshold: int = 24):
    """A small mixed run (chats decoding, long prompts arriving) with the engine's or ``fn``'s step 2."""
    eng = sim_engine(num_blocks=128, block_size=8, max_num_seqs=6, max_num_batched_tokens=budget, model_max_len=512,
                     long_prefill_token_threshold=threshold, batch_builder=fn)
    reqs = random_requests(10, seed=seed, prompt_range=(3, 150), output_range=(2, 20))
    finals = run_engine(eng, reqs, max_steps=3000)
    return len(finals), [e["seqs"] for e in eng.step_log]


# -- exercise 1: the batch builder --------------------------------------------------------------


def check_build_batch(fn: BuildBatch) -> CheckResult:
    """Check ``fn(running, budget, threshold) -> [(request, num_tokens), ...]`` (chunked prefill on)."""
    def run(running, budget, threshold=0):
        """The batch as ``{request_id: tokens}``, or what is wrong with its container: the signature's ``-> list``
        is part of the contract, as in every checker (a tuple of the right pairs used to pass both checkers)."""
        def case(f):
            rows = f(list(running), budget, threshold)
            return wrong_container(rows, list, "the batch") or _as_dict(rows)
        return case

    d1, d2, d3 = decode("d1"), decode("d2"), decode("d3")
    P = prefill("P", 100)
    expected_trace = _sim_trace(None)
    cases = [
        Case("nothing running", run([], 64), {}, "no running requests: return an empty list"),
        Case("three decodes, ample budget", run([d1, d2, d3], 64), {"d1": 1, "d2": 1, "d3": 1},
             "a decode (req.is_decode) computes exactly one token"),
        Case("a short prompt fits whole", run([prefill("a", 20)], 64), {"a": 20},
             "a prefill asks for req.num_uncomputed_tokens"),
        Case("a long prompt is chunked to the budget", run([P], 16), {"P": 16},
             "never schedule more tokens than the budget left: a chunk is min(what it wants, budget left)"),
        Case("a chunk continues where the last one stopped", run([prefill("b", 100, 90)], 64), {"b": 10},
             "ask for num_uncomputed_tokens (tokens - computed), not the whole prompt"),
        Case("decodes first, even when listed after a prefill", run([P, d1, d2], 10), {"d1": 1, "d2": 1, "P": 8},
             "take every decode before any prefill, so a running stream never stalls; prefills share what is left"),
        Case("decodes alone use up the budget", run([d1, d2, d3], 2), {"d1": 1, "d2": 1},
             "stop when the budget is spent (in running order); never add a row with 0 tokens"),
        Case("prefills share what is left, in running order", run([prefill("x", 40), prefill("y", 40)], 50),
             {"x": 40, "y": 10}, "subtract each row's num_tokens (not 1 per row) from the budget"),
        Case("the threshold caps a long prefill", run([P, prefill("s", 30)], 100, 16), {"P": 16, "s": 16},
             "long_prefill_token_threshold: no single request takes more than `threshold` tokens in one step"),
        Case("threshold 0 means no cap", run([P], 64, 0), {"P": 64}, "treat threshold == 0 as 'no per-request cap'"),
        Case("the threshold never raises a chunk", run([prefill("c", 100, 95)], 64, 16), {"c": 5},
             "the cap is min(uncomputed, threshold), not the threshold itself"),
        Case("the last prompt token is prefill, not decode", run([prefill("L", 20, 19), d1, d2], 2),
             {"d1": 1, "d2": 1}, "classify with req.is_decode, not 'one token left': a 1-token prefill chunk "
                                 "still waits behind the decodes"),
        Case("a preempted request recomputes its outputs too", run([_req("R", 20, 0, 5)], 64), {"R": 25},
             "after preemption (recompute) prompt AND generated tokens lack KV: use num_uncomputed_tokens"),
        Case("300 random states vs the engine's Scheduler.build_batch", _random_states_match, "all 300 match",
             "the first differing state is shown; compare it with the rules above"),
        Case("the real engine with your builder runs step for step like its own", _sim_trace, expected_trace,
             "install_batch_builder(engine, fn) runs your function as step 2 of every engine step",
             show_expected=f"{expected_trace[0]} requests finished, the same step log as the engine's"),
    ]
    return run_checks("build_batch", fn, cases)


# -- exercise 2: ITL percentile and worst gap --------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank: the smallest value with at least ``q`` % of the values at or below it (0.0 for none, so a
    lab's plot always has a number)."""
    return nearest_rank(values, q, 0.0)


def engine_itl_stats(token_times: dict, q: float = 99) -> tuple[float, float]:
    """``(q-th percentile ITL, worst ITL)`` as the engine and numpy compute them: the lab's fallback.

    The gaps are the engine's own :attr:`RequestMetrics.itls <minivllm.outputs.RequestMetrics.itls>`;
    the nearest-rank percentile is numpy's ``method="inverted_cdf"``.  Neither is the exercise's
    loop, so a learner who reads this learns where the numbers come from, not the answer to paste.
    numpy ranks in binary floats, so at some ``q`` it takes the next rank where the engine's
    :func:`~minivllm.metrics.stats.nearest_rank` (exact decimal ``q``) does not: p7 of 100 gaps, p99.9 of
    1,000.  At the lab's q = 50 and 99 the two agree; the checker accepts either rounding.
    """
    import numpy as np

    from minivllm.outputs import RequestMetrics

    gaps = [g for times in token_times.values() for g in RequestMetrics(0.0, token_times=list(times)).itls]
    if not gaps:
        return 0.0, 0.0
    return float(np.percentile(gaps, q, method="inverted_cdf")), float(max(gaps))


def _gaps(token_times: dict) -> list[float]:
    return [b - a for times in token_times.values() for a, b in zip(times, times[1:])]


def _itl_oracle(token_times: dict, q: float = 99) -> tuple[float, float]:
    """The checker's own reference (private: the notebook's fallback is :func:`engine_itl_stats`)."""
    gaps = _gaps(token_times)
    return (percentile(gaps, q), max(gaps)) if gaps else (0.0, 0.0)


def _itl_answers(token_times: dict, q: float) -> set:
    """Every answer a correct nearest rank gives: ``ceil(q / 100 * n)`` and ``ceil(q * n / 100)`` differ in
    floating point for some (q, n) -- 7 / 100 * 100 is 7.000000000000001 -- and the exact rank may differ from
    both.  A learner is graded on the rule, not on which of the three roundings the float arithmetic took."""
    from fractions import Fraction

    gaps = sorted(_gaps(token_times))
    if not gaps:
        return {(0.0, 0.0)}
    n = len(gaps)
    ranks = {math.ceil(q / 100 * n), math.ceil(q * n / 100), math.ceil(Fraction(str(q)) * n / 100)}
    return {(gaps[max(1, r) - 1], gaps[-1]) for r in ranks}


def _is_answer(got, token_times: dict, q: float) -> bool:
    """``got`` is a tuple (the signature's container) and one of :func:`_itl_answers`."""
    return isinstance(got, tuple) and got in _itl_answers(token_times, q)


def _times(gaps: Sequence[float], start: float = 0.0) -> list[float]:
    out = [start]
    for g in gaps:
        out.append(out[-1] + g)
    return out


def check_itl_stats(fn) -> CheckResult:
    """Check ``fn(token_times: {request_id: [times]}, q=99) -> (p_q ITL, worst ITL)``."""
    hundred = {"a": _times(range(1, 51)), "b": _times(range(51, 101), 1000)}
    one_fifty = {"a": _times(range(150, 0, -1))}
    one_sixty = {"a": _times(range(160, 0, -1))}  # 0.99 * 160 = 158.4: ceil and round-to-nearest part here
    one_stall = {"a": _times([1] * 199 + [10])}
    three_stalls = {f"r{i}": _times([1] * 66 + [10]) for i in range(3)}

    def real(f):
        eng = sim_engine(block_size=8, max_num_batched_tokens=32, max_num_seqs=4, model_max_len=512)
        finals = run_engine(eng, random_requests(6, seed=1, prompt_range=(4, 120), output_range=(3, 30)))
        times = {rid: o.metrics.token_times for rid, o in finals.items()}
        return _is_answer(f(times, 90), times, 90) and _is_answer(f(times), times, 99)

    cases = [
        Case("no requests", lambda f: f({}), (0.0, 0.0), "no gaps at all: return (0.0, 0.0)"),
        Case("one token each: no gaps", lambda f: f({"a": [1.0], "b": [2.0]}), (0.0, 0.0),
             "a request with a single token has no inter-token gap (its first token is TTFT, not ITL)",
             diagnose=lambda got: ("the gap you found, 1.0, runs from a's token to b's: gaps are differences WITHIN "
                                   "one request's list; don't merge the lists first" if list(got) == [1.0, 1.0] else None)),
        Case("gaps are per request, never across requests", lambda f: f({"a": [0, 4, 8], "b": [1, 5, 9]}, 50),
             (4, 4), "take differences of consecutive times WITHIN each request's list; two streams interleaved "
                     "in time do not shorten each other's gaps"),
        Case("q is a percentage: q=50 of 1,2,3,4 is 2", lambda f: f({"a": _times([3, 1, 4, 2])}, 50), (2, 4),
             "sort the gaps first; nearest rank: the value at position ceil(q/100 * n) counting from 1"),
        Case("p99 of 100 gaps is the 99th smallest", lambda f: f(hundred), (99, 100),
             "nearest rank counts from 1: index ceil(0.99 * 100) - 1 = 98 in a 0-based sorted list"),
        Case("p99 of 150 gaps rounds the rank up", lambda f: f(one_fifty), (149, 150),
             "0.99 * 150 = 148.5: round UP to rank 149 (math.ceil), i.e. index 148"),
        Case("p99 of 160 gaps rounds the rank up from .4 too", lambda f: f(one_sixty), (159, 160),
             "0.99 * 160 = 158.4: 158 gaps are under 99 %, so rank 159 (math.ceil), i.e. index 158 -- rounding to "
             "the nearest rank (int(x + 0.5), round) goes down whenever the fraction is below .5"),
        Case("one stall in 200 gaps: p99 misses it, the worst gap does not", lambda f: f(one_stall), (1, 10),
             "worst = the largest gap, whatever the percentile is"),
        Case("three stalls in 201 gaps: p99 sees them", lambda f: f(three_stalls), (10, 10),
             "ceil(0.99 * 201) = 199: the 199th smallest gap is a stall"),
        Case("q=100 is the worst gap", lambda f: f(hundred, 100), (100, 100), "rank ceil(1.0 * n) = n: the largest"),
        Case("q=0 is the smallest gap", lambda f: f(hundred, 0), (1, 100),
             "rank ceil(0 * n) = 0 is below the first: nearest rank is at least 1 (index -1 is the LAST gap)"),
        Case("token times from a real engine run", real, True, "per request: token_times[i+1] - token_times[i]"),
    ]
    return run_checks("itl_stats", fn, cases)


# -- exercise 3: pick the budget ---------------------------------------------------------------------


def engine_pick_budget(measure: Callable[[int], dict], budgets: Sequence[int], itl_target_s: float):
    """The load generator's sweep verdict applied to budgets: the lab's fallback.

    ``minivllm bench serve --rates R1,R2,... --slo-itl-ms MS`` picks the highest request *rate* whose
    p99 ITL meets an SLO (:func:`minivllm.bench.loadgen.sweep_verdict`); the same rule, with budgets in place of rates,
    is what exercise 3 asks for.  Each budget is measured once.
    """
    from minivllm.bench.loadgen import sweep_verdict

    rows = []
    for b in budgets:
        p99 = measure(b)["itl_p99"]
        rows.append({"rate": b, "overall": {"ok": 1, "itl_ms": {"p99": p99 * 1000}, "ttft_ms": {"p99": None}}})
    return sweep_verdict(rows, "itl", None, itl_target_s, 0.0)["max_rate_meeting_slo"]


def _pick_budget_oracle(measure: Callable[[int], dict], budgets: Sequence[int], itl_target_s: float):
    """The checker's own reference (private: the notebook's fallback is :func:`engine_pick_budget`)."""
    ok = [b for b in budgets if measure(b)["itl_p99"] <= itl_target_s]
    return max(ok) if ok else None


class _Measure:
    """A fake sweep: ``{budget: (p99, worst)}``; counts calls."""

    def __init__(self, table: dict) -> None:
        self.table, self.calls = table, 0

    def __call__(self, budget: int) -> dict:
        self.calls += 1
        p99, worst = self.table[budget]
        return {"itl_p99": p99, "itl_worst": worst, "itl_p50": p99 / 4, "ttft_long": 1.0 / budget,
                "tokens_per_s": float(budget)}


def check_pick_budget(fn) -> CheckResult:
    """Check ``fn(measure, budgets, itl_target_s) -> budget or None``."""
    curve = {128: (0.010, 0.011), 256: (0.020, 0.030), 512: (0.030, 0.045), 1024: (0.040, 0.060)}

    def pick(table, budgets, target):
        return lambda f: f(_Measure(table), list(budgets), target)

    def calls(f):
        m = _Measure(curve)
        seen = []
        f(lambda b: (seen.append(b), m(b))[1], list(curve), 0.030)
        return len(seen) == len(set(seen))

    def untouched(f):
        budgets = [1024, 128, 512, 256]
        f(_Measure(curve), budgets, 0.030)
        return budgets

    def fresh(f):
        slower = {b: (2 * p99, 2 * worst) for b, (p99, worst) in curve.items()}  # the same sweep on a slower GPU
        return f(_Measure(curve), list(curve), 0.030), f(_Measure(slower), list(curve), 0.030)

    def sim(f):
        def measure(budget):  # the same keys as the notebook's measure(b)
            return dict(summarize(serve(mixed_arrivals(num_long=2, seed=3), budget)[1]),
                        tokens_per_s=throughput_run(budget))
        budgets = [256, 1024, 4096, NO_CHUNKING]
        return f(measure, budgets, 0.040) == _pick_budget_oracle(measure, budgets, 0.040)

    cases = [
        Case("one budget, and it meets the target", pick({256: (0.02, 0.03)}, [256], 0.05), 256,
             "return the budget when its measure(b)['itl_p99'] <= the target"),
        Case("no budget meets the target", pick(curve, list(curve), 0.005), None,
             "return None when nothing qualifies (don't fall back to some budget)"),
        Case("the largest budget that meets the target", pick(curve, list(curve), 0.035), 512,
             "a bigger budget means more throughput and a faster long prompt: keep the LARGEST that qualifies"),
        Case("exactly on target counts as meeting it", pick(curve, list(curve), 0.030), 512,
             "meets = p99 <= target (not <)"),
        Case("a hair over the target misses",
             pick({2048: (0.0300, 0.040), 4096: (0.0304, 0.050)}, [2048, 4096], 0.030), 2048,
             "30.4 ms is over a 30 ms target: compare the measured p99 itself, don't round it (or cut it to whole "
             "milliseconds) first"),
        Case("no budgets at all", pick({}, [], 0.030), None,
             "an empty sweep has no budget that meets the target: return None, as when none qualifies"),
        Case("budgets in any order", pick(curve, [1024, 128, 512, 256], 0.030), 512,
             "don't assume the list is sorted: take the max of those that qualify"),
        # 256 meets with a higher p99 than 512: an answer that keeps the p99 closest to the target (the same
        # budget on every monotone curve above) picks it
        Case("a smaller budget misses, a larger one meets",
             pick({128: (0.040, 0.050), 256: (0.028, 0.035), 512: (0.025, 0.040)}, [128, 256, 512], 0.030), 512,
             "measured p99s need not grow with the budget (noise, where the long prompts landed): check every "
             "budget and keep the largest that meets the target -- don't stop at the first one that misses, and "
             "don't keep the one whose p99 comes closest to the target"),
        Case("judged on p99, not on the worst gap", pick(curve, list(curve), 0.041), 1024,
             "the target is on measure(b)['itl_p99']; the worst gap is reported, not the criterion"),
        Case("no budget measured twice", calls, True,
             "a measurement is a whole run: call measure(b) at most once per budget and keep the result"),
        Case("the budgets are only read", untouched, [1024, 128, 512, 256],
             "don't sort the list you are given: it is the caller's (the notebook passes its BUDGETS, in the order "
             "its table and plots use); sorted(budgets) makes a new list"),
        Case("every call measures afresh", fresh, (512, 128),
             "the same budgets on a slower GPU (every p99 doubled) meet the target only at 128: each call's measure is "
             "a new experiment, so keep its results inside the call -- a cache in a global (or on the function) "
             "answers the second sweep with the first one's numbers"),
        Case("a real sweep on the simulated engine", sim, True, "measure(b) runs the engine; compare its 'itl_p99'"),
    ]
    return run_checks("pick_budget", fn, cases)


# -- hidden cases (the grader's, seeded at grading time) ----------------------------------------------


def hidden_build_batch(fn: BuildBatch, seed: int) -> CheckResult:
    """Random running sets and a randomly configured engine run, compared with the engine's Scheduler."""
    rng = random.Random(seed)
    run_seed, budget, threshold = rng.randrange(1 << 30), rng.randint(8, 64), rng.choice([0, rng.randint(1, 40)])
    return run_checks("build_batch (hidden)", fn, [
        Case("200 random running sets vs Scheduler.build_batch",
             lambda f: _random_states_match(f, n=200, seed=run_seed), "all 200 match"),
        Case("a randomly configured engine run, step for step",
             lambda f: _sim_trace(f, run_seed, budget, threshold) == _sim_trace(None, run_seed, budget, threshold),
             True),
    ], verbose=False)


def hidden_itl_stats(fn, seed: int) -> CheckResult:
    """Random streams (stalls, single tokens, equal gaps) at random percentiles."""
    rng = random.Random(seed)

    def random_streams(f):
        for trial in range(150):
            times = {}
            for i in range(rng.randint(0, 5)):
                gaps = [rng.choice([0.015, 0.015, 0.02, rng.uniform(0.01, 0.05), 0.18])
                        for _ in range(rng.choice([0, rng.randint(1, 40), rng.randint(40, 120)]))]
                times[f"r{i}"] = _times(gaps, rng.uniform(0, 5))
            q = rng.choice([50, 90, 95, 99, 99.9, 100, rng.randint(1, 100)])
            got = f({k: list(v) for k, v in times.items()}, q)
            if (bad := wrong_container(got, tuple, f"trial {trial}")) is not None:  # as in the visible cases
                return bad
            if not _is_answer(got, times, q):
                return f"trial {trial} differs"
        return "all 150 match"

    return run_checks("itl_stats (hidden)", fn, [Case("150 random stream sets and percentiles", random_streams,
                                                      "all 150 match")], verbose=False)


def hidden_pick_budget(fn, seed: int) -> CheckResult:
    """Random sweep tables (any order, ties on the target, nothing qualifying, no budgets at all, the largest
    budget a fraction of a millisecond over the target), no budget measured twice, the list of budgets only read.

    The tables' p99s are whole milliseconds, so the "hair over" budget is what tells an answer that compares the
    measured p99 from one that rounds it (or cuts it to whole ms) first: 30.4 ms does not meet 30 ms."""
    rng = random.Random(seed)

    def random_sweeps(f):
        for trial in range(100):
            budgets = rng.sample([64, 128, 256, 512, 1024, 2048, 4096, 8192], rng.choice([0, *range(1, 9)]))
            table = {b: (round(rng.uniform(0.005, 0.06), 3), round(rng.uniform(0.06, 0.2), 3)) for b in budgets}
            target = round(rng.uniform(0.0, 0.07), 3)
            if table and rng.random() < 0.5:
                target = rng.choice(list(table.values()))[0]
            if table and rng.random() < 0.3:
                table[max(budgets)] = (target + rng.choice([1e-6, 1e-4, 4e-4]), 0.2)
            seen: list = []
            m = _Measure(table)
            given = list(budgets)
            got = f(lambda b: (seen.append(b), m(b))[1], given, target)
            if got != _pick_budget_oracle(_Measure(table), budgets, target) or len(seen) != len(set(seen)) \
                    or given != budgets:
                return f"sweep {trial} differs"
        return "all 100 match"

    return run_checks("pick_budget (hidden)", fn, [Case("100 random sweeps", random_sweeps, "all 100 match")],
                      verbose=False)


# -- quiz answers (``"compute": "minivllm.labs.check_lab04:<name>"`` in quizzes/lab04.json) ----------


def quiz_steps_to_first_token() -> int:
    """Steps from admission to the first token of a 1,000-token prompt while 3 requests decode (budget 256)."""
    eng = sim_engine(block_size=16, max_num_batched_tokens=256, max_num_seqs=8)
    for i in range(3):
        eng.add_request({"prompt_token_ids": [20 + i] * 8}, SamplingParams(max_tokens=50, ignore_eos=True), f"c{i}")
    eng.step()  # the three short prompts prefill (and sample their first tokens): from now on they decode
    eng.add_request({"prompt_token_ids": [11] * 1000}, SamplingParams(max_tokens=1, ignore_eos=True), "L")
    for steps in range(1, 100):
        if any(o.request_id == "L" and o.finished for o in eng.step()):
            return steps
    raise AssertionError("the long prompt never finished")


def quiz_stalls_p99_sees() -> int:
    """Fewest 180 ms stalls among 200 gaps (the rest 15 ms) for the nearest-rank p99 to be a stall."""
    return next(k for k in range(201) if percentile([0.015] * (200 - k) + [0.180] * k, 99) == 0.180)


# -- the measurement harness -------------------------------------------------------------------------


def mixed_arrivals(*, num_long: int = 5, long_len: int = LONG_PROMPT, long_every_s: float = 1.0,
                   first_long_s: float = 0.5, chat_every_s: float = 0.12, chat_prompt=(32, 96),
                   chat_output=(60, 120), seed: int = 0, shared_long_prefix: bool = False) -> list[Arrival]:
    """Chat requests (``c*``: short prompt, long answer) arriving all along, and ``num_long`` long prompts
    (``L*``, 8 output tokens) every ``long_every_s``.  With ``shared_long_prefix`` every long prompt is the
    same document followed by its own 32-token question (a prefix-cache workload)."""
    rng = random.Random(seed)
    out = []
    t, i = 0.0, 0
    horizon = first_long_s + num_long * long_every_s
    while t < horizon:
        prompt = tuple(made_up_ids(rng, rng.randint(*chat_prompt)))
        out.append(Arrival(round(t, 6), f"c{i}", "default", prompt, rng.randint(*chat_output)))
        t += rng.expovariate(1 / chat_every_s)
        i += 1
    doc = tuple(made_up_ids(rng, long_len))
    for k in range(num_long):
        if shared_long_prefix:
            prompt = doc + tuple(made_up_ids(rng, 32))
        else:
            prompt = tuple(made_up_ids(rng, long_len))
        out.append(Arrival(round(first_long_s + k * long_every_s, 6), f"L{k}", "default", prompt, 8))
    return sorted(out, key=lambda a: (a.time, a.request_id))


def lab_engine(budget: int, threshold: int = 0, *, builder: BuildBatch | None = None, **options: Any):
    """The lab's simulated engine: GPU-like step cost, room for 8K prompts; ``budget >= NO_CHUNKING``
    turns chunked prefill off (every prompt in one step)."""
    chunked = budget < NO_CHUNKING
    return sim_engine(num_blocks=4096, block_size=16, max_num_seqs=32, model_max_len=16384,
                      max_num_batched_tokens=budget, long_prefill_token_threshold=threshold if chunked else 0,
                      enable_chunked_prefill=chunked, executor=SimulatedExecutor(**GPU_LIKE),
                      batch_builder=builder if chunked else None, **options)


def run_arrivals(engine, arrivals: Sequence[Arrival], *, max_steps: int = 200_000) -> dict:
    """Step ``engine``, adding each request once its virtual clock reaches the arrival time.

    When the engine is idle the clock jumps to the next arrival.  The clock
    before each step is kept in ``engine.lab_step_starts`` (aligned with
    ``engine.step_log``; see :func:`step_durations`).  Returns
    ``{request_id: final RequestOutput}``.
    """
    clock = engine.executor
    starts = engine.__dict__.setdefault("lab_step_starts", [])
    finals: dict = {}
    k = 0
    for _ in range(max_steps):
        if k >= len(arrivals) and not engine.has_unfinished_requests():
            break
        if not engine.has_unfinished_requests() and k < len(arrivals) and arrivals[k].time > clock.now():
            clock.clock = arrivals[k].time  # idle: nothing happens until the next arrival
        while k < len(arrivals) and arrivals[k].time <= clock.now():
            a = arrivals[k]
            engine.add_request({"prompt_token_ids": list(a.prompt)},
                               SamplingParams(max_tokens=a.max_tokens, ignore_eos=True), a.request_id,
                               tenant=a.tenant, arrival_time=a.time)
            k += 1
        starts.append(clock.now())
        for o in engine.step():
            if o.finished:
                finals[o.request_id] = o
    return finals


def step_starts(engine) -> list[float]:
    """The clock before each step of ``engine.step_log`` (recorded by :func:`run_arrivals`; else the
    previous step's end)."""
    recorded = getattr(engine, "lab_step_starts", None)
    if recorded is not None and len(recorded) == len(engine.step_log):
        return list(recorded)
    out, prev = [], 0.0
    for e in engine.step_log:
        out.append(prev)
        prev = e["time"]
    return out


def step_durations(engine) -> list[float]:
    """Seconds each step of ``engine.step_log`` took."""
    return [e["time"] - s for e, s in zip(engine.step_log, step_starts(engine))]


def serve(arrivals: Sequence[Arrival], budget: int, threshold: int = 0, *, builder: BuildBatch | None = None,
          **options: Any):
    """``(engine, finals)``: ``arrivals`` served by :func:`lab_engine` (``budget``, ``threshold``, ``builder``)."""
    eng = lab_engine(budget, threshold, builder=builder, **options)
    return eng, run_arrivals(eng, arrivals)


def decoder_times(finals: dict) -> dict:
    """Token times of the chat requests (the streams a long prompt can stall)."""
    return {rid: o.metrics.token_times for rid, o in finals.items() if rid.startswith("c")}


def summarize(finals: dict, itl_stats: Callable = _itl_oracle) -> dict:
    """The numbers the lab prints: decoders' ITL p50/p99/worst, TTFTs (seconds).

    ``ttft_mean`` is the average over every request, the number a dashboard shows first: the lab sets it beside
    the p99 gap to measure the lesson's "ITL p99 under mixed workloads, not just average TTFT"."""
    times = decoder_times(finals)
    p50, _ = itl_stats(times, 50)
    p99, worst = itl_stats(times, 99)
    long_ttft = [o.metrics.ttft for rid, o in finals.items() if rid.startswith("L")]
    chat_ttft = [o.metrics.ttft for rid, o in finals.items() if rid.startswith("c")]
    every = long_ttft + chat_ttft
    return {"itl_p50": p50, "itl_p99": p99, "itl_worst": worst,
            "ttft_long": sum(long_ttft) / len(long_ttft) if long_ttft else 0.0,
            "ttft_chat_p99": percentile(chat_ttft, 99),
            "ttft_mean": sum(every) / len(every) if every else 0.0}


def throughput_run(budget: int, threshold: int = 0, *, builder: BuildBatch | None = None, n: int = 64,
                   seed: int = 3) -> float:
    """Tokens (prompt + output) per second of a saturated backlog: ``n`` requests queued at t=0."""
    eng = lab_engine(budget, threshold, builder=builder)
    reqs = random_requests(n, seed=seed, prompt_range=(256, 2048), output_range=(16, 64))
    run_engine(eng, reqs)
    return sum(len(p) + m for p, m in reqs) / eng.executor.now()


def prefill_block(engine, request_id: str, prompt_len: int) -> tuple[int, float]:
    """``(steps that carried request_id's prefill, the longest of those steps in seconds)``."""
    longest, steps = 0.0, 0
    for e, dt in zip(engine.step_log, step_durations(engine)):
        if any(rid == request_id and s < prompt_len for rid, s, _ in e["seqs"]):
            steps += 1
            longest = max(longest, dt)
    return steps, longest


__all__ = [
    "GPU_LIKE", "LONG_PROMPT", "NO_CHUNKING", "WithLimits", "check_build_batch",
    "check_itl_stats", "check_pick_budget", "decoder_times", "engine_build_batch", "engine_itl_stats",
    "engine_pick_budget", "install_batch_builder", "lab_engine", "mixed_arrivals",
    "percentile", "prefill_block", "run_arrivals", "serve", "step_durations", "step_starts", "summarize",
    "throughput_run",
]


# -- the registration ---------------------------------------------------------------------------------

LAB = Lab(4, "lab04_chunked_prefill", "Chunked prefill", exercises=(
    Exercise("build_batch", "build_batch", check_build_batch, points=2, hidden=hidden_build_batch, mutants=(
        ("prefills before decodes", "for req in decodes + prefills:", "for req in prefills + decodes:"),
        ("running order, not decode-first", "for req in decodes + prefills:", "for req in running:"),
        ("decode = one token left",
         "decodes = [r for r in running if r.is_decode]\n    prefills = [r for r in running if not r.is_decode]",
         "decodes = [r for r in running if r.num_uncomputed_tokens == 1]\n"
         "    prefills = [r for r in running if r.num_uncomputed_tokens != 1]"),
        ("threshold ignored", "if threshold:\n            want = min(want, threshold)",
         "if False:\n            want = min(want, threshold)"),
        ("threshold 0 taken as a cap of 0", "if threshold:\n            want", "if True:\n            want"),
        ("threshold as the chunk size", "want = min(want, threshold)", "want = threshold"),
        ("chunk not capped by the budget", "n = min(want, budget)", "n = want"),
        ("zero-token rows when the budget is spent", "if budget <= 0:", "if budget < 0:"),
        ("counts rows, not tokens", "budget -= n", "budget -= 1"),
        ("whole prompt, not the uncomputed rest", "want = req.num_uncomputed_tokens", "want = req.num_tokens"),
    )),
    Exercise("itl_stats", "itl_stats", check_itl_stats, points=1, hidden=hidden_itl_stats, mutants=(
        ("gaps across requests (times merged)",
         "for times in token_times.values() for a, b in zip(times, times[1:])",
         "for times in [sorted(t for ts in token_times.values() for t in ts)] for a, b in zip(times, times[1:])"),
        ("rank off by one", "gaps[max(rank, 1) - 1]", "gaps[min(rank, len(gaps) - 1)]"),
        ("rank rounded down", "math.ceil(q / 100 * len(gaps))", "int(q / 100 * len(gaps))"),
        # right on 148.5 (the 150-gap case), where rounding half up and the ceiling agree
        ("rank rounded to the nearest, half up", "math.ceil(q / 100 * len(gaps))", "int(q / 100 * len(gaps) + 0.5)"),
        ("no floor on the rank (q=0 reads the worst gap)", "gaps[max(rank, 1) - 1]", "gaps[rank - 1]"),
        ("gaps not sorted", "gaps = sorted(", "gaps = list("),
        ("q fixed at 99", "q / 100", "0.99"),
        ("worst = the percentile", "return gaps[max(rank, 1) - 1], gaps[-1]",
         "return gaps[max(rank, 1) - 1], gaps[max(rank, 1) - 1]"),
        ("mean instead of percentile", "return gaps[max(rank, 1) - 1], gaps[-1]",
         "return sum(gaps) / len(gaps), gaps[-1]"),
        ("no empty case", "if not gaps:\n        return 0.0, 0.0\n    ", ""),  # (ends with the next line's indent)
    )),
    Exercise("pick_budget", "pick_budget", check_pick_budget, points=1, hidden=hidden_pick_budget, mutants=(
        ("smallest instead of largest", "max(meets)", "min(meets)"),
        ("strictly below the target", "<= itl_target_s", "< itl_target_s"),
        ("judged on the worst gap", '"itl_p99"', '"itl_worst"'),
        ("judged on the median", '"itl_p99"', '"itl_p50"'),
        ("assumes sorted budgets", "max(meets)", "meets[-1]"),
        ("keeps the highest p99 that meets the target, not the largest budget",
         'meets = [b for b in budgets if measure(b)["itl_p99"] <= itl_target_s]\n    return max(meets) if meets else None',
         'p99 = {b: measure(b)["itl_p99"] for b in budgets}\n    meets = [b for b in budgets if p99[b] <= itl_target_s]\n'
         '    return max(meets, key=p99.get) if meets else None'),
        ("a budget even when none qualifies", "return max(meets) if meets else None",
         "return max(meets) if meets else max(budgets)"),
        ("measures twice", '[b for b in budgets if measure(b)["itl_p99"] <= itl_target_s]',
         '[b for b in budgets if measure(b)["itl_p99"] <= itl_target_s and measure(b)]'),
        ("sorts the caller's list", "meets = [b for b in budgets",
         "budgets.sort()\n    meets = [b for b in budgets"),
        ("keeps the measurements in a global across calls",
         'meets = [b for b in budgets if measure(b)["itl_p99"] <= itl_target_s]',
         'cache = globals().setdefault("_MEASURED", {})\n    for b in budgets:\n        if b not in cache:\n'
         '            cache[b] = measure(b)\n    meets = [b for b in budgets if cache[b]["itl_p99"] <= itl_target_s]'),
    )),
))
