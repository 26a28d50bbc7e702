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
  freed; it waits at the front and is swapped back in, ahead of new
  admissions, as soon as blocks allow.  Costs link traffic (twice its KV bytes).
  When the host tier is full the victim is recomputed instead.
* ``reject`` -- nothing running is ever preempted: a request is admitted only
  if the pool can hold its *worst case* (prompt + ``max_tokens``) next to the
  worst cases of everything running; a new request that cannot be admitted
  for lack of KV finishes as ``"rejected"`` with a ``retry_after_s`` hint.
* ``auto`` -- per victim, the cheaper of swap and recompute (:class:`PreemptionCosts`):
  swap when ``2 * kv_bytes / link_bandwidth < computed_tokens / prefill_rate``
  and the host tier has room, else recompute.  Long contexts on a fast link
  swap; short ones recompute.

Two rules keep preemption from thrashing: nothing is admitted in the step
right after a preemption (the pool is full; admitting would only preempt
again), and a request preempted ``preemption_protect_after`` times is only
chosen as a victim when every running request is protected.  So no request is
preempted "every step" (cf. vLLM issue #25538) while others could give way.

A request that could never fit the pool is rejected when it is added, so
"preempt until it fits" always terminates: alone in the engine, any accepted
request fits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from minivllm.config import EngineConfig
from minivllm.interfaces import AdmissionPolicy, PreemptionCostModel, PreemptionPolicy
from minivllm.kv.kv_cache_manager import KVCacheManager
from minivllm.request import Request, RequestStatus
from minivllm.sched.output import ScheduledBatch, ScheduledSeq
from minivllm.sched.policies import FCFSAdmission, RecomputeLatestPreemption


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


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0  # by recompute + by swap
    num_recompute_preemptions: int = 0
    num_swap_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_rejected: int = 0


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        admission_policy: AdmissionPolicy | None = None,
        preemption_policy: PreemptionPolicy | None = None,
        costs: PreemptionCostModel | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.admission_policy = admission_policy or FCFSAdmission()
        self.preemption_policy = preemption_policy or RecomputeLatestPreemption()
        self.costs = costs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._preempted_last_step = False
        self._rejected: list[Request] = []

    # -- queue management ----------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out of whichever queue holds it and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def _chunk_cap(self, req: Request) -> int:
        """Most tokens one request may take in a step."""
        threshold = self.config.long_prefill_token_threshold
        remaining = req.num_uncomputed_tokens
        if threshold and remaining > 1:
            return min(remaining, threshold)
        return remaining

    def _running_demand(self) -> int:
        return sum(self._chunk_cap(r) for r in self.running)

    def _reserved_blocks(self) -> int:
        """Blocks the running requests will claim: the rest of their prefill, or (reject mode) their worst case."""
        return sum(self._reservation(r) for r in self.running)

    # -- step 1: admit -------------------------------------------------------
    def admit(self) -> list[Request]:
        """Move waiting requests into ``running`` while seats, budget and blocks allow.

        Nothing is admitted in a step right after a preemption: the pool is
        full, and admitting would only preempt again (thrash).
        """
        if self._preempted_last_step or not self.waiting:
            return []
        budget = self.config.max_num_batched_tokens - self._running_demand()
        reserved = self._reserved_blocks()
        admitted: list[Request] = []
        for req in self.admission_policy.order(self.waiting, self.running):
            if len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break
            if not self._leader_ready(req):
                continue  # n > 1: a sibling sample forks once its leader has prefilled the prompt
            fit = self._try_admit(req, budget, reserved)
            if fit is None:
                if self._should_reject(req):
                    self._reject(req)
                    continue
                break
            tokens, blocks = fit
            reserved += blocks
            budget -= tokens
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.kv.record_admission(req)
            admitted.append(req)
        return admitted

    @staticmethod
    def _leader_ready(req: Request) -> bool:
        """A sample waits for its leader's prefill, unless the leader is gone (then it prefills alone)."""
        leader = req.leader
        if leader is None or leader.status.finished:
            return True
        return leader.num_computed_tokens >= leader.num_prompt_tokens

    def _try_admit(self, req: Request, budget: int, reserved: int) -> tuple[int, int] | None:
        """``(tokens this step, blocks to reserve)`` if ``req`` can start now, else None (nothing held)."""
        kv = self.kv
        if req.status is RequestStatus.SWAPPED:
            tokens = min(self._chunk_cap(req), budget)
            blocks = kv.num_new_blocks(req, tokens)  # the swapped blocks plus room for this step
            if not kv.can_provide(reserved + blocks):
                return None
            kv.swap_in(req)
            return tokens, self._reservation(req)
        forked = req.leader is not None and bool(req.leader.block_ids) and not req.leader.status.finished
        if forked:
            kv.fork(req.leader, req)
        else:
            kv.share_prefix(req, kv.match_prefix(req))
        want = self._chunk_cap(req)
        if not self.config.enable_chunked_prefill and want > budget:
            kv.free(req)
            return None
        tokens = min(want, budget)
        blocks = self._reservation(req)
        if forked and self.config.preemption_mode == "reject":
            blocks += 1  # the leader's last block is shared now: its next write copies it
        if not kv.can_provide(reserved + blocks):
            kv.free(req)
            return None
        return tokens, blocks

    def _reservation(self, req: Request) -> int:
        """Blocks set aside for ``req`` at admission.

        Its whole remaining prefill, not just this step's chunk: a prompt
        admitted on the strength of its first chunk could run out of room
        halfway, and as the newest request it would preempt itself and throw
        its chunks away, again and again.  Reject mode sets aside the worst
        case (prompt + ``max_tokens``), so nothing running is ever preempted.
        """
        if self.config.preemption_mode == "reject":
            return self.kv.worst_case_new_blocks(req)
        return self.kv.num_new_blocks(req, req.num_uncomputed_tokens)

    def _should_reject(self, req: Request) -> bool:
        """Reject mode: a request that found no room is turned away, unless it is already in flight."""
        return self.config.preemption_mode == "reject" and req.status is RequestStatus.WAITING

    def _reject(self, req: Request) -> None:
        self.waiting.remove(req)
        req.status = RequestStatus.FINISHED_REJECTED
        self.stats.num_rejected += 1
        self._rejected.append(req)

    # -- step 2: build the batch ---------------------------------------------
    def build_batch(self) -> ScheduledBatch:
        """Decode tokens first, then prefill chunks, never past the token budget.

        The sequences are finally put one-token rows first, the layout the
        attention backends expect (a stable sort, so decodes keep their order).
        """
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch(rejected=self._rejected)
        self._rejected = []
        decodes = [r for r in self.running if r.is_decode]
        prefills = [r for r in self.running if not r.is_decode]
        for req in decodes + prefills:
            if budget <= 0:
                break
            n = min(self._chunk_cap(req), budget)
            if n < req.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            batch.seqs.append(ScheduledSeq(req, n, req.num_computed_tokens, req.is_decode))
            budget -= n
        batch.seqs.sort(key=lambda s: s.num_tokens != 1)
        return batch

    # -- step 3: allocate ----------------------------------------------------
    def allocate(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Get KV blocks for every scheduled token, preempting when the pool is dry."""
        self._preempted_last_step = False
        for seq in batch.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.kv.allocate_slots(req, seq.num_tokens):
                victim = self.preemption_policy.choose_victim(self._victim_candidates())
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
        batch.seqs = [s for s in batch.seqs if s.request.status is RequestStatus.RUNNING]
        batch.moves = self.kv.take_block_moves()
        self.stats.num_steps += 1
        return batch

    def _victim_candidates(self) -> list[Request]:
        """Running requests the anti-thrash rule allows as victims (all of them if all are protected)."""
        limit = self.config.preemption_protect_after
        unprotected = [r for r in self.running if r.num_preemptions < limit] if limit else []
        return unprotected or self.running

    def _preempt(self, req: Request) -> None:
        """Give back ``req``'s device blocks by swap (if the mode and the host tier allow) or recompute."""
        self.running.remove(req)
        computed = req.num_computed_tokens
        if computed > 0:
            self._preempted_last_step = True
            self.stats.num_preemptions += 1
            req.num_preemptions += 1
        if computed > 0 and self._wants_swap(req) and self.kv.swap_out(req):
            self.stats.num_swap_preemptions += 1
            req.status = RequestStatus.SWAPPED
        else:
            if computed > 0:
                self.stats.num_recompute_preemptions += 1
                self.stats.num_recomputed_tokens += computed
                req.num_recomputed_tokens += computed
            self.kv.free(req)
            req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def _wants_swap(self, req: Request) -> bool:
        mode = self.config.preemption_mode
        if mode == "swap":
            return True
        if mode == "auto" and self.costs is not None:
            blocks = -(-req.num_computed_tokens // self.kv.block_size)
            return self.costs.prefers_swap(req.num_computed_tokens, blocks)
        return False
