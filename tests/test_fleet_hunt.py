"""The fleet's windowed summary against a recount from its own per-request records (found by the fleet
semantics hunt): with ``window=(t0, t1)`` only requests arriving in the window count, so the per-replica
request counts and hit rates must be those of the window's requests, as the fleet-wide hit rate already is.
"""

from __future__ import annotations

import pytest

from minivllm.sim.fleet import ChatMix, FleetArrival, Fleet, run_fleet
from minivllm.sim.router import RoundRobinRouter

import test_fleet  # noqa: E402  (tests/ is on sys.path): its small replica and chat mix
from test_fleet import small_replica  # noqa: E402


def small_mix(rate=8.0, duration=2.0, seed=4):
    return test_fleet.small_mix(rate, duration, seed)


def recount(res, window, num_replicas):
    """Per replica: the window's requests placed there, and their cached prompt tokens over looked-up ones."""
    t0, t1 = window
    requests, hits, looked = [0] * num_replicas, [0] * num_replicas, [0] * num_replicas
    for rid, k in res.placement.items():
        r = res.result(rid)
        if not t0 <= r.arrival < t1 or rid not in res.cached_tokens:  # (outside, or refused at the door)
            continue
        requests[k] += 1
        hits[k] += res.cached_tokens[rid]
        looked[k] += r.prompt_len
    return requests, [h / q if q else 0.0 for h, q in zip(hits, looked)]


def test_the_windowed_per_replica_requests_and_hit_rates_are_the_windows_own():
    """The bench's rows put ``replica_hit_rate`` beside the windowed ``prefix_hit_rate``, and lab 9 prints
    ``replica_requests`` of a windowed summary as the requests each replica got; both were whole-run counters
    (the committed L4 study's one-replica row: fleet hit rate 65.2%, its only replica's 36.8%; 495 requests per
    replica in a window of 110).  Oracle: the recount from placement and cached tokens."""
    mix = small_mix()
    res = run_fleet(mix, 2, "round_robin", engine_factory=small_replica)
    s = res.summary(window=mix.window)
    requests, hit_rates = recount(res, mix.window, 2)
    assert 0 < sum(requests) == s["requests"] < len(res.results)
    assert s["replica_requests"] == requests
    assert s["replica_hit_rate"] == pytest.approx(hit_rates, rel=1e-12)


def test_a_one_replica_fleets_windowed_hit_rate_is_its_replicas():
    mix = small_mix(seed=5)
    res = run_fleet(mix, 1, "round_robin", engine_factory=small_replica)
    s = res.summary(window=mix.window)
    assert s["replica_hit_rate"] == [pytest.approx(s["prefix_hit_rate"], rel=1e-12)]
    assert s["replica_requests"] == [s["requests"]]


def test_without_a_window_or_with_one_holding_everything_the_per_replica_figures_are_the_engines():
    """A request refused at the door was never admitted: it counts neither as a replica's request nor as a
    lookup, in the engines' counters and in the window's recount alike."""
    shared = tuple(range(10, 74))
    arrivals = [FleetArrival(0.5 * i, f"q{i}", shared + tuple(range(100 * i, 100 * i + 4)), 4) for i in range(6)]
    arrivals.insert(3, FleetArrival(1.2, "long", tuple([11] * 5000), 4))
    res = Fleet(2, RoundRobinRouter(), engine_factory=small_replica).run(arrivals)
    assert res.result("long").outcome == "error"
    whole, everything = res.summary(), res.summary(window=(-1.0, 1e9))
    assert everything["replica_requests"] == whole["replica_requests"] == [r.requests for r in res.replicas]
    assert everything["replica_hit_rate"] == pytest.approx(whole["replica_hit_rate"], rel=1e-12)


@pytest.mark.parametrize("rate, seed", [(6.0, 0), (10.0, 2)])
def test_the_default_chat_mix_window_is_the_steady_state_with_every_turn_in_it(rate, seed):
    """``ChatMix`` promises that its warm-up (about one session's length) brings the fleet to the steady state
    the window measures, at about ``rate`` requests per second.  Its warm-up assumed one-second answers; the
    default 32-160 output tokens take about 5 s at a 50 ms decode step (the default replica, lightly loaded
    here: 4 replicas for 6-10 requests/s), so a chat's last turn arrived only after the window and the window
    measured a ramp of first and second turns at about half the rate.  Oracle: in the steady state every turn
    of a chat arrives at the same rate, and all of them add up to ``rate``."""
    mix = ChatMix(rate, 6.0, seed=seed)
    res = run_fleet(mix, 4, "round_robin")
    t0, t1 = mix.window
    turns = [0] * mix.turns
    for rid in res.placement:
        if t0 <= res.result(rid).arrival < t1:
            turns[int(rid.split("t")[-1])] += 1
    assert min(turns) > 0, turns
    assert abs(sum(turns) / (t1 - t0) - rate) <= 0.25 * rate, turns
