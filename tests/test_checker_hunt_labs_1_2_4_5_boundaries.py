"""Wrong answers to labs 1, 4 and 5 that agreed with the reference on every case the checkers used to hold.

Each differs from the exercise's rule only at a boundary the exercise text states, and every case used to stay
clear of that boundary:

* lab 1 ``static_batching``: "return the waiting list as it is" -- every queue the checkers built was already
  sorted by request id, so an answer that sorts by id passed.  Oracle: the queue's own order.
* lab 4 ``pick_budget``: "the largest budget whose itl_p99 is at or below the target" -- every p99 was a whole
  millisecond, so an answer that rounds the p99 (or cuts it to whole ms) before comparing passed; and "None if none
  is" -- no sweep was empty, so an answer that reads ``budgets[0]`` first passed.  Oracle: the comparison by hand
  (30.4 ms is over 30 ms; an empty sweep has nothing that qualifies).
* lab 5 ``victim_policy``: "the fewest computed tokens" -- no visible set held a request with 0 computed tokens,
  so a loop that takes 0 for "no best yet" (``if not best_tokens or ...``) passed.  Oracle: min by hand.
"""

from __future__ import annotations

import pytest

from minivllm.labs import check_lab01, check_lab04, check_lab05
from minivllm.labs.workloads import StaticBatchAdmission
from tests.checker_verdicts import accepts, refuses

SEEDS = (0, 7, 12345)


def _hidden_rejects(hidden, wrong) -> None:
    assert not any(hidden(wrong, seed) for seed in SEEDS)


def _hidden_accepts(hidden, right) -> None:
    assert all(hidden(right, seed) for seed in SEEDS)


def _pinned(check, hidden, wrong, case: str, why: str, *right) -> None:
    """The wrong answer fails ``case`` of the visible check (its message naming ``why``) and the grader on every
    seed; each right answer passes both."""
    refuses(check, wrong, case, why)
    _hidden_rejects(hidden, wrong)
    accepts(check, *right)
    for r in right:
        _hidden_accepts(hidden, r)


# -- lab 1: static batching keeps the queue's order ---------------------------------------------------


class _SortsById:
    """Admits the whole queue when nothing runs -- but in request-id order, not the queue's."""

    def order(self, waiting, running):
        return [] if running else sorted(waiting, key=lambda r: r.request_id)


class _SliceCopy:
    """Right, written another way."""

    def order(self, waiting, running):
        return waiting[:] if not running else []


def test_static_batching_keeps_the_queue_order_not_the_id_order():
    _pinned(check_lab01.check_static_batching, check_lab01.hidden_static_batching, _SortsById,
            "the queue's order is kept, whatever the ids", "order", StaticBatchAdmission, _SliceCopy)


# -- lab 4: pick_budget compares the measured p99, and an empty sweep is None -------------------------


def _rounds_to_ms(measure, budgets, itl_target_s):
    ok = [b for b in budgets if round(measure(b)["itl_p99"] * 1000) <= round(itl_target_s * 1000)]
    return max(ok) if ok else None


def _cuts_to_ms(measure, budgets, itl_target_s):
    ok = [b for b in budgets if int(measure(b)["itl_p99"] * 1000) <= itl_target_s * 1000]
    return max(ok) if ok else None


def _rounds_to_3_places(measure, budgets, itl_target_s):
    ok = [b for b in budgets if round(measure(b)["itl_p99"], 3) <= itl_target_s]
    return max(ok) if ok else None


def _reads_the_first_budget(measure, budgets, itl_target_s):
    best = budgets[0] if measure(budgets[0])["itl_p99"] <= itl_target_s else None
    for b in budgets[1:]:
        if measure(b)["itl_p99"] <= itl_target_s and (best is None or b > best):
            best = b
    return best


def _largest_first(measure, budgets, itl_target_s):
    """Right, written another way: measure from the largest down, stop at the first that meets the target."""
    for b in sorted(budgets, reverse=True):
        if measure(b)["itl_p99"] <= itl_target_s:
            return b
    return None


@pytest.mark.parametrize("wrong", [_rounds_to_ms, _cuts_to_ms, _rounds_to_3_places])
def test_pick_budget_a_hair_over_the_target_misses(wrong):
    class Sweep:
        def __call__(self, b):
            return {"itl_p99": {2048: 0.0300, 4096: 0.0304}[b]}

    assert wrong(Sweep(), [2048, 4096], 0.030) == 4096  # by hand: 30.4 ms > 30 ms, so 2048 is the answer
    refuses(check_lab04.check_pick_budget, wrong, "a hair over the target misses", "round")
    _hidden_rejects(check_lab04.hidden_pick_budget, wrong)


def test_pick_budget_of_an_empty_sweep_is_none():
    refuses(check_lab04.check_pick_budget, _reads_the_first_budget, "no budgets at all", "None")
    _hidden_rejects(check_lab04.hidden_pick_budget, _reads_the_first_budget)


def test_pick_budget_right_answers_still_pass():
    accepts(check_lab04.check_pick_budget, check_lab04.engine_pick_budget, _largest_first)
    _hidden_accepts(check_lab04.hidden_pick_budget, check_lab04.engine_pick_budget)
    _hidden_accepts(check_lab04.hidden_pick_budget, _largest_first)


# -- lab 5: a victim with nothing computed is the cheapest ---------------------------------------------


class _ZeroMeansUnset:
    """Least work, ties to the newest -- but 0 computed tokens reads as "no best yet"."""

    def __init__(self, protected_tenants=()):
        self.protected = set(protected_tenants)

    def choose_victim(self, running):
        cands = [r for r in running if r.tenant not in self.protected] or list(running)
        best, best_tokens = None, 0
        for r in cands:
            if not best_tokens or r.num_computed_tokens <= best_tokens:
                best, best_tokens = r, r.num_computed_tokens
        return best


class _SortedStable:
    """Right, written another way: a stable sort of the reversed candidates, first item."""

    def __init__(self, protected_tenants=()):
        self.protected = frozenset(protected_tenants)

    def choose_victim(self, running):
        cands = [r for r in running if r.tenant not in self.protected] or list(running)
        return sorted(cands[::-1], key=lambda r: r.num_computed_tokens)[0]


def test_victim_with_nothing_computed_is_the_least_work():
    _pinned(check_lab05.check_victim_policy, check_lab05.hidden_victim_policy, _ZeroMeansUnset,
            "nothing computed yet is the least work", "is None", check_lab05.ReferenceVictim, _SortedStable)


# -- lab 4: build_batch returns the signature's list ---------------------------------------------------


def _batch_as_tuple(running, budget, threshold):
    """The right pairs, in a tuple: ``-> list`` is the signature's container (the rule every checker keeps)."""
    return tuple(check_lab04.engine_build_batch(running, budget, threshold))


def _batch_from_a_loop(running, budget, threshold):
    """Right, written another way: one pass, decodes counted in before any prefill by a sort on the kind."""
    rows = []
    for req in sorted(running, key=lambda r: not r.is_decode):
        if budget <= 0:
            break
        n = min(req.num_uncomputed_tokens, threshold or req.num_uncomputed_tokens, budget)
        rows.append((req, n))
        budget -= n
    return rows


def test_build_batch_returns_a_list():
    _pinned(check_lab04.check_build_batch, check_lab04.hidden_build_batch, _batch_as_tuple, "nothing running",
            "not a list", check_lab04.engine_build_batch, _batch_from_a_loop)
