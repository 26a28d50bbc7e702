"""Simulation: executors with a virtual clock that run the real scheduler without a model."""

from minivllm.sim.executor import SimulatedExecutor

__all__ = ["SimulatedExecutor"]
