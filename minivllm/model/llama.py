"""A Llama-family decoder written for serving, in plain torch.

Unlike a training model, this one never sees a ``[batch, seq_len]`` tensor.  It
takes the flat batch the scheduler built — the new tokens of many requests, end
to end — plus :class:`~minivllm.model.attention.AttentionMetadata`, and for every
layer writes each token's K/V into the paged cache before attending through
the block tables.  Padding never exists, so no FLOP is wasted on it.

Covers Llama 2/3 (incl. Llama 3's RoPE scaling), SmolLM/SmolLM2, Qwen2
(bias on q/k/v) and Qwen3 (RMSNorm on q and k per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minivllm.model.attention import AttentionMetadata, TorchAttentionBackend

SUPPORTED_ARCHITECTURES = {"llama", "qwen2", "qwen3", "mistral"}


@dataclass
class ModelArgs:
    """The handful of numbers that define a Llama-family model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    qkv_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "ModelArgs":
        arch = getattr(config, "model_type", None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}: minivllm serves Llama-family decoders "
                f"({', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        heads = config.num_attention_heads
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            max_position_embeddings=getattr(config, "max_position_embeddings", 4096),
            qkv_bias=bool(getattr(config, "attention_bias", False)) or arch == "qwen2",
            qk_norm=arch == "qwen3",
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 like the reference implementations."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention used by HF checkpoints.

    The inverse frequencies come from transformers' own RoPE initialisers, so
    every scaling scheme a config names (Llama 3, linear, YaRN...) is handled the
    way the checkpoint was trained.  cos/sin are looked up per token position,
    which is what a ragged batch needs: each token carries its own position.
    """

    def __init__(self, hf_config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(h, args.num_heads * d, bias=args.qkv_bias)
        self.k_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.qkv_bias)
        self.v_proj = nn.Linear(h, args.num_kv_heads * d, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * d, h, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.qk_norm = args.qk_norm
        self.scale = d**-0.5

    def fuse(self) -> None:
        """Stack q/k/v weights so one matmul replaces three (fewer, larger calls run faster)."""
        self.register_buffer("qkv_weight", torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]), persistent=False)
        bias = self.q_proj.bias
        if bias is not None:
            bias = torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias])
        self.register_buffer("qkv_bias", bias, persistent=False)

    def forward(self, x, positions, rope, kv_cache, meta, backend):
        t = x.shape[0]
        if hasattr(self, "qkv_weight"):
            qkv = nn.functional.linear(x, self.qkv_weight, self.qkv_bias)
            q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                 self.num_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.up_proj = nn.Linear(args.hidden_size, args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def fuse(self) -> None:
        """Stack gate/up weights: one matmul, then split — same math, one call fewer."""
        self.register_buffer("gate_up_weight", torch.cat([self.gate_proj.weight, self.up_proj.weight]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate_up_weight"):
            gate, up = nn.functional.linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, positions, rope, kv_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and final norm; parameter names match HF's ``model.*``."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForServing(nn.Module):
    """The whole model: ``forward`` returns hidden states, ``logits`` projects chosen rows.

    Splitting the two saves the vocabulary projection for every token whose
    logits nobody samples from (all but the last token of a prefill chunk).
    """

    def __init__(self, args: ModelArgs, hf_config, backend=None) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = RotaryEmbedding(hf_config, args.head_dim, args.max_position_embeddings)
        self.backend = backend if backend is not None else TorchAttentionBackend()  # an AttentionBackend

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, positions, self.rope, kv_cache, meta, self.backend)
        return self.model.norm(x)

    def fuse_projections(self) -> None:
        """Serve with stacked q/k/v and gate/up weights (the originals are dropped to save memory)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj):
                lin.weight = nn.Parameter(torch.empty(0, device=lin.weight.device, dtype=lin.weight.dtype), requires_grad=False)
                lin.bias = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()
