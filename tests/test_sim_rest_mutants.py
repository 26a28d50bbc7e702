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


def test_a_forward_pass_reads_every_weight_but_the_embedding_table():
    """``ModelShape.weight_bytes_per_step``: what one forward pass reads, every layer's GEMMs and the lm_head, the
    embedding being a gather of a few rows.  Oracle: Meta-Llama-3-8B's config.json by hand (hidden 4096, 32
    layers, 32 heads, 8 KV heads of 128, intermediate 14336, vocab 128256, untied), bf16.  One layer: q and o
    4096 x 4096 each, k and v 4096 x 1024 each, gate/up/down 3 x 4096 x 14336 = 218,103,808 weights; 32 layers =
    6,979,321,856; lm_head 128256 x 4096 = 525,336,576; x 2 bytes = 15,009,316,864 (the published 8.03e9
    parameters less the embedding table, in bytes).  Kills: the lm_head left out (13,958,643,712)."""
    llama = model_preset("llama-3-8b")
    layer = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096 + 3 * 4096 * 14336
    assert layer == 218_103_808
    assert llama.weight_bytes_per_step == (32 * layer + 128256 * 4096) * 2 == 15_009_316_864
    assert llama.weight_bytes_per_step == (llama.num_params - 128256 * 4096) * 2


def test_each_phase_names_its_own_binding_roof():
    """``StepTime.attention_bound`` says which roof bound the *attention* phase, whatever bound the GEMMs (a decode
    batch at long context: GEMMs near the compute roof, attention reading K/V).  Hand case: a 2-layer toy model
    (hidden 8, 2 heads and 1 KV head of 4, MLP 16, vocab 32, bf16), a 3-token prefill and a decode at position 5,
    on a device of 1000 FLOP/s, 1e6 B/s for GEMMs and 10 B/s for attention.  Dense: 10240 FLOPs / 1000 = 10.24 s
    against 4736 B / 1e6 -- compute.  Attention: 768 FLOPs / 1000 = 0.768 s against 672 B / 10 = 67.2 s -- memory
    (terms as in test_sim_roofline's hand count).  Kills: the attention phase labelled by the dense phase's roof."""
    from minivllm.sim.roofline import ModelShape, roofline_time, step_cost

    tiny = ModelShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                      head_dim=4, vocab_size=32, dtype_bytes=2)
    hw = HardwareSpec("toy", peak_flops=1000, mem_bandwidth=1e6, attention_bandwidth=10)
    t = roofline_time(step_cost(tiny, [(0, 3, True), (5, 1, True)]), tiny, hw)
    assert (t.dense, t.dense_bound) == (pytest.approx(10.24), "compute")
    assert (t.attention, t.attention_bound) == (pytest.approx(67.2), "memory")



def test_auto_mode_prices_a_recompute_beside_32_decodes_at_2048_tokens_of_context():
    """The auto mode of ``sim run`` prices a recompute as the time its chunks add to a busy server's steps, a
    server decoding 32 sequences at 2,048 tokens of context (RooflinePreemptionCosts' background, the one lab 5's
    curves and ``labs.at_scale.recompute_s`` quote).  Oracle: the steps built by hand -- a 5,000-token victim in
    2,048-token chunks is 2,048 + 2,048 + 904 tokens, each beside the 32 decodes, only the last one sampling --
    each less the decodes-only step.  Kills: another background (16 decodes, or 1,024 tokens of context), which
    moves every swap-or-recompute decision the simulated engine takes."""
    from minivllm.sim.presets import hardware_preset
    from minivllm.sim.roofline import roofline_time, step_cost

    shape, hw = model_preset("llama-3-8b"), hardware_preset("h100")
    costs = make_engine(shape, hw, num_gpu_blocks_override=4096, max_num_batched_tokens=2048,
                        preemption_mode="auto").scheduler.costs
    decodes = [(2048, 1, True)] * 32

    def seconds(seqs):
        return roofline_time(step_cost(shape, seqs), shape, hw).total

    chunks = [(0, 2048, False), (2048, 2048, False), (4096, 904, True)]
    want = sum(seconds(decodes + [c]) - seconds(decodes) for c in chunks)
    assert costs.recompute_s(5000) == pytest.approx(want, rel=1e-12)


def test_sim_runs_header_counts_every_prompt_and_output_token_it_offers():
    """``sim run``'s header and its JSON's ``total_tokens`` count the work offered: every request's prompt and
    output tokens.  Hand case: 5 requests of a fixed 32-token prompt and 8 outputs = 5 * (32 + 8) = 200 tokens.
    Kills: counting the prompts alone (160)."""
    import io

    from minivllm.sim.run import _parser, run_sim

    args = _parser().parse_args(["--model", "smollm2-135m", "--tenant", "name=a,input=fixed:32,output=fixed:8",
                                 "--num-requests", "5", "--request-rate", "100", "--no-requests-in-json"])
    out = io.StringIO()
    doc = run_sim(args, out)
    assert doc["total_tokens"] == 200 and doc["num_requests"] == 5
    assert "| 5 requests, 200 tokens |" in out.getvalue()


def test_sim_runs_extras_line_puts_each_number_under_its_own_label():
    """The line under ``sim run``'s table: KV peak and time-weighted mean, and how many steps' GEMMs were memory
    and compute bound.  Hand case: peak 50%, mean 25%, 5 memory-bound steps and 2 compute-bound ones, busy 40%.
    Kills: the peak printed as the mean (and back), and the two step counts under each other's labels (a decode
    heavy run reading as compute bound)."""
    from minivllm.sim.run import format_extras

    x = {"steps": 7, "preemptions": 2, "prefix_cache_hit_rate": None, "kv_blocks": 100, "kv_usage_peak": 0.5,
         "kv_usage_mean": 0.25, "kv_usage_over_time": [(0.0, 0.5)], "busy_fraction": 0.4,
         "dense_bound_steps": {"memory": 5, "compute": 2}}
    text = format_extras(x)
    assert "KV blocks 100 (peak 50%, mean 25%)" in text and "busy 40%" in text
    assert "memory-bound 5 / compute-bound 2 steps" in text
