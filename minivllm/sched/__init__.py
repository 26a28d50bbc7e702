"""Scheduling: who runs each step (:mod:`~minivllm.sched.scheduler`), the batch it hands the
executor (:mod:`~minivllm.sched.output`), the admission / preemption policies and the fairness
policies (:mod:`~minivllm.sched.fairness`)."""

from minivllm.sched.fairness import (
    CapTable,
    DeadlineAdmission,
    LongContextSwap,
    RankPreemption,
    ThreeClassAdmission,
    WFQAdmission,
    make_policies,
)
from minivllm.sched.output import ScheduledBatch, ScheduledSeq
from minivllm.sched.policies import FCFSAdmission, PriorityAdmission, PriorityPreemption, RecomputeLatestPreemption
from minivllm.sched.scheduler import PreemptionCosts, Scheduler

__all__ = [
    "CapTable",
    "DeadlineAdmission",
    "FCFSAdmission",
    "LongContextSwap",
    "RankPreemption",
    "ThreeClassAdmission",
    "WFQAdmission",
    "make_policies",
    "PreemptionCosts",
    "PriorityAdmission",
    "PriorityPreemption",
    "RecomputeLatestPreemption",
    "ScheduledBatch",
    "ScheduledSeq",
    "Scheduler",
]
