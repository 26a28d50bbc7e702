"""A waiting queue kept in a policy's order as requests enter and leave it, instead of sorted every step.

The scheduler tells a :class:`~minivllm.interfaces.KeepsOrder` policy of every change to its waiting queue;
:class:`KeptOrder` is what such a policy keeps, and :class:`KeepsItsOrder` passes the hooks on to it.  Used by
the priority policy (:mod:`minivllm.sched.policies`) and by WFQ, deadline and three_class
(:mod:`minivllm.sched.fairness`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from minivllm.request import Request


def one_bucket(req: Request) -> int:
    """:class:`KeptOrder`'s default: every request in one bucket (a named function, so a policy still pickles)."""
    return 0


def no_rank(req: Request) -> int:
    """A rank that ties every request: a :class:`KeptOrder` by it keeps the queue's own order."""
    return 0


class KeptOrder:
    """The scheduler's waiting queue sorted by a rank fixed while a request waits, kept up to date as requests enter
    and leave it: what a :class:`~minivllm.interfaces.KeepsOrder` policy holds instead of re-sorting every step.

    Requests are kept in ``buckets`` (a policy's classes, or its tenants; one by default), each sorted by ``rank``
    and each present only while it holds a request.  Ties keep the queue's own order, as a stable sort of the
    queue would.  That order needs no positions: the queue grows only at its ends (new requests at the back,
    preempted ones at the front) and never reorders what stays in it, so the n-th request to enter breaks ties
    by ``+n`` if it entered at the back and by ``-n`` at the front.
    """

    def __init__(self, rank: Callable[[Request], Any], bucket: Callable[[Request], Hashable] | None = None) -> None:
        self.rank = rank
        self.bucket = bucket or one_bucket
        self.buckets: dict[Hashable, list[Request]] = {}
        self._key: dict[Request, tuple] = {}  # (rank, tie-break) of each kept request
        self._entries = 0
        self.queue: Sequence[Request] | None = None  # the queue tracked

    def track(self, queue: Sequence[Request]) -> None:
        """Remember which queue the buckets mirror: :meth:`kept` answers only for that very object, so any other
        sequence (a lab's list, a second scheduler's queue) is sorted instead of read from buckets it never fed."""
        self.queue = queue

    def add(self, req: Request, at_front: bool) -> None:
        self._entries += 1
        self._key[req] = (self.rank(req), -self._entries if at_front else self._entries)
        b = self.bucket(req)
        bucket = self.buckets.get(b)
        if bucket is None:
            bucket = self.buckets[b] = []
        bisect.insort(bucket, req, key=self._key.__getitem__)

    def remove(self, req: Request) -> None:
        b = self.bucket(req)
        bucket = self.buckets[b]
        del bucket[bisect.bisect_left(bucket, self._key[req], key=self._key.__getitem__)]
        del self._key[req]
        if not bucket:  # a server that saw many tenants keeps no empty buckets
            del self.buckets[b]

    def key(self, req: Request) -> tuple:
        """``req``'s place in the sorted queue; with a rank that ties all, its place in the queue itself."""
        return self._key[req]

    @property
    def entries(self) -> int:
        """How many requests have entered so far: a request kept now entered as number ``<= entries`` (a
        re-entry counts anew), which is how a reader of the buckets tells what was there at some moment."""
        return self._entries

    def entered_by(self, req: Request, entries: int) -> bool:
        """Did ``req`` (kept now) enter at or before the moment :attr:`entries` read ``entries``?"""
        return abs(self._key[req][1]) <= entries

    def first_after(self, bucket: Hashable, key: tuple | None, entries: int) -> Request | None:
        """The first request of ``bucket`` past ``key`` (from the start when None) among those that entered by
        ``entries``, or None: a walk of the live bucket in its sorted order that skips the requests which entered
        since, without a copy of the bucket.  O(log n) to find the place, plus one look at each request past it
        that entered since (within a WFQ admission pass: the victims it preempted, a handful)."""
        requests = self.buckets.get(bucket)
        if not requests:
            return None
        keys = self._key
        i = 0 if key is None else bisect.bisect_right(requests, key, key=keys.__getitem__)
        for i in range(i, len(requests)):
            if abs(keys[requests[i]][1]) <= entries:
                return requests[i]
        return None

    def kept(self, waiting: Sequence[Request]) -> dict[Hashable, list[Request]] | None:
        """The buckets, if ``waiting`` is the tracked queue and they hold exactly it; else None (sort it).

        The count is the guard: a policy object shared by two schedulers hears both queues' changes, and holds
        as many requests as one of them only while the other's is empty -- when what it holds *is* that queue.
        """
        return self.buckets if waiting is self.queue and len(waiting) == len(self._key) else None


class KeepsItsOrder:
    """Base of a policy that keeps its order in ``self._kept`` (a :class:`KeptOrder`): the
    :class:`~minivllm.interfaces.KeepsOrder` hooks the scheduler calls, passed on to it."""

    _kept: KeptOrder

    def track(self, waiting: Sequence[Request]) -> None:
        self._kept.track(waiting)

    def enqueued(self, req: Request, at_front: bool) -> None:
        self._kept.add(req, at_front)

    def dequeued(self, req: Request) -> None:
        self._kept.remove(req)
