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
import itertools
import random
from typing import Any, Sequence

from minivllm.arrival import made_up_ids
from minivllm.labs.checkers import Case, CheckResult, run_checks
from minivllm.labs.live import Sample, SimArrival, SimRun, ramp_arrivals, run_sim_load
from minivllm.labs.registry import Exercise, Lab
from minivllm.metrics.prometheus import ITL_BUCKETS, metrics_from_step_log
from minivllm.sampling_params import SamplingParams, brief_repr
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
    """``{rate: SimRun.summary()}``: a flat Poisson load of ``seconds`` at each rate on :func:`lab_engine`
    (no scrapes: a summary needs none)."""
    return {r: run_sim_load(lab_engine(), ramp_arrivals([r], seconds, seed=seed), every_s=None).summary()
            for r in rates}


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
    """The ramp of section 3: 2 -> 16 req/s in steps of 5 s, scraped every second."""
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


# -- section 2: tokens per tenant and per model, and what they cost -------------------------------

GPU_HOUR_USD = 3.00
"""The assumed price of one H100 SXM GPU-hour, on demand, in US dollars: an input, not a measurement.

Chosen when lab 8 was written (2026-12-01) from the list prices the course authors quoted for that time: about
$2.50-3.50 per GPU-hour at GPU clouds and $3.50-5 at hyperscalers, reserved capacity 30-50 % cheaper.  No source
for those ranges is kept here and prices move, so the lab passes it on as ``gpu_hour_usd`` (rebinding this name
does not reach the functions' defaults).  Every dollar figure the lab prints is proportional to it; the *shares*
of a bill do not depend on it at all."""

DECODE_WEIGHT = 4.0
"""The attribution rule's weight of a generated token, in prompt tokens.

A prompt token is computed together with hundreds of others in one step; a generated token needs a step of
its own (weights and the request's whole KV read once more), which is also why hosted APIs price output tokens
above input tokens.  :func:`decode_weight` measures the ratio on the roofline preset."""


def tenant_tokens(samples: dict) -> dict[str, dict[str, float]]:
    """``{tenant: {"prompt": n, "generation": n}}`` read from a parsed ``/metrics`` page (:func:`metric_samples`)."""
    from minivllm.metrics.scrape import label_values, metric_value

    names = set(label_values(samples, "vllm:prompt_tokens_total", "tenant"))
    names |= set(label_values(samples, "vllm:generation_tokens_total", "tenant"))
    return {t: {"prompt": metric_value(samples, "vllm:prompt_tokens_total", tenant=t),
                "generation": metric_value(samples, "vllm:generation_tokens_total", tenant=t)} for t in sorted(names)}


def model_tokens(samples: dict) -> dict[str, dict[str, float]]:
    """``{model_name: {"prompt": n, "generation": n}}``: PromQL's ``sum by (model_name)`` of the token counters."""
    from minivllm.metrics.scrape import label_values, metric_value

    names = set(label_values(samples, "vllm:generation_tokens_total", "model_name"))
    return {m: {"prompt": metric_value(samples, "vllm:prompt_tokens_total", model_name=m),
                "generation": metric_value(samples, "vllm:generation_tokens_total", model_name=m)} for m in sorted(names)}


def weighted_tokens(tokens: dict[str, dict[str, float]], decode_weight: float = DECODE_WEIGHT) -> dict[str, float]:
    """The attribution rule: each tenant's prompt tokens plus ``decode_weight`` x its generated tokens."""
    return {t: v["prompt"] + decode_weight * v["generation"] for t, v in tokens.items()}


def attribute(usage: dict[str, float], total_usd: float) -> dict[str, float]:
    """Split ``total_usd`` among tenants in proportion to ``usage`` (any rule's numbers): the bills sum to the total.

    A bill is price x hours x the tenant's share of the usage.  With no usage at all, nobody is billed."""
    whole = sum(usage.values())
    if whole <= 0:
        return {t: 0.0 for t in usage}
    return {t: total_usd * u / whole for t, u in usage.items()}


def window_usd(seconds: float, gpus: int = 1, gpu_hour_usd: float = GPU_HOUR_USD) -> float:
    """What ``gpus`` GPUs rented for ``seconds`` cost: the machine is paid by the hour, busy or idle."""
    return gpu_hour_usd * gpus * seconds / 3600.0


def usd_per_million(tokens: float, seconds: float, gpus: int = 1, gpu_hour_usd: float = GPU_HOUR_USD) -> float:
    """Dollars per million tokens served in ``seconds`` on ``gpus`` GPUs (inf when nothing was served)."""
    return window_usd(seconds, gpus, gpu_hour_usd) / (tokens / 1e6) if tokens > 0 else float("inf")


def kv_block_seconds(step_log) -> dict[str, float]:
    """Per tenant, the KV blocks its running requests held, integrated over time (block-seconds).

    After each step a tenant holds ``row.kv_blocks``; it keeps them until the next step ends.  The last step's
    holding is not counted (nothing is measured after it), nor is an idle gap (no request holds blocks then)."""
    out: dict[str, float] = {}
    records = list(step_log)
    for rec, nxt in itertools.pairwise(records):
        for row in rec.tenants:
            out[row.tenant] = out.get(row.tenant, 0.0) + row.kv_blocks * (nxt.time - rec.time)
    return out


def decode_weight(model: str = "llama-3-8b", hardware: str = "h100", batch: int = 64, context: int = 1024,
                  chunk: int = 2048) -> float:
    """Seconds per generated token over seconds per prompt token, on the roofline preset (simulated).

    A generated token's cost: one decode step of ``batch`` requests at ``context`` tokens, divided by the
    batch.  A prompt token's: the extra time a ``chunk``-token prefill adds to that same step, per token."""
    from minivllm.labs import at_scale

    decodes = [(context, 1, True)] * batch
    base = at_scale.step_s(decodes, model, hardware)
    with_chunk = at_scale.step_s(decodes + [(0, chunk, True)], model, hardware)
    return (base / batch) / ((with_chunk - base) / chunk)


def metered(engine, metrics):
    """Attach ``metrics`` (an :class:`EngineMetrics`) to ``engine`` the way the server does: each request's tenant
    is tracked when it is added, and the step and its outputs are observed after every step.  Returns ``engine``."""
    from minivllm.metrics.prometheus import observe_all

    add, step = engine.add_request, engine.step

    def add_request(prompt, params=None, request_id=None, *, tenant: str = "default", **kw):
        rid = add(prompt, params, request_id, tenant=tenant, **kw)
        metrics.track(rid, tenant)
        return rid

    def observed_step():
        outs = step()
        observe_all(metrics, engine, outs)
        return outs

    engine.add_request, engine.step = add_request, observed_step
    return engine


COST_TENANTS = {  # tenant: (req/s, prompt tokens, output tokens), uniform ranges
    "rag": (12.0, (1024, 1536), (16, 64)),  # long retrieved context, short answers
    "chat": (12.0, (64, 256), (256, 512)),  # short questions, long answers
}


def cost_arrivals(seconds: float = 10.0, seed: int = 3, tenants: dict = COST_TENANTS) -> list[SimArrival]:
    """Two tenants' Poisson arrivals, merged in time order (request ids ``<tenant>-<i>``)."""
    from dataclasses import replace

    out = []
    for k, (name, (rate, prompt, output)) in enumerate(tenants.items()):
        for a in ramp_arrivals([rate], seconds, prompt=prompt, output=output, tenants=(name,), seed=seed + k):
            out.append(replace(a, request_id=f"{name}-{a.request_id[1:]}"))
    return sorted(out, key=lambda a: a.time)


def cost_run(seconds: float = 10.0, seed: int = 3):
    """Section 2's cost comparison, simulated on the H100 preset (Llama-3-8B, bf16, one GPU, the roofline).

    Returns ``(run, samples, engine)``: the :class:`SimRun`, the parsed ``/metrics`` page of the engine's
    Prometheus series (model name ``llama-3-8b``), and the engine (its step log holds the KV per tenant)."""
    from minivllm.labs import at_scale
    from minivllm.metrics.prometheus import EngineMetrics
    from minivllm.metrics.scrape import metric_samples

    metrics = EngineMetrics(at_scale.MODEL)
    engine = metered(at_scale.serving_engine(), metrics)
    run = run_sim_load(engine, cost_arrivals(seconds, seed), every_s=None)  # the bill reads counters, not scrapes
    return run, metric_samples(metrics.render().decode()), engine


FLEET = {"llama-3-8b": 40.0, "llama-3.2-1b": 15.0}  # model: its traffic (req/s), one simulated H100 each


def fleet_scrape(models: dict[str, float] = FLEET, seconds: float = 10.0, seed: int = 1):
    """One simulated H100 replica per model (the roofline, each model's preset), each with its own open-loop
    traffic, every replica with its own Prometheus registry labelled with its model name.

    Returns ``(samples, {model: SimRun})``: the merged ``/metrics`` samples -- what Prometheus holds after
    scraping every replica -- and each replica's run (for its duration)."""
    from minivllm.labs import at_scale
    from minivllm.metrics.prometheus import EngineMetrics
    from minivllm.metrics.scrape import metric_samples

    samples, runs = {}, {}
    for m, rate in models.items():
        metrics = EngineMetrics(m)
        runs[m] = run_sim_load(metered(at_scale.serving_engine(model=m), metrics),
                               ramp_arrivals([rate], seconds, seed=seed), every_s=None)
        samples.update(metric_samples(metrics.render().decode()))
    return samples, runs


# -- section 5: tuning on a workload that shares a system prompt ----------------------------------

SYSTEM_PROMPT_LEN = 256  # tokens: 16 whole blocks of the app's instructions
SHARED_EVERY = 4  # 3 requests in 4 come from the app (and start with its system prompt); 1 in 4 do not
SYSTEM_PROMPT = tuple(1000 + (7 * k) % 89 for k in range(SYSTEM_PROMPT_LEN))  # ids the random prompts never use


def shares_system_prompt(request_id: str) -> bool:
    """``r<i>`` is the app's request unless ``i`` is a multiple of :data:`SHARED_EVERY`."""
    return int(request_id.lstrip("r")) % SHARED_EVERY != 0


def with_system_prompt(engine):
    """Prepend :data:`SYSTEM_PROMPT` to the prompt of every request :func:`shares_system_prompt` picks.

    The user's part keeps its drawn length, so the app's prompts are 256 tokens longer: a chat front end's
    instructions, sent verbatim with every request.  Returns ``engine``."""
    add = engine.add_request

    def add_request(prompt, params=None, request_id=None, **kw):
        if request_id is not None and shares_system_prompt(request_id):
            prompt = {**prompt, "prompt_token_ids": list(SYSTEM_PROMPT) + list(prompt["prompt_token_ids"])}
        return add(prompt, params, request_id, **kw)

    engine.add_request = add_request
    return engine


TUNING_BLOCKS = (384, 512, 768, 1024)


def tuning_run(num_blocks: int, rate: float = 8.0, seconds: float = 20.0, seed: int = 1, prefix_caching: bool = True):
    """Section 5's workload on :func:`lab_engine` with ``num_blocks`` KV blocks: ``(SimRun, engine)`` (the run
    takes no scrapes: the table reads its summary and the engine's counters)."""
    engine = with_system_prompt(lab_engine(num_blocks=num_blocks, enable_prefix_caching=prefix_caching))
    return run_sim_load(engine, ramp_arrivals([rate], seconds, seed=seed), every_s=None), engine


def tuning_table(blocks: Sequence[int] = TUNING_BLOCKS, cache_off: int | None = 512, **kw) -> tuple[str, dict, dict]:
    """Preemptions, prefix-cache hit rate, TTFT/ITL percentiles and tokens/s per KV pool size (prefix caching on),
    plus one row with the cache off at ``cache_off`` blocks.  Returns the text, ``{row label: summary}`` (a
    summary's ``hit_rate`` is the engine's hits / lookups, in prompt tokens) and ``{row label: engine}``."""
    rows, engines = {}, {}
    lines = [(f"{'KV blocks':>13s}{'preempt':>8s}{'hit rate':>9s}{'TTFT p50/p99 ms':>17s}{'ITL p50/p99 ms':>16s}"
              f"{'tokens/s':>9s}")]
    plan = [(str(b), b, True) for b in blocks] + ([(f"{cache_off} no cache", cache_off, False)] if cache_off else [])
    for label, b, on in plan:
        run, engines[label] = tuning_run(b, prefix_caching=on, **kw)
        s = run.summary()
        s["hit_rate"] = run.stats.get("prefix_cache_hit_rate", 0.0)
        rows[label] = s
        lines.append(f"{label:>13s}{s['preemptions']:8d}{s['hit_rate']:9.1%}{s['ttft_p50_ms']:8.0f} /{s['ttft_p99_ms']:6.0f}"
                     f"{s['itl_p50_ms']:8.1f} /{s['itl_p99_ms']:5.1f}{s['tokens_per_s']:9.0f}")
    return "\n".join(lines), rows, engines


def tuning_prompt_lens(rate: float = 8.0, seconds: float = 20.0, seed: int = 1) -> dict[str, int]:
    """``{request id: full prompt length}`` of :func:`tuning_run`'s workload (the system prompt included)."""
    return {a.request_id: a.prompt_len + SYSTEM_PROMPT_LEN * shares_system_prompt(a.request_id)
            for a in ramp_arrivals([rate], seconds, seed=seed)}


def hit_rate_from_log(step_log, prompt_lens: dict[str, int]) -> float:
    """The hit rate recounted from the step log: a request's first chunk starts after the tokens the cache gave it.

    ``prompt_lens`` are the prompts' full lengths (system prompt included) of the requests that were admitted."""
    first: dict[str, int] = {}
    for rec in step_log:
        for rid, start, _ in rec.seqs:
            first.setdefault(rid, start)
    queried = sum(prompt_lens[rid] for rid in first)
    return sum(first.values()) / queried if queried else 0.0


TUNING_KNOBS = (  # (the guide's knob, this engine's EngineConfig field, what to watch while turning it)
    ("gpu_memory_utilization", "num_gpu_blocks_override", "preemptions, hit rate (evictions), KV usage"),
    ("max_num_batched_tokens", "max_num_batched_tokens", "ITL p99 (a long chunk stalls decodes), TTFT"),
    ("max_num_seqs", "max_num_seqs", "queue depth, ITL p50 (bigger batches, slower steps)"),
    ("enable_chunked_prefill", "enable_chunked_prefill", "ITL p99 while long prompts arrive"),
    ("enable_prefix_caching", "enable_prefix_caching", "hit rate, TTFT of requests sharing a prefix"),
    ("preemption mode", "preemption_mode", "preemptions, recomputed tokens"),
    ("block_size", "block_size", "hit rate (only whole blocks are shared)"),
)


def knobs_table(config) -> str:
    """vLLM's tuning-guide knobs next to this engine's config fields and their values in ``config``."""
    lines = [f"{'vLLM guide knob':24s}{'EngineConfig field':26s}{'value here':>11s}   watch"]
    for knob, field_name, watch in TUNING_KNOBS:
        lines.append(f"{knob:24s}{field_name:26s}{getattr(config, field_name)!s:>11s}   {watch}")
    return "\n".join(lines)


# -- exercise 1: the seed's metric list, from the step log ----------------------------------------


def _metric_run(requests: Sequence[tuple[int, int, float]], *, num_blocks: int = 64, budget: int = 256,
                max_seqs: int = 16, stop_after: int | None = None, mode: str = "recompute", caching: bool = False):
    """Serve ``(prompt_len, max_tokens, arrival)`` requests on a small simulated engine with the engine's own
    Prometheus metrics attached; stop after ``stop_after`` steps (mid-run gauges) or at the end.

    Returns (engine, metrics samples, prompt_lens, arrivals)."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.metrics.prometheus import EngineMetrics, observe_all
    from minivllm.metrics.scrape import metric_samples

    engine = sim_engine(num_blocks=num_blocks, block_size=16, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                        model_max_len=1024, preemption_mode=mode, num_cpu_blocks_override=256 if mode == "swap" else None,
                        enable_prefix_caching=caching, executor=SimulatedExecutor(**SERVING_GPU))
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
            engine.add_request({"prompt_token_ids": made_up_ids(rng, p)},
                               SamplingParams(max_tokens=m, ignore_eos=True), rid, arrival_time=a)
            prompt_lens[rid], arrivals[rid] = p, a
        if not engine.has_unfinished_requests():
            continue
        observe_all(metrics, engine, engine.step())
        steps += 1
        if stop_after is not None and steps >= stop_after:
            break
    samples: dict = {}
    itl_buckets: dict[float, float] = {}
    for (name, labels), value in metric_samples(metrics.render().decode()).items():
        samples[name] = samples.get(name, 0.0) + value  # summed over labels
        if name == "vllm:inter_token_latency_seconds_bucket":
            le = float(dict(labels)["le"])
            itl_buckets[le] = itl_buckets.get(le, 0.0) + value
    samples["itl buckets"] = tuple(int(itl_buckets[le]) for le in sorted(itl_buckets))  # cumulative, as exported
    return engine, samples, prompt_lens, arrivals


def _cumulative_buckets(values: Sequence[float]) -> tuple[int, ...]:
    """A Prometheus histogram's cumulative bucket counts (``value <= le``) for the engine's ITL buckets, +Inf last."""
    return tuple(sum(1 for v in values if v <= le) for le in (*ITL_BUCKETS, float("inf")))


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
        # bucket by bucket: per-token gaps that are wrong but sum to the right total (a token counted one chunk
        # early, the next one a chunk late) move observations between buckets
        "itl buckets": samples.get("itl buckets") or _cumulative_buckets([]),
    }


def _learner_view(got: dict) -> dict:
    """The learner's per-request numbers reduced to what ``/metrics`` exports (gauges, counts, sums, cumulative
    ITL buckets): Prometheus keeps no per-request values, so this is the shape both sides can be compared in."""
    ttft, itl = got["ttft"], list(got["itl"])
    return {
        "running": got["running"], "waiting": got["waiting"], "used_blocks": got["used_blocks"],
        "free_blocks": got["free_blocks"], "preemptions": got["preemptions"],
        "generation_tokens": got["generation_tokens"],
        "ttft count": len(ttft), "ttft sum": round(sum(ttft.values()), 6),
        "itl count": len(itl), "itl sum": round(sum(itl), 6), "itl buckets": _cumulative_buckets(itl),
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
    # a small budget splits the recompute of prompt + generated tokens into chunks: only the last one samples
    rechunk_run, rechunk_exp = _compare([(120, 150, 0.01 * i) for i in range(10)], num_blocks=40, budget=64)
    # six equal requests cross a block edge in the same step: one step preempts two of them
    pair_run, pair_exp = _compare([(16, 150, 0.0)] * 6, num_blocks=24, max_seqs=8)
    # with prefix caching on, the finished requests' full blocks stay cached: off the free list, yet not used
    cached_run, cached_exp = _compare([(40, 6, 0.0), (70, 4, 0.01), (33, 9, 0.02)], caching=True)

    def inputs_read_only(f):
        # the notebook passes its own prompt_lens and arrivals: an answer that counts generated tokens by raising
        # prompt_lens[rid] in place gets every number right once, and wrong when the cell runs again
        engine, _, plens, arr = _metric_run([(20, 5, 0.0), (40, 3, 0.01)], budget=16)
        given_plens, given_arr = dict(plens), dict(arr)
        f(engine.step_log, given_plens, given_arr, 64)
        return given_plens == plens, given_arr == arr

    exact = _one_request_exact(metrics_from_step_log)[1]
    zero = {"running": 0, "waiting": 0, "used_blocks": 0, "free_blocks": 64, "preemptions": 0, "generation_tokens": 0,
            "ttft count": 0, "ttft sum": 0.0, "itl count": 0, "itl sum": 0.0, "itl buckets": _cumulative_buckets([])}
    cases = [
        Case("an empty log", empty, zero, "no steps: nothing running, every block free, no latencies yet"),
        Case("one request: TTFT and ITLs to the step", lambda f: _one_request_exact(f)[0], exact,
             "a token exists at the END of the step that sampled it (record.time); TTFT starts at the arrival; "
             "ITL is the gap between one request's consecutive tokens"),
        Case("one request vs /metrics", one_run, one_exp, "5 tokens: 1 TTFT and 4 ITLs"),
        Case("chunked prefill: only the last chunk samples", chunk_run, chunk_exp,
             "a 200-token prompt in 64-token chunks: the chunks that do not finish the prompt produce no token"),
        Case("gauges mid-run", mid_run, mid_exp,
             "running, waiting and free blocks are gauges: read them from the LAST record as they are (its waiting "
             "already counts the requests a preemption sent back to the queue); used = pool - available"),
        Case("queued requests: TTFT from arrival", late_run, late_exp,
             "two seats, four requests: the wait in the queue is part of TTFT (arrival, not first scheduling)"),
        Case("preemption by recompute", pre_run, pre_exp,
             "a preempted request prefills prompt + generated tokens again; only the chunk that reaches its last "
             "known token samples a new one. Count every preempted id of every record. A preemption restarts no "
             "clock: the TTFT stays the time to the first token ever, and the gap across the preemption is one ITL"),
        Case("preemption by swap", swap_run, swap_exp, "a swapped request resumes decoding where it stopped"),
        Case("a chunked recompute samples once", rechunk_run, rechunk_exp,
             "with a 64-token budget the recompute of prompt + generated runs in chunks: a chunk samples only if it "
             "reaches the request's last known token (prompt + generated so far), not merely past the prompt; "
             "a token timed one chunk early (and the next one a chunk late) keeps the ITL sum but moves the "
             "gaps between histogram buckets"),
        Case("two victims in one step", pair_run, pair_exp,
             "record.preempted lists every request preempted in that step: a step can have several victims, so "
             "add len(record.preempted), not 1 per step that preempted"),
        Case("prefix caching: cached blocks are not used", cached_run, cached_exp,
             "a finished request's full blocks stay in the prefix cache, off the free list; the allocator evicts "
             "them on demand, so they are not used either: used = pool - rec.available_blocks, not - free"),
        Case("prompt_lens and arrivals are only read", inputs_read_only, (True, True),
             "keep what you count in dicts of your own (generated tokens per request): the caller's prompt_lens "
             "and arrivals must come back unchanged, or running the cell twice gives other numbers"),
    ]
    return run_checks("metrics_from_log", fn, cases)


def hidden_metrics_from_log(fn, seed: int) -> CheckResult:
    """Grader-only: a random workload (seeded at grading time) against /metrics."""
    rng = random.Random(seed)
    reqs = [(rng.randint(8, 300), rng.randint(1, 80), round(rng.uniform(0, 1.5), 3)) for _ in range(rng.randint(5, 25))]
    kw = dict(num_blocks=rng.choice([40, 64, 128]), budget=rng.choice([64, 128, 256]), max_seqs=rng.choice([2, 4, 16]))
    run, exp = _compare(reqs, **kw, stop_after=rng.choice([None, 25]))
    # and always one run that preempts with a budget small enough to split its recomputes into chunks
    tight = [(rng.randint(80, 160), rng.randint(100, 160), round(0.01 * i, 3)) for i in range(10)]
    run2, exp2 = _compare(tight, num_blocks=40, budget=64)
    # the same run read right after a step that preempted: the gauges of a record whose victims just went back to
    # the queue (the random stop above rarely lands on one, and a finished run has an empty queue)
    preempting = [k for k, rec in enumerate(_metric_run(tight, num_blocks=40, budget=64)[0].step_log) if rec.preempted]
    run3, exp3 = _compare(tight, num_blocks=40, budget=64, stop_after=rng.choice(preempting) + 1)
    return run_checks("metrics_from_log (hidden)", fn, [Case(f"random workload seed {seed}", run, exp),
                                                         Case("a preempting run with chunked recomputes", run2, exp2),
                                                         Case("gauges read just after a preemption", run3, exp3)])


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


def _series(values: Sequence[float], signal: str = "waiting", step: float = 1.0,
            times: Sequence[float] | None = None) -> list[Sample]:
    nan = float("nan")
    out = []
    for i, v in enumerate(values):
        kw = dict(time=step * (i + 1) if times is None else times[i], running=0, waiting=0, kv_usage=0.0, utilisation=0.0, busy=0.0, ttft_p90=nan,
                  itl_p99=nan, tokens_per_s=0.0, arrived=0)
        kw[signal] = v
        out.append(Sample(**kw))
    return out


@functools.cache
def _ramp_for_checker() -> tuple[Sample, ...]:
    """The checker's copy of the ramp's samples (computed once per process: mutation tests call the checker often).

    A tuple, and each learner call gets a list of its own: the copy outlives one check, so a function that
    consumed its list (``samples.pop(0)`` in a loop) would otherwise shorten it for every later check in the
    process -- the reference's expected answers included, so a verdict would depend on what ran before."""
    return tuple(ramp_run().samples)


def check_first_alarm(fn, ramp: Sequence[Sample] | None = None) -> CheckResult:
    """Check ``fn(samples, signal, threshold, for_s) -> time or None``.

    ``ramp``: the scrapes of section 3's ramp to check on, the notebook's own run (``LiveLoad.result.samples``:
    the same run as :func:`ramp_run`, plus the last partial window), so the check does not serve the whole ramp a
    second time; by default the checker's own copy.  Either way the expected times are the reference's on them.
    """
    if ramp is None:
        ramp = _ramp_for_checker()
    elif not isinstance(ramp, (list, tuple)) or not ramp or not all(isinstance(s, Sample) for s in ramp):
        raise ValueError("check_first_alarm needs ramp to be the ramp run's samples (a non-empty list of Sample), "
                         f"got {brief_repr(ramp)}")
    ramp = tuple(ramp)  # each learner call gets a list of its own (see _ramp_for_checker)
    nan = float("nan")
    on_ramp = {sig: reference_first_alarm(ramp, sig, th, 2.0)
               for sig, th in (("waiting", 4), ("kv_usage", 0.9), ("ttft_p90", 0.5))}

    def ramp_case(f):
        return {sig: f(list(ramp), sig, th, 2.0) for sig, th in (("waiting", 4), ("kv_usage", 0.9), ("ttft_p90", 0.5))}

    cases = [
        Case("no samples yet: no alarm", lambda f: f([], "waiting", 4, 0), None,
             "before the first scrape the list is empty: return None without reading samples[0]"),
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
        Case("a threshold between whole numbers", lambda f: f(_series([0.3, 0.6], "kv_usage"), "kv_usage", 0.5, 0),
             2.0, "threshold 0.5: 0.3 is not above it, 0.6 is -- compare with the threshold as given, not cut to a "
             "whole number"),
        Case("reads the signal it is given", lambda f: f(_series([0.1, 0.95, 0.97], "kv_usage"), "kv_usage", 0.9, 1),
             3.0, "getattr(sample, signal)"),
        Case("for_s is seconds, not scrapes", lambda f: f(_series([0, 5, 5, 5, 5, 5], step=0.5), "waiting", 4, 1),
             2.0, "scrapes every 0.5 s here: above since t=1.0, held 1 s at t=2.0 (3 scrapes) -- compare sample "
             "times, not a count of scrapes"),
        Case("fires at a scrape, whatever for_s", lambda f: f(_series([5, 5, 5, 5, 5]), "waiting", 4, 1.5), 3.0,
             "above since t=1; at t=2 it has held 1 s, at t=3 2 s >= 1.5 s: the alarm fires at the scrape that "
             "sees it, t=3 (not at t=1 + 1.5: nobody looked then)"),
        Case("uneven scrapes", lambda f: f(_series([5] * 5, times=[1.0, 1.5, 3.5, 4.0, 6.0]), "waiting", 4, 2),
             3.5, "scrapes at 1, 1.5, 3.5, 4, 6 s, all above: held 2.5 s at t=3.5 -- measure time from the first "
             "scrape of the streak, do not assume an even interval"),
        Case("the held time is not rounded",
             lambda f: f(_series([5] * 4, times=[1.0, 2.5, 2.8, 4.0]), "waiting", 4, 1.75), 2.8,
             "scrapes at 1, 2.5, 2.8, 4 s, all above, for_s 1.75: at t=2.5 it has held 1.5 s (too short), at t=2.8 "
             "1.8 s (long enough) -- compare the exact held time, neither rounded nor cut to whole seconds"),
        Case("equal breaks a streak", lambda f: f(_series([5, 4, 5, 5]), "waiting", 4, 2), None,
             "4 is not above 4: the streak restarts at t=3 and holds only 1 s by t=4"),
        Case("on the ramp of section 3", ramp_case, on_ramp, "queue depth > 4, KV usage > 90 %, TTFT p90 > 0.5 s, "
             "each held for 2 s"),
    ]
    return run_checks("first_alarm", fn, cases)


def hidden_first_alarm(fn, seed: int) -> CheckResult:
    rng = random.Random(seed)
    cases = []
    for k in range(20):
        values = [rng.choice([0, 1, 3, 4, 5, 8, float("nan")]) for _ in range(rng.randint(0, 12))]
        th, for_s = rng.choice([3, 4, 5]), rng.choice([0, 0.7, 1, 1.5, 2, 3])
        times = list(itertools.accumulate(rng.choice([0.25, 0.5, 1.0, 1.5]) for _ in values))  # uneven scrapes
        series = _series(values, "ttft_p90", times=times)
        cases.append(Case(f"random series {k}", lambda f, s=series, t=th, d=for_s: f(s, "ttft_p90", t, d),
                          reference_first_alarm(series, "ttft_p90", th, for_s)))
    for k in range(3):  # drawn after the series above, which therefore stay what they were for a seed
        # a streak whose held time lands just short of, then just past, a for_s between two whole seconds: a held
        # time rounded to whole seconds fires a scrape early, one cut to whole seconds a scrape late
        for_s, start, th = rng.randint(1, 3) + 0.75, rng.choice([0.5, 1.0, 2.0]), rng.choice([3, 4])
        short, past = round(rng.uniform(0.05, 0.2), 2), round(rng.uniform(0.05, 0.2), 2)
        times = [start, start + for_s - short, start + for_s + past, start + for_s + 1]
        series = _series([th + 1] * 4, "ttft_p90", times=times)
        cases.append(Case(f"a streak around for_s {k}", lambda f, s=series, t=th, d=for_s: f(s, "ttft_p90", t, d),
                          reference_first_alarm(series, "ttft_p90", th, for_s)))
        # a threshold between two whole numbers, and a value above its whole part but not above it
        th = rng.randint(1, 4) + 0.5
        values = [0] * rng.randint(0, 3) + [th - 0.25, th + 1]
        series = _series(values, "ttft_p90")
        cases.append(Case(f"a fractional threshold {k}", lambda f, s=series, t=th: f(s, "ttft_p90", t, 0),
                          reference_first_alarm(series, "ttft_p90", th, 0)))
    # edges every seed must see, not only the seeds whose draws happen to hold them (the draws above hold no empty
    # series at about one seed in five): no scrape yet, a value equal to the threshold, no data (NaN), and a dip
    # inside a streak -- drawn last, so the cases above stay what they were for a seed
    th, for_s, nan = rng.choice([3, 4, 5]), rng.choice([1, 1.5, 2]), float("nan")
    edges = {"no samples yet": [],
             "a value equal to the threshold": [th - 1, th, th + 1],
             "no data beside data above": [nan, th + 1, nan, th + 1],
             "a dip inside a streak": [th + 1, 0] + [th + 1] * 4}
    for name, values in edges.items():
        series = _series(values, "ttft_p90")
        for d in (0, for_s):
            cases.append(Case(f"{name}, for_s {d}", lambda f, s=series, t=th, d=d: f(s, "ttft_p90", t, d),
                              reference_first_alarm(series, "ttft_p90", th, d)))
    return run_checks("first_alarm (hidden)", fn, cases)


# -- quiz answers ---------------------------------------------------------------------------------


def quiz_itl_count() -> int:
    """ITL observations of one request with max_tokens=16 (the first token has a TTFT, not an ITL)."""
    _, samples, _, _ = _metric_run([(20, 16, 0.0)])
    return int(samples["vllm:inter_token_latency_seconds_count"])


def quiz_max_rate() -> float:
    """The highest rate of the lab's sweep that meets both SLOs."""
    return float(max_rate_meeting_slo(knee_sweep()))


def quiz_cost_split() -> float:
    """Tenant A's bill for a $3.00 hour: A 3.0 M prompt + 0.25 M generated, B 0.5 M + 0.5 M, weight 4."""
    usage = weighted_tokens({"A": {"prompt": 3.0e6, "generation": 0.25e6}, "B": {"prompt": 0.5e6, "generation": 0.5e6}},
                            4.0)
    return round(attribute(usage, window_usd(3600, gpu_hour_usd=3.00))["A"], 2)


MUTANTS_METRICS = (
    ("every scheduled chunk counts as a token", "if start + n == prompt_lens[rid] + generated.get(rid, 0):",
     "if True:"),
    ("forgets the generated tokens: only the first token counts", "if start + n == prompt_lens[rid] + generated.get(rid, 0):",
     "if start + n == prompt_lens[rid]:"),
    ("TTFT from time zero, not from the arrival", "ttft[rid] = rec.time - arrivals[rid]", "ttft[rid] = rec.time"),
    ("one ITL clock for all requests", "itl.append(rec.time - last[rid])", "itl.append(rec.time - max(last.values()))"),
    ("gauges from the first record", "end = step_log[-1] if len(step_log) else None",
     "end = step_log[0] if len(step_log) else None"),
    ("used blocks = free blocks", "\"used_blocks\": num_blocks - end.available_blocks if end else 0",
     "\"used_blocks\": end.available_blocks if end else 0"),
    ("cached blocks counted as used", "\"used_blocks\": num_blocks - end.available_blocks if end else 0",
     "\"used_blocks\": num_blocks - end.free_blocks if end else 0"),
    ("preemptions of the last step only", "preemptions += len(rec.preempted)", "preemptions = len(rec.preempted)"),
    ("one preemption per step that preempted", "preemptions += len(rec.preempted)",
     "preemptions += bool(rec.preempted)"),
    ("the first token's wait counted as an ITL too", "ttft[rid] = rec.time - arrivals[rid]",
     "ttft[rid] = rec.time - arrivals[rid]\n                    itl.append(ttft[rid])"),
    ("counts tokens in the caller's prompt_lens",
     "if start + n == prompt_lens[rid] + generated.get(rid, 0):  # computed every known token: samples one\n",
     "if start + n == prompt_lens[rid]:\n                prompt_lens[rid] += 1\n"),
    ("an empty log read at its last record", "end = step_log[-1] if len(step_log) else None", "end = step_log[-1]"),
)

MUTANTS_ALARM = (
    ("fires on equal values", "if v > threshold:", "if v >= threshold:"),
    ("a dip does not reset", "            since = None\n", "            pass\n"),
    ("fires when it first crosses", "if s.time - since >= for_s:", "if True:"),
    ("NaN counts as above", "if v > threshold:", "if not v <= threshold:"),
    ("needs strictly more than for_s", "if s.time - since >= for_s:", "if s.time - since > for_s:"),
    ("ignores for_s when the series starts above", "since = s.time", "since = 0.0"),
    ("never returns the time it fired", "                return s.time\n", "                fired = s.time\n"),
    # the same verdict on every list with a scrape, and IndexError before the first scrape
    ("reads the first sample before the loop: an empty list raises", "    since = None\n    for s in samples:",
     "    since = samples[0].time if getattr(samples[0], signal) > threshold else None\n    for s in samples:"),
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
    widgets=("run again",),
)
