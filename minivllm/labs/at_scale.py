"""At-scale what-ifs for the labs: the same policies on a datasheet GPU running a real model shape.

Why a separate module?  Labs 4, 5, 6 and 8 teach with a 3-constant cost model
(:class:`~minivllm.sim.executor.SimulatedExecutor`: a fixed cost per step plus
a cost per token), which is easy to reason about but linear: it cannot show
that a decode step is memory bound (extra prompt tokens ride almost free), nor
that attention makes a long prefill grow faster than its length.  Both facts
move the answers of those labs.  The functions here rerun each lab's key
experiment on :class:`~minivllm.sim.roofline.RooflineExecutor` with a preset
from :mod:`minivllm.sim.presets` (default: Llama-3-8B in bf16 on the H100
datasheet preset), so a notebook cell stays a few lines and the numbers it
prints are the ones a test can recompute.

Everything here is simulated: the scheduler, KV manager and preemption are the
real engine's, the step times are the roofline's, and the hardware numbers are
datasheet peaks times assumed utilisations (see ``minivllm/sim/presets.py``).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

from minivllm.sim.presets import hardware_preset, model_preset
from minivllm.sim.roofline import (HardwareSpec, ModelShape, RooflineExecutor, RooflinePreemptionCosts, roofline_time,
                                   step_cost)

MODEL = "llama-3-8b"
HARDWARE = "h100"
BLOCK_SIZE = 16


def presets(model: str = MODEL, hardware: str = HARDWARE) -> tuple[ModelShape, HardwareSpec]:
    """The model shape (bf16) and the hardware spec by preset name."""
    return model_preset(model, 2), hardware_preset(hardware)


def label(model: str = MODEL, hardware: str = HARDWARE) -> str:
    """The one-line provenance every at-scale cell prints: simulated, which executor, which presets."""
    shape, hw = presets(model, hardware)
    return (f"simulated: RooflineExecutor, {shape.name} (bf16, {shape.num_params / 1e9:.1f} B params) on the "
            f"'{hw.name}' datasheet preset ({hw.peak_flops / 1e12:.0f} TFLOP/s x {hw.flops_util:.0%}, "
            f"{hw.mem_bandwidth / 1e12:.2f} TB/s x {hw.bw_util:.0%}, host link {hw.swap_bandwidth / 1e9:.0f} GB/s)")


def step_s(seqs: Sequence[tuple[int, int, bool]], model: str = MODEL, hardware: str = HARDWARE) -> float:
    """Roofline seconds of one step over ``(start, num_tokens, samples)`` per sequence (the executor's own rule)."""
    shape, hw = presets(model, hardware)
    return roofline_time(step_cost(shape, seqs, block_size=BLOCK_SIZE), shape, hw).total


def device_s(seqs: Sequence[tuple[int, int, bool]], model: str = MODEL, hardware: str = HARDWARE) -> float:
    """The device's share of :func:`step_s`: the weights, the attention and their FLOPs at the roofs, no host costs.

    Lab 7 sets it beside measured step times: what is left over is the host.
    """
    shape, hw = presets(model, hardware)
    t = roofline_time(step_cost(shape, seqs, block_size=BLOCK_SIZE), shape, hw)
    return t.dense + t.attention


# -- lab 4: chunk budget vs ITL and the long prompt's TTFT ------------------------------------------


def chunk_engine(budget: int | None, *, model: str = MODEL, hardware: str = HARDWARE, max_len: int = 32768 + 256,
                 num_blocks: int = 8192, max_num_seqs: int = 64, **options: Any):
    """A real engine on the roofline executor; ``budget=None`` turns chunked prefill off (whole prompts)."""
    from minivllm.labs.workloads import sim_engine

    shape, hw = presets(model, hardware)
    chunked = budget is not None
    return sim_engine(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs, model_max_len=max_len,
                      max_num_batched_tokens=budget if chunked else max_len, enable_chunked_prefill=chunked,
                      executor=RooflineExecutor(shape, hw, block_size=BLOCK_SIZE), **options)


def chunk_sweep(budgets: Sequence[int | None], arrivals, *, builder=None, itl_stats=None,
                **engine_options: Any) -> dict:
    """``{budget: summary}`` for ``arrivals`` (lab 4's list of :class:`~minivllm.arrival.Arrival`) served at each
    budget.

    ``builder`` (a lab-4 batch builder) replaces the engine's step 2 in the chunked runs and
    ``itl_stats`` measures the gaps, so a learner's own functions run at scale.  The summary is lab 4's
    :func:`~minivllm.labs.check_lab04.summarize` (decoders' ITL p50/p99/worst, mean TTFT of the long
    prompts, chat TTFT p99, seconds) plus ``tokens_per_s`` (prompt and output
    tokens over the run's virtual time), the keys lab 4's ``pick_budget`` reads, and ``max_chunk``: the most
    tokens one request computed in one step, read from the step log.
    """
    from minivllm.labs.check_lab04 import install_batch_builder, run_arrivals, summarize

    out = {}
    tokens = sum(len(a.prompt) + a.max_tokens for a in arrivals)
    for b in budgets:
        eng = chunk_engine(b, **engine_options)
        if builder is not None and b is not None:
            install_batch_builder(eng, builder)
        finals = run_arrivals(eng, arrivals)
        out[b] = summarize(finals, itl_stats) if itl_stats is not None else summarize(finals)
        out[b]["tokens_per_s"] = tokens / eng.executor.now()  # served over the run's virtual time
        out[b]["max_chunk"] = max((n for e in eng.step_log for _, _, n in e["seqs"]), default=0)
    return out


# -- lab 5: recompute vs swap, as a function of the victim's context ----------------------------------


def costs(model: str = MODEL, hardware: str = HARDWARE, **options: Any) -> RooflinePreemptionCosts:
    """The roofline's swap-or-recompute cost model on a preset (``options``: chunk, decodes, decode_context)."""
    shape, hw = presets(model, hardware)
    return RooflinePreemptionCosts(shape, hw, block_size=BLOCK_SIZE, **options)


def swap_s(num_tokens: int, model: str = MODEL, hardware: str = HARDWARE) -> float:
    """Seconds of link traffic to swap a victim of ``num_tokens`` out and back in (whole blocks, twice)."""
    return costs(model, hardware).swap_s(math.ceil(num_tokens / BLOCK_SIZE))


def recompute_s(num_tokens: int, model: str = MODEL, hardware: str = HARDWARE, **options: Any) -> float:
    """Extra seconds a busy engine spends prefilling a victim's ``num_tokens`` again, in chunks of ``chunk``
    next to ``decodes`` sequences decoding at ``decode_context`` (``options``; the defaults, 2,048-token chunks
    beside 32 decodes at 2,048 tokens, are :class:`RooflinePreemptionCosts`' own)."""
    return costs(model, hardware, **options).recompute_s(num_tokens)


def crossover_tokens(model: str = MODEL, hardware: str = HARDWARE, lengths: Sequence[int] | None = None,
                     **recompute_options: Any) -> int | None:
    """The shortest context (on ``lengths``, in any order, default :func:`model_context_grid`) from which
    swapping is cheaper than recomputing at every longer length on the grid, or None if swap loses at the
    longest one (whatever it does at shorter ones: on some scenes the winner flips twice).

    Lengths past the model's positions (:func:`max_context`) are left out: no victim of that model is that long,
    so one grid can serve every preset, and the answer is never a context the model cannot take."""
    grid = sorted(lengths) if lengths is not None else model_context_grid(model)  # "longer": by length, not order
    if not grid:
        raise ValueError("crossover_tokens needs at least one context length in lengths")
    cap = max_context(model)
    if cap is not None:
        grid = [n for n in grid if n <= cap]
        if not grid:
            raise ValueError(f"crossover_tokens: every length in lengths is past {model}'s {cap} positions")
    swap_wins = [swap_s(n, model, hardware) < recompute_s(n, model, hardware, **recompute_options) for n in grid]
    if not swap_wins[-1]:
        return None
    k = len(grid) - 1
    while k > 0 and swap_wins[k - 1]:
        k -= 1
    return grid[k]


def context_grid(lo: int = 16, hi: int = 131072, per_octave: int = 4) -> list[int]:
    """Context lengths from ``lo`` to ``hi`` on a geometric grid, whole blocks.

    The ends are the first whole block at or above ``lo`` and the last at or below ``hi``, and every point in
    between rounds to the nearest block within them: a point rounded to the nearest block past an end (20
    tokens to 16) would show a length the caller left out of the range.  A range holding no whole block is a
    ValueError, not a grid of lengths outside it.
    """
    if not 0 < lo <= hi or per_octave < 1:
        raise ValueError(f"context_grid needs 0 < lo <= hi and per_octave >= 1, got lo={lo}, hi={hi}, "
                         f"per_octave={per_octave}")
    # int(): a float end (a length computed by the caller, 100.0) must not put floats in a grid of whole blocks
    first, last = int(-(-lo // BLOCK_SIZE) * BLOCK_SIZE), int(hi // BLOCK_SIZE * BLOCK_SIZE)
    if first > last:
        raise ValueError(f"context_grid: no whole block of {BLOCK_SIZE} tokens lies between lo={lo} and hi={hi}")
    n_pts = int(round(math.log2(hi / lo) * per_octave)) + 1
    inner = (int(round(lo * 2 ** (i / per_octave) / BLOCK_SIZE)) * BLOCK_SIZE for i in range(n_pts))
    return sorted({first, last} | {min(last, max(first, n)) for n in inner})


def max_context(model: str = MODEL) -> int | None:
    """The longest context ``model`` serves: the positions it was trained for (config.json's
    ``max_position_embeddings``; Qwen3-0.6B 40,960, Llama-3-8B's preset 131,072), None where the shape did not
    record them.  A simulated engine of the shape refuses a longer request, so a cost drawn past it is the cost
    of nothing the model can serve."""
    return model_preset(model).max_position_embeddings


def model_context_grid(model: str = MODEL, lo: int = 16, hi: int = 131072, per_octave: int = 4) -> list[int]:
    """:func:`context_grid` ending at ``model``'s positions where they fall short of ``hi``.

    The geometric steps are the full grid's; the last point is the model's longest context (Qwen3-0.6B's grid
    ends at 40,960, Llama-3-8B's still at 131,072), so a curve drawn on it stops where the model does.
    """
    cap = max_context(model)
    return context_grid(lo, hi if cap is None else min(hi, cap), per_octave)


# -- lab 8: the knee of the latency/rate curve on a whole datacenter GPU ------------------------------


def pool_blocks(model: str = MODEL, hardware: str = HARDWARE, memory_share: float = 0.9) -> int:
    """KV blocks left on the device after the bf16 weights, at ``memory_share`` of its memory (vLLM's rule,
    as ``minivllm sim run`` sizes its pool: :func:`~minivllm.sim.run.kv_pool_blocks`)."""
    from minivllm.sim.run import kv_pool_blocks

    if not 0 < memory_share <= 1:  # above 1 would hand out more KV memory than the device has
        raise ValueError(f"pool_blocks needs 0 < memory_share <= 1, got {memory_share}")
    return kv_pool_blocks(*presets(model, hardware), memory_share, BLOCK_SIZE)


def serving_engine(*, model: str = MODEL, hardware: str = HARDWARE, max_num_seqs: int = 256,
                   max_num_batched_tokens: int = 8192, **options: Any):
    """A real engine on the roofline executor with a device-sized KV pool, 256 seats and an 8,192-token step budget.

    (``vllm serve``'s defaults on a smaller card; on a GPU of 70 GiB or more other than an A100 it takes 1,024
    seats.  256 keeps the at-scale cells' runs short, and lab 8 says which it uses.)"""
    from minivllm.labs.workloads import sim_engine

    shape, hw = presets(model, hardware)
    return sim_engine(num_blocks=pool_blocks(model, hardware), block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, model_max_len=2048,
                      executor=RooflineExecutor(shape, hw, block_size=BLOCK_SIZE), **options)


def knee_sweep(rates: Sequence[float] = (20, 40, 70, 80, 100), seconds: float = 20.0, seed: int = 1,
               **engine_options: Any) -> dict[float, dict]:
    """Lab 8's flat-load sweep (same arrivals: prompts 64-512, outputs 32-256 tokens) on :func:`serving_engine`.

    The default rates are the points the lab reads: 20 and 40 req/s on the flat part, the knee (70), the step
    past it where TTFT breaks (80) and the one where ITL breaks too (100).  A 60 req/s point (p99 ITL 31 ms,
    between 40's and 70's) said nothing more and cost 2.3 s of CPU on a 2-core machine, where CI's two runs of
    the notebook, beside the rest of the suite, had passed the course's three minutes.  The runs take no scrapes
    (``every_s=None``): the streaming outputs a scrape needs were half of each run's time at 256 seats."""
    from minivllm.labs.live import ramp_arrivals, run_sim_load

    return {r: run_sim_load(serving_engine(**engine_options), ramp_arrivals([r], seconds, seed=seed),
                            every_s=None).summary() for r in rates}


# -- lab 6: the three-class policy where the hardware can meet the SLOs -----------------------------


def class_mix(policy: str, classes: dict, knobs=None, *, scale: float = 300.0, duration: float = 20.0,
              model: str = MODEL, hardware: str = HARDWARE, num_blocks: int | None = None, batch: int | None = None):
    """Lab 6's mixed workload with rates and backlog times ``scale``, served under ``policy`` on the roofline.

    The engine is lab 6's three-class engine with the GPU's sizes: a device-sized KV
    pool (or ``num_blocks``, to put the mix under KV pressure), 256 seats, a 2,048-token step budget, prefix
    caching on.  ``batch`` keeps the backlog's first ``batch`` prompts
    (:func:`~minivllm.labs.check_lab06.mixed_classes`): lab 6's squeezed pool (700 blocks) starts about 530 of
    the 1,800 in the 20 s window and drained the rest until 56 s, a drain its clause table reads nothing of but
    preemption counts, so it keeps 600: batch work still waits when the window closes.  Returns lab 6's
    :class:`~minivllm.labs.check_lab06.ServeResult`.
    """
    from minivllm.config import ThreeClassConfig
    from minivllm.labs.check_lab06 import lab_engine, serve

    shape, hw = presets(model, hardware)
    engine = lab_engine({"scheduling_policy": policy, "tenants": classes, "three_class": knobs or ThreeClassConfig()},
                        num_blocks=num_blocks or pool_blocks(model, hardware), budget=2048, max_seqs=256, chunk=0, max_len=4096,
                        executor=RooflineExecutor(shape, hw, block_size=BLOCK_SIZE), enable_prefix_caching=True)
    return serve(engine, _mixed_at_scale(duration, scale, batch), window=duration)


@functools.cache
def _mixed_at_scale(duration: float, scale: float, batch: int | None = None) -> tuple:
    """:func:`~minivllm.labs.check_lab06.mixed_classes` at scale, drawn once per process and backlog size: lab 6
    serves the same mix under nine settings, and its 6,000-odd prompts (1,800 of them batch prompts of 300-600
    random tokens) take about a quarter of a second to draw: two seconds of a notebook's run if drawn for each."""
    from minivllm.labs.check_lab06 import mixed_classes

    return tuple(mixed_classes(duration, scale=scale, batch=batch))


BATCH_COST_ROWS = ("chats alone", "chats + batch, three_class", "chats + batch, fcfs", "batch alone")


def batch_cost_runs(*, seconds: float = 10.0, chat_rate: float = 20.0, num_batch: int = 200, seed: int = 1,
                    model: str = MODEL, hardware: str = HARDWARE, gpu_hour_usd: float | None = None) -> dict[str, dict]:
    """The batch class's promise, "no latency SLO, minimise cost", measured on one simulated GPU.

    Chats (interactive) arrive ``chat_rate`` a second for ``seconds`` (prompts 64-512 tokens, answers 64-256);
    a backlog of ``num_batch`` batch prompts (500-1,000 tokens, 100-300 out) is queued at t = 0.  Four runs
    (:data:`BATCH_COST_ROWS`): the chats alone; chats and batch under ``three_class`` and under ``fcfs``; the
    batch alone, on a GPU of its own.  Each row: ``requests`` and ``served``; ``gpu_s`` (first arrival to
    last token: the time the GPU is rented for) and ``busy_s`` (the time it spent in steps); ``tokens`` and
    ``batch_tokens`` served (prompt + output); ``usd_per_m`` (dollars per million tokens at
    ``gpu_hour_usd``, by default lab 8's assumed GPU-hour price, read at the call so that a notebook's own price
    reaches it); the chats' p95 TTFT and ITL; ``batch_done_s`` (when the last batch request finished).
    """
    import random

    from minivllm.config import TenantConfig
    from minivllm.labs import check_lab08
    from minivllm.labs.check_lab08 import usd_per_million

    price = check_lab08.GPU_HOUR_USD if gpu_hour_usd is None else gpu_hour_usd
    from minivllm.labs.live import SimArrival, ramp_arrivals, run_sim_load
    from minivllm.metrics.stats import nearest_rank

    chats = ramp_arrivals([chat_rate], seconds, prompt=(64, 512), output=(64, 256), tenants=("chat",), seed=seed)
    rng = random.Random(seed)
    batch = [SimArrival(0.0, f"b{i}", "bulk", rng.randint(500, 1000), rng.randint(100, 300)) for i in range(num_batch)]
    tenants = {"chat": TenantConfig(priority_class="interactive"), "bulk": TenantConfig(priority_class="batch")}
    both = sorted(chats + batch, key=lambda a: a.time)
    runs = dict(zip(BATCH_COST_ROWS, ((chats, "three_class"), (both, "three_class"), (both, "fcfs"),
                                      (batch, "three_class"))))
    out = {}
    for name, (arrivals, policy) in runs.items():
        engine = serving_engine(model=model, hardware=hardware, max_num_batched_tokens=2048,
                                scheduling_policy=policy, tenants=tenants)
        run = run_sim_load(engine, arrivals, every_s=None)  # (the table reads latencies, not scrapes)
        start = {a.request_id: a.time for a in arrivals}
        chat_ids = [a.request_id for a in arrivals if a.tenant == "chat"]
        bulk_ids = [a.request_id for a in arrivals if a.tenant == "bulk"]
        tokens = sum(a.prompt_len + a.max_tokens for a in arrivals)
        out[name] = {
            "requests": len(arrivals), "served": len(run.e2e),
            "gpu_s": run.duration, "busy_s": engine.executor.busy_s, "tokens": tokens,
            "batch_tokens": sum(a.prompt_len + a.max_tokens for a in arrivals if a.tenant == "bulk"),
            "usd_per_m": usd_per_million(tokens, run.duration, gpu_hour_usd=price),
            "chat_ttft_p95": nearest_rank([run.ttft[r] for r in chat_ids], 95, float("nan")),
            "chat_itl_p95": nearest_rank([g for r in chat_ids for g in run.itls[r]], 95, float("nan")),
            "batch_done_s": max((start[r] + run.e2e[r] for r in bulk_ids if r in run.e2e), default=0.0),
        }
    return out


def long_prefill_run(budget: int, long_prefill_tokens: int, *, doc_class: str = "agent", model: str = MODEL,
                     hardware: str = HARDWARE) -> dict:
    """Lab 4's at-scale scene under the three-class preset: does the clause ``chunk_long_prefills`` protect ITL?

    Chats arrive about 20 a second (tenant ``chat``, interactive) and two 32K-token
    documents 1.5 s apart (tenant ``docs``, class ``doc_class``).  The step budget is
    ``budget``; no request prefills more than ``long_prefill_tokens`` tokens in one step
    (the preset's clause, vLLM's ``long_prefill_token_threshold``; a value at or above the
    budget switches it off).  Returns :func:`chunk_sweep`'s row for ``budget``: lab 4's
    :func:`~minivllm.labs.check_lab04.summarize` (the chats' ITL p50/p99/worst, their TTFT p99,
    the documents' mean TTFT) plus ``max_chunk``, the most prompt tokens one request prefilled
    in one step.
    """
    import dataclasses

    from minivllm.config import TenantConfig, ThreeClassConfig
    from minivllm.labs.check_lab04 import mixed_arrivals

    arrivals = [dataclasses.replace(a, tenant="chat" if a.request_id.startswith("c") else "docs")
                for a in mixed_arrivals(num_long=2, long_len=32768, long_every_s=1.5, first_long_s=0.3,
                                        chat_every_s=0.05, seed=2)]
    tenants = {"chat": TenantConfig(priority_class="interactive"), "docs": TenantConfig(priority_class=doc_class)}
    return chunk_sweep([budget], arrivals, model=model, hardware=hardware, scheduling_policy="three_class",
                       tenants=tenants, three_class=ThreeClassConfig(long_prefill_tokens=long_prefill_tokens))[budget]


__all__ = ["BATCH_COST_ROWS", "BLOCK_SIZE", "HARDWARE", "MODEL", "batch_cost_runs", "chunk_engine", "chunk_sweep",
           "class_mix", "context_grid", "costs", "crossover_tokens", "device_s", "knee_sweep", "label",
           "long_prefill_run", "max_context", "model_context_grid", "pool_blocks", "presets", "recompute_s",
           "serving_engine", "step_s", "swap_s"]
