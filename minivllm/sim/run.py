"""``minivllm sim run``: the real engine, a roofline clock, open-loop arrivals, the load generator's SLO report.

The engine is the one that serves real requests -- same scheduler, policies,
KV manager and prefix cache -- with a :class:`~minivllm.sim.roofline.RooflineExecutor`
in place of the model.  Arrivals use the load generator's workload format
(``--tenant`` specs and Poisson/gamma rates, or ``--workload PATH`` with a JSONL
trace in the load generator's ``--trace`` format; see :mod:`minivllm.bench.loadgen`), and the report is the load generator's table,
built from the engine's own timestamps, so a simulated run and a measured one
read the same way.

:func:`drive` is the loop both the simulator and the real-engine validation
use: inject every request whose arrival time has passed, step, collect.  Its
own work per step is proportional to what changed (new arrivals, requests
that produced a token), never to everything running.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field, replace

from minivllm.argtypes import fraction, nonnegative_int, output_file, positive_float, positive_int, positive_rate, refuse_unread
from minivllm.bench.loadgen import (WORDS, LengthDist, RequestResult, RunResult, Tenant, check_burstiness_shapes, format_table,
                                    mean_arrival_rate, parse_tenant, parse_trace, plan_from_trace, plan_requests,
                                    summarize)
from minivllm.bench.results import write_result

_WORD_IDS = {w: i + 10 for i, w in enumerate(WORDS)}


@dataclass
class SimRequest:
    """One request of a workload, already as token ids (so the real and the simulated engine get the same ones)."""

    index: int
    arrival: float  # seconds after the start of the run
    tenant: str
    prompt_token_ids: list[int]
    max_tokens: int
    # samples per prompt (SamplingParams.n): they share the prompt's prefill and its blocks, so a workload of n > 1
    # requests loads the engine unlike n separate ones; its result counts every sample's tokens
    n: int = 1
    # seconds after the start of the run: the "deadline" policy serves earliest deadlines first (None: none)
    deadline: float | None = None


def word_token_ids(text: str, vocab_size: int = 49152) -> list[int]:
    """Token ids for the load generator's word prompts without a tokenizer: one id per word, stable across runs.

    The load generator's words are about one token each, and equal texts map
    to equal ids, so a shared system prompt still hits the prefix cache.
    """
    top = max(11, vocab_size - 10)
    return [_WORD_IDS.get(w) or zlib.crc32(w.encode()) % top + 10 for w in text.split()]


def requests_from_plan(plan, tokenize=None, vocab_size: int = 49152) -> list[SimRequest]:
    """``PlannedRequest`` s (from ``plan_requests`` / ``plan_from_trace``) -> token-id requests sorted by arrival."""
    enc = tokenize or (lambda text: word_token_ids(text, vocab_size))
    out = [SimRequest(p.index, p.arrival, p.tenant, enc(p.prompt), p.max_tokens) for p in plan]
    out.sort(key=lambda r: (r.arrival, r.index))
    return out


@dataclass
class DriveRecord:
    """What :func:`drive` saw: one result per request, the step boundaries, KV usage over time."""

    results: list[RequestResult]
    # each request's sampled tokens by its engine id: a replay writes these (ReplayExecutor.tokens), since with a
    # prefix cache what a block holds decides what it shares
    output_token_ids: dict[str, list[int]] = field(default_factory=dict, kw_only=True)
    # clock (s after t0) where each step began: the arrival check before it (the end of the step before, or the
    # arrival an idle engine waited for), so the steps tile the run as the engine's step-time average counts them
    step_starts: list[float] = field(default_factory=list)
    kv_usage: list[tuple[float, float]] = field(default_factory=list)  # (s after t0, fraction of blocks held)
    kv_peak: float = 0.0  # the highest fraction of blocks held after any step (kv_usage is only sampled)
    kv_area: float = 0.0  # the integral of that fraction over [0, kv_span]: every step's level, held until it changes
    kv_span: float = 0.0  # the run's duration, or the last step's end if that came later
    injected_before_step: list[int] = field(default_factory=list)  # requests added so far, before each step
    # What a replay needs besides the times to decide as this engine did (ReplayExecutor.from_record): its KV
    # block size in bytes (it sizes a swap_space host tier and prices a swap), and auto mode's start-up numbers,
    # (link bytes/s, prefill tokens/s), measured on a real engine by timing, which no step time reproduces
    kv_bytes_per_block: int | None = None
    start_costs: tuple[float, float] | None = None
    # The executor's clock when the run began (``t0``; the times above are after it), and its reading at each
    # step's end, as the engine read it (its step log's time: the time of the step's tokens and finishes, and what
    # its step-time average and prefill-rate fit were fed).  The readings are kept, not their times after t0
    # (``step_ends``, derived): a difference can round, so it cannot give a reading back.  A replay starts its clock
    # at the origin and moves it to those readings (ReplayExecutor.from_record): every time the engine computes (an
    # arrival, a deadline's aging, a step's length) then rounds as in the real run, where a clock started at 0
    # rounds the same sums otherwise, and two deadlines tied in one run come apart.
    clock_origin: float = 0.0
    step_end_readings: list[float] = field(default_factory=list)
    duration: float = 0.0
    wall_s: float = 0.0

    @property
    def step_ends(self) -> list[float]:
        """Each step's end in seconds after t0 (built on each read from ``step_end_readings``)."""
        t0 = self.clock_origin
        return [t - t0 for t in self.step_end_readings]

    @property
    def check_after_step(self) -> list[float]:
        """The clock at the arrival check after each step: the step's end (``step_ends``), where :func:`drive`
        takes it, so a replay whose clock stands at these times (:class:`~minivllm.sim.replay.ReplayExecutor`)
        shows its engine every time the recorded engine read."""
        return self.step_ends


def drive(engine, requests: list[SimRequest], *, temperature: float = 0.0, kv_samples: int = 200,
          max_idle_steps: int = 1000) -> DriveRecord:
    """Run ``requests`` open loop through ``engine`` until all are done; works on a real or a virtual clock.

    A request joins the engine at the first step boundary at or after its
    arrival (an engine adds requests between steps).  When nothing is in
    flight the loop waits for the next arrival: ``executor.advance_to(t)`` on
    a virtual clock, ``time.sleep`` on a real one.  ``requests`` must be in
    arrival order (the loop admits a prefix of the list): an unsorted list is
    a ValueError, not requests silently held back behind a later one.
    """
    from minivllm.engine.input_processor import InputProcessor
    from minivllm.interfaces import VirtualClock, implements
    from minivllm.sampling_params import SamplingParams
    from minivllm.sched.scheduler import PreemptionCosts

    late = next((k for k in range(1, len(requests)) if requests[k].arrival < requests[k - 1].arrival), None)
    if late is not None:
        raise ValueError(f"requests must be sorted by arrival: request {requests[late].index} arrives at "
                         f"{requests[late].arrival:g} s, before the one listed ahead of it ({requests[late - 1].arrival:g} s)")

    engine_id = InputProcessor.engine_id
    ex = engine.executor
    advance = ex.advance_to if implements(ex, VirtualClock) else None  # (a forwarding wrapper counts: see implements)
    wall0 = time.perf_counter()
    t0 = ex.now()
    n = len(requests)
    results = [RequestResult(r.index, r.tenant, r.arrival, len(r.prompt_token_ids), r.max_tokens) for r in requests]
    by_id: dict[str, tuple[RequestResult, list[float], int]] = {}  # (result, token times, samples)
    rec = DriveRecord(results, kv_bytes_per_block=engine.bytes_per_block, clock_origin=t0)
    costs = engine.scheduler.costs
    if isinstance(costs, PreemptionCosts):  # (read before the first step: the fit moves the rate later)
        rec.start_costs = (costs.swap_bytes_per_s, costs.prefill_tokens_per_s)
    span_hint = max((r.arrival for r in requests), default=0.0)
    sample_every = max(span_hint, 1e-3) / max(1, kv_samples)
    next_sample = 0.0
    level_t, level = 0.0, 0.0  # the KV level since level_t (the engine holds nothing before its first step)

    def level_changes(t: float, u: float) -> None:
        nonlocal level_t, level
        rec.kv_area += level * (t - level_t)
        level_t, level = t, u

    i = 0
    idle = 0
    # A check is taken at a time the replay of the run (sim.replay) has its clock at, never at a fresh read of a
    # real clock, which comes a varying moment later (host work, a sleep's overshoot: milliseconds on a busy
    # machine), and a request arriving in that moment would join a step the replay leaves it out of: after a
    # step, at the step's end as the engine read it (its step log's time); after a wait, at the time waited
    # for (the run's start t0, or the arrival an idle engine slept until).
    wake: float | None = t0
    after_preemption = False  # the step before preempted a request (the next one may be the guard's pause)
    while True:
        now = ex.now() if wake is None else wake
        wake = None
        while i < n and t0 + requests[i].arrival <= now:
            r = requests[i]
            rid = f"r{r.index}"
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=temperature,
                                    output_kind="delta", n=r.n)
            res = results[i]
            res.start = r.arrival
            try:
                engine.add_request({"prompt_token_ids": r.prompt_token_ids}, params, request_id=rid, tenant=r.tenant,
                                   arrival_time=t0 + r.arrival,
                                   deadline=None if r.deadline is None else t0 + r.deadline)
            except ValueError as exc:  # refused at the door (too long, over a tenant's cap): an error, as HTTP 400 is
                res.outcome, res.error = "error", str(exc)
            else:
                by_id[rid] = (res, [], r.n)
                for k in range(r.n):  # keyed as the engine names the samples, which is what a replay looks up
                    rec.output_token_ids[engine_id(rid, r.n, k)] = []
            i += 1
        if not engine.has_unfinished_requests():
            if i >= n:
                break
            left = engine.kv.usage()  # the idle stretch holds what is left now
            level_changes(now - t0, left)
            if rec.kv_usage and rec.kv_usage[-1][0] < now - t0:
                rec.kv_usage.append((now - t0, left))
            nxt = t0 + requests[i].arrival
            if advance is not None:
                advance(nxt)
                if ex.now() < nxt - 1e-9 or nxt <= now:  # no progress: the same idle wait would repeat forever
                    raise RuntimeError(f"drive is stuck: the engine is idle at {now - t0:.6f} s and request "
                                       f"{requests[i].index} (arrival {requests[i].arrival:.6f} s) was not added; "
                                       f"the executor's advance_to({nxt - t0:.6f}) left the clock at "
                                       f"{ex.now() - t0:.6f}")
            else:
                time.sleep(max(0.0, nxt - ex.now()))
                if ex.now() >= nxt:  # (a sleep cut short checks the clock again: never inject a request early)
                    wake = nxt
            continue
        rec.step_starts.append(now - t0)
        rec.injected_before_step.append(i)
        outputs = engine.step()
        last = engine.step_log[-1]  # (the log keeps at least its newest record)
        wake = last.time
        end = wake - t0
        rec.step_end_readings.append(wake)
        if not last.seq_ids and not (last.swapped_in or last.swapped_out):  # (not .seqs: it builds a row per seq)
            idle += 1  # nothing could run: wait for the next arrival (or give up if there is none)
            # -- unless the step before preempted: the step after a preemption admits nothing by design (the
            # scheduler's thrash guard) and the next one runs again, as a real engine, stepping at once, shows;
            # that empty step is a pause, and a jump to the next arrival would idle every waiting request till then
            if i < n and advance is not None and not after_preemption:
                wake = max(wake, t0 + requests[i].arrival)  # (the step's end, before the jump, is in step_ends)
                advance(wake)
            elif idle > max_idle_steps:
                break
        else:
            idle = 0
        after_preemption = bool(last.preempted)
        for out in outputs:
            entry = by_id.get(out.request_id)
            if entry is None:
                continue
            res, times, samples = entry
            m = out.metrics
            times.extend(m.token_times)
            for c in out.outputs:  # one completion per sample, each with its own new tokens
                rec.output_token_ids[engine_id(out.request_id, samples, c.index)].extend(c.delta_token_ids)
                res.output_tokens += len(c.delta_token_ids)
            if out.finished:
                _finish(res, out, times, t0)
                del by_id[out.request_id]
        usage = engine.kv.usage()  # (O(1): the pool's free count and the cache's evictable count)
        if usage > rec.kv_peak:
            rec.kv_peak = usage
        level_changes(end, usage)
        if end >= next_sample:
            rec.kv_usage.append((end, usage))
            next_sample = end + sample_every
    for res, times, _ in by_id.values():  # left unfinished (a policy that never admits them)
        res.outcome, res.error = "timeout", "not finished when the run stopped"
    # The run lasts until the loop stopped (its last clock check, or its last step's end when it gave up on a
    # request it never admitted), not until its last answer: a request refused at the door, rejected or timed out
    # has no e2e, and the latest e2e alone ended a run at its last answer however long after it the others were
    # still arriving or waiting -- the rates over it came out too high (as the load generator's did).
    stop = max(now, rec.step_end_readings[-1]) if rec.step_end_readings else now
    # A run that ends on its last answer keeps that answer's reading: the two are one instant summed two ways, and
    # may differ in the last bit, which would move a result file's raw floats for nothing.
    last_end = max((r.start + r.e2e for r in results if r.start is not None and r.e2e is not None), default=-math.inf)
    rec.duration = last_end if last_end >= stop - t0 - 1e-9 else stop - t0
    rec.kv_span = max(rec.duration, level_t)
    level_changes(rec.kv_span, level)
    rec.wall_s = time.perf_counter() - wall0
    return rec


def _finish(res: RequestResult, out, times: list[float], t0: float) -> None:
    """Fill ``res`` from a finished request as the load generator fills it from a served one (outcome, TTFT,
    ITLs, e2e from the engine's own timestamps), so the two reports share one table and one SLO check."""
    m = out.metrics
    reason = out.outputs[0].finish_reason if out.outputs else None
    res.prompt_tokens = len(out.prompt_token_ids or ())
    # (output_tokens is counted as the tokens come, over every sample; times are the group's, one per step in
    # which any sample got a token: the chunks a streaming client sees)
    res.chunks = len(times)
    if reason == "rejected":
        res.outcome, res.retry_after = "rejected", getattr(out, "retry_after_s", None)
        return
    if reason in ("error", "abort"):
        res.outcome, res.error = "error", reason
        return
    res.outcome = "ok"
    arrival = m.arrival_time
    res.ttft = times[0] - arrival if times else None
    res.itl = [b - a for a, b in zip(times, times[1:])]
    end = m.finished_time if m.finished_time is not None else (times[-1] if times else arrival)
    res.e2e = end - arrival


# -- workloads ---------------------------------------------------------------------------------

WORKLOADS = {
    # name: (tenant specs, default rate req/s, burstiness)
    "chat": (["name=chat,input=uniform:16:128,output=uniform:8:48"], 200.0, 1.0),
    "decode-heavy": (["name=gen,input=uniform:16:64,output=uniform:128:256"], 20.0, 1.0),
    "bursty": (["name=chat,share=3,input=uniform:32:256,output=uniform:16:64",
                "name=batch,share=1,input=uniform:512:1024,output=uniform:32:128"], 50.0, 0.25),
    "long-prompt": (["name=docs,input=uniform:2048:8192,output=uniform:16:64"], 5.0, 1.0),
    "shared-prefix": (["name=app,input=uniform:16:64,output=uniform:16:64,prefix=sys:1024"], 50.0, 1.0),
}


def _rate(rate: float | None, reqs: list[SimRequest]) -> str:
    """The offered rate for the header: the workload's, else a trace's own mean (arrivals per second of its
    span), else "-"."""
    if rate is not None and math.isfinite(rate):
        return f"{rate:g}"
    own = mean_arrival_rate([r.arrival for r in reqs]) if reqs else math.inf
    return f"{own:.3g} (the trace's mean)" if math.isfinite(own) else "-"


def build_requests(args, vocab_size: int) -> tuple[list[SimRequest], float, list[Tenant]]:
    """The workload of ``args``: a JSONL trace, a named workload, or ``--tenant`` specs.

    With neither ``--workload`` nor ``--tenant`` the workload is ``chat``; ``--tenant`` specs alone are a workload
    of their own (10 req/s unless ``--request-rate`` says), not chat's tenants replaced at chat's rate.
    """
    if args.workload is None and not args.tenant:
        args.workload = "chat"
    if args.workload in WORKLOADS:
        specs, rate, burst = WORKLOADS[args.workload]
    elif args.workload is None:
        specs, rate, burst = [], 10.0, 1.0
    elif os.path.exists(args.workload):
        specs, rate, burst = [], None, 1.0
    else:
        raise ValueError(f"unknown workload {args.workload!r}: a JSONL trace path or one of {', '.join(WORKLOADS)}")
    # --input-len / --output-len: checked whatever else is given; they replace a named workload's lengths
    # (dropped in silence, "--workload chat --input-len 4096" simulated chat's short prompts), and fill in a
    # --tenant spec's missing ones (its own input= / output= win)
    input_len = LengthDist.parse(args.input_len) if args.input_len is not None else None
    output_len = LengthDist.parse(args.output_len) if args.output_len is not None else None
    default_in, default_out = str(input_len or "uniform:32:128"), str(output_len or "fixed:16")
    tenants = [parse_tenant(s, default_in, default_out) for s in args.tenant or specs] or [
        Tenant("default", None, 1.0, LengthDist.parse(default_in), LengthDist.parse(default_out))]
    if not args.tenant:  # a named workload's own lengths give way to the ones given
        tenants = [replace(t, input_len=input_len or t.input_len, output_len=output_len or t.output_len)
                   for t in tenants]
    if len({t.name for t in tenants}) != len(tenants):  # as bench serve: two specs of one name would merge silently
        raise ValueError("tenant names must be distinct")
    rate = args.request_rate if args.request_rate is not None else rate
    burst = args.burstiness if args.burstiness is not None else burst
    trace = bool(args.workload) and args.workload not in WORKLOADS
    check_burstiness_shapes(args.burstiness, trace, rate == math.inf)
    if trace:
        with open(args.workload, encoding="utf-8") as fh:
            entries = parse_trace(fh)
        if args.num_requests is not None:  # as --burstiness: a count given must count something
            raise ValueError("--num-requests sizes a generated workload; a trace sends all its lines: drop it")
        names = {e.tenant for e in entries if e.tenant} - {t.name for t in tenants}
        tenants += [Tenant(name, None, 1.0, LengthDist.parse(default_in), LengthDist.parse(default_out))
                    for name in sorted(names)]
        plan = plan_from_trace(entries, tenants, rate, args.seed)
        rate = rate if rate is not None else float("nan")
    else:
        if rate is None or not rate > 0:
            raise ValueError("--request-rate must be > 0")
        plan = plan_requests(tenants, 1000 if args.num_requests is None else args.num_requests, rate, burst, args.seed)
    return requests_from_plan(plan, vocab_size=vocab_size), rate, tenants


# -- one simulation ----------------------------------------------------------------------------


def kv_pool_bytes(shape, hw, utilization: float) -> int:
    """KV memory on ``hw``: what ``utilization`` of device memory leaves after the weights.

    A profile calibrated on a CPU has no device memory of its own (``memory_bytes`` 0): its pool is the
    real engine's CPU default, :data:`~minivllm.kv.kv_cache.DEFAULT_CPU_KV_BYTES` (1 GiB), so a
    simulation of this machine sizes its pool as ``LLM()`` on this machine does.
    """
    if not hw.memory_bytes:
        from minivllm.kv.kv_cache import DEFAULT_CPU_KV_BYTES

        return DEFAULT_CPU_KV_BYTES
    free = hw.memory_bytes * utilization - shape.num_params * shape.dtype_bytes
    if free <= 0:
        raise ValueError(f"{shape.name} ({shape.num_params * shape.dtype_bytes / 1e9:.1f} GB of weights) does not fit "
                         f"in {utilization:.0%} of {hw.name}'s {hw.memory_bytes / 1e9:.1f} GB")
    return int(free)


def kv_pool_blocks(shape, hw, utilization: float = 0.9, block_size: int = 16) -> int:
    """The KV pool of :func:`kv_pool_bytes` in blocks of ``block_size`` tokens: the one sizing rule of every
    simulated device (``minivllm sim run``, a fleet's replicas, the labs' at-scale engines)."""
    return kv_pool_bytes(shape, hw, utilization) // (shape.kv_bytes_per_token * block_size)


def make_engine(shape, hw, *, block_size: int = 16, gpu_memory_utilization: float = 0.9, fit_max_model_len: bool = False,
                **options):
    """A real :class:`LLMEngine` on a :class:`RooflineExecutor` whose pool is sized like the device's.

    ``fit_max_model_len``: treat ``max_model_len`` as a wish and clamp it to what the model's positions and the
    pool allow, so one over-long request of a workload is refused on its own (as a server's 400) instead of the
    engine refusing to start.
    """
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.roofline import RooflineExecutor

    ex = RooflineExecutor(shape, hw, block_size=block_size)
    if options.get("num_gpu_blocks_override") is None and options.get("kv_cache_memory_bytes") is None:
        options["kv_cache_memory_bytes"] = kv_pool_bytes(shape, hw, gpu_memory_utilization)
    # the model's own positions bound every request (a shape that did not record them: 131,072, a long context)
    model_max_len = options.pop("model_max_len", shape.max_position_embeddings or 131072)
    costs = options.pop("preemption_cost_model", None)
    blocks = options.get("num_gpu_blocks_override") or options["kv_cache_memory_bytes"] // ex.kv_bytes_per_block
    if options.get("max_model_len") is None:
        options["max_model_len"] = min(model_max_len, blocks * block_size)
    elif fit_max_model_len:
        options["max_model_len"] = min(options["max_model_len"], model_max_len, blocks * block_size)
    config = EngineConfig(block_size=block_size, device="cpu", **options)
    # in auto mode (three_class resolves to it) the engine asks the executor for its cost model: the same
    # roofline that times the steps decides swap-or-recompute, by the victim's length
    return LLMEngine(config, executor=ex, model_max_len=model_max_len, eos_token_ids=set(), preemption_cost_model=costs)


def report_extras(engine, rec: DriveRecord) -> dict:
    """What a simulated run adds to the load generator's table: what only the engine and the virtual clock know
    (steps, preemptions, KV usage over time, how busy the device was, which roof bound the dense phase)."""
    st = engine.stats()
    ex = engine.executor
    usage = [u for _, u in rec.kv_usage]
    return {
        "steps": len(rec.step_end_readings),
        "preemptions": st["num_preemptions"],
        "prefix_cache_hit_rate": st.get("prefix_cache_hit_rate"),
        "kv_blocks": st["num_blocks"],
        "kv_usage_peak": max([rec.kv_peak, *usage]),  # every step's, not only the samples
        # every step's level weighted by how long it held, idle stretches included: a plain mean of the samples
        # would let a burst's few busy samples stand for a long idle run (and count a long step once)
        "kv_usage_mean": rec.kv_area / rec.kv_span if rec.kv_span > 0 else 0.0,
        "kv_usage_over_time": rec.kv_usage,
        "busy_fraction": getattr(ex, "busy_s", 0.0) / rec.duration if rec.duration else None,
        "dense_bound_steps": getattr(ex, "bound_steps", None),
        "wall_s": rec.wall_s,
    }


def sparkline(values: list[float], width: int = 60, top: float = 1.0) -> str:
    """``values`` over time in one line of block characters, a full block at ``top``; a value above 0 never
    draws as blank (a run at 2% usage on a 0..1 scale would otherwise print an empty line)."""
    if not values:
        return ""
    bars = " ▁▂▃▄▅▆▇█"
    step = max(1, math.ceil(len(values) / width))
    cols = [max(values[k:k + step]) for k in range(0, len(values), step)]
    return "".join(bars[min(8, max(1 if v > 0 else 0, int(round(v / top * 8))))] for v in cols)


def format_extras(x: dict) -> str:
    hit = x["prefix_cache_hit_rate"]
    bound = x["dense_bound_steps"] or {}
    return (f"steps {x['steps']} | preemptions {x['preemptions']} | prefix hit rate "
            f"{'-' if hit is None else f'{100 * hit:.1f}%'} | KV blocks {x['kv_blocks']} (peak {100 * x['kv_usage_peak']:.0f}%,"
            f" mean {100 * x['kv_usage_mean']:.0f}%) | busy {100 * (x['busy_fraction'] or 0):.0f}% | dense phase "
            f"memory-bound {bound.get('memory', 0)} / compute-bound {bound.get('compute', 0)} steps\n"
            f"KV usage over time |{sparkline([u for _, u in x['kv_usage_over_time']], top=_spark_top(x))}| "
            f"(a full block is {100 * _spark_top(x):.0f}%)")


def _spark_top(x: dict) -> float:
    """The sparkline's full scale: 100%, or, when the pool was never a tenth full, the peak rounded up to a
    whole per cent (so a lightly loaded run still shows its shape)."""
    peak = x["kv_usage_peak"] or 0.0
    # (per cent rounded to 1e-9 before the ceiling: 7 of 100 blocks is the float 0.07, whose 100-fold is
    # 7.000000000000001, and a bare ceiling made the scale 8% -- the peak drawn short of a full block)
    return 1.0 if peak >= 0.1 else max(0.01, math.ceil(round(peak * 100, 9)) / 100)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minivllm sim run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default=None,
                    help=f"a JSONL trace path or one of {', '.join(WORKLOADS)} (default: chat, unless --tenant is given)")
    ap.add_argument("--hardware", default="h100", help="h100, h200, a100, l4, or a calibration profile (name or path)")
    ap.add_argument("--model", default="llama-3-8b", help="llama-3-8b, llama-3.2-1b, qwen3-0.6b, smollm2-135m")
    ap.add_argument("--dtype-bytes", type=int, choices=(1, 2, 4), default=None,
                    help="bytes per weight/KV element: 1 (fp8), 2 (bf16), 4 (fp32); the GEMM rate follows it on the "
                         "GPU presets (fp8 2x bf16's; fp32 the FP32 units' datasheet peak, TF32 being off); default: the preset's, and on a "
                         "GPU bf16 as the engine's dtype 'auto' picks there")
    ap.add_argument("--tenant", action="append", default=[], metavar="SPEC", help="as minivllm bench serve --tenant")
    ap.add_argument("--input-len", default=None, metavar="DIST",
                    help="prompt lengths: N, fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA[:MAX]; replaces a named "
                         "workload's, fills in a --tenant spec without input= (default uniform:32:128 there)")
    ap.add_argument("--output-len", default=None, metavar="DIST",
                    help="output lengths, the same way (default fixed:16 where nothing else says)")
    ap.add_argument("--num-requests", type=positive_int, default=None,
                    help="requests to generate (default 1000); a trace workload sends all its lines instead")
    ap.add_argument("--request-rate", type=positive_rate, default=None, help="req/s (default: the workload's)")
    ap.add_argument("--burstiness", type=positive_float, default=None)
    ap.add_argument("--seed", type=nonnegative_int, default=0)  # (numpy's generators take no negative seed)
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--max-num-seqs", type=positive_int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=fraction, default=0.9)
    ap.add_argument("--num-gpu-blocks-override", type=positive_int, default=None)
    ap.add_argument("--max-model-len", type=positive_int, default=None,
                    help="longest prompt + output a request may have (default: the workload's longest, at least 2048, "
                         "within the model's positions and the KV pool); a longer request is refused on its own, "
                         "as a 400")
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "reject", "auto"])
    ap.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "wfq", "three_class"],
                    help="who is served first (default fcfs). Not offered: 'priority' and 'deadline', since no "
                         "simulated request carries a priority or a deadline (they ran FCFS's schedule step for "
                         "step), and 'caps', which needs tenant caps no flag here can give")
    ap.add_argument("--slo-ttft-ms", type=positive_float, default=None)
    ap.add_argument("--slo-itl-ms", type=positive_float, default=None)
    ap.add_argument("--out", type=output_file, default=None, help="write the summary (and per-request results) as JSON here")
    ap.add_argument("--no-requests-in-json", action="store_true", help="leave the per-request records out of --out")
    ap.add_argument("--profile", action="store_true", help="run under cProfile and print the top functions")
    return ap


def run_sim(args, out=None) -> dict:
    out = out or sys.stdout
    from minivllm.sim.presets import hardware_and_profile, simulated_shape

    hw, profile = hardware_and_profile(args.hardware)
    shape = simulated_shape(args.model, hw, args.dtype_bytes)
    reqs, rate, tenants = build_requests(args, shape.vocab_size)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    engine = make_engine(shape, hw, block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         num_gpu_blocks_override=args.num_gpu_blocks_override,
                         enable_prefix_caching=args.enable_prefix_caching, preemption_mode=args.preemption_mode,
                         scheduling_policy=args.scheduling_policy, max_model_len=args.max_model_len or max(longest, 2048),
                         fit_max_model_len=args.max_model_len is None)
    rec = drive(engine, reqs)
    slo_ttft = args.slo_ttft_ms / 1000 if args.slo_ttft_ms is not None else None
    slo_itl = args.slo_itl_ms / 1000 if args.slo_itl_ms is not None else None
    summary = summarize(RunResult(rate, rec.duration, rec.results), slo_ttft, slo_itl)
    extras = report_extras(engine, rec)
    tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in reqs)
    print(f"== simulated: {shape.name} on {hw.name} | {len(reqs)} requests, {tokens} tokens | workload "
          f"{args.workload or 'of the --tenant specs'}"
          f" | offered {_rate(rate, reqs)} req/s | {rec.duration:.1f} s simulated in {rec.wall_s:.1f} s wall", file=out)
    if profile is not None:  # a calibration profile: a snapshot of one host and engine
        when = profile.get("date_utc") or "an unrecorded date"
        print(f"   (the profile describes the host and engine it was measured on, {when}; "
              f"`minivllm sim calibrate --check {args.hardware}` says whether it still describes this one)", file=out)
    slo = ", ".join(x for x in (f"TTFT <= {args.slo_ttft_ms:g} ms" if slo_ttft else "",
                                f"p99 ITL <= {args.slo_itl_ms:g} ms" if slo_itl else "") if x)
    print(format_table(summary, f"SLO {slo}" if slo else ""), file=out)
    print(format_extras(extras), file=out, flush=True)
    doc = {"tool": "minivllm sim run", "model": asdict(shape), "hardware": hw.to_dict(), "workload": args.workload,
           "tenants": [t.describe() for t in tenants], "num_requests": len(reqs), "total_tokens": tokens,
           "summary": summary, "sim": extras}
    if not getattr(args, "no_requests_in_json", False):  # as bench serve's --out: the numbers behind the summary
        doc["requests"] = [asdict(r) for r in rec.results]
    if args.out:
        write_result(args.out, doc, "minivllm sim run", getattr(args, "argv", None))
        print(f"wrote {args.out}", file=out)
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.out is None:  # (run_sim's own callers read the records from the document it returns)
        refuse_unread(parser, args, ("no_requests_in_json",), "without --out (it trims the JSON --out writes)")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line a result file records
    try:
        if args.profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.runcall(run_sim, args)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
            pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        else:
            run_sim(args)
    except (ValueError, OSError) as exc:  # OSError: a --workload or --out path that cannot be read or written
        print(f"minivllm sim run: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
