"""Engine options, named as vLLM names them, validated once and frozen.

Everything the scheduler and the memory manager need to know about sizes lives
here, so an impossible configuration (a KV pool too small for one max-length
request, a token budget that could never hold a whole prompt with chunking
off, ``max_num_seqs=2.5``...) fails loudly before any request is accepted,
instead of deadlocking later.

The config is built in two steps and never changes afterwards:
``EngineConfig(**options)`` checks what the caller gave; :meth:`EngineConfig.resolve`
returns a *new* frozen config with the defaults that depend on the model
(``max_model_len``, the token budget) filled in.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.argtypes import is_real
from minivllm.sampling_params import brief_repr

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

PREEMPTION_MODES = ("recompute", "swap", "reject", "auto")
PREFIX_CACHE_KINDS = ("radix", "hash")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
LINEAR_BACKENDS = ("auto", "torch", "onednn")
SCHEDULING_POLICIES = ("fcfs", "priority", "caps", "wfq", "deadline", "three_class")
PRIORITY_CLASSES = ("interactive", "agent", "batch")

PCIE4_X16_BYTES_PER_S = 25e9
"""A PCIe 4.0 x16 link, roughly: the host-tier bandwidth assumed where none is measured or given (a simulated
device's default, a calibration on a machine without a host tier)."""


def _check_share(name: str, value: Any, optional: bool = True) -> None:
    check_type(name, value, (int, float), optional=optional)
    if value is not None and not 0 < value <= 1:
        raise ValueError(f"{name} must be a fraction in (0, 1], got {brief_repr(value)}")


@dataclass(frozen=True)
class TenantConfig:
    """One tenant's scheduling settings (``LLM(tenants={"alice": TenantConfig(...)})``).

    * ``weight`` -- its share under ``scheduling_policy="wfq"`` (a tenant of weight 2
      is served twice the *charged* tokens of a tenant of weight 1 when both are backlogged:
      ``wfq_prefill_weight`` per prompt token, ``wfq_decode_weight`` per output token -- the raw
      token counts match that ratio only when the two tenants' requests have the same shape).
    * ``max_running`` -- at most this many of its requests hold a seat at once.
    * ``max_tokens_per_step`` -- at most this many of its tokens in one step's batch (held by the
      scheduler's own step 2; a custom ``batch_builder`` replaces that step, this limit included).
    * ``max_kv_share`` -- at most this fraction of the KV pool's blocks held by its
      running requests (a request that could never fit under it is refused at
      ``add_request``; one that would grow past it preempts its own tenant's work).
      Counted as the blocks it pins, plus what is set aside for the rest of its
      prefill: a block two of the tenant's requests share (a forked sample, a cached
      system prompt) counts once (:class:`~minivllm.kv.sharing.GroupBlocks`), as its
      ``kv_blocks`` gauge counts it.  A waiting request is checked with its whole prompt
      first; only when that fails is the cached prefix its tenant's requests already hold
      (which it would share) taken off (``Scheduler._cap_verdict``).
    * ``priority_class`` -- ``"interactive"``, ``"agent"`` or ``"batch"`` under
      ``scheduling_policy="three_class"`` (``None``: interactive).
    * ``over_cap`` -- ``"wait"`` (default) or ``"reject"``: a *new* request that finds
      its tenant at ``max_running`` or ``max_kv_share`` finishes ``"rejected"`` with a
      ``retry_after_s`` hint (the server's 429 + ``Retry-After``) instead of queueing.
      ``max_tokens_per_step`` is a per-step limit and always waits.
    * ``max_cache_share`` -- at most this fraction of the pool kept in the prefix cache
      for this tenant (all its salts together); over it, its *own* least recently used
      cached blocks go first.  ``None``: the engine-wide quota.

    Caps (``max_*``) are enforced under *every* scheduling policy: a tenant over
    a cap waits (or is rejected), its neighbours do not.
    """

    weight: float = 1.0
    max_running: int | None = None
    max_tokens_per_step: int | None = None
    max_kv_share: float | None = None
    priority_class: str | None = None
    over_cap: str = "wait"
    max_cache_share: float | None = None

    def __post_init__(self) -> None:
        check_type("TenantConfig.weight", self.weight, (int, float))
        if not (is_real(self.weight) and self.weight > 0):  # (an int past float's range overflowed at use)
            raise ValueError(f"TenantConfig.weight must be a finite number > 0, got {brief_repr(self.weight)}")
        for name in ("max_running", "max_tokens_per_step"):
            value = getattr(self, name)
            check_type(f"TenantConfig.{name}", value, int, optional=True)
            if value is not None and value < 1:
                raise ValueError(f"TenantConfig.{name} must be >= 1 (or None for no cap), got {brief_repr(value)}")
        _check_share("TenantConfig.max_kv_share", self.max_kv_share)
        _check_share("TenantConfig.max_cache_share", self.max_cache_share)
        if self.over_cap not in ("wait", "reject"):
            raise ValueError(f"TenantConfig.over_cap must be 'wait' or 'reject', got {brief_repr(self.over_cap)}")
        if self.priority_class is not None and self.priority_class not in PRIORITY_CLASSES:
            raise ValueError(f"TenantConfig.priority_class must be one of {', '.join(PRIORITY_CLASSES)} or None, "
                             f"got {brief_repr(self.priority_class)}")

    @property
    def has_caps(self) -> bool:
        return any(v is not None for v in (self.max_running, self.max_tokens_per_step, self.max_kv_share))


@dataclass(frozen=True)
class ThreeClassConfig:
    """Knobs of the ``scheduling_policy="three_class"`` preset (the seed lesson's worked policy).

    * ``interactive_kv_reserve`` -- fraction of the KV pool agent and batch work may never hold
      (rule ``reserve_kv_for_interactive``; what they may hold is rounded down, but at least one block);
    * ``agent_kv_share`` / ``agent_max_running_share`` -- the agent queue's bounded share of
      blocks and seats (rule ``bounded_agent_queue``; each rounded down, but at least one: a cap of 0
      would refuse the whole class);
    * ``batch_max_interactive_queue`` -- batch work is admitted only while fewer interactive
      requests than this wait (rule ``batch_only_when_interactive_idle``);
    * ``tenant_cache_share`` -- prefix caching is on, each tenant (all its cache salts together)
      may keep at most this fraction of the pool cached (rule ``capped_prefix_cache``; an explicit
      ``prefix_cache_quota_blocks`` wins);
    * ``long_prefill_tokens`` -- no request prefills more than this many tokens in one step, so a
      prompt above it is chunked (rule ``chunk_long_prefills``; vLLM's
      ``long_prefill_token_threshold``, and an explicit value of that option above 0 wins).  It bounds
      one request's share of a step; the step's size, and so the ITL it costs everyone, is
      ``max_num_batched_tokens`` (lab 4 picks it from the ITL target);
    * ``swap_min_tokens`` -- batch is preempted before agent before interactive, and a victim with
      a long context is swapped, a short one recomputed (rule ``preempt_batch_first_swap_long``).
      ``None`` (the default): "long" is where copying the victim's blocks costs less than
      recomputing them, by the auto mode's cost model.  On the roofline simulator that is a length
      (about 300 tokens for Llama-3-8B on the H100 preset, lab 5); the engine's own model prices
      recompute at one measured prefill rate, which gives the same answer at every length.  An int
      fixes the threshold in computed tokens instead.

    The preset also turns prefix caching on and, when ``preemption_mode`` is left at its default
    ``"recompute"``, sets it to ``"auto"`` (an explicit ``"swap"`` or ``"reject"`` is kept).
    """

    interactive_kv_reserve: float = 0.25
    agent_kv_share: float = 0.4
    agent_max_running_share: float = 0.5
    batch_max_interactive_queue: int = 1
    tenant_cache_share: float = 0.25
    long_prefill_tokens: int = 8192
    swap_min_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_share("ThreeClassConfig.agent_kv_share", self.agent_kv_share, optional=False)
        _check_share("ThreeClassConfig.agent_max_running_share", self.agent_max_running_share, optional=False)
        _check_share("ThreeClassConfig.tenant_cache_share", self.tenant_cache_share, optional=False)
        check_type("ThreeClassConfig.interactive_kv_reserve", self.interactive_kv_reserve, (int, float))
        if not 0 <= self.interactive_kv_reserve < 1:
            raise ValueError(f"ThreeClassConfig.interactive_kv_reserve must be in [0, 1), got {brief_repr(self.interactive_kv_reserve)}")
        for name in ("batch_max_interactive_queue", "long_prefill_tokens", "swap_min_tokens"):
            if name == "swap_min_tokens" and self.swap_min_tokens is None:
                continue
            check_type(f"ThreeClassConfig.{name}", getattr(self, name), int)
            if getattr(self, name) < 1:
                raise ValueError(f"ThreeClassConfig.{name} must be >= 1, got {brief_repr(getattr(self, name))}")


_TORCH_DTYPES = frozenset(_DTYPES.values()) | {torch.float64}
"""The ``torch.dtype`` objects a model can be served in: the named ones, and fp64 (exact, slow, for checks)."""


def parse_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` is fp32 on CPU (exact, and CPU half matmuls are slow) and bf16 on GPU.

    A ``torch.dtype`` must be a floating-point one the model can run in: ``torch.int8`` was accepted, the weights
    were cast to it, and every request then failed in the first step ("silu_cpu not implemented for 'Char'").
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES:
            raise ValueError(f"dtype {dtype} cannot serve a model; use one of "
                             f"{', '.join(sorted(str(d) for d in _TORCH_DTYPES))} (or a name: auto, float32, ...)")
        return dtype
    if not isinstance(dtype, str):  # (a list reached the dict lookup below as "unhashable type")
        raise ValueError(f"dtype must be a str or torch.dtype, got {brief_repr(dtype)} ({type(dtype).__name__})")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {brief_repr(dtype)}; use one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def parse_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError, OverflowError) as exc:  # (an int past C's range: OverflowError)
        raise ValueError(f"unknown device {brief_repr(device)}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {brief_repr(device)} asked for, but this machine has no CUDA GPU (use 'cpu' or 'auto')")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {brief_repr(device)} is not supported; use 'cpu', 'cuda' or 'auto'")
    return dev


def check_type(name: str, value: Any, kind: type | tuple[type, ...], optional: bool = False) -> None:
    """A clear ``ValueError`` for a value of the wrong type (``True`` is not an int here)."""
    if value is None and optional:
        return
    kinds = kind if isinstance(kind, tuple) else (kind,)
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        names = " or ".join(k.__name__ for k in kinds) + (" or None" if optional else "")
        raise ValueError(f"{name} must be {names}, got {brief_repr(value)} ({type(value).__name__})")


@dataclass(frozen=True)
class EngineConfig:
    """Options for :class:`~minivllm.engine.LLMEngine` (and ``LLM(**options)``).

    KV capacity: give ``num_gpu_blocks_override`` (blocks, vLLM's name) or
    ``kv_cache_memory_bytes`` (bytes); otherwise 1 GiB on CPU,
    ``gpu_memory_utilization`` (default 0.4) of the GPU memory still free once
    the weights are loaded on CUDA, and 4,096 blocks on a simulated executor
    (``kv.kv_cache.DEFAULT_SIM_KV_BLOCKS``).  A share of what is *free*, not
    of the whole GPU as vLLM's 0.9 is: the two numbers are not comparable.

    Preemption (what happens when KV blocks run out, see
    :mod:`minivllm.sched.scheduler`): ``preemption_mode`` is ``"recompute"``
    (free the victim's blocks, prefill again later), ``"swap"`` (park them in a
    host tier of ``swap_space`` GiB, or ``num_cpu_blocks_override`` blocks),
    ``"reject"`` (never preempt: admit only what is sure to fit, reject the
    rest with a retry hint) or ``"auto"`` (per victim, the cheaper of swap and
    recompute by a cost model that uses ``swap_bandwidth_gbps`` and
    ``prefill_tokens_per_s``; either is measured when not given).
    A request preempted ``preemption_protect_after`` times is chosen as a
    victim only when every running request is protected, or every running
    request of the group whose KV cap forces the preemption (anti-thrash).

    ``step_log_max_entries`` bounds the step log (a ring buffer) in entries:
    one per step, one per scheduled sequence and one per logged tenant row
    (:mod:`minivllm.metrics.step_log`), about 30 bytes each at 256 decodes a
    step and 150 at one.  ``step_log_tenants=False`` leaves its per-tenant fields
    empty whatever tenants the engine serves: a driver that reads none of them
    (the fleet simulator) stops paying a count of each tenant's blocks per step.

    ``stall_timeout_s``: a run of steps that compute nothing and end nothing
    (a scheduling deadlock) fails the requests still in the engine once it is
    ``llm_engine.STALL_STEPS`` steps long and has lasted this many seconds of
    the executor's clock -- or at once, on a clock that has not moved (nothing
    timed can change then).  ``None`` turns the watchdog off.

    The running set is capped at ``min(max_num_seqs, max_num_batched_tokens)``
    with chunked prefill on, so that every running decode fits every step.

    Scheduling (see :mod:`minivllm.sched.fairness`): ``scheduling_policy`` is
    ``"fcfs"``, ``"priority"``, ``"caps"``, ``"wfq"`` (token-weighted fair queueing,
    charging ``wfq_prefill_weight`` per prefill token and ``wfq_decode_weight`` per
    output token), ``"deadline"`` (earliest deadline first; no request is passed by
    one that arrived more than ``deadline_aging_s`` after it, unless its tenant's cap
    holds it back) or ``"three_class"``
    (the preset in :class:`ThreeClassConfig`).  ``tenants`` maps tenant names to
    :class:`TenantConfig` (the key ``"*"`` sets every unlisted tenant).
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
    long_prefill_token_threshold: int = 0  # a prefill chunk cap (0: none); below max_model_len it needs chunking on
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.4
    enable_prefix_caching: bool = False
    prefix_cache: str = "radix"
    prefix_cache_quota_blocks: int | None = None
    share_prefix_cache_across_tenants: bool = False
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    num_cpu_blocks_override: int | None = None
    swap_bandwidth_gbps: float | None = None
    prefill_tokens_per_s: float | None = None
    preemption_protect_after: int = 3
    attention_backend: str = "auto"
    linear_backend: str = "auto"  # "onednn": projections through oneDNN (fp32 CPU); "auto" picks it there
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (vLLM's flag); no effect on a CPU
    cpu_keep_freed_memory: bool = True  # CPU: glibc malloc keeps freed activations for reuse (model/host_malloc.py)
    step_log_max_entries: int = 500_000
    step_log_tenants: bool = True
    stall_timeout_s: float | None = 10.0
    scheduling_policy: str = "fcfs"
    tenants: Any = None  # {name: TenantConfig}; stored as a sorted tuple of pairs (hashable, frozen)
    wfq_prefill_weight: float = 1.0
    wfq_decode_weight: float = 2.0
    deadline_aging_s: float = 30.0
    three_class: ThreeClassConfig = ThreeClassConfig()

    def __post_init__(self) -> None:
        self._check_scheduling()
        check_type("model", self.model, str, optional=True)
        for name in ("seed", "block_size", "max_num_seqs", "long_prefill_token_threshold", "preemption_protect_after",
                     "step_log_max_entries"):
            check_type(name, getattr(self, name), int)
        for name in ("max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "kv_cache_memory_bytes", "prefix_cache_quota_blocks", "num_cpu_blocks_override"):
            check_type(name, getattr(self, name), int, optional=True)
        for name in ("enable_chunked_prefill", "enable_prefix_caching", "share_prefix_cache_across_tenants",
                     "enforce_eager", "cpu_keep_freed_memory", "step_log_tenants"):
            check_type(name, getattr(self, name), bool)
        for name in ("gpu_memory_utilization", "swap_space"):
            check_type(name, getattr(self, name), (int, float))
        for name in ("swap_bandwidth_gbps", "prefill_tokens_per_s", "stall_timeout_s"):
            check_type(name, getattr(self, name), (int, float), optional=True)
        for name in ("prefix_cache", "preemption_mode", "attention_backend", "linear_backend"):
            check_type(name, getattr(self, name), str)
        bs = self.block_size
        if bs < 1 or bs & (bs - 1):
            raise ValueError(f"block_size must be a power of two, got {brief_repr(bs)}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {brief_repr(self.seed)}")
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "num_gpu_blocks_override",
                     "kv_cache_memory_bytes", "step_log_max_entries"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {brief_repr(value)}")
        for name in ("long_prefill_token_threshold", "prefix_cache_quota_blocks", "num_cpu_blocks_override",
                     "preemption_protect_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {brief_repr(value)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {brief_repr(self.gpu_memory_utilization)}")
        if not 0 <= self.swap_space < 1024:
            raise ValueError(f"swap_space is in GiB and must be in [0, 1024), got {brief_repr(self.swap_space)}")
        if self.stall_timeout_s is not None and not (is_real(self.stall_timeout_s) and self.stall_timeout_s >= 0):
            raise ValueError(f"stall_timeout_s must be a number of seconds >= 0 (or None: no watchdog), "
                             f"got {brief_repr(self.stall_timeout_s)}")
        for name in ("swap_bandwidth_gbps", "prefill_tokens_per_s"):
            value = getattr(self, name)
            if value is not None and not (is_real(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0 (or None to measure it), got {brief_repr(value)}")
        if self.prefix_cache not in PREFIX_CACHE_KINDS:
            raise ValueError(f"prefix_cache must be 'radix' or 'hash', got {brief_repr(self.prefix_cache)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, got {brief_repr(self.preemption_mode)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto, torch, cpu or triton, got {brief_repr(self.attention_backend)}")
        if self.linear_backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend must be auto, torch or onednn, got {brief_repr(self.linear_backend)}")
        device = parse_device(self.device)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "dtype", parse_dtype(self.dtype, device))

    def _check_scheduling(self) -> None:
        check_type("scheduling_policy", self.scheduling_policy, str)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {brief_repr(self.scheduling_policy)}")
        tenants = self.tenants
        if tenants is None:
            tenants = ()
        elif isinstance(tenants, dict):
            tenants = tuple(tenants.items())
        elif not (isinstance(tenants, tuple) and all(isinstance(p, tuple) and len(p) == 2 for p in tenants)):
            raise ValueError(f"tenants must be a dict {{name: TenantConfig}}, got {type(tenants).__name__}")
        for name, tc in tenants:
            if not isinstance(name, str) or not name:
                raise ValueError(f"tenant names must be non-empty strings, got {brief_repr(name)}")
            if not isinstance(tc, TenantConfig):
                raise ValueError(f"tenants[{brief_repr(name)}] must be a TenantConfig, got {type(tc).__name__}")
        names = [name for name, _ in tenants]
        if len(set(names)) != len(names):  # (the tuple form can repeat a name; a dict cannot)
            raise ValueError(f"tenant names must be distinct, got {brief_repr(sorted(names))}")
        object.__setattr__(self, "tenants", tuple(sorted(tenants, key=lambda pair: pair[0])))
        for name in ("wfq_prefill_weight", "wfq_decode_weight", "deadline_aging_s"):
            value = getattr(self, name)
            check_type(name, value, (int, float))
            if not (is_real(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {brief_repr(value)}")
        if not isinstance(self.three_class, ThreeClassConfig):
            raise ValueError(f"three_class must be a ThreeClassConfig, got {type(self.three_class).__name__}")
        if self.scheduling_policy == "caps" and not any(tc.has_caps for _, tc in tenants):
            raise ValueError("scheduling_policy='caps' needs at least one TenantConfig with max_running, "
                             "max_tokens_per_step or max_kv_share (use the key '*' for every tenant)")

    def tenant_config(self, tenant: str) -> TenantConfig:
        """The settings of ``tenant``: its own entry, else the ``"*"`` entry, else ``TenantConfig()``."""
        for name, tc in self.tenants:
            if name == tenant:
                return tc
        for name, tc in self.tenants:
            if name == "*":
                return tc
        return _DEFAULT_TENANT

    @classmethod
    def option_names(cls) -> frozenset[str]:
        """The options ``LLM(**options)`` accepts (every field but ``model``)."""
        return frozenset(f.name for f in dataclasses.fields(cls)) - {"model"}

    @property
    def prefill_chunk_tokens(self) -> int:
        """The most prompt tokens one request computes in a step: the chunk cap, or the step budget where that is
        smaller or there is no cap (:meth:`resolve` sets the budget; a config not resolved yet falls back to 2048,
        the chunked default).  What the retry hints divide a prompt by to count the steps it still needs
        (:meth:`Request.steps_to_finish`) -- an estimate: a tenant's own ``max_tokens_per_step`` is not read."""
        budget = self.max_num_batched_tokens or 2048
        return min(self.long_prefill_token_threshold, budget) if self.long_prefill_token_threshold else budget

    @property
    def uses_swap(self) -> bool:
        return self.preemption_mode in ("swap", "auto")

    def resolve(self, model_max_len: int) -> EngineConfig:
        """A new config with the model-dependent defaults filled in, and the sizes checked together."""
        max_len = self.max_model_len if self.max_model_len is not None else model_max_len
        if max_len > model_max_len:
            raise ValueError(
                f"max_model_len={brief_repr(max_len)} is beyond what the model was trained for ({model_max_len} positions); "
                f"minivllm does not extend RoPE silently"
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_len)
        if not self.enable_chunked_prefill and budget < max_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({budget}) must be "
                f">= max_model_len ({max_len}) or a long prompt could never be scheduled"
            )
        seats = min(self.max_num_seqs, budget) if self.enable_chunked_prefill else self.max_num_seqs
        preset = {}
        if self.scheduling_policy == "three_class":
            # The preset's clauses that are engine options (documented in ThreeClassConfig):
            # prefix caching on; long prefills chunked; swap for long contexts ("auto" + a length rule).
            preset["enable_prefix_caching"] = True
            if self.long_prefill_token_threshold == 0:
                preset["long_prefill_token_threshold"] = self.three_class.long_prefill_tokens
            if self.preemption_mode == "recompute":
                preset["preemption_mode"] = "auto"
        threshold = preset.get("long_prefill_token_threshold", self.long_prefill_token_threshold)
        if threshold and not self.enable_chunked_prefill and threshold < max_len:
            # the cap holds a prompt to chunks of ``threshold`` tokens, which only chunked prefill can run
            source = ", set by scheduling_policy='three_class'" if "long_prefill_token_threshold" in preset else ""
            raise ValueError(
                f"with chunked prefill off, long_prefill_token_threshold ({threshold}{source}) must be 0 or "
                f">= max_model_len ({max_len}) or a longer prompt could never be scheduled"
            )
        for _, tc in self.tenants:
            if tc.max_tokens_per_step is not None and not self.enable_chunked_prefill and tc.max_tokens_per_step < max_len:
                raise ValueError(
                    f"with chunked prefill off, a tenant's max_tokens_per_step ({tc.max_tokens_per_step}) must be "
                    f">= max_model_len ({max_len}) or its long prompts could never be scheduled"
                )
        return dataclasses.replace(
            self, max_model_len=max_len, max_num_batched_tokens=budget, max_num_seqs=seats,
            device=self.device, dtype=self.dtype, **preset,
        )

    def check_kv_capacity(self, num_blocks: int) -> None:
        """Refuse, at start-up, a KV pool that cannot hold one request of ``max_model_len`` tokens.  Why here:
        such an engine advertises a length it can never serve, and each long request would be refused one by
        one instead; one error naming both numbers tells the operator which to change."""
        need = -(-self.max_model_len // self.block_size)
        if num_blocks == 0:
            raise ValueError(
                f"the KV memory does not hold one block of block_size={self.block_size} tokens; "
                f"use a smaller block_size or give more KV memory"
            )
        if num_blocks < need:
            raise ValueError(
                f"KV cache of {num_blocks} blocks of {self.block_size} tokens cannot hold one request of "
                f"max_model_len={self.max_model_len} tokens ({need} blocks); give more KV memory or a "
                f"smaller max_model_len"
            )


_DEFAULT_TENANT = TenantConfig()
