"""Mutation hunt on ``minivllm.sim.presets``: preset numbers and lookups a user sees that no test pinned.  Each
test names the mutant it kills and its oracle (a published config value or the module's documented rule)."""

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
