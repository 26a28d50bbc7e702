"""Hardware and model presets for the roofline simulator, each number with its source.

Hardware peaks are datasheet numbers (dense, i.e. *without* 2:4 sparsity; the
datasheets print the sparse figure first).  ``flops_util`` / ``bw_util`` are
the fractions real kernels reach -- an assumption, not a datasheet number:
large BF16 GEMMs typically reach ~70% of peak and streaming kernels ~80-90% of
HBM bandwidth; the overheads are typical of a CUDA-graph'ed engine (vLLM-like)
and are also assumptions.  Calibrate (``minivllm sim calibrate``) on the real
device to replace all of them with measured values.

Device memory is what the card reports (``nvidia-smi``'s ``memory.total``), not
the label on the datasheet, because the pool is sized from what the device
reports: an "80 GB" H100 reports 81,559 MiB = 85.5 GB, and reading its label as
80e9 bytes would shrink a Llama-3-8B pool by 8%.  CUDA itself
(``torch.cuda.get_device_properties(0).total_memory``, which a calibrated profile
records) reports about 0.6% less on Hopper cards (an H100: ~81,089 MiB), what the
driver keeps for itself.

Model shapes come from each model's published ``config.json`` on the Hugging
Face hub; the bundled SmolLM2-135M is read from its own config file.
"""

from __future__ import annotations

import json
import os
import re
from functools import lru_cache

from minivllm.argtypes import brief_path, is_int
from minivllm.sampling_params import brief_repr
from minivllm.sim.roofline import HardwareSpec, ModelShape

GB = 1e9
TB = 1e12
GIB = 1024**3
MIB = 1024**2

# Typical host/launch costs of a GPU engine (assumptions, see the module docstring).
_GPU_STEP_OVERHEAD_S = 2e-3
_GPU_LAYER_OVERHEAD_S = 10e-6
_GPU_SEQ_OVERHEAD_S = 5e-6
_GEMM_UTIL = 0.7
_HBM_UTIL = 0.85

def _datasheet_gpu(name: str, bf16_dense_tflops: float, fp32_tflops: float, bandwidth: float, memory: float,
                   host_link: float, notes: str) -> HardwareSpec:
    """A datasheet GPU: its peaks, the assumed utilisations and the typical host/launch costs above."""
    return HardwareSpec(name, peak_flops=bf16_dense_tflops * TB, mem_bandwidth=bandwidth, memory_bytes=memory,
                        step_overhead_s=_GPU_STEP_OVERHEAD_S, layer_overhead_s=_GPU_LAYER_OVERHEAD_S,
                        seq_overhead_s=_GPU_SEQ_OVERHEAD_S, swap_bandwidth=host_link,
                        flops_util=_GEMM_UTIL, bw_util=_HBM_UTIL, flops_dtype_bytes=2,
                        fp32_peak_flops=fp32_tflops * TB, notes=notes)


HARDWARE: dict[str, HardwareSpec] = {
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column), nvidia.com/en-us/data-center/h100/:
    # BF16 Tensor Core 1,979 TFLOPS *with sparsity* -> 989.5 dense; GPU memory "80 GB", which the card
    # reports as 81,559 MiB; memory bandwidth 3.35 TB/s; interconnect PCIe Gen5 128 GB/s (both directions)
    # -> 64 GB/s one way.  FP32 67 TFLOPS (not tensor cores: TENSOR_CORE_SCALE says why fp32 runs there).
    "h100": _datasheet_gpu("h100", 989.5, 67, 3.35 * TB, 81_559 * MIB, 64 * GB, "H100 SXM5 80GB, datasheet peaks"),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column), nvidia.com/en-us/data-center/h200/:
    # BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989.5 dense; GPU memory "141 GB", reported as 143,771 MiB
    # (measured: benchmarks/results/2026-11-30_nvidia-h200_gpu_checks_run3_summary.txt); memory bandwidth 4.8 TB/s; PCIe Gen5
    # 128 GB/s (both directions) -> 64 GB/s one way.  FP32 67 TFLOPS.
    "h200": _datasheet_gpu("h200", 989.5, 67, 4.8 * TB, 143_771 * MIB, 64 * GB, "H200 SXM 141GB, datasheet peaks"),
    # NVIDIA A100 Tensor Core GPU datasheet (A100 80GB SXM column), nvidia.com/en-us/data-center/a100/:
    # BF16 Tensor Core 312 TFLOPS (624 with sparsity); GPU memory "80 GB" HBM2e, reported as 81,920 MiB;
    # memory bandwidth 2,039 GB/s; PCIe Gen4 64 GB/s (both directions) -> 32 GB/s one way.  FP32 19.5 TFLOPS.
    "a100": _datasheet_gpu("a100", 312, 19.5, 2039 * GB, 81_920 * MIB, 32 * GB, "A100 SXM4 80GB, datasheet peaks"),
    # NVIDIA L4 Tensor Core GPU datasheet, nvidia.com/en-us/data-center/l4/:
    # BF16 Tensor Core 242 TFLOPS with sparsity -> 121 dense; GPU memory "24 GB" GDDR6, reported as 23,034 MiB
    # (ECC on); memory bandwidth 300 GB/s; PCIe Gen4 x16 64 GB/s (both directions) -> 32 GB/s one way.
    # FP32 30.3 TFLOPS.
    "l4": _datasheet_gpu("l4", 121, 30.3, 300 * GB, 23_034 * MIB, 32 * GB, "L4 24GB, datasheet peaks"),
}

MODELS: dict[str, ModelShape] = {
    # meta-llama/Meta-Llama-3-8B config.json: hidden_size 4096, intermediate_size 14336, num_hidden_layers 32,
    # num_attention_heads 32, num_key_value_heads 8 (head_dim 4096/32 = 128), vocab_size 128256, untied.
    # Positions: 131,072, Llama-3.1-8B's (the same shape, rope-scaled; the 3.0 release had 8,192), so the labs'
    # 32K- and 64K-token prompts on this preset are ones a served model of this shape takes.
    "llama-3-8b": ModelShape("llama-3-8b", num_layers=32, hidden_size=4096, intermediate_size=14336, num_heads=32,
                             num_kv_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                             max_position_embeddings=131072),
    # meta-llama/Llama-3.2-1B config.json: hidden_size 2048, intermediate_size 8192, num_hidden_layers 16,
    # num_attention_heads 32, num_key_value_heads 8, head_dim 64, vocab_size 128256, tie_word_embeddings true,
    # max_position_embeddings 131072.
    "llama-3.2-1b": ModelShape("llama-3.2-1b", num_layers=16, hidden_size=2048, intermediate_size=8192, num_heads=32,
                               num_kv_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                               max_position_embeddings=131072),
    # Qwen/Qwen3-0.6B config.json: hidden_size 1024, intermediate_size 3072, num_hidden_layers 28,
    # num_attention_heads 16, num_key_value_heads 8, head_dim 128, vocab_size 151936, tie_word_embeddings true,
    # max_position_embeddings 40960.
    "qwen3-0.6b": ModelShape("qwen3-0.6b", num_layers=28, hidden_size=1024, intermediate_size=3072, num_heads=16,
                             num_kv_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                             max_position_embeddings=40960),
}

# Published parameter counts, for a sanity check of the shapes (tests compare ModelShape.num_params to these).
PUBLISHED_PARAMS = {"llama-3-8b": 8.03e9, "llama-3.2-1b": 1.24e9, "qwen3-0.6b": 0.6e9, "smollm2-135m": 0.135e9}

PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")


@lru_cache(maxsize=None)
def bundled_shape() -> ModelShape:
    """SmolLM2-135M read from the bundled model's ``config.json`` (fp32: the engine's CPU default)."""
    from minivllm.model.loader import resolve_model_dir

    with open(os.path.join(resolve_model_dir(None), "config.json"), encoding="utf-8") as fh:
        return ModelShape.from_hf_config(json.load(fh), name="smollm2-135m", dtype_bytes=4)


def model_preset(name: str, dtype_bytes: int | None = None) -> ModelShape:
    """A model shape by name (``smollm2-135m`` is fp32 by default, the others bf16)."""
    key = name.lower()
    if key in ("smollm2-135m", "smollm2", "bundled"):
        shape = bundled_shape()
    elif key in MODELS:
        shape = MODELS[key]
    else:
        raise ValueError(f"unknown model preset {brief_repr(name)}; known: smollm2-135m, {', '.join(MODELS)}")
    return shape.with_dtype(dtype_bytes) if dtype_bytes else shape


def simulated_shape(model: str, hw: HardwareSpec, dtype_bytes: int | None = None) -> ModelShape:
    """The model shape a simulation of ``model`` on ``hw`` uses: ``dtype_bytes`` if given; else on a GPU (a
    spec with device memory) bf16, as the engine's dtype "auto" picks there, and the preset's own elsewhere."""
    shape = model_preset(model, dtype_bytes)
    if dtype_bytes is None and hw.memory_bytes and shape.dtype_bytes == 4:
        shape = shape.with_dtype(2)
    return shape


def profile_names() -> list[str]:
    if not os.path.isdir(PROFILE_DIR):
        return []
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def profile_path(path_or_name: str) -> str:
    """The file of a profile given as a path, or as a name under ``sim/profiles``."""
    return path_or_name if os.path.exists(path_or_name) else os.path.join(PROFILE_DIR, f"{path_or_name}.json")


def load_profile(path_or_name: str) -> dict:
    """A calibration profile (JSON written by ``minivllm sim calibrate``): a path, or a name under ``sim/profiles``.

    A file that is there but is no profile (not JSON, a list, no ``hardware`` object) is a ValueError that
    says so, not a ``KeyError`` traceback or a misleading "no such profile".
    """
    path = profile_path(path_or_name)
    if not os.path.isfile(path):
        raise ValueError(f"no calibration profile {brief_path(path_or_name)} "
                         f"(known: {', '.join(profile_names()) or 'none'})")
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:  # (an OSError's own text quotes the path)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"calibration profile {brief_path(path)} is not readable JSON: {why}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("hardware"), dict):
        raise ValueError(f"{brief_path(path)} is not a calibration profile: no 'hardware' object "
                         "(profiles are written by minivllm sim calibrate)")
    return doc


def hardware_preset(name: str) -> HardwareSpec:
    """A hardware spec: a datasheet preset (h100, h200, a100, l4) or a calibration profile by name or path."""
    return hardware_and_profile(name)[0]


def hardware_and_profile(name: str) -> tuple[HardwareSpec, dict | None]:
    """:func:`hardware_preset`'s spec and the calibration profile it came from (``None`` for a datasheet preset).

    A caller that reports on the profile too (``sim run`` prints its date) takes both from this one read: read
    again, a profile rewritten in between (a calibration finishing beside the run) would pair one file's spec
    with another's date.
    """
    key = name.lower()
    if key in HARDWARE:
        return HARDWARE[key], None
    if not os.path.isfile(profile_path(name)):
        raise ValueError(f"unknown hardware {brief_path(name)}; presets: {', '.join(HARDWARE)}; "
                         f"profiles: {', '.join(profile_names()) or 'none'}")
    try:  # a profile that is there but broken says what is wrong with it
        doc = load_profile(name)
        return profile_spec(doc), doc
    except ValueError as exc:
        raise ValueError(f"hardware {brief_path(name)}: {exc}") from None


_UNIDENTIFIED = 1e29  # a roof the fit left at "infinity" (spec_from_theta's 1e30): the grid never reached it


def profile_spec(doc: dict) -> HardwareSpec:
    """A calibration profile's hardware, as every simulation reads it (``sim run``, the fleet, ``sim_accuracy``).

    A calibration fits only what its grid of batch shapes reaches: on an H200 no step of a 1B model up to
    1,024 prompt tokens is compute bound, so the fitted compute roof is "infinite", and an 8K-token prefill of
    an 8B model would be predicted at a third of the time the GPU's peak allows.  A grid that barely reaches
    the roof fits it loosely: the first H200 profile put it at 1,763 TFLOP/s, 1.8x the BF16 peak, and predicted
    that prefill in less time than its GEMMs take at the peak.  Nor did older profiles record device memory.
    For a GPU whose name names a datasheet preset (the word ``H200`` in ``NVIDIA H200``; an ``L40S`` is not an
    ``L4``), a compute roof that is unidentified or above the datasheet's peak becomes the datasheet's
    achievable one, at the profile's own dtype, and missing memory the datasheet's; any other GPU profile
    without memory is an error, since its KV pool could not be sized.  A CPU profile has no device memory (the
    engine's CPU default pool applies) and is returned as fitted.
    """
    from dataclasses import replace

    spec = HardwareSpec.from_dict(doc["hardware"])
    # the other fields read here, checked as HardwareSpec checks its own: a hand-edited profile's list or number
    # was read as a GPU (device), failed with an AttributeError (model) or a TypeError, or, a bool for the
    # dtype, passed for a 1-byte model in silence (True == 1)
    device = doc.get("device", "cpu")
    if not isinstance(device, str):
        raise ValueError(f"profile device must be a str (cpu, cuda), got {brief_repr(device)}")
    if device == "cpu":
        return spec
    model = doc.get("model")
    if model is not None and not isinstance(model, dict):
        raise ValueError(f"profile model must be an object of shape fields, got {brief_repr(model)}")
    # the fitted roofs hold for the profile's dtype (a hand-edited "model": null reads as the 2-byte default)
    dtype_bytes = (model or {}).get("dtype_bytes", 2)
    if not is_int(dtype_bytes) or dtype_bytes < 1:
        raise ValueError(f"profile model.dtype_bytes must be a positive integer, got {brief_repr(dtype_bytes)}")
    words = set(re.findall(r"[a-z0-9]+", spec.name.lower()))
    match = next((HARDWARE[k] for k in HARDWARE if k in words), None)
    if match is None:
        if not spec.memory_bytes:
            raise ValueError(f"the GPU profile {brief_repr(spec.name)} records no device memory and matches no datasheet "
                             f"preset ({', '.join(HARDWARE)}), so its KV pool cannot be sized; re-calibrate it")
        return spec
    filled, notes = {}, []
    if not spec.memory_bytes:
        filled["memory_bytes"] = match.memory_bytes
        notes.append(f"memory from the {match.name} datasheet")
    peak = match.peak_flops * match.dtype_scale(dtype_bytes)  # what no kernel exceeds at that dtype
    for roof in ("peak_flops", "attention_flops"):
        fitted = getattr(spec, roof) or 0
        if fitted >= _UNIDENTIFIED or fitted * spec.flops_util > peak:
            filled[roof] = match.flops * match.dtype_scale(dtype_bytes) / spec.flops_util
            why = ("" if fitted >= _UNIDENTIFIED
                   else f" (fitted {fitted * spec.flops_util / 1e12:.0f} TFLOP/s, above its peak)")
            notes.append(f"{roof} not identified by the grid{why}: the {match.name} datasheet's achievable one")
    if not filled:
        return spec
    return replace(spec, notes="; ".join([spec.notes, *notes]) if spec.notes else "; ".join(notes), **filled)
