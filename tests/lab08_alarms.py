"""Learner-style answers to lab 8's ``first_alarm``, for the tests of its checker.

Why one module: the tests build several answers that are the one-pass loop a learner writes with one thing
changed -- a comparison, a dip that does not reset, a streak opened before the loop, a list read by popping
it.  Written out each time, the copies differ in ways no test means; here the loop is written once and each
test names only what its answer changes.
"""

from __future__ import annotations

import operator
from typing import Callable, Iterable


def one_pass_alarm(scrapes: Iterable, signal: str, threshold: float, for_s: float, *,
                   above: Callable[[float, float], bool] = operator.gt, dip_resets: bool = True,
                   since: float | None = None) -> float | None:
    """The alarm in one pass: ``since`` is when the current streak of scrapes above ``threshold`` began (None:
    no streak); fire at the first scrape that finds the streak ``for_s`` seconds old.  With the defaults this is
    a right answer; ``above`` replaces the comparison, ``dip_resets=False`` lets a streak survive a scrape that
    is not above, and ``since`` opens a streak before the first scrape is read."""
    for s in scrapes:
        if above(getattr(s, signal), threshold):
            since = s.time if since is None else since
            if s.time - since >= for_s:
                return s.time
        elif dip_resets:
            since = None
    return None


def popped(samples: list) -> Iterable:
    """The scrapes of ``samples`` taken off its front one by one: an answer that reads its list this way leaves
    the caller an empty list."""
    while samples:
        yield samples.pop(0)
