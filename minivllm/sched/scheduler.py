"""The scheduler: who runs this step, with how many tokens, and who makes room.

It owns two queues -- ``waiting`` (not yet admitted, preempted or swapped out)
and ``running`` (admitted, holding KV blocks) -- and exposes the first three
steps of the serving loop as separate methods, so the engine step reads in order:

1. :meth:`Scheduler.admit` moves waiting requests into ``running`` while there
   is room: a seat (``max_num_seqs``), token budget and KV blocks for the
   request's whole remaining prefill (not just its first chunk).  It *asks*
   the memory manager (:class:`~minivllm.kv.kv_cache_manager.KVCacheManager`)
   whether blocks are there; it never touches a block itself.
2. :meth:`Scheduler.build_batch` gives each running request its tokens for the
   step under the budget ``max_num_batched_tokens``: decodes first (one token
   each, so a running stream never stalls), then prefill chunks fill the rest.
3. :meth:`Scheduler.allocate` gets KV blocks for every scheduled token and,
   when the pool runs dry, preempts a victim chosen by the
   :class:`~minivllm.interfaces.PreemptionPolicy`.

Preemption modes (``EngineConfig.preemption_mode``)
---------------------------------------------------
* ``recompute`` -- the victim's blocks are freed and its computed tokens
  forgotten; it goes back to the *front* of ``waiting`` and prefills again
  (prompt and generated tokens) when readmitted.  Costs compute.
* ``swap`` -- the victim's KV is copied to a host tier and its device blocks
  freed; it waits at the front of ``waiting`` and is swapped back in as soon
  as blocks allow -- ahead of new admissions in queue order (FCFS); a ranking
  policy (priority, deadline, ...) orders it by its rank like any waiting
  request.  Costs link traffic (twice its KV bytes).
  When the host tier is full the victim is recomputed instead.
* ``reject`` -- nothing running is ever preempted: a request is admitted only
  if the pool can hold its *worst case* (prompt + ``max_tokens``) next to the
  worst cases of everything running; a new request that cannot be admitted
  for lack of KV finishes as ``"rejected"`` with a ``retry_after_s`` hint.
* ``auto`` -- per victim, the cheaper of swap and recompute (:class:`PreemptionCosts`):
  swap when ``2 * kv_bytes / link_bandwidth < computed_tokens / prefill_rate``
  and the host tier has room, else recompute.  Both sides grow linearly with the
  context, so this default gives nearly the same answer at every length (only a
  part-filled last block tips a victim toward recompute); long contexts swap and
  short ones recompute under a model whose short recomputes are cheap per token,
  such as the simulator's roofline one.

Two rules keep preemption from thrashing: nothing is admitted in the step
right after a preemption made while allocating (the pool is full; admitting
would only preempt again -- so it pauses even when the victim had nothing
computed yet; a preemption made on purpose to seat a better-ranked request
does not pause admission), and a request preempted
``preemption_protect_after`` times is only chosen as a victim when every
running request is protected (or, when a group's KV cap makes it preempt its
own work, every running request of that group; preempting to seat a
better-ranked request never takes a protected one).  So no request is
preempted "every step" (cf. vLLM issue #25538) while others could give way.

A request that could never fit the pool is rejected when it is added, so
"preempt until it fits" always terminates: alone in the engine, any accepted
request fits.

Fairness (:mod:`minivllm.sched.fairness`)
-----------------------------------------
Per-tenant (and, under the three-class preset, per-class) caps are enforced here
for every policy, through a :class:`~minivllm.sched.fairness.CapTable`: a request
whose group is at ``max_running`` or would pass its KV cap is held back at
admission; a group's tokens in one batch never pass ``max_tokens`` (in the
scheduler's own step 2: a :class:`~minivllm.interfaces.BatchBuilder` replaces
that limit with the rest of step 2, and its answer is not checked against it);
a running request that would grow its group past the KV cap preempts within
its own group.  Policies with a ``rank`` also order the prefill chunks of a batch by
rank, count against an admission's token budget only the running prefills
ranked at or ahead of it, and (with ``may_preempt_for``) preempt a worse-ranked
running request to seat a better-ranked one (nothing ranked behind that victim is then admitted in the same
pass: it would take the victim's room; under a per-tenant head of line, nothing of the victim's own tenant).
Once a victim has been swapped out to seat another, no swapped request is swapped back in during the same
admission (the victim's freed device blocks could be overwritten before the
executor copies them out).  A swapped-out request that preempts a victim which is then swapped out therefore gets
back in one pass later, not in the same one: a step's delay, accepted so that a better-ranked request is not left
behind worse-ranked work until that work finishes.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterator, Sequence
from itertools import chain
from dataclasses import dataclass, field

from minivllm.config import EngineConfig
from minivllm.interfaces import (AdmissionPolicy, BatchBuilder, HeadOfLine, KeepsOrder, ObservesSteps,
                                 PreemptionCostModel, PreemptionPolicy, PreemptsToAdmit, RanksRequests,
                                 ReadsCachedPrefixes, TracksActivity, implements)
from minivllm.kv.kv_cache_manager import KVCacheManager, blocks_for
from minivllm.kv.sharing import GroupBlocks
from minivllm.metrics.stats import nearest_rank
from minivllm.request import Request, RequestStatus
from minivllm.sched.output import ScheduledBatch, ScheduledSeq
from minivllm.sched.fairness import NO_USAGE, CapTable, GroupUsage
from minivllm.sched.policies import FCFSAdmission, RecomputeLatestPreemption

#: ``Scheduler._try_admit``'s answer for a whole prefill (chunked prefill off) over the token budget left
_SHORT_OF_BUDGET = object()
_SAMPLES_KEPT = 2048  # per tenant: the newest finished requests' TTFTs and ITLs kept for percentiles
# What a request's caps tell the admission loop (``Scheduler._cap_verdict``): try to seat it, pass it over, or end
# the pass (every tenant still waiting is passed over)
_TRY, _SKIP, _STOP = "try", "skip", "stop"


def _named(answer) -> str:
    """A policy's wrong answer in an error message: a request by its id (a whole Request's repr would bury the
    message), a plain value as itself, anything else by its type."""
    if isinstance(answer, Request):
        return f"request {answer.request_id!r}"
    return repr(answer) if answer is None or isinstance(answer, (str, int, float)) else f"a {type(answer).__name__}"


class _AdmissionPass:
    """What one admission pass (``Scheduler._admit``) knows as it walks the policy's order: what it has admitted,
    the room those admissions took, and the tenants it passes over.  Made at the start of every pass, from the
    running requests as they stand, and dropped at its end: nothing here outlives a pass."""

    __slots__ = ("usage", "held", "reserved", "unranked_budget", "trusted", "admitted", "blocked", "cap_failed",
                 "cap_closed", "sharing", "swapped_out", "victim_rank", "held_seats", "decodes", "prefills")

    def __init__(self, usage: dict[tuple, GroupUsage] | None, held: GroupBlocks | None, reserved: int,
                 unranked_budget: int, trusted: bool) -> None:
        self.usage = usage  # with caps: each group's GroupUsage, kept as the pass seats requests
        self.held = held  # with caps: the blocks each group holds (a shared block once), kept likewise
        self.reserved = reserved  # blocks the running requests will still claim
        self.unranked_budget = unranked_budget  # without a ranking policy: the step's token budget left
        self.trusted = trusted  # the policy keeps its order: the requests it yields need no check against the queue
        self.admitted: list[Request] = []
        self.blocked: set[str] = set()  # tenants whose head request could not start (per-tenant head of line)
        # Per tenant, then per share class, the fewest blocks a request of that class needed (its fixed need,
        # ``Scheduler._need_blocks``) and still failed its caps: a later request of the same class needing as many
        # fails too, without asking (``Scheduler._share_class`` says what a class is and why this holds).  This
        # keeps a step with a long capped backlog (lab 6's 1,800 batch prompts) from re-checking every one of them.
        # (Per tenant first: a tenant none of whose requests failed is not asked its requests' share classes.)
        self.cap_failed: dict[str, dict] = {}
        # Tenants none of whose waiting requests can pass their caps in this pass: each of their classes failed at
        # its smallest need, or a cap failed that no request could pass (seats, tokens, KV already over).  Their
        # requests are passed over with one set lookup, so a step beside a long capped backlog costs the policy's
        # ordering and that lookup per request, not a cap check.
        self.cap_closed: set[str] = set()
        # Per tenant, the share keys of the cached prefixes its KV-capped groups hold (``Scheduler._sharing_keys``),
        # worked out once it is first asked; kept a superset as the pass seats requests
        self.sharing: dict[str, set] = {}
        self.swapped_out = False  # a victim swapped out in this pass: no swap-in may reuse its blocks this step
        # The best rank among the victims preempted in this pass to seat a better-ranked request, under the key
        # None (a global head of line) or per victim's tenant (a per-tenant one).  A request ranked behind one of
        # them is not admitted in the same pass: it would take the room the victim gave up (a priority-2 request
        # running while the priority-1 victim waits, an inversion of the policy's order).  Per tenant, a head that
        # cannot start lets other tenants pass by design, but not its own tenant's later requests, and a victim
        # is its tenant's head until the next pass (three_class: a batch request preempted for an interactive
        # one, its room taken by the same tenant's newer batch request -- the same-class trade that rule
        # preempt_batch_first_swap_long exists to avoid).
        self.victim_rank: dict[str | None, object] = {}
        self.held_seats = 0  # seats kept for samples whose leader is still prefilling (global head of line)
        # Under a ranking policy, once first asked (``Scheduler._admission_budget``): the running decodes' tokens
        # tallied, and the running prefills; None again after a preemption
        self.decodes: tuple[int, dict] | None = None
        self.prefills: list[Request] = []


@dataclass
class PreemptionCosts:
    """The auto mode's default cost model (a :class:`~minivllm.interfaces.PreemptionCostModel`):
    seconds to recompute vs seconds to swap a victim.

    ``prefill_tokens_per_s`` is the engine's measured prefill rate (or a
    configured one); ``swap_bytes_per_s`` the host link's bandwidth.
    """

    bytes_per_block: int
    swap_bytes_per_s: float
    prefill_tokens_per_s: float

    def recompute_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s

    def swap_s(self, num_blocks: int) -> float:
        """Out now and back in later: the victim's KV crosses the link twice."""
        return 2 * num_blocks * self.bytes_per_block / self.swap_bytes_per_s

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.swap_s(num_blocks) < self.recompute_s(num_tokens)


class PrefillRateFit:
    """The marginal cost of a prefill token, fitted from measured steps: what auto mode prices a recompute by.

    Recomputing a victim of ``N`` tokens adds ``N`` prefill tokens to steps that run anyway, so its cost is
    ``N`` times the *marginal* seconds of a prefill token -- not a share of everything else in those steps.
    Dividing a mixed step's whole time by all its tokens would charge each prefill token a slice of the per-step
    cost (the weights are read once a step, host work) and of the decode rows riding along, which cost far more
    per token than prefill tokens: on a busy, decode-heavy stream that rate comes out 1.7x too low (SmolLM2-135M
    on one quiet CPU thread, chat-sized prompts: 503 tokens/s against 798-840 for a plain prefill of 64-256
    tokens; this fit learns 852 from the same steps --
    ``benchmarks/results/2026-12-05_cpu-2core_prefill_rate_chat.json``), and auto mode would swap victims that
    are cheaper to recompute.

    So each step's time ``T`` is fitted as ``a + b * P + c * D`` (``P`` prefill tokens, ``D`` decode rows) by
    least squares, and the rate is ``1 / b``.  The fit keeps running, exponentially decayed sums (a weighted
    Welford update of the means and co-moments: ten floats, O(1) and no container per step, and no cancellation
    from subtracting large raw sums); ``decay`` per step forgets old steps (a half-life of ~35 steps at 0.98), so
    a machine that slows down or speeds up is followed.

    It says nothing (:meth:`rate` returns ``None``, and the caller keeps what it had: the start-up probe's
    rate, :meth:`~minivllm.model.runner.ModelRunner.measure_prefill_rate`, until a fit is trusted) when

    * fewer than ``min_steps`` steps' worth of weight has been seen;
    * ``P`` is (almost) a linear function of ``D``: a lone request alternates "whole prefill, no decode" and
      "one decode, no prefill", and a stream whose steps all fill the token budget has ``P + D`` fixed; then
      any split of the time between ``b`` and ``c`` fits equally well.  When ``D`` does not vary at all,
      ``c * D`` is a constant and ``b`` is fitted with ``a`` alone;
    * the slope is not positive or not clearly above its noise (``b`` under ``min_t`` standard errors: a near
      zero slope would mean a near-infinite rate, and every victim recomputed);
    * ``1 / b`` is more than ``max_ratio`` times away from ``prior`` (the probe timed a whole prefill on this
      machine; a fitted slope that far off comes from a step time that is not linear in ``P`` -- a GPU's
      memory-bound steps, where small chunks ride free -- or from contention, not from the machine).
    """

    __slots__ = ("prior", "decay", "min_steps", "min_t", "max_ratio", "w", "mp", "md", "mt",
                 "cpp", "cpd", "cdd", "cpt", "cdt", "ctt")

    def __init__(self, prior: float, *, decay: float = 0.98, min_steps: float = 10.0, min_t: float = 3.0,
                 max_ratio: float = 20.0):
        # the weight seen tends to 1 / (1 - decay): at or below min_steps (decay 0.9 with the default 10) no fit
        # would ever be trusted, and the probe's rate would stand for ever without a word (the tolerance: in
        # floats the weight at decay 0.9 settles just under 10 while 1 / (1 - 0.9) computes just over it)
        if not 0.0 < decay <= 1.0 or (1.0 - decay) * min_steps >= 1.0 - 1e-9:
            raise ValueError(f"decay must be in (0, 1] and keep more than min_steps ({min_steps}) steps' weight, "
                             f"got {decay} (it keeps {1.0 / (1.0 - decay) if 0.0 < decay < 1.0 else 0.0:.1f})")
        self.prior, self.decay, self.min_steps, self.min_t, self.max_ratio = prior, decay, min_steps, min_t, max_ratio
        self.w = self.mp = self.md = self.mt = 0.0
        self.cpp = self.cpd = self.cdd = self.cpt = self.cdt = self.ctt = 0.0

    def add(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        """One step: ``prefill_tokens`` prefill tokens and ``decode_tokens`` decode rows took ``seconds``."""
        k = self.decay
        self.w = w = k * self.w + 1.0
        dp, dd, dt = prefill_tokens - self.mp, decode_tokens - self.md, seconds - self.mt
        self.mp += dp / w
        self.md += dd / w
        self.mt += dt / w
        # co-moments: (x - old mean) * (y - new mean), previous sums decayed like the weights
        ep, ed, et = prefill_tokens - self.mp, decode_tokens - self.md, seconds - self.mt
        self.cpp = k * self.cpp + dp * ep
        self.cpd = k * self.cpd + dp * ed
        self.cdd = k * self.cdd + dd * ed
        self.cpt = k * self.cpt + dp * et
        self.cdt = k * self.cdt + dd * et
        self.ctt = k * self.ctt + dt * et

    def rate(self) -> float | None:
        """``1 / b`` in prefill tokens per second when the fit can be trusted, else ``None`` (see the class)."""
        if self.w < self.min_steps or self.cpp <= 0.0:
            return None
        cpp, cpd, cdd, cpt, cdt = self.cpp, self.cpd, self.cdd, self.cpt, self.cdt
        if cdd > 1e-6 * self.w:  # D varies: b from P's part not explained by D (the Schur complement)
            spread = cpp - cpd * cpd / cdd
            b = (cpt - cpd * cdt / cdd) / spread if spread > 1e-4 * cpp else None
            c, params = ((cdt - cpd * b) / cdd if b is not None else 0.0), 3
        else:  # D is constant: c * D folds into the intercept
            spread, b, c, params = cpp, cpt / cpp, 0.0, 2
        if b is None or b <= 0.0 or self.w <= params:
            return None
        residual = max(0.0, self.ctt - b * cpt - c * cdt) / (self.w - params)  # the noise variance per step
        if b * b * spread < self.min_t * self.min_t * residual:  # b within min_t standard errors of 0
            return None
        rate = 1.0 / b
        if not self.prior / self.max_ratio <= rate <= self.prior * self.max_ratio:
            return None
        return rate


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0  # by recompute + by swap
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_rejected: int = 0
    # the most device blocks used at once (``KVCacheManager.num_used_blocks``: evictable cached blocks are not
    # used): read once a step, after allocation and before finished requests free theirs (a pool read after the
    # step misses a request that came and went in it: --max-tokens 1 read 0)
    peak_used_blocks: int = 0


@dataclass
class TenantCounters:
    """Per-tenant counters, updated in O(1) per scheduled sequence (``LLMEngine.stats()["per_tenant"]``)."""

    prompt_tokens: int = 0  # prefill tokens computed (recomputation included: it is cost)
    output_tokens: int = 0
    preemptions: int = 0
    rejected: int = 0
    finished: int = 0
    queue_time_s: float = 0.0  # summed over finished requests: first scheduled - arrival
    ttft: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES_KEPT))
    itl: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES_KEPT))
    _percentiles: dict | None = None  # cached by latency_percentiles(); reset when a request finishes

    def record_finished(self, req: Request) -> None:
        """A finished request's latency samples (the newest kept in bounded deques) and its queue time."""
        self.finished += 1
        self._percentiles = None
        if req.first_scheduled_time is not None:
            self.queue_time_s += req.first_scheduled_time - req.arrival_time
        if req.first_token_time is not None:
            self.ttft.append(req.first_token_time - req.arrival_time)
            times = req.token_times
            self.itl.extend(b - a for a, b in zip(times, times[1:]))

    def latency_percentiles(self) -> dict[str, float | None]:
        """TTFT and ITL p50/p95 (nearest rank, seconds; None before the first sample), sorted once per change
        rather than once per ``stats()`` call."""
        if self._percentiles is None:
            self._percentiles = {
                "ttft_p50_s": nearest_rank(self.ttft, 50, None), "ttft_p95_s": nearest_rank(self.ttft, 95, None),
                "itl_p50_s": nearest_rank(self.itl, 50, None), "itl_p95_s": nearest_rank(self.itl, 95, None),
            }
        return self._percentiles


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        admission_policy: AdmissionPolicy | None = None,
        preemption_policy: PreemptionPolicy | None = None,
        costs: PreemptionCostModel | None = None,
        caps: CapTable | None = None,
        batch_builder: BatchBuilder | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.admission_policy = admission_policy or FCFSAdmission()
        self.preemption_policy = preemption_policy or RecomputeLatestPreemption()
        self.costs = costs
        self.caps = caps if caps is not None and caps.active else None
        self.batch_builder = batch_builder  # step 2 done by someone else (see build_batch); None: the scheduler's
        pol = self.admission_policy
        # the policy's optional protocols (minivllm.interfaces), asked once: the hot paths test for None
        self._rank = pol.rank if implements(pol, RanksRequests) else None
        self._may_preempt_for = (pol.may_preempt_for if self._rank is not None and implements(pol, PreemptsToAdmit)
                                 else None)
        self._observe = pol.observe if implements(pol, ObservesSteps) else None
        self._activity = pol.activity if implements(pol, TracksActivity) else None
        self._hol_per_tenant = implements(pol, HeadOfLine) and pol.head_of_line == "tenant"
        self.waiting: deque[Request] = deque()
        self._keeps_order = pol if implements(pol, KeepsOrder) else None  # told of every change to ``waiting``
        if self._keeps_order is not None:
            pol.track(self.waiting)
        # The tenants admission passes over for the rest of the pass it is in (its ``blocked`` and ``cap_closed``):
        # none outside a pass (see _computed_if_admitted)
        self._passed_over: tuple[Collection[str], ...] = ()
        if implements(pol, ReadsCachedPrefixes):
            pol.read_cached_prefixes(self._computed_if_admitted)
        # requests in ``waiting`` per tenant, kept by every change to the queue (the step log reads it each step)
        self.waiting_by_tenant: dict[str, int] = {}
        # With caps: each waiting request's cap blocks (fixed while it waits), and per tenant how many wait
        # needing each count.  Admission reads a need here instead of working it out again every step, and the
        # smallest need tells it when none of a tenant's waiting requests can pass a cap that one just failed.
        self._waiting_need: dict[Request, int] = {}
        self._needs_by_tenant: dict[str, Counter[int]] = {}
        # The same for the waiting requests that could start on cached blocks: each one's share key
        # (KVCacheManager.share_key, fixed while it waits), and per (tenant, key) how many wait needing each count.
        # Admission reads them to tell which requests a cap failure stands for (see _share_class).
        self._waiting_key: dict[Request, int] = {}
        self._needs_by_key: dict[tuple, Counter[int]] = {}
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.tenant_stats: dict[str, TenantCounters] = {}
        self._tenants_added: set[str] = set()  # every tenant a request was added for (one: observe's fast path)
        self._preempted_last_step = False
        self._rejected: list[Request] = []
        self._cap_rejected: set[Request] = set()  # rejected by a tenant cap (their hint: cap_retry_steps)
        self._admission_preempted: list[Request] = []
        self._swapped_in: list[Request] = []  # swapped in by admission since the last batch was built
        self._held: GroupBlocks | None = None  # during allocate: KV blocks held per cap group

    def tenant(self, name: str) -> TenantCounters:
        ts = self.tenant_stats.get(name)
        if ts is None:
            ts = self.tenant_stats[name] = TenantCounters()
        return ts

    # -- queue management ----------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)
        self._count_waiting(req, 1)
        self._tenants_added.add(req.tenant)

    def _count_waiting(self, req: Request, delta: int, at_front: bool = False) -> None:
        """Keep :attr:`waiting_by_tenant` (tenants with nobody waiting are dropped) as ``req`` enters or leaves,
        with caps the needs admission reads (a waiting request's tokens do not change until it runs), and a
        policy's kept order (:class:`~minivllm.interfaces.KeepsOrder`).  Every change to ``waiting`` calls this."""
        if self._keeps_order is not None:
            if delta > 0:
                self._keeps_order.enqueued(req, at_front)
            else:
                self._keeps_order.dequeued(req)
        counts = self.waiting_by_tenant
        n = counts.get(req.tenant, 0) + delta
        if n:
            counts[req.tenant] = n
        else:
            del counts[req.tenant]
        if self.caps is None:
            return
        if delta > 0:
            need = self._waiting_need[req] = self._need_blocks(req)
            self._count_need(self._needs_by_tenant, req.tenant, need)
            key = self.kv.share_key(req)
            if key is not None:
                self._waiting_key[req] = key
                self._count_need(self._needs_by_key, (req.tenant, key), need)
        else:
            need = self._waiting_need.pop(req)
            self._uncount_need(self._needs_by_tenant, req.tenant, need)
            key = self._waiting_key.pop(req, None)
            if key is not None:
                self._uncount_need(self._needs_by_key, (req.tenant, key), need)

    @staticmethod
    def _count_need(table: dict, at, need: int) -> None:
        """One more waiting request needing ``need`` blocks, counted in ``table[at]`` (no Counter built for a
        table that has one: ``setdefault`` would build one on every call)."""
        needs = table.get(at)
        if needs is None:
            needs = table[at] = Counter()
        needs[need] += 1

    @staticmethod
    def _uncount_need(table: dict, at, need: int) -> None:
        """One request needing ``need`` blocks left the waiting requests counted in ``table[at]``."""
        needs = table[at]
        needs[need] -= 1
        if not needs[need]:
            del needs[need]
            if not needs:  # like waiting_by_tenant: a server that saw many tenants keeps no empty tables
                del table[at]

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
            self._count_waiting(req, -1)
        self.kv.free(req)

    def _chunk_cap(self, req: Request) -> int:
        """Most tokens one request may take in a step."""
        threshold = self.config.long_prefill_token_threshold
        remaining = req.num_uncomputed_tokens
        if threshold and remaining > 1:
            return min(remaining, threshold)
        return remaining

    def _running_demand(self) -> int:
        return self._demand(self.running)

    def _demand(self, reqs) -> int:
        """Tokens ``reqs`` will take this step (a capped group's share counted at most up to its cap)."""
        if self.caps is None:
            # _chunk_cap written out in one loop: admission asks this every step a request waits.
            threshold = self.config.long_prefill_token_threshold
            total = 0
            for r in reqs:
                rest = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
                total += rest if not threshold or rest <= threshold else threshold
            return total
        return self._capped_total(*self._tally(reqs, 0, {}))

    def _tally(self, reqs, total: int, grouped: dict) -> tuple[int, dict]:
        """``reqs``' tokens this step (:meth:`_chunk_cap` each) added to ``total`` (a request outside every group
        with a per-step token cap) or to ``grouped`` (in place: key -> ``[tokens, cap]`` of its first such group)."""
        groups = self.caps.groups if self.caps is not None else None
        for r in reqs:
            c = self._chunk_cap(r)
            g = next((g for g in groups(r) if g.max_tokens is not None), None) if groups is not None else None
            if g is None:
                total += c
            elif g.key in grouped:
                grouped[g.key][0] += c
            else:
                grouped[g.key] = [c, g.max_tokens]
        return total, grouped

    @staticmethod
    def _capped_total(total: int, grouped: dict) -> int:
        """What :meth:`_tally` counted, each group's tokens counted at most up to its cap."""
        return total + sum(min(tokens, cap) for tokens, cap in grouped.values())

    def _admission_budget(self, p: _AdmissionPass, req: Request) -> int:
        """Token budget left for ``req`` under a ranking policy: every running decode but only the running
        prefills ranked at or ahead of it count.

        The decodes' tokens are tallied once per pass (``p.decodes``), the prefills listed (``p.prefills``), both in
        ``running`` order and kept by ``_seat`` (a pass only appends to ``running``; a preemption drops them, to be
        counted again): a running request's tokens, decode or not, do not change within a pass (nothing computes in
        it), so the sum is the very one a recount of ``running`` makes -- against ~250 decodes a lab-6 step, per
        request tried.  Only the prefills' ranks are asked, as a recount asks them (a decode never is)."""
        if p.decodes is None:
            p.prefills = [r for r in self.running if not r.is_decode]
            p.decodes = self._tally([r for r in self.running if r.is_decode], 0, {})
        key = self._rank(req)
        total, grouped = p.decodes
        ahead = [r for r in p.prefills if self._rank(r) <= key]
        if ahead:
            total, grouped = self._tally(ahead, total, {k: v[:] for k, v in grouped.items()})
        return self.config.max_num_batched_tokens - self._capped_total(total, grouped)

    # -- caps -----------------------------------------------------------------
    def _need_blocks(self, req: Request) -> int:
        """Blocks ``req`` counts against its KV caps when admitted (its tokens so far, or its worst case): its *fixed*
        need, the cheap first check of :meth:`_cap_verdict`.

        All of them, a cached prefix its group already holds included (admission would share those blocks, and
        its group would gain none): the count is fixed while ``req`` waits, so it is worked out once, when ``req``
        enters the queue, and one failed check can stand for later requests needing as many (``cap_failed``,
        ``cap_closed``).  Only when it fails -- on KV caps alone, or beside a group of ``req``'s that rejects -- is
        the held prefix taken off (:meth:`_cap_check`, :meth:`_cap_needs`), so a request that fits once its shared
        blocks are left out is admitted -- and, under ``over_cap="reject"``, not turned away.  Once it runs, its
        group is charged its distinct blocks exactly (``_seat``, ``_group_usage``)."""
        if self.config.preemption_mode == "reject":
            return blocks_for(req.max_total_tokens, self.kv.block_size)
        return blocks_for(req.num_tokens, self.kv.block_size)

    def _group_usage(self) -> tuple[dict[tuple, GroupUsage], GroupBlocks]:
        """Per cap group key: its :class:`~minivllm.sched.fairness.GroupUsage` (running requests, blocks held +
        reserved, tokens this step), and the
        :class:`~minivllm.kv.sharing.GroupBlocks` that counts the held blocks (a block two members share
        once, as the tenant gauges count it).  Recounted from ``running`` at each pass (then kept by ``_seat``
        as the pass seats requests), like :meth:`_group_held`: finishes, aborts and preemptions between passes all change
        it, and a count rebuilt here cannot drift.

        A member charged the copy of its shared last block gains its group no block when it is the group's last
        holder to write there (:meth:`~minivllm.kv.sharing.GroupBlocks.in_place_writes`): a leader and its samples
        on one partly filled block are charged one copy fewer than their number, as admission charged them (a copy
        per sample).  Only a request with a reservation can be charged a copy, and only while blocks are shared."""
        held = self._group_held()
        usage: dict = {}
        writers: dict = {}  # group -> members charged a copy of their last block (only just after a fork)
        shared = self.kv.may_share()
        for r in self.running:
            blocks, tokens, groups = self._reservation(r), self._chunk_cap(r), self.caps.groups(r)
            for g in groups:
                u = usage.get(g.key)
                if u is None:
                    u = usage[g.key] = GroupUsage(0, held.count[g.key], 0)
                u.seats += 1
                u.blocks += blocks
                u.tokens += tokens
            if blocks and shared and self.kv.num_copy_on_write_blocks(r):
                for g in groups:
                    writers.setdefault(g.key, []).append(r)
        for key, members in writers.items():
            usage[key].blocks -= held.in_place_writes(key, members)
        return usage, held

    def _cap_failure(self, req: Request, usage: dict[tuple, GroupUsage], needs: tuple[int, ...],
                     per_step: bool = True) -> str | None:
        """Which of ``req``'s caps it would break if admitted needing ``needs`` (one count per group, in
        ``caps.groups(req)`` order): None, none of them; ``"kv"``, KV caps alone, each of which a smaller need could
        pass (its exact need may: :meth:`_cap_check`); ``"full"``, a cap no request of the group could pass in this
        pass -- its seats taken, its step's tokens used, or its KV blocks at the cap or over it.  At the cap exactly
        is full too: every exact need is at least one block (:meth:`_cap_needs` takes off only blocks of all but
        the last token, and the fixed need covers every token), so no lookup there could pass, and each failure
        there would cost one and leave the tenant open for the next of its share classes to fail alike.  Monotone: with
        ``usage`` unchanged, a request of the same tenant needing as many blocks or more fails too (``admit``'s
        shortcuts rest on it).  ``per_step=False`` leaves out the per-step token cap: a sample waiting for its
        leader's prefill (``admit``'s held seats) would pass it next step, once the leader's own chunks stop
        filling it."""
        kv = False
        for g, need in zip(self.caps.groups(req), needs, strict=True):
            u = usage.get(g.key, NO_USAGE)
            if per_step and g.max_tokens is not None and u.tokens >= g.max_tokens:
                return "full"
            if g.would_exceed(u.seats, u.blocks, need):
                if g.would_exceed(u.seats, u.blocks, 1):  # (the least exact need: see above)
                    return "full"
                kv = True
        return "kv" if kv else None

    def _cap_needs(self, req: Request, need: int, held: GroupBlocks,
                   prefix: Sequence[int] | None = None) -> tuple[int, ...]:
        """``req``'s exact need per cap group (``caps.groups(req)`` order): its fixed need ``need``
        (:meth:`_need_blocks`) less the blocks of its cached prefix that the group's members in ``held`` hold --
        admission shares those, so the group gains none of them.  The one charge admission (:meth:`_cap_check`), a
        sample's held seat (:meth:`_keeps_a_seat`) and the 429 retry hint (:meth:`cap_retry_steps`) make.  Found
        by a lookup that leaves the cache as it was
        (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.held_prefix_blocks`); ``prefix``, that lookup's blocks
        when the caller already has them and the cache has not changed since."""
        return tuple(need - n for n in self.kv.held_prefix_blocks(req, held, self.caps.keys(req), prefix))

    def _cap_check(self, p: _AdmissionPass, req: Request, need: int, per_step: bool = True,
                   exact_needs: bool = True) -> tuple[str | None, tuple[int, ...]]:
        """``(failure, needs)``: what :meth:`_cap_failure` says of ``req`` in this pass, and the needs it was
        charged.  The fixed need ``need`` first, one lookup-free check; only when it fails -- on KV caps alone (a
        smaller need may pass), or beside a group of ``req``'s that rejects (which must not turn it away for
        blocks it would share, whichever cap fails) -- and ``req`` could start on cached blocks (it has a share
        key) is its exact need asked (:meth:`_cap_needs`), and checked again if KV caps alone failed.
        ``exact_needs=False``: the caller reads only the failure, so a failure other than ``"kv"`` (which no exact
        need can lift) is not looked up beside a rejecting group either."""
        needs = (need,) * len(self.caps.keys(req))
        failure = self._cap_failure(req, p.usage, needs, per_step)
        if failure is None or req not in self._waiting_key or failure != "kv" and not (
                exact_needs and self.caps.may_reject(req)):
            return failure, needs
        exact = self._cap_needs(req, need, p.held)
        if failure == "kv" and exact != needs:
            failure = self._cap_failure(req, p.usage, exact, per_step)
        return failure, exact

    def _cap_budget(self, req: Request, usage: dict[tuple, GroupUsage], budget: int) -> int:
        """``budget`` cut to what ``req``'s groups' per-step token caps leave: step 2 gives it no more, so admitting
        it on more would take blocks for tokens that get no row (or, chunked prefill off, a prompt that never
        fits)."""
        for g in self.caps.groups(req):
            if g.max_tokens is not None:
                budget = min(budget, g.max_tokens - usage.get(g.key, NO_USAGE).tokens)
        return budget

    def _preempt_to_admit(self, req: Request, admitted: list[Request]) -> bool:
        """Preempt one running request the policy ranks below ``req`` (never one protected by anti-thrash;
        never in reject mode, whose promise is that nothing running is preempted -- ``req`` is turned away)."""
        if self._may_preempt_for is None or self.config.preemption_mode == "reject":
            return False
        limit = self.config.preemption_protect_after
        # (never a sample's own leader: gone, it would take the sample's start with it -- the sample then starts
        # alone on its whole prompt, the group trading one of its sequences for another)
        cands = [r for r in self.running if r not in admitted and (not limit or r.num_preemptions < limit)
                 and r is not req.leader and self._may_preempt_for(req, r)]
        if not cands or not self._victims_could_make_room(req, cands):
            return False
        victim = self._choose_victim(cands)
        self._preempt(victim)
        self._admission_preempted.append(victim)
        return True

    def _victims_could_make_room(self, req: Request, cands: list[Request]) -> bool:
        """Would preempting *every* candidate leave blocks enough for ``req``?  Asked before each victim goes.

        Preempting throws a victim's KV away (or swaps it out); if ``req`` is still not admitted at the end,
        nobody gained.  Seats are no question (one victim frees one) and the token budget is never a reason
        to preempt (see :meth:`admit`); the blocks are: the bound freed blocks minus what the requests left
        running will still claim, against the blocks ``req`` would take
        (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.could_start_if_freed`, which weighs the start
        admission would make).  A sample of an ``n > 1`` request that can fork from its leader needs only a
        block -- the copy of the partly filled block it shares, or a new one -- but even that block may not be
        there: with the pool dry and the requests left running claiming what the victims give back, a preemption
        "always worth trying" for a sample seated nobody (a random search, priority policy, swap mode).  So a
        sample is bounded like any request, by what its fork really takes; a swapped-out or recomputed one by
        its swapped blocks or its outputs as well.

        What those left claim is counted as if the candidates' references were gone
        (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.claims_as_they_leave`), not from the refcounts as they
        stand: a sample forked earlier in this pass is no candidate (admitted in this pass), and once its leader
        goes it writes into the block they shared in place -- counted as a copy, a preemption of the leader that
        had room was refused.  (``req``'s own leader is never a candidate: :meth:`_preempt_to_admit`.)  (Asked only
        when a request finds no room and may preempt: one pass over the running requests and the candidates'
        tables, as :meth:`_reserved_blocks` and ``could_start_if_freed`` already take.)
        """
        # (what is left claims its next tokens, not its worst case: only reject mode reserves that, and it never
        # preempts -- :meth:`_preempt_to_admit` returns before asking)
        *_, (left, _) = self.kv.claims_as_they_leave(self.running, cands)
        return self.kv.could_start_if_freed(req, cands, left)

    def _reserved_blocks(self, running: list[Request] | None = None) -> int:
        """Blocks the running requests (or ``running``) will claim: the rest of their prefill, or (reject mode)
        their worst case, and the copies their next writes make -- one fewer per shared block than its holders
        when all of them write there (not :meth:`_reservation` summed: see :func:`~minivllm.kv.sharing.copies_made`)."""
        running = self.running if running is None else running
        return self.kv.num_new_blocks_all(running, worst_case=self.config.preemption_mode == "reject")

    # -- step 1: admit -------------------------------------------------------
    def _computed_if_admitted(self, req: Request) -> int:
        """What a policy that reads cached prefixes is told of ``req`` (:class:`ReadsCachedPrefixes`): the KV
        manager's :meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.computed_if_admitted` -- unless admission has
        passed ``req``'s tenant over for the rest of this pass (its head could not start, or none of its requests
        can pass its caps), when nothing is looked up and 0 is said.

        Why: WFQ asks for every request it hands out, and a tenant whose caps hold it back falls behind the others'
        counters, so each pass hands out its backlog up to that deficit -- all of it skipped.  Looked up, each cost
        a walk of the prompt's blocks (a 512-token prompt: ~7 us), a cost that grew with the deficit as long as the
        cap held.  What such a request is charged here orders only its own tenant's later requests, which this
        pass skips as well, so no request that can start is ordered otherwise (unless a preemption gives cap room
        back and reopens the tenant within the pass: its later requests then rank behind those passed-over ones'
        whole prompts, as every request did before cached prefixes were counted).
        """
        for tenants in self._passed_over:
            if req.tenant in tenants:
                return 0
        return self.kv.computed_if_admitted(req)

    def admit(self) -> list[Request]:
        """Move waiting requests into ``running`` while seats, budget and blocks allow (the pass: :meth:`_admit`).

        Nothing is admitted in a step right after a preemption made while
        allocating, whatever the victim had computed: the pool is full, and
        admitting would only preempt again (thrash).  (``allocate`` clears the
        flag first, so a preemption made here, to seat a better-ranked request,
        does not pause admission.)
        """
        try:
            return self._admit()
        finally:
            self._passed_over = ()  # (a policy asked outside a pass looks every request up)

    def _admit(self) -> list[Request]:
        """The pass :meth:`admit` runs (there, what it does and why): the policy's order walked once, each request
        skipped, held back by its caps, seated, turned away, or the end of the pass."""
        if (self._preempted_last_step or not self.waiting
                or len(self.running) >= self.config.max_num_seqs and self._may_preempt_for is None and self.caps is None):
            # The last clause: every seat is taken and no policy may free one, so nothing below could admit or
            # reject anyone (with caps it could: an over-cap request is rejected whatever the seats).  Returning
            # here keeps a saturated step from walking the waiting queue.
            if self._activity is not None:  # no ordering this step: tell the policy who is still active
                self._activity(self.waiting_by_tenant.keys() | {r.tenant for r in self.running})
            return []
        p = self._start_pass()
        blocked, cap_closed, admitted, caps = p.blocked, p.cap_closed, p.admitted, self.caps
        for req in self._order_for_pass():
            if not isinstance(req, Request):
                raise ValueError(self._not_an_order(req))
            if req.tenant in blocked or req.tenant in cap_closed or req.status is RequestStatus.FINISHED_REJECTED:
                continue  # (rejected in this pass together with its group's leader)
            if req.status is RequestStatus.RUNNING and req in admitted:
                continue  # listed twice, and admitted the first time
            if req.leader is not None and not self._leader_ready(req):
                if self._keeps_a_seat(p, req):
                    p.held_seats += 1
                continue
            if caps is not None:
                verdict = self._cap_verdict(p, req)
                if verdict is not _TRY:
                    if verdict is _STOP:
                        break
                    continue
            elif not p.trusted and req not in self.waiting:  # (by identity, in C; the removal in _seat scans as far)
                raise ValueError(self._not_an_order(req))
            if p.victim_rank and self._behind_a_victim(p, req):
                if not self._hol_per_tenant:
                    break  # it waits behind a victim, which cannot start again in this pass: the head of the line
                blocked.add(req.tenant)  # its tenant's head is a victim, which cannot start again in this pass
                if self._all_passed_over(blocked, cap_closed):
                    break
                continue
            fit, short_of_kv = self._fit_or_make_room(p, req)
            if fit is not None:
                self._seat(p, req, fit)
            elif short_of_kv and self._should_reject(req):  # (not short of budget: that is back next step)
                self._reject(req)
            elif not self._hol_per_tenant:
                break
            else:
                blocked.add(req.tenant)
                if self._all_passed_over(blocked, cap_closed):
                    break  # the rest of the order is passed over too
        return admitted

    def _start_pass(self) -> _AdmissionPass:
        """A fresh :class:`_AdmissionPass`, counted from ``running`` as it stands; its passed-over tenants are
        published (:meth:`_computed_if_admitted` reads them) before the policy is asked for its order."""
        if self.caps is not None:
            usage, held = self._group_usage()
        else:
            usage, held = None, None
        reserved = self._reserved_blocks()
        unranked_budget = self.config.max_num_batched_tokens - self._running_demand() if self._rank is None else 0
        p = _AdmissionPass(usage, held, reserved, unranked_budget, trusted=self._keeps_order is not None)
        self._passed_over = (p.blocked, p.cap_closed)
        return p

    def _order_for_pass(self) -> Iterator:
        """The admission policy's order for this pass, as an iterator: an answer that is not iterable is refused
        here, at the boundary (:meth:`_not_an_order`); what it yields is checked as the pass reaches it."""
        if self._keeps_order is not None:  # a policy that keeps its order recognises the queue itself, and reads it only
            order = self.admission_policy.order(self.waiting, self.running)
            if order is self.waiting:  # it may hand the queue back ("all of them, as they are"),
                order = list(order)  # which admission changes while it walks the order
        else:  # any other policy gets copies (lists, as a lab's checker gives it): one that pops what it was
            order = self.admission_policy.order(list(self.waiting), list(self.running))  # handed loses no request
        try:
            return iter(order)
        except TypeError:
            raise ValueError(self._not_an_order(order)) from None

    def _keeps_a_seat(self, p: _AdmissionPass, req: Request) -> bool:
        """Does ``req``, a sample whose leader has not finished its prefill, keep a seat in this pass?

        n > 1: a sibling sample forks once its leader has prefilled the prompt.  Under a global head of line it
        keeps a seat meanwhile: a request ranked behind it must not take the seat it will need in a step or two
        (the deadline policy's aging bound, FCFS's order), only the room it leaves.  Caps come first: a sample its
        tenant's cap holds back could not use the seat, so it keeps none.  It is charged what admission will charge
        it (:meth:`_cap_check`): the blocks of its prompt its group already holds -- the cached prefix its leader
        has prefilled so far, or a system prompt its tenant runs on -- are free, so a sample that will fit keeps
        its seat, and one whose whole prompt would not fit is not left seatless while a later request takes it."""
        return (not self._hol_per_tenant and req.leader.status is RequestStatus.RUNNING
                and (self.caps is None
                     or self._cap_check(p, req, self._waiting_need[req], per_step=False, exact_needs=False)[0] is None))

    def _cap_verdict(self, p: _AdmissionPass, req: Request) -> str:
        """What ``req``'s caps say in this pass: :data:`_TRY` it (it is within them), :data:`_SKIP` it (it waits
        behind its tenant's or class's cap, or a reject-cap turned it away here), or :data:`_STOP` the pass
        (every tenant still waiting is now passed over).

        Charged as :meth:`_cap_check` says: the fixed need (:meth:`_need_blocks`) first, its exact need (less the
        blocks of its cached prefix each group already holds) only when that fails on KV caps alone or beside a
        group that rejects.  A request its tenant's failure in this pass already stands for
        (:meth:`_close_on_failure`) is skipped before either."""
        need = self._waiting_need.get(req)  # (exactly the waiting requests have one)
        if need is None:
            raise ValueError(self._not_an_order(req))
        failed = p.cap_failed.get(req.tenant)
        if failed and need >= failed.get(self._share_class(p, req), need + 1):
            return _SKIP  # as over its caps as a request of its tenant and class that already failed them
        failure, needs = self._cap_check(p, req, need)
        if failure is None:
            return _TRY
        if req.status is RequestStatus.WAITING and req.leader is None and self.caps.rejecting_group(req, p.usage, needs):
            self._reject(req)  # TenantConfig(over_cap="reject"): turned away with a retry hint
            self._cap_rejected.add(req)
        elif not self.caps.may_reject(req) and self._close_on_failure(p, req, need, needs, failure):
            return _STOP  # the rest of the order is passed over too
        return _SKIP  # its tenant (or class) is at a cap: it waits, the others do not

    def _share_class(self, p: _AdmissionPass, req: Request):
        """Which waiting requests of its tenant a cap failure of ``req`` stands for: its share key
        (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.share_key`, its namespace and first block) when a prefix
        its groups hold starts with that key, else None (it shares no held block, and neither does any request
        classed None).

        The rule, and why it is sound.  A request of class None is charged its fixed need exactly, so its failure
        stands for every later request of class None of its tenant needing as many blocks: those need as much and
        share as little.  A failure of a request that shares held blocks stands only for requests with its key
        (those start on the same cached prefix); a request with another key shares other blocks or none, and is
        checked itself.  Seating a request in the pass adds to its group's usage at least the blocks a waiting
        request could newly share through it (the seated request's gain), so a failure stays a failure for the
        rest of the pass; only a preemption made in the pass reopens it (``_after_admission_victim``).

        The residual gap: two requests with one key may still share unequal amounts -- a retry or a continuation of
        a running request's prompt shares that request's own cached blocks too, past the system prompt the other
        shares.  A failure of the one that shares less stands for the one that shares more if it needs as many
        blocks, so the latter waits in that pass where the exact need would have seated it, as every request did
        when the cap charged whole prompts.  Closing that gap needs a lookup per waiting request (beside a
        backlog of 1,500: ~1,500 walks of the cache a step), the cost these shortcuts exist to avoid."""
        key = self._waiting_key.get(req)
        if key is None:
            return None
        return key if key in self._sharing_keys(p, req) else None

    def _sharing_keys(self, p: _AdmissionPass, req: Request) -> set:
        """The share keys of the cached prefixes ``req``'s groups hold (``p.sharing``, per tenant: a tenant's
        requests count in the same groups), asked of the KV manager once per tenant per pass.  (Every group's
        blocks, not only a KV-capped group's: a key too many only sends a request to its own check.)"""
        keys = p.sharing.get(req.tenant)
        if keys is None:
            held = [p.held.blocks(k) for k in self.caps.keys(req)]
            keys = p.sharing[req.tenant] = self.kv.prefix_keys_holding(chain.from_iterable(held))
        return keys

    def _close_on_failure(self, p: _AdmissionPass, req: Request, need: int, needs: tuple[int, ...],
                          failure: str) -> bool:
        """Record that ``req`` (needing ``need`` fixed blocks, charged ``needs``) failed its caps (``failure``, as
        :meth:`_cap_failure` says): it stands for later requests of its tenant and share class needing as many
        (``p.cap_failed``); the tenant closes (``p.cap_closed``) once each of its classes with waiting requests
        failed at its smallest need -- or at once when a cap failed that no request of it could pass (``"full"``).
        Returns whether every tenant still waiting is now passed over."""
        tenant = req.tenant
        if failure != "full":
            # its class: its key when its exact need took a held prefix off (a prefix its groups hold starts with
            # its key, known without a lookup), else as _share_class says
            cls = self._waiting_key[req] if min(needs) < need else self._share_class(p, req)
            failed = p.cap_failed.setdefault(tenant, {})
            failed[cls] = need
            if not all(failed.get(c, m + 1) <= m for c, m in self._class_minima(p, req, cls).items()):
                return False
        p.cap_closed.add(tenant)
        return self._all_passed_over(p.blocked, p.cap_closed)

    def _class_minima(self, p: _AdmissionPass, req: Request, cls) -> dict:
        """Per share class of ``req``'s tenant with waiting requests, the fewest blocks one of them needs (its fixed
        need).  ``cls`` is ``req``'s class; when every waiting request of its tenant has ``req``'s share key, that
        is the only class, and no held prefix is asked about.  Read from the per-tenant and per-key counts the
        queue keeps (``_count_waiting``): a few distinct needs each, however long the backlog."""
        tenant = req.tenant
        rest = self._needs_by_tenant[tenant]
        key = self._waiting_key.get(req)
        if key is None and not self._waiting_key:
            return {None: min(rest)}
        if key is not None and sum(self._needs_by_key[(tenant, key)].values()) == self.waiting_by_tenant[tenant]:
            return {cls: min(rest)}
        minima, keyed = {}, []  # (the keyed counts are taken off the tenant's where read: no copy of its Counter)
        for k in self._sharing_keys(p, req):
            needs = self._needs_by_key.get((tenant, k))
            if needs:
                minima[k] = min(needs)
                keyed.append(needs)
        unkeyed = min((n for n, count in rest.items()  # (class None: what is left once the keyed are taken off)
                       if count > sum(needs.get(n, 0) for needs in keyed)), default=None)
        if unkeyed is not None:
            minima[None] = unkeyed
        return minima

    def _fit_or_make_room(self, p: _AdmissionPass, req: Request) -> tuple[tuple[int, int] | None, bool]:
        """``(fit, short_of_kv)``: ``fit`` is :meth:`_try_admit`'s ``(tokens, blocks)`` once ``req`` fits, after
        preempting worse-ranked requests one at a time while the policy allows it and it could help; else None,
        and ``short_of_kv`` says whether it was KV blocks it lacked (reject mode turns such a request away) rather
        than a seat or this step's token budget (it waits)."""
        while True:
            budget = p.unranked_budget if self._rank is None else self._admission_budget(p, req)
            if self.caps is not None:
                budget = self._cap_budget(req, p.usage, budget)
            seated = len(self.running) + p.held_seats < self.config.max_num_seqs
            # Preemption cannot help with these: the token budget (the victims' own tokens this step,
            # one per decode, rarely cover it, and it comes back next step anyway), and a swap-in in the
            # step that swapped a victim out (its blocks are not back until the copy-out ran).
            # Nor with a seat that a sample ranked ahead holds: the seat a victim frees would be the sample's.
            stuck = (budget <= 0 or (p.swapped_out and req.status is RequestStatus.SWAPPED)
                     or (p.held_seats > 0 and not seated))
            fit = self._try_admit(req, budget, p.reserved) if seated and not stuck else None
            if fit is _SHORT_OF_BUDGET:  # its whole prompt is over the budget left (no chunking): as above
                fit, stuck = None, True
            if fit is not None or stuck or not self._preempt_to_admit(req, p.admitted):
                return fit, seated and not stuck
            self._after_admission_victim(p)

    def _behind_a_victim(self, p: _AdmissionPass, req: Request) -> bool:
        """Is ``req`` ranked behind a victim this pass preempted -- any victim under a global head of line, one of
        its own tenant under a per-tenant one (see :attr:`_AdmissionPass.victim_rank`)?"""
        best = p.victim_rank.get(req.tenant if self._hol_per_tenant else None)
        return best is not None and self._rank(req) > best

    def _after_admission_victim(self, p: _AdmissionPass) -> None:
        """A running request was just preempted to seat another: what the rest of the pass must know of it."""
        victim = self._admission_preempted[-1]
        p.swapped_out |= victim.status is RequestStatus.SWAPPED
        key, rank = (victim.tenant if self._hol_per_tenant else None), self._rank(victim)
        best = p.victim_rank.get(key)
        if best is None or rank < best:
            p.victim_rank[key] = rank
        p.reserved = self._reserved_blocks()
        p.decodes = None  # (the victim's tokens leave the budget's tally)
        if self.caps is not None:
            p.usage, p.held = self._group_usage()  # a victim gave its share back: earlier cap failures may pass
            p.cap_failed.clear()
            p.cap_closed.clear()
            p.sharing.clear()  # (its blocks may no longer be held)

    def _seat(self, p: _AdmissionPass, req: Request, fit: tuple[int, int]) -> None:
        """Move ``req``, which fit, from ``waiting`` to ``running``, and count what it takes against the rest of
        the pass: its tokens, its reserved blocks, and (with caps) its groups' usage."""
        tokens, blocks = fit
        p.reserved += blocks
        p.unranked_budget -= tokens
        key = self._waiting_key.get(req) if p.sharing else None  # (p.sharing is empty without caps)
        if key is not None:  # it holds the prefix it started on now: its key may name held blocks (_share_class)
            for keys in p.sharing.values():
                keys.add(key)
        self.waiting.remove(req)
        self._count_waiting(req, -1)
        self.kv.record_admission(req)  # before the status changes: it tells a swap-in from a recompute
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        p.admitted.append(req)
        if p.decodes is not None:  # (kept as _admission_budget reads it)
            if req.is_decode:
                p.decodes = self._tally((req,), *p.decodes)
            else:
                p.prefills.append(req)
        if self.caps is not None:  # (a prefix it shares with its group's running requests adds no block)
            usage, reserved, chunk = p.usage, self._reservation(req), self._chunk_cap(req)
            for g, gained in zip(self.caps.groups(req), p.held.add(req)):
                u = usage.get(g.key)
                if u is None:
                    u = usage[g.key] = GroupUsage(0, 0, 0)
                u.seats += 1
                u.blocks += gained + reserved
                u.tokens += chunk

    def _not_an_order(self, answer) -> str:
        """What is wrong with an admission policy's ``answer`` (its order, or one item of it), said at the
        boundary as a batch builder's is: before anything is allocated for it, not as an error from deep in
        the KV manager.  A request is named by its id: a whole Request's repr would bury the message."""
        name = f"admission policy {type(self.admission_policy).__name__}.order returned"
        if not isinstance(answer, Request):
            return (f"{name} {_named(answer)}; it must return waiting requests (the Request objects it was given) in the "
                    f"order to try them, e.g. a list, or [] to admit no one this step")
        return (f"{name} {_named(answer)} ({answer.status.value}), which is not in the waiting queue "
                f"it was given; return only requests from that queue")

    def _choose_victim(self, candidates: list[Request]) -> Request:
        """The preemption policy's choice among ``candidates``, made on its own copy of them (one that removes
        its victim from the list it was offered leaves the scheduler's alone) and checked here, at the boundary."""
        victim = self.preemption_policy.choose_victim(list(candidates))
        if victim not in candidates:  # (by identity: a Request compares by identity)
            raise ValueError(f"preemption policy {type(self.preemption_policy).__name__}.choose_victim returned "
                             f"{_named(victim)}, which is not one of the {len(candidates)} running requests it was offered; "
                             f"return one of them")
        return victim

    def _all_passed_over(self, blocked: set[str], closed: set[str]) -> bool:
        """Is every tenant still waiting head-of-line ``blocked`` or ``closed`` by its caps in this pass?

        Then admission may stop walking its order: each request left in it would be skipped with one set
        lookup, and a backlog of thousands would cost thousands of lookups a step for nothing.
        """
        return self.waiting_by_tenant.keys() <= blocked | closed

    @staticmethod
    def _leader_ready(req: Request) -> bool:
        """A sample waits for its leader's prefill, unless the leader is gone (then it prefills alone)."""
        leader = req.leader
        if leader is None or leader.status.finished:
            return True
        return leader.num_computed_tokens >= leader.num_prompt_tokens

    def _try_admit(self, req: Request, budget: int, reserved: int) -> tuple[int, int] | object | None:
        """``(tokens this step, blocks to reserve)`` if ``req`` can start now, else None (nothing held) -- or
        :data:`_SHORT_OF_BUDGET` when, with chunked prefill off, its prefill (after any cached prefix) is more
        than ``budget``: a reason ``admit`` must not preempt for, unlike a lack of blocks."""
        kv = self.kv
        if req.status is RequestStatus.SWAPPED:
            tokens = min(self._chunk_cap(req), budget)
            # the swapped blocks plus the rest of its prefill, as any admission reserves (see _reservation)
            blocks = kv.num_new_blocks(req, req.num_uncomputed_tokens)
            if not kv.can_provide(reserved + blocks):
                return None
            kv.swap_in(req)
            self._swapped_in.append(req)
            return tokens, self._reservation(req)
        kv.share_computed(req)  # a sample forks from its leader, or takes its own cached blocks if they hold more
        want = self._chunk_cap(req)
        if not self.config.enable_chunked_prefill and want > budget:
            kv.free(req)
            return _SHORT_OF_BUDGET
        tokens = min(want, budget)
        blocks = self._reservation(req)
        if not kv.can_provide(reserved + blocks):
            kv.free(req)
            return None
        return tokens, blocks

    def _reservation(self, req: Request) -> int:
        """Blocks set aside for ``req`` at admission.

        Its whole remaining prefill, not just this step's chunk: a prompt
        admitted on the strength of its first chunk could run out of room
        halfway, and as the newest request it would preempt itself and throw
        its chunks away, again and again.  A sample just forked from its leader
        also needs the private copy of the last block they share; without it,
        the step that admits the sample would preempt it again.  One copy per
        sample, never one for the leader as well: whichever of the two writes
        first copies, and the other then holds the block alone.  So the recounts
        of what running requests claim (:meth:`_reserved_blocks`,
        :meth:`_group_usage`, the retry hints of a cap and of reject mode,
        :meth:`_victims_could_make_room`) do not sum this: ``k``
        holders of one partly filled block that all write there next make
        ``k - 1`` copies, and adding a sample adds exactly its one.  Reject mode
        sets aside the worst case (prompt + ``max_tokens``), so nothing running
        is ever preempted.
        """
        if self.config.preemption_mode == "reject":
            return self.kv.worst_case_new_blocks(req)
        return self.kv.num_new_blocks(req, req.num_uncomputed_tokens) + self.kv.num_copy_on_write_blocks(req)

    def _should_reject(self, req: Request) -> bool:
        """Reject mode: a request that found no room is turned away, unless it is already in flight.

        A sample of an ``n > 1`` request (one with a leader) is in flight once its group is: the group
        is accepted or turned away whole, at its leader, so a caller never gets some samples and a
        "rejected" for the others.  A sample that finds no room waits for running work to finish.
        Only a lack of KV rejects (``admit`` asks only then): a prompt short of this step's token budget waits
        for the next step, whose budget any prompt fits (the config checks that).
        """
        return self.config.preemption_mode == "reject" and req.status is RequestStatus.WAITING and req.leader is None

    def cap_retry_steps(self, req: Request) -> int | None:
        """Steps until the tenant cap that rejected ``req`` has room (None: a cap did not reject it).  ``req`` is
        charged what its rejection charged it, its exact need (:meth:`_cap_needs`), asked again as the group's
        members leave (:meth:`~minivllm.sched.fairness.CapTable.retry_steps`): while a member holds its cached
        prefix the prefix is free, once none does it is not.  The group's waiting requests, charged alike, are
        admitted before a re-sent ``req``, so the walk seats them first -- a sample of a running leader as the
        fork it will be: on the leader's blocks its start holds (the whole blocks of the tokens
        :meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.computed_if_admitted` says it starts with; the partly
        filled one it copies), each charged as a held prefix is.  The engine asks at the end of the step
        that turned ``req`` away, before the requests that finished in it leave: those are gone already."""
        if req not in self._cap_rejected:
            return None
        self._cap_rejected.discard(req)
        running = [r for r in self.running if not r.status.finished]
        # each request's fixed need and cached prefix, looked up once per hint: the walk asks again as members
        # leave, and nothing it does changes the cache (only which blocks the group holds)
        once: dict[Request, tuple[int, list[int]]] = {}
        size = self.kv.block_size

        def lookup(r: Request) -> tuple[int, list[int]]:
            got = once.get(r)
            if got is None:
                got = once[r] = self._need_blocks(r), self.kv.cached_prefix_blocks(r)
            return got

        def needs(r: Request, held, start=()) -> tuple[int, ...]:
            fixed, prefix = lookup(r)  # (a fork's start is counted in ``held`` while it is seated: all of it is held)
            return tuple(min(n, fixed - len(start)) for n in self._cap_needs(r, fixed, held, prefix))

        def forks(r: Request) -> list[int]:  # (a restarted sample may start on its own cached blocks instead)
            fork = self.kv.can_fork(r) and not r.output_token_ids
            return r.leader.block_ids[:self.kv.computed_if_admitted(r) // size] if fork else []

        return self.caps.retry_steps(req, running, needs,
                                     self._reservation, self.kv.may_share(), self.kv.num_copy_on_write_blocks,
                                     self.waiting, forks, reads=lambda r: lookup(r)[1]) or 1

    def _reject(self, req: Request) -> None:
        """Turn ``req`` away; a group's leader takes its waiting samples with it (all or none)."""
        group = [req]
        if req.parent_id is not None and req.leader is None:
            group += [r for r in self.waiting if r.leader is req]
        for r in group:
            self.waiting.remove(r)
            self._count_waiting(r, -1)
            r.status = RequestStatus.FINISHED_REJECTED
            self._rejected.append(r)
        self.stats.num_rejected += 1  # one request turned away, however many samples: the server's one 429
        self.tenant(req.tenant).rejected += 1

    # -- step 2: build the batch ---------------------------------------------
    def build_batch(self) -> ScheduledBatch:
        """Decode tokens first, then prefill chunks, never past the token budget.

        The sequences are finally put one-token rows first, the layout the
        attention backends expect (a stable sort, so decodes keep their order).
        A :attr:`batch_builder` replaces all of this (:meth:`_build_batch_by`).
        """
        if self.batch_builder is not None:
            return self._build_batch_by(self.batch_builder)
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch(rejected=self._rejected, preempted=self._admission_preempted)
        self._rejected = []
        self._admission_preempted = []
        self._hand_over_swap_ins(batch)
        caps = self.caps
        seqs = batch.seqs
        if caps is None:
            # Decodes take one token each, in running order, while the budget lasts: the hot path of a
            # decode step, so their rows are built in the pass that finds them, not in the general loop below.
            rows, prefills = Request.split_decodes(self.running, as_rows=ScheduledSeq)
            seqs += rows[:max(budget, 0)]
            budget -= len(seqs)
            decodes = []
        else:
            decodes, prefills = Request.split_decodes(self.running)
        num_decodes = len(seqs)  # the rows so far are all decodes (none yet with caps)
        num_prefill = 0
        if self._rank is not None:
            prefills.sort(key=self._rank)  # better-ranked prefills get the budget first
        first_prefill = len(seqs)
        used: dict = {}
        for req in decodes + prefills:
            if budget <= 0:
                break
            n = min(self._chunk_cap(req), budget)
            if caps is not None:
                for g in caps.groups(req):
                    if g.max_tokens is not None:
                        n = min(n, g.max_tokens - used.get(g.key, 0))
                if n <= 0:
                    continue  # its group used its tokens for this step
            if n < req.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            is_decode = req.is_decode
            seqs.append(ScheduledSeq(req, n, req.num_computed_tokens, is_decode))
            budget -= n
            if is_decode:
                num_decodes += 1
            else:
                num_prefill += n
            if caps is not None:
                for g in caps.groups(req):
                    if g.max_tokens is not None:
                        used[g.key] = used.get(g.key, 0) + n
        # One-token rows first.  Everything before ``first_prefill`` is a decode (one token), so only the
        # tail needs sorting; a stable sort keeps each part in scheduling order (decodes, scheduled first, lead).
        seqs[first_prefill:] = sorted(seqs[first_prefill:], key=lambda s: s.num_tokens != 1)
        batch.split = (num_prefill, num_decodes)
        return batch

    def _build_batch_by(self, builder: BatchBuilder) -> ScheduledBatch:
        """Step 2 by ``builder`` (a :class:`~minivllm.interfaces.BatchBuilder`), its answer checked here, at
        the boundary: a request that is not running, or is listed twice, a token count outside 1 .. its
        uncomputed tokens, or a total over the budget is a ``ValueError`` before anything is allocated (and
        before this step's rejections and preemptions are handed over: the next step still reports them)."""
        budget = self.config.max_num_batched_tokens
        running = set(map(id, self.running))
        seen: set[int] = set()
        seqs: list[ScheduledSeq] = []
        total = num_decodes = 0
        for req, n in builder(list(self.running), budget, self.config.long_prefill_token_threshold):
            if id(req) not in running or id(req) in seen:
                raise ValueError(f"build_batch returned {getattr(req, 'request_id', req)!r}, which is not "
                                 f"a running request or appears twice")
            if not 1 <= n <= req.num_uncomputed_tokens:
                raise ValueError(f"build_batch gave {req.request_id!r} {n} tokens; it has "
                                 f"{req.num_uncomputed_tokens} to compute (give 1 .. that many, or leave it out)")
            seen.add(id(req))
            total += n
            is_decode = req.is_decode
            num_decodes += is_decode
            seqs.append(ScheduledSeq(req, n, req.num_computed_tokens, is_decode))
        if total > budget:
            raise ValueError(f"build_batch scheduled {total} tokens, over the budget of {budget}")
        # One-token rows first (the attention backends' layout), decodes leading them (the step log counts them).
        seqs.sort(key=lambda s: (s.num_tokens != 1) + (not s.is_decode))
        batch = ScheduledBatch(seqs, preempted=self._admission_preempted, rejected=self._rejected,
                               split=(total - num_decodes, num_decodes))  # (a decode row is one token)
        self._rejected = []
        self._admission_preempted = []
        self._hand_over_swap_ins(batch)
        return batch

    def _hand_over_swap_ins(self, batch: ScheduledBatch) -> None:
        """Give ``batch`` the requests swapped in since the last batch was built: their copies in ride in its
        moves, so its execution is what they depend on (see :meth:`swap_in_failed`).  Handed over with this
        step's other admission results, and kept, like them, when a batch builder's answer is refused."""
        if self._swapped_in:  # (a step without a swap-in builds no list)
            batch.swapped_in, self._swapped_in = self._swapped_in, []

    # -- step 3: allocate ----------------------------------------------------
    def allocate(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Get KV blocks for every scheduled token, preempting when the pool is dry."""
        self._preempted_last_step = False
        self._held = self._group_held() if self.caps is not None else None
        preempted_before = len(batch.preempted)
        # Without KV caps only the sequences that need a new block (or a private copy of their last one)
        # can run the pool dry; the others fit their tables as they stand (15 of 16 decodes at block 16).
        # Of those, the ones whose blocks are all full get theirs off the free list in one loop, while it lasts.
        if self._held is not None:
            todo = batch.seqs
        else:
            todo = self.kv.grow_full_tables(self.kv.seqs_needing_blocks(batch.seqs))
        for seq in todo:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._held is not None and not self._fit_group_kv(req, seq.num_tokens, batch):
                continue  # it gave way to its own group's cap
            before, last = len(req.block_ids), req.block_ids[-1] if req.block_ids else None
            while not self.kv.allocate_slots(req, seq.num_tokens):
                victim = self._choose_victim(self._victim_candidates())
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if self._held is not None and req.status is RequestStatus.RUNNING and (
                    len(req.block_ids) != before or before and req.block_ids[before - 1] != last):  # (grew, or copied)
                self._held.grew(req, before, last)
        self._held = None
        if len(batch.preempted) > preempted_before:  # someone gave way: drop the victims' rows
            batch.seqs = [s for s in batch.seqs if s.request.status is RequestStatus.RUNNING]
            batch.split = None  # counted with the victims' rows: the survivors are counted when read
        batch.moves = self.kv.take_block_moves()
        self.stats.num_steps += 1
        self.stats.peak_used_blocks = max(self.stats.peak_used_blocks, self.kv.num_used_blocks)
        return batch

    def _group_held(self) -> GroupBlocks:
        """KV blocks held per cap group, a block two members share counted once (a tenant's requests behind one
        cached system prompt hold its blocks once, and its cap and its gauge say so alike).  Recounted from the
        tables where it is needed -- once per :meth:`allocate`, and by :meth:`_group_usage` at each admission pass
        (again after a preemption made in it) -- rather than kept across steps: admissions, finishes, aborts and
        failed steps all change what a group holds, and a count rebuilt here cannot drift; within the step
        ``allocate`` and ``_preempt`` keep it as tables change."""
        # (shared=True: an admission in the pass can make blocks shared)
        return GroupBlocks(self.running, self.caps.keys, shared_now=self.kv.may_share())

    def _fit_group_kv(self, req: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Make room under ``req``'s KV caps for ``num_tokens`` more tokens by preempting within each group.

        Returns False when ``req`` itself was the victim.  Terminates: a request
        whose worst case exceeds a cap is refused at ``add_request``, so alone in
        its group any request fits.
        """
        grow = self.kv.num_new_blocks(req, num_tokens)
        for g in self.caps.groups(req):
            if g.max_blocks is None:
                continue
            while True:
                over = self._held.count.get(g.key, 0) + grow - g.max_blocks
                # At the cap exactly, a copy of its shared last block (made before it writes) would pass it -- but
                # only while another member holds the original: asked again after each victim (the victim may have
                # been that member).  A copy of a block only the cache or another group shares adds nothing here,
                # so a request alone in its group needs only its new blocks.  (Asked only at the cap: one refcount
                # lookup per row otherwise, every step.)
                if over < 0 or over == 0 and not (self.kv.num_copy_on_write_blocks(req)
                                                  and self._held.holds_last_too(req, g.key)):
                    break
                members = [r for r in self.running if g in self.caps.groups(r)]
                victim = self._choose_victim(self._victim_candidates(members))
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    return False
        return True

    def _victim_candidates(self, pool: list[Request] | None = None) -> list[Request]:
        """Running requests the anti-thrash rule allows as victims (all of them if all are protected)."""
        pool = self.running if pool is None else pool
        limit = self.config.preemption_protect_after
        unprotected = [r for r in pool if r.num_preemptions < limit] if limit else []
        return unprotected or pool

    # -- per-step accounting ----------------------------------------------------
    def observe(self, batch: ScheduledBatch, sampled: dict[str, int], now: float) -> None:
        """After a step ran: per-tenant token counts, then the policy's optional ``observe`` hook."""
        seqs = batch.seqs
        if len(self._tenants_added) == 1:
            # Every request ever added belongs to one tenant: no Python work per sequence.  The executor
            # returns a token exactly for the rows that sample (its contract), so ``len(sampled)`` counts them.
            prompt_tokens = batch.num_prefill_tokens  # the tokens of the non-decode rows
            output_tokens = len(sampled)
            if prompt_tokens or output_tokens:  # (a tenant's counters appear with its first counted token)
                ts = self.tenant(next(iter(self._tenants_added)))
                ts.prompt_tokens += prompt_tokens
                ts.output_tokens += output_tokens
        else:
            # Counted per tenant in local dicts first, then added once per tenant: no method call per sequence.
            prompt: dict[str, int] = {}
            output: dict[str, int] = {}
            for s in seqs:
                req = s.request
                if not s.is_decode:
                    prompt[req.tenant] = prompt.get(req.tenant, 0) + s.num_tokens
                if req.request_id in sampled:
                    output[req.tenant] = output.get(req.tenant, 0) + 1
            for name, n in prompt.items():
                self.tenant(name).prompt_tokens += n
            for name, n in output.items():
                self.tenant(name).output_tokens += n
        if self._observe is not None:
            self._observe(batch, now)

    def _preempt(self, req: Request, may_swap: bool = True) -> None:
        """Give back ``req``'s device blocks by swap (if ``may_swap``, the mode and the host tier allow) or recompute."""
        self.running.remove(req)
        if self._held is not None:
            self._held.remove(req)
        # Any victim pauses the next admission (see admit), one with nothing computed too: it lost no work, but
        # it gave way because the pool (or a group's cap) ran dry, and that is what the pause is for.
        self._preempted_last_step = True
        computed = req.num_computed_tokens
        if computed > 0:
            self.stats.num_preemptions += 1
            self.tenant(req.tenant).preemptions += 1
            req.num_preemptions += 1
        if computed > 0 and may_swap and self._wants_swap(req) and self.kv.swap_out(req):
            self.stats.num_swap_preemptions += 1
            req.status = RequestStatus.SWAPPED
        else:
            if computed > 0:
                self._count_recompute(req, computed)
            self.kv.free(req)
            req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self._count_waiting(req, 1, at_front=True)

    def swap_out_failed(self, req: Request) -> None:
        """``req`` was swapped out in a step whose execution failed, perhaps before its KV was copied out (the
        executor copies first, and may fail there): its host copy cannot be trusted, so it is recomputed instead.
        It stays where the preemption put it, at the front of the queue."""
        computed = req.num_computed_tokens
        self.kv.drop_swapped_copy(req)
        self.stats.num_swap_preemptions -= 1
        self._count_recompute(req, computed)
        req.status = RequestStatus.PREEMPTED

    def swap_in_failed(self, req: Request) -> None:
        """``req`` was swapped in for a step whose execution failed, perhaps before its KV was copied in (the
        executor copies first, and may fail there), and it had no row in that step, so it did not fail with the
        rows.  Left running, it would attend device blocks that may hold anything.  Its host copy cannot be
        used instead: the swap-in gave those host blocks back, and a victim swapped out in the same step may
        have been handed them.  So it is preempted again, by recompute (a swap out would save the
        garbage), and counted so; it waits at the front of the queue, as any victim does.  (Its copy in is taken
        out of the swap counts with the rest of the failed step's: ``KVCacheManager.uncount_swap_ins``.)"""
        paused = self._preempted_last_step
        self._preempt(req, may_swap=False)
        self._preempted_last_step = paused  # the pool did not run dry: no reason to pause the next admission

    def _count_recompute(self, req: Request, computed: int) -> None:
        """A preemption by recompute: ``computed`` tokens thrown away, to be computed again."""
        self.stats.num_recompute_preemptions += 1
        self.stats.num_recomputed_tokens += computed
        req.num_recomputed_tokens += computed
        req.num_tokens_computed_once = max(req.num_tokens_computed_once, computed)

    def _wants_swap(self, req: Request) -> bool:
        """Try the host tier for this victim?  Swap mode always does (:meth:`KVCacheManager.swap_out` refuses when
        the tier is full, and the victim is recomputed); auto asks the cost model, and without one (a scheduler
        built by hand, not by the engine, which always gives auto mode one) recomputes, which needs no tier."""
        mode = self.config.preemption_mode
        if mode == "swap":
            return True
        if mode == "auto" and self.costs is not None:
            blocks = blocks_for(req.num_computed_tokens, self.kv.block_size)
            return self.costs.prefers_swap(req.num_computed_tokens, blocks)
        return False
