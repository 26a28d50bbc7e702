"""``python -m minivllm.bench host_overhead``: the engine's Python work per decode step does not grow with
output length.

Times on a shared machine move by several per cent between runs, so the exact check is on the Python
bytecodes a step executes (the bench's machine-independent measure): the same at 16 and at 337 output
tokens, for the output kind ``LLM.generate`` uses and for streaming.  A per-step pass over each request's
tokens (the quadratic output copy issue 12 started from) would add thousands per step at the later point.
"""

import pytest

from minivllm.bench.host_overhead import measure, sweep


@pytest.mark.parametrize("kind", ["final_only", "delta"])
def test_python_work_per_step_is_flat_in_output_length(kind):
    row = measure(64, 16, 300, 5, kind)
    assert row["tokens_late"] > 256 + row["tokens_early"]
    assert row["python_opcodes_per_step_early"] == row["python_opcodes_per_step_late"], row


def _collections_in_decode_steps(kind: str, seqs: int, steps: int) -> int:
    import gc

    from minivllm.bench.host_overhead import _engine, _prefill_all

    engine = _engine(seqs, steps + 40, kind)
    _prefill_all(engine)
    for _ in range(20):
        engine.step()
    started = [0]

    def count(phase, info):
        started[0] += phase == "start"

    gc.callbacks.append(count)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        gc.callbacks.remove(count)
    return started[0]


def test_garbage_collector_stays_out_of_final_only_steps_only():
    """The module's claim, both halves: a final_only decode step keeps no small containers alive, so at 256
    sequences 100 steps see about one collection; a delta step makes a RequestOutput and its two objects per
    request (768 here, past the collector's threshold of 700), so it collects at least once a step."""
    assert _collections_in_decode_steps("final_only", 256, 100) <= 2
    assert _collections_in_decode_steps("delta", 256, 20) >= 20


def test_sweep_visits_each_output_length_in_order():
    rows = sweep(16, [40, 8, 300], samples=3, prompt_len=300)
    assert [r["output_tokens"] for r in rows] == [8, 40, 300]
    assert [r["total_tokens"] for r in rows] == [308, 340, 600]
    assert all(r["host_cpu_us_median"] > 0 and r["prep_cpu_us_median"] > 0 for r in rows)


def test_admission_beside_a_capped_backlog_does_little_per_waiting_request():
    """A step beside requests waiting on a three_class cap costs nothing per waiting request: the policy keeps
    its order as the queue changes (KeepsOrder) and admission stops walking it once every waiting tenant is
    passed over.  The opcode count is exact: 0.0 per waiting request; 12.5 when the policy re-sorts the queue
    every step; 20.6 if admission also walks on, skipping each; 70.6 with only the per-tenant memo of the smallest
    cap failure; 155.0 with neither."""
    from minivllm.bench.host_overhead import backlog

    rows = backlog([16, 500], samples=3)
    assert rows[0]["running"] == rows[1]["running"] and rows[1]["waiting"] - rows[0]["waiting"] == 484, rows
    assert rows[1]["opcodes_per_waiting_request"] < 1, rows


def test_wfq_beside_a_backlog_does_little_per_waiting_request():
    """WFQ beside requests waiting for KV blocks: it keeps each tenant's queue as the scheduler's changes and
    hands out its merge lazily, so a step where admission looks at one request does not regroup and merge the
    whole backlog.  The opcode count is exact: 0.0 per waiting request; 104 if the order is built from the queue
    every step (the kept path switched off); 129 before the policy kept it."""
    from minivllm.bench.host_overhead import backlog

    rows = backlog([16, 500], samples=3, policy="wfq")
    assert rows[0]["running"] == rows[1]["running"] == 32 and rows[1]["waiting"] - rows[0]["waiting"] == 484, rows
    assert rows[1]["opcodes_per_waiting_request"] < 1, rows


def test_fcfs_beside_a_backlog_walks_no_waiting_request_in_python():
    """FCFS beside requests waiting for KV blocks: admission stops at the head, and the copy of the queue it walks
    is made in C.  The opcode count is exact: 0.0 per waiting request; 4.4 if the policy's order is built in Python
    (``[r for r in waiting]``), more if admission walked past the head."""
    from minivllm.bench.host_overhead import backlog

    rows = backlog([16, 500], samples=3, policy="fcfs")
    assert rows[0]["running"] == rows[1]["running"] == 32 and rows[1]["waiting"] - rows[0]["waiting"] == 484, rows
    assert rows[1]["opcodes_per_waiting_request"] < 1, rows


@pytest.mark.parametrize("policy", ["three_class", "fcfs", "wfq", "priority"])
def test_backlog_engine_holds_its_running_set_through_the_measured_steps(policy):
    """The backlog rows are "what admission pays per waiting request", so the steps they measure (8 counted, 14
    timed) must admit and preempt nothing.  By hand: a 112-token prompt takes 7 blocks of 16; its first sampled
    token takes an 8th at position 112, and positions 113-127 fit there, so 15 decode steps follow before a 9th.
    One step in, 37 prompts held 7 blocks each and the next step preempted 5; under a three_class cap with 7 blocks
    spare a fresh prompt was admitted every third step and preempted the next."""
    from minivllm.bench.host_overhead import backlog_engine

    engine = backlog_engine(16, running=32, policy=policy)
    held = {r.request_id: len(r.block_ids) for r in engine.scheduler.running}
    assert len(held) == 32 and set(held.values()) == {8}, held
    for _ in range(15):
        engine.step()
        record = engine.step_log[-1]
        assert not record.preempted and record.running == 32 and record.waiting == 16, record
    assert {r.request_id: len(r.block_ids) for r in engine.scheduler.running} == held
