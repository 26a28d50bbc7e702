"""WFQ's lazy order (read live from its kept queues through a ``_LivePass``) against the list order, under every
kind of change admission can make to the waiting queue while it walks the order.

``test_fairness.py`` checks one hand-built scene (an admitted request, a front-entered victim, one early leaver of a
tenant already under way).  These cover what that scene leaves out, each of which a planted bug in ``_LivePass`` or
``KeptOrder`` got past: a request that entered *during* the pass and then leaves again, an early leaver of a tenant
whose turn has not come yet, several early leavers of one tenant at once; and then random mixtures of all of them.
Oracle: the same policy given a plain list, drawn whole before anything changed -- the order the lazy one promises
to equal, request for request and place for place.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from minivllm import EngineConfig, SamplingParams
from minivllm.config import TenantConfig
from minivllm.request import Request
from minivllm.sched.fairness import WFQAdmission

TENANTS = "abc"


def _policies():
    cfg = EngineConfig(scheduling_policy="wfq", max_num_batched_tokens=8, max_model_len=64, device="cpu",
                       tenants={"a": TenantConfig(weight=1.0), "b": TenantConfig(weight=2.0), "c": TenantConfig()})
    return WFQAdmission(cfg), WFQAdmission(cfg)


def _request(rid: str, tenant: str, prompt: int) -> Request:
    return Request(rid, [1] * prompt, SamplingParams(max_tokens=1, temperature=0.0), 0.0, tenant=tenant)


class _Scene:
    """A tracked queue and the two policies: ``kept`` hears every change, ``unkept`` gave the list order."""

    def __init__(self, reqs: list[Request], counters: dict[str, float]) -> None:
        self.kept, self.unkept = _policies()
        self.queue: deque = deque()
        self.kept.track(self.queue)
        for r in reqs:
            self.queue.append(r)
            self.kept.enqueued(r, False)
        for p in (self.kept, self.unkept):
            p.counters.update(counters)
        self.expected = self.unkept.order(list(self.queue), [])
        self.lazy = iter(self.kept.order(self.queue, []))
        self.got: list[Request] = []

    def take(self, n: int = 1) -> None:
        for _ in range(n):
            self.got.append(next(self.lazy))

    def leave(self, req: Request) -> None:
        self.queue.remove(req)
        self.kept.dequeued(req)

    def enter_front(self, req: Request) -> None:
        self.queue.appendleft(req)
        self.kept.enqueued(req, True)

    def finish(self) -> None:
        self.got += list(self.lazy)
        assert [r.request_id for r in self.got] == [r.request_id for r in self.expected]
        assert [self.kept.rank(r) for r in self.got] == [self.unkept.rank(r) for r in self.expected]


def _three_each() -> list[Request]:
    return [_request(f"{t}{i}", t, 2 + i) for i in range(3) for t in TENANTS]


def test_a_victim_that_enters_and_leaves_during_the_pass_is_never_handed_out():
    """A victim preempted back to the front of tenant c's queue, then gone again (a rejected leader's sample),
    before c's first turn: it was not waiting when the order was made, so c's three requests come out as listed
    -- not the victim in c0's place (as when the pass forgets to check when a leaver entered)."""
    scene = _Scene(_three_each(), {"c": 50.0})
    assert [r.tenant for r in scene.expected[-3:]] == ["c"] * 3  # c's turn comes last
    scene.take(2)
    scene.leave(scene.got[0])  # admitted
    victim = _request("v", "c", 5)
    scene.enter_front(victim)
    scene.leave(victim)
    scene.finish()


def test_a_tenant_whose_turn_has_not_come_loses_a_request_before_it():
    """c0 leaves while c has had no turn yet (no cursor): it is still handed out first of c's, in its place, as from
    the list drawn before it left."""
    scene = _Scene(_three_each(), {"c": 50.0})
    scene.take(1)
    c0 = next(r for r in scene.expected if r.request_id == "c0")
    scene.leave(c0)
    scene.finish()


def test_several_requests_of_one_tenant_leave_before_their_turn():
    """A rejected leader takes all its waiting samples with it: two requests of tenant a leave at once, past a's
    cursor.  They come out in their queue's order (a1 before a2), each in its place."""
    scene = _Scene(_three_each(), {"b": 50.0, "c": 60.0})
    scene.take(1)
    assert scene.got[0].request_id == "a0"
    a1, a2 = (next(r for r in scene.expected if r.request_id == rid) for rid in ("a1", "a2"))
    scene.leave(a2)
    scene.leave(a1)
    scene.finish()


def _victim_moves(scene, rng, victims: list, enters: bool) -> None:
    """A preempted victim enters the queue at the front (``enters``), or one already there leaves it again."""
    if enters:
        v = _request(f"v{len(victims)}", rng.choice(TENANTS), rng.randint(1, 9))
        victims.append(v)
        scene.enter_front(v)
    elif any(v in scene.queue for v in victims):
        scene.leave(rng.choice([v for v in victims if v in scene.queue]))


@pytest.mark.parametrize("seed", range(40))
def test_random_changes_during_the_pass_leave_the_order_as_listed(seed):
    """Random queues and counters; between requests handed out, random admissions (a handed-out request leaves),
    early leavers (a request not yet handed out leaves), victims entering at the front, and victims leaving again."""
    rng = random.Random(seed)
    reqs = [_request(f"r{i}", rng.choice(TENANTS), rng.randint(1, 9)) for i in range(rng.randint(3, 14))]
    scene = _Scene(reqs, {t: rng.choice((0.0, 3.0, 10.0)) for t in TENANTS})
    victims: list[Request] = []
    for _ in range(len(scene.expected)):
        scene.take()
        for _ in range(rng.randint(0, 2)):
            move = rng.randrange(4)
            waiting = [r for r in scene.queue if r not in victims]
            handed = [r for r in waiting if r in scene.got]
            ahead = [r for r in waiting if r not in scene.got]
            if move == 0 and handed:
                scene.leave(rng.choice(handed))
            elif move == 1 and ahead:
                scene.leave(rng.choice(ahead))
            elif move in (2, 3):
                _victim_moves(scene, rng, victims, enters=move == 2)
    scene.finish()


@pytest.mark.parametrize("seed", range(8))
def test_a_pass_in_which_most_requests_leave_early_in_any_order_hands_them_out_as_listed(seed):
    """Hundreds of requests; after a few are handed out, three quarters of the rest leave before their turn in a
    random order (not their queue order), interleaved with more requests handed out and victims entering and leaving
    at the front.  Every tenant then holds dozens of early leavers at once, and they must come out in their places
    -- what a ghost store that assumed leavers arrive in key order (a plain FIFO) or lost its order when taken from
    gets wrong."""
    rng = random.Random(1000 + seed)
    reqs = [_request(f"r{i}", rng.choice(TENANTS), rng.randint(1, 9)) for i in range(300)]
    scene = _Scene(reqs, {t: rng.choice((0.0, 3.0, 10.0, 40.0)) for t in TENANTS})
    scene.take(rng.randint(0, 5))
    ahead = [r for r in scene.expected if r not in scene.got]
    leavers = rng.sample(ahead, 3 * len(ahead) // 4)
    victims: list[Request] = []
    most_ghosts = 0
    for r in leavers:
        if r in scene.queue:  # not handed out and admitted meanwhile
            scene.leave(r)
        most_ghosts = max([most_ghosts, *map(len, scene.kept._pass.ghosts.values())])
        move = rng.randrange(8)
        if move == 0 and len(scene.got) < len(scene.expected):
            scene.take()
        elif move in (1, 2):
            _victim_moves(scene, rng, victims, enters=move == 1)
    assert most_ghosts >= 30  # the premise: one tenant held many early leavers at once
    scene.finish()
