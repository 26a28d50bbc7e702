"""Do the garbage collector's pauses land in the real engine's slow prompt steps?  (A one-off GPU probe.)

Runs two of sim_accuracy's three held-out workloads (decode_heavy and bursty_mixed; not long_prompt_chunked)
at scale 0.5 on the real engine (measure(): one sample per step), twice, with a gc.callbacks hook that
records every collection's start, duration and generation; then twice again after gc.collect();
gc.freeze().  Prints, per series, the prompt steps' times, the number of collections by
generation and the pause statistics (whether a pause fell inside a slow step is read by comparing the
two lists; the script does not match them).  Usage: python tools/gc_probe.py MODEL_DIR DEVICE DTYPE OUT.json
"""
import gc
import json
import statistics
import sys
import time

from minivllm.bench.sim_accuracy import ENGINE, workload_requests
from minivllm.sim.calibrate import measure, real_engine

model, device, dtype, out = sys.argv[1:5]
pauses = []
_t = {}


def hook(phase, info):
    if phase == "start":
        _t["s"] = time.perf_counter()
    else:
        pauses.append((_t["s"], time.perf_counter() - _t["s"], info["generation"]))


eng = real_engine(model=model, device=device, dtype=dtype, **ENGINE)
with open(f"{model}/config.json") as fh:
    vocab = json.load(fh)["vocab_size"]
res = {"python": sys.version, "gc_threshold": gc.get_threshold(), "tracked_objects": len(gc.get_objects())}
warm = workload_requests("bursty_mixed", None, 0.3, vocab_size=vocab)
measure(eng, warm)
gc.callbacks.append(hook)
for label in ("normal", "normal2", "frozen", "frozen2"):
    if label == "frozen":
        gc.collect()
        gc.freeze()
    for name in ("decode_heavy", "bursty_mixed"):
        reqs = workload_requests(name, None, 0.5, vocab_size=vocab)
        del pauses[:]
        samples, rec = measure(eng, reqs)
        prompt = [s for s in samples if any(n > 1 for _, n, _ in s.seqs)]
        times = sorted(1e3 * s.time_s for s in prompt)
        p = [d for _, d, _ in pauses]
        row = {"prompt_steps_ms": [round(x, 2) for x in times],
               "prompt_p50_ms": statistics.median(times), "prompt_max_ms": max(times),
               "gc_collections": {g: sum(1 for *_, gg in pauses if gg == g) for g in (0, 1, 2)},
               "gc_pause_total_ms": 1e3 * sum(p), "gc_pause_max_ms": 1e3 * max(p) if p else 0.0,
               "gc_pauses_over_1ms": sorted(round(1e3 * d, 2) for d in p if d > 1e-3)}
        res[f"{label}/{name}"] = row
        print(label, name, {k: v for k, v in row.items() if k != "prompt_steps_ms"}, flush=True)
        print("   prompt steps ms:", row["prompt_steps_ms"], flush=True)
with open(out, "w") as fh:
    json.dump(res, fh, indent=1)
print(res["python"], res["gc_threshold"], res["tracked_objects"])
