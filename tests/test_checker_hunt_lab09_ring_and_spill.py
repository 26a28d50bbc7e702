"""Lab 9's prefix-affinity checker against wrong routers that passed it and the grader's hidden cases.

Each wrong answer is written out here; the oracle is the exercise's text: "a key belongs to the first point at
or after stable_hash(key tokens)", and "if the owner's outstanding tokens exceed max(min_spill_tokens,
spill_factor x mean load), route to the least-loaded replica instead" -- the owner and the loads of *this*
request, nothing remembered.  The solution notebook's router must still pass.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

from checker_verdicts import accepts, refuses

from minivllm.labs import check_lab09
from minivllm.sim.router import PrefixAffinityRouter, stable_hash

SOLUTION = Path(__file__).resolve().parents[1] / "solutions" / "lab09_fleet.ipynb"
SEEDS = (0, 7, 12345)


def _solution():
    nb = json.loads(SOLUTION.read_text())
    cell = next(c for c in nb["cells"] if "exercise:prefix_affinity" in c.get("metadata", {}).get("tags", []))
    ns = {"stable_hash": stable_hash}
    exec(compile("".join(cell["source"]), "<lab09 prefix_affinity>", "exec"), ns)
    return ns["PrefixAffinity"]


class _Ring:
    """The text's router, right in every part but the one a subclass gets wrong."""

    def __init__(self, num_replicas, *, block_size=16, key_blocks=20, vnodes=64, spill_factor=1.5,
                 min_spill_tokens=4096):
        self.block_size, self.key_blocks = block_size, key_blocks
        self.spill_factor, self.min_spill_tokens = spill_factor, min_spill_tokens
        ring = sorted((stable_hash(f"replica-{r}#{v}"), r) for r in range(num_replicas) for v in range(vnodes))
        self.points, self.owners = [h for h, _ in ring], [r for _, r in ring]

    def key(self, prompt):
        full = min(self.key_blocks, len(prompt) // self.block_size)
        return stable_hash(prompt[: full * self.block_size] if full else prompt)

    def owner(self, prompt):
        i = bisect.bisect_left(self.points, self.key(prompt))
        return self.owners[i % len(self.points)]

    def spills(self, loads, owner):
        return loads[owner] > max(self.min_spill_tokens, self.spill_factor * sum(loads) / len(loads))

    def route(self, prompt, loads):
        owner = self.owner(prompt)
        return min(range(len(loads)), key=lambda i: (loads[i], i)) if self.spills(loads, owner) else owner


class _BisectRight(_Ring):
    """``bisect.bisect`` is ``bisect_right``: a key equal to a point goes to the NEXT point's replica."""

    def owner(self, prompt):
        i = bisect.bisect(self.points, self.key(prompt))
        return self.owners[i % len(self.points)]


class _StickySpill(_Ring):
    """Remembers where a spilled key went and keeps sending it there (the cache "follows" the chat), even when
    the ring's owner is no longer over the bound."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.moved = {}

    def route(self, prompt, loads):
        key = self.key(prompt)
        owner = self.moved.get(key, self.owner(prompt))
        if not self.spills(loads, owner):
            return owner
        self.moved[key] = min(range(len(loads)), key=lambda i: (loads[i], i))
        return self.moved[key]


class _FloorInclusive(_Ring):
    """The bound as two comparisons, one of them off by one: spills AT min_spill_tokens."""

    def spills(self, loads, owner):
        return loads[owner] >= self.min_spill_tokens and loads[owner] > self.spill_factor * sum(loads) / len(loads)


def test_the_cases_are_what_the_text_says():
    p, r = check_lab09._on_point_case(dict(block_size=16, key_blocks=2))
    assert stable_hash(p) in PrefixAffinityRouter(3, vnodes=16).points  # exactly on a point ...
    assert PrefixAffinityRouter(3, block_size=16, key_blocks=2, vnodes=16).owner(p) == r  # ... which owns it
    assert _BisectRight(3, block_size=16, key_blocks=2, vnodes=16).owner(p) != r
    ref = PrefixAffinityRouter(3, min_spill_tokens=1000)
    assert ref.route([1, 2, 3], [1000 if i == ref.owner([1, 2, 3]) else 0 for i in range(3)]) == ref.owner([1, 2, 3])


def test_a_ring_that_skips_a_point_equal_to_the_key_fails_both_checkers():
    refuses(check_lab09.check_prefix_affinity, _BisectRight, "a key exactly on a point belongs to that point",
            "bisect_left")
    assert not any(check_lab09.hidden_prefix_affinity(_BisectRight, s) for s in SEEDS)


def test_a_router_that_remembers_a_spill_fails_both_checkers():
    refuses(check_lab09.check_prefix_affinity, _StickySpill, "a spill is not remembered", "owner")
    assert not any(check_lab09.hidden_prefix_affinity(_StickySpill, s) for s in SEEDS)


def test_a_spill_at_exactly_min_spill_tokens_fails_both_checkers():
    refuses(check_lab09.check_prefix_affinity, _FloorInclusive, "exactly min_spill_tokens stays", "max(1000")
    assert not any(check_lab09.hidden_prefix_affinity(_FloorInclusive, s) for s in SEEDS)


def test_the_solution_and_the_texts_router_still_pass():
    accepts(check_lab09.check_prefix_affinity, _solution(), _Ring)
    assert all(check_lab09.hidden_prefix_affinity(cls, s) for cls in (_solution(), _Ring) for s in SEEDS)
