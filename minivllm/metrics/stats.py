"""Summary statistics the engine, the benchmarks and the labs share: percentiles, an SLO check, Jain's index.

Why one module: a percentile has more than one definition, and two numbers printed side by side must not
disagree because two files picked different ones.  Both definitions in use are here, named for what they do:

* :func:`nearest_rank` -- the smallest sample with at least ``q`` % of the samples at or below it.  Always one
  of the samples; the rule the labs teach (lab 1) and the engine's per-tenant stats and the fairness
  benchmark report.  With few samples its p99 is the maximum, which is the honest answer.
* :func:`interpolated` -- linear interpolation between order statistics (numpy's default), what vLLM's serving
  benchmark reports; the load generator and the simulator's reports use it so that their tables compare with
  vLLM's.

An empty sample has no percentile; ``empty`` says what the caller shows instead (NaN for "no data" in a table,
None in a JSON, 0.0 where a lab's plot needs a number).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Iterable

_NAN = float("nan")


def nearest_rank(values: Iterable[float], q: float, empty: Any = _NAN) -> Any:
    """The ``q``-th percentile by nearest rank: ``sorted(values)[ceil(q / 100 * n) - 1]``, clamped to the samples.

    The rank is computed on ``q`` as written (decimal), not on its binary float: ``q / 100 * n`` in floats makes
    the 7th percentile of 100 samples the 8th (7 / 100 * 100 = 7.000000000000001) and p99.9 of 1,000 the maximum.
    """
    ordered = sorted(values)
    if not ordered:
        return empty
    rank = math.ceil(Fraction(str(q)) * len(ordered) / 100)
    return ordered[min(len(ordered), max(1, rank)) - 1]


def interpolated(values: Iterable[float], q: float, empty: Any = _NAN) -> Any:
    """The ``q``-th percentile by linear interpolation between order statistics (numpy's default method)."""
    ordered = sorted(float(x) for x in values)
    if not ordered:
        return empty
    k = (len(ordered) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def meets_slo(ttft: float | None, itl: float | None, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """Did one served request keep its latency promise?  ``itl`` is the request's own inter-token figure (its
    p95 or p99 gap, by the caller's rule) or None when it streamed fewer than two chunks; bounds in seconds,
    None for no bound.

    A bound is met *at* the bound (``<=``, as an SLO "within 500 ms" reads), and a request with no gaps has no
    gap to miss.  A request that never produced a first token (``ttft`` None) misses any TTFT bound.
    """
    if slo_ttft is not None and (ttft is None or ttft > slo_ttft):
        return False
    return slo_itl is None or itl is None or itl <= slo_itl


def jain(xs: Iterable[float]) -> float:
    """Jain's fairness index ``(sum x)^2 / (n sum x^2)``: 1 when all get the same, 1/n when one gets everything
    (NaN when nobody got anything: no split to judge)."""
    xs = list(xs)
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if xs and any(xs) else _NAN
