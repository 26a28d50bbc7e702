"""A second mutation pass over ``minivllm/sim`` (roofline, calibrate, presets): behaviours no other test pinned.

Each test kills one planted bug that every other sim test let through.  Expectations come from the public
formulas worked by hand for a tiny model shape, or from the definition the code documents, never from the
code under test.  None of them needs the real model.
"""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace

import pytest

from minivllm.kv.kv_cache_manager import BlockMoves
from minivllm.sim.roofline import (
    HardwareSpec, ModelShape, RooflineExecutor, RooflinePreemptionCosts, StepCost, combine,
)

# 2 layers, hidden 8, MLP 16, 2 query heads sharing 1 KV head of 4, vocab 32, bf16 (as in test_sim_mutants).
TINY = ModelShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                  head_dim=4, vocab_size=32, dtype_bytes=2)


def _batch(seqs):
    """A scheduled batch as the executor reads it: ``seqs`` are (start, num_tokens, request length)."""
    items = [SimpleNamespace(start=s, num_tokens=n, samples=s + n == total,
                             request=SimpleNamespace(request_id=f"q{i}", num_tokens=total))
             for i, (s, n, total) in enumerate(seqs)]
    return SimpleNamespace(seqs=items, moves=BlockMoves(), num_tokens=sum(n for _, n, _ in seqs))


# -- roofline.py -----------------------------------------------------------------------------------


def test_recomputing_a_victim_reads_the_lm_head_only_in_its_last_chunk():
    """Kills: ``recompute_s`` marking every re-prefill chunk as sampling.  Only the chunk that ends the prompt
    computes logits, so earlier chunks must not pay for the lm_head's weights and the fp32 logits; charging
    them inflates recomputation of long victims and tilts the auto mode towards swapping.

    By hand, memory bound at 1 B/s, no decodes beside the victim (so the base step costs nothing), a 6-token
    victim in chunks of 3.  Chunk 1 (0..3, no sample): layer weights 2 x 576 x 2 B = 2304, activations
    2 layers x 104 elements x 3 tokens x 2 B = 1248; K/V 32 B x (3 context + 3 written) = 192, Q in + O out
    2 x 2 layers x 8 x 2 B x 3 = 192.  Chunk 2 (3..6, samples): 2304 + lm_head 8 x 32 x 2 = 512 + 1248 + logits
    32 x 4 = 128; K/V 32 x (6 + 3) = 288, Q/O 192."""
    hw = HardwareSpec("toy", peak_flops=1e30, mem_bandwidth=1.0)
    costs = RooflinePreemptionCosts(TINY, hw, block_size=4, chunk=3, decodes=0)
    chunk1 = 2304 + 1248 + 192 + 192
    chunk2 = 2304 + 512 + 1248 + 128 + 288 + 192
    assert costs.recompute_s(6) == pytest.approx(chunk1 + chunk2)  # 8608 s


def test_a_config_without_tie_word_embeddings_or_kv_heads_reads_as_untied_multi_head():
    """Kills: ``from_hf_config`` defaulting a missing ``tie_word_embeddings`` to True.  Llama, Mistral and Qwen2
    configs default to an untied lm_head, so a config.json that omits the key has a separate output matrix:
    counting it once would under-size the weights (and over-size the simulated KV pool) by vocab x hidden.
    A missing ``num_key_value_heads`` means plain multi-head attention."""
    cfg = {"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
           "vocab_size": 32}
    shape = ModelShape.from_hf_config(cfg, name="t")
    assert (shape.tie_word_embeddings, shape.num_kv_heads, shape.head_dim) == (False, 2, 4)
    # one layer: q, k, v, o 4 x 8x8 + MLP 3 x 8x16 = 256 + 384; embedding and lm_head 32 x 8 each
    assert shape.num_params == 2 * 640 + 2 * 256
    assert ModelShape.from_hf_config({**cfg, "tie_word_embeddings": True}).num_params == 2 * 640 + 256


def test_executor_counts_steps_by_the_bound_of_their_dense_phase():
    """Kills: ``bound_steps`` counting the attention phase's bound.  The ``sim run`` report says "dense phase
    memory-bound N / compute-bound M steps"; a step whose GEMMs stream weights (memory bound) while its
    attention is compute bound must count as memory bound."""
    hw = HardwareSpec("toy", peak_flops=1e30, mem_bandwidth=1.0, attention_flops=1e-6, attention_bandwidth=1e30)
    ex = RooflineExecutor(TINY, hw, block_size=4)
    ex.execute(_batch([(5, 1, 6)]))
    assert ex.bound_steps == {"compute": 0, "memory": 1}


def test_advancing_the_roofline_clock_to_the_past_leaves_it_where_it_is():
    """Kills: ``RooflineExecutor.advance_to`` setting the clock unconditionally.  The driver asks to idle until
    the next arrival, which may already have passed during a long step; moving the clock back would make time
    run backwards (negative ITL, arrivals admitted twice as "early")."""
    hw = HardwareSpec("toy", peak_flops=1e30, mem_bandwidth=1e30, step_overhead_s=2.0)
    ex = RooflineExecutor(TINY, hw, block_size=4)
    ex.execute(_batch([(5, 1, 6)]))
    assert ex.now() == 2.0
    ex.advance_to(1.0)
    assert ex.now() == 2.0
    ex.advance_to(3.5)
    assert ex.now() == 3.5


# -- calibrate.py ----------------------------------------------------------------------------------


def test_refit_reports_the_largest_error_relative_to_the_measured_time():
    """Kills: ``refit``'s ``max_abs_rel_error`` dividing by the prediction.  Relative error is relative to what
    was measured (as the rms error is); dividing by the prediction understates a step the fit predicts too slow
    and overstates one it predicts too fast, so the profile's headline number would lie."""
    from minivllm.sim.calibrate import refit

    seqs = [[[0, 16, True]], [[0, 64, True]], [[0, 256, True]], [[8, 1, True]], [[8, 1, True]] * 4,
            [[40, 1, True]] * 8, [[0, 32, True], [8, 1, True]], [[100, 1, True]] * 2]
    times = [0.010, 0.013, 0.030, 0.004, 0.009, 0.006, 0.020, 0.003]  # noisy: no fit is exact
    doc = {"model": asdict(TINY), "engine": {"block_size": 4}, "fit": {}, "hardware": {"name": "toy"},
           "samples": [{"seqs": s, "swapped_blocks": 0, "time_s": t} for s, t in zip(seqs, times)]}
    refit(doc)
    worst = max(abs(s["pred_s"] - s["time_s"]) / s["time_s"] for s in doc["samples"])
    assert worst > 0.01  # the data really are noisy, so the two definitions differ
    assert doc["fit"]["max_abs_rel_error"] == pytest.approx(worst)


def test_a_fit_exactly_at_the_trusted_limit_draws_no_warning():
    """Kills: ``fit_warning`` using ``<`` for ``<=``.  The warning says the error is *above* 15%; a fit at exactly
    15% is within the limit and must pass silently."""
    from minivllm.sim.calibrate import MAX_TRUSTED_RMS, fit_warning

    assert MAX_TRUSTED_RMS == 0.15
    assert fit_warning({"fit": {"rms_rel_error": 0.15}}) is None
    assert fit_warning({"fit": {"rms_rel_error": 0.1501}}) is not None


def test_the_cpu_clock_skips_each_idle_gap_on_top_of_the_earlier_ones():
    """Kills: ``RecordingExecutor._advance_to`` replacing its offset instead of adding to it.  On the CPU-time
    clock each idle wait jumps the offset over the gap; forgetting the earlier jumps would move the clock back
    at the second idle gap of a calibration run, and every later step's start would be wrong.  The thread's
    CPU time is replaced by a fixed value, so the timeline is traced by hand."""
    import minivllm.sim.calibrate as cal

    rec = cal.RecordingExecutor(SimpleNamespace(), clock="cpu")
    cpu = [10.0]
    real = cal.time.thread_time
    cal.time.thread_time = lambda: cpu[0]
    try:
        rec.advance_to(15.0)  # idle 10 -> 15: offset 5
        assert rec.now() == 15.0
        cpu[0] = 11.0  # one CPU second of work: clock 16
        assert rec.now() == 16.0
        rec.advance_to(20.0)  # idle 16 -> 20: offset 5 + 4
        assert rec.now() == 20.0
        cpu[0] = 12.0
        assert rec.now() == 21.0
    finally:
        cal.time.thread_time = real


# -- presets.py ------------------------------------------------------------------------------------


def test_a_gpu_profiles_missing_compute_roof_comes_at_its_own_dtypes_rate_and_utilisation():
    """Kills: ``profile_spec`` ignoring the profile model's dtype (taking bf16), and dropping the division by the
    profile's ``flops_util``.  An fp32 calibration on an H200 whose grid never reached the compute roof gets
    the datasheet's *achievable fp32* rate: 67 TFLOP/s (the FP32 units; torch leaves TF32 off) x 0.7 (GEMM
    util) = 46.9 TFLOP/s as the effective roof, whatever utilisation the profile stores."""
    from minivllm.sim.presets import profile_spec

    doc = {"device": "cuda", "model": {"dtype_bytes": 4},
           "hardware": {"name": "NVIDIA H200", "peak_flops": 1e30, "mem_bandwidth": 4e12, "attention_flops": 1e30,
                        "memory_bytes": 150e9, "flops_util": 0.5}}
    spec = profile_spec(doc)
    assert spec.flops == pytest.approx(67e12 * 0.7)
    assert spec.attn_flops == pytest.approx(67e12 * 0.7)


def test_an_explicit_fp32_simulation_on_a_gpu_stays_fp32():
    """Kills: ``simulated_shape`` switching fp32 to bf16 on a GPU even when the dtype was asked for.  bf16 is
    only the default (what the engine's dtype "auto" picks on a GPU); ``--dtype-bytes 4`` must simulate fp32,
    twice the weight and K/V bytes."""
    from minivllm.sim.presets import HARDWARE, simulated_shape

    assert simulated_shape("llama-3-8b", HARDWARE["h200"], dtype_bytes=4).dtype_bytes == 4
    assert simulated_shape("llama-3-8b", HARDWARE["h200"]).dtype_bytes == 2


def test_a_profile_that_names_no_device_is_a_cpu_profile():
    """Kills: ``profile_spec`` treating a profile without a ``device`` key as a GPU's.  Profiles written before
    the key existed were CPU calibrations with no device memory; read as a GPU's they match no datasheet and
    are refused ("its KV pool cannot be sized") instead of loading as fitted."""
    from minivllm.sim.presets import profile_spec

    doc = {"hardware": {"name": "cpu-2core", "peak_flops": 5e10, "mem_bandwidth": 1e10, "step_overhead_s": 0.003}}
    spec = profile_spec(doc)
    assert (spec.peak_flops, spec.memory_bytes, spec.step_overhead_s) == (5e10, 0.0, 0.003)


# -- replay.py -------------------------------------------------------------------------------------


def test_a_replayed_step_never_moves_the_clock_back_past_an_idle_jump():
    """Kills: ``ReplayExecutor.execute`` setting the clock to the recorded time without the ``max``.  After the
    driver idled the clock forward (``advance_to``) past a recorded boundary, replaying that boundary must not
    make time run backwards; past the recording's end each call adds ``tail_step_s``."""
    from minivllm.sim.replay import ReplayExecutor

    ex = ReplayExecutor([1.0, 2.0], tail_step_s=0.5)
    ex.advance_to(5.0)
    ex.execute(_batch([(5, 1, 6)]))
    assert ex.now() == 5.0
    ex.execute(_batch([(6, 1, 7)]))
    assert ex.now() == 5.0
    ex.execute(_batch([(7, 1, 8)]))
    assert ex.now() == 5.5


def test_replay_samples_only_the_rows_that_finish_their_prompt():
    """Kills: ``ReplayExecutor.execute`` returning a token for every scheduled row.  A middle chunk of a prompt
    samples nothing; a token for it would append an output the real engine never produced, and the replayed
    step log would differ from the recorded one for a simulator bug that is not there."""
    from minivllm.sim.replay import ReplayExecutor

    out = ReplayExecutor([1.0]).execute(_batch([(0, 3, 10), (9, 1, 10)]))  # a prompt chunk 0..3 of 10, a decode
    assert set(out) == {"q1"}


# -- run.py ----------------------------------------------------------------------------------------


def test_requests_arriving_together_keep_their_plan_order():
    """Kills: ``requests_from_plan`` breaking arrival ties by descending index.  Requests at the same instant
    (a burst, a calibration group at t=0) join the engine in plan order, so FCFS serves request 0 first, as
    the real load generator sends it."""
    from minivllm.sim.run import requests_from_plan

    plan = [SimpleNamespace(index=k, arrival=a, tenant="t", prompt="hello world", max_tokens=1)
            for k, a in ((2, 0.5), (0, 0.5), (1, 0.0), (3, 0.5))]
    assert [r.index for r in requests_from_plan(plan)] == [1, 0, 2, 3]


def test_word_token_ids_stay_inside_the_vocabulary_and_clear_of_the_special_ids():
    """Kills: ``word_token_ids`` hashing into ``vocab_size`` ids and then adding 10.  Words outside the load
    generator's list hash to ``crc32 % (vocab - 10) + 10``: every id in [10, vocab), so a small-vocabulary
    model is never fed an id past its embedding table."""
    from minivllm.sim.run import word_token_ids

    ids = word_token_ids(" ".join(f"zq{k}" for k in range(400)), vocab_size=50)
    assert all(10 <= t < 50 for t in ids) and max(ids) >= 45  # the top of the range is reached


def test_linear_executor_samples_only_the_rows_that_finish_their_prompt():
    """Kills: ``SimulatedExecutor.execute`` returning a token for every scheduled row.  A middle prompt chunk
    samples nothing (the engine would otherwise append an output token mid-prompt)."""
    from minivllm.sim.executor import SimulatedExecutor

    out = SimulatedExecutor().execute(_batch([(0, 3, 10), (9, 1, 10)]))
    assert set(out) == {"q1"}


# -- calibrate.fit_roof ----------------------------------------------------------------------------------


def _dense_steps(p, tokens, group):
    """Decode-shaped steps whose only roof terms are dense: ``tokens`` FLOPs against 10 + tokens/10 bytes,
    1-3 sequences each, timed exactly as 1 s + 0.1 s/sequence + combine(FLOPs, bytes, p) at 1 s per unit."""
    costs, times = [], []
    for i, n in enumerate(tokens):
        seqs = 1 + i % 3
        c = StepCost(num_seqs=seqs, num_tokens=seqs, num_sampled=seqs, dense_flops=float(n), dense_bytes=10 + 0.1 * n)
        costs.append(c)
        times.append(1.0 + 0.1 * seqs + combine(c.dense_flops, c.dense_bytes, p))
    return costs, times, [group] * len(tokens)


def test_the_roofline_corner_is_chosen_by_the_error_that_weighs_every_group_the_same():
    """Kills: ``fit_roof`` choosing ``roof_p`` by the per-step (unweighted) rms error instead of the
    group-weighted one the fit minimises.  The calibration grid yields dozens of decode steps per group and a
    handful per prefill group; chosen per step, the corner would be decided by the many short decodes, while
    every parameter around it was fitted to treat the groups alike (the long steps set TTFT).

    Data: one group of 13 steps timed with a sharp corner (``max``) and two groups of 2 steps near the ridge
    timed with ``p=2``.  Per step, the sharp group is the majority; per group, the minority -- and the two
    errors pick different corners.  Oracle: for each candidate, the public ``fit`` at that corner gives the
    parameters; the prediction ``a + s*seqs + combine(f*FLOPs, bytes, p)`` is computed here by hand, and the
    weighted error is the root of the mean over groups of each group's mean squared relative error."""
    import numpy as np

    from minivllm.sim.calibrate import ROOF_P_CANDIDATES, fit, fit_roof

    parts = [_dense_steps(None, [1, 2, 4, 6, 8, 10, 11, 12, 14, 16, 20, 30, 40], 0),
             _dense_steps(2.0, [9, 12], 1), _dense_steps(2.0, [10, 11], 2)]
    costs = [c for cs, _, _ in parts for c in cs]
    times = np.array([t for _, ts, _ in parts for t in ts])
    groups = [g for _, _, gs in parts for g in gs]

    weighted, unweighted = {}, {}
    for p in ROOF_P_CANDIDATES:
        theta, _ = fit(costs, list(times), groups=groups, s_per_byte=1.0, roof_p=p)
        a, s, f, by = theta[:4]
        pred = np.array([a + s * c.num_seqs + combine(f * c.dense_flops, by * c.dense_bytes, p) for c in costs])
        rel2 = ((pred - times) / times) ** 2
        weighted[p] = float(np.sqrt(np.mean([rel2[np.array(groups) == g].mean() for g in set(groups)])))
        unweighted[p] = float(np.sqrt(rel2.mean()))
    best = min(weighted, key=weighted.get)
    per_step_best = min(unweighted, key=unweighted.get)
    assert best != per_step_best  # the data do tell the two choices apart
    assert sorted(weighted.values())[1] - weighted[best] > 1e-3 * weighted[best]  # and not by a hair

    theta, err, roof_p = fit_roof(costs, list(times), groups=groups, s_per_byte=1.0)
    assert roof_p == best
    assert err == pytest.approx(unweighted[best], rel=1e-9)  # the error it reports stays the per-step one


# -- calibrate.measure -----------------------------------------------------------------------------------


def test_measured_samples_leave_out_the_steps_that_ran_no_sequence():
    """Kills: ``measure`` keeping a step that ran no sequence (the list comprehension's trailing ``if seqs``
    dropped).  Such a step is the engine finding nothing to run -- here the step after the last running
    request finished while two preempted ones wait to be re-admitted -- and on the roofline it takes no time:
    kept, it would be a sample with no shape and a time of 0, which the fit refuses (times must be > 0) or,
    on a real clock, a few microseconds of host loop taught to the fit as a batch.

    Setup: 8 blocks of 4 tokens, three 6-token prompts that each want 12 more tokens, so the pool runs out
    and requests are preempted (recompute) and the engine idles one step before re-admitting them.  Oracle:
    a wrapper of our own under the recorder counts, per ``execute`` call, the sequences it was given."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, measure
    from minivllm.sim.presets import hardware_preset, model_preset
    from minivllm.sim.roofline import RooflineExecutor
    from minivllm.sim.run import SimRequest

    class Counting(RooflineExecutor):
        def execute(self, batch):
            self.seqs_per_call.append(len(batch.seqs))
            return super().execute(batch)

    counting = Counting(model_preset("smollm2-135m").with_dtype(4), hardware_preset("h100"))
    counting.seqs_per_call = []
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, num_gpu_blocks_override=8, max_model_len=20,
                       device="cpu", block_size=4)
    engine = LLMEngine(cfg, executor=RecordingExecutor(counting), model_max_len=20, eos_token_ids=set())
    samples, _ = measure(engine, [SimRequest(i, 0.0, "t", [11 + i] * 6, 12) for i in range(3)])

    assert 0 in counting.seqs_per_call  # the run did have a step with nothing to run
    assert len(samples) == sum(1 for n in counting.seqs_per_call if n > 0)
    assert all(s.seqs for s in samples)
    assert [len(s.seqs) for s in samples] == [n for n in counting.seqs_per_call if n > 0]


def test_attention_runs_at_the_dtypes_rate_like_the_gemms():
    """An fp32 model on a spec quoted for bf16 runs its attention on the FP32 units too (TENSOR_CORE_SCALE's
    comment: the engine's kernels ask for exact fp32 dots), and an fp8 one at twice the bf16 rate.  Hand case:
    peak 100 FLOP/s (bf16), FP32 peak 10, bandwidth so high that memory takes ~0 s; one 4-token prefill of a
    1-layer, 1-head, head_dim-2 model: 4 * 2 * 10 pairs = 80 attention FLOPs -> 8 s at fp32, 0.4 s at fp8.
    Catches the attention phase left at the quoted rate whatever the dtype (0.8 s for both)."""
    from minivllm.sim.roofline import HardwareSpec, ModelShape, roofline_time, step_cost

    hw = HardwareSpec("hand", peak_flops=100.0, mem_bandwidth=1e30, flops_dtype_bytes=2, fp32_peak_flops=10.0)
    for dtype_bytes, seconds in ((4, 8.0), (1, 0.4), (2, 0.8)):
        shape = ModelShape("t", num_layers=1, hidden_size=2, intermediate_size=2, num_heads=1, num_kv_heads=1,
                           head_dim=2, vocab_size=16, dtype_bytes=dtype_bytes)
        cost = step_cost(shape, [(0, 4, False)])
        assert cost.attn_flops == 4.0 * 1 * 1 * 2 * (1 + 2 + 3 + 4)
        assert roofline_time(cost, shape, hw).attention == pytest.approx(seconds)
