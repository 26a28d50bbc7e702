"""Bugs found in a hunt over the simulator's executor, presets and profile loading.

Each test's oracle is independent of the code under test: a datasheet peak and the FLOPs of a step counted
by hand, or what a profile says it holds.
"""

from __future__ import annotations

import json
import pathlib

import pytest

from minivllm.sim.presets import HARDWARE, hardware_preset, model_preset, profile_spec
from minivllm.sim.roofline import HardwareSpec, roofline_time, step_cost

RESULTS = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
H200_BF16_DENSE_PEAK = 989.5e12  # NVIDIA H200 SXM datasheet: 1,979 TFLOP/s BF16 with sparsity -> 989.5 dense


def test_no_profile_lets_a_prefill_beat_the_datasheet_peak_of_its_gpu():
    """The first H200 profile's grid (a 1B model, prompts up to 1,024 tokens) hardly reached the compute roof,
    and the fit put it at 1,763 TFLOP/s -- 1.8x the H200's BF16 peak, which no kernel exceeds.  profile_spec
    bounded only a roof the fit left at "infinity", so ``sim run --hardware`` with this profile priced the GEMMs
    of an 8K-token prefill of Llama-3-8B at 69 ms (the whole step at 118 ms), where their FLOPs take 116 ms at
    the datasheet peak (the very thing profile_spec's docstring says it prevents).  Oracle: 2 FLOPs per weight
    per token for the 32 layers' GEMMs (32 x 218,103,808 weights, counted from the published config) over
    989.5 TFLOP/s."""
    layer_weights = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q, o; k, v (8 KV heads of 128); MLP
    gemm_flops = 2 * 32 * layer_weights * 8192
    floor_s = gemm_flops / H200_BF16_DENSE_PEAK  # 0.1156 s for the layers alone, before lm_head and attention
    shape = model_preset("llama-3-8b")
    for name in ("2026-11-30_nvidia-h200_llama1b_profile.json", "2026-11-30_nvidia-h200_llama1b_profile_run2.json"):
        spec = hardware_preset(str(RESULTS / name))
        t = roofline_time(step_cost(shape, [(0, 8192, True)]), shape, spec)
        assert t.dense > floor_s, name
        assert spec.flops <= H200_BF16_DENSE_PEAK and spec.attn_flops <= H200_BF16_DENSE_PEAK, name


def test_a_fitted_compute_roof_within_the_datasheet_peak_is_kept():
    """The bound replaces only what cannot be true: a compute roof the fit found below the peak (here 800 of
    989.5 TFLOP/s, above the preset's assumed 70% -- a measurement beats that assumption) stays as fitted."""
    doc = {"device": "cuda", "model": {"dtype_bytes": 2},
           "hardware": {"name": "NVIDIA H200", "peak_flops": 800e12, "mem_bandwidth": 4e12, "attention_flops": 2e15,
                        "memory_bytes": 150e9}}
    spec = profile_spec(doc)
    assert spec.peak_flops == 800e12
    assert spec.attn_flops == pytest.approx(HARDWARE["h200"].flops)  # 2,000 TFLOP/s of attention: not possible


@pytest.mark.parametrize("field,value", [("attention_bandwidth", 0.0), ("attention_bandwidth", -7.8e9),
                                         ("attention_flops", 0.0), ("attention_flops", -1e9),
                                         ("attention_flops", "8e10"), ("flops_dtype_bytes", 3)])
def test_a_profile_with_an_impossible_attention_roof_is_refused_when_loaded(tmp_path, field, value):
    """HardwareSpec checked every roof but the attention ones and the dtype its FLOP/s are quoted for.  A profile
    with ``attention_bandwidth: 0`` (or a string, or ``flops_dtype_bytes: 3``) loaded, and then every step of
    ``sim run`` raised inside the executor: the engine failed all requests with "execution failed" and the
    command exited 0 with a table of errors.  A negative roof loaded and was silently wrong (the max, or the
    p-norm, of the two limits took the other one, or more).  Like a zero ``peak_flops``, it is a ValueError
    that names the field, when the profile is read."""
    doc = json.loads((pathlib.Path(__file__).parent.parent / "minivllm/sim/profiles/cpu-2core.json").read_text())
    doc["hardware"][field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=field):
        hardware_preset(str(path))
    with pytest.raises(ValueError, match=field):
        HardwareSpec("toy", peak_flops=1e12, mem_bandwidth=1e11, **{field: value})
    HardwareSpec("toy", peak_flops=1e12, mem_bandwidth=1e11, attention_flops=None, attention_bandwidth=None)


def test_an_fp32_model_on_a_datasheet_gpu_runs_at_the_fp32_units_peak_not_tf32():
    """torch leaves TF32 off for fp32 matmuls and the engine's Triton kernels ask for exact fp32 dots, so an fp32
    model on this engine computes on the FP32 units: each preset's FP32 datasheet figure (H100/H200 67, A100
    19.5, L4 30.3 TFLOP/s), not half the BF16 rate (TF32), which priced compute-bound fp32 steps 7-8x too fast.
    The oracle is the engine's own setting, read from torch, and the datasheet figures."""
    import torch

    assert torch.backends.cuda.matmul.allow_tf32 is False  # what the rate below assumes of the engine
    fp32 = {"h100": 67e12, "h200": 67e12, "a100": 19.5e12, "l4": 30.3e12}
    for name, rate in fp32.items():
        hw = HARDWARE[name]
        assert hw.peak_flops * hw.dtype_scale(4) == pytest.approx(rate), name
        assert hw.dtype_scale(2) == 1.0 and hw.dtype_scale(1) == 2.0


def test_an_fp32_model_on_a_spec_with_no_fp32_rate_is_an_error_not_a_guess():
    """A hand-built spec quoted for bf16 without ``fp32_peak_flops`` cannot price an fp32 model: the error names
    the field to give, rather than the TF32 ratio this engine does not run at."""
    hw = HardwareSpec("mine", peak_flops=100e12, mem_bandwidth=1e12, flops_dtype_bytes=2)
    with pytest.raises(ValueError, match="fp32_peak_flops"):
        hw.dtype_scale(4)
    with pytest.raises(ValueError, match="fp32_peak_flops"):
        HardwareSpec("mine", peak_flops=100e12, mem_bandwidth=1e12, fp32_peak_flops=0.0)
