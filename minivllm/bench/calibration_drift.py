"""``python -m minivllm.bench calibration_drift`` -- how far the calibration grid repeats itself on this host.

Why: ``sim_accuracy`` judges the simulator against the real engine within 10%, and the simulator is a fit to
the calibration grid measured minutes before.  If the same grid, measured again on the same host in the same
process, takes a different time or gives a fit that mispredicts the first measurement, no cost model can be
judged more finely than that: the verdict's floor is the host's own repeatability.  This measures it on the
grid itself -- the model loaded once, :func:`~minivllm.sim.calibrate.calibrate` run ``--passes`` times back to
back, nothing changed in between -- so that a miss can be set beside what the host alone moves.

Per pass: the grid's total time (the sum of its measured steps, without the warm-up, the bandwidth read and the
fit), the fit's rms and max relative error on its own steps, and its fitted rates.  Per pair of passes (later
over earlier): the ratio of total times, each group's time ratio (min / median / max over the groups), and
each fit's rms and max relative error on the *other* pass's steps, predicted as ``sim_accuracy`` predicts them
(the profile's hardware as fitted).  A fit that erred 5% on its own steps and 15% on the next pass's says the
host moved by more than the cost model misses.  The cross errors, not the fitted rates, are the comparison to
read: two terms of the cost model can trade weight between fits (a K/V rate against the span's) while both
fits predict the same steps equally well.

Every step's shape and time is kept in the JSON (``--out``), so each number here can be recomputed from it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import time

from minivllm.argtypes import output_file, positive_int
from minivllm.bench.results import cpu_times, steal_share, write_result
from minivllm.engine.startup import frozen_heap
from minivllm.sim import calibrate as cal

PASSES = 2


def grid_seconds(doc: dict) -> float:
    """A calibration's measured grid time: the sum of its steps (no warm-up, bandwidth read or fit)."""
    return sum(s["time_s"] for s in doc["samples"])


def group_seconds(doc: dict) -> dict[int, float]:
    """A calibration's measured time per group of the grid: the sum of that group's steps."""
    out: dict[int, float] = {}
    for s in doc["samples"]:
        out[s["group"]] = out.get(s["group"], 0.0) + s["time_s"]
    return out


def prediction_error(fitted: dict, measured: dict) -> dict:
    """``fitted``'s relative error on ``measured``'s steps (predicted as ``sim run`` and ``sim_accuracy`` would:
    :func:`~minivllm.sim.calibrate.predicted_step_s`): rms and largest absolute, as the fit reports its own."""
    steps = measured["samples"]
    predicted = cal.predicted_step_s(fitted, [(s["seqs"], s["swapped_blocks"]) for s in steps])
    rel = [(p - s["time_s"]) / s["time_s"] for p, s in zip(predicted, steps)]
    return {"rms": math.sqrt(sum(e * e for e in rel) / len(rel)), "max_abs": max(abs(e) for e in rel)}


def pass_summary(doc: dict) -> dict:
    """One pass's row: its grid time, its fit's own errors and rates, and the steps they came from."""
    return {"grid_s": grid_seconds(doc), "pass_s": doc["fit"].get("seconds"),
            "steps": len(doc["samples"]), "rms_rel_error": doc["fit"]["rms_rel_error"],
            "max_abs_rel_error": doc["fit"]["max_abs_rel_error"], "params": doc["fit"]["params"],
            "measured_read_bandwidth": doc["fit"].get("measured_read_bandwidth"), "hardware": doc["hardware"],
            "loadavg": doc.get("loadavg"), "date_utc": doc.get("date_utc"),
            "model": doc["model"], "engine": doc["engine"],
            "samples": [{k: s[k] for k in ("group", "seqs", "swapped_blocks", "time_s")} for s in doc["samples"]]}


def compare_passes(earlier: dict, later: dict) -> dict:
    """Two passes side by side: ``later`` over ``earlier`` in total and per group, and each fit on the other's steps.

    ``same_steps`` says whether the two ran the same step shapes in the same order (the engine schedules the grid
    deterministically, so it should): the group ratios then compare like with like."""
    ga, gb = group_seconds(earlier), group_seconds(later)
    ratios = {g: gb[g] / ga[g] for g in sorted(ga) if g in gb and ga[g] > 0}
    same = [s["seqs"] for s in earlier["samples"]] == [s["seqs"] for s in later["samples"]]
    return {"total_ratio": grid_seconds(later) / grid_seconds(earlier), "group_ratios": ratios,
            "group_ratio_min": min(ratios.values()), "group_ratio_median": statistics.median(ratios.values()),
            "group_ratio_max": max(ratios.values()), "same_steps": same,
            "earlier_fit_on_later": prediction_error(earlier, later),
            "later_fit_on_earlier": prediction_error(later, earlier)}


def run(engine, passes: int = PASSES, scale: float = 1.0, repeats: int = cal.REPEATS, pin_bandwidth: bool = True,
        shape=None, out=None) -> dict:
    """Calibrate ``engine`` ``passes`` times back to back and compare the passes (see the module docstring)."""
    out = out or sys.stdout
    docs = []
    for k in range(passes):
        print(f"pass {k + 1} of {passes}:", file=out, flush=True)
        docs.append(cal.calibrate(engine, shape=shape, scale=scale, out=out, pin_bandwidth=pin_bandwidth,
                                  repeats=repeats))
        print(cal.format_profile(docs[-1]), file=out, flush=True)
    pairs = [dict(earlier=i, later=j, **compare_passes(docs[i], docs[j]))
             for i, j in itertools.combinations(range(passes), 2)]
    return {"passes": [pass_summary(d) for d in docs], "pairs": pairs}


def format_table(result: dict) -> str:
    """Per pass its grid time and fit; per pair the ratios and the cross errors (passes numbered from 1)."""
    lines = [f"{'pass':>4} {'grid s':>8} {'steps':>5} {'fit rms':>8} {'fit max':>8} {'overhead':>9} "
             f"{'GEMM GFLOP/s':>12} {'K/V GB/s':>9} {'span GB/s':>9}"]
    for k, p in enumerate(result["passes"], 1):
        hw = p["hardware"]
        gemm = "-" if hw["peak_flops"] >= 1e29 else f"{hw['peak_flops'] / 1e9:.1f}"
        kv = "-" if hw["attention_bandwidth"] >= 1e29 else f"{hw['attention_bandwidth'] / 1e9:.1f}"
        span = hw.get("attention_span_bandwidth")  # None: the fit gave the longest sequence no term of its own
        span = "-" if span is None else f"{span / 1e9:.1f}"
        lines.append(f"{k:>4} {p['grid_s']:>8.2f} {p['steps']:>5} {100 * p['rms_rel_error']:>7.1f}% "
                     f"{100 * p['max_abs_rel_error']:>7.1f}% {1e3 * hw['step_overhead_s']:>6.2f} ms "
                     f"{gemm:>12} {kv:>9} {span:>9}")
    lines.append(f"{'pair':>5} {'total':>7} {'group min':>9} {'median':>7} {'max':>6} "
                 f"{'fit a on b rms':>14} {'fit b on a rms':>14}")
    for r in result["pairs"]:
        pair = f"{r['earlier'] + 1}->{r['later'] + 1}"
        lines.append(f"{pair:>5} {r['total_ratio']:>6.3f}x {r['group_ratio_min']:>8.3f}x "
                     f"{r['group_ratio_median']:>6.3f}x {r['group_ratio_max']:>5.3f}x "
                     f"{100 * r['earlier_fit_on_later']['rms']:>13.1f}% {100 * r['later_fit_on_earlier']['rms']:>13.1f}%"
                     + ("" if r["same_steps"] else "  (the passes ran different steps)"))
    lines.append("pair a->b: b's time over a's; fit a on b: the earlier pass's fit predicting the later pass's steps")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench calibration_drift",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--passes", type=positive_int, default=PASSES,
                    help=f"calibrate this many times back to back on one loaded model (default {PASSES}; at least 2)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time steps by the serving thread's CPU time, one torch thread (as sim calibrate)")
    ap.add_argument("--repeats", type=positive_int, default=cal.REPEATS,
                    help=f"runs of each group per pass, median per step (default {cal.REPEATS}, as sim calibrate)")
    ap.add_argument("--quick", action="store_true", help="sim calibrate's smaller grid (about a third of the time)")
    ap.add_argument("--fit-bandwidth", action="store_true",
                    help="fit the memory roof too, instead of pinning it to a measured streaming-read bandwidth")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=output_file, default=None, help="write the result JSON here (every step's shape "
                    "and time per pass, the comparisons, the command and the machine)")
    args = ap.parse_args(argv)
    if args.passes < 2:
        ap.error("--passes must be at least 2: one pass has nothing to compare with")
    load_before, ticks_before = (os.getloadavg() if hasattr(os, "getloadavg") else None), cpu_times()
    t_start = time.perf_counter()
    engine = cal.real_engine(device=args.device, clock=args.clock)
    with frozen_heap():  # measured as `minivllm serve` runs it, as sim calibrate does
        result = run(engine, args.passes, 0.4 if args.quick else 1.0, args.repeats, not args.fit_bandwidth,
                     out=sys.stderr)
    print(format_table(result))
    if args.out:
        host = {"loadavg_before": load_before, "loadavg_after": os.getloadavg() if hasattr(os, "getloadavg") else None,
                "steal_share": steal_share(ticks_before, cpu_times())}
        write_result(args.out, {"benchmark": "calibration_drift",
                                "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "clock": args.clock,
                                "repeats": args.repeats, "quick": args.quick, "host": host, **result,
                                "seconds": time.perf_counter() - t_start},
                     "python -m minivllm.bench calibration_drift", argv)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
