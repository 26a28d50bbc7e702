"""Lab 5's measured claims: when swap pays (the host tier's size, how long victims stay in it).

The oracle for the host-tier sweep is the engine's own rule, checked from the outside: ``swap_out`` moves a
victim's computed blocks all or none, so with no room for any victim every preemption must be a recompute, with
a tier larger than the whole workload's need every one must be a swap, and in between each attempt must go
exactly when the blocks it needed were free.  The per-step observations are cross-checked against the engine's
counters and against each other (Little's law: the area under the occupancy curve equals the sum over stays of
blocks x time).  The quiz's "why" quotes numbers from this sweep; the last test keeps them true.
"""

import json

import pytest

from minivllm.labs.check_lab05 import (
    BLOCK_SIZE,
    host_tier_run,
    lab_engine,
    overload_workload,
    serve,
)
from minivllm.labs.quiz import load_bank

ARRIVALS = overload_workload()


@pytest.fixture(scope="module")
def runs():
    return {n: host_tier_run(n, ARRIVALS) for n in (0, 1, 16, 32, 2048)}


@pytest.mark.parametrize("blocks", [0, 1])
def test_a_host_tier_too_small_for_any_victim_recomputes_every_preemption(runs, blocks):
    run = runs[blocks]
    s = run.result.stats
    assert s["num_preemptions"] > 0
    assert all(a.blocks > blocks for a in run.attempts), "every victim needs more blocks than the tier has"
    assert run.swapped == [] and s["num_swap_preemptions"] == 0
    assert len(run.fell_back) == s["num_recompute_preemptions"] == s["num_preemptions"]
    assert s["recomputed_tokens"] > 0 and s["swapped_out_blocks"] == 0
    assert run.peak_blocks == 0 and run.stays == []


def test_swap_mode_without_a_host_tier_is_recompute_mode(runs):
    """The silent fallback, end to end: the same preemptions, the same recomputed tokens, the same latencies."""
    plain = serve(lab_engine(preemption_mode="recompute"), ARRIVALS)
    fell_back = runs[0].result
    assert fell_back.stats["recomputed_tokens"] == plain.stats["recomputed_tokens"]
    assert fell_back.latency == plain.latency


def test_a_large_host_tier_swaps_every_victim_and_gets_all_of_them_back(runs):
    run = runs[2048]
    s = run.result.stats
    assert s["num_preemptions"] > 0
    assert len(run.swapped) == s["num_swap_preemptions"] == s["num_preemptions"]
    assert run.fell_back == [] and s["recomputed_tokens"] == 0
    assert len(run.stays) == len(run.swapped)  # every victim came back ...
    assert sum(st.blocks for st in run.stays) == s["swapped_out_blocks"] == s["swapped_in_blocks"]
    assert s["cpu_blocks_used"] == 0 and run.occupancy[-1][1] == 0  # ... and left nothing in the tier
    assert 0 < run.peak_blocks <= 2048


@pytest.mark.parametrize("blocks", [16, 32])
def test_each_attempt_swaps_exactly_when_its_blocks_are_free(runs, blocks):
    run = runs[blocks]
    assert run.swapped and run.fell_back, "a middle-sized tier should do both"
    for a in run.attempts:
        assert a.swapped == (a.blocks <= a.host_free), a
    assert all(b <= blocks for _, b in run.occupancy)
    s = run.result.stats
    assert len(run.swapped) == s["num_swap_preemptions"] and len(run.fell_back) == s["num_recompute_preemptions"]
    # a fallback recomputes what the victim had computed: its blocks' worth of tokens, at most
    assert s["recomputed_tokens"] <= sum(a.blocks * BLOCK_SIZE for a in run.fell_back)


def test_swapped_victims_come_back_ahead_of_new_requests_and_littles_law_holds(runs):
    run = runs[2048]
    assert run.stays and run.admitted_while_swapped == 0
    for st in run.stays:
        assert st.wait_steps >= 2 and st.wait_s > 0  # nothing is admitted in the step after a preemption
    area, by_stay = run.block_seconds()
    assert area == pytest.approx(by_stay, rel=1e-9) and area > 0
    # the observer really can see a newcomer pass: every request started exactly once, in the step log
    first = {}
    for rec in run_engine_log(2048):
        for rid in rec.seq_ids:
            first.setdefault(rid, rec.time)
    for st in run.stays:
        passed = [rid for rid, t in first.items() if st.out_time < t < st.in_time]
        assert passed == [], (st, passed)


def run_engine_log(blocks):
    """The step log of the same run, read independently of the observer (the first step of each request)."""
    engine = lab_engine(preemption_mode="swap", num_cpu_blocks=blocks)
    serve(engine, ARRIVALS)
    return list(engine.step_log)


def test_the_quiz_quotes_the_sweep(runs):
    q = next(q for q in load_bank(5) if q["id"] == "host-tier-full")
    why = q["why"] + json.dumps(q["answers"])
    r16, big = runs[16], runs[2048]
    assert (len(r16.swapped), len(r16.fell_back), r16.result.stats["recomputed_tokens"]) == (8, 17, 8353)
    assert "swapped 8 victims and recomputed 17 (8,353 tokens)" in why
    assert len(big.swapped) == 24 and f"all {len(big.swapped)} were swapped" in why
    assert host_tier_run(64, ARRIVALS).fell_back == []
    assert big.peak_blocks == 61 and "needed 61 host blocks at its peak" in why
