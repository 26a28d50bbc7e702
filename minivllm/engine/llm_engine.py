"""The serving loop.  :meth:`LLMEngine.step` is the whole lesson, seven steps in order.

::

    1. admit       waiting -> running, while seats, token budget and KV blocks allow
    2. build batch decode tokens first, then prefill chunks, under the token budget
    3. allocate    KV blocks for every scheduled token; preempt when the pool is dry
    4. execute     block moves, then one forward pass over the flat ragged batch; sample
    5. append KV   the step's K/V now count as computed; sampled tokens join the request
    6. emit        incremental detokenization, stop checks, streamed deltas
    7. finish      finished requests leave and give their blocks back

Who owns what: the :class:`~minivllm.sched.scheduler.Scheduler` decides who
runs (steps 1-3); the :class:`~minivllm.kv.kv_cache_manager.KVCacheManager`
decides who *can* run and is the only owner of KV blocks; the executor runs
the batch (step 4); :class:`~minivllm.engine.input_processor.InputProcessor`
and :class:`~minivllm.engine.output_processor.OutputProcessor` face the
caller.  This class wires them together and keeps the request table.

Everything that can vary is a seam (see :mod:`minivllm.interfaces`): the
admission and preemption policies, step 2's batch builder, the prefix cache,
the executor (and ``executor_wrapper``, a function that wraps it: a fault
injector, a recorder), and the cost model that chooses a victim's fate
between recompute and swap in auto mode.
"""

from __future__ import annotations

import _signal
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterable

from minivllm.argtypes import is_real
from minivllm.config import PCIE4_X16_BYTES_PER_S, EngineConfig
from minivllm.engine.input_processor import InputProcessor
from minivllm.engine.output_processor import OutputProcessor
from minivllm.interfaces import (AdmissionPolicy, BatchBuilder, Executor, PreemptionCostModel, PreemptionPolicy, PrefixCache,
                                 PricesRecompute, SimulatedDevice, Tokenizer, check_seam, implements)
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.kv_cache import DEFAULT_SIM_KV_BLOCKS, num_host_blocks
from minivllm.kv.kv_cache_manager import KVCacheManager, blocks_for
from minivllm.metrics.engine_stats import EngineStats, TenantStats
from minivllm.metrics.step_log import StepLog, StepRecord, tenant_blocks, tenant_fields
from minivllm.outputs import RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams, brief_repr
from minivllm.sched.fairness import CapTable, make_policies, tenant_cache_quota
from minivllm.sched.output import ScheduledBatch
from minivllm.sched.scheduler import PreemptionCosts, PrefillRateFit, Scheduler

SIM_BYTES_PER_TOKEN = 1024
"""KV bytes per token assumed with an executor that does not say (sizes ``kv_cache_memory_bytes`` and swap)."""

log = logging.getLogger(__name__)

_EMA = 0.2  # weight of the newest step in the step-time estimate


UNTIMED_STEP_S = 0.05
"""The seconds a retry hint counts per step before any step has been timed (``step_time_s`` still None).

A step is timed from the end of the one before it, or from the arrival that woke an idle engine, so on a
clock that moves the first step a request is rejected in already has a time; this value stands in where no
step has taken time on the executor's clock yet -- a simulator whose clock stands still, or a driver that
asks for a hint by hand.  Why 0.05 s: it sits between the devices this engine runs on (a graphed GPU decode
step takes milliseconds, a CPU step of the bundled model tens of them), so a hint is off by a factor of a
few at worst, and the first timed step replaces it.  The README states it where it explains the hint.
"""


def _hint(seconds: float) -> float:
    """A retry hint in seconds, rounded to the millisecond and never below one millisecond: rounded to 0.0, a
    fast executor's sub-millisecond step would tell a rejected caller to retry at once, into the same full pool
    (a hint is > 0 by contract)."""
    return max(round(seconds, 3), 0.001)


STALL_STEPS = 64
"""Steps in a row that compute nothing and end nothing, with requests in the engine, before it looks for a stall.

Every request the engine holds is either schedulable or waiting on something
a step frees, so a working scheduler moves at most a step or two without
computing a token or ending a request (the pause after a preemption: the
longest such run over the whole test suite is 2 steps).  A longer run is a
deadlock -- a learner's admission policy that admits no one, a block lost by
its owner -- unless the policy is waiting for something outside the engine: a
second arrival, a time window.  So the stuck requests are failed only once the
run has also lasted ``EngineConfig.stall_timeout_s`` of the executor's clock,
or when that clock has not moved at all (a simulated clock stands still on
empty steps, and nothing timed can change).  Failing them with a message that
says so turns the hang into an error a caller can read, and keeps the engine
serving."""


class _CtrlCHeld:
    """Holds a Ctrl-C (SIGINT) back while a step runs on the main thread, and delivers it when the step ends.

    Why: a step changes many requests one after another -- it appends a sampled token to each, detokenizes it,
    checks its stops, builds its output, takes the finished ones out.  A ``KeyboardInterrupt`` landing between two
    of those (Ctrl-C in a notebook while ``LLM.stream`` reads) left the others half done: a token appended but never
    shown to its stream, a request past its stop scheduled again, final outputs dropped.  Held, the signal cannot
    land inside the step: the step runs whole, its outputs wait in ``LLMEngine._unread`` (the next step returns them
    if this one does not get to), and the signal goes, as the step exits, to the handler it was meant for
    (``KeyboardInterrupt`` by default; one that ignores it leaves the step to return as usual).  A step is one batch
    (chunked prefill bounds it), so Ctrl-C waits at most that long.

    Only the main thread of the main interpreter receives signals and may set a handler, so a step elsewhere (the
    server's loop, a subinterpreter) holds nothing; nor does one under a handler installed from C, which could not
    be put back.  A step inside a step (the engine's lock is reentrant) holds once, outermost.  Not covered: a Ctrl-C
    in the bytecode or two between a step taking its outputs and its caller receiving them.

    ``_signal`` rather than ``signal``: the public wrappers convert handlers to enums, ~7 us a step of their own
    beside a simulated step's ~300 us; the raw calls cost under 1 us.
    """

    __slots__ = ("previous", "pending", "depth")

    def __init__(self) -> None:
        self.previous = None  # the handler held back (None: nothing held)
        self.pending = False  # a Ctrl-C came while held
        self.depth = 0  # steps inside steps: only the outermost swaps the handler

    def _hold(self, signum, frame) -> None:
        self.pending = True

    def __enter__(self) -> "_CtrlCHeld":
        self.depth += 1
        if self.depth == 1 and threading.current_thread() is threading.main_thread():
            previous = _signal.getsignal(signal.SIGINT)
            if previous is not None:
                self.pending = False  # (before the swap: a Ctrl-C right after it must stay counted)
                try:
                    _signal.signal(signal.SIGINT, self._hold)
                except ValueError:  # not the main interpreter
                    return self
                self.previous = previous
        return self

    def __exit__(self, *exc) -> None:
        self.depth -= 1
        if self.depth == 0 and self.previous is not None:
            previous, self.previous = self.previous, None
            _signal.signal(signal.SIGINT, previous)
            if self.pending:
                self.pending = False
                signal.raise_signal(signal.SIGINT)  # now, to its own handler


class LLMEngine:
    """The incremental engine: ``add_request`` / ``step`` / ``abort_request``.

    Thread-safe: the three calls take one lock, so callers on several threads
    can share an engine (each ``step`` runs whole; its outputs go to whoever
    called it -- :class:`~minivllm.llm.LLM` routes them to their owners).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        executor: Executor | None = None,
        tokenizer: Tokenizer | None = None,
        admission_policy: AdmissionPolicy | None = None,
        preemption_policy: PreemptionPolicy | None = None,
        prefix_cache: PrefixCache | None = None,
        preemption_cost_model: PreemptionCostModel | None = None,
        batch_builder: BatchBuilder | None = None,
        executor_wrapper: Callable[[Executor], Executor] | None = None,
        eos_token_ids: set[int] | None = None,
        model_max_len: int = 8192,
    ) -> None:
        config = config or EngineConfig()
        for name, value, protocol in (
            ("executor", executor, Executor), ("admission_policy", admission_policy, AdmissionPolicy),
            ("preemption_policy", preemption_policy, PreemptionPolicy), ("prefix_cache", prefix_cache, PrefixCache),
            ("batch_builder", batch_builder, BatchBuilder), ("preemption_cost_model", preemption_cost_model, PreemptionCostModel),
        ):
            check_seam(name, value, protocol)  # a wrong object fails here, not inside a later step
        self.model_runner = None
        self.loaded = None
        device = executor if implements(executor, SimulatedDevice) else None  # a simulator's sizes, or None
        vocab_size = None
        if executor is None:
            from minivllm.model.runner import load_for_serving

            self.loaded = load_for_serving(config)
            tokenizer = self.loaded.tokenizer
            model_max_len = self.loaded.model.args.max_position_embeddings
            vocab_size = self.loaded.model.args.vocab_size
        elif tokenizer is not None and hasattr(tokenizer, "__len__"):
            vocab_size = len(tokenizer)  # a prompt id past the vocabulary could not be detokenized: refuse it
        self.config = config = config.resolve(model_max_len)
        self.tokenizer = tokenizer

        # -- memory: the pool (and host tier) sized once, owned by the KV cache manager
        if self.loaded is not None:
            from minivllm.model.runner import ModelRunner, kv_layout

            layout = kv_layout(self.loaded.model, config)
            num_blocks, num_cpu_blocks, bytes_per_block = layout.num_blocks, layout.num_cpu_blocks, layout.bytes_per_block
        else:
            bytes_per_block = device.kv_bytes_per_block if device is not None else config.block_size * SIM_BYTES_PER_TOKEN
            budget = config.kv_cache_memory_bytes
            num_blocks = config.num_gpu_blocks_override or (budget // bytes_per_block if budget else DEFAULT_SIM_KV_BLOCKS)
            num_cpu_blocks = num_host_blocks(config, bytes_per_block)
        config.check_kv_capacity(num_blocks)
        pool = BlockPool(num_blocks)
        cpu_pool = BlockPool(num_cpu_blocks) if num_cpu_blocks else None
        if prefix_cache is None and config.enable_prefix_caching:
            from minivllm.kv.prefix import make_prefix_cache

            tenant_quota = tenant_cache_quota(config, num_blocks)  # per-tenant cache shares (rule capped_prefix_cache)
            # Any quota counts per tenant, all its salts together: the salt comes from the client, and a quota per
            # (tenant, salt) would be multiplied by every salt it invents -- and would turn into a per-tenant one
            # as soon as some other tenant got a max_cache_share.
            by_tenant = tenant_quota is not None or config.prefix_cache_quota_blocks is not None
            prefix_cache = make_prefix_cache(
                config.prefix_cache, pool, config.block_size, config.prefix_cache_quota_blocks,
                quota_group=KVCacheManager.namespace_tenant if by_tenant else None, quota_for=tenant_quota,
            )
        # (a caller's own cache object is bound to this pool by the KV manager, its owner)
        self.kv = KVCacheManager(pool, config.block_size, prefix_cache, cpu_pool, config.share_prefix_cache_across_tenants)
        if self.loaded is not None:
            self.model_runner = executor = ModelRunner(
                self.loaded.model, layout.make_cache(), seed=config.seed, max_model_len=config.max_model_len,
                cuda_graph_max_batch=0 if config.enforce_eager else config.max_num_seqs)
        if executor_wrapper is not None:
            # A measuring layer between the loop and the executor (calibrate's RecordingExecutor), put in here
            # because the engine builds the model runner itself: the engine's clock is the wrapper's from the
            # first step, and nobody swaps the executor of an engine already built.
            executor = executor_wrapper(executor)
            if executor is None:
                raise ValueError("executor_wrapper returned None: it must return the executor the engine will call")
            check_seam("executor_wrapper's result", executor, Executor)
        self.executor = executor

        # -- scheduling: the named policy (unless the caller passed its own), caps, the auto-mode cost model
        named_admission, named_preemption, named_costs = make_policies(config, admission_policy)
        admission_policy = named_admission  # the caller's, if given
        preemption_policy = preemption_policy or named_preemption
        costs = preemption_cost_model or named_costs
        if costs is None and config.preemption_mode == "auto":
            # An executor that can price a recompute by its length (the roofline simulator: short victims ride
            # free in memory-bound steps) supplies its own model; otherwise one measured prefill rate, which
            # makes the choice the same at every length.
            if implements(executor, PricesRecompute):
                costs = executor.preemption_cost_model(config.max_num_batched_tokens)
            else:
                swap_bw = config.swap_bandwidth_gbps * 1e9 if config.swap_bandwidth_gbps else None
                if swap_bw is None and self.model_runner is not None:
                    swap_bw = self.model_runner.kv_cache.measure_swap_bandwidth()
                elif swap_bw is None:
                    swap_bw = device.swap_bytes_per_s if device is not None else PCIE4_X16_BYTES_PER_S
                rate = config.prefill_tokens_per_s
                if rate is None and self.model_runner is not None:  # measured, as the link is (a guess stands
                    # for ever where every victim is swapped: no prefill step ever corrects it).  A GPU is
                    # launch-bound below a few hundred tokens, so it gets a long probe (milliseconds); a CPU's
                    # rate is flat from ~128 tokens on, and each pass there costs ~0.3 s of start-up
                    probe = 2048 if self.model_runner.device.type == "cuda" else 128
                    # (a prompt like any other: no longer than max_model_len, or a model trained for fewer
                    # positions has no RoPE row for the probe's last tokens)
                    rate = self.model_runner.measure_prefill_rate(
                        min(config.max_num_batched_tokens, config.max_model_len, probe))
                elif rate is None and device is not None:  # a simulated device may say its rate as it says its
                    # link: a replay starts from the recorded engine's probe, or its auto mode would choose
                    # differently until (if ever) its fit is trusted (ReplayExecutor.from_record)
                    rate = getattr(device, "prefill_tokens_per_s", None)
                costs = PreemptionCosts(bytes_per_block, swap_bw, rate or 1000.0)
        self.scheduler = Scheduler(config, self.kv, admission_policy, preemption_policy, costs,
                                   CapTable(config, num_blocks), batch_builder)
        # The prefill rate is learnt only into a cost model the engine built itself: a caller's own object (and
        # its numbers) stays as the caller made it.
        self._learnt_costs = costs if (preemption_cost_model is None and isinstance(costs, PreemptionCosts)
                                       and config.prefill_tokens_per_s is None) else None
        # the marginal prefill cost, fitted from the steps; the start-up rate stands until the fit is trusted
        self._prefill_fit = PrefillRateFit(costs.prefill_tokens_per_s) if self._learnt_costs is not None else None
        # decode-only steps replayed as CUDA graphs run another code path, without the eager launch cost a
        # step with prefill pays: fitted with the others, that cost would be charged to the prefill tokens
        self._fit_decode_steps = getattr(self.model_runner, "graphs", None) is None
        self.bytes_per_block = bytes_per_block

        # -- the caller's side
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else self._eos_ids()
        self.inputs = InputProcessor(tokenizer, vocab_size, config.max_model_len)
        self.requests: dict[str, Request] = {}
        self._groups: dict[str, list[Request]] = {}  # n > 1: parent id -> its samples (the output processor reads it)
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self._groups)
        self._finished_elsewhere: list[Request] = []  # ended outside a step's batch (aborted samples, a stall)
        self._ctrl_c = _CtrlCHeld()
        self._unread: list[RequestOutput] = []  # a step's outputs kept when Ctrl-C ended it: the next step returns them
        self.step_log = StepLog(config.step_log_max_entries)  # read by widgets, labs and benchmarks
        self.num_errors = 0
        self._idle_steps = 0  # steps in a row that ran nothing and ended nothing while work remained
        self._idle_since = 0.0  # the executor's clock at the first of them
        self.num_stalls = 0
        # (running requests, the KV manager's table_changes, each tenant's blocks) as the step log last counted them
        self._kept_tenant_blocks: tuple[list[Request], int, dict[str, int]] | None = None
        self._tenant_blocks_read = False  # has stats() counted tenant blocks yet? (only then is a count kept)
        self._last_step_time: float | None = None
        self.step_time_s: float | None = None  # moving average of the wall (or virtual) time per step
        self._lock = threading.RLock()
        self._in_step = False
        self._deferred_aborts: list[str] = []
        self.closed = False
        self._driver = None  # the server loop stepping this engine, if any (claim_driver)

    # -- who steps the engine --------------------------------------------
    def claim_driver(self, driver, start: Callable[[], None] | None = None) -> None:
        """Make ``driver`` (a server's loop, with an ``is_running`` property) the one loop that steps this engine.

        Whoever steps the engine receives every request's outputs and hands each to the stream waiting for it;
        a second loop would drop the outputs of the first one's streams, and their clients would wait forever
        (a notebook cell that starts a server twice).  So a second driver is refused while the first runs.
        ``start`` (the driver's thread) runs under the same lock: a driver counts as serving only once it runs,
        and a second one claiming in between -- two servers started at once -- would find it not running yet.
        """
        with self._lock:
            self.check_unserved(driver)
            self._driver = driver
            if start is not None:
                start()

    def check_unserved(self, driver=None) -> None:
        """``RuntimeError`` if a running loop other than ``driver`` steps this engine (:meth:`claim_driver`)."""
        current = self.served_by()
        if current is not None and current is not driver:
            raise RuntimeError("this engine is already served by another running server (stop that one first)")

    def release_driver(self, driver) -> None:
        """Give up the claim of :meth:`claim_driver`, only if ``driver`` still holds it: a loop that stops
        after another has claimed the engine (once the first stopped running) must not undo that claim."""
        with self._lock:
            if self._driver is driver:
                self._driver = None

    def served_by(self):
        """The running loop that has claimed this engine (:meth:`claim_driver`), or None."""
        driver = self._driver
        return driver if driver is not None and driver.is_running else None

    # -- construction helpers ---------------------------------------------
    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        eos = getattr(getattr(self.loaded, "hf_config", None), "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return ids

    @property
    def pool(self) -> BlockPool:
        """The device block pool (read it; only :mod:`minivllm.kv` changes it)."""
        return self.kv.pool

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.kv.prefix_cache

    # -- public API ---------------------------------------------------------
    def never_runs(self, max_total_tokens: int, tenant: str) -> str | None:
        """Why a request that may come to hold ``max_total_tokens`` tokens of KV could never run here, or ``None``.

        Alone in the pool it must fit the whole pool, and its tenant's KV cap.  Asked by :meth:`add_request`,
        and by the HTTP server before its admission door, so a request that can never run is a 400 there rather
        than a 429 whose client would retry it.  Reads only sizes fixed at start-up: safe from any thread.
        """
        bs = self.config.block_size
        if not self.kv.could_ever_hold(max_total_tokens):
            return (f"needs up to {max_total_tokens} tokens of KV but the whole pool holds "
                    f"{self.pool.num_blocks * bs}; it could never run")
        cap = self.scheduler.caps.max_blocks_for(tenant) if self.scheduler.caps is not None else None
        if cap is not None and blocks_for(max_total_tokens, bs) > cap:
            return (f"needs up to {max_total_tokens} tokens of KV but tenant {tenant!r} may hold at most "
                    f"{cap * bs} (its KV cap); it could never run")
        return None

    def add_request(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        tenant: str = "default",
        priority: int = 0,
        arrival_time: float | None = None,
        deadline: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id.  Bad input raises ``ValueError``.

        ``tenant`` names who sent it (its caps, weight and class come from
        ``EngineConfig.tenants``).  Tenants are a small, fixed set -- the server takes
        them from its API-key table -- because the engine keeps each one's counters
        for its whole life (about 2 KB for a name seen once, up to ~130 KB once its
        TTFT and ITL windows hold their 2,048 samples each): an end-user id as the
        tenant would grow them without bound.  ``priority`` (lower first) and ``deadline`` (seconds
        on the executor's clock, like ``arrival_time``) are read by the
        ``"priority"`` and ``"deadline"`` scheduling policies.
        """
        with self._lock:
            return self._add_request(prompt, sampling_params, request_id, tenant, priority, arrival_time, deadline)

    def _add_request(self, prompt, sampling_params, request_id, tenant, priority, arrival_time, deadline=None) -> str:
        self._check_open()
        # priority and deadline are checked by the input processor, after a prompt dict's own values win
        if arrival_time is not None and (
            not is_real(arrival_time)
        ):
            raise ValueError(f"arrival_time must be a finite number of seconds, got {brief_repr(arrival_time)}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        if request_id is None:
            request_id = self.inputs.new_request_id()
            while self._id_in_use(request_id):
                request_id = self.inputs.new_request_id()
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {brief_repr(request_id)}")
        if self._id_in_use(request_id):
            raise ValueError(f"duplicate request id {brief_repr(request_id)}: a request with this id is still in the engine")
        parent = self.inputs.sample_parent(request_id)
        if parent is not None and parent in self._groups:
            raise ValueError(f"request id {brief_repr(request_id)} clashes with a sample id of request {brief_repr(parent)}, still in the engine")
        arrival = self.executor.now() if arrival_time is None else arrival_time
        samples = self.inputs.process(
            prompt, params, request_id, tenant=tenant, priority=priority, arrival_time=arrival, deadline=deadline
        )
        if params.n > 1 and any(r.request_id in self.requests or r.request_id in self._groups for r in samples):
            raise ValueError(f"request id {brief_repr(request_id)} clashes with a sample id of a request in the engine")
        why = self.never_runs(samples[0].max_total_tokens, samples[0].tenant)
        if why is not None:
            raise ValueError(f"request {brief_repr(request_id)} {why}")
        if params.n > 1:
            self._groups[request_id] = samples
        if not self.scheduler.has_work():  # the engine was idle: time its next step from this arrival, not from the
            # last step's end (a quiet minute is no step's cost; see _observe_step).  The arrival, not a clock read
            # here: a replay of the run (sim.replay) has its clock exactly there, where a real clock reads a driver's
            # sleep overshoot later, and the first step after the wait would be timed differently in the two
            last = self._last_step_time
            self._last_step_time = arrival if last is None or arrival > last else last
        self.outputs.add(samples)
        for req in samples:
            self.requests[req.request_id] = req
            self.scheduler.add(req)
        return request_id

    def tokens_so_far(self, request_id: str) -> tuple[int, tuple[int, ...]]:
        """``(prompt tokens, output tokens per sample in index order)`` of a request the caller added and that is
        still in the engine; ``(0, ())`` for an id it does not know.

        Why a caller asks: a ``final_only`` request reports its tokens only when it finishes, so one aborted part
        way (a client that gave up on a non-streamed answer) would leave its generated tokens out of every count
        read from outputs.  The server reads this just before it aborts, and its metrics count what was unseen.
        """
        with self._lock:  # (re-entrant; the server asks from the stepping thread, another caller need not)
            group = self._groups.get(request_id)
            samples = group if group is not None else [r] if (r := self.requests.get(request_id)) is not None else []
            if not samples:
                return 0, ()
            return len(samples[0].prompt_token_ids), tuple(len(r.output_token_ids) for r in samples)

    def num_output_tokens(self, request_ids: Iterable[str]) -> list[int]:
        """Output tokens so far of each of ``request_ids`` -- one request each (a sample's own id, ``"g#1"``, as the
        step log names it), 0 for an id the engine does not hold -- under one taking of the lock.

        Why beside :meth:`tokens_so_far`: a driver that follows every row of every step (the fleet simulator
        counts each running request's streamed tokens) asked that once per row, each call taking the lock and
        building a tuple -- about a twentieth of lab 9's capacity study's CPU time.
        """
        with self._lock:
            get = self.requests.get
            return [0 if (r := get(rid)) is None else len(r.output_token_ids) for rid in request_ids]

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks (on both tiers) go back at once -- or, when the call comes from
        inside a step on the stepping thread (a finalizer, a callback), as that step ends.  False if unknown.

        Aborting a parent id of ``n > 1`` aborts every sample and nothing more
        is reported for it.  Aborting one sample (``"g#1"``) finishes just that
        sample as ``"abort"``; the group goes on, and its output reports the
        aborted sample in the next step.
        """
        if not isinstance(request_id, str):  # a list or dict would fail as an unhashable key deep inside
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        with self._lock:
            if self._in_step:
                # Re-entered on the stepping thread itself (the lock is re-entrant): a finalizer -- an abandoned
                # LLM.stream that the cycle collector frees at an allocation inside step() -- or a callback.
                # Ending the request mid-step would pull it out from under the batch; it ends when the step does.
                self._deferred_aborts.append(request_id)
                return request_id in self.requests or request_id in self._groups
            return self._abort_request(request_id)

    def _id_in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` is a request's in the engine -- or one whose last outputs a step Ctrl-C ended still
        keeps (a new request under that id would be handed the old one's)."""
        return (request_id in self.requests or request_id in self._groups
                or bool(self._unread) and any(out.request_id == request_id for out in self._unread))

    def _abort_request(self, request_id: str, drop_unread: bool = True) -> bool:
        if self._unread and drop_unread:  # kept from a step Ctrl-C ended: nobody reads an aborted request's outputs
            self._unread = [out for out in self._unread if out.request_id != request_id]
        sample = self.requests.get(request_id)
        if sample is not None and sample.parent_id is not None and sample.parent_id in self._groups:
            if sample.status.finished:
                return False  # aborted already; its output is on its way
            self._end(sample, RequestStatus.FINISHED_ABORTED)
            self._finished_elsewhere.append(sample)
            return True
        group = self._groups.pop(request_id, None)
        self.outputs.forget_group(request_id)
        if group is not None:  # the caller gave up on the whole group: report none of it
            self._finished_elsewhere = [r for r in self._finished_elsewhere if r.parent_id != request_id]
        targets = group if group is not None else [self.requests.get(request_id)]
        found = False
        for req in targets:
            if req is None or self.requests.get(req.request_id) is not req:
                continue  # finished already (its id may be someone else's now)
            self._end(req, RequestStatus.FINISHED_ABORTED)
            # No output reports this ending, so finish() never counts it: counted here, as finish() counts an
            # aborted sample's (TenantStats says why every ending counts).  A sample aborted alone whose output
            # was still owed was dropped from _finished_elsewhere above, so it is counted here, once.
            self.scheduler.tenant(req.tenant).record_finished(req)
            self._forget(req)
            found = True
        return found

    def _end(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of the scheduler (its blocks go back) and mark how it ended."""
        self.scheduler.remove(req)
        req.status = status
        req.finished_time = self.executor.now()

    def close(self) -> None:
        """Abort everything in flight and refuse new work.  Idempotent; ``LLM`` calls it on ``with`` exit."""
        with self._lock:
            for rid in list(self._groups) + list(self.requests):
                self._abort_request(rid)
            self._finished_elsewhere.clear()
            self._unread = []
            self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this engine is closed")

    def stats(self) -> EngineStats:
        """Gauges and counters for metrics, labs and benchmarks (a typed dict, cheap to build: see
        :mod:`minivllm.metrics.engine_stats` for every key).  Under the engine lock: a caller on another thread
        than the one stepping (a monitor beside ``LLM.generate``) waits for the step to end rather than walk the
        scheduler's tables while the step changes them."""
        with self._lock:
            return self._stats()

    def _stats(self) -> EngineStats:
        pool, kv, sched = self.pool, self.kv, self.scheduler.stats
        cache = self.prefix_cache
        available = kv.num_available_blocks  # free + evictable cached: counted once, the rest derive from it
        cpu_pool = kv.cpu_pool
        out: EngineStats = {
            "num_blocks": pool.num_blocks,
            "free_blocks": pool.num_free,  # the free list
            "available_blocks": available,  # what an allocation can get
            "cached_blocks": cache.num_cached_blocks if cache else 0,
            "used_blocks": pool.num_blocks - available,
            "kv_cache_usage": kv.usage(),
            "num_cpu_blocks": cpu_pool.num_blocks if cpu_pool else 0,
            "cpu_blocks_used": cpu_pool.num_used if cpu_pool else 0,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": kv.num_swapped,
            "num_preemptions": sched.num_preemptions,
            "num_recompute_preemptions": sched.num_recompute_preemptions,
            "num_swap_preemptions": sched.num_swap_preemptions,
            "recomputed_tokens": sched.num_recomputed_tokens,
            "swapped_out_blocks": kv.stats.swapped_out_blocks,
            "swapped_in_blocks": kv.stats.swapped_in_blocks,
            "swapped_out_bytes": kv.stats.swapped_out_blocks * self.bytes_per_block,
            "swapped_in_bytes": kv.stats.swapped_in_blocks * self.bytes_per_block,
            "num_rejected": sched.num_rejected,
            "num_errors": self.num_errors,
            "num_stalls": self.num_stalls,
            "recompute_hit_tokens": kv.stats.recompute_hit_tokens,
            "per_tenant": self.tenant_stats(),
        }
        if cache is not None:
            st = cache.stats
            out.update(
                prefix_cache_queries=st.queries_tokens,
                prefix_cache_hits=st.hits_tokens,
                prefix_cache_hit_rate=st.hit_rate,
                prefix_cache_evictions=st.evicted_blocks,
                prefix_cache_quota_evictions=st.quota_evictions,
            )
        return out

    def has_unfinished_requests(self) -> bool:
        """Whether a driver must step again: the scheduler's work, and outputs still owed for requests that ended
        outside a step (an aborted sample, a stall) or in a step Ctrl-C ended -- only the next step reports them."""
        return self.scheduler.has_work() or bool(self._finished_elsewhere) or bool(self._unread)

    def holds_any(self, request_ids) -> bool:
        """Whether any of ``request_ids`` (ids :meth:`add_request` returned) is still in the engine, so a
        step may yet report it: False once each has finished or been aborted and its last output was returned (a
        step Ctrl-C ended keeps its outputs for the next).  C-level set tests, no Python loop."""
        with self._lock:
            if self._unread and not {out.request_id for out in self._unread}.isdisjoint(request_ids):
                return True
            return not (self.requests.keys().isdisjoint(request_ids) and self._groups.keys().isdisjoint(request_ids))

    # -- the loop -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration of the serving loop; returns what changed for each request.

        A Ctrl-C on the main thread waits for the step to end (:class:`_CtrlCHeld`); the step's outputs then wait for
        the next call, which returns them, in order, before its own.
        """
        with self._lock:
            with self._ctrl_c, self._stepping():
                self._check_open()
                self.scheduler.admit()                             # 1. admit
                batch = self.scheduler.build_batch()               # 2. build batch
                batch = self.scheduler.allocate(batch)             # 3. allocate KV blocks
                sampled = self.execute(batch)                      # 4. execute
                grew = self.append(batch, sampled)                 # 5. append KV (and tokens)
                outputs = self.emit(grew)                          # 6. emit / stream
                outputs = self.finish(outputs, batch)              # 7. finish
                self.log_step(batch)
                self._unread += outputs  # (taken below -- unless Ctrl-C, delivered as the step exits, ends it here)
            outputs, self._unread = self._unread, []
            return outputs

    @contextlib.contextmanager
    def _stepping(self):
        """Mark a step in progress; aborts that arrive from inside it (see :meth:`abort_request`) end when it does."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            while self._deferred_aborts:
                # (after the step, as if it came after it: the step's own outputs, about to be returned, stay)
                self._abort_request(self._deferred_aborts.pop(0), drop_unread=False)

    def execute(self, batch: ScheduledBatch) -> dict[str, int]:
        """Step 4, guarded: if the executor fails as a whole, the requests of this batch fail, not the engine."""
        batch.started = self._last_step_time  # (the end of the step before: see ScheduledBatch.started)
        try:
            return self.executor.execute(batch)
        except Exception as exc:  # noqa: BLE001 - reported per request as finish_reason "error"
            for seq in batch.seqs:
                batch.errors.setdefault(seq.request.request_id, f"execution failed: {type(exc).__name__}: {exc}")
            # Its copies in may never have run either: none of them is counted as swapped in, whoever they
            # were for (a row that failed, a request with no row, one preempted again in this very step).
            if batch.moves.swap_in:
                self.kv.uncount_swap_ins(batch.moves)
            # A victim swapped out in this step is in no row, so it does not fail; but its copy out may never
            # have run, and swapped back in it would attend garbage: it is recomputed instead.
            for req in batch.preempted:
                if req.status is RequestStatus.SWAPPED:
                    self.scheduler.swap_out_failed(req)
            # Likewise a request swapped in for this step but given no row (a batch builder may leave one out):
            # it does not fail, but its copy in may never have run, and left running it would attend garbage.
            if batch.swapped_in:
                rows = {id(seq.request) for seq in batch.seqs}
                for req in batch.swapped_in:
                    if req.status is RequestStatus.RUNNING and id(req) not in rows:
                        self.scheduler.swap_in_failed(req)
                        # counted as a preemption (its tenant's too): the step log names it like any victim, or
                        # /metrics labels it tenant "unknown" and a rebuild from the log misses it
                        batch.preempted.append(req)
            return {}
        finally:
            self._step_end(batch)

    def _step_end(self, batch: ScheduledBatch) -> float:
        """The clock at the end of ``batch``'s step: read once, right after the forward pass, and used by every
        stage after it (the step time and prefill-rate fit, token times, finish times, the step log).

        One reading, not one per stage: a replay (:mod:`minivllm.sim.replay`) can put its clock at one time per
        step -- the step log's -- and with a reading per stage the later ones came a varying moment of host work
        after it, so the real engine's step-time average, prefill-rate fit and retry hints were fed times its
        replay never showed (and auto mode could swap in one where the other recomputed).  A batch whose
        executor was called by hand (lab 1 walks the steps one by one) is read at the first stage that asks.
        """
        if batch.ended is None:
            batch.ended = self.executor.now()
        return batch.ended

    def append(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[Request]:
        """Step 5: the K/V written in this step is now part of each request; sampled tokens join it.

        Newly filled blocks are offered to the prefix cache right away, so the
        next request (or the next turn of this chat) can reuse them.
        """
        now = self._step_end(batch)
        self._observe_step(batch, now)
        self.scheduler.observe(batch, sampled, now)
        grew: list[Request] = []
        errors = batch.errors
        token_of = sampled.get
        for seq in batch.seqs:  # once per scheduled request every step: kept to plain attribute work
            req = seq.request
            if errors and req.request_id in errors:
                req.status, req.error = RequestStatus.FINISHED_ERROR, errors[req.request_id]
                continue
            if not seq.is_decode and req.first_scheduled_time is None:  # (a decode was scheduled before)
                started = batch.started  # (None: a batch run by hand; a request may arrive after a step began)
                req.first_scheduled_time = now if started is None else max(started, req.arrival_time)
            req.num_computed_tokens += seq.num_tokens
            token = token_of(req.request_id)
            if token is not None:
                req.output_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = now
                req.token_times.append(now)
                grew.append(req)
        if self.kv.prefix_cache is not None:
            self.kv.cache_new_full_blocks(batch.seqs)
        return grew

    def emit(self, grew: list[Request]) -> list[RequestOutput]:
        """Step 6: detokenize, check stops, build the outputs a streaming caller reads."""
        return self.outputs.emit(grew)

    def finish(self, outputs: list[RequestOutput], batch: ScheduledBatch) -> list[RequestOutput]:
        """Step 7: finished requests leave and free their blocks; ``n > 1`` samples fold into their parent.

        Besides the step's outputs, requests that ended without a new token get
        their last output here: rejected ones (with a retry hint), failed ones
        and samples aborted since the last step.
        """
        now = self._step_end(batch)
        self._watch_progress(batch, outputs, now)
        for req in batch.rejected:
            req.finished_time = now
            req.retry_after_s = self.retry_after(req)
            outputs.append(self.outputs.final_output(req))
        if batch.errors:
            for seq in batch.seqs:
                if seq.request.request_id in batch.errors:  # failed in execution (emit reports its own failures)
                    outputs.append(self.outputs.final_output(seq.request))
        for req in self._finished_elsewhere:
            outputs.append(self.outputs.final_output(req))
        self._finished_elsewhere = []
        requests = self.requests
        # n > 1 samples fold into their parent's output; with no group in the engine every output is its
        # own caller's and goes back as it is (fold would return the same list).
        pairs = [(requests[out.request_id], out) for out in outputs] if self._groups else None
        for out in [out for out in outputs if out.finished]:
            req = requests[out.request_id]
            self.scheduler.tenant(req.tenant).record_finished(req)  # its tenant's latency samples
            self.num_errors += req.status is RequestStatus.FINISHED_ERROR
            if req.finished_time is None or req.status is not RequestStatus.FINISHED_ABORTED:
                req.finished_time = now
            out.metrics.finished_time = req.finished_time
            self.scheduler.remove(req)
            self._forget(req)
        if pairs is None:
            return outputs
        folded = self.outputs.fold(pairs)
        for out in folded:
            if out.finished:
                self._groups.pop(out.request_id, None)
        return folded

    def _watch_progress(self, batch: ScheduledBatch, outputs: list[RequestOutput], now: float) -> None:
        """Count steps that made no progress; fail what is stuck once they are a stall (see :data:`STALL_STEPS`).

        Progress is a scheduled sequence (every one computes at least one
        token) or a request that ends or reports this step.  The stuck requests
        end as ``"error"`` through :attr:`_finished_elsewhere`, so this step's
        :meth:`finish` reports them and frees their blocks like any other.
        """
        if batch.seqs or outputs or batch.rejected or self._finished_elsewhere or not self.scheduler.has_work():
            self._idle_steps = 0
            return
        if not self._idle_steps:
            self._idle_since = now
        self._idle_steps += 1
        waited, timeout = now - self._idle_since, self.config.stall_timeout_s
        if timeout is None or self._idle_steps < STALL_STEPS or 0 < waited < timeout:
            return
        sched = self.scheduler
        stuck = [*sched.running, *sched.waiting]
        why = (f"the engine made no progress in {self._idle_steps} steps ({waited:.3g} s; nothing scheduled, "
               f"nothing finished) with {len(sched.waiting)} waiting and {len(sched.running)} running, "
               f"{self.pool.num_free} KV blocks free: a scheduling deadlock (an admission policy that admits "
               f"no one, a request that can never fit?); the request was failed so the engine keeps serving")
        log.warning("%s (%d requests failed)", why, len(stuck))
        for req in stuck:
            req.status, req.error = RequestStatus.FINISHED_ERROR, why
            self._finished_elsewhere.append(req)
        self._idle_steps = 0
        self.num_stalls += 1

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Per-tenant accounting: tokens in/out, KV blocks held, running/waiting, queue time, preemptions,
        rejects, and TTFT/ITL percentiles (seconds) of the newest finished requests."""
        with self._lock:  # (see stats)
            return self._tenant_stats()

    def _tenant_stats(self) -> dict[str, TenantStats]:
        live: dict[str, list[int]] = {}
        for r in self.scheduler.running:
            live.setdefault(r.tenant, [0, 0, 0])[0] += 1
        for tenant, n in self._tenant_blocks().items():
            live[tenant][2] = n
        for tenant, n in self.scheduler.waiting_by_tenant.items():
            live.setdefault(tenant, [0, 0, 0])[1] += n
        out = {}
        for name in sorted(set(self.scheduler.tenant_stats) | set(live)):
            ts = self.scheduler.tenant(name)
            running, waiting, blocks = live.get(name, (0, 0, 0))
            out[name] = {
                "prompt_tokens": ts.prompt_tokens,
                "output_tokens": ts.output_tokens,
                "kv_blocks": blocks,
                "kv_share": blocks / self.pool.num_blocks,
                "num_running": running,
                "num_waiting": waiting,
                "num_finished": ts.finished,
                "queue_time_s": ts.queue_time_s,
                "num_preemptions": ts.preemptions,
                "num_rejected": ts.rejected,
                **ts.latency_percentiles(),
            }
        return out

    def _tenant_blocks(self) -> dict[str, int]:
        """Each tenant's device blocks now (:func:`~minivllm.metrics.step_log.tenant_blocks`): the step log's count
        when nothing it was taken from has changed since, else a fresh one.

        Why reuse it: with blocks shared the count is a set union (~0.14 ms at 128 requests of 70 blocks), and a
        server reads ``stats()`` after every step, so each step paid for it twice.  Why it cannot go stale: the
        count depends only on which requests run (a request's tenant is fixed) and on their block tables.  The
        step log kept the running requests (compared by identity: one pointer each) and the KV manager's
        :attr:`~minivllm.kv.kv_cache_manager.KVCacheManager.table_changes`, which every change to any table
        bumps -- only that class changes one, whatever pool it runs on.  Any change since (an abort or a
        deferred one, a stage of a step walked by hand, a copy-on-write that swaps a last block in place) shows
        in one or the other, and the count is taken again.  (Comparing a copy of every table instead cost
        O(blocks) at each step and each read: 13-24 us a read at 128 requests of 69 blocks, against 0.3 us.)  A
        kept count is a set union, right whether or not blocks are shared now.  Nothing is kept until a first
        read: a driver that never reads ``stats()`` (an offline run, a simulation) pays nothing.
        """
        self._tenant_blocks_read = True
        running, kept = self.scheduler.running, self._kept_tenant_blocks
        if kept is not None and kept[1] == self.kv.table_changes and kept[0] == running:
            return kept[2]
        return tenant_blocks(running, self.kv.may_share())

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.outputs.forget(req)

    def log_step(self, batch: ScheduledBatch) -> None:
        sched, seqs = self.scheduler, batch.seqs
        per_tenant = {}  # per-tenant fields only once a named tenant (or tenant settings) exists: see step_log
        seen = sched.tenant_stats
        if self.config.step_log_tenants and (self.config.tenants or len(seen) > 1 or (seen and "default" not in seen)):
            shared = self.kv.may_share()
            fields = tenant_fields(seqs, sched.running, sched.waiting_by_tenant, shared)
            per_tenant = {"seq_tenants": fields[0], "tenants": fields[1]}
            # A set union is kept for the stats() read that follows a step (see _tenant_blocks), where stats()
            # is read at all; unshared, the count is a sum that costs less than keeping it would
            running = sched.running
            self._kept_tenant_blocks = (list(running), self.kv.table_changes,
                                        {row.tenant: row.kv_blocks for row in fields[1] if row.running}
                                        ) if shared and self._tenant_blocks_read else None
        # Rows are one-token rows first (the batch's layout), so a last row of one token means a batch of
        # one-token rows: a steady decode step, logged without a pass over the batch for its token counts.
        seq_tokens = (1,) * len(seqs) if not seqs or seqs[-1].num_tokens == 1 else tuple([s.num_tokens for s in seqs])
        self.step_log.append(
            StepRecord(
                step=self.scheduler.stats.num_steps - 1,
                time=self._step_end(batch),  # (the time the step's tokens and finishes carry)
                seq_ids=tuple([s.request.request_id for s in seqs]),
                seq_starts=tuple([s.start for s in seqs]),
                seq_tokens=seq_tokens,
                num_tokens=sum(seq_tokens),  # (batch.num_tokens would walk the batch again)
                num_decodes=batch.num_decode_tokens,  # (carried by the batch: no pass over it)
                preempted=tuple(r.request_id for r in batch.preempted),
                # (a victim whose swap failed with its step was recomputed instead: no longer SWAPPED here)
                swapped=tuple(r.request_id for r in batch.preempted if r.status is RequestStatus.SWAPPED)
                if batch.preempted else (),
                swapped_out=len(batch.moves.swap_out),
                swapped_in=len(batch.moves.swap_in),
                rejected=tuple(r.request_id for r in batch.rejected),
                failed=tuple(batch.errors),
                free_blocks=self.pool.num_free,
                available_blocks=self.kv.num_available_blocks,
                running=len(self.scheduler.running),
                waiting=len(self.scheduler.waiting),
                **per_tenant,
            )
        )

    # -- estimates: step time, prefill rate, retry hints ---------------------------
    def _observe_step(self, batch: ScheduledBatch, now: float) -> None:
        """A moving average of the step time (what retry hints use) and the fit of the marginal prefill rate
        (what auto mode prices a recompute by: :class:`~minivllm.sched.scheduler.PrefillRateFit`).

        A step is timed from the end of the one before, so host work between steps counts -- except after the
        engine ran dry: a driver steps only while there is work, so the wait for the next request is idle time,
        and :meth:`add_request` restarts the clock at the arrival that ends it.  ``now`` is the step's one
        reading (:meth:`_step_end`), a time a replay of the run reproduces exactly.

        Every step feeds the fit, decode-only ones included: they help tell the per-step and per-decode costs
        apart from the per-prefill-token one.  Three kinds do not: a step that swapped KV (its time holds link
        copies that are neither prefill nor decode work); a step whose every row failed (the executor raised:
        its time is how long the failure took, not what the work costs); and, where decode-only steps are
        CUDA graphs, those (a graph replay skips the launch cost every step with prefill pays, so one
        intercept cannot fit both kinds; the steps with prefill still vary in prefill tokens and decode rows).
        """
        last, self._last_step_time = self._last_step_time, now
        if last is None or not batch.seqs or now <= last:
            return
        dt = now - last
        self.step_time_s = dt if self.step_time_s is None else (1 - _EMA) * self.step_time_s + _EMA * dt
        fit = self._prefill_fit
        if fit is not None and not (batch.moves.swap_in or batch.moves.swap_out) and len(batch.errors) < len(batch.seqs):
            prefill = batch.num_prefill_tokens  # builds no list in a decode-only step
            if not prefill and not self._fit_decode_steps:
                return
            fit.add(prefill, batch.num_decode_tokens if prefill else len(batch.seqs), dt)
            rate = fit.rate()
            if rate is not None:
                self._learnt_costs.prefill_tokens_per_s = rate

    def retry_after(self, req: Request) -> float:
        """When a rejected request might fit: the time until running requests free enough blocks
        (:meth:`retry_steps` steps, each taking the measured average)."""
        step = self.step_time_s or UNTIMED_STEP_S
        cap_steps = self.scheduler.cap_retry_steps(req)  # turned away by its tenant's cap, not by the pool
        if cap_steps is not None:
            return _hint(step * cap_steps)
        return _hint(step * self.retry_steps(req))

    def retry_steps(self, req: Request) -> int:
        """Steps until the pool has room for ``req``'s worst case next to the worst cases of everything running.

        Running requests are assumed to finish in order of the steps they still need
        (:meth:`~minivllm.request.Request.steps_to_finish`, the rule a cap's hint uses).  What those left still
        claim and what the gone ones gave back are recounted after each departure
        (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.claims_as_they_leave`), not summed per request: a
        leader and its samples on one partly filled block make one copy fewer than their number, and the
        prompt blocks they share come back once, with the last of them.
        """
        kv = self.kv
        chunk = self.config.prefill_chunk_tokens
        order = sorted(self.scheduler.running, key=lambda r: r.steps_to_finish(chunk))
        need = kv.worst_case_new_blocks(req) - kv.num_available_blocks
        counts = kv.claims_as_they_leave(order, order, worst_case=True)
        claimed, given_back = next(counts)
        remaining = 1
        for r, (claimed_after, given_back_after) in zip(order, counts):
            if need + claimed - given_back <= 0:
                break
            claimed, given_back = claimed_after, given_back_after
            remaining = r.steps_to_finish(chunk)
        return remaining
