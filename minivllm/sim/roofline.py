"""A roofline cost model for one engine step, and an executor that runs the real engine on it.

Why a roofline?  A transformer step is a handful of big kernels, and each is
limited either by arithmetic (FLOPs / peak FLOP/s) or by memory traffic
(bytes / bandwidth), whichever is slower.  That one rule explains the facts the
course is about: a decode step costs about the same for 1 or 64 sequences
(reading the weights dominates), a 2,000-token prefill is compute bound, and
long contexts make attention memory bound.  The model needs only numbers a
datasheet or a model's ``config.json`` gives, plus a few overheads a short
calibration fits (:mod:`minivllm.sim.calibrate`), so it transfers to hardware
nobody in the course has (an H100 from a laptop).

A step is split into *phases*, each its own set of kernels that run one after
another, and each phase is timed by its own roofline::

    time = step_overhead + num_layers * layer_overhead + num_seqs * seq_overhead
         + eager_step_overhead if a row has more than one token   # no CUDA graph replays it (GPU)
         + max(dense FLOPs / peak FLOP/s,        dense bytes / bandwidth)      # the GEMMs + lm_head
         + max(attention FLOPs / attention FLOP/s,                             # reading/writing K/V
               attention bytes / attention B/s + longest sequence's K/V / span B/s)
         + swapped bytes / swap bandwidth                                      # block moves over PCIe

The ``max`` is the textbook roofline: the slower limit alone sets the time, as
if arithmetic and memory traffic overlapped perfectly.  Near the ridge point
(where the two are equal) real kernels fall short of both: a decode GEMM of 8
rows on the CPU measured here neither streams at full bandwidth nor computes
at full rate.  ``HardwareSpec.roof_p`` softens the corner: each phase takes
``(compute**p + memory**p) ** (1/p)``, which is the ``max`` for ``p = inf``
(the default, and what the datasheet presets use), the sum for ``p = 1``, and
in between adds the most time exactly where the two limits meet.  Calibration
chooses ``p`` from the measured steps.

Why a second K/V rate (the *span*)?  Reading K/V is split among threads (a CPU's
cores, a GPU's SMs) by sequence and head, and one sequence's blocks are walked
in order by the few workers that get it.  So a step's attention memory time is
the textbook work-and-span bound (Brent): all the K/V bytes at the whole
device's rate, plus the longest sequence's K/V at the rate a single walk
reaches -- a lone 2,000-token decode cannot use what 16 short ones can.  On the
2-core CPU, one K/V rate for every byte left lone long decodes 7-8% slower than
predicted and 2-16 decodes at 65-512 tokens 7-9% faster; with the span term all
decode bands of the calibration but one (2-4 at 65-512 tokens, still 7% faster
than predicted) are within 5% (``minivllm sim calibrate --residuals``).
``attention_span_bandwidth=None`` (the datasheet presets) leaves the term out: a
GPU kernel that splits a sequence's context over many SMs (split-KV, "flash
decoding") has little span to speak of.  Re-fitted with the term, the two stored
H200 calibrations (Llama-3.2-1B, ``benchmarks/results/*_nvidia-h200_llama1b_profile*.json``)
give it no weight: their fits come back unchanged.

What it ignores, knowingly: kernel-level inefficiencies beyond one achievable
fraction per roof (tile quantization, wave effects, small-GEMM shapes), the
re-reading of K/V by each query tile of a long prefill, norms, rotary and other
element-wise ops (a few % of bytes), overlap *between* phases or with the host
(the host's per-step cost is the ``*_overhead`` terms), communication for
tensor parallelism, and caches (on a CPU the weights of a small model may
partly stay in the last-level cache; the calibration absorbs that into the
fitted bandwidth).
"""

from __future__ import annotations

import zlib
from dataclasses import MISSING, dataclass, field, replace

from minivllm.argtypes import is_int, is_real
from minivllm.config import PCIE4_X16_BYTES_PER_S, check_type
from minivllm.sampling_params import brief_repr


def _from_dict(cls, d):
    """``cls(**d)`` for a dict read from a JSON file: what is missing or ill-typed is a ValueError naming it.

    Why: profiles and results are files a person may have edited or written by hand, and the commands that
    read them report a ValueError as a one-line error; a ``KeyError`` or ``TypeError`` would be a traceback.
    Unknown keys are ignored, so an older reader takes a newer file.
    """
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__} needs an object of fields, got {type(d).__name__}")
    missing = [k for k, f in cls.__dataclass_fields__.items()
               if f.default is MISSING and f.default_factory is MISSING and k not in d]
    if missing:
        raise ValueError(f"{cls.__name__} needs {', '.join(missing)}")
    try:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})
    except TypeError as exc:  # a string where a number belongs: the comparisons in __post_init__ fail
        raise ValueError(f"bad {cls.__name__} field: {exc}") from None


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a decoder-only (Llama-style) model."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    # the positions the model was trained for (config.json's max_position_embeddings): a simulated engine of this
    # shape refuses a longer request, as the real one would; None (a shape stored before it was recorded): unknown
    max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        for k in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
                  "vocab_size", "dtype_bytes", "max_position_embeddings"):
            v = getattr(self, k)
            if v is None and k == "max_position_embeddings":
                continue
            if not is_int(v) or v < 1:
                raise ValueError(f"ModelShape.{k} must be a positive integer, got {brief_repr(v)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({brief_repr(self.num_heads)}) must be a multiple of num_kv_heads "
                             f"({brief_repr(self.num_kv_heads)})")
        check_fake_vocab(self.vocab_size, "ModelShape")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelShape":
        """From a profile's or a result's ``model`` object; missing or ill-typed fields are a ValueError."""
        return _from_dict(cls, d)

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str | None = None, dtype_bytes: int = 2) -> "ModelShape":
        """From a Hugging Face ``config.json`` dict (Llama, Qwen2/3, Mistral field names)."""
        heads = cfg["num_attention_heads"]
        return cls(
            name=name or cfg.get("_name_or_path", "model"),
            num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"], num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"], dtype_bytes=dtype_bytes,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=cfg.get("max_position_embeddings"),
        )

    def with_dtype(self, dtype_bytes: int) -> "ModelShape":
        return replace(self, dtype_bytes=dtype_bytes)

    @property
    def layer_params(self) -> int:
        """Weights of the GEMMs of one layer: q, k, v, o projections and the gated MLP (norms left out)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d + 2 * h * self.num_kv_heads * d + self.num_heads * d * h
        return attn + 3 * h * self.intermediate_size

    @property
    def num_params(self) -> int:
        """All weights (embedding, and a separate lm_head unless tied; norms are < 0.1% and left out)."""
        emb = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + emb * (1 if self.tie_word_embeddings else 2)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes_per_step(self) -> int:
        """Weights one forward pass reads: every layer's GEMMs and the lm_head (embedding rows are a gather)."""
        return self.layer_weight_bytes + self.lm_head_bytes

    @property
    def layer_weight_bytes(self) -> int:
        """Weights of every layer's GEMMs: read by any step, whatever it computes."""
        return self.num_layers * self.layer_params * self.dtype_bytes

    @property
    def lm_head_bytes(self) -> int:
        """The output projection (hidden x vocab): read only by a step that samples a token.

        The engine computes logits only for rows it samples from, so a step that runs nothing but
        middle chunks of long prompts never touches it -- on a small model a large share of the weights
        (SmolLM2-135M: 28M of 135M parameters; Qwen3-0.6B: 156M of 596M).
        """
        return self.vocab_size * self.hidden_size * self.dtype_bytes

    @property
    def act_elems_per_token_layer(self) -> int:
        """Activation elements one token moves through one layer's GEMMs: each reads its input, writes its output."""
        h, d = self.hidden_size, self.head_dim
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * d
        return (h + qkv_out) + (self.num_heads * d + h) + (h + 2 * self.intermediate_size) + (self.intermediate_size + h)


# Dense tensor-core throughput by element size, relative to 16-bit, on the datasheet GPUs (H100, H200, A100,
# L4): FP8 (or INT8 on the A100, which has no FP8) runs at twice the BF16 rate (H100 SXM: 1,979 / 989.5 dense
# TFLOP/s; A100: 624 TOPS / 312; L4: 242.5 / 121).  FP32 is not here on purpose: tensor cores would run it as
# TF32 at half the BF16 rate, but torch leaves TF32 off for matmuls (``torch.backends.cuda.matmul.allow_tf32``
# is False, the float32 matmul precision "highest") and the engine's Triton kernels ask for exact fp32 dots, so
# an fp32 model on this engine runs on the ordinary FP32 units -- ``HardwareSpec.fp32_peak_flops``, a datasheet
# figure of its own (H100 67 TFLOP/s, 15x below BF16; A100 19.5, 16x; L4 30.3, 4x), not a ratio.
TENSOR_CORE_SCALE = {1: 2.0, 2: 1.0}


@dataclass(frozen=True)
class HardwareSpec:
    """A device as the roofline sees it.

    ``peak_flops`` and ``mem_bandwidth`` are datasheet peaks; ``flops_util`` and
    ``bw_util`` are the fractions kernels achieve (the product is the roof the
    model uses).  A calibrated spec stores fitted effective values with utils 1.
    ``attention_flops`` and ``attention_bandwidth`` are the roofs for attention
    kernels when they reach a different fraction of peak than GEMMs (None: the
    same as the GEMMs).  Why separate: attention reads K/V through block tables
    (gathers of 16-token blocks), which on a CPU streams far slower than a
    weight matrix; on a GPU a paged-attention kernel is close to the GEMM roofs.
    ``attention_span_bandwidth`` is the rate at which the longest sequence's K/V
    streams through the few workers that walk it (the module docstring's
    *span*); None: no such term, every byte at ``attention_bandwidth``.
    """

    name: str
    peak_flops: float
    mem_bandwidth: float  # bytes/s
    memory_bytes: float = 0.0  # device memory (sizes the KV pool in ``minivllm sim run``)
    step_overhead_s: float = 0.0  # host scheduling, input preparation, sampling: once per step
    layer_overhead_s: float = 0.0  # kernel launches: once per layer per step
    seq_overhead_s: float = 0.0  # per scheduled sequence per step (metadata, sampling)
    # Extra fixed cost of a step with a row of more than one token (StepCost.eager).  On a GPU: an engine with
    # CUDA graphs captures steps of one-token rows and replays each as one launch, while any other launches its ~10
    # kernels per layer one by one from Python -- on the H200, 2.6 ms for a graphed decode step of a 1B
    # model against 11-17 ms for any step with a prefill chunk, nearly flat in its tokens up to 512.  On a
    # CPU: the prefill path's per-layer work beside the decode kernel (K/V gather, mask, one SDPA call per
    # prompt), 5-13 ms a step for SmolLM2 on one core.  The datasheet presets leave it 0 (a compiled engine).
    eager_step_overhead_s: float = 0.0
    swap_bandwidth: float = PCIE4_X16_BYTES_PER_S  # bytes/s between device and host tier
    flops_util: float = 1.0
    bw_util: float = 1.0
    attention_flops: float | None = None
    attention_bandwidth: float | None = None  # bytes/s
    attention_span_bandwidth: float | None = None  # bytes/s of one sequence's walk (None: no span term)
    roof_p: float | None = None  # how compute and memory time combine per phase (module docstring); None = max
    # The element size ``peak_flops`` is quoted for (2: a datasheet's BF16 tensor-core figure), so a model in
    # another dtype runs at that dtype's tensor-core rate (TENSOR_CORE_SCALE).  0: the roof holds for the
    # dtype it was measured with -- a calibration fits its own model's dtype and nothing else.
    flops_dtype_bytes: int = 0
    # The datasheet's FP32 (non-tensor) peak, where an fp32 model's GEMMs and attention run on this engine
    # (see TENSOR_CORE_SCALE for why not TF32); None: unknown, and an fp32 model on a spec quoted for another
    # dtype is an error rather than a guess.  Unused when ``flops_dtype_bytes`` is 0.
    fp32_peak_flops: float | None = None
    notes: str = ""

    def __post_init__(self) -> None:
        for k in ("peak_flops", "mem_bandwidth", "swap_bandwidth", "flops_util", "bw_util"):
            if not (is_real(getattr(self, k)) and getattr(self, k) > 0):
                raise ValueError(f"HardwareSpec.{k} must be a finite number > 0, got {brief_repr(getattr(self, k))}")
        for k in ("step_overhead_s", "layer_overhead_s", "seq_overhead_s", "eager_step_overhead_s", "memory_bytes"):
            if not (is_real(getattr(self, k)) and getattr(self, k) >= 0):
                raise ValueError(f"HardwareSpec.{k} must be a finite number >= 0, got {brief_repr(getattr(self, k))}")
        # (a str or list here failed its comparison with a TypeError, which named no field; a bool is no number)
        if self.roof_p is not None and not (is_real(self.roof_p) and self.roof_p >= 1):
            raise ValueError(f"HardwareSpec.roof_p must be a finite number >= 1 or None (the max), "
                             f"got {brief_repr(self.roof_p)}")
        # The attention roofs divide a step's terms as the others do: a zero one failed every step inside the
        # executor (each request "execution failed"), a negative one lost to the other limit in silence.
        for k in ("attention_flops", "attention_bandwidth", "attention_span_bandwidth", "fp32_peak_flops"):
            v = getattr(self, k)
            if v is not None and not (is_real(v) and v > 0):
                raise ValueError(f"HardwareSpec.{k} must be a finite number > 0 or None, got {brief_repr(v)}")
        if not is_int(self.flops_dtype_bytes) or (self.flops_dtype_bytes != 0
                                                  and self.flops_dtype_bytes not in TENSOR_CORE_SCALE):
            raise ValueError(f"HardwareSpec.flops_dtype_bytes must be 0 (the calibrated dtype) or one of "
                             f"{sorted(TENSOR_CORE_SCALE)}, got {brief_repr(self.flops_dtype_bytes)}")
        check_type("HardwareSpec.name", self.name, str)  # (printed and recorded as text)
        check_type("HardwareSpec.notes", self.notes, str)

    @property
    def flops(self) -> float:
        return self.peak_flops * self.flops_util

    @property
    def attn_flops(self) -> float:
        return (self.attention_flops if self.attention_flops is not None else self.peak_flops) * self.flops_util

    @property
    def bandwidth(self) -> float:
        return self.mem_bandwidth * self.bw_util

    @property
    def attn_bandwidth(self) -> float:
        return (self.attention_bandwidth if self.attention_bandwidth is not None else self.mem_bandwidth) * self.bw_util

    @property
    def attn_span_bandwidth(self) -> float | None:
        return None if self.attention_span_bandwidth is None else self.attention_span_bandwidth * self.bw_util

    def dtype_scale(self, dtype_bytes: int) -> float:
        """How much faster than ``peak_flops`` this device runs a model of ``dtype_bytes`` per element: the
        tensor-core ratio for fp8 and bf16, the FP32 units' own peak for fp32 (TENSOR_CORE_SCALE says why)."""
        if not self.flops_dtype_bytes or dtype_bytes == self.flops_dtype_bytes:
            return 1.0
        if dtype_bytes == 4:
            if self.fp32_peak_flops is None:
                raise ValueError(f"no fp32 rate for {self.name}: its peak_flops is quoted for "
                                 f"{self.flops_dtype_bytes}-byte elements; give fp32_peak_flops (the datasheet's "
                                 f"FP32 figure)")
            return self.fp32_peak_flops / self.peak_flops
        if dtype_bytes not in TENSOR_CORE_SCALE:
            raise ValueError(f"no tensor-core rate for {dtype_bytes}-byte elements on {self.name} "
                             f"(known: {sorted(TENSOR_CORE_SCALE)} and 4 with fp32_peak_flops)")
        return TENSOR_CORE_SCALE[dtype_bytes] / TENSOR_CORE_SCALE[self.flops_dtype_bytes]

    def slowed(self, factor: float) -> "HardwareSpec":
        """The same device running every step ``factor`` times longer (every roof divided, every fixed cost
        multiplied): what a shared machine looks like when its neighbours take a share of it."""
        if not (is_real(factor) and factor > 0):
            raise ValueError(f"factor must be a finite number > 0, got {brief_repr(factor)}")
        return replace(self, flops_util=self.flops_util / factor, bw_util=self.bw_util / factor,
                       swap_bandwidth=self.swap_bandwidth / factor,
                       step_overhead_s=self.step_overhead_s * factor, layer_overhead_s=self.layer_overhead_s * factor,
                       seq_overhead_s=self.seq_overhead_s * factor,
                       eager_step_overhead_s=self.eager_step_overhead_s * factor)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: dict) -> "HardwareSpec":
        """From :meth:`to_dict` (or a profile's ``hardware``); missing or non-numeric fields are a ValueError."""
        return _from_dict(cls, d)


@dataclass
class StepCost:
    """The roofline terms of one step (FLOPs, bytes), before any hardware is applied."""

    num_seqs: int = 0
    num_tokens: int = 0
    num_sampled: int = 0
    dense_flops: float = 0.0
    dense_bytes: float = 0.0
    attn_flops: float = 0.0
    attn_bytes: float = 0.0
    attn_span_bytes: float = 0.0  # the longest sequence's K/V (read by one walk: the module docstring's span)
    swap_bytes: float = 0.0

    @property
    def eager(self) -> bool:
        """Does a row carry more than one token (more tokens than sequences)?  Then no CUDA graph replays it.

        Not "does the step carry prompt tokens": the runner graphs any batch of one-token rows
        (``DecodeGraphRunner.can_run`` counts rows of one token), so a one-token prompt chunk -- the last
        token of a prompt whose other blocks the prefix cache held -- rides a graphed step like a decode.
        """
        return self.num_tokens > self.num_seqs

    @property
    def kind(self) -> str:
        """``"prompt"`` for an :attr:`eager` step, else ``"decode"``: the two populations whose times a cost model gets
        right or wrong separately (a TTFT miss is about prompt steps, an ITL miss mostly about decode steps)."""
        return "prompt" if self.eager else "decode"


def step_cost(shape: ModelShape, seqs, swap_blocks: int = 0, block_size: int = 16) -> StepCost:
    """The terms for a batch given as ``(start, num_tokens, samples)`` per scheduled sequence.

    * dense: ``2 * layer_params`` FLOPs per token per layer, plus ``2 * hidden * vocab``
      per *sampled* row (the engine computes logits only there); bytes = the layers'
      weights once, the lm_head's once if any row samples (a step of middle prompt
      chunks never reads it), plus each GEMM's input and output activations.
    * attention: token ``i`` of a chunk starting at ``s`` attends ``s + i + 1``
      keys; QK^T and PV are ``2 * head_dim`` FLOPs per head per key each.  Bytes:
      the sequence's whole context of K/V read once, the new K/V written, Q read
      and the output written.  Span: the longest sequence's context of K/V, which one walk reads.
    """
    L, H, d, b = shape.num_layers, shape.num_heads, shape.head_dim, shape.dtype_bytes
    n_tok = n_seq = n_samp = 0
    pairs = 0  # sum over scheduled tokens of the keys each attends
    ctx = 0  # sum over sequences of their context after this step
    longest = 0  # the longest of those contexts
    for start, n, samples in seqs:
        n_seq += 1
        n_tok += n
        n_samp += 1 if samples else 0
        pairs += n * start + n * (n + 1) // 2
        ctx += start + n
        if start + n > longest:
            longest = start + n
    c = StepCost(num_seqs=n_seq, num_tokens=n_tok, num_sampled=n_samp)
    if n_seq:
        c.dense_flops = 2.0 * L * shape.layer_params * n_tok + 2.0 * shape.hidden_size * shape.vocab_size * n_samp
        c.dense_bytes = (shape.layer_weight_bytes + (shape.lm_head_bytes if n_samp else 0)
                         + L * shape.act_elems_per_token_layer * n_tok * b
                         + n_samp * shape.vocab_size * 4)  # fp32 logits out
        c.attn_flops = 4.0 * L * H * d * pairs
        c.attn_bytes = float(shape.kv_bytes_per_token * (ctx + n_tok) + 2 * L * H * d * b * n_tok)
        c.attn_span_bytes = float(shape.kv_bytes_per_token * longest)
    c.swap_bytes = float(swap_blocks * block_size * shape.kv_bytes_per_token)
    return c


@dataclass(frozen=True)
class StepTime:
    """A step's time, phase by phase (seconds), and which roof bound each phase."""

    overhead: float
    dense: float
    attention: float
    swap: float
    dense_bound: str  # "compute" or "memory"
    attention_bound: str

    @property
    def total(self) -> float:
        return self.overhead + self.dense + self.attention + self.swap


def combine(compute: float, memory: float, p: float | None) -> float:
    """One phase's time from its two limits: ``max`` for ``p=None``, else their ``p``-norm.

    Divided by the larger limit before the power: a profile may set any ``roof_p >= 1``, and millisecond times
    raised to a large one underflow (``p = 120``: 0.0 for a 2 ms phase), while the ratios, at most 1, keep the
    larger term exact."""
    top = max(compute, memory)
    if p is None or top == 0.0:
        return top
    return top * ((compute / top) ** p + (memory / top) ** p) ** (1.0 / p)


def roofline_time(cost: StepCost, shape: ModelShape, hw: HardwareSpec) -> StepTime:
    """Apply ``hw`` to the terms: overheads plus one roofline per phase (see the module docstring)."""
    if cost.num_seqs == 0:
        return StepTime(hw.step_overhead_s if cost.swap_bytes else 0.0, 0.0, 0.0, cost.swap_bytes / hw.swap_bandwidth,
                        "-", "-")
    overhead = hw.step_overhead_s + shape.num_layers * hw.layer_overhead_s + cost.num_seqs * hw.seq_overhead_s
    if cost.eager:
        overhead += hw.eager_step_overhead_s
    speed = hw.dtype_scale(shape.dtype_bytes)
    dc, dm = cost.dense_flops / (hw.flops * speed), cost.dense_bytes / hw.bandwidth
    ac, am = cost.attn_flops / (hw.attn_flops * speed), cost.attn_bytes / hw.attn_bandwidth
    span = hw.attn_span_bandwidth
    if span is not None:
        am += cost.attn_span_bytes / span
    return StepTime(overhead, combine(dc, dm, hw.roof_p), combine(ac, am, hw.roof_p), cost.swap_bytes / hw.swap_bandwidth,
                    "compute" if dc >= dm else "memory", "compute" if ac >= am else "memory")


@dataclass(frozen=True)
class RooflinePreemptionCosts:
    """The auto preemption mode's cost model on the roofline: what recomputing a victim really costs, by length.

    The engine's default (:class:`~minivllm.sched.scheduler.PreemptionCosts`) charges
    recomputation at one prefill rate, so its swap-or-recompute answer hardly
    depends on the victim's length.  On a GPU it does.  A server that preempts is
    busy, so a victim's prompt is prefilled again in chunks of ``chunk`` tokens
    that ride in steps already decoding ``decodes`` sequences of ``decode_context``
    tokens; the cost is the *marginal* time those chunks add.  While such a step
    is memory bound (it reads every weight anyway) a short victim costs almost
    nothing; a long one is compute bound and pays attention over everything
    before each chunk, which grows with the square of its length.  Swapping
    costs the victim's blocks over the host link twice (out now, in later).

    A :class:`~minivllm.interfaces.PreemptionCostModel`; ``minivllm sim run
    --preemption-mode auto`` uses it, and lab 5 draws its two curves.
    """

    shape: ModelShape
    hardware: HardwareSpec
    block_size: int = 16
    chunk: int = 2048
    decodes: int = 32
    decode_context: int = 2048

    def __post_init__(self) -> None:
        if self.chunk < 1:  # a zero chunk never advances through the victim's prompt: recompute_s would not return
            raise ValueError(f"RooflinePreemptionCosts needs chunk >= 1, got {self.chunk}")
        if self.decodes < 0 or self.decode_context < 0:
            raise ValueError(f"RooflinePreemptionCosts needs decodes >= 0 and decode_context >= 0, "
                             f"got {self.decodes} and {self.decode_context}")

    def recompute_s(self, num_tokens: int) -> float:
        dec = [(self.decode_context, 1, True)] * self.decodes
        base = roofline_time(step_cost(self.shape, dec, block_size=self.block_size), self.shape, self.hardware).total
        total, start = 0.0, 0
        while start < num_tokens:
            n = min(self.chunk, num_tokens - start)
            seqs = dec + [(start, n, start + n == num_tokens)]
            total += roofline_time(step_cost(self.shape, seqs, block_size=self.block_size), self.shape,
                                   self.hardware).total - base
            start += n
        return total

    def swap_s(self, num_blocks: int) -> float:
        return 2 * num_blocks * self.block_size * self.shape.kv_bytes_per_token / self.hardware.swap_bandwidth

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_s(num_blocks) < self.recompute_s(num_tokens)


RESERVED_TOKEN_IDS = 10  # ids 0-9, which a simulated "sampled" token never takes (see fake_token)


def check_fake_vocab(vocab_size, owner: str) -> None:
    """Refuse a vocabulary :func:`fake_token` cannot draw from, where it is configured rather than at the first
    sampled token: with ``RESERVED_TOKEN_IDS`` or fewer ids there is no id left to draw (a modulo by zero, or
    tokens outside the vocabulary)."""
    if not is_int(vocab_size) or vocab_size <= RESERVED_TOKEN_IDS:
        raise ValueError(f"{owner}.vocab_size must be an integer > {RESERVED_TOKEN_IDS} (the simulator's sampled "
                         f"tokens skip ids 0-{RESERVED_TOKEN_IDS - 1}), got {brief_repr(vocab_size)}")


def fake_token(request_id: str, position: int, vocab_size: int) -> int:
    """A deterministic "sampled" token (the same in every process, unlike ``hash`` of a str); never 0-9.

    Never 0-9: tokenizers keep EOS/BOS/pad there, and a simulated engine with an EOS id would stop requests at
    random.  2654435761 (about 2^32 / golden ratio) spreads consecutive positions over the vocabulary instead of
    stepping through it one id at a time (a text of consecutive ids would not look like sampled output).  The
    vocabulary is checked where it is configured (:func:`check_fake_vocab`), not here, once per token."""
    return (zlib.crc32(request_id.encode()) + 2654435761 * position) % (vocab_size - RESERVED_TOKEN_IDS) \
        + RESERVED_TOKEN_IDS


@dataclass
class RooflineExecutor:
    """An :class:`~minivllm.interfaces.Executor` on a virtual clock that advances by the roofline step time.

    The engine around it is the real one (scheduler, policies, KV manager,
    prefix cache); only the forward pass is replaced.  Tokens are a
    deterministic function of the request id and position, so a run is
    reproducible to the bit.  ``kv_bytes_per_block`` and ``swap_bytes_per_s``
    are read by the engine (pool sizing, the auto preemption mode).
    """

    shape: ModelShape
    hardware: HardwareSpec
    block_size: int = 16
    clock: float = 0.0
    busy_s: float = 0.0  # virtual seconds spent in steps (the rest is idle time between arrivals)
    num_steps: int = 0
    bound_steps: dict = field(default_factory=lambda: {"compute": 0, "memory": 0})  # by the dense phase

    @property
    def kv_bytes_per_block(self) -> int:
        return self.shape.kv_bytes_per_token * self.block_size

    @property
    def swap_bytes_per_s(self) -> float:
        return self.hardware.swap_bandwidth

    def preemption_cost_model(self, chunk: int) -> "RooflinePreemptionCosts":
        """The auto mode's cost model on this executor's roofline (the engine asks for it): recompute priced by
        length, with chunks of ``chunk`` tokens (the engine's step budget)."""
        return RooflinePreemptionCosts(self.shape, self.hardware, block_size=self.block_size, chunk=chunk)

    @property
    def vocab_size(self) -> int:
        return self.shape.vocab_size

    def now(self) -> float:
        return self.clock

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` (the driver calls it when nothing is running and the next request is in the future)."""
        if t > self.clock:
            self.clock = t

    def breakdown(self, batch, sampled: list | None = None) -> StepTime:
        """The step's time by phase; with ``sampled`` (a list), also collects ``(request id, position)`` of each
        row whose logits are sampled: the position its sampled token takes (the row's end).

        The executor's only per-sequence work besides the fake tokens: it runs once per scheduled row, ~2 * 10^6
        times for 10,000 decode-heavy requests (6 * 10^4 steps), so it is two comprehensions (C-driven loops, no
        append call per row) rather than one loop.  The row's end is the sampled token's position: the fake
        token's reader need not ask the request for its length again.
        """
        rows = batch.seqs
        seqs = [(s.start, s.num_tokens, s.start + s.num_tokens == s.request.num_tokens) for s in rows]
        if sampled is not None:
            sampled += [(s.request.request_id, start + n) for s, (start, n, samples) in zip(rows, seqs) if samples]
        swapped = len(batch.moves.swap_in) + len(batch.moves.swap_out)
        return roofline_time(step_cost(self.shape, seqs, swapped, self.block_size), self.shape, self.hardware)

    def step_time(self, batch) -> float:
        return self.breakdown(batch).total

    def execute(self, batch) -> dict[str, int]:
        sampled: list = []
        if batch.seqs or batch.moves:
            t = self.breakdown(batch, sampled)
            self.clock += t.total
            self.busy_s += t.total
            self.num_steps += 1
            if t.dense_bound in self.bound_steps:
                self.bound_steps[t.dense_bound] += 1
        vocab = self.shape.vocab_size
        return {rid: fake_token(rid, position, vocab) for rid, position in sampled}
