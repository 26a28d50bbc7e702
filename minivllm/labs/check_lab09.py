"""Checkers for lab 9 (from one engine to a fleet): least-outstanding-tokens routing, prefix affinity on a hash ring.

Also the lab's shared harness: the fleet preset (:data:`~minivllm.sim.fleet.GPU_LIKE`, an L4-class GPU with
a Llama-3-8B-shaped model, simulated), a small chat mix, and the quiz answers, so the notebook, the tests and
the quiz compute their numbers with the same functions.  The references the checkers compare against are
the engine's own routers (:mod:`minivllm.sim.router`).
"""

from __future__ import annotations

import random
import struct
from typing import Any

from minivllm.arrival import made_up_ids
from minivllm.labs.checkers import Case, CheckResult, expect_raises, run_checks
from minivllm.labs.registry import Exercise, Lab
from minivllm.sim.fleet import ChatMix, Fleet, sim_replica
from minivllm.sim.router import HashRing, LeastOutstandingRouter, PrefixAffinityRouter, stable_hash

SMALL_REPLICA = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, model_max_len=4096)


def small_replica(executor: Any):
    """A small replica (256 KV blocks) on the lab's GPU-like executor: checkers run fleets of these in milliseconds."""
    return sim_replica(executor, **SMALL_REPLICA)


def small_mix(seed: int = 1) -> ChatMix:
    """The checkers' chat mix: :class:`ChatMix`'s closed-loop turns on shared system prompts, cut to 3 s at 6/s
    with short prompts and answers, so a fleet run takes milliseconds and later turns still carry a history."""
    return ChatMix(6.0, 3.0, seed=seed, system_len=64, user_range=(32, 64), output_range=(4, 16), turns=3,
                   think_s=(0.2, 0.6))


def _placements(router, seed: int = 1, replicas: int = 3) -> dict[str, int]:
    """Which replica served each request of a small closed-loop chat run with ``router``."""
    mix = small_mix(seed)
    res = Fleet(replicas, router, engine_factory=small_replica).run(mix.arrivals(), follow_up=mix.follow_up)
    return res.placement


def _prompt(rng: random.Random, n: int) -> list[int]:
    return made_up_ids(rng, n)


# -- exercise 1: least outstanding tokens ------------------------------------------------------------------


def check_least_outstanding(cls) -> CheckResult:
    """Check a router class ``cls()`` with ``route(prompt_token_ids, loads) -> replica index``."""
    expected_run = _placements(LeastOutstandingRouter())

    def route(k, loads, prompt=(1, 2, 3)):
        return k().route(list(prompt), loads)

    def untouched(k):
        loads = [30, 10, 20]
        k().route([1], loads)
        return loads

    rng = random.Random(0)
    grid = [[rng.randrange(0, 5) * 100 for _ in range(rng.randint(1, 7))] for _ in range(300)]

    def agrees(k):
        r = k()
        return all(r.route([7], loads) == min(range(len(loads)), key=lambda i: (loads[i], i)) for loads in grid)

    cases = [
        Case("one replica", lambda k: route(k, [500]), 0, "with a single replica there is no choice to make"),
        Case("the fewest outstanding tokens", lambda k: route(k, [300, 100, 200]), 1,
             "return the INDEX of the smallest load"),
        Case("the last replica can win", lambda k: route(k, [300, 200, 100]), 2,
             "look at every replica, the last one included"),
        Case("a tie goes to the lowest index", lambda k: route(k, [50, 0, 0]), 1,
             "among equal loads, the first one: compare with < , not <="),
        Case("the minimum, not the first smaller than replica 0", lambda k: route(k, [50, 40, 10]), 2,
             "keep the best so far and compare each load with IT, not with loads[0]"),
        Case("an index, not a load", lambda k: route(k, [7, 900, 8]), 0,
             "return which replica, not how loaded it is"),
        Case("no replicas is a clear error", lambda k: expect_raises(ValueError, lambda: route(k, [])), "ValueError",
             "raise ValueError when loads is empty: a fleet with no replica cannot serve"),
        Case("the loads are only read", untouched, [30, 10, 20],
             "don't sort or change the list the fleet passes you: it is the fleet's bookkeeping"),
        Case("the same prompt follows the loads", lambda k: (lambda r: (r.route([7], [0, 5]), r.route([7], [5, 0])))(k()),
             (0, 1), "one router, one prompt, two calls: loads 0, 5 then 5, 0 -- each call goes to the replica that is "
             "least loaded NOW; keep no memory of where a prompt went"),
        Case("agrees with the argmin on 300 random fleets", agrees, True,
             "the smallest load wins; on ties the lowest index"),
        Case("in a real fleet: the same placements as the engine's router", lambda k: _placements(k()), expected_run,
             "plugged into the fleet, your router must send every chat turn where the engine's does",
             show_expected="the engine's LeastOutstandingRouter placements"),
    ]
    return run_checks("least outstanding", cls, cases)


def hidden_least_outstanding(cls, seed: int) -> CheckResult:
    """Random fleets with many ties; the loads must come back unchanged."""
    rng = random.Random(seed)

    def random_fleets(k):
        r = k()
        for trial in range(400):
            loads = [rng.choice([0, 1, 5, 5, 9, rng.randrange(0, 10_000)]) for _ in range(rng.randint(1, 9))]
            before = list(loads)
            got = r.route(_prompt(rng, 5), loads)
            if loads != before or got != min(range(len(before)), key=lambda i: (before[i], i)):
                return f"fleet {trial} differs"
        return "all 400 match"

    def same_prompt(k):  # one chat's turns under other loads: the route follows the loads, never the prompt
        r, prompt = k(), _prompt(rng, 5)
        for trial in range(20):
            loads = [rng.randrange(0, 10_000) for _ in range(rng.randint(2, 9))]
            if r.route(list(prompt), list(loads)) != min(range(len(loads)), key=lambda i: (loads[i], i)):
                return f"repeat {trial} differs"
        return "all 20 match"

    return run_checks("least outstanding (hidden)", cls, [
        Case("400 random fleets", random_fleets, "all 400 match"),
        Case("one prompt, 20 different fleets", same_prompt, "all 20 match"),
        Case("no replicas", lambda k: expect_raises(ValueError, lambda: k().route(_prompt(rng, 5), [])), "ValueError"),
    ], verbose=False)


# -- exercise 2: prefix affinity on a consistent-hash ring ----------------------------------------------------


def _make(cls, n, **kw):
    return cls(n, **kw)


def _above_top_prompt(n: int, vnodes: int, block_size: int = 16, key_blocks: int = 2) -> list[int]:
    """A prompt whose key lies above the ring's highest point (it must wrap to the first point)."""
    top = max(stable_hash(f"replica-{r}#{v}") for r in range(n) for v in range(vnodes))
    rng = random.Random(11)
    while True:
        p = _prompt(rng, block_size * key_blocks)
        if stable_hash(p) > top:
            return p


def _point_prompt(replica: int, vnode: int) -> list[int]:
    """A prompt whose key lies exactly ON ring point ``replica-{replica}#{vnode}``.

    ``stable_hash`` hashes a token list as its ids packed little-endian as uint32, and a string as its bytes: the
    point's name, cut into 4-byte ids, hashes to the point itself.  Random prompts never hit a point (one chance in
    2^64 / points), so without this prompt "at or after" (``bisect_left``) and "after" (``bisect_right``) look alike.
    The name must be a whole number of ids: a one-digit replica and a two-digit vnode make 12 bytes, 3 ids -- a
    prompt shorter than any block, so the key is the whole prompt.
    """
    raw = f"replica-{replica}#{vnode}".encode()
    if len(raw) % 4 or not (0 <= replica < 10 and 10 <= vnode < 100):
        raise ValueError(f"replica-{replica}#{vnode} is not 12 bytes: one-digit replica, two-digit vnode")
    return list(struct.unpack(f"<{len(raw) // 4}I", raw))


def _on_point_case(kw: dict, n: int = 3, vnodes: int = 16) -> tuple[list[int], int]:
    """A prompt keyed exactly on one of replica r's points whose clockwise neighbour belongs to another replica
    (so "the next point" names another owner), and that r."""
    ring = PrefixAffinityRouter(n, **{**kw, "vnodes": vnodes})
    for r in range(n):
        for v in range(10, vnodes):
            i = ring.points.index(stable_hash(f"replica-{r}#{v}"))
            if ring.owners[(i + 1) % len(ring.points)] != r:
                return _point_prompt(r, v), r
    raise AssertionError("every point of this ring is followed by its own replica's")


def check_prefix_affinity(cls) -> CheckResult:
    """Check ``cls(num_replicas, *, block_size, key_blocks, vnodes, spill_factor, min_spill_tokens)``
    with ``owner(prompt_token_ids)`` and ``route(prompt_token_ids, loads)``."""
    kw = dict(block_size=16, key_blocks=2, vnodes=8, spill_factor=1.5, min_spill_tokens=1000)
    rng = random.Random(3)
    prompts = [_prompt(rng, rng.randint(1, 80)) for _ in range(300)]

    def owners_agree(k):
        for n, vnodes in ((1, 8), (3, 8), (5, 32)):
            mine = _make(k, n, **{**kw, "vnodes": vnodes})
            ref = PrefixAffinityRouter(n, **{**kw, "vnodes": vnodes})
            if [mine.owner(p) for p in prompts] != [ref.owner(p) for p in prompts]:
                return f"owners differ with {n} replicas, {vnodes} virtual nodes"
        return "all agree"

    head = _prompt(random.Random(4), 32)
    same = [head, head + [5], head + _prompt(random.Random(5), 40)]
    # one full block, then eight different partial ones (a key that keeps the partial block scatters them: with
    # three replicas all eight would share an owner by chance once in 3^7)
    partial = [head[:16] + [t, t + 1, t + 2, t + 3] for t in range(1, 33, 4)]
    # shorter than a block: keyed on the whole prompt; eight of them, whose owners differ, so an answer that keys
    # every short prompt on the same (empty) head cannot match them all by chance
    short = [[10, 11, t] for t in range(12, 20)]

    def moved_only_to_new(k):
        keys = [_prompt(random.Random(i), 32) for i in range(600)]
        old, new = _make(k, 4, **kw), _make(k, 5, **kw)
        moved = [p for p in keys if old.owner(p) != new.owner(p)]
        return all(new.owner(p) == 4 for p in moved) and 0 < len(moved) < 0.4 * len(keys)

    wrap = _above_top_prompt(3, 8)
    ref3 = PrefixAffinityRouter(3, **kw)
    owner = ref3.owner(head)
    others = [i for i in range(3) if i != owner]

    def loads_with(owner_load, a, b):
        loads = [0, 0, 0]
        loads[owner], loads[others[0]], loads[others[1]] = owner_load, a, b
        return loads

    at_bound = loads_with(3000, 0, 3000)  # mean 2000, bound 3000: exactly the bound stays
    over_mean = loads_with(3100, 1000, 400)  # mean 1500, bound 2250: spills to the least loaded
    tie_spill = loads_with(9000, 0, 0)
    quiet = loads_with(900, 0, 0)  # above 1.5 x mean, but under min_spill_tokens
    sum_vs_mean = loads_with(5000, 500, 500)  # 1.5 x mean = 3000 < 5000 < 1.5 x sum = 9000
    # mean 1001.33, bound 1502.0: stays; a floored mean and a rounded one (both 1001, bound 1501.5) spill.  (Loads
    # 1501, 1501, 0 caught only the floor: round(1000.67) is 1001, and 1501 stays under 1501.5.)
    exact_mean = loads_with(1502, 1502, 0)
    at_floor = loads_with(1000, 0, 0)  # 1.5 x mean = 500: the bound is min_spill_tokens itself, and 1000 stays
    # 1.5 x mean = 600: the bound is min_spill_tokens, 1000, and 1200 spills (spill_factor x max(floor, mean)
    # puts it at 1500 and keeps it)
    over_floor = loads_with(1200, 0, 0)
    median_vs_mean = loads_with(2000, 1500, 0)  # mean 1166.7, bound 1750: spills (the middle load, 1500, keeps it)
    on_point, point_owner = _on_point_case(kw)

    def route(k, loads):
        return _make(k, 3, **kw).route(head, loads)

    def spill_then_idle(k):  # one router, two requests of one chat: overloaded, then quiet again
        r = _make(k, 3, **kw)
        return r.route(head, over_mean), r.route(head, [0, 0, 0])

    def untouched(k):  # both answers: the owner kept (quiet) and a spill (over_mean)
        for given in (quiet, over_mean):
            loads = list(given)
            _make(k, 3, **kw).route(head, loads)
            if loads != given:
                return False
        return True

    expected_run = _placements(PrefixAffinityRouter(3, block_size=16, key_blocks=5))

    cases = [
        Case("one replica owns everything", lambda k: {_make(k, 1, **kw).owner(p) for p in prompts[:20]}, {0},
             "with one replica every point on the ring is replica 0's"),
        Case("same first blocks, same owner", lambda k: {_make(k, 3, **kw).owner(p) for p in same},
             {ref3.owner(head)}, "key on the first key_blocks FULL blocks only: what follows must not matter",
             # one owner for all three, but not the ring's: a key too short, or the lookup on the ring
             diagnose=lambda got: ("the three prompts agree on an owner, but not the ring's: is the key all of the "
                                   "first key_blocks full blocks, and is the owner the first point at or after the "
                                   "key's hash (bisect_left), wrapping past the top to point 0?"
                                   if isinstance(got, set) and len(got) == 1 else None)),
        Case("a partial block is not part of the key", lambda k: len({_make(k, 3, **kw).owner(p) for p in partial}),
             1, "full = min(key_blocks, len(prompt) // block_size): a half-filled block cannot be cached yet, so "
                "prompt[:key_blocks * block_size] is not the key when the prompt has fewer than key_blocks full "
                "blocks"),
        Case("a prompt shorter than a block", lambda k: [_make(k, 3, **kw).owner(p) for p in short],
             [ref3.owner(p) for p in short], "no full block at all: hash the whole prompt"),
        Case("a key above the top point wraps to the first", lambda k: _make(k, 3, **kw).owner(wrap), ref3.owner(wrap),
             "clockwise from the key: past the highest point you continue at the lowest one"),
        Case("a key exactly on a point belongs to that point", lambda k: _make(k, 3, **{**kw, "vnodes": 16}).owner(on_point),
             point_owner, "the first point AT or after the key's hash: bisect_left. bisect.bisect (= bisect_right) "
                          "skips a point equal to the key and hands it to the next replica on the ring"),
        Case("owners agree with the engine's ring on 300 prompts", owners_agree, "all agree",
             "points at stable_hash(f'replica-{r}#{v}') for every replica r and virtual node v, sorted; the owner "
             "is the first point at or after the key's hash"),
        Case("adding a replica moves keys only to it", moved_only_to_new, True,
             "a ring, not hash % N: with one more replica, a key either stays or moves to the new one"),
        Case("an idle fleet: the owner", lambda k: route(k, [0, 0, 0]), owner, "no load: always the ring's owner"),
        Case("a light load below min_spill_tokens stays", lambda k: route(k, quiet), owner,
             "the bound is max(min_spill_tokens, spill_factor x mean load)"),
        Case("exactly at the bound stays", lambda k: route(k, at_bound), owner,
             "spill only when the owner's load EXCEEDS the bound"),
        Case("exactly min_spill_tokens stays", lambda k: route(k, at_floor), owner,
             "the floor is part of the bound: loads 1000, 0, 0 give max(1000, 1.5 x 333) = 1000, and 1000 does not "
             "exceed it -- one comparison, loads[owner] > bound, not >= on the floor and > on the mean"),
        Case("over the bound spills to the least loaded", lambda k: route(k, over_mean),
             over_mean.index(min(over_mean)), "skip the owner: send it to the replica with the fewest outstanding tokens"),
        Case("the bound uses the mean, not the total", lambda k: route(k, sum_vs_mean),
             sum_vs_mean.index(min(sum_vs_mean)), "mean load = sum(loads) / len(loads)"),
        Case("the bound follows the mean load, not the middle one", lambda k: route(k, median_vs_mean),
             median_vs_mean.index(0), "owner at 2000, the others at 1500 and 0: the mean load is 1166.7, so the "
             "owner is over the bound and the request spills to the idle replica. The middle load (1500) is not "
             "the mean: the idle replica pulls the mean down"),
        Case("the mean is not rounded", lambda k: route(k, exact_mean), owner,
             "sum(loads) / len(loads), true division, neither floored nor rounded: with loads 1502, 1502, 0 the "
             "bound is 1.5 x 1001.33 = 1502.0, and 1502 stays"),
        Case("over min_spill_tokens with a light mean spills", lambda k: route(k, over_floor), min(others),
             "the spill factor scales the mean only, not the floor: loads 1200, 0, 0 give max(1000, 1.5 x 400) = "
             "1000, and 1200 exceeds it"),
        Case("a spill tie goes to the lowest index", lambda k: route(k, tie_spill), min(others),
             "among equally idle replicas, the lowest index"),
        Case("a spill is not remembered", spill_then_idle, (over_mean.index(min(over_mean)), owner),
             "each request goes to the ring's owner unless the owner is over the bound NOW: once the load is gone, "
             "the chat goes back to its owner (keep no memory of where a key was sent)"),
        Case("the loads are only read", untouched, True, "don't change the fleet's list"),
        Case("in a real fleet: the same placements as the engine's router",
             lambda k: _placements(k(3, block_size=16, key_blocks=5)), expected_run,
             "plugged into the fleet (5 key blocks, default spill), every chat turn goes where the engine sends it",
             show_expected="the engine's PrefixAffinityRouter placements"),
    ]
    return run_checks("prefix affinity", cls, cases)


def hidden_prefix_affinity(cls, seed: int) -> CheckResult:
    """Random ring sizes, prompts and loads against the engine's router."""
    rng = random.Random(seed)

    def random_fleets(k):
        for trial in range(60):
            n, vnodes, kb = rng.randint(1, 6), rng.choice([1, 4, 16, 64]), rng.randint(1, 4)
            opts = dict(block_size=rng.choice([4, 16]), key_blocks=kb, vnodes=vnodes,
                        spill_factor=rng.choice([1.0, 1.5, 2.0]), min_spill_tokens=rng.choice([0, 100, 1000]))
            mine, ref = k(n, **opts), PrefixAffinityRouter(n, **opts)
            prompts = [_prompt(rng, rng.randint(1, 90)) for _ in range(10)]
            if vnodes > 10:  # a key exactly on a point (see _point_prompt)
                prompts.append(_point_prompt(trial % n, 10 + trial % (vnodes - 10)))
            # every prompt twice, under other loads: a router that remembers where a key went routes the second
            # one by its memory; loads of exactly min_spill_tokens test the floor's side of the bound
            for p in prompts + prompts:
                loads = [rng.choice([0, 50, 500, opts["min_spill_tokens"], rng.randrange(0, 5000)]) for _ in range(n)]
                if mine.owner(p) != ref.owner(p) or mine.route(p, list(loads)) != ref.route(p, list(loads)):
                    return f"fleet {trial} differs"
        return "all 60 match"

    return run_checks("prefix affinity (hidden)", cls, [Case("60 random fleets", random_fleets, "all 60 match")],
                      verbose=False)


# -- quiz answers (``"compute": "minivllm.labs.check_lab09:<name>"`` in quizzes/lab09.json) -------------------


def quiz_share_moved_4_to_5() -> float:
    """Share of 20,000 random keys whose owner changes when a 64-vnode ring grows from 4 to 5 replicas (1 decimal)."""
    rng = random.Random(0)
    old, new = HashRing(4), HashRing(5)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    return round(sum(old.owner(k) != new.owner(k) for k in keys) / len(keys), 1)


def quiz_modulo_share_moved_4_to_5() -> float:
    """The same with ``hash % N``: a key stays only when k % 4 == k % 5 (1 decimal)."""
    rng = random.Random(0)
    keys = [rng.getrandbits(64) for _ in range(20_000)]
    return round(sum(k % 4 != k % 5 for k in keys) / len(keys), 1)


def quiz_spill_choice() -> int:
    """Loads [1000, 9000, 2000], owner replica 1, spill factor 1.5, min 4096: which replica serves?"""
    loads = [1000, 9000, 2000]
    bound = max(4096, 1.5 * sum(loads) / len(loads))
    return 1 if loads[1] <= bound else min(range(3), key=lambda i: (loads[i], i))


LAB = Lab(9, "lab09_fleet", "From one engine to a fleet", exercises=(
    Exercise("least_outstanding", "LeastOutstanding", check_least_outstanding, points=1,
             hidden=hidden_least_outstanding, mutants=(
        ("ties go to the last replica", "if loads[i] < loads[best]:", "if loads[i] <= loads[best]:"),
        ("the most loaded replica", "if loads[i] < loads[best]:", "if loads[i] > loads[best]:"),
        ("skips the last replica", "for i in range(1, len(loads)):", "for i in range(1, len(loads) - 1):"),
        ("returns the load, not the index", "        return best\n", "        return loads[best]\n"),
        ("compares with replica 0 only", "if loads[i] < loads[best]:", "if loads[i] < loads[0]:"),
        ("no error without replicas", 'raise ValueError("no replicas to route to")', "return 0"),
        ("sorts the fleet's list", "best = 0\n", "loads.sort()\n        best = 0\n"),
    )),
    Exercise("prefix_affinity", "PrefixAffinity", check_prefix_affinity, points=2, hidden=hidden_prefix_affinity,
             mutants=(
        ("one point per replica", "for v in range(vnodes)", "for v in range(1)"),
        ("hash % N instead of a ring", "i = bisect.bisect_left(self.points, stable_hash(head))",
         "return stable_hash(head) % self.num_replicas"),
        ("no wrap-around past the top point", "return self.owners[i % len(self.points)]",
         "return self.owners[min(i, len(self.points) - 1)]"),
        ("keys on the whole prompt", "head = prompt_token_ids[: full * self.block_size] if full else prompt_token_ids",
         "head = prompt_token_ids"),
        ("counts a partial block", "full = min(self.key_blocks, len(prompt_token_ids) // self.block_size)",
         "full = min(self.key_blocks, -(-len(prompt_token_ids) // self.block_size))"),
        ("never spills", "if loads[owner] <= bound:", "if True:"),
        ("spills at the bound", "if loads[owner] <= bound:", "if loads[owner] < bound:"),
        ("spills to the next replica", "return min(range(len(loads)), key=lambda i: (loads[i], i))",
         "return (owner + 1) % len(loads)"),
        ("no floor on the bound", "bound = max(self.min_spill_tokens, self.spill_factor * sum(loads) / len(loads))",
         "bound = self.spill_factor * sum(loads) / len(loads)"),
        ("adds the prompt to the owner's load", "        if loads[owner] <= bound:\n            return owner",
         "        if loads[owner] <= bound:\n            loads[owner] += len(prompt_token_ids)\n            return owner"),
        ("keys a short prompt on an empty head",
         "head = prompt_token_ids[: full * self.block_size] if full else prompt_token_ids",
         "head = prompt_token_ids[: full * self.block_size]"),
        ("total instead of mean", "self.spill_factor * sum(loads) / len(loads))", "self.spill_factor * sum(loads))"),
        ("rounds the mean", "self.spill_factor * sum(loads) / len(loads))",
         "self.spill_factor * round(sum(loads) / len(loads)))"),
        ("the spill factor scales the floor too",
         "bound = max(self.min_spill_tokens, self.spill_factor * sum(loads) / len(loads))",
         "bound = self.spill_factor * max(self.min_spill_tokens, sum(loads) / len(loads))"),
    )),
))
