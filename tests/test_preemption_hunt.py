"""Preemption semantics checked against what the docs promise (a bug hunt), each against a hand count.

Reject mode's promise (``minivllm/sched/scheduler.py``, README, lab 5): a new request is turned away *for lack of
KV*, with a retry hint, a number of seconds > 0.  The fuzzed properties in test_preemption.py check invariants
(no leak, nothing running harmed); these pin who is rejected and what the hint says.
"""

from __future__ import annotations

import math

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.sim import SimulatedExecutor

from invariants import assert_no_leak, drain, tiny_engine  # noqa: E402  (tests/ is on sys.path)


def test_reject_mode_with_chunking_off_lets_a_prompt_wait_for_token_budget_rather_than_reject_it():
    """Hand count: 64 blocks of 4 tokens, a 32-token budget, chunked prefill off.  A and B (20-token prompts,
    4 tokens each: 6 blocks at worst) arrive together; both worst cases fit the pool ten times over, but the
    budget holds one prompt a step, so B starts in step 1, after A's prefill.  Nothing lacks KV, so no one is
    rejected.  (The scheduler rejected B in step 0: a prompt that does not fit the budget *left* was taken for
    one that does not fit the pool.)"""
    engine = tiny_engine(num_blocks=64, budget=32, max_len=32, chunked=False, preemption_mode="reject", max_seqs=4)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [1] * 20}, params, "A")
    engine.add_request({"prompt_token_ids": [2] * 20}, params, "B")
    finals = drain(engine)
    assert {rid: out.outputs[0].finish_reason for rid, out in finals.items()} == {"A": "length", "B": "length"}
    assert engine.stats()["num_rejected"] == 0
    first = {rid: next(rec.step for rec in engine.step_log if rid in rec.seq_ids) for rid in "AB"}
    assert first == {"A": 0, "B": 1}
    assert_no_leak(engine)


def test_a_reject_hint_stays_positive_on_an_executor_with_sub_millisecond_steps():
    """Hand count: 16 blocks of 4 tokens; A (8 + 50 tokens: 15 blocks at worst) runs, so B (the same) cannot fit
    beside it and is rejected.  A's steps take 10 microseconds; the hint is a step or two, about 2e-5 s, and
    rounded to milliseconds it read 0.0: "retry now", into the same full pool.  A hint is > 0 and finite."""
    cfg = EngineConfig(num_gpu_blocks_override=16, block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=64, preemption_mode="reject", device="cpu")
    fast = SimulatedExecutor(fixed_overhead_s=1e-5, per_token_s=1e-7, per_context_token_s=0.0)
    engine = LLMEngine(cfg, executor=fast, model_max_len=64, eos_token_ids=set())
    engine.add_request({"prompt_token_ids": [1] * 8}, SamplingParams(max_tokens=50, ignore_eos=True), "A")
    for _ in range(48):
        engine.step()
    engine.add_request({"prompt_token_ids": [2] * 8}, SamplingParams(max_tokens=50, ignore_eos=True), "B")
    out = next(o for o in engine.step() if o.request_id == "B")
    assert out.outputs[0].finish_reason == "rejected"
    assert math.isfinite(out.retry_after_s) and out.retry_after_s > 0
    drain(engine)
    assert_no_leak(engine)
