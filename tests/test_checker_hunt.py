"""Lab checkers (labs 4-8) against answers their planted bugs do not cover: a right answer written another way
must pass, and a wrong one must fail visibly -- not only in the grader's hidden cases, and not by a KeyError
raised inside the checker.  Each answer is written out here; the oracle is the exercise's text (and, for the
wrong ones, what the same answer does on a second call or in the hidden cases)."""

from __future__ import annotations

import contextlib
import io

from minivllm.labs import check_lab04, check_lab05, check_lab06, check_lab08


def _quiet(check, fn):
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = check(fn)
    return result, out.getvalue()


# -- lab 5: the door rule --------------------------------------------------------------------------------


def _door_without_swapped(stats, max_waiting, min_free_blocks):
    """Reads "num_swapped is a part of num_waiting" as "leave the swapped ones out": they wait ahead of the
    newcomer, so a queue of max_waiting with some of them swapped out is still full."""
    waiting = stats["num_waiting"] - stats["num_swapped"]
    return waiting >= max_waiting or (waiting > 0 and stats["available_blocks"] < min_free_blocks)


def test_a_door_that_subtracts_the_swapped_requests_fails_the_visible_checker():
    full = check_lab05._stats(waiting=4, swapped=2)
    assert check_lab05.engine_should_reject(full, 4, 16) is True  # the server's own door: the queue is full
    assert _door_without_swapped(full, 4, 16) is False
    assert not check_lab05.hidden_should_reject(_door_without_swapped, 7)  # the grader rejects it already
    result, text = _quiet(check_lab05.check_should_reject, _door_without_swapped)
    assert not result, "the learner would see a pass, then lose the points in the hidden cases"
    assert "num_swapped" in text


# -- lab 6: the virtual token counter ----------------------------------------------------------------------


class _LiftOnlyWhenRaising:
    """A right VirtualTokenCounter that writes a counter only when activation raises it: a missing counter
    already reads as 0 (``counters.get(t, 0.0)``, as the engine's WFQ reads it), so lifting 0 to 0 writes
    nothing."""

    def __init__(self, weights, prefill_weight=1.0, decode_weight=2.0):
        self.weights, self.prefill_weight, self.decode_weight = dict(weights), prefill_weight, decode_weight
        self.counters = {}

    def weight(self, tenant):
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant, prefill_tokens, output_tokens):
        cost = self.prefill_weight * prefill_tokens + self.decode_weight * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)

    def activate(self, tenant, active):
        others = [self.counters.get(t, 0.0) for t in active if t != tenant]
        if others and min(others) > self.counters.get(tenant, 0.0):
            self.counters[tenant] = min(others)


def test_a_counter_that_leaves_a_zero_unwritten_passes_the_visible_checker():
    assert all(check_lab06.hidden_virtual_token_counter(_LiftOnlyWhenRaising, seed) for seed in (0, 7, 12345))
    result, text = _quiet(check_lab06.check_virtual_token_counter, _LiftOnlyWhenRaising)
    assert "raised KeyError" not in text, "the checker's own lookup failed, and the hint blamed the learner"
    assert result, text


class _DividesTheRunningTotal(_LiftOnlyWhenRaising):
    """Divides the counter, not the charge, by the weight: ``(counter + cost) / weight``.  Right for a tenant of
    weight 1 and for a first charge; wrong from the second charge of a weighted tenant on, which divides every
    earlier charge again (a weight-2 tenant charged 60 then 40 prefill tokens has served 100 / 2 = 50, not 35)."""

    def charge(self, tenant, prefill_tokens, output_tokens):
        cost = self.prefill_weight * prefill_tokens + self.decode_weight * output_tokens
        self.counters[tenant] = (self.counters.get(tenant, 0.0) + cost) / self.weight(tenant)


def test_a_counter_that_divides_its_running_total_fails_visible_and_hidden():
    by_hand = _DividesTheRunningTotal({"a": 2.0})  # the exercise's rule, by hand: (60 + 40) / 2 = 50
    by_hand.charge("a", 60, 0)
    by_hand.charge("a", 40, 0)
    assert by_hand.counters["a"] == 35.0 != (60 + 40) / 2
    result, text = _quiet(check_lab06.check_virtual_token_counter, _DividesTheRunningTotal)
    assert not result, text
    assert "Divide each charge's cost" in text
    assert not any(check_lab06.hidden_virtual_token_counter(_DividesTheRunningTotal, seed) for seed in range(20))
    assert all(check_lab06.hidden_virtual_token_counter(_LiftOnlyWhenRaising, seed) for seed in range(20))


# -- lab 4: pick the budget --------------------------------------------------------------------------------


def _pick_sorting_in_place(measure, budgets, itl_target_s):
    """The right budget, found by sorting the caller's list (the notebook's BUDGETS) largest first."""
    budgets.sort(reverse=True)
    return next((b for b in budgets if measure(b)["itl_p99"] <= itl_target_s), None)


def test_a_pick_budget_that_sorts_the_callers_list_fails():
    mine = [256, 8192, 1024]
    _pick_sorting_in_place(lambda b: {"itl_p99": 0.01}, mine, 0.05)
    assert mine != [256, 8192, 1024]  # the caller's list, reordered
    result, _ = _quiet(check_lab04.check_pick_budget, _pick_sorting_in_place)
    assert not result and result.failed_case == "the budgets are only read"
    assert not check_lab04.hidden_pick_budget(_pick_sorting_in_place, 7)


# -- lab 8: the metric list from the step log ----------------------------------------------------------------


def _metrics_counting_in_prompt_lens(step_log, prompt_lens, arrivals, num_blocks):
    """Right numbers on a first call, with the tokens a request knows kept by raising the caller's prompt_lens."""
    last, ttft, itl, preemptions, generated = {}, {}, [], 0, 0
    for rec in step_log:
        preemptions += len(rec.preempted)
        for rid, start, n in rec.seqs:
            if start + n == prompt_lens[rid]:
                prompt_lens[rid] += 1
                generated += 1
                if rid in last:
                    itl.append(rec.time - last[rid])
                else:
                    ttft[rid] = rec.time - arrivals[rid]
                last[rid] = rec.time
    end = step_log[-1] if len(step_log) else None
    return {"running": end.running if end else 0, "waiting": end.waiting if end else 0,
            "used_blocks": num_blocks - end.available_blocks if end else 0,
            "free_blocks": end.free_blocks if end else num_blocks, "preemptions": preemptions,
            "generation_tokens": generated, "ttft": ttft, "itl": itl}


def test_metrics_that_change_the_callers_prompt_lens_fail():
    engine, _, plens, arr = check_lab08._metric_run([(20, 5, 0.0)])
    first = _metrics_counting_in_prompt_lens(engine.step_log, plens, arr, 64)
    again = _metrics_counting_in_prompt_lens(engine.step_log, plens, arr, 64)  # the notebook cell run twice
    assert first["generation_tokens"] == 5 and again["generation_tokens"] != 5
    result, text = _quiet(check_lab08.check_metrics_from_log, _metrics_counting_in_prompt_lens)
    assert not result and result.failed_case == "prompt_lens and arrivals are only read", text


# -- lab 6: the deadline key's two clamps ------------------------------------------------------------------


class _AgingDeadline:
    """A right ``AgingDeadline``, written here: the clamps as an if-chain instead of min and max."""

    def __init__(self, aging_s):
        self.aging_s = aging_s

    def key(self, req):
        latest = req.arrival_time + self.aging_s
        if req.deadline is None or req.deadline > latest:
            return latest
        return max(req.deadline, req.arrival_time)

    def rank(self, req):
        return (self.key(req), req.arrival_time)

    def order(self, waiting, running):
        return sorted(waiting, key=self.rank)


class _ExpiredMeansNegative(_AgingDeadline):
    """Reads "an already-expired deadline" as "a negative deadline": a request that arrived at 2.0 due at 1.0
    keeps the key 1.0 and jumps ahead of requests that arrived before it."""

    def key(self, req):
        latest = req.arrival_time + self.aging_s
        due = latest if req.deadline is None else min(req.deadline, latest)
        return req.arrival_time if due < 0 else due


class _AgingFromTimeZero(_AgingDeadline):
    """Pulls a deadline in to ``aging_s`` rather than to ``arrival_time + aging_s``: the same key for a request
    that arrived at 0.0 (as the visible far-deadline request did), too early for every later one."""

    def key(self, req):
        latest = req.arrival_time + self.aging_s
        due = latest if req.deadline is None else min(req.deadline, self.aging_s)
        return max(req.arrival_time, due)


def test_deadline_keys_clamped_at_the_wrong_bound_fail_visible_and_hidden():
    from minivllm.labs.check_lab06 import _R

    # the exercise's rule by hand: arrived 2.0 due 1.0 -> 2.0; arrived 2.0 due 40 with aging 10 -> 12.0
    assert _AgingDeadline(10.0).key(_R("p", "t", 2.0, 1.0)) == 2.0 != _ExpiredMeansNegative(10.0).key(_R("p", "t", 2.0, 1.0))
    assert _AgingDeadline(10.0).key(_R("f", "t", 2.0, 40.0)) == 12.0 != _AgingFromTimeZero(10.0).key(_R("f", "t", 2.0, 40.0))
    for wrong in (_ExpiredMeansNegative, _AgingFromTimeZero):
        result, text = _quiet(check_lab06.check_deadline_aging, wrong)
        assert not result, (wrong.__name__, text)
        assert not any(check_lab06.hidden_deadline_aging(wrong, seed) for seed in range(20)), wrong.__name__
    result, text = _quiet(check_lab06.check_deadline_aging, _AgingDeadline)
    assert result, text
    assert all(check_lab06.hidden_deadline_aging(_AgingDeadline, seed) for seed in range(20))
