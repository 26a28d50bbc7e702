"""Mutation hunt on ``minivllm.sim.roofline`` and ``minivllm.sim.run``, the mutants an earlier hunt left untried:
behaviour a user sees that no test pinned.  Each test names the mutant it kills and its hand-computed oracle."""

import pytest

from minivllm.sim.presets import model_preset
from minivllm.sim.roofline import HardwareSpec
from minivllm.sim.run import make_engine


def test_auto_mode_prices_a_recompute_in_chunks_of_the_engines_step_budget():
    """``--preemption-mode auto`` on the simulator prices re-prefilling a victim in the chunks the engine would
    really run: its step budget, ``max_num_batched_tokens`` (the executor's docstring).  Hand case: a device
    where only the per-sequence overhead costs time (1 ms; every roof ~infinite), so each chunk adds exactly one
    sequence to a step: a 1000-token victim in 256-token chunks costs ceil(1000 / 256) = 4 ms, 256 tokens 1 ms,
    257 tokens 2 ms.  Kills: the executor ignoring the budget and pricing 2048-token chunks (1 ms for all three:
    a long victim looks as cheap to recompute as a short one)."""
    shape = model_preset("smollm2-135m").with_dtype(2)
    hw = HardwareSpec("seq-overhead-only", peak_flops=1e30, mem_bandwidth=1e30, seq_overhead_s=1e-3)
    engine = make_engine(shape, hw, num_gpu_blocks_override=256, max_num_batched_tokens=256, preemption_mode="auto")
    costs = engine.scheduler.costs
    assert [costs.recompute_s(n) for n in (1000, 256, 257)] == pytest.approx([4e-3, 1e-3, 2e-3], rel=1e-9)


def test_the_simulated_pool_is_its_bytes_over_a_blocks_bytes():
    """A simulated engine's KV pool is ``kv_cache_memory_bytes`` over one *block's* K and V, which the engine also
    prices a swap with and ``sim run`` reports.  Hand case: SmolLM2-135M in bf16 (config.json: 30 layers, 3 KV
    heads, head_dim 64) holds 2 * 30 * 3 * 64 * 2 = 23040 bytes per token, 368640 per 16-token block; a budget
    of 100 such blocks gives 100 blocks and a 1600-token max_model_len.  Kills: the executor's block size in
    bytes counting one token (16x the blocks: 1600, and a 25600-token max_model_len the memory cannot hold)."""
    from minivllm.sim.presets import hardware_preset

    shape = model_preset("smollm2-135m").with_dtype(2)
    engine = make_engine(shape, hardware_preset("h100"), kv_cache_memory_bytes=368640 * 100, max_num_batched_tokens=256)
    assert engine.bytes_per_block == 368640
    assert engine.kv.pool.num_blocks == 100 and engine.config.max_model_len == 1600


def test_a_small_nonzero_usage_never_draws_as_a_blank():
    """``sparkline``'s promise: a value above 0 never draws as blank (a run at 1% of a 0..1 scale would print an
    empty line).  Hand case: [0.01, 0, 1.0] on a full scale of 1: 0.01 * 8 rounds to 0 bars but is not zero, so
    one bar; 0 is blank; 1.0 is a full block -> "▁ █".  Kills: rounding small values down to a blank ("  █")."""
    from minivllm.sim.run import sparkline

    assert sparkline([0.01, 0.0, 1.0], top=1.0) == "▁ █"


@pytest.mark.parametrize("peak,top", [(0.1, 1.0), (0.031, 0.04), (0.0, 0.01)])
def test_the_sparklines_scale_is_a_full_pool_from_a_tenth_on_else_the_peak_rounded_up(peak, top):
    """``_spark_top``'s promise: 100% for a pool that was ever a tenth full, else the peak rounded *up* to a whole
    per cent, so the peak itself still fits in a full block.  Hand cases: a peak of exactly 10% -> 100%; 3.1% ->
    4% (3% would put the peak over the top of the line); nothing held -> 1% (never a zero scale).  Kills: the
    tenth taken strictly (10% -> 11%), and rounding to the nearest per cent (3.1% -> 3%)."""
    from minivllm.sim.run import _spark_top

    assert _spark_top({"kv_usage_peak": peak}) == pytest.approx(top, abs=1e-12)


def test_a_request_with_several_samples_counts_every_samples_tokens():
    """``sim run``'s output throughput counts what the engine generated; a request with ``n`` samples
    generates ``n`` completions (SimRequest's comment: "its result counts every sample's tokens").  Hand case: no
    EOS on the roofline executor, so n = 3 samples of max_tokens 4 -> 12 tokens, beside an n = 1 request of 5.
    Kills: an n > 1 group counting only its first sample's tokens (4)."""
    from minivllm.sim.presets import hardware_preset
    from minivllm.sim.run import SimRequest, drive

    engine = make_engine(model_preset("smollm2-135m").with_dtype(2), hardware_preset("h100"),
                         num_gpu_blocks_override=64, max_num_batched_tokens=256)
    rec = drive(engine, [SimRequest(0, 0.0, "t", [11] * 8, 4, n=3), SimRequest(1, 0.0, "t", [12] * 8, 5)],
                temperature=1.0)
    assert [(r.output_tokens, r.outcome) for r in rec.results] == [(12, "ok"), (5, "ok")]


def test_a_request_the_reject_mode_turns_away_is_rejected_with_a_retry_hint_not_an_error():
    """``preemption_mode="reject"`` admits a request only if the pool holds its worst case beside everyone
    else's; the others finish "rejected" with a ``retry_after_s`` hint (the scheduler's docstring), which a
    report counts as rejects (a server's 429), not errors.  Hand case: 4 blocks of 16 tokens; three requests of
    8 prompt + 40 output tokens = 3 blocks each, arriving together: the first is served, 1 block is left, so the
    other two are rejected.  Kills: drive recording a rejection as an error (no retry hint, counted as failed)."""
    from minivllm.sim.presets import hardware_preset
    from minivllm.sim.run import SimRequest, drive

    engine = make_engine(model_preset("smollm2-135m").with_dtype(2), hardware_preset("h100"),
                         num_gpu_blocks_override=4, max_num_batched_tokens=256, preemption_mode="reject")
    rec = drive(engine, [SimRequest(k, 0.0, "t", [11 + k] * 8, 40) for k in range(3)])
    assert [(r.outcome, r.error) for r in rec.results] == [("ok", None), ("rejected", None), ("rejected", None)]
    assert all(r.retry_after is not None and r.retry_after > 0 for r in rec.results[1:])
