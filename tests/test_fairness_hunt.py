"""A semantics hunt on the fairness policies: each test holds a policy to what its docstring, the README or lab 6
promises, with its own oracle (the arithmetic of a scripted workload), on the simulated executor.

Two promises were broken: a request whose whole prompt was over the token budget left (chunked prefill off)
preempted running work to get a seat it had, though the token budget is never a reason to preempt; and a victim
preempted to seat a better-ranked request was passed, in the same admission, by a request ranked behind it.
"""

from __future__ import annotations

import pytest

from minivllm.config import TenantConfig

from invariants import assert_no_leak, drain  # noqa: E402  (tests/ is on sys.path)
from test_fairness import add, make_engine  # noqa: E402


@pytest.mark.parametrize("policy", ["priority", "three_class"])
def test_a_whole_prompt_short_of_token_budget_waits_and_preempts_no_one(policy):
    """Priority preempts "to seat a higher-priority request when ``max_num_seqs`` or KV is the limit" (the
    module docstring), and "the token budget is never a reason to preempt" (``_victims_could_make_room``; lab 6:
    "wait for token budget, which the engine never preempts for").  Here neither seats nor KV is the limit: 12
    seats for 11 requests, and 64 blocks for ten 11-token decodes (3 blocks each) plus a 60-token prompt (15).
    Only the budget is: ten decodes leave 54 of 64 tokens, and with chunked prefill off the 60-token prompt
    needs all of them in one step.  So the urgent request waits until the decodes finish, and nothing is
    preempted.  (It used to preempt six decodes, each to be prefilled again, for one token of budget apiece.)"""
    tenants = {"lo": TenantConfig(priority_class="batch"), "hi": TenantConfig(priority_class="interactive")}
    engine = make_engine(policy, tenants if policy == "three_class" else None, num_blocks=64, budget=64,
                         max_seqs=12, enable_chunked_prefill=False)
    for i in range(10):
        add(engine, "lo", 4, 8, f"lo{i}", priority=5)
    for _ in range(3):
        engine.step()
    add(engine, "hi", 60, 2, "hi", priority=0)
    drain(engine)
    assert [r.preempted for r in engine.step_log if r.preempted] == []
    first = next(i for i, r in enumerate(engine.step_log) if any(rid == "hi" for rid, _, _ in r.seqs))
    assert sum(1 for rid, _, n in engine.step_log[first].seqs if rid != "hi") <= 4  # 4 decodes + 60 = 64
    assert_no_leak(engine)


def test_a_victim_preempted_to_seat_a_better_request_is_not_passed_by_a_worse_one():
    """Priority is "lower first, ties by arrival", admission stops at the first request that cannot start, and a
    running request is preempted only for a better-ranked one.  A pass that preempts "mid" (priority 1) to seat
    "hi" (priority 0) must not then admit "lo" (priority 2) into the room "mid" gave up: "lo" would run while the
    request ranked ahead of it waits.  Oracle: the priorities the test gave.  Pool of 16 blocks; "mid" (56 + 8
    tokens) holds 15 of them after four steps, so "hi" (6 tokens, 2 blocks) needs "mid" to go; the 14 blocks left
    would take "lo" too, but not "mid" again beside "hi".  So "hi" runs, then "mid", then "lo".  It used to
    admit "lo" with "hi", and "mid" ran again only once "lo" was done."""
    engine = make_engine("priority", num_blocks=16, budget=64, max_seqs=4)
    add(engine, "t", 56, 8, "mid", priority=1)
    for _ in range(4):
        engine.step()
    assert engine.pool.num_free == 1
    add(engine, "t", 6, 4, "hi", priority=0)
    add(engine, "t", 6, 4, "lo", priority=2)
    drain(engine)
    assert [r.preempted for r in engine.step_log if r.preempted] == [("mid",)]
    back = next(i for i, r in enumerate(engine.step_log) if r.preempted)
    start = {rid: min(i for i, r in enumerate(engine.step_log) if i >= back and any(s[0] == rid for s in r.seqs))
             for rid in ("hi", "mid", "lo")}
    assert start["hi"] < start["mid"] < start["lo"], start
    assert_no_leak(engine)
