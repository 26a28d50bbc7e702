"""How hard the property tests search: one knob for all of them.

Why: each hypothesis test here draws a fixed number of random programs (arrivals, aborts, cache operations,
request bodies), sized so that ``make test`` stays within CI's budget.  Some states are rare -- the WFQ
kept-order test's "preempted back to the queue before the next order" is reached by about 1 run in 180 --
so a CI-sized search finds them only by chance.  ``FUZZ_SCALE=20 make fuzz`` runs the same properties
twenty times as hard, which is how a developer looks for such states on purpose before a release.
"""

from __future__ import annotations

import os

SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
if not SCALE > 0:
    raise ValueError(f"FUZZ_SCALE must be a number > 0, got {os.environ.get('FUZZ_SCALE')!r}")


def examples(n: int) -> int:
    """``n`` examples (the CI size), times ``FUZZ_SCALE``; at least one."""
    return max(1, round(n * SCALE))
