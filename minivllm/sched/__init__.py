"""Scheduling: who runs each step (:mod:`~minivllm.sched.scheduler`), the batch it hands the
executor (:mod:`~minivllm.sched.output`) and the admission / preemption policies."""

from minivllm.sched.output import ScheduledBatch, ScheduledSeq
from minivllm.sched.policies import FCFSAdmission, PriorityAdmission, PriorityPreemption, RecomputeLatestPreemption
from minivllm.sched.scheduler import PreemptionCosts, Scheduler

__all__ = [
    "FCFSAdmission",
    "PreemptionCosts",
    "PriorityAdmission",
    "PriorityPreemption",
    "RecomputeLatestPreemption",
    "ScheduledBatch",
    "ScheduledSeq",
    "Scheduler",
]
