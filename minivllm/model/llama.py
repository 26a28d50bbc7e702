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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` -- through oneDNN when the weight was packed for it.

    :meth:`LlamaForServing.pack_for_onednn` turns the weights into oneDNN
    tensors; the rest of the model does not know.  Same maths as
    ``F.linear``, a different summation order (results agree to ~1e-6).
    """
    if weight.is_mkldnn:
        rows = x.shape[0]
        if 0 < rows < ONEDNN_MIN_ROWS and x.dim() == 2:  # see ONEDNN_MIN_ROWS: pad, multiply, drop the padding
            x = torch.cat([x, x.new_zeros(ONEDNN_MIN_ROWS - rows, x.shape[1])])
            return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return nn.functional.linear(x, weight, bias)


# oneDNN multiplies 1 or 2 rows by a packed weight with a different kernel than 3 or more, and on the
# CPUs measured here that kernel was slower in absolute terms: a full pass over SmolLM2's weights took
# 36 ms for 1 row, 44 ms for 2, 31 ms for 4 (one thread; ``python -m minivllm.bench linear``).  A decode
# step of one or two sequences therefore pads its rows to this many; each output row depends only on
# its own input row, so the padding changes nothing but the time.
ONEDNN_MIN_ROWS = 4


def onednn_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` reordered once into the blocked layout oneDNN's matmul reads."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


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

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D]`` for the batch's positions: looked up once per step, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


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

    def forward(self, x, rope, kv_cache, meta, backend):
        t = x.shape[0]
        if hasattr(self, "qkv_weight"):
            qkv = linear(x, self.qkv_weight, self.qkv_bias)
            q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                                 self.num_kv_heads * self.head_dim], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        return linear(out.reshape(t, -1), self.o_proj.weight)


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
            gate, up = linear(x, self.gate_up_weight).chunk(2, dim=-1)
            return linear(nn.functional.silu(gate) * up, self.down_proj.weight)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, rope, kv_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
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

    linear_backend = "torch"  # "onednn" once :meth:`pack_for_onednn` ran

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
        rope = self.rope(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta, self.backend)
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

    def pack_for_onednn(self) -> None:
        """Hand every projection to oneDNN (fp32 CPU serving; call after :meth:`fuse_projections`).

        Why: a decode step multiplies a few rows by every weight of the model,
        and on the CPUs measured here oneDNN does that 2-3.7x faster (1-16 rows) than the
        default BLAS once each weight is reordered into the blocked layout its
        kernels read (``python -m minivllm.bench linear`` measures both on
        this machine).  The reorder is done once, here, not per call.  A tied
        vocabulary projection gets its own packed copy; the embedding lookup
        keeps the plain one.
        """
        self.linear_backend = "onednn"
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_weight = onednn_weight(attn.qkv_weight)
            mlp.gate_up_weight = onednn_weight(mlp.gate_up_weight)
            attn.o_proj.weight = nn.Parameter(onednn_weight(attn.o_proj.weight), requires_grad=False)
            mlp.down_proj.weight = nn.Parameter(onednn_weight(mlp.down_proj.weight), requires_grad=False)
        if self.args.tie_word_embeddings:
            self.register_buffer("lm_head_packed", onednn_weight(self.model.embed_tokens.weight), persistent=False)
        else:
            self.lm_head.weight = nn.Parameter(onednn_weight(self.lm_head.weight), requires_grad=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "lm_head_packed"):
            weight = self.lm_head_packed
        else:
            weight = self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return linear(hidden, weight).float()
