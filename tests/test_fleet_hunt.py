"""The fleet's windowed summary against a recount from its own per-request records (found by the fleet
semantics hunt): with ``window=(t0, t1)`` only requests arriving in the window count, so the per-replica
request counts and hit rates must be those of the window's requests, as the fleet-wide hit rate already is.
At the end, from a later mutation hunt: ChatMix's think times and single-question tenant, and the default
replica's costs against the datasheet they claim.
"""

from __future__ import annotations

import pytest

from minivllm.arrival import Arrival
from minivllm.sim.fleet import ChatMix, Fleet, FleetResult, ReplicaStats, run_fleet, sim_replica
from minivllm.sim.router import PrefixAffinityRouter, RoundRobinRouter

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
    arrivals = [Arrival(0.5 * i, f"q{i}", "default", shared + tuple(range(100 * i, 100 * i + 4)), 4) for i in range(6)]
    arrivals.insert(3, Arrival(1.2, "long", "default", tuple([11] * 5000), 4))
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


class _RecordingAffinity(PrefixAffinityRouter):
    """Prefix affinity that notes, per routing call (the fleet routes in arrival order, and a result's ``index``
    is that order), whether it sent the request somewhere other than the ring's owner."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.away = []

    def route(self, prompt_token_ids, loads):
        k = super().route(prompt_token_ids, loads)
        self.away.append(k != self.owner(prompt_token_ids))
        return k


def test_the_windowed_spill_preemption_and_busy_figures_are_the_windows_own():
    """``bench fleet`` prints spills and preemptions beside the window's rates, and ``replica_busy_fraction`` sits
    beside them in its JSON; all three were the whole run's (warm-up and drain included) and the spill count was
    the router's lifetime counter.  Oracles: the router's own record of each request it sent away from its owner,
    the replicas' step logs (each request id a step preempted), and busy time recounted from hand-made spans."""
    mix = ChatMix(12.0, 3.0, seed=2, system_len=64, user_range=(32, 64), output_range=(8, 24), turns=3,
                  think_s=(0.2, 0.6))
    router = _RecordingAffinity(2, key_blocks=4, spill_factor=1.0, min_spill_tokens=0)  # one key: spills
    fleet = Fleet(2, router, engine_factory=lambda ex: sim_replica(ex, **{**test_fleet.SMALL, "num_blocks": 32}))  # tight: preemptions
    res = fleet.run(mix.arrivals(), follow_up=mix.follow_up)
    t0, t1 = mix.window
    inside = {r.index for r in res.results if t0 <= r.arrival < t1}
    ids = {rid for rid, i in res._index.items() if i in inside}
    spills = sum(1 for i, away in enumerate(router.away) if away and i in inside)
    preempted = sum(rid in ids for e in fleet.engines for rec in e.step_log for rid in rec.preempted)
    whole, s = res.summary(), res.summary(window=mix.window)
    assert 0 < spills < whole["spilled"] == sum(router.away)
    assert 0 < preempted < whole["preemptions"]
    assert (s["spilled"], s["preemptions"]) == (spills, preempted)
    everything = res.summary(window=(-1.0, 1e9))
    assert everything["replica_busy_fraction"] == pytest.approx([r.busy_s / (1e9 + 1) for r in res.replicas])

    made = FleetResult([], [ReplicaStats(busy_s=2.0, step_spans=[(0.0, 1.0), (2.0, 3.0)])], {}, {}, 3.0)
    assert made.summary(window=(0.5, 2.5))["replica_busy_fraction"] == [pytest.approx(0.5)]  # 0.5 + 0.5 of 2 s
    assert made.summary()["replica_busy_fraction"] == [pytest.approx(2 / 3)]


def test_the_chat_mix_warm_up_counts_answers_at_the_replicas_own_decode_step():
    """``ChatMix``'s docstring: an answer's default ``answer_s`` is its mean output tokens at the decode step the
    replicas' executor predicts for a full batch of mid-session chats.  It was a fixed 60 ms whatever the fleet
    ran, so an L4 fleet's warm-up was too short (a ramp in the window) and an H100's far too long.  Oracle: the
    roofline model itself, priced here from ``step_cost``/``roofline_time`` on the same (start, tokens, samples)
    rows, not through the executor: the L4 (300 GB/s) steps slower than the H100 (3.35 TB/s), so its answers and
    warm-up are longer; an explicit ``answer_s`` still wins."""
    from minivllm.sim.fleet import REPLICA, roofline_factory
    from minivllm.sim.presets import hardware_preset, simulated_shape
    from minivllm.sim.roofline import roofline_time, step_cost

    kw = dict(seed=0, system_len=256, turns=4, user_range=(64, 256), output_range=(200, 400))  # answers above 1 s
    context = round(256 + 4 * (64 + 256 + 200 + 400) / 4)  # the system prompt and half a session, at the means
    answers = {}
    for hw in ("l4", "h100"):
        spec = hardware_preset(hw)
        shape = simulated_shape("llama-3-8b", spec)
        step = roofline_time(step_cost(shape, [(context - 1, 1, True)] * REPLICA["max_num_seqs"]), shape, spec).total
        mix = ChatMix(10.0, 2.0, executor_factory=roofline_factory(hw), **kw)
        answers[hw] = mix.warmup / (4 - 1) - 2.0  # warmup = (turns - 1) * (mean think 2 s + answer_s)
        assert answers[hw] == pytest.approx(step * 300, rel=1e-9), hw
    assert answers["l4"] > 4 * answers["h100"] > 4.0, answers
    fixed = ChatMix(10.0, 2.0, executor_factory=roofline_factory("l4"), answer_s=3.0, **kw)
    assert fixed.warmup == pytest.approx(3 * (2.0 + 3.0))


def test_a_chats_next_turn_arrives_a_uniform_think_time_after_the_answer():
    """``ChatMix``'s next turn arrives a think time after the previous answer finished, drawn from ``think_s``
    (seeded per session and turn); the warm-up counts its mean, (low + high) / 2.  Oracle: the uniform
    distribution on (1, 3) s: every gap inside it, the sample mean near 2 s (within 0.15 s: ~6 standard
    errors for ~100 draws) and the draws not all one value.  Kills: a think time fixed at one end of the range."""
    mix = ChatMix(8.0, 30.0, seed=1, turns=3, think_s=(1.0, 3.0), answer_s=1.0)
    gaps = []
    for a in mix.arrivals():
        nxt = mix.follow_up(a, [11, 12], finished_at=a.time + 5.0)
        if nxt is not None:
            assert nxt.prompt == a.prompt + (11, 12) + nxt.prompt[len(a.prompt) + 2:]
            gaps.append(nxt.time - (a.time + 5.0))
    assert len(gaps) >= 80
    assert all(1.0 - 1e-6 <= g <= 3.0 + 1e-6 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(2.0, abs=0.15)
    assert max(gaps) - min(gaps) > 1.0


def test_the_default_replica_costs_are_llama_3_8b_on_an_l4_by_hand():
    """``GPU_LIKE`` claims a Llama-3-8B-class model (fp16) on an L4-class GPU.  Oracle, by hand from the NVIDIA
    L4 datasheet (121 TFLOP/s dense BF16/FP16, 300 GB/s) and Llama-3-8B's config (8.03e9 parameters; 32 layers x
    8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB of KV a token): a step reads the 16 GB of weights, 53 ms;
    a prompt token costs 2 x 8.03e9 FLOPs, 133 us; a context token's KV read, 0.44 us.  Each cost within 15%.
    Kills: a unit slip in any of the three (10x)."""
    from minivllm.sim.fleet import GPU_LIKE

    weights_s = 2 * 8.03e9 / 300e9
    token_s = 2 * 8.03e9 / 121e12
    kv_s = 32 * 8 * 128 * 2 * 2 / 300e9
    assert GPU_LIKE["fixed_overhead_s"] == pytest.approx(weights_s, rel=0.15)
    assert GPU_LIKE["per_token_s"] == pytest.approx(token_s, rel=0.15)
    assert GPU_LIKE["per_context_token_s"] == pytest.approx(kv_s, rel=0.15)


def test_single_questions_are_their_own_tenant_at_the_single_shot_share():
    """A session of one turn is tenant ``single``, one of several turns tenant ``chat`` (per-tenant tables tell
    them apart), and ``single_shot_share`` of the sessions are single.  Oracle: each session's drawn turn count,
    and the share (0.3) within 0.08 over the ~270 sessions (about 3 standard errors)."""
    mix = ChatMix(20.0, 30.0, seed=2, turns=4, single_shot_share=0.3, answer_s=1.0)
    firsts = mix.arrivals()
    assert len(firsts) >= 150
    for a in firsts:
        assert a.tenant == ("single" if mix.session_turns[a.session] == 1 else "chat")
    share = sum(a.tenant == "single" for a in firsts) / len(firsts)
    assert share == pytest.approx(0.3, abs=0.08)
