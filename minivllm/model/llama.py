"""A Llama-family decoder written for serving, in plain torch.

Unlike a training model, this one never sees a ``[batch, seq_len]`` tensor.  It
takes the flat batch the scheduler built — the new tokens of many requests, end
to end — plus :class:`~minivllm.model.attention.AttentionMetadata`, and for every
layer writes each token's K/V into the paged cache before attending through
the block tables.  No request is padded to a common sequence length, so no FLOP
is wasted on that (the only padding is a few rows: decode batches to a captured
CUDA-graph size, and 1-3 rows to 4 for oneDNN's faster kernel).

Covers Llama 2/3 (incl. Llama 3's RoPE scaling), SmolLM/SmolLM2, Qwen2
(bias on q/k/v), Qwen3 (RMSNorm on q and k per head) and Mistral (its sliding
window is not implemented, so it bounds the servable length instead).
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


# oneDNN multiplies a few rows by a packed weight with a different kernel than many, and on the CPUs
# measured here that kernel was slower in absolute terms: a full pass over SmolLM2's weights took 36 ms
# for 1 row, 44 ms for 2, 31 ms for 4 (one thread; ``python -m minivllm.bench linear``).  A decode step
# of one to three sequences therefore pads its rows to this many; each output row depends only on its
# own input row, so the padding changes nothing but the time.
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
    o_bias: bool = False
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
        max_positions = getattr(config, "max_position_embeddings", 4096)
        # Sliding-window attention (Mistral; Qwen with use_sliding_window) is not implemented: full attention
        # equals it only while a sequence fits in the window, so the window bounds the servable length.
        window = getattr(config, "sliding_window", None)
        if window and (arch == "mistral" or getattr(config, "use_sliding_window", False)):
            max_positions = min(max_positions, int(window))
        # LongRoPE keeps two sets of factors and transformers switches to the long ones for a whole sequence once
        # it passes original_max_position_embeddings; one cos/sin table holds the short ones only, so their
        # range bounds the servable length (within it the table is transformers' own).  A top-level
        # original_max_position_embeddings (Phi-3's layout, beside a ``rope_scaling``) wins over the dict's copy, as
        # it does in transformers: the model config class fills the dict with max_position_embeddings before that
        # attribute is set, and the RoPE initialiser overwrites it with the top-level value only when it runs.
        rope = getattr(config, "rope_parameters", None) or {}
        original = getattr(config, "original_max_position_embeddings", None) or rope.get("original_max_position_embeddings")
        if rope.get("rope_type") == "longrope" and original:
            max_positions = min(max_positions, int(original))
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
            max_position_embeddings=max_positions,
            qkv_bias=bool(getattr(config, "attention_bias", False)) or arch == "qwen2",
            # HF's Llama/Qwen3 put attention_bias on o_proj too; Qwen2's o_proj never has one
            o_bias=bool(getattr(config, "attention_bias", False)) and arch != "qwen2",
            qk_norm=arch == "qwen3",
        )


class Projection(nn.Module):
    """A linear layer's ``weight`` ``[out, in]`` (and bias), left uninitialised: the checkpoint fills it.

    Why not ``nn.Linear``: its constructor draws random weights that loading
    overwrites at once, and building it on the meta device instead imports
    ``torch._dynamo`` (150 MB resident).  ``torch.empty`` reserves address
    space only; pages that are never written never occupy memory.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        bias_param = nn.Parameter(torch.empty(out_features, **factory), requires_grad=False) if bias else None
        self.register_parameter("bias", bias_param)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """The token embedding table ``[vocab, hidden]``, uninitialised like :class:`Projection`."""

    def __init__(self, num_embeddings: int, dim: int, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, **factory), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 like the reference implementations."""

    def __init__(self, dim: int, eps: float, **factory) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, **factory), requires_grad=False)
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
    way the checkpoint was trained (LongRoPE up to its original length, which
    :meth:`ModelArgs.from_hf_config` makes the servable one).  cos/sin are looked
    up per token position, which is what a ragged batch needs: each token
    carries its own position.
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
        factors = getattr(hf_config, "rope_freq_factors", None)
        if factors is not None:
            # a Llama 3 GGUF's RoPE scaling as llama.cpp stores it (the loader's ``gguf_rope_freq_factors``): each
            # frequency divided by its factor -- what HF's ``llama3`` initialiser computes from the config's numbers
            if len(factors) != inv_freq.numel():
                raise ValueError(f"rope_freq_factors has {len(factors)} entries; head_dim {head_dim} needs {inv_freq.numel()}")
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float)
        t = torch.arange(max_positions, dtype=torch.float)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        # rotate-half multiplies the first half of sin by -x2: that minus sign, stored once (see _rotate)
        sign = torch.ones(head_dim)
        sign[: head_dim // 2] = -1.0
        self.register_buffer("sin_sign", sign, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and *signed* sin ``[T, 1, D]`` for the batch's positions, looked up once per step for every layer."""
        return self.cos[positions].unsqueeze(1), (self.sin[positions] * self.sin_sign).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in rotate-half form, ``x * cos + cat(-x2, x1) * sin``, over ``x: [T, heads, D]``.

    Computed as ``x * cos + cat(x2, x1) * signed_sin``: one ``flip`` swaps the
    halves and the minus sign lives in the sin table.  Negating a factor is
    exact in floating point, so the result is bit for bit the textbook
    formula's, in fewer operations -- and :class:`Attention` rotates q and k in
    one call.  Why it matters: on a GPU each operation is a kernel launch, and
    a step no CUDA graph replays is bound by launches, not arithmetic
    (``python -m minivllm.bench eager_step``).
    """
    t, heads, d = x.shape
    xf = x.float()
    swapped = xf.reshape(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    return (xf * cos + swapped * signed_sin).to(x.dtype)


class Attention(nn.Module):
    """Self-attention with q, k and v stacked in one projection (one matmul instead of three).

    The checkpoint stores ``q_proj``/``k_proj``/``v_proj`` separately;
    :meth:`LlamaForServing.load_weight` copies each into its rows of
    ``qkv_proj``, so the stacked weight is never built by concatenation.
    """

    def __init__(self, args: ModelArgs, **factory) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        h, d = args.hidden_size, args.head_dim
        self.qkv_proj = Projection(h, (args.num_heads + 2 * args.num_kv_heads) * d, bias=args.qkv_bias, **factory)
        self.o_proj = Projection(args.num_heads * d, h, bias=args.o_bias, **factory)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps, **factory)
            self.k_norm = RMSNorm(d, args.rms_norm_eps, **factory)
        self.qk_norm = args.qk_norm
        self.scale = d**-0.5

    def forward(self, x, rope, kv_cache, meta, backend):
        t, hq, hk, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (hq + hk) * d:].reshape(t, hk, d)
        cos, sin = rope
        if self.qk_norm:  # Qwen3: each of q and k normalised per head, with its own weight, before RoPE
            q = _rotate(self.q_norm(qkv[:, : hq * d].reshape(t, hq, d)), cos, sin)
            k = _rotate(self.k_norm(qkv[:, hq * d: (hq + hk) * d].reshape(t, hk, d)), cos, sin)
        else:  # q's and k's heads sit side by side in the projection's output: one rotation for both
            qk = _rotate(qkv[:, : (hq + hk) * d].reshape(t, hq + hk, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
        k_cache, v_cache = kv_cache
        backend.write_kv(k, v, k_cache, v_cache, meta)
        out = backend.attend(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, -1))


class MLP(nn.Module):
    """SwiGLU, down(silu(gate(x)) * up(x)), with gate and up stacked in one projection."""

    def __init__(self, args: ModelArgs, **factory) -> None:
        super().__init__()
        self.gate_up_proj = Projection(args.hidden_size, 2 * args.intermediate_size, bias=False, **factory)
        self.down_proj = Projection(args.intermediate_size, args.hidden_size, bias=False, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, **factory) -> None:
        super().__init__()
        self.self_attn = Attention(args, **factory)
        self.mlp = MLP(args, **factory)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)

    def forward(self, x, rope, kv_cache, meta, backend):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and final norm; parameter names match HF's ``model.*``."""

    def __init__(self, args: ModelArgs, **factory) -> None:
        super().__init__()
        self.embed_tokens = Embedding(args.vocab_size, args.hidden_size, **factory)
        self.layers = nn.ModuleList(DecoderLayer(args, **factory) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, **factory)


class LlamaForServing(nn.Module):
    """The whole model: ``forward`` returns hidden states, ``logits`` projects chosen rows.

    Splitting the two saves the vocabulary projection for every token whose
    logits nobody samples from: all of a prefill chunk but the request's last
    token, which only the chunk reaching it holds (a decode's one token is sampled).
    """

    linear_backend = "torch"  # "onednn" once :meth:`pack_for_onednn` ran

    # checkpoint projections served as rows of a stacked one: name -> (stacked name, index among the stacked)
    STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, args: ModelArgs, hf_config, backend=None, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        """Build the model with uninitialised weights on ``device``; :meth:`load_weight` fills them."""
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.args = args
        self.model = LlamaModel(args, **factory)
        if not args.tie_word_embeddings:
            self.lm_head = Projection(args.hidden_size, args.vocab_size, bias=False, **factory)
        self.rope = RotaryEmbedding(hf_config, args.head_dim, args.max_position_embeddings).to(device)  # fp32
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

    def load_weight(self, name: str, tensor: torch.Tensor) -> str:
        """Copy one checkpoint tensor into place; return where it landed (``param`` or ``param[i]``).

        ``copy_`` writes into the parameter's own storage, converting dtype and
        device on the way, so loading allocates nothing beyond the model.
        Checkpoint names match HF's; a q/k/v or gate/up projection lands in
        its rows of the stacked projection (:attr:`STACKED`).  Raises
        ``KeyError`` for a name the model has no place for.
        """
        owner_name, _, leaf = name.rpartition(".")
        module_name, _, proj = owner_name.rpartition(".")
        if proj in self.STACKED:
            stacked, index = self.STACKED[proj]
            owner_name = f"{module_name}.{stacked}"
        else:
            index = None
        try:
            param = self.get_parameter(f"{owner_name}.{leaf}")
        except AttributeError:
            raise KeyError(name) from None
        if index is None:
            target = param
        else:
            sizes = self._stacked_sizes(stacked)
            start = sum(sizes[:index])
            target = param.narrow(0, start, sizes[index])
        if target.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}")
        target.copy_(tensor)
        return f"{owner_name}.{leaf}" + ("" if index is None else f"[{index}]")

    def weight_slots(self) -> set[str]:
        """Every place :meth:`load_weight` must fill once for the model to be complete."""
        slots = set()
        for name, _ in self.named_parameters():
            module = name.rsplit(".", 2)[-2]
            if module in {stacked for stacked, _ in self.STACKED.values()}:
                slots.update(f"{name}[{i}]" for i in range(len(self._stacked_sizes(module))))
            else:
                slots.add(name)
        return slots

    def _stacked_sizes(self, stacked: str) -> list[int]:
        a = self.args
        if stacked == "qkv_proj":
            return [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
        return [a.intermediate_size, a.intermediate_size]

    def pack_for_onednn(self) -> None:
        """Hand every projection to oneDNN (fp32 CPU serving).

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
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                proj.weight = nn.Parameter(onednn_weight(proj.weight), requires_grad=False)
        if self.args.tie_word_embeddings:
            self.register_buffer("lm_head_packed", onednn_weight(self.model.embed_tokens.weight), persistent=False)
        else:
            self.lm_head.weight = nn.Parameter(onednn_weight(self.lm_head.weight), requires_grad=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection of ``hidden``'s rows, in fp32 whatever the model's dtype: the sampler
        (:func:`~minivllm.model.sampler.sample`) takes fp32 rows, so its softmax and top-p sums run at full precision."""
        if hasattr(self, "lm_head_packed"):
            weight = self.lm_head_packed
        else:
            weight = self.model.embed_tokens.weight if self.args.tie_word_embeddings else self.lm_head.weight
        return linear(hidden, weight).float()
