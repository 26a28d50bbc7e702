"""``python -m minivllm.bench sim_accuracy`` — does the calibrated simulator predict the real engine?

Protocol (the issue's, after Vidur's): calibrate the roofline on one set of
workloads -- the grid of batch shapes of :mod:`minivllm.sim.calibrate` -- then,
on three *held-out* open-loop workloads, run the real engine on this machine
(bundled SmolLM2-135M) and the simulator (same engine, same config, roofline
executor with the fitted spec) on the very same arrivals and token ids, and
compare p50/p99 TTFT, p50/p99 ITL and the total time of the run.  Relative error
= (simulated - real) / real; the target is within 10% each (goal 5%).

The held-out workloads: steady decode-heavy (Poisson, long outputs), bursty
mixed (gamma arrivals with burstiness 0.2, short chats plus long batch prompts),
and long prompts with chunked prefill (prompts longer than the token budget).

The real engine runs each workload ``--real-repeats`` times (default 2): its
metrics are the median of the runs, and their spread ((max - min) / median)
is printed beside the simulator's error.  That spread is the floor under any
accuracy claim: a simulator cannot be judged more precisely than the engine
repeats itself on the same machine.

The machine itself can change speed while the benchmark runs (a shared VM's
neighbours, clocks): a fixed *probe* -- two groups of the calibration grid, a
lone 512-token prefill and 8 sequences decoding -- is re-run before each
workload and at the end, and its time divided by the same steps' time in the
calibration is recorded as ``drift``.  Nothing is fitted to the held-out
workloads: the verdict is the simulator with the calibrated spec, as before.
Beside it the table shows the error of the same simulation slowed by the drift
measured around that workload (``HardwareSpec.slowed``), which separates "the
cost model is wrong" from "the machine was slower than when it was measured".

Real timings are only as good as the machine is quiet: the JSON records the
load average before and after, the share of the run's CPU time a hypervisor gave
other guests (steal: the neighbour a VM's load average never shows), and the
calibration fit's own error.  On a
machine shared with other busy processes, ``--clock cpu`` times the real engine
by its serving thread's CPU time (one torch thread; idle gaps skipped), which
is what the run would take on a quiet machine -- calibration and validation
then both use that clock (see :class:`minivllm.sim.calibrate.RecordingExecutor`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from minivllm.argtypes import (brief_path, is_int, output_file, positive_float, positive_int, refuse_unread,
                               unwritable)
from minivllm.bench.loadgen import parse_tenant, percentile, plan_requests
from minivllm.bench.results import cpu_identity, cpu_times, steal_share, write_json, write_result
from minivllm.engine.startup import frozen_heap
from minivllm.metrics.stats import nearest_rank
from minivllm.sim.calibrate import REPEATS as CALIBRATION_REPEATS

WORKLOADS = {
    # name: (tenant specs, requests, rate req/s, burstiness)
    "decode_heavy": (["name=gen,input=uniform:16:64,output=uniform:48:80"], 16, 1.0, 1.0),
    "bursty_mixed": (["name=chat,share=3,input=uniform:32:128,output=uniform:16:32",
                      "name=batch,share=1,input=uniform:256:400,output=uniform:8:16"], 20, 1.5, 0.2),
    "long_prompt_chunked": (["name=docs,input=uniform:600:1200,output=uniform:8:16"], 8, 0.4, 1.0),
}
METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "total_s")
ENGINE = dict(max_num_batched_tokens=512, max_num_seqs=32, num_blocks=512, max_model_len=4096)
RUN_FLAGS = ("scale", "workload", "clock", "save_profile", "model", "real_repeats", "calibration_repeats", "device",
             "dtype", "live_heap")
"""The flags (parser destinations) that shape a real run and its fresh calibration, and that nothing else reads:
``--explain`` and ``--resimulate`` run no engine.  Each is None (False for ``--live-heap``) in the parser, so that one
given is told from one left alone even when typed with its default's value (``--explain R --scale 1.0`` was taken and
dropped in silence while ``--scale 0.5`` was refused); ``main`` puts :data:`RUN_DEFAULTS` in after its checks."""
RUN_DEFAULTS = dict(scale=1.0, clock="wall", real_repeats=2, device="auto", dtype="auto")
"""What a real run reads for each of :data:`RUN_FLAGS` left alone (the others: none, all workloads, frozen heap,
and ``minivllm.sim.calibrate``'s repeats)."""


def metrics(rec) -> dict:
    """One run's latency figures over the requests served whole (``ok``): a refused or failed request has no
    latency to compare (it counts in ``requests``, not in ``ok``)."""
    ok = [r for r in rec.results if r.outcome == "ok"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "itl_p50": percentile(itl, 50),
            "itl_p99": percentile(itl, 99), "total_s": rec.duration, "ok": len(ok), "requests": len(rec.results)}


def workload_requests(name: str, tokenizer, scale: float = 1.0, seed: int = 0, vocab_size: int = 32000):
    """The held-out workload's requests; a model without a tokenizer (random weights) gets one id per word."""
    import zlib

    from minivllm.sim.run import requests_from_plan

    specs, n, rate, burst = WORKLOADS[name]
    tenants = [parse_tenant(s) for s in specs]
    plan = plan_requests(tenants, max(3, int(round(n * scale))), rate, burst, seed)
    if tokenizer is None:
        def tokenize(text):
            return [10 + zlib.crc32(w.encode()) % (vocab_size - 10) for w in text.split()]
    else:
        tokenize = tokenizer.encode
    return requests_from_plan(plan, tokenize=tokenize)


def sim_engine(spec, shape, *, max_num_batched_tokens: int, max_num_seqs: int, num_blocks: int,
               max_model_len: int, block_size: int = 16):
    """The engine with the real one's configuration, its executor the roofline with ``spec``."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.roofline import RooflineExecutor

    sim_cfg = EngineConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                           num_gpu_blocks_override=num_blocks, max_model_len=max_model_len,
                           block_size=block_size, device="cpu")
    return LLMEngine(sim_cfg, executor=RooflineExecutor(shape, spec, block_size=block_size),
                     model_max_len=max_model_len, eos_token_ids=set())


def compare(runs: list[dict], m_sim: dict) -> dict:
    """One workload's row: the real runs' median and spread, the simulator's metrics and its relative error."""
    m_real = dict(runs[0], **{k: statistics.median(m[k] for m in runs) for k in METRICS})
    spread = {k: (max(m[k] for m in runs) - min(m[k] for m in runs)) / m_real[k] if m_real[k] else None
              for k in METRICS}
    err = {k: (m_sim[k] - m_real[k]) / m_real[k] if m_real[k] else None for k in METRICS}
    return {"real": m_real, "real_runs": runs, "real_spread": spread, "sim": m_sim, "rel_error": err}


def step_log(samples) -> list:
    """Each real step as ``[began_s, seconds, [[start, tokens, completes_prompt], ...], host]``, kept in the JSON.

    ``host`` is ``[cpu_s, minor_faults, involuntary_switches]`` of the forward pass
    (:class:`~minivllm.sim.calibrate.HostUsage`), or null where it was not recorded.
    Why: a miss on a lent GPU can then be taken apart step by step on any
    machine afterwards -- which shapes of step the profile predicts too fast, and
    whether a slow step was the host running slower or waiting -- without another
    lease (the per-run metrics alone only say *that* it missed).
    """
    return [[round(s.start_s, 7), round(s.time_s, 7), [list(q) for q in s.seqs],
             None if s.host is None else [s.host.cpu_s, s.host.minor_faults, s.host.involuntary_switches]]
            for s in samples]


def within_10pct(rows: dict, key: str = "rel_error") -> list[bool]:
    """Per metric, whether the error under ``key`` (a row without it: its plain ``rel_error``) is within 10%."""
    return [abs(e) <= 0.10 for r in rows.values() for e in r.get(key, r["rel_error"]).values() if e is not None]


# The probe: calibration groups 4 (one 512-token prompt) and 14 (8 sequences decoding at 32 tokens of context) --
# one prompt-bound and one decode-bound shape, about a second together on the 2-core CPU.
PROBE_GROUPS = (4, 14)


def probe_seconds(engine, groups, repeats: int = 3) -> tuple[float, list[int]]:
    """The probe's time on ``engine`` now (per step the median of ``repeats`` runs, as the calibration
    measured it, summed) and its steps per group."""
    from minivllm.sim.calibrate import measure_median

    steps = [measure_median(engine, group, repeats) for group in groups]
    return sum(s.time_s for group in steps for s in group), [len(group) for group in steps]


def probe_reference(doc: dict, group_ids=PROBE_GROUPS) -> tuple[float, list[int]]:
    """The probe's steps as the calibration recorded them: their summed time and their number per group."""
    samples = doc.get("samples") or []
    mine = [[x["time_s"] for x in samples if x.get("group") == gid] for gid in group_ids]
    return sum(map(sum, mine)), [len(t) for t in mine]


# What a stored result says about its *own* simulation, which a re-simulation with another profile replaces:
# the drift-adjusted errors were computed against that run's probe and calibration, so they would sit beside
# the new errors and describe another simulator.
_OLD_SIMULATION_ROW = ("rel_error_drift_adjusted",)
_OLD_SIMULATION = ("probe", "within_10pct_drift_adjusted")


def resimulate(result: dict, doc: dict, out=None) -> dict:
    """The simulator side of a stored ``result`` again, with the profile ``doc``; the real side as recorded.

    A GPU run's real measurements cost a lent machine; the simulator runs anywhere in seconds.  So a
    change to the cost model (or a re-fitted profile, ``minivllm sim calibrate --refit``) can be judged
    on the recorded real runs without the GPU.  Every path of this benchmark uses the profile's hardware
    *as fitted*: it judges the fit on the shapes it was fitted and recorded with.  ``sim run`` and the
    fleet, which extrapolate a profile to other models and lengths, read it through
    :func:`~minivllm.sim.presets.profile_spec`, which bounds a roof the grid never reached by the datasheet.  The workloads are regenerated from their seeds; the
    request count is checked against the record.
    """
    from minivllm.sim.roofline import HardwareSpec, ModelShape
    from minivllm.sim.run import drive

    out = out or sys.stdout
    shape, spec = ModelShape.from_dict(doc.get("model")), HardwareSpec.from_dict(doc.get("hardware"))
    rows = {}
    for name, old in result["workloads"].items():
        reqs = workload_requests(name, None, result["scale"], vocab_size=shape.vocab_size)
        if len(reqs) != old["requests"]:
            raise ValueError(f"{name}: {len(reqs)} requests regenerated, {old['requests']} recorded")
        rec = drive(sim_engine(spec, shape, block_size=doc["engine"]["block_size"], **result["engine"]), reqs)
        kept = {k: v for k, v in old.items() if k not in _OLD_SIMULATION_ROW}
        rows[name] = dict(kept, **compare(old["real_runs"], metrics(rec)), sim_steps=len(rec.step_end_readings))
    print(format_table(rows), file=out)
    within = within_10pct(rows)
    print(f"{sum(within)}/{len(within)} metrics within 10% (re-simulated with {spec.name}, recorded real runs)", file=out)
    kept = {k: v for k, v in result.items() if k not in _OLD_SIMULATION}
    return dict(kept, workloads=rows, within_10pct=f"{sum(within)}/{len(within)}",
                calibration={k: doc[k] for k in ("hardware", "fit", "model")},
                resimulated_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def run(scale: float = 1.0, profile: str | None = None, names=None, out=None, clock: str = "wall",
        model: str | None = None, device: str = "auto", dtype: str = "auto", real_repeats: int = 2,
        calibration_repeats: int = CALIBRATION_REPEATS, freeze_heap: bool = True, checkpoint=None) -> dict:
    """Calibrate (or load ``profile``), then real vs simulated on the held-out workloads.

    ``model`` (an HF directory, e.g. a random-weight Llama-3.2-1B on a GPU machine
    without downloads) replaces the bundled model; its shape comes from its config.
    ``freeze_heap``: once the real engine is built, freeze what is alive out of the
    garbage collector while measuring, as ``minivllm serve`` does
    (:mod:`minivllm.engine.startup`); ``False`` measures with the live heap, as
    results before 2026-12-02 did.  ``checkpoint(doc)``, if given, is called with the result so far once
    the profile is ready and after each workload (see :func:`_against_real`).
    """
    from minivllm.sim.calibrate import real_engine

    load_before, ticks_before = os.getloadavg(), cpu_times()
    t_start = time.perf_counter()
    real = real_engine(clock=clock, model=model, device=device, dtype=dtype, **ENGINE)
    def document(doc: dict, frozen: int) -> dict:
        host = {"cpus": os.cpu_count(), "cpu": cpu_identity(), "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(), "steal_share": steal_share(ticks_before, cpu_times()),
                "note": "1-minute load average before and after: above about 1 per core, other processes shared the "
                        "machine; steal_share: the part of the run's CPU time the hypervisor gave other guests"}
        return {"benchmark": "sim_accuracy", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "clock": clock, "host": host, **doc, "gc_frozen_objects": frozen,
                "seconds": time.perf_counter() - t_start}

    with frozen_heap() if freeze_heap else contextlib.nullcontext(0) as frozen:
        doc = _against_real(real, scale, profile, names, out or sys.stdout, model, real_repeats, calibration_repeats,
                            checkpoint=checkpoint and (lambda part: checkpoint(document(part, frozen))))
    return document(doc, frozen)


def _against_real(real, scale: float, profile: str | None, names, out, model: str | None, real_repeats: int,
                  calibration_repeats: int, checkpoint=None) -> dict:
    """:func:`run`'s measurements on the built ``real`` engine: calibration, then each held-out workload.

    ``checkpoint(doc)`` is called with the result so far (``unfinished_workloads`` naming those still to run)
    once the profile is ready and after each workload.  Why: on a lent GPU the run has a time box, and a run
    ended by it used to leave nothing -- not the calibration, not the workloads already measured -- so the
    next step that needed the profile failed too.
    """
    import torch

    from minivllm.sim.calibrate import calibrate, calibration_grid, format_profile, measure
    from minivllm.sim.presets import bundled_shape, load_profile
    from minivllm.sim.roofline import HardwareSpec, ModelShape
    from minivllm.sim.run import drive

    dtype_bytes = torch.tensor([], dtype=real.config.dtype).element_size()
    if model is None:
        shape = bundled_shape().with_dtype(dtype_bytes)
    else:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as fh:
            shape = ModelShape.from_hf_config(json.load(fh), name=os.path.basename(os.path.normpath(model)),
                                              dtype_bytes=dtype_bytes)
    grid_scale = 0.6 if scale < 1 else 1.0
    if profile:
        doc = load_profile(profile)
        spec = HardwareSpec.from_dict(doc.get("hardware"))  # the fit as stored: see resimulate()
    else:
        print("calibrating on the grid of batch shapes (the training set)...", file=out, flush=True)
        doc = calibrate(real, shape=shape, scale=grid_scale, out=out, repeats=calibration_repeats)
        spec = HardwareSpec.from_dict(doc.get("hardware"))
    print(format_profile(doc), file=out, flush=True)
    shape = shape.with_dtype(doc["model"]["dtype_bytes"])
    cfg = real.config  # the simulated engine gets the real one's configuration
    same_config = dict(max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
                       num_blocks=real.pool.num_blocks, max_model_len=cfg.max_model_len, block_size=cfg.block_size)
    grid = calibration_grid(shape.vocab_size, scale=grid_scale)
    probe = [grid[g] for g in PROBE_GROUPS]
    ref_s, ref_counts = probe_reference(doc)
    first, counts = probe_seconds(real, probe)
    probes = [first]  # the probe's time before each workload and after the last
    calibrated = counts == ref_counts and ref_s > 0
    reference = ref_s if calibrated else first  # else (another grid, or a profile without probe steps): the first probe
    against = "the calibration's" if calibrated else "this run's first (the profile has no matching probe steps)"

    def drift_now() -> float:
        probes.append(probe_seconds(real, probe)[0])
        return probes[-1] / reference

    drift = first / reference
    rows = {}
    names = list(names or WORKLOADS)

    def result() -> dict:
        within, adjusted = within_10pct(rows), within_10pct(rows, "rel_error_drift_adjusted")
        doc_so_far = {"engine": ENGINE, "scale": scale, "real_repeats": real_repeats,
                      "calibration": {k: doc[k] for k in ("hardware", "fit", "model")},
                      "workloads": rows, "within_10pct": f"{sum(within)}/{len(within)}",
                      "probe": {"groups": list(PROBE_GROUPS), "calibration_s": ref_s, "reference_s": reference,
                                "seconds": probes, "reference": "calibration" if calibrated else "first probe"},
                      "within_10pct_drift_adjusted": f"{sum(adjusted)}/{len(adjusted)}", "_profile": doc}
        unfinished = [n for n in names if n not in rows]
        return dict(doc_so_far, unfinished_workloads=unfinished) if unfinished else doc_so_far

    if checkpoint:
        checkpoint(result())
    for name in names:
        reqs = workload_requests(name, real.tokenizer, scale, vocab_size=shape.vocab_size)
        measured = [measure(real, reqs) for _ in range(max(1, real_repeats))]
        recs_real = [rec for _, rec in measured]
        rec_sim = drive(sim_engine(spec, shape, **same_config), reqs)
        before, drift = drift, drift_now()
        around = (before + drift) / 2
        rows[name] = {**compare([metrics(r) for r in recs_real], metrics(rec_sim)),
                      "requests": len(reqs), "tokens": sum(len(r.prompt_token_ids) + r.max_tokens for r in reqs),
                      "real_steps": len(recs_real[0].step_end_readings), "sim_steps": len(rec_sim.step_end_readings),
                      "real_step_logs": [step_log(samples) for samples, _ in measured],
                      "drift": {"before": before, "after": drift}}
        if abs(around - 1) > 1e-3:
            m_adj = metrics(drive(sim_engine(spec.slowed(around), shape, **same_config), reqs))
            rows[name]["rel_error_drift_adjusted"] = compare(rows[name]["real_runs"], m_adj)["rel_error"]
        print(f"  {name}: {len(reqs)} requests, real runs {', '.join(f'{r.wall_s:.1f}' for r in recs_real)} s, "
              f"probe x{before:.3f} before, x{drift:.3f} after", file=out, flush=True)
        if checkpoint:
            checkpoint(result())
    print("\n" + format_table(rows), file=out)
    within = within_10pct(rows)
    print(f"{sum(within)}/{len(within)} metrics within 10%", file=out)
    adjusted = within_10pct(rows, "rel_error_drift_adjusted")
    print(f"the probe's time against {against}: x{first / reference:.3f} at the start, "
          f"x{drift:.3f} at the end; the simulator slowed by the drift around each workload: "
          f"{sum(adjusted)}/{len(adjusted)} within 10% (not the verdict: an explanation of misses)", file=out)
    if real_repeats > 1:
        spreads = [e for r in rows.values() for e in r["real_spread"].values() if e is not None]
        print(f"the real engine's own run-to-run spread: median {100 * statistics.median(spreads):.1f}%, "
              f"max {100 * max(spreads):.1f}% ({real_repeats} runs per workload)", file=out)
    return result()


def _step_seqs(workload: str, step) -> list[tuple]:
    """A recorded step's sequences, ``[(start, tokens, samples), ...]``; a step of another shape is a ValueError.

    Step logs are read from files (``--explain``), so a hand-made or truncated one is an error that says
    which workload it is in, not an ``IndexError`` or ``TypeError`` from deep inside the comparison.  A step
    runs at least one sequence, and ``start`` and ``tokens`` are counts (the cost model adds them up).
    """
    try:
        seqs = [tuple(q) for q in step[2]]
        if (isinstance(step[1], (int, float)) and seqs and all(len(q) == 3 for q in seqs)
                and all(is_int(x) and x >= 0 for q in seqs for x in q[:2])):
            return seqs
    except (TypeError, IndexError, KeyError):
        pass
    raise ValueError(f"workload {workload!r}: step {step!r} is not [began_s, seconds, [[start, tokens, samples], ...]]")


def explain(result: dict, doc: dict) -> dict:
    """Take a stored result's misses apart step by step: each recorded real step against the profile's prediction.

    Per workload and kind of step (``prompt``: any sequence computes more than one token; ``decode``:
    every sequence one), the median and 90th percentile of real / predicted time, and the real
    steps' median duration; where two runs scheduled a step identically, how much the engine's own
    time for that same step moved between them (median and max of |run 2 / run 1 - 1|).  And, for
    results recorded with host usage (:class:`~minivllm.sim.calibrate.HostUsage`), the forward
    passes' CPU time over their wall time and their page faults and involuntary switches.  Why:
    a TTFT miss is a statement about prompt steps; this says whether the profile predicts them too
    fast on average (the model) or the engine itself does not repeat them (the machine).
    """
    from minivllm.sim.roofline import HardwareSpec, ModelShape, roofline_time, step_cost

    if not isinstance(doc, dict) or not isinstance(result.get("workloads"), dict):
        raise ValueError("the calibration and the result's workloads must be JSON objects")
    shape, spec = ModelShape.from_dict(doc.get("model")), HardwareSpec.from_dict(doc.get("hardware"))
    block = (doc.get("engine") or {}).get("block_size", 16)  # a result's own calibration block carries no engine
    if not is_int(block) or block < 1:
        raise ValueError(f"the calibration's engine block_size must be a positive integer, got {block!r}")

    def pct(xs, q):  # q a fraction
        return nearest_rank(xs, 100 * q, None)

    rows = {}
    for name, w in result["workloads"].items():
        if not isinstance(w, dict):
            raise ValueError(f"workload {name!r} is not an object")
        logs = w.get("real_step_logs") or []
        if not isinstance(logs, list) or not all(isinstance(log, list) for log in logs):
            raise ValueError(f"workload {name!r}: real_step_logs is not a list of runs, each a list of steps")
        by_kind: dict[str, dict] = {}
        kinds: list[list[str]] = []  # each run's steps' kinds, for the repeat comparison below
        for log in logs:
            kinds.append([])
            for step in log:
                cost = step_cost(shape, _step_seqs(name, step), 0, block)
                pred = roofline_time(cost, shape, spec).total
                kinds[-1].append(cost.kind)
                k = by_kind.setdefault(cost.kind, {"ratio": [], "real": [], "host": []})
                k["ratio"].append(step[1] / pred)
                k["real"].append(step[1])
                if len(step) > 3 and step[3] is not None:
                    k["host"].append((step[1], *step[3]))
        if len(logs) >= 2:
            for a, b, kind in zip(logs[0], logs[1], kinds[0]):
                if a[2] == b[2] and a[1] > 0:
                    by_kind[kind].setdefault("repeat", []).append(abs(b[1] / a[1] - 1))
        out = {}
        for k, v in by_kind.items():
            row = {"steps": len(v["real"]), "real_over_pred_p50": pct(v["ratio"], 0.5),
                   "real_over_pred_p90": pct(v["ratio"], 0.9), "real_ms_p50": 1e3 * pct(v["real"], 0.5)}
            if v.get("repeat"):
                row.update(same_step_moved_p50=pct(v["repeat"], 0.5), same_step_moved_max=max(v["repeat"]))
            if v["host"]:
                row.update(cpu_over_wall_p50=pct([c / t for t, c, _, _ in v["host"] if t > 0], 0.5),
                           minor_faults=sum(f for _, _, f, _ in v["host"]),
                           involuntary_switches=sum(s for _, _, _, s in v["host"]))
            out[k] = row
        rows[name] = out
    return rows


def format_explain(rows: dict) -> str:
    lines = [f"{'workload':<20} {'kind':<7} {'steps':>5} {'real/pred p50':>13} {'p90':>6} {'real p50':>9} "
             f"{'same step moved p50/max':>24} {'cpu/wall':>9} {'faults':>7} {'inv.sw':>6}"]
    for name, kinds in rows.items():
        for k, r in sorted(kinds.items()):
            moved = (f"{100 * r['same_step_moved_p50']:.1f}% / {100 * r['same_step_moved_max']:.1f}%"
                     if "same_step_moved_p50" in r else "-")
            host = (f"{r['cpu_over_wall_p50']:>9.2f} {r['minor_faults']:>7} {r['involuntary_switches']:>6}"
                    if "cpu_over_wall_p50" in r else f"{'-':>9} {'-':>7} {'-':>6}")
            lines.append(f"{name:<20} {k:<7} {r['steps']:>5} {r['real_over_pred_p50']:>13.3f} "
                         f"{r['real_over_pred_p90']:>6.2f} {r['real_ms_p50']:>7.1f}ms {moved:>24} {host}")
    return "\n".join(lines)


def format_table(rows: dict) -> str:
    head = f"{'workload':<20} {'metric':<9} {'real':>9} {'sim':>9} {'error':>7} {'real spread':>12} {'drift-adj.':>10}"
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        for k in METRICS:
            unit = 1.0 if k == "total_s" else 1000.0
            e, sp = r["rel_error"][k], r.get("real_spread", {}).get(k)
            adj = r.get("rel_error_drift_adjusted", {}).get(k)
            lines.append(f"{name:<20} {k + ('' if k == 'total_s' else '_ms'):<9} {r['real'][k] * unit:>9.1f} "
                         f"{r['sim'][k] * unit:>9.1f} {'-' if e is None else f'{100 * e:+.1f}%':>7} "
                         f"{'-' if sp is None else f'{100 * sp:.1f}%':>12} {'-' if adj is None else f'{100 * adj:+.1f}%':>10}")
    return "\n".join(lines)


def read_result(flag: str, path: str):
    """The JSON in ``path``, a stored result the command line named with ``flag``: a file missing, unreadable or not
    JSON is a one-line ValueError naming the flag and the path as :func:`~minivllm.argtypes.brief_path` quotes it.

    Why not the OSError's own text: it quotes the path whole (``[Errno 2] No such file or directory: '...'``), and
    a generated or pasted path of thousands of characters made the one-line error as long.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except OSError as exc:
        raise ValueError(f"{flag} {brief_path(path)}: {exc.strerror or type(exc).__name__}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:  # (neither quotes the path)
        raise ValueError(f"{flag} {brief_path(path)} is not readable JSON: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench sim_accuracy", description=__doc__.split("\n\n")[0])
    d = RUN_DEFAULTS  # (each None in the parser: see RUN_FLAGS)
    ap.add_argument("--scale", type=positive_float, default=None,
                    help=f"fraction of each workload's requests (quick: 0.5; default {d['scale']})")
    ap.add_argument("--profile", default=None, help="use this calibration profile instead of calibrating now")
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS), default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default=None,
                    help="cpu: the real engine's clock is its thread's CPU time (one torch thread), immune to other "
                         f"processes on a shared machine (default {d['clock']})")
    ap.add_argument("--save-profile", type=output_file, default=None, help="also write the fresh calibration as a profile JSON here")
    ap.add_argument("--out", type=output_file, default=None, help="JSON results (default: benchmarks/results/<date>_cpu-<N>core_sim_accuracy.json, "
                    "..._sim_accuracy_cputime.json with --clock cpu)")
    ap.add_argument("--model", default=None, help="an HF model directory instead of the bundled model "
                    "(a GPU run: a random-weight Llama-3.2-1B, see `python -m minivllm.bench gpu_e2e`)")
    ap.add_argument("--real-repeats", type=positive_int, default=None,
                    help=f"run the real engine this many times per workload (median; the spread is printed; default "
                         f"{d['real_repeats']})")
    # (None when not given, so that one given beside --profile, which makes no calibration, can be refused)
    ap.add_argument("--calibration-repeats", type=positive_int, default=None,
                    help=f"run each calibration group this many times, median per step (see sim.calibrate; default "
                         f"{CALIBRATION_REPEATS}); not with --profile, which stands in for the calibration")
    ap.add_argument("--device", default=None, help=f"the real engine's device (default {d['device']})")
    ap.add_argument("--dtype", default=None, help=f"the real engine's dtype (default {d['dtype']})")
    ap.add_argument("--live-heap", action="store_true",
                    help="measure the real engine without freezing its start-up heap out of the garbage collector "
                         "(the default freezes it, as `minivllm serve` does; results before 2026-12-02: live)")
    ap.add_argument("--resimulate", default=None, metavar="RESULT",
                    help="run no real engine: re-simulate this stored result's workloads with --profile (e.g. a GPU "
                         "run re-judged after `minivllm sim calibrate --refit`) and compare with its recorded real runs; "
                         "printed, and written only with --out (RESULT itself is a measurement: never overwritten)")
    ap.add_argument("--explain", default=None, metavar="RESULT",
                    help="run nothing: compare this stored result's recorded real steps, one by one, with the "
                         "predictions of --profile (default: the result's own calibration): real / predicted per "
                         "kind of step, the engine's own step-to-step repeatability, host usage where recorded")
    args = ap.parse_args(argv)
    if args.explain and args.resimulate:
        ap.error("--explain and --resimulate are two different jobs: pass one")
    job = "--explain" if args.explain else "--resimulate" if args.resimulate else None
    if job:  # (--explain prints only: --out, which --resimulate writes, is refused beside it too)
        refuse_unread(ap, args, RUN_FLAGS + (("out",) if args.explain else ()),
                      f"with {job} (it runs no real engine{' and writes nothing' if args.explain else ''})")
    if args.profile:  # (with a job, refused above already: it reads no run flag)
        refuse_unread(ap, args, ("save_profile", "calibration_repeats"), "with --profile (this run makes no calibration)")
    for flag, path in (("--out", args.out), ("--save-profile", args.save_profile)):  # (written last: ask first)
        if path and (why := unwritable(path)):
            ap.error(f"argument {flag}: cannot write {brief_path(path)}: {why}")
    for dest, value in {**RUN_DEFAULTS, "calibration_repeats": CALIBRATION_REPEATS}.items():
        if getattr(args, dest) is None:  # (what a real run reads when the flag is left alone)
            setattr(args, dest, value)
    if args.profile and not args.explain and not args.resimulate:
        from minivllm.sim.presets import load_profile

        try:  # checked before a calibration-free run spends minutes loading the model
            stored = load_profile(args.profile)
        except ValueError as exc:
            ap.error(str(exc))
        timed_on = stored.get("clock")  # (profiles before the CPU-time clock say nothing: wall)
        if timed_on in ("wall", "cpu") and timed_on != args.clock:
            ap.error(f"--profile {brief_path(args.profile)} was timed on the {timed_on} clock and this run would time the real "
                     f"engine on the {args.clock} clock: pass --clock {timed_on} (the simulator predicts the seconds "
                     "of the clock it was calibrated on)")
    if args.explain:
        from minivllm.sim.presets import load_profile

        try:  # a file named on the command line: missing, not JSON, or the wrong kind is a one-line error
            result = read_result("--explain", args.explain)
            if not isinstance(result, dict) or "workloads" not in result or "calibration" not in result:
                raise ValueError(f"--explain {brief_path(args.explain)} is not a sim_accuracy result "
                                 "(no 'workloads' and 'calibration')")
            rows = explain(result, load_profile(args.profile) if args.profile else result["calibration"])
        except ValueError as exc:
            ap.error(str(exc))
        print(format_explain(rows))
        return 0
    if args.resimulate:
        if not args.profile:
            ap.error("--resimulate needs --profile (the profile JSON with the model shape and fitted hardware)")
        if args.out and os.path.realpath(args.out) == os.path.realpath(args.resimulate):
            ap.error(f"--out {brief_path(args.out)} is the --resimulate result itself: a measurement is never overwritten")
        try:  # two files named on the command line: either may be missing, not JSON, or the wrong kind
            result = read_result("--resimulate", args.resimulate)
            from minivllm.sim.presets import load_profile

            profile = load_profile(args.profile)
            if not isinstance(result, dict) or "workloads" not in result:
                raise ValueError(f"--resimulate {brief_path(args.resimulate)} is not a sim_accuracy result (no 'workloads')")
            lacks = [k for k, kind in (("scale", (int, float)), ("engine", dict), ("workloads", dict))
                     if not isinstance(result.get(k), kind)]
            workloads = result.get("workloads")
            lacks += [f"workloads.{w}" for w, row in (workloads.items() if isinstance(workloads, dict) else ())
                      if not (isinstance(row, dict) and isinstance(row.get("requests"), int)
                              and isinstance(row.get("real_runs"), list))]
            engine = result.get("engine")
            # sim_engine's sizes, as a run records them (ENGINE); block_size comes from the profile
            lacks += [f"engine.{k}" for k in ENGINE
                      if isinstance(engine, dict) and not isinstance(engine.get(k), int)]
            if isinstance(engine, dict) and set(engine) - set(ENGINE):
                raise ValueError(f"--resimulate {brief_path(args.resimulate)}: engine has unknown fields "
                                 f"{', '.join(sorted(map(str, set(engine) - set(ENGINE))))}")
            if lacks:  # a hand-edited or truncated result: say what is missing, not a KeyError traceback
                raise ValueError(f"--resimulate {brief_path(args.resimulate)} lacks {', '.join(lacks)} "
                                 "(a sim_accuracy result records each workload's requests and real_runs)")
            if not isinstance(profile.get("model"), dict):
                raise ValueError(f"--profile {brief_path(args.profile)} has no 'model' shape to simulate")
            if not isinstance(profile.get("engine"), dict) or not isinstance(profile["engine"].get("block_size"), int):
                raise ValueError(f"--profile {brief_path(args.profile)} has no engine block_size (written by minivllm sim calibrate)")
            doc = resimulate(result, profile)
        except ValueError as exc:
            print(f"python -m minivllm.bench sim_accuracy: error: {exc}", file=sys.stderr)
            return 2
        if args.out:
            kept = {k: v for k, v in doc.items() if k not in ("command", "machine")}
            if "machine" in doc:  # the real runs were measured there, not on the machine that re-simulates
                kept.update(real_runs_machine=doc["machine"], real_runs_command=doc.get("command"))
            write_result(args.out, kept, "python -m minivllm.bench sim_accuracy", argv)
            print(f"wrote {args.out}")
        return 0
    suffix = "" if args.clock == "wall" else "_cputime"
    path = args.out or os.path.join("benchmarks", "results",
                                    f"{time.strftime('%Y-%m-%d')}_cpu-{os.cpu_count()}core_sim_accuracy{suffix}.json")

    def save(doc: dict) -> None:
        """The profile (a fresh calibration's) and the result so far, on disk: a time box that ends the run
        keeps them (tools/gpu_checks.sh packs what a step left, and its next step reads the profile)."""
        if args.save_profile and not args.profile:
            write_json(args.save_profile, doc["_profile"])
        write_result(path, {k: v for k, v in doc.items() if k != "_profile"}, "python -m minivllm.bench sim_accuracy",
                     argv)

    doc = run(args.scale, args.profile, args.workload, clock=args.clock, model=args.model, device=args.device,
              dtype=args.dtype, real_repeats=args.real_repeats, calibration_repeats=args.calibration_repeats,
              freeze_heap=not args.live_heap, checkpoint=save)
    save(doc)
    if args.save_profile and not args.profile:
        print(f"wrote {args.save_profile}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
