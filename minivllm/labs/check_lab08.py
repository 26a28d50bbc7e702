"""Checkers for lab 8 (observability and serving): metrics from the step log, an autoscaling alarm.

Also the lab's simulated machine and its measurements, written once here so the
notebook, the quiz answers and the tests print the same numbers:

* :data:`SERVING_GPU` -- the cost model of the big sweeps: an 8B-class model on
  one datacenter GPU (12 ms per step, 30 us per batched token, 0.3 us per KV
  token read), on :class:`~minivllm.sim.executor.SimulatedExecutor`;
* :func:`lab_engine` -- a real ``LLMEngine`` on it (512 KV blocks of 16 tokens,
  64 seats, a 1024-token step budget: memory, not compute, is the bottleneck,
  as on most real deployments);
* :func:`knee_sweep` and :func:`ramp_run` -- the latency/rate curve and the
  ramp the alarms are compared on.

Exercise 1's checker compares the learner's metrics with the engine's own
Prometheus series (:class:`~minivllm.metrics.prometheus.EngineMetrics`, the
numbers ``GET /metrics`` serves), never with a second copy of the solution.
"""

from __future__ import annotations

import functools
import random
from typing import Any, Sequence

from minivllm.labs.checkers import Case, CheckResult, run_checks
from minivllm.labs.live import Sample, SimRun, ramp_arrivals, run_sim_load
from minivllm.labs.registry import Exercise, Lab
from minivllm.metrics.prometheus import metrics_from_step_log
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor

SERVING_GPU = dict(fixed_overhead_s=0.012, per_token_s=0.00003, per_context_token_s=0.0000003)
SLO_TTFT_S = 1.0  # the lab's SLO: p99 TTFT under a second ...
SLO_ITL_S = 0.050  # ... and p99 ITL under 50 ms
KNEE_RATES = (2, 4, 6, 7, 8, 9, 10, 12, 16)
RAMP_RATES = (2, 4, 6, 8, 10, 12, 14, 16)  # req/s, 5 s each


def lab_engine(*, num_blocks: int = 512, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, **options: Any):
    """The lab's simulated serving machine (see the module docstring)."""
    from minivllm.labs.workloads import sim_engine

    return sim_engine(num_blocks=num_blocks, block_size=16, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, model_max_len=2048,
                      executor=SimulatedExecutor(**SERVING_GPU), **options)


def knee_sweep(rates: Sequence[float] = KNEE_RATES, seconds: float = 20.0, seed: int = 1) -> dict[float, dict]:
    """``{rate: SimRun.summary()}``: a flat Poisson load of ``seconds`` at each rate on :func:`lab_engine`."""
    return {r: run_sim_load(lab_engine(), ramp_arrivals([r], seconds, seed=seed)).summary() for r in rates}


def max_rate_meeting_slo(sweep: dict[float, dict], ttft_s: float = SLO_TTFT_S, itl_s: float = SLO_ITL_S) -> float | None:
    """The highest swept rate at or below which every rate meets both p99 SLOs (None: not even the lowest)."""
    best = None
    for rate in sorted(sweep):
        s = sweep[rate]
        if s["ttft_p99_ms"] <= 1000 * ttft_s and s["itl_p99_ms"] <= 1000 * itl_s:
            best = rate
        else:
            break
    return best


def ramp_run(seed: int = 1, every_s: float = 1.0) -> SimRun:
    """The ramp of section 5: 2 -> 16 req/s in steps of 5 s, scraped every second."""
    return run_sim_load(lab_engine(), ramp_arrivals(RAMP_RATES, 5.0, seed=seed), every_s=every_s)


def knee_figure(sweep: dict[float, dict], best: float | None, ttft_s: float = SLO_TTFT_S, itl_s: float = SLO_ITL_S):
    """A sweep's p99 TTFT (log scale) and p99 ITL against the offered rate, SLO lines dotted, the knee dashed.

    A :class:`matplotlib.figure.Figure` of its own (not pyplot's), so a notebook shows it exactly once, as
    the cell's value."""
    from matplotlib.figure import Figure

    rates = list(sweep)
    fig = Figure(figsize=(7, 3))
    ax = fig.subplots()
    ax.plot(rates, [sweep[r]["ttft_p99_ms"] / 1000 for r in rates], "o-", color="#f28e2b", label="p99 TTFT (s)")
    ax.axhline(ttft_s, color="#f28e2b", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("p99 TTFT (s)")
    ax2 = ax.twinx()
    ax2.plot(rates, [sweep[r]["itl_p99_ms"] for r in rates], "s-", color="#4e79a7", label="p99 ITL (ms)")
    ax2.axhline(1000 * itl_s, color="#4e79a7", ls=":", lw=1)
    ax2.set_ylabel("p99 ITL (ms)")
    ax2.set_ylim(0, 100)
    if best is not None:
        ax.axvline(best, color="#888888", ls="--", lw=1)
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88), fontsize=8)
    fig.tight_layout()
    return fig


def knee_table(sweep: dict[float, dict], best: float | None, ttft_s: float = SLO_TTFT_S, itl_s: float = SLO_ITL_S) -> str:
    """The sweep as text: p99 TTFT and ITL, tokens/s and preemptions per rate, and the highest rate within both SLOs."""
    lines = [f"{'rate':>5s}{'TTFT p99 ms':>12s}{'ITL p99 ms':>11s}{'tokens/s':>9s}{'preempt':>8s}"]
    for r, s in sweep.items():
        lines.append(f"{r:5}{s['ttft_p99_ms']:12.0f}{s['itl_p99_ms']:11.1f}{s['tokens_per_s']:9.0f}{s['preemptions']:8d}")
    lines.append(f"highest rate meeting p99 TTFT <= {ttft_s:g} s and p99 ITL <= {1000 * itl_s:g} ms: {best} req/s")
    return "\n".join(lines)


def rate_at(t: float | None, seconds_each: float = 5.0, rates: Sequence[float] = RAMP_RATES) -> float | None:
    """The offered rate of the ramp at time ``t`` (None for None; the last rate after the ramp ends)."""
    if t is None:
        return None
    return rates[min(len(rates) - 1, int(t // seconds_each))]


# -- exercise 1: the seed's metric list, from the step log ----------------------------------------


def _metric_run(requests: Sequence[tuple[int, int, float]], *, num_blocks: int = 64, budget: int = 256,
                max_seqs: int = 16, stop_after: int | None = None, mode: str = "recompute"):
    """Serve ``(prompt_len, max_tokens, arrival)`` requests on a small simulated engine with the engine's own
    Prometheus metrics attached; stop after ``stop_after`` steps (mid-run gauges) or at the end.

    Returns (engine, metrics samples, prompt_lens, arrivals)."""
    from prometheus_client.parser import text_string_to_metric_families

    from minivllm.labs.workloads import sim_engine
    from minivllm.metrics.prometheus import EngineMetrics, observe_all

    engine = sim_engine(num_blocks=num_blocks, block_size=16, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                        model_max_len=1024, preemption_mode=mode, num_cpu_blocks_override=256 if mode == "swap" else None,
                        executor=SimulatedExecutor(**SERVING_GPU))
    metrics = EngineMetrics("lab8")
    prompt_lens, arrivals = {}, {}
    rng = random.Random(len(requests))
    pending = sorted(((a, p, m, f"q{i}") for i, (p, m, a) in enumerate(requests)))
    ex = engine.executor
    steps = 0
    while pending or engine.has_unfinished_requests():
        if pending and not engine.has_unfinished_requests() and ex.clock < pending[0][0]:
            ex.clock = pending[0][0]
        while pending and pending[0][0] <= ex.clock:
            a, p, m, rid = pending.pop(0)
            engine.add_request({"prompt_token_ids": [rng.randrange(10, 900) for _ in range(p)]},
                               SamplingParams(max_tokens=m, ignore_eos=True), rid, arrival_time=a)
            prompt_lens[rid], arrivals[rid] = p, a
        if not engine.has_unfinished_requests():
            continue
        observe_all(metrics, engine, engine.step())
        steps += 1
        if stop_after is not None and steps >= stop_after:
            break
    samples: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return engine, samples, prompt_lens, arrivals


def _prom_view(samples: dict) -> dict:
    """The engine's Prometheus numbers, in the shape compared below."""
    return {
        "running": int(samples.get("vllm:num_requests_running", 0)),
        "waiting": int(samples.get("vllm:num_requests_waiting", 0)),
        "used_blocks": int(samples.get("vllm:kv_cache_used_blocks", 0)),
        "free_blocks": int(samples.get("vllm:kv_cache_free_blocks", 0)),
        "preemptions": int(samples.get("vllm:num_preemptions_total", 0)),
        "generation_tokens": int(samples.get("vllm:generation_tokens_total", 0)),
        "ttft count": int(samples.get("vllm:time_to_first_token_seconds_count", 0)),
        "ttft sum": round(samples.get("vllm:time_to_first_token_seconds_sum", 0.0), 6),
        "itl count": int(samples.get("vllm:inter_token_latency_seconds_count", 0)),
        "itl sum": round(samples.get("vllm:inter_token_latency_seconds_sum", 0.0), 6),
    }


def _learner_view(got: dict) -> dict:
    ttft, itl = got["ttft"], list(got["itl"])
    return {
        "running": got["running"], "waiting": got["waiting"], "used_blocks": got["used_blocks"],
        "free_blocks": got["free_blocks"], "preemptions": got["preemptions"],
        "generation_tokens": got["generation_tokens"],
        "ttft count": len(ttft), "ttft sum": round(sum(ttft.values()), 6),
        "itl count": len(itl), "itl sum": round(sum(itl), 6),
    }


def _compare(requests, **kw):
    """A case body: the learner's metrics of one run, next to the engine's Prometheus numbers of the same run."""
    def run(fn):
        engine, samples, plens, arr = _metric_run(requests, **kw)
        return _learner_view(fn(engine.step_log, plens, arr, engine.stats()["num_blocks"]))

    def expected():
        _, samples, _, _ = _metric_run(requests, **kw)
        return _prom_view(samples)

    return run, expected()


def _one_request_exact(fn) -> tuple:
    engine, _, plens, arr = _metric_run([(20, 5, 0.5)])
    got = fn(engine.step_log, plens, arr, 64)
    times = [r.time for r in engine.step_log]
    return (round(got["ttft"]["q0"], 9), [round(g, 9) for g in got["itl"]]), \
        (round(times[0] - 0.5, 9), [round(b - a, 9) for a, b in zip(times, times[1:])])


def check_metrics_from_log(fn) -> CheckResult:
    """Check ``fn(step_log, prompt_lens, arrivals, num_blocks) -> dict`` against the engine's Prometheus series."""
    def empty(f):
        from minivllm.labs.workloads import sim_engine

        got = f(sim_engine().step_log, {}, {}, 64)
        return _learner_view(got)

    one_run, one_exp = _compare([(20, 5, 0.0)])
    chunk_run, chunk_exp = _compare([(200, 3, 0.0)], budget=64)
    mid_run, mid_exp = _compare([(100, 40, 0.0)] * 20, stop_after=30)
    late_run, late_exp = _compare([(60, 8, 0.0), (60, 8, 0.02), (300, 8, 0.03), (40, 8, 0.5)], max_seqs=2, budget=128)
    pre_run, pre_exp = _compare([(120, 150, 0.01 * i) for i in range(10)], num_blocks=40)
    swap_run, swap_exp = _compare([(120, 150, 0.01 * i) for i in range(10)], num_blocks=40, mode="swap")
    exact = _one_request_exact(metrics_from_step_log)[1]
    zero = {"running": 0, "waiting": 0, "used_blocks": 0, "free_blocks": 64, "preemptions": 0, "generation_tokens": 0,
            "ttft count": 0, "ttft sum": 0.0, "itl count": 0, "itl sum": 0.0}
    cases = [
        Case("an empty log", empty, zero, "no steps: nothing running, every block free, no latencies yet"),
        Case("one request: TTFT and ITLs to the step", lambda f: _one_request_exact(f)[0], exact,
             "a token exists at the END of the step that sampled it (record.time); TTFT starts at the arrival; "
             "ITL is the gap between one request's consecutive tokens"),
        Case("one request vs /metrics", one_run, one_exp, "5 tokens: 1 TTFT and 4 ITLs"),
        Case("chunked prefill: only the last chunk samples", chunk_run, chunk_exp,
             "a 200-token prompt in 64-token chunks: the chunks that do not finish the prompt produce no token"),
        Case("gauges mid-run", mid_run, mid_exp,
             "running, waiting and free blocks are gauges: read them from the LAST record; used = pool - free"),
        Case("queued requests: TTFT from arrival", late_run, late_exp,
             "two seats, four requests: the wait in the queue is part of TTFT (arrival, not first scheduling)"),
        Case("preemption by recompute", pre_run, pre_exp,
             "a preempted request prefills prompt + generated tokens again; only the chunk that reaches its last "
             "known token samples a new one. Count every preempted id of every record"),
        Case("preemption by swap", swap_run, swap_exp, "a swapped request resumes decoding where it stopped"),
    ]
    return run_checks("metrics_from_log", fn, cases)


def hidden_metrics_from_log(fn, seed: int) -> CheckResult:
    """Grader-only: a random workload (seeded at grading time) against /metrics."""
    rng = random.Random(seed)
    reqs = [(rng.randint(8, 300), rng.randint(1, 80), round(rng.uniform(0, 1.5), 3)) for _ in range(rng.randint(5, 25))]
    kw = dict(num_blocks=rng.choice([40, 64, 128]), budget=rng.choice([64, 128, 256]), max_seqs=rng.choice([2, 4, 16]))
    run, exp = _compare(reqs, **kw, stop_after=rng.choice([None, 25]))
    return run_checks("metrics_from_log (hidden)", fn, [Case(f"random workload seed {seed}", run, exp)])


# -- exercise 2: an alarm on a signal (Prometheus' `for:`) ------------------------------------------


def reference_first_alarm(samples: Sequence[Sample], signal: str, threshold: float, for_s: float) -> float | None:
    """The first sample time at which ``signal`` has been above ``threshold`` at every scrape for ``for_s`` s.

    Brute force, on purpose unlike the one-pass solution the learner writes: at each scrape, walk back over
    the unbroken run of scrapes above the threshold that ends there, and fire at the first scrape whose run
    spans ``for_s`` seconds.  (NaN, no data, is not above anything and so breaks a run.)
    """
    for i, s in enumerate(samples):
        first = i
        while first >= 0 and getattr(samples[first], signal) > threshold:
            first -= 1
        if first < i and s.time - samples[first + 1].time >= for_s:
            return s.time
    return None


def _series(values: Sequence[float], signal: str = "waiting", step: float = 1.0) -> list[Sample]:
    nan = float("nan")
    out = []
    for i, v in enumerate(values):
        kw = dict(time=step * (i + 1), running=0, waiting=0, kv_usage=0.0, utilisation=0.0, busy=0.0, ttft_p90=nan,
                  itl_p99=nan, tokens_per_s=0.0, arrived=0)
        kw[signal] = v
        out.append(Sample(**kw))
    return out


@functools.lru_cache(maxsize=1)
def _ramp_for_checker() -> SimRun:
    """The checker's copy of the ramp (computed once per process: mutation tests call the checker often)."""
    return ramp_run()


def check_first_alarm(fn) -> CheckResult:
    """Check ``fn(samples, signal, threshold, for_s) -> time or None``."""
    ramp = _ramp_for_checker()
    nan = float("nan")
    on_ramp = {sig: reference_first_alarm(ramp.samples, sig, th, 2.0)
               for sig, th in (("waiting", 4), ("kv_usage", 0.9), ("ttft_p90", 0.5))}

    def ramp_case(f):
        return {sig: f(ramp.samples, sig, th, 2.0) for sig, th in (("waiting", 4), ("kv_usage", 0.9), ("ttft_p90", 0.5))}

    cases = [
        Case("never above: no alarm", lambda f: f(_series([0, 1, 2, 1]), "waiting", 4, 0), None,
             "return None when the signal never crosses"),
        Case("above at once, no `for`", lambda f: f(_series([0, 9, 0]), "waiting", 4, 0), 2.0,
             "with for_s = 0 the first scrape above the threshold fires"),
        Case("equal is not above", lambda f: f(_series([4, 4, 5]), "waiting", 4, 0), 3.0,
             "the alarm is for values strictly ABOVE the threshold"),
        Case("held for for_s", lambda f: f(_series([0, 5, 6, 7, 8]), "waiting", 4, 2), 4.0,
             "above since t=2; held for 2 s at t=4: fire then, not when it first crossed"),
        Case("a dip resets the clock", lambda f: f(_series([5, 5, 0, 5, 5, 5]), "waiting", 4, 2), 6.0,
             "the condition must hold at EVERY scrape; after a dip, the pending time starts again"),
        Case("a short spike never fires", lambda f: f(_series([0, 9, 9, 0, 9, 0]), "waiting", 4, 2), None,
             "two scrapes 1 s apart hold for 1 s, not 2 s"),
        Case("no data is not above", lambda f: f(_series([nan, 0.9, nan, nan, 0.9], "ttft_p90"), "ttft_p90", 0.5, 0),
             2.0, "NaN (no first token in that window) compares False with everything: it is not an alarm"),
        Case("no data breaks a streak", lambda f: f(_series([0.9, nan, 0.9, 0.9], "ttft_p90"), "ttft_p90", 0.5, 1),
             4.0, "a scrape without data is not a scrape above the threshold"),
        Case("the first alarm, not the last", lambda f: f(_series([9, 0, 9, 9]), "waiting", 4, 0), 1.0,
             "return as soon as it fires"),
        Case("reads the signal it is given", lambda f: f(_series([0.1, 0.95, 0.97], "kv_usage"), "kv_usage", 0.9, 1),
             3.0, "getattr(sample, signal)"),
        Case("on the ramp of section 5", ramp_case, on_ramp, "queue depth > 4, KV usage > 90 %, TTFT p90 > 0.5 s, "
             "each held for 2 s"),
    ]
    return run_checks("first_alarm", fn, cases)


def hidden_first_alarm(fn, seed: int) -> CheckResult:
    rng = random.Random(seed)
    cases = []
    for k in range(20):
        values = [rng.choice([0, 1, 3, 4, 5, 8, float("nan")]) for _ in range(rng.randint(0, 12))]
        th, for_s = rng.choice([3, 4, 5]), rng.choice([0, 1, 2, 3])
        series = _series(values, "ttft_p90", step=rng.choice([0.5, 1.0]))
        cases.append(Case(f"random series {k}", lambda f, s=series, t=th, d=for_s: f(s, "ttft_p90", t, d),
                          reference_first_alarm(series, "ttft_p90", th, for_s)))
    return run_checks("first_alarm (hidden)", fn, cases)


# -- quiz answers ---------------------------------------------------------------------------------


def quiz_itl_count() -> int:
    """ITL observations of one request with max_tokens=16 (the first token has a TTFT, not an ITL)."""
    _, samples, _, _ = _metric_run([(20, 16, 0.0)])
    return int(samples["vllm:inter_token_latency_seconds_count"])


def quiz_max_rate() -> float:
    """The highest rate of the lab's sweep that meets both SLOs."""
    return float(max_rate_meeting_slo(knee_sweep()))


MUTANTS_METRICS = (
    ("every scheduled chunk counts as a token", "if start + n == prompt_lens[rid] + generated.get(rid, 0):",
     "if True:"),
    ("forgets the generated tokens: only the first token counts", "if start + n == prompt_lens[rid] + generated.get(rid, 0):",
     "if start + n == prompt_lens[rid]:"),
    ("TTFT from time zero, not from the arrival", "ttft[rid] = rec.time - arrivals[rid]", "ttft[rid] = rec.time"),
    ("one ITL clock for all requests", "itl.append(rec.time - last[rid])", "itl.append(rec.time - max(last.values()))"),
    ("gauges from the first record", "end = step_log[-1] if len(step_log) else None",
     "end = step_log[0] if len(step_log) else None"),
    ("used blocks = free blocks", "\"used_blocks\": num_blocks - end.free_blocks if end else 0",
     "\"used_blocks\": end.free_blocks if end else 0"),
    ("preemptions of the last step only", "preemptions += len(rec.preempted)", "preemptions = len(rec.preempted)"),
    ("the first token's wait counted as an ITL too", "ttft[rid] = rec.time - arrivals[rid]",
     "ttft[rid] = rec.time - arrivals[rid]\n                    itl.append(ttft[rid])"),
)

MUTANTS_ALARM = (
    ("fires on equal values", "if v > threshold:", "if v >= threshold:"),
    ("a dip does not reset", "            since = None\n", "            pass\n"),
    ("fires when it first crosses", "if s.time - since >= for_s:", "if True:"),
    ("NaN counts as above", "if v > threshold:", "if not v <= threshold:"),
    ("needs strictly more than for_s", "if s.time - since >= for_s:", "if s.time - since > for_s:"),
    ("ignores for_s when the series starts above", "since = s.time", "since = 0.0"),
    ("never returns the time it fired", "                return s.time\n", "                fired = s.time\n"),
)


LAB = Lab(
    number=8,
    stem="lab08_serving",
    title="Observability and serving",
    exercises=(
        Exercise("metrics_from_log", "metrics_from_log", check_metrics_from_log, points=2,
                 mutants=MUTANTS_METRICS, hidden=hidden_metrics_from_log),
        Exercise("first_alarm", "first_alarm", check_first_alarm, points=1, mutants=MUTANTS_ALARM,
                 hidden=hidden_first_alarm),
    ),
    quiz="lab08",
    widgets=("run again",),
)
