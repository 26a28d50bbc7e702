"""The seams of the engine: small protocols a learner's class can stand in for.

Each protocol is the *whole* contract the engine relies on.  Pass your own
object with these methods into :class:`~minivllm.engine.LLMEngine` (or ``LLM``)
and the real serving loop runs with it:

* :class:`AdmissionPolicy` — which waiting request to admit next (FCFS,
  priorities, weighted fair queueing, per-tenant caps...).
* :class:`PreemptionPolicy` — who gives up its KV blocks when they run out.
* :class:`Executor` — what "run the batch" means: the real model runner, or a
  simulated executor with a virtual clock for fast what-if studies.
* ``PrefixCache`` lives in :mod:`minivllm.prefix_cache`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from minivllm.request import Request
    from minivllm.scheduler import ScheduledBatch


@runtime_checkable
class AdmissionPolicy(Protocol):
    def order(self, waiting: Sequence["Request"], running: Sequence["Request"]) -> list["Request"]:
        """Waiting requests in the order to try admitting them.

        A request left out of the list is held back this step (a tenant over
        its cap, say).  Preempted requests sit at the front of ``waiting``.
        """
        ...


@runtime_checkable
class PreemptionPolicy(Protocol):
    def choose_victim(self, running: Sequence["Request"]) -> "Request":
        """The running request that gives up its blocks when the pool is empty.

        ``running`` is in admission order and never empty.
        """
        ...


@runtime_checkable
class Executor(Protocol):
    def execute(self, batch: "ScheduledBatch") -> dict[str, int]:
        """Run one step: write K/V for every scheduled token, return the sampled
        next token for each request whose last scheduled token was its last
        uncomputed one (``request_id -> token id``)."""
        ...

    def now(self) -> float:
        """The executor's clock in seconds (wall clock, or virtual in a simulator)."""
        ...
