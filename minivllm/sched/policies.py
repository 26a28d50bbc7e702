"""The default admission and preemption policies: first come, first served.

They implement :class:`~minivllm.interfaces.AdmissionPolicy` and
:class:`~minivllm.interfaces.PreemptionPolicy`.  Fairness policies (caps,
weighted fair queueing, priority classes) are other classes with the same two
methods.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Sequence

from minivllm.request import Request
from minivllm.sched.kept import KeepsItsOrder, KeptOrder


class FCFSAdmission:
    """Admit in queue order: preempted requests (at the front) first, then by arrival.

    The queue as given is the order: the scheduler hands a policy like this one its own copy of the queue
    (it reads and changes the real one while it admits), so a second copy here would only cost a step time.
    """

    def order(self, waiting: Sequence[Request], running: Sequence[Request]) -> Sequence[Request]:
        return waiting


class RecomputeLatestPreemption:
    """Preempt the most recently admitted request (vLLM's FCFS rule).

    The newest request has done the least work, so recomputing it later wastes
    the least, and the oldest requests keep their promise of finishing first.
    """

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


class PriorityAdmission(KeepsItsOrder):
    """Lower ``priority`` value first, ties by arrival (vLLM's priority policy).

    A waiting request may preempt a running one of strictly lower priority
    (larger value) to get a seat or blocks, as vLLM does when ``max_num_seqs``
    is the limit (vLLM #40004); see the optional hooks in :mod:`minivllm.interfaces`.

    The scheduler's queue is kept in this order as it changes (:class:`~minivllm.interfaces.KeepsOrder`)
    rather than sorted every step: beside 2,000 waiting requests the sort was half of a step's host time.
    """

    def __init__(self) -> None:
        self._kept = KeptOrder(self.rank)

    def order(self, waiting: Sequence[Request], running: Sequence[Request]) -> list[Request]:
        kept = self._kept.kept(waiting)
        return list(kept.get(0, ())) if kept is not None else sorted(waiting, key=self.rank)

    #: ``rank(req) == (req.priority, req.arrival_time)``.  An ``attrgetter`` rather than a function: a C key is
    #: several times cheaper per request, for a sort and for the kept order's inserts alike.
    rank = staticmethod(attrgetter("priority", "arrival_time"))

    @staticmethod
    def may_preempt_for(req: Request, victim: Request) -> bool:
        return victim.priority > req.priority


class PriorityPreemption:
    """Preempt the lowest-priority request (largest value), newest among ties."""

    def choose_victim(self, running: Sequence[Request]) -> Request:
        return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))
