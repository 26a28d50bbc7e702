"""Simulation: the real engine with the model replaced by a cost model and a virtual clock.

Executors (``executor``: a linear cost model; ``roofline``: FLOPs and bytes against a hardware
spec; ``replay``: recorded step times), hardware and model presets (``presets``), calibration of
a spec from the real engine on this machine (``calibrate``, ``minivllm sim calibrate``),
simulation runs with the load generator's report (``run``, ``minivllm sim run``), and fleets of
simulated engines behind routers (``fleet``, ``router``).
"""

from minivllm.sim.executor import SimulatedExecutor
from minivllm.sim.presets import hardware_preset, model_preset
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.roofline import HardwareSpec, ModelShape, RooflineExecutor

__all__ = ["SimulatedExecutor", "RooflineExecutor", "ReplayExecutor", "HardwareSpec", "ModelShape", "hardware_preset",
           "model_preset"]
