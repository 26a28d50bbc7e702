"""Benchmarks: scripts run with ``python -m minivllm.bench.<name>``."""
