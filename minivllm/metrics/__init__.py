"""What the engine records about itself: typed per-step records (the step log) that loggers,
widgets and labs read."""

from minivllm.metrics.step_log import StepLog, StepRecord

__all__ = ["StepLog", "StepRecord", "EngineMetrics"]


def __getattr__(name):  # prometheus-client is imported only when the metrics are used
    if name == "EngineMetrics":
        from minivllm.metrics.prometheus import EngineMetrics

        return EngineMetrics
    raise AttributeError(name)
