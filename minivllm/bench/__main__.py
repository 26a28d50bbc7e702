"""``python -m minivllm.bench <name> [options]`` — run one of the project's benchmarks.

Names: ``offline`` (engine vs HF transformers throughput), ``attention`` (Triton
kernels, GPU), ``prefix`` (prefix caching end to end), ``prefix_structures``
(radix tree vs hash index cost), ``preemption`` (recompute / swap / reject / auto
on one overloaded workload), ``serve`` (load generator for any OpenAI-compatible
server: ``--base-url URL``; also ``minivllm bench serve``), ``host_overhead`` (engine cost per decode
step without a model), ``fleet`` (replicas x router policy on a simulated fleet: capacity and prefix affinity), ``sim_accuracy`` (the calibrated
simulator vs the real engine on held-out workloads), ``linear`` (the model's projections: default BLAS vs oneDNN),
``eager_step`` (where a step that carries prompt tokens spends its time: spread, idle, GC, profile),
``activations`` (peak activation memory of one forward against the token budget), ``gpu_e2e`` (the engine
end to end on a CUDA GPU: Triton vs torch backend, CUDA graphs, nano-vllm's workload vs HF ``generate``),
``fairness`` (noisy vs quiet tenant per scheduling policy, Jain's index, three classes; simulated),
``prefill_rate`` (auto preemption's learnt prefill rate on a busy stream against a plain prefill),
``replay`` (the simulator replaying real runs' step times over a grid of policies: identical decisions?),
``ab`` (any of these on two git versions in one session, runs interleaved: ``ab --base REV -- NAME ... --out {out}``),
``lab_times`` (each lab notebook run top to bottom in a fresh kernel: the README's CPU-time column), ``cpu_decode``
(the CPU decode-attention kernel alone, by batch and context), ``calibration_drift`` (the calibration grid
measured and fitted twice back to back: how far the host repeats itself, the floor under ``sim_accuracy``).
"""

import importlib
import sys

from minivllm.bench import NAMES


def main() -> int:
    if len(sys.argv) >= 2 and sys.argv[1] in ("-h", "--help"):  # asked for: the list, and success
        print(__doc__)
        return 0
    if len(sys.argv) < 2 or sys.argv[1] not in NAMES:
        print(__doc__)
        what = f"unknown benchmark {sys.argv[1]!r}" if len(sys.argv) >= 2 else "name a benchmark"
        print(f"python -m minivllm.bench: error: {what}; choose from {', '.join(NAMES)}", file=sys.stderr)
        return 2
    name = sys.argv[1]
    module = importlib.import_module(NAMES[name])
    sys.argv = [f"minivllm.bench {name}"] + sys.argv[2:]
    try:
        return module.main() or 0
    except (ValueError, OSError) as exc:  # a bad model, device, dtype or path: one line, not a traceback
        print(f"python -m minivllm.bench {name}: error: {exc}", file=sys.stderr)
        return 2


sys.exit(main())
