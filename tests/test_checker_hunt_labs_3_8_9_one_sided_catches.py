"""Labs 3, 8 and 9: wrong answers that only ONE of the two checks caught, now refused by both.

Each lab exercise has a visible checker (what the learner runs) and hidden cases (what the grader adds, seeded at
grading time).  An answer the visible checker passes and the grader fails costs a learner points with no warning;
one the grader passes earns points for a wrong answer.  Each answer below is written out as a learner would; the
oracle is the exercise's text (quoted where it decides) and, for the numbers, a hand computation or the checker's
independent reference (the engine's routers, the brute-force alarm, the engine's Prometheus series).

Before this file (at 3d1c283), visible / hidden (seeds 0-19):

* lab 3 ``block_hashes`` that leaves out each block's last token: visible passed, hidden failed;
* lab 3 ``block_hashes`` that puts the salt in front of the prompt as one more token: visible passed, hidden failed;
* lab 3 ``pick_victim`` "fewest children first": visible passed, hidden failed;
* lab 8 ``first_alarm`` comparing with ``int(threshold)``: visible failed (at a case whose hint is "getattr"),
  hidden passed (its thresholds were whole numbers);
* lab 8 ``first_alarm`` with the held time rounded to whole seconds: visible passed, hidden failed on 4 of 20
  seeds; cut to whole seconds (``int``): passed both;
* lab 8 ``metrics_from_log`` reporting waiting + the last record's preempted: visible failed, hidden passed (its
  runs never stopped on a step that preempted);
* lab 9 ``LeastOutstanding`` remembering each prompt's replica: visible failed, hidden passed (random prompts
  never repeat);
* lab 9 ``LeastOutstanding`` raising IndexError on no replicas: visible failed, hidden passed (never empty);
* lab 9 ``PrefixAffinity`` with a spill bound from the median load: visible passed, hidden failed.

Not refused, on purpose: a salt placed inside the first block's tuple (``(salt,) + block`` for block 0) mixes the
salt into the first key only, which is what the exercise asks ("the salt enters the first key only").
"""

from __future__ import annotations

import bisect
import statistics
from pathlib import Path

import nbformat
import pytest
from checker_verdicts import accepts, refuses

from minivllm.labs import check_lab03, check_lab08, check_lab09
from minivllm.labs.grade import exercise_cells
from minivllm.sim.router import stable_hash

ROOT = Path(__file__).resolve().parents[1]
SEEDS = range(5)


def _solution(stem: str, exercise: str, name: str):
    """The solution notebook's answer (its exercise cell, run on its own)."""
    ns = {"bisect": bisect, "stable_hash": stable_hash}
    source = exercise_cells(nbformat.read(ROOT / "solutions" / f"{stem}.ipynb", as_version=4))[exercise]
    exec(compile(source, f"<{stem} {exercise}>", "exec"), ns)
    return ns[name]


def _hidden_refuses(hidden, wrong) -> None:
    """The grader refuses ``wrong`` on every seed tried, not by luck of one."""
    for seed in SEEDS:
        assert not hidden(wrong, seed), seed


def _hidden_accepts(hidden, right) -> None:
    for seed in SEEDS:
        assert hidden(right, seed), seed


# -- lab 3 --------------------------------------------------------------------------------------------------


def _hash_without_last_token(token_ids, block_size, salt=None):
    """Slices each block one short: ``[i * bs:(i + 1) * bs - 1]``."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size:(i + 1) * block_size - 1]), salt if i == 0 else None))
        keys.append(parent)
    return keys


def _hash_salt_as_a_token(token_ids, block_size, salt=None):
    """Puts the salt in front of the prompt and cuts blocks from there: every block shifts by one."""
    tokens = ([salt] if salt is not None else []) + list(token_ids)
    keys, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash((parent, tuple(tokens[i * block_size:(i + 1) * block_size])))
        keys.append(parent)
    return keys


def _hash_salt_in_first_block(token_ids, block_size, salt=None):
    """The salt as an extra element of block 0's tuple only: mixed into the first key, as the exercise asks."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash((parent, (salt, *block) if i == 0 and salt is not None else block))
        keys.append(parent)
    return keys


def _fewest_children_first(nodes):
    """Prefers leaves, but falls back to an unlocked inner node when no leaf is free."""
    free = [n for n in nodes if n["locks"] == 0]
    return min(free, key=lambda n: (n["children"], n["last_access"]))["id"] if free else None


def test_block_hashes_without_each_blocks_last_token_fails_both():
    # by hand: P and P with token 15 changed differ in block 0, so every key differs; this answer never reads token 15
    P = list(range(100, 132))
    changed = P[:15] + [999] + P[16:]
    assert _hash_without_last_token(P, 16) == _hash_without_last_token(changed, 16)
    refuses(check_lab03.check_block_hashes, _hash_without_last_token, "a block's last token is part of its key",
            "16th token")
    _hidden_refuses(check_lab03.hidden_block_hashes, _hash_without_last_token)


def test_block_hashes_with_the_salt_as_a_leading_token_fails_both():
    # "one key per full block": 47 tokens are 2 full blocks; with the salt in front this answer makes 3
    assert len(_hash_salt_as_a_token(list(range(47)), 16, salt="alice")) == 3
    refuses(check_lab03.check_block_hashes, _hash_salt_as_a_token,
            "a salted prompt has one key per full block of its own tokens", "The salt is not a token")
    _hidden_refuses(check_lab03.hidden_block_hashes, _hash_salt_as_a_token)


def test_a_salt_inside_the_first_blocks_tuple_passes_both():
    right = _solution("lab03_prefix_caching", "block_hashes", "block_hashes")
    accepts(check_lab03.check_block_hashes, right, _hash_salt_in_first_block)
    _hidden_accepts(check_lab03.hidden_block_hashes, right)
    _hidden_accepts(check_lab03.hidden_block_hashes, _hash_salt_in_first_block)


def test_fewest_children_first_eviction_fails_both():
    # "only leaves (children == 0)": the one unlocked node is inner, the one leaf locked -- nothing may go
    nodes = [check_lab03._node("a", 1, children=1), check_lab03._node("b", 2, locks=1)]
    assert _fewest_children_first(nodes) == "a"
    refuses(check_lab03.check_pick_victim, _fewest_children_first,
            "no unlocked leaf: no victim, even with a free inner node", "never a victim")
    _hidden_refuses(check_lab03.hidden_pick_victim, _fewest_children_first)
    right = _solution("lab03_prefix_caching", "pick_victim", "pick_victim")
    accepts(check_lab03.check_pick_victim, right)
    _hidden_accepts(check_lab03.hidden_pick_victim, right)


# -- lab 8 --------------------------------------------------------------------------------------------------


def _alarm(above, held):
    """The text's alarm with the comparison ``above(v, threshold)`` and the held time ``held(seconds)``."""
    def first_alarm(samples, signal, threshold, for_s):
        since = None
        for s in samples:
            if above(getattr(s, signal), threshold):
                since = s.time if since is None else since
                if held(s.time - since) >= for_s:
                    return s.time
            else:
                since = None
        return None
    return first_alarm


def _exact(x):
    return x


_INT_THRESHOLD = _alarm(lambda v, th: v > int(th), _exact)
_ROUNDED_HELD = _alarm(lambda v, th: v > th, round)
_CUT_HELD = _alarm(lambda v, th: v > th, int)


@pytest.mark.parametrize("wrong,case,hint", [
    (_INT_THRESHOLD, "a threshold between whole numbers", "not cut to a whole number"),
    (_ROUNDED_HELD, "the held time is not rounded", "neither rounded nor cut"),
    (_CUT_HELD, "the held time is not rounded", "neither rounded nor cut"),
], ids=["int-threshold", "rounded-held", "cut-held"])
def test_a_rounded_threshold_or_held_time_fails_both(wrong, case, hint):
    # by hand, "signal > threshold ... held for for_s": 0.3 is not above 0.5; scrapes at 1, 2.5, 2.8 s held 1.5 s
    # (< 1.75) at 2.5 and 1.8 s at 2.8, so the alarm fires at 2.8
    assert _alarm(lambda v, th: v > th, _exact)(check_lab08._series([0.3, 0.6], "kv_usage"), "kv_usage", 0.5, 0) == 2.0
    assert check_lab08.reference_first_alarm(check_lab08._series([5] * 4, times=[1.0, 2.5, 2.8, 4.0]),
                                             "waiting", 4, 1.75) == 2.8
    refuses(check_lab08.check_first_alarm, wrong, case, hint)
    _hidden_refuses(check_lab08.hidden_first_alarm, wrong)


def test_the_solution_alarm_passes_both():
    right = _solution("lab08_serving", "first_alarm", "first_alarm")
    accepts(check_lab08.check_first_alarm, right, _alarm(lambda v, th: v > th, _exact))
    _hidden_accepts(check_lab08.hidden_first_alarm, right)


def test_waiting_plus_the_last_steps_preempted_fails_both():
    """The text: "running, waiting, free_blocks: gauges, as of the last record" -- the record's waiting already
    holds the requests a preemption put back in the queue (the engine's /metrics gauge is the oracle)."""
    right = _solution("lab08_serving", "metrics_from_log", "metrics_from_log")

    def waiting_plus_preempted(step_log, prompt_lens, arrivals, num_blocks):
        out = right(step_log, prompt_lens, arrivals, num_blocks)
        if len(step_log):
            out["waiting"] = step_log[-1].waiting + len(step_log[-1].preempted)
        return out

    refuses(check_lab08.check_metrics_from_log, waiting_plus_preempted, "gauges mid-run",
            "requests a preemption sent back")
    _hidden_refuses(check_lab08.hidden_metrics_from_log, waiting_plus_preempted)
    _hidden_accepts(check_lab08.hidden_metrics_from_log, right)


# -- lab 9 --------------------------------------------------------------------------------------------------


class _RemembersPrompts:
    """Routes a prompt seen before to the replica it went to then ("the same chat, the same replica")."""

    def __init__(self):
        self.seen = {}

    def route(self, prompt_token_ids, loads):
        if not loads:
            raise ValueError("no replicas")
        key = tuple(prompt_token_ids)
        if key not in self.seen:
            self.seen[key] = min(range(len(loads)), key=lambda i: (loads[i], i))
        return self.seen[key]


class _IndexErrorWhenEmpty:
    """The argmin loop with no guard: ``loads[0]`` raises IndexError on an empty fleet."""

    def route(self, prompt_token_ids, loads):
        best = loads.index(loads[0])
        for i in range(1, len(loads)):
            if loads[i] < loads[best]:
                best = i
        return best


def test_least_outstanding_that_remembers_prompts_fails_both():
    r = _RemembersPrompts()
    assert (r.route([7], [0, 5]), r.route([7], [5, 0])) == (0, 0)  # the least loaded the second time is 1
    refuses(check_lab09.check_least_outstanding, _RemembersPrompts, "the same prompt follows the loads", "NOW")
    _hidden_refuses(check_lab09.hidden_least_outstanding, _RemembersPrompts)


def test_least_outstanding_with_an_index_error_on_no_replicas_fails_both():
    refuses(check_lab09.check_least_outstanding, _IndexErrorWhenEmpty, "no replicas is a clear error", "ValueError")
    _hidden_refuses(check_lab09.hidden_least_outstanding, _IndexErrorWhenEmpty)
    right = _solution("lab09_fleet", "least_outstanding", "LeastOutstanding")
    accepts(check_lab09.check_least_outstanding, right)
    _hidden_accepts(check_lab09.hidden_least_outstanding, right)


def test_a_spill_bound_from_the_median_load_fails_both():
    right = _solution("lab09_fleet", "prefix_affinity", "PrefixAffinity")

    class MedianBound(right):
        def route(self, prompt_token_ids, loads):
            owner = self.owner(prompt_token_ids)
            if loads[owner] <= max(self.min_spill_tokens, self.spill_factor * statistics.median(loads)):
                return owner
            return min(range(len(loads)), key=lambda i: (loads[i], i))

    # by hand, "max(min_spill_tokens, spill_factor x mean load)": loads 2000, 1500, 0 give max(1000, 1750) = 1750,
    # which 2000 exceeds (spill); the median, 1500, gives 2250 (stay)
    assert max(1000, 1.5 * sum([2000, 1500, 0]) / 3) < 2000 < max(1000, 1.5 * statistics.median([2000, 1500, 0]))
    refuses(check_lab09.check_prefix_affinity, MedianBound, "the bound follows the mean load, not the middle one",
            "1166.7")
    _hidden_refuses(check_lab09.hidden_prefix_affinity, MedianBound)
    accepts(check_lab09.check_prefix_affinity, right)
    _hidden_accepts(check_lab09.hidden_prefix_affinity, right)
