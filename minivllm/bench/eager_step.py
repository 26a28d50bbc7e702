"""``python -m minivllm.bench eager_step`` — where a step that carries prompt tokens spends its time.

With CUDA graphs a decode step is one replay, but a step that carries prompt
tokens runs eagerly: every operator of every layer is launched from Python.
The simulator's GPU calibration fits that as a fixed cost (about 10 ms a step
for a Llama-3.2-1B shape on an H200, whatever the prompt's length), and the
held-out runs showed such steps varying 11-31 ms with *identical* shapes --
the noise that sinks the simulator's TTFT predictions there.  This benchmark
takes that cost apart on any device:

1. the time of one prompt step of a fixed shape, ``--repeats`` times back to
   back, then each after an idle gap (``--gap``), then back to back again with
   the garbage collector's long-lived objects frozen (``gc.freeze``, as
   ``minivllm serve`` and vLLM do after start-up) -- is the spread there
   without idling, and is it the collector?  And what one full collection
   costs with the heap as it is and frozen;
2. a decode step of the same engine, for scale, and (on a GPU) the same step
   with CUDA graphs off (``enforce_eager``): what one graph replay saves;
3. ``torch.profiler`` over a few prompt steps: how many kernels a step
   launches and which host-side operators take the CPU time; and the tensor
   operations the model dispatches in one prompt step, counted the same way
   on every device (a CPU run predicts the GPU's launch count, Triton's aside);
4. the same for one sequence's decode steps, plus ``cProfile``'s Python
   functions: where the host side of a (graphed) decode step goes.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable

from minivllm.argtypes import nonnegative_float, output_file, positive_int
from minivllm.bench.results import write_result
from minivllm.engine.startup import frozen_heap
from minivllm.metrics.stats import interpolated

IDLE_GAP_S = 0.5
"""``--gap``'s default: seconds the engine sits idle before each step of the idle series.

Why 0.5 s: the question is whether a prompt step that follows a pause is slower than one that follows
another step, and the pauses that matter are the ones between arrivals in ``bench sim_accuracy``'s held-out
workloads, where the prompt steps varied (1.5, 1 and 0.4 requests/s: 0.67, 1 and 2.5 s apart on average).
Half a second is a pause of that order at its short end, and keeps the idle series' sleeping to about 5 s
at the default ``--repeats``.  (The H200 runs of 2026-11-30 used ``--gap 1``.)
"""

IDLE_SERIES_SHARE = 3
"""The idle series times ``--repeats`` // this many steps (a third: 10 at the default 30), not ``--repeats``.

Why fewer: each of its steps costs ``--gap`` seconds of sleep on top of the step, so a full-length series
would multiply the run's time by the idle it waits; a third still gives it a median and a p90 next to the
back-to-back series' (see :data:`IDLE_SERIES_MIN` for small ``--repeats``).
"""

IDLE_SERIES_MIN = 3
"""The idle series' fewest steps, whatever ``--repeats``.

Why: ``--repeats 2`` // :data:`IDLE_SERIES_SHARE` is 0, and an empty series has no statistics (``_stats``
fails on it); three is the fewest whose median is a step that was timed (of two it is their mean).
"""


def idle_series_length(repeats: int) -> int:
    """Steps in the idle series for a ``--repeats`` of ``repeats`` (the two constants above)."""
    return max(IDLE_SERIES_MIN, repeats // IDLE_SERIES_SHARE)


def _stats(xs: list[float]) -> dict:
    s = sorted(xs)
    return {"n": len(s), "min_ms": 1e3 * s[0], "p50_ms": 1e3 * interpolated(s, 50),
            "p90_ms": 1e3 * interpolated(s, 90), "max_ms": 1e3 * s[-1],
            "mean_ms": 1e3 * statistics.fmean(s)}


def full_collection_pause(repeats: int = 5) -> dict:
    """What one full garbage collection costs in this process, with the heap as it is and then frozen
    (:mod:`minivllm.engine.startup`: why ``minivllm serve`` freezes it)."""
    def pauses() -> list[float]:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - t)
        return times

    tracked = len(gc.get_objects())
    unfrozen = _stats(pauses())
    with frozen_heap() as frozen:
        return {"tracked_objects": tracked, "unfrozen": unfrozen, "frozen": _stats(pauses()), "frozen_objects": frozen}


def prompt_step_times(engine, prompt_len: int, repeats: int, vocab: int, gap_s: float = 0.0) -> list[float]:
    """Time of the one step that prefills a fresh ``prompt_len``-token prompt, ``repeats`` times.

    The ids are seeded by the number of steps the engine has recorded, so each call draws prompts no earlier
    call drew: a fixed seed gave every series the warm-up's prompts again, and with prefix caching on the
    series' first step found 48 of its 64 tokens cached and was refused below as a budget too small.
    """
    import numpy as np

    from minivllm.sim.calibrate import measure
    from minivllm.sim.run import SimRequest

    rng = np.random.default_rng(len(engine.executor.batches))
    times = []
    for i in range(repeats):
        if gap_s:
            time.sleep(gap_s)
        ids = [int(x) for x in rng.integers(10, vocab - 1, prompt_len)]  # fresh ids: no prefix-cache hit
        samples, _ = measure(engine, [SimRequest(i, 0.0, "p", ids, 1)])
        if [new for _, new, *_ in samples[0].seqs] != [prompt_len]:  # a chunk is not the step this times
            raise RuntimeError(f"the first step carried {samples[0].seqs}, not the whole {prompt_len}-token prompt: "
                               "the engine's step budget is smaller than the prompt")
        times.append(samples[0].time_s)
    return times


def run(model: str | None, device: str, dtype: str, prompt_len: int, repeats: int, gap_s: float,
        profile_steps: int, eager_decode: bool | None = None, checkpoint=None) -> dict:
    """The measurements of the module docstring; ``eager_decode`` (default: on a GPU only) adds the decode step
    of a second engine with CUDA graphs off, and that step's tensor operations.

    ``checkpoint(doc)``, if given, is called with the result so far after each finished measurement, with
    ``unfinished`` naming the keys still to come (the returned result has no such key).  Why: on a lent GPU
    ``tools/gpu_checks.sh`` time-boxes this step, and a run ended by the box used to leave no file at all,
    losing the measurements it had already made.
    """
    import torch

    from minivllm.sim.calibrate import real_engine

    # The step budget holds the whole prompt: at ``real_engine``'s 512 a longer prompt was prefilled in chunks,
    # and what was timed (and its operations counted) as the prompt step was its first chunk.
    engine = real_engine(model=model, device=device, dtype=dtype, max_num_batched_tokens=max(512, prompt_len))
    if model is None:
        from minivllm.sim.presets import bundled_shape

        vocab = bundled_shape().vocab_size
    else:
        with open(f"{model}/config.json", encoding="utf-8") as fh:
            vocab = json.load(fh)["vocab_size"]
    prompt_step_times(engine, prompt_len, 3, vocab)  # warm-up: kernels, allocator
    out = {"benchmark": "eager_step", "device": str(engine.config.device), "dtype": str(engine.config.dtype),
           "prompt_len": prompt_len, "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if torch.cuda.is_available() and engine.config.device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    if eager_decode is None:
        eager_decode = out["device"].startswith("cuda")
    idle = f"after_{gap_s:g}s_idle"
    parts = ["back_to_back", idle, "full_collection", "back_to_back_gc_frozen", "decode_step",
             *(["decode_step_eager"] if eager_decode else []), "profile", "decode_profile"]

    def finished() -> None:
        if checkpoint:
            checkpoint(dict(out, unfinished=[k for k in parts if k not in out]))

    out["back_to_back"] = _stats(prompt_step_times(engine, prompt_len, repeats, vocab))
    finished()
    out[idle] = _stats(prompt_step_times(engine, prompt_len, idle_series_length(repeats), vocab, gap_s))
    finished()
    out["full_collection"] = full_collection_pause()
    finished()
    with frozen_heap():
        out["back_to_back_gc_frozen"] = _stats(prompt_step_times(engine, prompt_len, repeats, vocab))
    finished()
    out["decode_step"] = decode_step_stats(engine, vocab)
    finished()
    if eager_decode:  # the same decode step launched kernel by kernel: what the graph saves
        eager = real_engine(model=model, device=device, dtype=dtype, enforce_eager=True)
        decode_step_stats(eager, vocab)  # warm-up
        eager_stats = decode_step_stats(eager, vocab)
        eager_stats["tensor_ops"] = forward_ops(eager, lambda: decode_step_stats(eager, vocab, 2))[-1].n
        out["decode_step_eager"] = eager_stats  # whole or absent: a checkpoint never holds half of it
        del eager
        finished()

    acts = [torch.profiler.ProfilerActivity.CPU]
    if out["device"].startswith("cuda"):
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        prompt_step_times(engine, prompt_len, profile_steps, vocab)
    profile = _ops(prof, profile_steps)
    profile["tensor_ops_per_step"] = tensor_ops(engine, prompt_len, vocab)
    out["profile"] = profile
    finished()
    out["decode_profile"], out["decode_python"] = _profile_decode(engine, acts, vocab)
    return out


class OpCounter:
    """Counts the tensor operations dispatched while it is active, views left out.

    Why count operations: on a GPU each one is about one kernel launch, and an
    eager step's cost is mostly the host launching them; the count is the same on
    every device, so a CPU predicts the GPU's launch count (Triton kernels aside).
    A ``TorchDispatchMode`` sees every operation below autograd, including the ones
    a composite operator decomposes into.  Use as ``with OpCounter() as c: ...; c.n``;
    ``c.names`` counts them by operator (``aten.mm``, ``aten.mul``, ...).
    """

    def __init__(self) -> None:
        from collections import Counter

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if not func.is_view:
                    counter.names[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

        self.names: Counter = Counter()
        self._mode = _Mode()

    @property
    def n(self) -> int:
        return sum(self.names.values())

    def __enter__(self) -> "OpCounter":
        self.names.clear()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def per_forward(engine, run: Callable[[], object], make_meter: Callable[[], object]) -> list:
    """Run ``run()`` with every model forward of ``engine`` inside its own ``make_meter()`` context.

    Returns ``[(tokens, meter)]``, one per forward in call order (``tokens``: the
    rows of that forward's ``input_ids``).  Any context manager fits: an
    :class:`OpCounter` counts operations per forward, an
    :class:`~minivllm.bench.activations.ActivationMeter` the peak bytes alive.
    """
    model = engine.model_runner.model
    forward = model.forward
    got = []

    def metered(input_ids, *args, **kwargs):
        with make_meter() as meter:
            result = forward(input_ids, *args, **kwargs)
        got.append((int(input_ids.shape[0]), meter))
        return result

    model.forward = metered
    try:
        run()
    finally:
        del model.forward
    return got


def forward_ops(engine, run) -> list[OpCounter]:
    """The tensor operations of each model forward that ``run()`` makes the engine do (one per step)."""
    return [counter for _, counter in per_forward(engine, run, OpCounter)]


def decode_step_stats(engine, vocab: int, max_tokens: int = 17) -> dict:
    """Step-time statistics of one sequence's decode steps (its prompt step left out)."""
    import numpy as np

    from minivllm.sim.calibrate import measure
    from minivllm.sim.run import SimRequest

    ids = [int(x) for x in np.random.default_rng(1).integers(10, vocab - 1, 32)]
    samples, _ = measure(engine, [SimRequest(0, 0.0, "d", ids, max_tokens)])
    return _stats([s.time_s for s in samples[1:]])


def tensor_ops(engine, prompt_len: int, vocab: int) -> int:
    """Tensor operations (views left out) the model dispatches in one prompt step, on any device.

    On a GPU each is about one kernel launch (the Triton kernels come on top),
    so this counts what an eager step costs the host where no profiler sees
    launches -- on a CPU, too, and the same number on both.
    """
    return forward_ops(engine, lambda: prompt_step_times(engine, prompt_len, 1, vocab))[0].n


def _ops(prof, steps: int) -> dict:
    """Kernel launches and the operators with the most host (CPU) self time, per step."""
    events = prof.key_averages()
    launches = sum(e.count for e in events if "LaunchKernel" in e.key or e.key == "cudaGraphLaunch")
    return {"steps": steps, "kernel_launches_per_step": launches / steps,
            "top_cpu_self": [{"op": e.key, "calls_per_step": e.count / steps,
                              "self_cpu_us_per_step": e.self_cpu_time_total / steps}
                             for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:25]]}


def _profile_decode(engine, acts, vocab: int, steps: int = 16) -> tuple[dict, list]:
    """One sequence's decode steps (a CUDA-graph replay each on a GPU): torch operators, and the Python
    functions with the most time of their own (``cProfile``) -- the host side the kernels' time does not
    explain (on the H200 a graphed decode step of a 1B model took 2.5 ms; reading its weights takes ~0.6)."""
    import cProfile
    import pstats

    import numpy as np
    import torch

    from minivllm.sampling_params import SamplingParams

    ids = [int(x) for x in np.random.default_rng(2).integers(10, vocab - 1, 32)]
    engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=2 * steps + 4, ignore_eos=True, temperature=0),
                       request_id="eager-step-decode")
    engine.step()  # the prompt
    engine.step()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
    py = cProfile.Profile()
    py.enable()
    for _ in range(steps):
        engine.step()
    py.disable()
    while engine.has_unfinished_requests():
        engine.step()
    stats = pstats.Stats(py).stats  # {(file, line, name): (calls, prim, tottime, cumtime, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]
    python = [{"function": f"{name} ({file.rsplit('/', 1)[-1]}:{line})", "calls_per_step": v[0] / steps,
               "self_us_per_step": 1e6 * v[2] / steps} for (file, line, name), v in top]
    return _ops(prof, steps), python


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench eager_step", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="an HF model directory (default: the bundled model)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompt-len", type=positive_int, default=64)
    ap.add_argument("--repeats", type=positive_int, default=30,
                    help="prompt steps in each back-to-back series (default 30); the idle series times "
                         "1/3 as many, at least 3")
    ap.add_argument("--gap", type=nonnegative_float, default=IDLE_GAP_S,
                    help="idle seconds before each step of the idle series (default 0.5)")
    ap.add_argument("--profile-steps", type=positive_int, default=3)
    ap.add_argument("--json", type=output_file, default=None)
    a = ap.parse_args(argv)

    def save(doc: dict) -> None:
        """The result so far, on disk (atomically, as every write is): a time box that ends the run keeps it."""
        write_result(a.json, doc, "python -m minivllm.bench eager_step", argv)

    res = run(a.model, a.device, a.dtype, a.prompt_len, a.repeats, a.gap, a.profile_steps,
              checkpoint=save if a.json else None)
    for k, v in res.items():
        if isinstance(v, dict) and "p50_ms" in v:
            print(f"{k:<24} n={v['n']:3d}  min {v['min_ms']:7.2f}  p50 {v['p50_ms']:7.2f}  p90 {v['p90_ms']:7.2f}  "
                  f"max {v['max_ms']:7.2f} ms")
    p = res["profile"]
    print(f"kernel launches per prompt step: {p['kernel_launches_per_step']:.0f} "
          f"(tensor operations dispatched: {p['tensor_ops_per_step']})")
    for e in p["top_cpu_self"][:15]:
        print(f"  {e['op'][:48]:<48} {e['calls_per_step']:7.1f} calls {e['self_cpu_us_per_step']:9.0f} us/step")
    d = res["decode_profile"]
    print(f"decode step of one sequence: {d['kernel_launches_per_step']:.0f} launches; "
          f"host time by Python function (cProfile, us per step):")
    for e in res["decode_python"][:10]:
        print(f"  {e['function'][:60]:<60} {e['calls_per_step']:6.1f} calls {e['self_us_per_step']:8.0f} us")
    if a.json:
        save(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
