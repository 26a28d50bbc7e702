"""Lab 4's ``pick_budget`` against an answer that caches ``measure(b)`` in a module-level dict.

The checker asks for "at most one measure(b) per budget", and a learner may meet it with a global cache; every
visible sweep agreed with the first one on which budgets qualify, so the stale cache passed the notebook's checker
and lost its points only in the grader's hidden cases.  Oracle: the rule itself, on two sweeps of the same budgets
(the second with every p99 doubled), checked against :func:`check_lab04.engine_pick_budget`."""

from __future__ import annotations

from minivllm.labs import check_lab04
from tests.checker_verdicts import accepts, refuses

_MEASURED: dict = {}


def _pick_with_global_cache(measure, budgets, itl_target_s):
    for b in budgets:
        if b not in _MEASURED:
            _MEASURED[b] = measure(b)
    meets = [b for b in budgets if _MEASURED[b]["itl_p99"] <= itl_target_s]
    return max(meets) if meets else None


def test_a_pick_budget_that_caches_measurements_across_calls_fails():
    fast = {128: (0.010, 0.011), 256: (0.020, 0.030), 512: (0.030, 0.045), 1024: (0.040, 0.060)}
    slow = {b: (2 * p, 2 * w) for b, (p, w) in fast.items()}
    _MEASURED.clear()
    assert _pick_with_global_cache(check_lab04._Measure(fast), list(fast), 0.030) == 512
    assert check_lab04.engine_pick_budget(check_lab04._Measure(slow), list(fast), 0.030) == 128
    assert _pick_with_global_cache(check_lab04._Measure(slow), list(fast), 0.030) == 512  # the first sweep's answer
    _MEASURED.clear()
    refuses(check_lab04.check_pick_budget, _pick_with_global_cache, "every call measures afresh", "a cache in a global")
    accepts(check_lab04.check_pick_budget, check_lab04.engine_pick_budget)
