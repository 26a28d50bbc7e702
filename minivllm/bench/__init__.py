"""Benchmarks: ``python -m minivllm.bench <name>`` runs one (the list: ``python -m minivllm.bench --help``)."""

# name -> module.  Here rather than in ``__main__`` (which runs a benchmark when imported) so that what reads
# the table -- ``ab``, which copies a benchmark's module between versions, and the documentation tests -- can.
NAMES = {
    "offline": "minivllm.bench.offline",
    "attention": "minivllm.bench.attention",
    "prefix": "minivllm.bench.prefix",
    "prefix_structures": "minivllm.bench.prefix_structures",
    "preemption": "minivllm.bench.preemption",
    "host_overhead": "minivllm.bench.host_overhead",
    "gpu_e2e": "minivllm.bench.gpu_e2e",
    "fairness": "minivllm.bench.fairness",
    "serve": "minivllm.bench.loadgen",
    "sim_accuracy": "minivllm.bench.sim_accuracy",
    "fleet": "minivllm.bench.fleet",
    "linear": "minivllm.bench.linear",
    "eager_step": "minivllm.bench.eager_step",
    "activations": "minivllm.bench.activations",
    "prefill_rate": "minivllm.bench.prefill_rate",
    "replay": "minivllm.bench.replay",
    "ab": "minivllm.bench.ab",
    "lab_times": "minivllm.bench.lab_times",
    "cpu_decode": "minivllm.bench.cpu_decode",
    "calibration_drift": "minivllm.bench.calibration_drift",
}
