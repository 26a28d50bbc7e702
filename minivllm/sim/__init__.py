"""Simulation: executors with a virtual clock that run the real scheduler without a model."""

from minivllm.sim.executor import SimulatedExecutor
from minivllm.sim.presets import hardware_preset, model_preset
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.roofline import HardwareSpec, ModelShape, RooflineExecutor

__all__ = ["SimulatedExecutor", "RooflineExecutor", "ReplayExecutor", "HardwareSpec", "ModelShape", "hardware_preset",
           "model_preset"]
