"""The roofline simulator: arithmetic against hand-computed terms, presets against published facts,
the calibration fit against known parameters, and the executor inside the real engine."""

from __future__ import annotations

import collections
import dataclasses
import io
import itertools

import numpy as np
import pytest

from minivllm.sim.calibrate import fit, nnls, spec_from_theta
from minivllm.sim.presets import HARDWARE, MODELS, PUBLISHED_PARAMS, hardware_preset, model_preset
from minivllm.sim.roofline import (HardwareSpec, ModelShape, RooflineExecutor, RooflinePreemptionCosts, roofline_time,
                                   step_cost)

TINY = ModelShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                  head_dim=4, vocab_size=32, dtype_bytes=2)


def test_tiny_shape_by_hand():
    # one layer: q 8x8 + k,v 2 x 8x4 + o 8x8 + MLP 3 x 8x16 = 64 + 64 + 64 + 384
    assert TINY.layer_params == 576
    # two layers + separate embedding and lm_head (32 x 8 each)
    assert TINY.num_params == 2 * 576 + 2 * 256
    # K and V, 2 layers, 1 kv head of 4, 2 bytes
    assert TINY.kv_bytes_per_token == 32


def test_step_cost_by_hand():
    # a 3-token prefill from position 0 and a decode at position 5, both sampled
    c = step_cost(TINY, [(0, 3, True), (5, 1, True)])
    assert (c.num_seqs, c.num_tokens, c.num_sampled) == (2, 4, 2)
    # GEMMs: 2 FLOPs x 576 weights x 2 layers x 4 tokens; lm_head: 2 x 8 x 32 per sampled row
    assert c.dense_flops == 2 * 576 * 2 * 4 + 2 * 8 * 32 * 2 == 10240
    # weights once (2 x 576 + lm_head 256, 2 bytes) + activations (GEMM inputs + outputs per token per layer:
    # qkv 8+16, o 8+8, gate_up 8+32, down 16+8 = 104 elements) + fp32 logits of 2 rows
    assert c.dense_bytes == (2 * 576 + 256) * 2 + 2 * 104 * 4 * 2 + 2 * 32 * 4 == 4736
    # keys attended: prefill 1+2+3 = 6, decode 6; 4 FLOPs per head-dim element (QK^T and PV), 2 heads, 2 layers
    assert c.attn_flops == 4 * 2 * 2 * 4 * 12 == 768
    # K/V read: contexts 3 + 6, written: 4 tokens (32 bytes each); Q in + O out: 2 x 2 layers x 8 x 2 bytes x 4 tokens
    assert c.attn_bytes == 32 * (9 + 4) + 2 * 2 * 8 * 2 * 4 == 672


def test_a_step_that_samples_nothing_reads_no_lm_head():
    """A step of middle prompt chunks computes no logits (the engine runs the lm_head only on rows it samples
    from), so its dense terms leave out the lm_head's FLOPs, its weights and the logits."""
    c = step_cost(TINY, [(0, 3, False)])
    assert c.num_sampled == 0
    assert c.dense_flops == 2 * 576 * 2 * 3 == 6912
    # the layers' weights once (2 x 576, 2 bytes) + activations (104 elements per token per layer, 2 bytes)
    assert c.dense_bytes == 2 * 576 * 2 + 2 * 104 * 3 * 2 == 3552
    # one sampled row anywhere in the step brings the whole lm_head (8 x 32, 2 bytes) back, plus its fp32 logits
    both = step_cost(TINY, [(0, 3, False), (5, 1, True)])
    assert both.dense_bytes == 2 * 576 * 2 + 256 * 2 + 2 * 104 * 4 * 2 + 32 * 4


def test_the_engine_runs_the_lm_head_only_in_steps_that_sample():
    """The assumption above, checked on the real engine: a 40-token prompt in 16-token chunks and 2 outputs
    is 4 steps (16, 16, 8 + first token, 1 decode); only the last two call the lm_head, one row each."""
    from minivllm import LLM, SamplingParams

    llm = LLM(dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, long_prefill_token_threshold=16)
    model = llm.engine.model_runner.model
    rows = []
    original = model.logits

    def counting(hidden):
        rows.append(hidden.shape[0])
        return original(hidden)

    model.logits = counting
    from tests.invariants import steps

    taken = 0
    llm.engine.add_request({"prompt_token_ids": list(range(100, 140))}, SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in steps(llm.engine):
        taken += 1
    assert (taken, rows) == (4, [1, 1])


def test_roofline_time_by_hand():
    hw = HardwareSpec("toy", peak_flops=1000, mem_bandwidth=100, step_overhead_s=1, layer_overhead_s=0.25,
                      seq_overhead_s=0.5, swap_bandwidth=64)
    t = roofline_time(step_cost(TINY, [(0, 3, True), (5, 1, True)], swap_blocks=2, block_size=4), TINY, hw)
    assert t.overhead == pytest.approx(1 + 2 * 0.25 + 2 * 0.5)
    assert (t.dense, t.dense_bound) == (pytest.approx(47.36), "memory")  # 4736 B / 100 B/s > 10240 / 1000
    assert (t.attention, t.attention_bound) == (pytest.approx(6.72), "memory")
    assert t.swap == pytest.approx(2 * 4 * 32 / 64)  # 2 blocks of 4 tokens of 32 bytes over 64 B/s
    fast_mem = HardwareSpec("toy2", peak_flops=1000, mem_bandwidth=1e6)
    t2 = roofline_time(step_cost(TINY, [(0, 3, True), (5, 1, True)]), TINY, fast_mem)
    assert (t2.dense, t2.dense_bound, t2.attention_bound) == (pytest.approx(10.24), "compute", "compute")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_presets_match_published_sizes(name):
    shape = model_preset(name)
    assert shape.num_params == pytest.approx(PUBLISHED_PARAMS[name], rel=0.04)


def test_bundled_preset_reads_the_bundled_config(default_model_dir):
    import json

    cfg = json.loads((default_model_dir / "config.json").read_text())
    shape = model_preset("smollm2-135m")
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads, shape.vocab_size) == (
        cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"], cfg["vocab_size"])
    assert shape.num_params == pytest.approx(PUBLISHED_PARAMS["smollm2-135m"], rel=0.04)


def test_hardware_presets_sane():
    for name, hw in HARDWARE.items():
        ridge = hw.flops / hw.bandwidth  # FLOP per byte where GEMMs turn compute bound
        assert 100 < ridge < 600, name
        assert hw.memory_bytes >= 24e9 and hw.swap_bandwidth >= 16e9
    llama = model_preset("llama-3-8b")
    assert llama.kv_bytes_per_token == 128 * 1024  # Llama-3-8B: 128 KiB of KV per token in bf16
    decode = step_cost(llama, [(512, 1, True)])
    prefill = step_cost(llama, [(0, 4096, True)])
    h100, h200 = hardware_preset("h100"), hardware_preset("h200")
    d100, d200 = roofline_time(decode, llama, h100), roofline_time(decode, llama, h200)
    # batch-1 decode reads 16 GB of weights: memory bound, ~5-6 ms on an H100's 3.35 TB/s, faster on an H200
    assert d100.dense_bound == "memory" and 4e-3 < d100.dense < 8e-3
    assert d200.dense == pytest.approx(d100.dense * 3.35 / 4.8, rel=1e-6)
    assert roofline_time(prefill, llama, h100).dense_bound == "compute"
    with pytest.raises(ValueError):
        hardware_preset("tpu-v9")
    with pytest.raises(ValueError):
        model_preset("gpt-5")


def test_nnls_matches_brute_force():
    rng = np.random.default_rng(0)
    for trial in range(20):
        A = rng.normal(size=(8, 4))
        b = rng.normal(size=8)
        best = None
        for k in range(5):  # every active set: unconstrained least squares on it, keep feasible solutions
            for cols in itertools.combinations(range(4), k):
                x = np.zeros(4)
                if cols:
                    x[list(cols)] = np.linalg.lstsq(A[:, cols], b, rcond=None)[0]
                if (x >= -1e-12).all():
                    r = np.linalg.norm(A @ x - b)
                    best = r if best is None else min(best, r)
        x = nnls(A, b)
        assert (x >= 0).all()
        assert np.linalg.norm(A @ x - b) == pytest.approx(best, rel=1e-7, abs=1e-10), trial


def _synthetic_batches():
    out = [[(0, n, True)] for n in (16, 64, 160, 320, 512)] + [[(512, 512, True)], [(0, 64, True)] * 4]
    for b, ctx in ((1, 40), (2, 40), (4, 40), (8, 40), (16, 40), (32, 40), (1, 400), (4, 400), (12, 400)):
        out.append([(ctx, 1, True)] * b)
    out.append([(300, 1, True)] * 6 + [(0, 200, True)])  # mixed
    return out


def test_fit_recovers_known_parameters():
    shape = model_preset("smollm2-135m").with_dtype(4)
    truth = HardwareSpec("truth", peak_flops=60e9, mem_bandwidth=12e9, attention_flops=25e9,
                         attention_bandwidth=3e9, step_overhead_s=4e-3, seq_overhead_s=0.3e-3)
    costs = [step_cost(shape, b) for b in _synthetic_batches()]
    times = [roofline_time(c, shape, truth).total for c in costs]
    bounds = {(roofline_time(c, shape, truth).dense_bound, roofline_time(c, shape, truth).attention_bound) for c in costs}
    assert {b[0] for b in bounds} == {b[1] for b in bounds} == {"compute", "memory"}  # both regimes in the data
    theta, err = fit(costs, times)
    got = spec_from_theta(theta, "fit")
    assert err < 1e-6
    for k in ("peak_flops", "mem_bandwidth", "attention_flops", "attention_bandwidth", "step_overhead_s",
              "seq_overhead_s"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-4), k
    # and with 3% multiplicative noise the fit stays close
    rng = np.random.default_rng(1)
    noisy = [t * (1 + 0.03 * rng.standard_normal()) for t in times]
    theta, err = fit(costs, noisy)
    got = spec_from_theta(theta, "noisy")
    assert err < 0.03  # no worse than the noise itself
    for k in ("peak_flops", "mem_bandwidth"):  # the big terms; a 4 ms overhead drowns in 3% of 50 ms steps
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=0.1), k
    # pinned bandwidth (what calibrate does with a measured one), per-group weights: the other five come back
    theta, err = fit(costs, times, groups=list(range(len(costs) // 2)) * 2 + [0] * (len(costs) % 2),
                     s_per_byte=1 / truth.mem_bandwidth)
    got = spec_from_theta(theta, "pinned")
    assert err < 1e-6
    for k in ("peak_flops", "mem_bandwidth", "attention_flops", "attention_bandwidth", "step_overhead_s",
              "seq_overhead_s"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-4), k
    # pinned to a wrong bandwidth, the fit must get worse, not silently absorb it
    _, err_wrong = fit(costs, times, s_per_byte=1 / (3 * truth.mem_bandwidth))
    assert err_wrong > 0.01


def test_span_term_is_the_longest_sequences_kv_at_its_own_rate():
    """The span term (roofline docstring): beside all K/V bytes at the attention rate, the longest sequence's K/V at
    the rate one walk reaches.  Oracle: a hand sum.  Steps of 1 x 400 and 4 x 100 read the same K/V in total, so
    without the term they cost the same; with it the lone long sequence costs more, by exactly its extra span over
    the span rate.  A spec without the term (every datasheet preset) prices both as before."""
    shape = ModelShape("toy", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                       head_dim=16, vocab_size=100, dtype_bytes=4)
    lone, four = step_cost(shape, [(399, 1, True)]), step_cost(shape, [(99, 1, True)] * 4)
    assert lone.attn_span_bytes == shape.kv_bytes_per_token * 400 == 2 * 2 * 2 * 16 * 4 * 400
    assert four.attn_span_bytes == shape.kv_bytes_per_token * 100 and four.attn_bytes > lone.attn_bytes
    mixed = step_cost(shape, [(10, 1, True), (700, 1, True), (0, 30, True)])  # the longest is not the first
    assert mixed.attn_span_bytes == shape.kv_bytes_per_token * 701
    flat = HardwareSpec("flat", peak_flops=1e15, mem_bandwidth=1e12, attention_flops=1e15, attention_bandwidth=1e9)
    spanned = dataclasses.replace(flat, attention_span_bandwidth=2e8)
    for c in (lone, four, mixed):
        t0, t1 = roofline_time(c, shape, flat), roofline_time(c, shape, spanned)
        assert t0.attention == pytest.approx(c.attn_bytes / 1e9, rel=1e-6)  # memory bound, max corner
        assert t1.attention - t0.attention == pytest.approx(c.attn_span_bytes / 2e8, rel=1e-6)
    # slowed() divides the span rate as it does the others (a neighbour takes a share of every stream)
    assert roofline_time(lone, shape, spanned.slowed(2.0)).attention == pytest.approx(
        2 * roofline_time(lone, shape, spanned).attention, rel=1e-6)
    with pytest.raises(ValueError, match="attention_span_bandwidth"):
        dataclasses.replace(flat, attention_span_bandwidth=0.0)


def _fit_finds_the_term(shape, truth, batches, recovered, ablation: dict, worse_than: float, gone: dict, absent):
    """The pattern both fitted terms (the prompt step's fixed cost, the span) are held to: on exact data made by
    ``truth`` the fit recovers ``recovered``; the same data fitted with the term left out (``ablation``, e.g.
    ``prompt_term=False``) errs by more than ``worse_than`` instead of hiding it in another term; on data made with
    the term removed (``gone``, the spec's field reset) the fit gives it none (``absent(spec)`` holds)."""
    costs = [step_cost(shape, b) for b in batches]
    times = [roofline_time(c, shape, truth).total for c in costs]
    theta, err = fit(costs, times, s_per_byte=1 / truth.mem_bandwidth)
    got = spec_from_theta(theta, "fit")
    assert err < 1e-6
    for k in recovered:
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-3), k
    _, err_without = fit(costs, times, s_per_byte=1 / truth.mem_bandwidth, **ablation)
    assert err_without > worse_than
    times = [roofline_time(c, shape, dataclasses.replace(truth, **gone)).total for c in costs]
    theta, err = fit(costs, times, s_per_byte=1 / truth.mem_bandwidth)
    assert err < 1e-6 and absent(spec_from_theta(theta, "fit"))
    return costs


def test_fit_recovers_a_span_rate_and_misses_without_the_term():
    """Data made with a span rate: the fit must find it (and the other roofs), and the same data fitted with one K/V
    rate (``span_term=False``, the ablation) must fit visibly worse rather than hide it in another term; data made
    without a span must get none (spec_from_theta's None)."""
    truth = HardwareSpec("truth", peak_flops=60e9, mem_bandwidth=12e9, attention_flops=25e9,
                         attention_bandwidth=6e9, attention_span_bandwidth=2e9, step_overhead_s=4e-3,
                         seq_overhead_s=0.3e-3)
    batches = _synthetic_batches() + [[(1500, 1, True)], [(1500, 1, True)] * 2, [(200, 1, True)] * 8]
    _fit_finds_the_term(model_preset("smollm2-135m").with_dtype(4), truth, batches,
                        ("attention_bandwidth", "attention_span_bandwidth", "attention_flops", "step_overhead_s"),
                        {"span_term": False}, 0.02, {"attention_span_bandwidth": None},
                        lambda spec: spec.attention_span_bandwidth is None)


@pytest.mark.parametrize("p", [4.0, 1.5])
def test_fit_round_trips_a_span_rate_at_a_soft_corner(p):
    """Both committed CPU profiles have a finite ``roof_p``, where the fit linearises each phase by the shares of
    :func:`~minivllm.sim.calibrate._shares`.  The span is part of attention's *memory* limit, so its share must be
    taken from the memory time with the span in it; shares taken from the work alone still converge, to a fit 0.1-0.5%
    off with the span rate 1-5% wrong, which no test at the ``max`` corner sees (there a share is 0 or 1).  Oracle:
    data made by :func:`roofline_time` from known rates must be fitted back exactly, and :func:`fit_roof` must find
    the corner it was made with."""
    from minivllm.sim.calibrate import fit_roof

    shape = model_preset("smollm2-135m").with_dtype(4)
    truth = HardwareSpec("truth", peak_flops=60e9, mem_bandwidth=12e9, attention_flops=25e9,
                         attention_bandwidth=6e9, attention_span_bandwidth=2e9, step_overhead_s=4e-3,
                         seq_overhead_s=0.3e-3, eager_step_overhead_s=5e-3, roof_p=p)
    batches = _synthetic_batches() + [[(1500, 1, True)], [(1500, 1, True)] * 2, [(200, 1, True)] * 8,
                                      [(900, 1, True), (0, 300, True)]]
    costs = [step_cost(shape, b) for b in batches]
    times = [roofline_time(c, shape, truth).total for c in costs]
    theta, err = fit(costs, times, s_per_byte=1 / truth.mem_bandwidth, roof_p=p)
    got = spec_from_theta(theta, "fit", roof_p=p)
    assert err < 1e-9
    for k in ("peak_flops", "attention_flops", "attention_bandwidth", "attention_span_bandwidth", "step_overhead_s",
              "seq_overhead_s", "eager_step_overhead_s"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-6), k
    for c, t in zip(costs, times):  # the fitted spec, as sim run prices a step, gives the data back
        assert roofline_time(c, shape, got).total == pytest.approx(t, rel=1e-9)
    assert fit_roof(costs, times, s_per_byte=1 / truth.mem_bandwidth)[2] == p


def test_span_is_the_longest_context_of_any_row_and_counts_toward_the_bound():
    """The span is the longest context after the step whatever computes it -- here a prompt chunk of 200 tokens from
    300, beside a decode at 50 -- and it belongs to attention's memory limit, so it can make a phase memory bound
    that the work alone would leave compute bound.  Oracle: hand sums (TINY: 32 bytes of K/V per token)."""
    c = step_cost(TINY, [(50, 1, True), (300, 200, False)])
    assert c.attn_span_bytes == 32 * 500
    work = c.attn_bytes / 1e6  # seconds at 1 MB/s
    flops_rate = c.attn_flops / (1.5 * work)  # compute takes 1.5x the work's memory time ...
    hw = HardwareSpec("toy", peak_flops=1e30, mem_bandwidth=1e30, attention_flops=flops_rate,
                      attention_bandwidth=1e6, attention_span_bandwidth=c.attn_span_bytes / work)  # ... the span 1x
    t = roofline_time(c, TINY, hw)
    assert t.attention == pytest.approx(2 * work) and t.attention_bound == "memory"
    t = roofline_time(c, TINY, dataclasses.replace(hw, attention_span_bandwidth=None))
    assert t.attention == pytest.approx(1.5 * work) and t.attention_bound == "compute"


def test_fit_recovers_the_fixed_cost_of_steps_with_prompt_tokens():
    """A step with prompt tokens pays a fixed cost a decode-only step does not (kernel launches no CUDA graph
    hides on a GPU; the prefill path's per-layer work on a CPU).

    The fit must find that cost -- and, on the same data with the term left out, fit visibly worse instead
    of silently spreading it over other terms; on data without such a cost it must find none.
    """
    truth = HardwareSpec("truth", peak_flops=500e12, mem_bandwidth=4e12, step_overhead_s=2e-3,
                         seq_overhead_s=20e-6, eager_step_overhead_s=9e-3)
    costs = _fit_finds_the_term(model_preset("llama-3.2-1b"), truth, _synthetic_batches(),
                                ("eager_step_overhead_s", "step_overhead_s", "seq_overhead_s", "peak_flops"),
                                {"prompt_term": False}, 0.1, {"eager_step_overhead_s": 0.0},
                                lambda spec: spec.eager_step_overhead_s == pytest.approx(0.0, abs=1e-9))
    assert any(c.eager for c in costs) and not all(c.eager for c in costs)


@pytest.mark.parametrize("profile,result", [
    ("2026-11-30_nvidia-h200_llama1b_profile.json", "2026-12-02_nvidia-h200_sim_accuracy_llama1b_resimulated.json"),
    ("2026-11-30_nvidia-h200_llama1b_profile_run2.json",
     "2026-12-02_nvidia-h200_sim_accuracy_llama1b_run2_resimulated.json"),
])
def test_refit_and_resimulate_reproduce_the_recorded_gpu_run(profile, result):
    """Each H200 profile in benchmarks/results re-fits to the parameters stored in it, and re-simulating the
    recorded sim_accuracy run with it reproduces the stored simulator metrics exactly (the simulator is
    deterministic; the workloads are regenerated from their seeds).  A change to the cost model fails here
    until the profiles are re-fitted (``minivllm sim calibrate --refit``) and the runs re-simulated
    (``sim_accuracy --resimulate ... --out``, a new file: the measured one is never overwritten)."""
    import copy
    import json
    import pathlib

    from minivllm.bench.sim_accuracy import resimulate
    from minivllm.sim.calibrate import refit

    results = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
    doc = json.loads((results / profile).read_text())
    again = refit(copy.deepcopy(doc))
    for k, v in doc["fit"]["params"].items():
        assert again["fit"]["params"][k] == pytest.approx(v, rel=1e-9, abs=1e-15), k
    assert doc["hardware"]["eager_step_overhead_s"] > 2 * doc["hardware"]["step_overhead_s"]  # 10 ms vs 2 ms
    stored = json.loads((results / result).read_text())
    redone = resimulate(stored, doc, out=io.StringIO())
    for name, row in stored["workloads"].items():
        for k, v in row["sim"].items():
            assert redone["workloads"][name]["sim"][k] == pytest.approx(v, rel=1e-9), (name, k)
        assert redone["workloads"][name]["real"] == row["real"]
        # what the stored run said about its own simulation (drift-adjusted errors) is not carried over
        assert "rel_error_drift_adjusted" not in redone["workloads"][name]
    assert "within_10pct_drift_adjusted" not in redone and "probe" not in redone


def test_a_gpu_profile_is_completed_from_its_datasheet_where_the_grid_could_not_see(tmp_path):
    """The H200 calibration measured no device memory and no compute roof (no step of its grid was compute
    bound): loaded for a simulation it gets the H200 datasheet's memory and achievable compute, so an 8K-token
    prefill of Llama-3-8B cannot come out faster than the GPU's peak allows (2 x 8.03e9 x 8192 FLOPs at
    989.5 TFLOP/s is 133 ms).  A GPU profile matching no datasheet and lacking memory is refused."""
    import json
    import pathlib

    from minivllm.sim.roofline import step_cost

    path = pathlib.Path(__file__).parent.parent / "benchmarks/results/2026-11-30_nvidia-h200_llama1b_profile_run2.json"
    raw = json.loads(path.read_text())
    assert raw["hardware"]["memory_bytes"] == 0 and raw["hardware"]["peak_flops"] >= 1e29  # what the fit left
    spec, sheet = hardware_preset(str(path)), HARDWARE["h200"]
    assert spec.memory_bytes == sheet.memory_bytes == 143_771 * 2**20  # what this H200 reported (nvidia-smi)
    assert spec.flops == pytest.approx(sheet.flops) and spec.attn_flops == pytest.approx(sheet.flops)
    assert spec.step_overhead_s == raw["hardware"]["step_overhead_s"]  # what the grid did see is kept
    shape = model_preset("llama-3-8b")
    prefill = roofline_time(step_cost(shape, [(0, 8192, True)]), shape, spec).total
    assert prefill > 2 * shape.num_params * 8192 / (989.5e12)
    for name in ("Some Other GPU", "NVIDIA L40S"):  # an L40S is not an L4: names match by word
        raw["hardware"]["name"] = name
        other = tmp_path / "other.json"
        other.write_text(json.dumps(raw))
        with pytest.raises(ValueError, match="no device memory"):
            hardware_preset(str(other))
    assert hardware_preset("cpu-2core").memory_bytes == 0  # a CPU profile: the engine's CPU pool applies


def test_calibrate_guards_the_committed_profiles_and_flags_a_noisy_fit(capsys):
    """Without --out, calibrate must not silently replace a committed profile (the tests load them): it refuses
    before measuring anything.  A fit above 15% rms is flagged with the machine's load."""
    import os

    from minivllm.sim.calibrate import default_name, fit_warning, main
    from minivllm.sim.presets import PROFILE_DIR

    assert os.path.exists(os.path.join(PROFILE_DIR, "cpu-1thread-cputime.json"))
    assert main(["--device", "cpu", "--clock", "cpu"]) == 2  # cpu-1thread-cputime.json exists
    assert "exists" in capsys.readouterr().err
    assert default_name("cpu", "cpu") == "cpu-1thread-cputime"
    assert fit_warning({"fit": {"rms_rel_error": 0.05}}) is None
    noisy = fit_warning({"fit": {"rms_rel_error": 0.503}, "loadavg": [5.8, 5.7, 4.3], "cpus": 2})
    assert "50%" in noisy and "5.8 on 2 CPUs" in noisy and "--clock cpu" in noisy


def test_explain_takes_a_recorded_run_apart_step_by_step():
    """``sim_accuracy --explain`` on the recorded H200 run: every logged step is counted once under its kind, and
    the real/predicted medians and the step-to-step repeatability equal a brute-force recomputation from the
    step logs with the roofline (the oracle: ``roofline_time`` on each step's shape, sorted by hand).  A
    synthetic result with host usage fills the host columns."""
    import json
    import pathlib

    from minivllm.bench.sim_accuracy import explain, format_explain
    from minivllm.sim.roofline import step_cost

    results = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
    doc = json.loads((results / "2026-11-30_nvidia-h200_llama1b_profile_run2.json").read_text())
    stored = json.loads((results / "2026-11-30_nvidia-h200_sim_accuracy_llama1b_run2.json").read_text())
    rows = explain(stored, doc)
    shape, spec = ModelShape(**doc["model"]), HardwareSpec.from_dict(doc["hardware"])
    for name, w in stored["workloads"].items():
        logs = w["real_step_logs"]
        prompt = [s for log in logs for s in log if any(q[1] > 1 for q in s[2])]
        decode = [s for log in logs for s in log if all(q[1] == 1 for q in s[2])]
        assert rows[name]["prompt"]["steps"] == len(prompt) and rows[name]["decode"]["steps"] == len(decode)
        ratios = sorted(s[1] / roofline_time(step_cost(shape, [tuple(q) for q in s[2]], 0, 16), shape, spec).total
                        for s in prompt)
        # nearest rank, the project's one percentile rule for a median: the ceil(n/2)-th smallest
        assert rows[name]["prompt"]["real_over_pred_p50"] == pytest.approx(ratios[-(-len(ratios) // 2) - 1])
        moved = sorted(abs(b[1] / a[1] - 1) for a, b in zip(*logs) if a[2] == b[2] and any(q[1] > 1 for q in a[2]))
        assert rows[name]["prompt"]["same_step_moved_max"] == pytest.approx(moved[-1])
        assert "cpu_over_wall_p50" not in rows[name]["prompt"]  # recorded before host usage was
    # the H200's miss, in one line: decode steps as predicted, the decode-heavy workload's prompt steps 1.5x slower
    assert 0.9 < rows["decode_heavy"]["decode"]["real_over_pred_p50"] < 1.1
    assert rows["decode_heavy"]["prompt"]["real_over_pred_p50"] > 1.3
    synthetic = {"workloads": {"w": {"real_step_logs": [[[0.0, 0.02, [[0, 64, True]], [0.015, 300, 2]],
                                                         [0.02, 0.01, [[64, 1, True]], [0.01, 0, 0]]]]}}}
    host = explain(synthetic, doc)["w"]
    assert host["prompt"]["cpu_over_wall_p50"] == pytest.approx(0.75) and host["prompt"]["minor_faults"] == 300
    assert host["prompt"]["involuntary_switches"] == 2 and host["decode"]["cpu_over_wall_p50"] == pytest.approx(1.0)
    assert "prompt" in format_explain(rows) and "0.75" in format_explain({"w": host})


def test_roof_corner_by_hand():
    from minivllm.sim.roofline import combine

    assert combine(3.0, 4.0, None) == 4.0  # the textbook roofline: the slower limit
    assert combine(3.0, 4.0, 1.0) == pytest.approx(7.0)  # no overlap at all
    assert combine(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert combine(0.0, 0.0, 3.0) == 0.0
    assert combine(1e-9, 5.0, 4.0) == pytest.approx(5.0)  # far from the ridge a p-norm is the max
    with pytest.raises(ValueError, match="roof_p"):
        HardwareSpec("x", peak_flops=1e9, mem_bandwidth=1e9, roof_p=0.5)


def test_fit_roof_recovers_a_soft_corner():
    from minivllm.sim.calibrate import fit_roof

    shape = model_preset("smollm2-135m").with_dtype(4)
    for p in (3.0, None):
        truth = HardwareSpec("truth", peak_flops=60e9, mem_bandwidth=12e9, attention_flops=25e9,
                             attention_bandwidth=3e9, step_overhead_s=4e-3, seq_overhead_s=0.3e-3, roof_p=p)
        costs = [step_cost(shape, b) for b in _synthetic_batches()]
        times = [roofline_time(c, shape, truth).total for c in costs]
        theta, err, got_p = fit_roof(costs, times, s_per_byte=1 / truth.mem_bandwidth)
        assert got_p == p and err < 1e-4
        got = spec_from_theta(theta, "fit", roof_p=got_p)
        for k in ("peak_flops", "attention_flops", "attention_bandwidth", "step_overhead_s"):
            assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-2), (p, k)


def test_roofline_executor_in_the_real_engine():
    from minivllm.sim.run import SimRequest, drive, make_engine

    shape, hw = model_preset("llama-3-8b"), hardware_preset("h100")
    reqs = [SimRequest(i, 0.01 * i, "t", list(range(10, 10 + 20 + 7 * i)), 5 + i % 3) for i in range(12)]
    runs = []
    for _ in range(2):
        engine = make_engine(shape, hw, max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks_override=64)
        rec = drive(engine, reqs)
        runs.append([(r.ttft, tuple(r.itl), r.e2e) for r in rec.results])
        assert all(r.outcome == "ok" and r.output_tokens == q.max_tokens for r, q in zip(rec.results, reqs))
        # the clock is the sum of the roofline step times plus idle gaps: never behind the busy time
        assert engine.executor.busy_s <= engine.executor.now() + 1e-12
        # an ITL is at least one decode step of an 8B model on an H100
        assert min(g for r in rec.results for g in r.itl) > 0.005
    assert runs[0] == runs[1]  # deterministic to the bit


def test_executors_fit_the_protocol_and_idle_between_arrivals():
    from minivllm.interfaces import Executor
    from minivllm.sim import ReplayExecutor, SimulatedExecutor
    from minivllm.sim.run import SimRequest, drive, make_engine

    ex = RooflineExecutor(model_preset("qwen3-0.6b"), hardware_preset("l4"))
    assert isinstance(ex, Executor) and isinstance(ReplayExecutor([]), Executor)
    # two requests 5 s apart: the clock jumps over the idle gap, the second request's TTFT is one prefill step
    engine = make_engine(ex.shape, ex.hardware, max_num_seqs=4, max_num_batched_tokens=256, num_gpu_blocks_override=64)
    rec = drive(engine, [SimRequest(0, 0.0, "t", [11] * 100, 3), SimRequest(1, 5.0, "t", [12] * 100, 3)])
    first, second = rec.results
    assert first.ttft == pytest.approx(second.ttft)
    assert 5.0 < second.start + second.e2e < 5.5 and engine.executor.busy_s < 1.0
    # the old linear executor idles the same way (no real sleeping on a virtual clock)
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine

    lin = LLMEngine(EngineConfig(num_gpu_blocks_override=64, max_model_len=512, device="cpu"),
                    executor=SimulatedExecutor(), model_max_len=512, eos_token_ids=set())
    rec = drive(lin, [SimRequest(0, 0.0, "t", [11] * 10, 2), SimRequest(1, 100.0, "t", [12] * 10, 2)])
    assert rec.wall_s < 5 and lin.executor.now() > 100.0


def test_calibrate_end_to_end_on_a_simulated_device():
    """The whole calibration path (grid -> engine -> measured steps -> fit) on an engine whose "device" is a
    roofline with known parameters: the profile must give those parameters back."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, calibrate

    shape = model_preset("smollm2-135m").with_dtype(4)
    truth = HardwareSpec("truth", peak_flops=80e9, mem_bandwidth=15e9, attention_flops=20e9,
                         attention_bandwidth=2e9, step_overhead_s=3e-3, seq_overhead_s=0.2e-3)
    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=32, num_gpu_blocks_override=512, max_model_len=4096,
                       device="cpu")
    engine = LLMEngine(cfg, executor=RecordingExecutor(RooflineExecutor(shape, truth)), model_max_len=4096,
                       eos_token_ids=set())
    # pin_bandwidth=False: this "device" streams at truth's 15 GB/s, not at what this machine measures
    doc = calibrate(engine, shape=shape, scale=0.4, name="sim-device", out=None, pin_bandwidth=False)
    got = HardwareSpec.from_dict(doc["hardware"])
    assert doc["fit"]["rms_rel_error"] < 1e-6 and doc["fit"]["steps"] > 20
    for k in ("peak_flops", "mem_bandwidth", "attention_flops", "attention_bandwidth", "step_overhead_s",
              "seq_overhead_s"):
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-3), k


class _HostBoundExecutor(RooflineExecutor):
    """A forward pass with a known cost to the host: 20 ms of CPU, 300 ms asleep, 8 MiB of fresh memory touched.

    The sleep is long so that "counted the sleep" and "faulting 8 MiB in was slow on a busy machine" cannot be
    confused: the faults cost a few ms to a few tens of ms, the sleep 300."""

    def execute(self, batch):
        import time

        end = time.thread_time() + 0.020
        while time.thread_time() < end:
            pass
        time.sleep(0.300)
        import mmap

        fresh = mmap.mmap(-1, 8 << 20)  # a new anonymous mapping (never recycled by malloc): 2,048 fresh pages
        for offset in range(0, 8 << 20, mmap.PAGESIZE):
            fresh[offset] = 1  # the first write to each page is a minor fault
        fresh.close()
        return super().execute(batch)


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="per-thread getrusage is Linux's")
def test_recorded_steps_carry_what_they_cost_the_host():
    """sim_accuracy's step logs say whether a slow step *ran* slower or *waited*: each recorded forward pass
    carries its thread's CPU time, minor page faults and involuntary switches.  Oracle: a forward pass that
    spins 20 ms of CPU, sleeps 300 ms and writes 8 MiB of new memory -- CPU time must read the spin plus the
    faults (not the 320+ ms of wall time), and the faults must show the fresh pages."""
    from minivllm.bench.sim_accuracy import step_log
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, calibration_grid, measure

    shape = model_preset("smollm2-135m").with_dtype(4)
    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=32, num_gpu_blocks_override=64, max_model_len=1024,
                       device="cpu")
    engine = LLMEngine(cfg, executor=_HostBoundExecutor(shape, hardware_preset("h100")), model_max_len=1024,
                       eos_token_ids=set(), executor_wrapper=RecordingExecutor)
    samples, _ = measure(engine, calibration_grid(shape.vocab_size)[0])  # one lone 16-token prefill
    assert len(samples) == 1 and samples[0].host is not None
    host = samples[0].host
    assert 0.020 <= host.cpu_s < 0.200, host  # the spin, plus faulting 8 MiB in; never the 300 ms asleep
    import mmap

    assert host.minor_faults >= 0.7 * (8 << 20) // mmap.PAGESIZE, host  # most of the fresh pages
    assert host.involuntary_switches >= 0
    row = step_log(samples)[0]
    assert row[2] == [[0, 16, True]] and row[3] == [host.cpu_s, host.minor_faults, host.involuntary_switches]


class _BusyHostExecutor(RooflineExecutor):
    """A forward pass that keeps the host busy for 1 ms and never blocks, like a graphed decode step whose CUDA
    sync spins on a GPU, or a CPU forward pass: no sleep, no context switch inside it."""

    def execute(self, batch):
        import time

        end = time.perf_counter() + 0.001  # (not thread_time: reading the thread's CPU clock refreshes the account)
        while time.perf_counter() < end:
            pass
        return super().execute(batch)


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="per-thread getrusage is Linux's")
def test_recorded_cpu_time_of_a_busy_step_is_not_stale():
    """A forward pass that never blocks must record the CPU time it used.  Oracle: each step spins 1 ms of
    wall time without yielding, so at the median it uses about 1 ms of CPU.  ``getrusage(RUSAGE_THREAD)``
    reads the scheduler's account of a running thread, brought up to date only at a timer tick or a switch:
    three of four such steps read 0 CPU and the median was 0 (the dry run's CPU decode steps, pure
    computation, showed cpu/wall 0.00 in ``--explain``), so a host-bound step looked like one that waited."""
    import statistics

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, calibration_grid, measure

    shape = model_preset("smollm2-135m").with_dtype(4)
    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=32, num_gpu_blocks_override=64, max_model_len=1024,
                       device="cpu")
    engine = LLMEngine(cfg, executor=_BusyHostExecutor(shape, hardware_preset("h100")), model_max_len=1024,
                       eos_token_ids=set(), executor_wrapper=RecordingExecutor)
    # decode batches of 1 to 32 sequences (groups 11-16): dozens of short steps back to back
    cpu = [s.host.cpu_s for group in calibration_grid(shape.vocab_size)[11:17] for s in measure(engine, group)[0]]
    assert len(cpu) >= 20
    # a step may lose the core for part of its spin on a shared machine, not most steps most of it
    assert statistics.median(cpu) >= 0.0006, cpu


def _known_device():
    """A "device" that is a roofline of known parameters (a prompt-step cost and a rounded roof corner included)
    and sim_accuracy's engine configuration: what the drift tests calibrate on, then slow down."""
    from minivllm.config import EngineConfig

    shape = model_preset("smollm2-135m").with_dtype(4)
    truth = HardwareSpec("truth", peak_flops=80e9, mem_bandwidth=15e9, attention_flops=20e9, roof_p=3.0,
                         attention_bandwidth=2e9, step_overhead_s=3e-3, seq_overhead_s=0.2e-3,
                         eager_step_overhead_s=4e-3)
    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=32, num_gpu_blocks_override=512, max_model_len=4096,
                       device="cpu")
    return shape, truth, cfg


@pytest.mark.parametrize("factor", [1.0, 1.25])
def test_drift_probe_reads_a_known_slowdown(factor):
    """sim_accuracy's drift probe, on a "device" that is a roofline: calibrate on it, then slow it by a known
    factor (``HardwareSpec.slowed``) -- every step of the probe must take exactly that factor longer than the
    calibration recorded, with the roofs, fixed costs and the eager-step cost all slowed alike."""
    from minivllm.bench.sim_accuracy import PROBE_GROUPS, probe_reference, probe_seconds
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, calibrate, calibration_grid

    shape, truth, cfg = _known_device()

    def engine(spec):
        return LLMEngine(cfg, executor=RecordingExecutor(RooflineExecutor(shape, spec)), model_max_len=4096,
                         eos_token_ids=set())

    doc = calibrate(engine(truth), shape=shape, scale=0.6, name="sim-device", out=None, pin_bandwidth=False)
    ref_s, ref_counts = probe_reference(doc)
    grid = calibration_grid(shape.vocab_size, scale=0.6)
    took, counts = probe_seconds(engine(truth.slowed(factor)), [grid[g] for g in PROBE_GROUPS], repeats=1)
    assert counts == ref_counts and all(counts)
    assert took / ref_s == pytest.approx(factor, rel=1e-9)


def test_the_drift_adjusted_simulation_is_slowed_by_the_mean_of_the_probes_around_the_workload(monkeypatch, tmp_path):
    """sim_accuracy's drift-adjusted column, on a "real" engine that is a roofline device of known speed.  Its
    speed moves during the run: calibrated at x1.00, it runs the probe before the workload at x1.00, the workload
    at x1.10 and the probe after it at x1.20 (a machine slowing steadily).  The mean of the two probes is the
    workload's own speed, so the adjusted simulation is this device exactly (errors ~0) while the verdict's
    simulation, at the calibrated speed, is fast on every metric.  Kills: the adjustment slowing by the probe after (x1.20) or before (x1.00) alone,
    dividing by the drift, or leaving the column out.  Oracle: the device's speed, set by the test."""
    import json

    from minivllm.bench import sim_accuracy
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, calibrate

    shape, truth, cfg = _known_device()
    device = RooflineExecutor(shape, truth)
    real = LLMEngine(cfg, executor=RecordingExecutor(device), model_max_len=4096, eos_token_ids=set())
    profile = tmp_path / "device.json"
    profile.write_text(json.dumps(calibrate(real, shape=shape, scale=0.6, name="sim-device", out=None,
                                            pin_bandwidth=False)))
    probes = iter([(1.0, 1.10), (1.20, 1.20)])  # per probe: the device's speed during it, then after it
    real_probe = sim_accuracy.probe_seconds

    def probe_then_change_speed(engine, groups, repeats=3):
        during, after = next(probes)
        device.hardware = truth.slowed(during)
        got = real_probe(engine, groups, repeats)
        device.hardware = truth.slowed(after)
        return got

    monkeypatch.setattr(sim_accuracy, "probe_seconds", probe_then_change_speed)
    res = sim_accuracy._against_real(real, 0.5, str(profile), ["decode_heavy"], io.StringIO(), None, 1, 1)
    row = res["workloads"]["decode_heavy"]
    assert row["drift"]["before"] == pytest.approx(1.0) and row["drift"]["after"] == pytest.approx(1.2)
    assert all(abs(e) < 1e-6 for e in row["rel_error_drift_adjusted"].values()), row["rel_error_drift_adjusted"]
    assert all(e < 0 for e in row["rel_error"].values()) and min(row["rel_error"].values()) < -0.1, row["rel_error"]
    assert res["within_10pct_drift_adjusted"] == "5/5"


def test_the_quick_calibration_grid_drops_only_the_big_decode_groups_and_keeps_the_probe_in_place():
    """A quick grid (``scale`` < 1, sim_accuracy's quick run) leaves out the decode groups holding more than 2,048
    tokens of context -- the slow ones on a CPU -- and nothing else; the groups before them, the drift probe's
    two among them, keep their index and their shape, so a probe reads the same steps in either grid.  Kills:
    the filter dropped (the quick grid as slow as the full one) or applied to every scale (the full grid
    without its long-context decodes, which the K/V-reading term needs).  Oracle: the grid's own list of
    decode shapes, counted here by hand: 11 decode groups, of which (12, 384) and (4, 1024) exceed 2,048."""
    from minivllm.bench.sim_accuracy import PROBE_GROUPS
    from minivllm.sim.calibrate import calibration_grid

    def shapes(grid):
        return [(len(g), len(g[0].prompt_token_ids), g[0].max_tokens) for g in grid]

    full, quick = shapes(calibration_grid(scale=1.0)), shapes(calibration_grid(scale=0.6))
    assert len(full) == 11 + 11 and len(quick) == 11 + 9
    decodes = [(b, p) for b, p, _ in full[11:]]
    assert [(b, p) for b, p, _ in quick[11:]] == [(b, p) for b, p in decodes if b * p <= 2048]
    assert {(12, 384), (4, 1024)} == set(decodes) - {(b, p) for b, p, _ in quick[11:]}
    assert quick[:11] == full[:11]  # prefills and mixed groups: the same at any scale
    for g in PROBE_GROUPS:
        assert quick[g][:2] == full[g][:2], g  # the same shape at the same index (decode steps scale)


def test_calibration_repeats_take_the_median_step(monkeypatch):
    """A device that triples every 13th step it runs: one run fits it badly, the median of three runs (what
    ``repeats=3`` keeps per step) gives the true parameters back.  The hiccups are periodic rather than
    random so that no step is hit in two of its three runs (that needs a group of exactly 13 steps, checked
    below), which is the case the median is for: rare, independent upsets."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, calibrate

    shape = model_preset("smollm2-135m").with_dtype(4)
    truth = HardwareSpec("truth", peak_flops=80e9, mem_bandwidth=15e9, attention_flops=20e9,
                         attention_bandwidth=2e9, step_overhead_s=3e-3, seq_overhead_s=0.2e-3)

    steps = itertools.count(1)

    class Hiccups(RooflineExecutor):
        def breakdown(self, batch, sampled=None):
            from dataclasses import replace

            t = super().breakdown(batch, sampled)
            return replace(t, overhead=t.overhead + 2 * t.total) if next(steps) % 13 == 0 else t

    def fitted(repeats):
        cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=32, num_gpu_blocks_override=512,
                           max_model_len=4096, device="cpu")
        engine = LLMEngine(cfg, executor=RecordingExecutor(Hiccups(shape, truth)), model_max_len=4096,
                           eos_token_ids=set())
        doc = calibrate(engine, shape=shape, scale=0.4, name="hiccups", out=None, pin_bandwidth=False, repeats=repeats)
        return HardwareSpec.from_dict(doc["hardware"]), doc

    once, _ = fitted(1)
    median, doc = fitted(3)
    assert doc["fit"]["repeats"] == 3
    per_group = collections.Counter(x["group"] for x in doc["samples"])
    assert 13 not in per_group.values()
    assert once.peak_flops != pytest.approx(truth.peak_flops, rel=0.02)  # the hiccups did pull the single run
    for k in ("peak_flops", "attention_flops", "step_overhead_s"):
        assert getattr(median, k) == pytest.approx(getattr(truth, k), rel=0.02), k


def test_sim_run_cli(tmp_path, capsys):
    import json

    from minivllm.cli import main

    out = tmp_path / "sim.json"
    rc = main(["sim", "run", "--workload", "shared-prefix", "--enable-prefix-caching", "--num-requests", "40",
               "--hardware", "a100", "--model", "llama-3.2-1b", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "TTFT ms p50/p90/p99" in text and "prefix hit rate" in text
    doc = json.loads(out.read_text())
    assert doc["summary"]["overall"]["ok"] == 40
    # 40 requests share a 1024-token system prompt: all but the first hit it
    assert doc["sim"]["prefix_cache_hit_rate"] > 0.8
    assert main(["sim", "run", "--workload", "no-such-workload"]) == 2
    assert main(["sim", "run", "--hardware", "tpu-v9", "--num-requests", "3"]) == 2
    # one request past the model's 131,072 positions is refused on its own, as a server's 400, not the whole run
    trace = tmp_path / "huge.jsonl"
    trace.write_text('{"prompt_len": 200000, "output_len": 4, "arrival": 0.0}\n'
                     '{"prompt_len": 100, "output_len": 4, "arrival": 0.1}\n')
    capsys.readouterr()
    assert main(["sim", "run", "--workload", str(trace), "--hardware", "l4", "--out", str(out)]) == 0
    overall = json.loads(out.read_text())["summary"]["overall"]
    assert (overall["ok"], overall["error"]) == (1, 1)
    assert "offered nan" not in capsys.readouterr().out  # a trace without a rate gets its own in the header


@pytest.mark.parametrize("name", ["cpu-1thread-cputime", "cpu-2core"])
def test_committed_cpu_profile_loads_and_reproduces_its_fit(name):
    from minivllm.sim.presets import load_profile, profile_names

    assert name in profile_names()
    doc = load_profile(name)
    hw = hardware_preset(name)
    shape = ModelShape(**{k: v for k, v in doc["model"].items()})
    # a CPU: 1 GFLOP/s .. 10 TFLOP/s of GEMM; memory at least 1 GB/s (1e30 = "never the binding roof", which a
    # single-model fit may conclude: its per-step weight read is then folded into the step overhead)
    assert hw.step_overhead_s >= 0 and 1e9 < hw.peak_flops < 1e13 and hw.mem_bandwidth > 1e9
    decode = roofline_time(step_cost(shape, [(100, 1, True)]), shape, hw).total
    assert 5e-3 < decode < 1.0  # one decode step of SmolLM2-135M on a CPU core: milliseconds, not microseconds
    # the stored predictions are what this spec gives for the stored batch shapes
    for s in doc["samples"][:50]:
        seqs = [tuple(x) for x in s["seqs"]]
        t = roofline_time(step_cost(shape, seqs, s["swapped_blocks"], doc["engine"]["block_size"]), shape, hw).total
        assert t == pytest.approx(s["pred_s"], rel=1e-9)
    rel = [abs(s["pred_s"] - s["time_s"]) / s["time_s"] for s in doc["samples"]]
    assert (sum(r * r for r in rel) / len(rel)) ** 0.5 == pytest.approx(doc["fit"]["rms_rel_error"], rel=1e-6)


def test_roofline_preemption_costs_are_length_aware():
    """Recompute costs what its chunks add to a busy step: nearly nothing while the step is memory bound, more per
    token once it is compute bound, more again as attention grows with the context. A one-rate model (the engine's
    default) has the same cost per token at every length; swap is linear by construction."""
    shape, hw = model_preset("llama-3-8b"), hardware_preset("h100")
    costs = RooflinePreemptionCosts(shape, hw, block_size=16, chunk=2048)
    assert costs.swap_s(10) == pytest.approx(2 * 10 * 16 * 131072 / 64e9)  # 128 KiB of K/V a token, twice over PCIe 5
    per_token = {n: costs.recompute_s(n) / n for n in (256, 2048, 32768)}
    assert per_token[2048] > 3 * per_token[256]
    assert per_token[32768] > 1.3 * per_token[2048]
    grid = [2 ** k for k in range(4, 18)]
    says = [costs.prefers_swap(n, -(-n // 16)) for n in grid]
    assert not says[0] and says[-1] and says == sorted(says)  # recompute short victims, swap long ones: one switch


def test_sim_run_auto_mode_swaps_long_victims_and_recomputes_short_ones():
    """``minivllm sim run --preemption-mode auto`` decides with the roofline's costs. With the engine's one-rate
    default every victim of this workload would be swapped (its rate is a CPU guess, 1,000 tokens/s)."""
    from minivllm.sim.run import SimRequest, drive, make_engine

    shape, hw = model_preset("llama-3-8b"), hardware_preset("h100")
    engine = make_engine(shape, hw, num_gpu_blocks_override=700, num_cpu_blocks_override=4000,
                         preemption_mode="auto", max_num_batched_tokens=2048, max_num_seqs=64)
    costs = engine.scheduler.costs
    assert isinstance(costs, RooflinePreemptionCosts) and costs.chunk == 2048
    rng = np.random.default_rng(0)
    # three long prompts first, then short ones: the newest (the default victim) may be of either kind
    reqs = [SimRequest(i, 0.02 * i, "t", [int(x) for x in rng.integers(10, 1000, 3000 if i < 3 else 64)], 600)
            for i in range(24)]
    drive(engine, reqs)
    st = engine.stats()
    assert st["num_swap_preemptions"] > 0 and st["num_recompute_preemptions"] > 0, st
    crossover = next(n for n in range(16, 8192, 16) if costs.prefers_swap(n, n // 16))
    assert st["recomputed_tokens"] < crossover * st["num_recompute_preemptions"]  # only short victims recomputed


def test_sim_run_header_and_sparkline_say_something_at_low_load():
    """A trace without a rate gets its own mean rate in the header (not "nan"), and a pool that never reached a
    tenth full still draws its shape, on a stated scale (at 2% usage every bar used to round to blank)."""
    from minivllm.sim.run import SimRequest, _rate, _spark_top, sparkline

    trace = [SimRequest(i, t, "default", [1, 2], 4) for i, t in enumerate([0.0, 1.0, 2.0, 4.0])]
    assert _rate(float("nan"), trace) == "0.75 (the trace's mean)" and _rate(2.0, trace) == "2"
    assert _rate(None, trace[:1]) == "-"
    low = {"kv_usage_peak": 0.02}
    assert _spark_top(low) == 0.02 and _spark_top({"kv_usage_peak": 0.5}) == 1.0
    line = sparkline([0.0, 0.005, 0.01, 0.02], width=4, top=_spark_top(low))
    assert line[0] == " " and all(c != " " for c in line[1:]) and line[-1] == "█"


def test_sim_run_sparkline_scale_is_the_peak_per_cent_exactly_when_it_is_whole():
    """The low-load scale is the peak "rounded up to a whole per cent": a peak already whole keeps its value.
    Hand case: 7 of 100 blocks held -> 7%, and the peak column a full block (0.035 half of it: 4 of 8 bars).
    It was 8% (0.07 * 100 is 7.000000000000001 in floats), the peak drawn as 7 of 8 bars under a wrong label."""
    from minivllm.sim.run import _spark_top, sparkline

    top = _spark_top({"kv_usage_peak": 7 / 100})
    assert top == 0.07
    assert sparkline([0.0, 0.035, 7 / 100], top=top) == " ▄█"


def test_the_gemm_rate_follows_the_dtype_on_a_datasheet_gpu():
    """A datasheet quotes BF16 tensor-core FLOP/s; an fp8 model runs twice as fast on them, and an fp32 one at
    the FP32 units' own datasheet peak (67 of 989.5 TFLOP/s on an H100; not TF32's half, which torch leaves off)
    -- a compute-bound 8K prefill's dense phase scales exactly so -- while a calibrated CPU profile keeps the rate
    it measured for its own dtype.  (It used to price fp8, bf16 and fp32 alike, then fp32 as TF32.)"""
    from minivllm.sim.roofline import step_cost

    h100 = hardware_preset("h100")
    dense = {}
    for b in (1, 2, 4):
        shape = model_preset("llama-3-8b", b)
        t = roofline_time(step_cost(shape, [(0, 8192, True)]), shape, h100)
        assert t.dense_bound == "compute"
        dense[b] = step_cost(shape, [(0, 8192, True)]).dense_flops / t.dense  # the FLOP/s the step was priced at (2 FLOPs a weight)
    assert dense[1] == pytest.approx(2 * dense[2], rel=0.02)
    assert dense[4] == pytest.approx(dense[2] * 67 / 989.5, rel=0.02)
    assert dense[2] == pytest.approx(h100.flops, rel=0.02)
    cpu = hardware_preset("cpu-2core")
    assert cpu.flops_dtype_bytes == 0 and cpu.dtype_scale(2) == cpu.dtype_scale(4) == 1.0


def test_sim_run_out_holds_the_per_request_results_it_promises(tmp_path):
    """``--out`` says it writes "the summary (and per-request results)": the records are there, one per request,
    and the summary's percentiles are numpy's over them (``--no-requests-in-json`` leaves them out, as
    ``bench serve``'s does)."""
    import json

    import numpy as np

    from minivllm.sim.run import main

    out = tmp_path / "sim.json"
    assert main(["--num-requests", "30", "--request-rate", "20", "--model", "llama-3.2-1b", "--hardware", "l4",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    reqs = doc["requests"]
    assert len(reqs) == 30 and all(r["outcome"] == "ok" for r in reqs)
    ttft_ms = [1000 * r["ttft"] for r in reqs]
    assert doc["summary"]["overall"]["ttft_ms"]["p90"] == pytest.approx(np.percentile(ttft_ms, 90))
    assert main(["--num-requests", "5", "--model", "llama-3.2-1b", "--hardware", "l4", "--no-requests-in-json",
                 "--out", str(out)]) == 0
    assert "requests" not in json.loads(out.read_text())


def test_the_drift_line_names_its_reference_when_the_profile_has_no_probe_steps(tmp_path):
    """A profile without probe steps (the bundled ``cpu-2core``'s samples carry no group) leaves nothing to compare
    the probe with, so drift is measured against this run's own first probe: x1.000 at the start by construction.
    The line said "against the calibration's" all the same, on a device 1.5x slower than its calibration -- a
    comparison that never happened.  Oracle: the device's speed, set by the test (1.5 read against a tagged
    profile; the untagged one must say what it compared with)."""
    import json

    from minivllm.bench import sim_accuracy
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.calibrate import RecordingExecutor, calibrate

    shape, truth, cfg = _known_device()
    doc = calibrate(LLMEngine(cfg, executor=RecordingExecutor(RooflineExecutor(shape, truth)), model_max_len=4096,
                              eos_token_ids=set()), shape=shape, scale=0.6, name="sim-device", out=None,
                    pin_bandwidth=False)
    tagged, untagged = tmp_path / "tagged.json", tmp_path / "untagged.json"
    tagged.write_text(json.dumps(doc))
    untagged.write_text(json.dumps({**doc, "samples": [{k: v for k, v in x.items() if k != "group"}
                                                       for x in doc["samples"]]}))
    for profile, reference, start in ((tagged, "calibration", 1.5), (untagged, "first probe", 1.0)):
        slow = LLMEngine(cfg, executor=RecordingExecutor(RooflineExecutor(shape, truth.slowed(1.5))),
                         model_max_len=4096, eos_token_ids=set())
        out = io.StringIO()
        res = sim_accuracy._against_real(slow, 0.5, str(profile), ["decode_heavy"], out, None, 1, 1)
        assert res["probe"]["reference"] == reference
        assert res["workloads"]["decode_heavy"]["drift"]["before"] == pytest.approx(start)
        said = "against the calibration's" if reference == "calibration" else "against this run's first"
        assert said in out.getvalue(), out.getvalue()[-400:]


def test_sim_accuracy_killed_mid_run_leaves_its_profile_and_the_finished_workloads(monkeypatch, tmp_path):
    """A GPU lease runs sim_accuracy in a time box, and the next step (``--live-heap --profile``) needs the profile
    it saves.  A run ended after its calibration and one workload must leave the profile and that workload's row on
    disk, marked unfinished.  Kills: writing only at the end (a run killed after 2 of 3 workloads left no file at
    all).  Oracle: the kill comes at the drift probe after the first workload; the files are read back."""
    import json

    from minivllm.bench import sim_accuracy
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim import calibrate as cal

    shape, truth, cfg = _known_device()
    monkeypatch.setattr(cal, "real_engine", lambda **kw: LLMEngine(
        cfg, executor=cal.RecordingExecutor(RooflineExecutor(shape, truth)), model_max_len=4096, eos_token_ids=set()))
    real_calibrate = cal.calibrate
    # this "device" streams at truth's bandwidth, not this machine's: nothing to measure (and no 512 MB to read)
    monkeypatch.setattr(cal, "calibrate", lambda *a, **kw: real_calibrate(*a, **dict(kw, pin_bandwidth=False)))
    probes, real_probe = [], sim_accuracy.probe_seconds

    def probe_then_kill(engine, groups, repeats=3):
        probes.append(1)
        if len(probes) == 3:  # the start, after decode_heavy, after bursty_mixed: killed there
            raise KeyboardInterrupt
        return real_probe(engine, groups, repeats)

    monkeypatch.setattr(sim_accuracy, "probe_seconds", probe_then_kill)
    out, profile = tmp_path / "result.json", tmp_path / "profile.json"
    with pytest.raises(KeyboardInterrupt):
        sim_accuracy.main(["--scale", "0.2", "--real-repeats", "1", "--calibration-repeats", "1",
                           "--out", str(out), "--save-profile", str(profile)])
    saved = json.loads(profile.read_text())
    assert saved["samples"] and saved["hardware"]["name"]
    got = json.loads(out.read_text())
    assert list(got["workloads"]) == ["decode_heavy"], list(got["workloads"])
    assert got["unfinished_workloads"] == ["bursty_mixed", "long_prompt_chunked"]
    assert got["workloads"]["decode_heavy"]["real_step_logs"] and got["command"].startswith("python -m minivllm")
    assert "_profile" not in got
    # what was left is a result --explain reads, against the profile left beside it
    assert sim_accuracy.main(["--explain", str(out), "--profile", str(profile)]) == 0
