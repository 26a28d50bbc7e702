"""Engine options, named as vLLM names them, validated once at construction.

Everything the scheduler and the cache need to know about sizes lives here, so
an impossible configuration (a KV pool too small for one max-length request, a
token budget that could never hold a whole prompt with chunking off...) fails
loudly before any request is accepted, instead of deadlocking later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is fp32 on CPU (exact, and CPU half matmuls are slow) and bf16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def parse_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"unknown device {device!r}") from exc


@dataclass
class EngineConfig:
    """Options for :class:`~minivllm.engine.LLMEngine` (and ``LLM(**options)``).

    KV capacity: give ``num_gpu_blocks_override`` (blocks, vLLM's name) or
    ``kv_cache_memory_bytes`` (bytes); otherwise 1 GiB on CPU and 40% of free
    GPU memory on CUDA.
    """

    model: str | None = None
    dtype: str | torch.dtype = "auto"
    device: str | torch.device | None = "auto"
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.4
    enable_prefix_caching: bool = False
    prefix_cache: str = "radix"
    prefix_cache_quota_blocks: int | None = None
    share_prefix_cache_across_tenants: bool = False
    preemption_mode: str = "recompute"
    attention_backend: str = "auto"
    disable_log_stats: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        bs = self.block_size
        if not isinstance(bs, int) or bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two, got {bs!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 = no per-request cap)")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if self.prefix_cache not in ("radix", "hash"):
            raise ValueError(f"prefix_cache must be 'radix' or 'hash', got {self.prefix_cache!r}")
        if self.preemption_mode not in ("recompute",):
            raise ValueError(f"preemption_mode {self.preemption_mode!r} is not supported (only 'recompute')")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}")
        self.device = parse_device(self.device)
        self.dtype = parse_dtype(self.dtype, self.device)

    def finalize(self, model_max_len: int) -> None:
        """Fill in defaults that depend on the model, then check the sizes fit together."""
        if self.max_model_len is None:
            self.max_model_len = model_max_len
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, self.max_model_len)
        if self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_num_seqs:
            # Every running decode must fit in every step's budget, or decodes would starve.
            self.max_num_seqs = self.max_num_batched_tokens
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}) or a long prompt could never be scheduled"
            )

    def check_kv_capacity(self, num_blocks: int) -> None:
        need = -(-self.max_model_len // self.block_size)
        if num_blocks < need:
            raise ValueError(
                f"KV cache of {num_blocks} blocks of {self.block_size} tokens cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens ({need} blocks); give more KV memory or a "
                f"smaller max_model_len"
            )
