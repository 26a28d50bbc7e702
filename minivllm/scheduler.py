"""The scheduler: who runs this step, with how many tokens, and who makes room.

It owns two queues — ``waiting`` (not yet admitted, or preempted) and
``running`` (admitted, holding KV blocks) — and exposes the first three steps
of the serving loop as separate methods, so the engine step reads in order:

1. :meth:`Scheduler.admit` moves waiting requests into ``running`` while there
   is room: a seat (``max_num_seqs``), token budget and KV blocks.
2. :meth:`Scheduler.build_batch` gives each running request its tokens for the
   step under the budget ``max_num_batched_tokens``: decodes first (one token
   each, so a running stream never stalls), then prefill chunks fill the rest.
3. :meth:`Scheduler.allocate` finds KV blocks for every scheduled token and,
   when the pool runs dry, preempts by recompute: the victim's blocks are freed,
   its computed tokens forgotten, and it goes back to the *front* of ``waiting``.

A request that could never fit the pool is rejected when it is added, so
"preempt until it fits" always terminates: alone in the engine, any accepted
request fits.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minivllm.config import EngineConfig
from minivllm.interfaces import AdmissionPolicy, PreemptionPolicy
from minivllm.kv_cache_manager import KVCacheManager, blocks_for
from minivllm.policies import FCFSAdmission, RecomputeLatestPreemption
from minivllm.request import Request, RequestStatus


@dataclass
class ScheduledSeq:
    """One request's share of a step: ``num_tokens`` tokens starting at ``start``."""

    request: Request
    num_tokens: int
    start: int  # == request.num_computed_tokens when scheduled

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last token (so its logits are sampled)?"""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class ScheduledBatch:
    """What the executor runs: sequences ordered single-token-first, plus block copies."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for s in self.seqs if s.request.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_steps: int = 0


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        admission_policy: AdmissionPolicy | None = None,
        preemption_policy: PreemptionPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.admission_policy = admission_policy or FCFSAdmission()
        self.preemption_policy = preemption_policy or RecomputeLatestPreemption()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._preempted_last_step = False
        self.on_admit = None  # hook set by the engine: prefix-cache lookup at admission

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

    # -- step 1: admit -------------------------------------------------------
    def admit(self) -> list[Request]:
        """Move waiting requests into ``running`` while seats, budget and blocks allow.

        Nothing is admitted in a step right after a preemption: the pool is
        full, and admitting would only preempt again (thrash).
        """
        if self._preempted_last_step or not self.waiting:
            return []
        budget = self.config.max_num_batched_tokens - self._running_demand()
        reserved = sum(self.kv.num_new_blocks(r, self._chunk_cap(r)) for r in self.running)
        admitted: list[Request] = []
        for req in self.admission_policy.order(self.waiting, self.running):
            if len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break
            if req.leader is not None and req.leader.num_computed_tokens < req.leader.num_prompt_tokens:
                continue  # n > 1: a sibling sample forks once its leader has prefilled the prompt
            if self.on_admit is not None and not req.block_ids:
                self.on_admit(req)  # may share cached prefix blocks and advance num_computed_tokens
            want = self._chunk_cap(req)
            if not self.config.enable_chunked_prefill and want > budget:
                self._undo_admit(req)
                break
            tokens = min(want, budget)
            blocks = self.kv.num_new_blocks(req, tokens)
            if not self.kv.can_provide(reserved + blocks):
                self._undo_admit(req)
                break
            reserved += blocks
            budget -= tokens
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
        return admitted

    def _undo_admit(self, req: Request) -> None:
        """A request matched cached (or forked) blocks but cannot start now: give them back."""
        if req.block_ids:
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.num_inserted_blocks = 0

    # -- step 2: build the batch ---------------------------------------------
    def build_batch(self) -> ScheduledBatch:
        """Decode tokens first, then prefill chunks, never past the token budget."""
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch()
        decodes = [r for r in self.running if r.num_uncomputed_tokens == 1]
        prefills = [r for r in self.running if r.num_uncomputed_tokens > 1]
        for req in decodes + prefills:
            if budget <= 0:
                break
            n = min(self._chunk_cap(req), budget)
            if n < req.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
                continue
            batch.seqs.append(ScheduledSeq(req, n, req.num_computed_tokens))
            budget -= n
        return batch

    # -- step 3: allocate ----------------------------------------------------
    def allocate(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Get KV blocks for every scheduled token, preempting when the pool is dry."""
        self._preempted_last_step = False
        kept: list[ScheduledSeq] = []
        for seq in batch.seqs:
            req = seq.request
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.kv.allocate_slots(req, seq.num_tokens):
                victim = self.preemption_policy.choose_victim(self.running)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.RUNNING:
                kept.append(seq)
        batch.seqs = [s for s in kept if s.request.status is RequestStatus.RUNNING]
        batch.block_copies = self.kv.take_pending_copies()
        self.stats.num_steps += 1
        return batch

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: free everything, forget computed tokens, requeue at the front."""
        self.running.remove(req)
        if req.num_computed_tokens > 0:
            self.stats.num_preemptions += 1
            req.num_preemptions += 1
            req.num_recomputed_tokens += req.num_computed_tokens
            self.stats.num_recomputed_tokens += req.num_computed_tokens
            self._preempted_last_step = True
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_inserted_blocks = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    # -- capacity check used at add time ---------------------------------------
    def could_ever_fit(self, req: Request) -> bool:
        """Would this request fit the whole pool if it were alone?"""
        return blocks_for(req.max_total_tokens, self.kv.block_size) <= self.kv.pool.num_blocks
