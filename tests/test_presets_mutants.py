"""Mutation hunt on ``minivllm.sim.presets``: preset numbers and lookups a user sees that no test pinned.  Each
test names the mutant it kills and its oracle (a published config value or the module's documented rule)."""

import pytest

from minivllm.sim.presets import HARDWARE, hardware_preset, model_preset, simulated_shape
from minivllm.sim.roofline import HardwareSpec


def test_smaller_model_presets_carry_their_published_kv_heads_and_head_dim():
    """KV bytes per token size the simulated KV pool (how many requests fit), and the parameter-count check the
    other tests make hardly sees the K/V projections (8 -> 4 KV heads moves Llama-3.2-1B's count by 0.7%).
    Oracle, the published config.json files: meta-llama/Llama-3.2-1B num_hidden_layers 16, num_key_value_heads
    8, head_dim 64; Qwen/Qwen3-0.6B num_hidden_layers 28, num_key_value_heads 8, head_dim 128 (not 1024/16).
    bf16: 2 (K and V) * layers * kv heads * head_dim * 2 bytes."""
    assert model_preset("llama-3.2-1b").kv_bytes_per_token == 2 * 16 * 8 * 64 * 2  # 32 KiB
    assert model_preset("qwen3-0.6b").kv_bytes_per_token == 2 * 28 * 8 * 128 * 2  # 112 KiB


def test_a_cpu_profile_simulates_the_bundled_model_in_fp32():
    """The engine's dtype "auto" is bf16 on a GPU and fp32 on the CPU; a simulation of the bundled model on a CPU
    profile (no device memory) must keep its fp32 shape, or it halves the weight and KV bytes the CPU profile
    was fitted on.  Kills: switching to bf16 whatever the hardware."""
    cpu = HardwareSpec("cpu-2core", peak_flops=50e9, mem_bandwidth=10e9)
    assert simulated_shape("smollm2-135m", cpu).dtype_bytes == 4
    assert simulated_shape("smollm2-135m", HARDWARE["h100"]).dtype_bytes == 2


def test_hardware_presets_are_found_whatever_the_case():
    """``--hardware H100`` names the datasheet preset, as ``h100`` does (the lookup lower-cases the name).
    Kills: the case-sensitive lookup, which reports 'unknown hardware'."""
    assert hardware_preset("H100") is HARDWARE["h100"]
    assert hardware_preset("L4") is HARDWARE["l4"]


def test_a_profiles_compute_roof_is_replaced_only_when_what_it_achieves_beats_the_datasheet_peak():
    """``profile_spec`` compares what a fitted roof *achieves* (roof x the profile's ``flops_util``) with the
    datasheet's BF16 peak, as its docstring and its note ("fitted N TFLOP/s, above its peak") say.  Oracle, the
    NVIDIA H200 datasheet: 1,979 TFLOPS BF16 with sparsity, 989.5 dense.  A profile whose kernels reach 900
    TFLOP/s at 50% of a 1,800 TFLOP/s roof is below the peak and kept as fitted; one reaching 1,100 is above it
    and gets the preset's achievable 989.5 x 70% = 692.65.  Kills: comparing the bare roof with the peak,
    which throws away a plausible fit whenever the fitted utilisation is below 1."""
    import json
    import pathlib

    from minivllm.sim.presets import profile_spec

    path = pathlib.Path(__file__).parent.parent / "benchmarks/results/2026-11-30_nvidia-h200_llama1b_profile_run2.json"
    doc = json.loads(path.read_text())
    assert doc["hardware"]["name"] == "NVIDIA H200" and doc["model"]["dtype_bytes"] == 2
    doc["hardware"]["flops_util"] = 0.5
    for achieved, want in ((900e12, 900e12), (1100e12, 989.5e12 * 0.7)):
        doc["hardware"]["peak_flops"] = doc["hardware"]["attention_flops"] = achieved / 0.5
        spec = profile_spec(doc)
        assert spec.peak_flops * spec.flops_util == pytest.approx(want)
        assert spec.attention_flops * spec.flops_util == pytest.approx(want)
