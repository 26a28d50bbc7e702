"""Load shedding at the door: turn a request away *before* it joins the queue.

Why a door, when the engine already has reject mode?  Reject mode decides at
admission, after a request has waited in the queue; under a burst the queue
itself becomes the latency (every request in it will miss its TTFT target),
and a client that is told "429, retry in 1 s" at once can go to another
replica.  The rule is the one lab 5 asks the learner to write: refuse when the
waiting queue is already ``max_waiting`` sequences deep (a request for ``n``
choices is ``n``: the engine queues each sample), or when requests are waiting
*and* the KV pool is nearly dry (fewer than ``min_free_blocks`` available), since
then new work can only start by preempting running work.  "Available" counts
the free list plus cached blocks no request holds (``available_blocks``, the
same number in ``engine.stats()`` and in the server's snapshot): the allocator
evicts those on demand, so a warm prefix cache is not memory pressure.

The server reads the two numbers without taking the engine's lock (a
``len()`` and an integer: a step may be in progress, so the snapshot can be one
step old, which is as fresh as a load-shedding decision needs).
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.argtypes import is_int


@dataclass(frozen=True)
class DoorRule:
    """``closed(stats)`` is True when a new request should get 429 instead of a place in the queue."""

    max_waiting: int
    min_free_blocks: int = 0
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if not is_int(self.max_waiting) or self.max_waiting < 1:
            raise ValueError(f"max_waiting must be an int >= 1, got {self.max_waiting!r}")
        if not is_int(self.min_free_blocks) or self.min_free_blocks < 0:
            raise ValueError(f"min_free_blocks must be an int >= 0, got {self.min_free_blocks!r}")
        if not self.retry_after_s > 0:
            raise ValueError(f"retry_after_s must be > 0, got {self.retry_after_s!r}")

    def closed(self, stats: dict) -> bool:
        """``stats`` needs ``num_waiting`` and ``available_blocks`` (``engine.stats()`` has both)."""
        waiting = stats["num_waiting"]
        return waiting >= self.max_waiting or (waiting > 0 and stats["available_blocks"] < self.min_free_blocks)


def door_snapshot(engine, num_waiting: int | None = None) -> dict:
    """The two numbers :meth:`DoorRule.closed` reads, taken without the engine lock.

    ``num_waiting`` is the queue as the caller counts it; None: the scheduler's queue.  A server passes its
    :meth:`~minivllm.server.async_engine.AsyncEngine.waiting_or_posted`, which adds the requests that passed
    the door but have not reached the scheduler's queue yet (the engine thread adds them between steps):
    without them a burst of simultaneous requests would all see the queue as it was before the burst and all
    get in.  ``available_blocks`` is ``engine.stats()``'s: the free list plus cached blocks nobody is using,
    which the engine evicts on demand.
    """
    try:
        available = engine.kv.num_available_blocks
    except RuntimeError:  # a cache structure resized by the engine thread mid-count: use the lower bound
        available = engine.pool.num_free
    if num_waiting is None:
        num_waiting = len(engine.scheduler.waiting)
    return {"num_waiting": num_waiting, "available_blocks": available}
