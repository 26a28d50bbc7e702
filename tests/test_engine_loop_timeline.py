"""The engine loop's clock readings, step log and stall watchdog, against timelines worked out by hand.

Why: a mutation pass over ``LLMEngine`` (its ``append``/``finish``/``log_step``/``add_request``) found
changes that every existing test let through although a user sees them: a finished request's
``metrics.finished_time`` left ``None``, a first-token time overwritten by every later token, TTFT and
end-to-end latency measured from the first schedule instead of the arrival, the step log written before
the finished requests gave their blocks back (or counting cached idle blocks as free), the step-time
average's weights swapped, a second deadlock failed after one step instead of :data:`STALL_STEPS`, a
sub-millisecond retry hint rounded to 0, a reject-mode hint that waits for the wrong running request,
swapped-in bytes counted from the swap-outs, and waiting requests counted as running in ``stats()``.

The oracle is the simulated executor's published cost model (``fixed_overhead + per_token * tokens +
per_context_token * context``, see :mod:`minivllm.sim.executor`) evaluated by hand for each step, the
block arithmetic of small prompts in 4-token blocks, the block moves the executor was handed, and replays
(re-submit a rejected request k steps later).  Nothing here reads the engine's own clock
bookkeeping to compute what it should be.
"""

from __future__ import annotations

import pytest

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import STALL_STEPS, LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor

BLOCKS = 64
# The simulated executor's defaults: 10 ms a step, 0.4 ms a token, 2 us per context token read.
PREFILL3 = 0.010 + 3 * 0.0004 + 3 * 0.000002  # a 3-token prompt from position 0: context 3
DECODE4 = 0.010 + 1 * 0.0004 + 4 * 0.000002  # the decode of token 4 (position 3): context 4
TWO = SamplingParams(max_tokens=2, ignore_eos=True)


def _engine(**seams) -> tuple[LLMEngine, SimulatedExecutor]:
    ex = SimulatedExecutor()
    cfg = EngineConfig(num_gpu_blocks_override=BLOCKS, block_size=4, max_model_len=64, max_num_seqs=1,
                       enable_prefix_caching=False, device="cpu")
    return LLMEngine(cfg, executor=ex, tokenizer=None, model_max_len=64, eos_token_ids=set(), **seams), ex


def _finals(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_timestamps_of_a_queued_request_follow_the_hand_worked_timeline():
    """One seat (``max_num_seqs=1``), two 3-token prompts that arrive at 0 and want 2 tokens each: ``a`` runs
    steps 1-2, ``b`` waits for the seat and runs steps 3-4.  Hand-worked:
    a: first token at P, finished at P + D;  b: scheduled at P + D (the end of a's last step), first token
    at 2P + D, finished at 2P + 2D; every latency is measured from the arrival at 0."""
    engine, _ = _engine()
    for rid, first in (("a", 11), ("b", 21)):
        engine.add_request({"prompt_token_ids": [first, first + 1, first + 2]}, TWO, rid, arrival_time=0.0)
    finals = _finals(engine)
    P, D = PREFILL3, DECODE4
    a, b = finals["a"].metrics, finals["b"].metrics
    assert a.first_token_time == pytest.approx(P) and a.token_times == pytest.approx([P, P + D])
    assert a.finished_time == pytest.approx(P + D) and a.e2e_latency == pytest.approx(P + D)
    assert b.queue_time == pytest.approx(P + D)
    assert b.first_token_time == pytest.approx(2 * P + D) and b.ttft == pytest.approx(2 * P + D)
    assert b.finished_time == pytest.approx(2 * P + 2 * D) and b.e2e_latency == pytest.approx(2 * P + 2 * D)
    assert b.itls == pytest.approx([D])


def test_the_step_log_shows_the_pool_and_queues_after_the_step_s_finished_requests_left():
    """The step log records the state *after* the step (``minivllm.metrics.step_log``): in the step where
    ``a`` ends, its one block (3 prompt tokens + 1 in a 4-token block) is already back and it no longer
    counts as running.  Hand count per step: 1: a holds 1 block, b waits; 2: a ended, b still waits (the
    seat frees only at step 3's admission); 3: b holds 1 block; 4: b ended, nothing left."""
    engine, _ = _engine()
    for rid, first in (("a", 11), ("b", 21)):
        engine.add_request({"prompt_token_ids": [first, first + 1, first + 2]}, TWO, rid, arrival_time=0.0)
    _finals(engine)
    got = [(r.free_blocks, r.running, r.waiting) for r in engine.step_log]
    assert got == [(BLOCKS - 1, 1, 1), (BLOCKS, 0, 1), (BLOCKS - 1, 1, 0), (BLOCKS, 0, 0)]


def test_an_idle_gap_before_an_arrival_is_not_counted_as_step_time():
    """``step_time_s`` (the average retry hints use) is a moving average of step durations with weight 0.2
    on the newest.  After the engine ran dry at P + D, the clock idles to t = 100 and ``c`` arrives: its
    step (a 5-token prefill) lasts 0.01201 s, not the 99.98 s since the last step ended (see
    ``LLMEngine._observe_step``).  (Three unequal durations: with P, D, P the weights 0.2 and 0.8 swapped give
    the same average, and the test could not tell them apart.)"""
    engine, ex = _engine()
    engine.add_request({"prompt_token_ids": [11, 12, 13]}, TWO, "a", arrival_time=0.0)
    _finals(engine)
    ex.advance_to(100.0)
    engine.add_request({"prompt_token_ids": [31, 32, 33, 34, 35]}, SamplingParams(max_tokens=1, ignore_eos=True), "c")
    finals = _finals(engine)
    prefill5 = 0.010 + 5 * 0.0004 + 5 * 0.000002
    assert finals["c"].metrics.finished_time == pytest.approx(100.0 + prefill5)
    expected = None
    for dt in (PREFILL3, DECODE4, prefill5):
        expected = dt if expected is None else 0.8 * expected + 0.2 * dt
    assert engine.step_time_s == pytest.approx(expected)


def test_a_second_deadlock_gets_its_own_stall_steps_before_it_is_failed():
    """The watchdog fails stuck requests after :data:`STALL_STEPS` steps in a row without progress.  After it
    fired once, a request that arrives next under the same deadlocked policy must get a full run of
    :data:`STALL_STEPS` steps too (it may yet be admitted), not fail on its first step because the count
    from the first stall went on."""

    class AdmitsNoOne:
        def order(self, waiting, running):
            return []

    engine, _ = _engine(admission_policy=AdmitsNoOne())
    engine.add_request({"prompt_token_ids": [11, 12, 13]}, TWO, "first")
    for _ in range(STALL_STEPS - 1):
        assert engine.step() == []
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["error"]
    engine.add_request({"prompt_token_ids": [21, 22, 23]}, TWO, "second")
    for _ in range(STALL_STEPS - 1):
        assert engine.step() == []
    assert [(o.request_id, o.outputs[0].finish_reason) for o in engine.step()] == [("second", "error")]
    assert engine.stats()["num_stalls"] == 2


def test_a_retry_hint_under_a_millisecond_is_rounded_up_to_one_not_down_to_zero():
    """A tenant at its seat cap with ``over_cap="reject"`` turns a second request away with a hint: the steps
    until its running member finishes times the step time.  On an executor whose steps take ~10 us, that is
    9 steps x ~10 us = ~0.09 ms, which rounds to 0.000 s at millisecond precision; a hint of 0 tells the
    client to retry at once into the same full seat, and the engine promises a hint > 0 (``_hint``: never
    below 1 ms).  Hand-worked: 0.001."""
    from minivllm.config import TenantConfig

    fast = SimulatedExecutor(fixed_overhead_s=1e-5, per_token_s=1e-8, per_context_token_s=0.0)
    cfg = EngineConfig(num_gpu_blocks_override=BLOCKS, block_size=4, max_model_len=64, max_num_seqs=4,
                       scheduling_policy="caps", tenants={"bulk": TenantConfig(max_running=1, over_cap="reject")},
                       device="cpu")
    engine = LLMEngine(cfg, executor=fast, tokenizer=None, model_max_len=64, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": [5] * 8}, SamplingParams(max_tokens=10, ignore_eos=True), "b0",
                       tenant="bulk")
    engine.step()
    engine.step()  # b0 has 9 tokens to go
    engine.add_request({"prompt_token_ids": [6] * 8}, SamplingParams(max_tokens=4, ignore_eos=True), "b1",
                       tenant="bulk")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["b1"].outputs[0].finish_reason == "rejected"
    assert engine.step_time_s < 2e-5  # the premise: 9 such steps are far below a millisecond
    assert outs["b1"].retry_after_s == 0.001


def test_stats_count_running_and_waiting_apart_overall_and_per_tenant():
    """One seat, two requests: after the first step one runs (holding one 4-token block for its 3-token
    prompt) and one waits.  Hand count: 1 running, 1 waiting, overall and for the tenant."""
    engine, _ = _engine()
    for rid, first in (("a", 11), ("b", 21)):
        engine.add_request({"prompt_token_ids": [first, first + 1, first + 2]}, TWO, rid, arrival_time=0.0)
    engine.step()
    stats = engine.stats()
    assert (stats["num_running"], stats["num_waiting"]) == (1, 1)
    tenant = stats["per_tenant"]["default"]
    assert (tenant["num_running"], tenant["num_waiting"], tenant["kv_blocks"]) == (1, 1, 1)


def test_swapped_bytes_are_the_block_moves_the_executor_was_handed_times_its_block_size():
    """Three requests outgrow an 8-block pool in swap mode, so decode growth swaps one out and later back
    in.  The oracle counts the block moves each step handed the executor and multiplies by the executor's
    own KV bytes per block; the engine's swap counters in ``stats()`` must say the same, in each direction."""
    moved = {"in": 0, "out": 0}

    class Counting(SimulatedExecutor):
        def execute(self, batch):
            moved["in"] += len(batch.moves.swap_in)
            moved["out"] += len(batch.moves.swap_out)
            return super().execute(batch)

    ex = Counting(kv_bytes_per_block=3000)
    cfg = EngineConfig(num_gpu_blocks_override=8, num_cpu_blocks_override=16, block_size=4,
                       max_num_batched_tokens=32, max_num_seqs=4, max_model_len=32, preemption_mode="swap",
                       enable_prefix_caching=False, device="cpu")
    engine = LLMEngine(cfg, executor=ex, tokenizer=None, model_max_len=32, eos_token_ids=set())
    for i in range(3):
        engine.add_request({"prompt_token_ids": [10 + i] * 6}, SamplingParams(max_tokens=12, ignore_eos=True), f"r{i}")
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        seen.append((stats["swapped_out_bytes"], stats["swapped_in_bytes"]))
        assert seen[-1] == (moved["out"] * 3000, moved["in"] * 3000), len(seen)
    # the premise: both directions ran, and at some step more had gone out than come back
    assert moved["in"] and any(out > back for out, back in seen)


def test_the_step_log_counts_cached_idle_blocks_as_not_free():
    """``free_blocks`` in the step log is the pool's free list, as in ``stats()`` (cached blocks nobody holds
    are *available*, not free).  With prefix caching, an 8-token prompt in 4-token blocks that finishes
    after one token leaves its 2 full blocks in the cache: hand count 64 - 2 = 62 free, 64 available."""
    ex = SimulatedExecutor()
    cfg = EngineConfig(num_gpu_blocks_override=BLOCKS, block_size=4, max_model_len=64, enable_prefix_caching=True,
                       device="cpu")
    engine = LLMEngine(cfg, executor=ex, tokenizer=None, model_max_len=64, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": list(range(40, 48))}, SamplingParams(max_tokens=1, ignore_eos=True), "a")
    _finals(engine)
    assert engine.step_log[-1].free_blocks == BLOCKS - 2
    assert (engine.stats()["free_blocks"], engine.stats()["available_blocks"]) == (BLOCKS - 2, BLOCKS)


def _two_running_in_a_12_block_pool() -> LLMEngine:
    """Reject mode, 12 blocks of 4 tokens: r0 (8 + 4 tokens, worst case 3 blocks) and r1 (8 + 16, 6 blocks)
    run two steps, so 3 blocks are left unreserved."""
    cfg = EngineConfig(num_gpu_blocks_override=12, block_size=4, max_model_len=32, max_num_seqs=4,
                       preemption_mode="reject", enable_prefix_caching=False, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=None, model_max_len=32, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": [1] * 8}, SamplingParams(max_tokens=4, ignore_eos=True), "r0")
    engine.add_request({"prompt_token_ids": [2] * 8}, SamplingParams(max_tokens=16, ignore_eos=True), "r1")
    engine.step()
    engine.step()
    return engine


def test_a_reject_mode_hint_waits_for_the_running_request_that_frees_enough_first():
    """r2 (12 + 8 tokens: 5 blocks worst case) finds 3 unreserved blocks and is rejected.  Hand-worked: it is
    2 blocks short; r0, the running request with the fewest tokens to go (1 after the step), frees its 3
    reserved blocks when it ends, which covers them, so the hint is 1 step (r1, 13 tokens to go, is not
    waited for).  The replay oracle agrees: re-submitted right away r2 is rejected again, re-submitted one
    step later it is admitted."""
    engine = _two_running_in_a_12_block_pool()
    r2 = {"prompt_token_ids": [3] * 12}
    engine.add_request(r2, SamplingParams(max_tokens=8, ignore_eos=True), "r2")
    outs = {o.request_id: o for o in engine.step()}
    assert outs["r2"].outputs[0].finish_reason == "rejected"
    assert outs["r2"].retry_after_s == round(engine.step_time_s * 1, 3)

    accepted = []
    for k in range(3):
        replay = _two_running_in_a_12_block_pool()
        for _ in range(1 + k):
            replay.step()
        replay.add_request(r2, SamplingParams(max_tokens=8, ignore_eos=True), "r2")
        out = {o.request_id: o for o in replay.step()}.get("r2")
        accepted.append(out is None or out.outputs[0].finish_reason != "rejected")
    assert accepted == [False, True, True]
