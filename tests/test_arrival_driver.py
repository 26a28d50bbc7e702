"""The one arrival loop behind the fairness benchmark's ``run`` and lab 6's ``serve`` (:class:`ArrivalDriver`).

Oracles: hand traces on a simulated clock where every step takes exactly 1 s (a fixed overhead and nothing per
token), so each request's times follow from counting steps; the agent rule as the lesson states it (the next call
is sent ``think_s`` after the previous one finished, its prompt the conversation so far plus the tool's tokens);
and the engine's own step log for how many steps ran.
"""

from __future__ import annotations

import random

import pytest

from minivllm.arrival import Arrival
from minivllm.bench import fairness as bench
from minivllm.labs import check_lab06 as lab

ONE_S = dict(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)


def test_lab_and_bench_share_the_driver():
    assert lab.ArrivalDriver is bench.ArrivalDriver


def test_the_labs_the_benchmark_and_the_fleet_make_one_arrival_class():
    """One definition of a timed request: lab 6's workloads, the fairness benchmark's (agents included) and the
    fleet's chats, first turns and the follow-ups made during a run, are all :class:`minivllm.arrival.Arrival`.
    Kills: any of the three makers building a look-alike class of its own again."""
    from minivllm.sim.fleet import ChatMix

    mix = ChatMix(rate=4.0, duration=2.0, answer_s=1.0, seed=1)
    chat = next(a for a in mix.arrivals() if mix.session_turns[a.session] > 1)
    bench_arrivals, _ = bench.cpu_three_class_workload(0, 4.0)
    made = {"lab 6": lab.noisy_quiet(2.0), "benchmark": bench_arrivals,
            "fleet": [*mix.arrivals(), mix.follow_up(chat, [7, 8], 3.0)]}
    assert {name: {type(a) for a in arrivals} for name, arrivals in made.items()} == dict.fromkeys(made, {Arrival})
    assert any(a.session is not None for a in bench_arrivals)


def test_an_idle_engine_jumps_to_the_next_arrival_in_both_callers():
    """Hand trace: r0 (0 s, 2 outputs) runs in [0, 1] (prefill + first token) and [1, 2]; then nothing is in flight
    until r1 arrives at 5.5 s, so the next step starts at exactly 5.5, not later and not at 2: r1's first token
    at 6.5 (TTFT 1 s), its finish at 7.5."""
    arrivals = [Arrival(0.0, "r0", "t", (11, 12, 13, 14), 2), Arrival(5.5, "r1", "t", (11, 12, 13, 14), 2)]
    res = lab.serve(lab.lab_engine(step=ONE_S), arrivals)
    assert res.step_starts == [0.0, 1.0, 5.5, 6.5]
    assert res.first_token == {"r0": 1.0, "r1": 6.5}
    assert res.ttft == {"r0": 1.0, "r1": 1.0}
    assert res.makespan == 7.5

    run = bench.run("fcfs", arrivals, step=ONE_S, window=10.0, blocks=8, max_len=128)
    assert run.steps == 4 and run.clock == 7.5
    assert sorted(o.metrics.ttft for _, o in run.outputs.values()) == [1.0, 1.0]


def test_an_agents_next_call_carries_the_conversation_and_leaves_after_the_finish():
    """Three calls of one session (``calls_left`` 2 after the first), 5 tool tokens and 0.25 s of tool time per
    call: call k+1's prompt is call k's prompt + its answer + 5 tokens, it is sent 0.25 s after call k finished
    (the engine is idle meanwhile, so it starts then), and with 1 s steps its first token comes 1 s later."""
    session = {"calls_left": 2, "rng": random.Random(3), "tool_tokens": 5, "max_tokens": (2, 3), "think_s": 0.25}
    run = bench.run("fcfs", [Arrival(0.0, "agent-s0-c0", "agent", (11, 12, 13, 14), 2, session=0)], step=ONE_S,
                    window=60.0, sessions={0: session}, blocks=16, max_len=256)
    calls = sorted((o for _, o in run.outputs.values()), key=lambda o: o.metrics.arrival_time)
    assert len(calls) == 3
    for prev, nxt in zip(calls, calls[1:]):
        sent = prev.prompt_token_ids + prev.outputs[0].token_ids
        assert nxt.prompt_token_ids[:len(sent)] == sent and len(nxt.prompt_token_ids) == len(sent) + 5
        assert nxt.metrics.arrival_time == prev.metrics.finished_time + 0.25
        assert nxt.metrics.ttft == 1.0
        assert 2 <= len(nxt.outputs[0].token_ids) <= 3
    assert session["calls_left"] == 2  # the caller's session is not used up: a rerun makes the same calls


def test_lab_agent_calls_are_numbered_per_session_and_timed_from_the_finish():
    """Two sessions of two calls each: the follow-up ids are ``<tenant>-s<session>-c1`` and each is sent 0.25 s after
    its session's previous call finished."""
    sessions = {s: {"calls_left": 1, "rng": random.Random(s), "tool_tokens": 5, "max_tokens": (2, 2),
                    "think_s": 0.25} for s in (0, 1)}
    arrivals = [Arrival(0.0, "agent-s0-c0", "agent", (11, 12, 13), 2, session=0),
                Arrival(3.0, "agent-s1-c0", "agent", (21, 22, 23), 3, session=1)]
    res = lab.serve(lab.lab_engine(step=ONE_S), arrivals, sessions=sessions)
    assert res.calls == {0: ["agent-s0-c0", "agent-s0-c1"], 1: ["agent-s1-c0", "agent-s1-c1"]}
    for s in (0, 1):
        first, second = res.calls[s]
        assert res.arrival[second] == res.finished[first] + 0.25
    assert res.finished["agent-s0-c0"] == 2.0 and res.arrival["agent-s0-c1"] == 2.25


@pytest.mark.parametrize("max_steps", [1, 3])
def test_the_step_budget_is_never_exceeded(max_steps):
    """A request of 5 outputs needs 5 steps; with a budget below that the driver stops after exactly ``max_steps``
    of them (the engine's step log counts them), naming the caller."""
    engine = lab.lab_engine(step=ONE_S)
    with pytest.raises(RuntimeError, match=f"the engine did not drain in {max_steps} steps"):
        lab.serve(engine, [Arrival(0.0, "r0", "t", (11, 12, 13, 14), 5)], max_steps=max_steps)
    assert len(engine.step_log) == max_steps
    with pytest.raises(RuntimeError, match=f"fcfs: did not drain in {max_steps} steps"):
        bench.run("fcfs", [Arrival(0.0, "r0", "t", (11, 12, 13, 14), 5)], step=ONE_S, window=1.0, blocks=8,
                  max_len=128, max_steps=max_steps)


def test_a_run_that_drains_on_its_last_allowed_step_is_done():
    """A request of 5 outputs takes exactly 5 steps (one prompt step, then one decode per further token): a budget
    of 5 is enough, so both callers return its 5 tokens instead of calling the drained engine stuck.  Kills: the
    budget checked before asking whether anything is left (the driver's first version raised here)."""
    engine = lab.lab_engine(step=ONE_S)
    res = lab.serve(engine, [Arrival(0.0, "r0", "t", (11, 12, 13, 14), 5)], max_steps=5)
    assert len(engine.step_log) == 5 and len(res.tokens["r0"]) == 5
    run = bench.run("fcfs", [Arrival(0.0, "r0", "t", (11, 12, 13, 14), 5)], step=ONE_S, window=1.0, blocks=8,
                    max_len=128, max_steps=5)
    assert run.steps == 5 and [len(o.outputs[0].token_ids) for _, o in run.outputs.values()] == [5]


def test_a_call_queued_during_the_run_goes_before_a_listed_arrival_at_the_same_time():
    """The order among equal times decides who is first in an FCFS queue, and lab 6's agent and retry tables were
    made with this one: what was queued last goes first.  Hand trace, one seat: the agent's first call runs in
    [0, 1] and [1, 2]; its follow-up and x are both due at 2.25, the follow-up queued during the run, x listed
    from the start.  The follow-up takes the seat (first token 3.25); x waits for its 2 steps (first token 5.25)."""
    sessions = {0: {"calls_left": 1, "rng": random.Random(0), "tool_tokens": 5, "max_tokens": (2, 2),
                    "think_s": 0.25}}
    arrivals = [Arrival(0.0, "agent-s0-c0", "agent", (11, 12, 13), 2, session=0),
                Arrival(2.25, "x", "chat", (21, 22, 23), 2)]
    res = lab.serve(lab.lab_engine(step=ONE_S, max_seqs=1), arrivals, sessions=sessions)
    assert res.first_token == {"agent-s0-c0": 1.0, "agent-s0-c1": 3.25, "x": 5.25}


def test_lab_window_counts_the_steps_that_end_inside_it():
    """The lab's side of the window rule (the benchmark's is in test_fairness.py), by hand: a 4-token prompt with 5
    outputs, 1 s steps, a 2.5 s window: the steps ending at 1 and 2 s are in it (4 prompt tokens, 2 outputs), the
    one ending at 3 s crosses it and is not counted.  The KV share: 1 block held after each step, for 2.5 s of
    the window's 2.5 s, over the pool."""
    engine = lab.lab_engine(step=ONE_S)
    res = lab.serve(engine, [Arrival(0.0, "r0", "t", (11, 12, 13, 14), 5)], window=2.5)
    assert res.window_tokens == {"t": (4, 2)}
    assert res.kv_share("t") == pytest.approx(1 / engine.pool.num_blocks)


def test_a_session_the_driver_has_no_parameters_for_is_refused_before_anything_runs():
    """``session`` is one field for agents and fleet chats; the driver makes only agents' next calls, from
    ``sessions``.  An arrival of a session it was given nothing for (a fleet chat's, or agents with ``sessions``
    forgotten) is a ValueError naming it, raised before the engine takes a request -- not a KeyError when its first
    call finishes, and not a run that quietly drops the session's later calls."""
    from minivllm.sim.fleet import ChatMix

    chat = next(a for a in ChatMix(rate=4.0, duration=2.0, answer_s=1.0, seed=1).arrivals() if a.session is not None)
    engine = lab.lab_engine(step=ONE_S)
    with pytest.raises(ValueError, match=f"arrival {chat.request_id!r} belongs to session {chat.session}"):
        lab.serve(engine, [Arrival(0.0, "r0", "t", (11, 12, 13), 2), chat])
    assert not engine.has_unfinished_requests() and len(engine.step_log) == 0
    agent = Arrival(0.0, "agent-s0-c0", "agent", (11, 12, 13), 2, session=0)
    with pytest.raises(ValueError, match="belongs to session 0"):
        bench.run("fcfs", [agent], step=ONE_S, window=10.0, blocks=8, max_len=128)
