"""Fairness and multi-tenancy: per-tenant caps, weighted fair queueing, deadlines, priority classes.

*"Be fair" is not a policy until you name a metric and an enforcement.*  Each
policy here is a pair behind the two existing seams
(:class:`~minivllm.interfaces.AdmissionPolicy`,
:class:`~minivllm.interfaces.PreemptionPolicy`) plus, where it needs them, the
optional protocols the scheduler asks about (``rank``, ``may_preempt_for``,
``observe``, ``activity``, ``head_of_line``, and ``track`` / ``enqueued`` / ``dequeued``
to keep an order as the queue changes; see :mod:`minivllm.interfaces`).  Pick one by
name with ``LLM(scheduling_policy=...)``:

========================  ==============================================================
``"fcfs"``                arrival order; preempt the newest (today's behaviour)
``"priority"``            lower ``priority`` first, ties by arrival; preempt the lowest
                          priority, also to seat a higher-priority request when
                          ``max_num_seqs`` or KV is the limit (cf. vLLM #40004)
``"caps"``                FCFS plus per-tenant caps (``TenantConfig.max_*``); a tenant
                          whose head request cannot start does not block other tenants
``"wfq"``                 weighted fair queueing over tokens (VTC, OSDI 2024): a virtual
                          token counter per tenant
``"deadline"``            earliest deadline first, with aging
``"three_class"``         the seed lesson's worked policy (interactive / agent / batch)
========================  ==============================================================

**Caps compose with every policy**: ``TenantConfig(max_running=..., max_tokens_per_step=...,
max_kv_share=...)`` are enforced by the scheduler whatever the order (a
:class:`CapTable` maps each request to the cap groups it counts against).  A
tenant at a cap waits -- or, with ``TenantConfig(over_cap="reject")``, a new request
of a tenant at its seat or KV cap finishes ``"rejected"`` with a ``retry_after_s``
hint (:meth:`CapTable.retry_steps`: the steps until its running requests, and the
waiting ones admitted before a retry, leave it enough room; the server answers 429 +
``Retry-After``); a running tenant that would
grow past its KV share preempts *its own* work (the victim the preemption policy picks among
its requests), never a neighbour's, so it
cannot pin the cache.  Nor can it fill the prefix cache: ``TenantConfig(max_cache_share=...)``
(and the three-class preset's ``tenant_cache_share``) bound what one tenant keeps
cached, all its cache salts together (:func:`tenant_cache_quota`).

**WFQ** (:class:`WFQAdmission`).  Each tenant ``t`` has a counter
``c[t] += (wfq_prefill_weight * prefill tokens + wfq_decode_weight * output tokens) / weight[t]``,
charged from the tokens each step really served (the ``observe`` hook; a prompt token
once, however often a recompute preemption makes the engine compute it again).  Waiting
requests are interleaved lowest counter first.  A tenant that becomes active
(had nothing waiting or running) starts at ``max(c[t], min of the active
tenants' counters)`` -- or, when no tenant is active, at the counter of the last
tenant that went idle -- so idling banks no credit.  Nor does trickling: a tenant kept active only by
running requests (nothing waiting) that sends again rejoins at ``max(c[t], m - 2 * margin)``, ``m`` the
minimum counter of the tenants that kept requests waiting (else of the other active tenants), as VTC lifts
every client whose queue was empty -- its next request still ranks first, but it banks at most two steps'
tokens, not everything the backlogged tenants were served meanwhile.  A waiting request may preempt a
running request of a tenant whose counter is more than one step's budget
(``max_num_batched_tokens * wfq_prefill_weight``) ahead: that margin keeps two
backlogged tenants from preempting each other back and forth.

**Deadline** (:class:`DeadlineAdmission`).  The sort key of a request is
``max(arrival, min(deadline, arrival + deadline_aging_s))`` (no deadline: ``arrival +
deadline_aging_s``).  *Bound:* a request that arrived at ``a`` is never admitted
after a request that arrived later than ``a + deadline_aging_s`` (that request's
key is past ``a + deadline_aging_s``, this one's is not, and admission stops at the
first request that does not fit; a sample of an ``n > 1`` request holds its seat
while its leader prefills).  So its wait is at most ``deadline_aging_s``
plus the time to serve what arrived before ``a + deadline_aging_s``; nothing is
starved by an endless stream of tighter deadlines.  Caps come first: a request
its tenant's cap holds back is passed by other tenants' requests, however late.

**Three classes** (:class:`ThreeClassAdmission`, knobs in
:class:`~minivllm.config.ThreeClassConfig`), one named rule per clause of the worked policy
(:data:`THREE_CLASS_RULES`).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from itertools import chain
from dataclasses import dataclass
from types import MappingProxyType
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence

from minivllm.config import PRIORITY_CLASSES, EngineConfig
from minivllm.interfaces import AdmissionPolicy, RanksRequests, implements
from minivllm.kv.sharing import GroupBlocks
from minivllm.request import Request, RequestStatus
from minivllm.sched.kept import KeepsItsOrder, KeptOrder, no_rank
from minivllm.sched.policies import (
    FCFSAdmission,
    PriorityAdmission,
    PriorityPreemption,
    RecomputeLatestPreemption,
)

CLASS_RANK = MappingProxyType({name: rank for rank, name in enumerate(PRIORITY_CLASSES)})  # read-only: module state

THREE_CLASS_RULES = MappingProxyType({
    "reserve_kv_for_interactive": "agent and batch requests together never hold more than "
                                  "(1 - interactive_kv_reserve) of the KV blocks (rounded down, at least one)",
    "bounded_agent_queue": "agent requests are ordered after interactive ones and hold at most agent_kv_share "
                           "of the blocks and agent_max_running_share of the seats (each rounded down, at least one)",
    "batch_only_when_interactive_idle": "batch requests are admitted only while fewer than "
                                        "batch_max_interactive_queue interactive requests wait",
    "capped_prefix_cache": "prefix caching is on and each tenant (all its cache salts together) keeps at most "
                           "tenant_cache_share of the pool cached, evicting its own blocks first "
                           "(TenantConfig.max_cache_share or prefix_cache_quota_blocks win)",
    "chunk_long_prefills": "no request prefills more than long_prefill_tokens tokens in one step, so longer "
                           "prompts are chunked (long_prefill_token_threshold; an explicit value of it above 0 wins)",
    "preempt_batch_first_swap_long": "victims are batch before agent before interactive, among the requests "
                                     "anti-thrash leaves open (one preempted preemption_protect_after times is spared, "
                                     "whatever its class, until everyone is); a victim whose context is "
                                     "long enough that swapping it costs less than recomputing it (the auto mode's "
                                     "cost model, or swap_min_tokens computed tokens if set) is swapped, a shorter "
                                     "one recomputed",
})


def class_of(config: EngineConfig, tenant: str) -> str:
    """A tenant's priority class under the three-class preset (unclassed tenants are interactive)."""
    return config.tenant_config(tenant).priority_class or "interactive"


# -- caps ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CapGroup:
    """A set of requests that share caps: one tenant, or a class of tenants under the preset."""

    key: tuple
    rule: str
    max_running: int | None = None
    max_blocks: int | None = None
    max_tokens: int | None = None
    over_cap: str = "wait"  # "reject": a new request finding the group at max_running / max_blocks is turned away

    def would_exceed(self, seats: int, blocks: int, need_blocks: int) -> bool:
        """Would one more request needing ``need_blocks`` KV blocks exceed this group's seat or KV cap, with ``seats``
        members running and ``blocks`` counted against it?  Admission
        (:meth:`~minivllm.sched.scheduler.Scheduler._cap_failure`), a reject-cap (:meth:`CapTable.rejecting_group`)
        and its retry hint (:meth:`CapTable.retry_steps`) ask this one question, so the rule cannot drift apart: a
        request that brings the group to its caps exactly fits.  Nor can what they ask it with: each charges the
        request its exact need (``Scheduler._cap_needs``: a cached prefix the group holds is free).  The per-step
        token cap is not asked: it frees up at the next step."""
        return ((self.max_running is not None and seats >= self.max_running)
                or (self.max_blocks is not None and blocks + need_blocks > self.max_blocks))


@dataclass(slots=True)
class GroupUsage:
    """What a cap group's running members take in an admission pass: what its caps are checked against.

    Counted from ``running`` at the start of a pass (``Scheduler._group_usage``), again after each preemption the
    pass makes, and kept as the pass seats requests."""

    seats: int  # running members (against max_running)
    blocks: int  # KV blocks they hold (a block two members share once) plus those set aside for them, less the copy
    #              a group's last writer into a shared block will not make (max_blocks)
    tokens: int  # tokens they take this step (max_tokens)


#: the usage of a group with no running member, for reading only (a pass adds a group's own record as it seats)
NO_USAGE = GroupUsage(0, 0, 0)


@dataclass(eq=False)
class _ForkedStart:
    """The leader's blocks a sample that :meth:`CapTable.retry_steps` seats by a fork holds: a holder its
    :class:`~minivllm.kv.sharing.GroupBlocks` counts as it counts a member (one per sample: compared by identity)."""

    block_ids: list[int]


class CapTable:
    """Which cap groups each request counts against (built once per tenant name, then looked up).

    ``active`` is False when no cap is configured: the scheduler then skips all cap
    bookkeeping, so a run without tenants costs what it did before.
    """

    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        self.config = config
        self.num_blocks = num_blocks
        self._groups: dict[str, tuple[CapGroup, ...]] = {}
        self._keys: dict[str, tuple[tuple, ...]] = {}
        self.active = config.scheduling_policy == "three_class" or any(tc.has_caps for _, tc in config.tenants)

    def groups(self, req: Request) -> tuple[CapGroup, ...]:
        g = self._groups.get(req.tenant)
        if g is None:
            g = self._groups[req.tenant] = self._build(req.tenant)
        return g

    def keys(self, req: Request) -> tuple[tuple, ...]:
        """The keys of ``req``'s groups: what :class:`~minivllm.kv.sharing.GroupBlocks` counts blocks under (kept
        per tenant, as the groups are: the count is rebuilt from every running request twice a step)."""
        k = self._keys.get(req.tenant)
        if k is None:
            k = self._keys[req.tenant] = tuple(g.key for g in self.groups(req))
        return k

    def _build(self, tenant: str) -> tuple[CapGroup, ...]:
        config, n = self.config, self.num_blocks
        tc = config.tenant_config(tenant)
        out = []
        if tc.has_caps:
            blocks = None if tc.max_kv_share is None else max(1, math.floor(tc.max_kv_share * n))
            out.append(CapGroup(("tenant", tenant), "tenant_caps", tc.max_running, blocks, tc.max_tokens_per_step,
                                tc.over_cap))
        if config.scheduling_policy == "three_class":
            # each share rounds down but to at least one block / seat: a cap of 0 would refuse the class outright
            cls, knobs = class_of(config, tenant), config.three_class
            if cls != "interactive":
                out.append(CapGroup(("class", "agent+batch"), "reserve_kv_for_interactive",
                                    max_blocks=max(1, math.floor((1 - knobs.interactive_kv_reserve) * n))))
            if cls == "agent":
                out.append(CapGroup(("class", "agent"), "bounded_agent_queue",
                                    max_running=max(1, math.floor(knobs.agent_max_running_share * config.max_num_seqs)),
                                    max_blocks=max(1, math.floor(knobs.agent_kv_share * n))))
        return tuple(out)

    def may_reject(self, req: Request) -> bool:
        """Does any of ``req``'s groups turn over-cap requests away (rather than make them wait)?"""
        return any(g.over_cap == "reject" for g in self.groups(req))

    def rejecting_group(self, req: Request, usage: dict[tuple, GroupUsage], needs: Sequence[int]) -> CapGroup | None:
        """The ``over_cap="reject"`` group whose seat or KV cap keeps ``req`` out now, if any.

        ``usage`` is the scheduler's :class:`GroupUsage` per group key; ``needs`` the blocks ``req`` would cost each
        of its groups, one per group in :meth:`groups` order (a held prefix it would share is not charged to the
        group holding it: ``Scheduler._cap_needs``).  The per-step token cap never rejects: it frees up at the next
        step.
        """
        for g, need in zip(self.groups(req), needs, strict=True):
            if g.over_cap != "reject":
                continue
            u = usage.get(g.key, NO_USAGE)
            if g.would_exceed(u.seats, u.blocks, need):
                return g
        return None

    def retry_steps(self, req: Request, running: Sequence[Request],
                    needs: Callable[[Request, GroupBlocks], Sequence[int]], reserved: Callable[[Request], int],
                    shared: bool = True, copies: Callable[[Request], int] | None = None,
                    waiting: Iterable[Request] = (), forks: Callable[[Request], Sequence[int]] | None = None,
                    reads: Callable[[Request], Iterable[int]] | None = None) -> int | None:
        """Engine steps until the group that rejected ``req`` has room for it (None: it has room now).

        ``needs(r, held)``: the blocks ``r`` (``req``, or a request of ``waiting``) would cost each of its groups (in
        :meth:`groups` order) while the members counted in ``held`` run -- its fixed need less the blocks of its
        cached prefix they hold (``Scheduler._cap_needs``, what admission charges it; ``needs(r, held, start)``, a
        forked sample's charge: see ``forks``).  Asked again as members
        leave: a member that holds the prefix shortens the wait while it runs, and once the last holder is gone the
        group would gain those blocks again.

        A running member counts against the KV cap what admission counted: its blocks (a block members
        share once: :class:`~minivllm.kv.sharing.GroupBlocks`) plus ``reserved(r)``, the blocks set aside
        for it; ``shared``: whether any block has two holders now (``GroupBlocks``' ``shared_now``: the walk's count
        is kept as it seats members, and a fork it seats shares blocks).  ``copies(r)`` says whether ``reserved(r)``
        includes the copy of a shared last block: members that all write into one such block are charged one copy
        fewer, as admission charges them (:meth:`~minivllm.kv.sharing.GroupBlocks.in_place_writes`), and that count is
        taken again as members leave -- any member, not only a writer: one that holds a writer's block but writes
        elsewhere (a leader whose next token starts a block, while its sample still writes the last prompt token
        into the block they share) keeps that writer's copy a gain for the group until it goes, and then the
        writer writes in place.  Its running members are assumed to finish in order of
        the steps they still need (:meth:`~minivllm.request.Request.steps_to_finish`); each gives back its seat and the blocks no member
        left behind it still holds (a shared prompt's blocks come back with the last of its holders).

        ``waiting``: the queue a resubmitted ``req`` would join at its end.  The group's members in it are admitted
        before ``req`` (a waiting sample of a running leader, a preempted member, a request held back by the pool):
        counted only among the running, a hint said 1 step where the room went to a waiting sample and the real wait
        was 17.  So each, in queue order, takes a seat and its need as soon as the walk has room for it, and leaves
        again ``steps_to_finish`` steps later; ``req`` is given the room left after them.  An estimate, like reject
        mode's hint: members can also be preempted, or stop early at EOS, and a smaller request may pass a waiting
        one whose need does not fit yet.

        ``forks(r)``: the blocks of its leader a waiting sample ``r`` would start on, the whole ones (empty: it would
        not fork).  Seated while that leader still runs, such a sample forks: it is let in on the need admission
        checks, then holds those blocks with the leader (admission then counts its distinct blocks:
        :meth:`~minivllm.sched.scheduler.Scheduler._seat`), and keeps them once the leader goes.  So the walk counts
        its start among the blocks ``held`` counts and charges it the rest, ``needs(r, held, start)`` (its fixed need
        less the start -- or less its cached prefix the group holds, if that is more): a leader leaving gives back
        only what no fork of it holds, and a request starting on the prompt's cached prefix still finds it held.
        Charged its
        whole need, a sample read as its prompt's blocks more (prefix caching off), and once its leader left the
        prompt left the group's count: hints of 11 to 13 steps where the wait was 6 to 8.

        ``reads(r)``: the blocks whose holding ``needs(r, ...)`` depends on (its cached prefix; None: any block).
        A charge changes only when one of those leaves the group's count, so the walk asks the seated
        members again only then -- not at every member leaving, whose own blocks mostly no one else reads.  Asked
        at every leave, with 200 members running and 1,000 short requests of the group waiting, a 429 took 11,662
        charges (116 ms; 2,000 waiting: 28,711, 262 ms), now one per request (32 and 61 ms); the hint is the same.
        """
        chunk = self.config.prefill_chunk_tokens
        for g in self.groups(req):
            if g.over_cap != "reject":
                continue
            members = [r for r in running if g in self.groups(r)]
            # kept as the walk seats members: a fork it seats shares blocks even where none is shared now
            held = GroupBlocks(members, lambda r: (g.key,), shared=True, shared_now=shared)
            writers = [r for r in members if copies(r)] if copies is not None and shared else []
            spared = held.in_place_writes(g.key, writers)
            seats, blocks = len(members), held.count.get(g.key, 0) + sum(reserved(r) for r in members) - spared
            leaving = deque(sorted(members, key=lambda r: r.steps_to_finish(chunk)))
            seated: dict[Request, int] = {}  # waiting members the walk seated -> the blocks each is charged
            starts: dict[Request, _ForkedStart] = {}  # those seated by a fork -> the leader's blocks they hold
            ends: list[tuple[int, int, Request]] = []  # (the step each leaves, #, it)
            now = 0  # steps from now: the walk's clock
            # the blocks some charge reads (``reads``; only grows: a block no charge reads any more costs at most a
            # needless re-ask).  Only a leave can change a charge: the one block set that joins ``held``, a fork's
            # start, joins beside its leader, still running, which holds every block of it
            watched: set[int] | None = set() if reads is not None else None
            for k, r in enumerate(chain((w for w in waiting if g in self.groups(w)), (req,))):
                if watched is not None:
                    watched.update(reads(r))
                need = needs(r, held)[self.groups(r).index(g)]
                while g.would_exceed(seats, blocks, need) and (leaving or ends):
                    if ends and (not leaving or ends[0][0] <= leaving[0].steps_to_finish(chunk)):
                        now, _, w = heapq.heappop(ends)
                        start = starts.pop(w, None)
                        seats, blocks = seats - 1, blocks - seated.pop(w)
                        if start is None:
                            continue  # (it held nothing ``held`` counts: no charge changes)
                        read = watched.intersection(start.block_ids) if watched is not None else None
                        blocks -= held.remove(start)[0]
                    else:
                        m = leaving.popleft()
                        now = m.steps_to_finish(chunk)
                        read = watched.intersection(m.block_ids) if watched is not None else None
                        seats, blocks = seats - 1, blocks - held.remove(m)[0] - reserved(m)
                        if writers:  # (any member leaving may have held a writer's block: see the docstring)
                            if m in writers:
                                writers.remove(m)
                            blocks += spared - (spared := held.in_place_writes(g.key, writers))
                    if read is not None:
                        still = held.blocks(g.key)
                        if all(b in still for b in read):
                            continue  # no block a charge reads left the group: every charge stands
                    for w, was in seated.items():  # a seated member holds what it shared with the one gone itself now
                        start = starts.get(w)
                        charge = needs(w, held, start.block_ids) if start else needs(w, held)
                        seated[w] = charge[self.groups(w).index(g)]
                        blocks += seated[w] - was
                    need = needs(r, held)[self.groups(r).index(g)]
                if r is not req:
                    # a fork only while its leader runs past ``now``: one leaving at ``now`` is gone when it is seated
                    runs = forks is not None and r.leader in leaving and r.leader.steps_to_finish(chunk) > now
                    start = forks(r) if runs else ()
                    if start:  # it forks: it holds the leader's blocks with it
                        starts[r] = _ForkedStart(list(start))
                        blocks += held.add(starts[r])[0]
                        need = needs(r, held, start)[self.groups(r).index(g)]
                    seats, blocks, seated[r] = seats + 1, blocks + need, need
                    heapq.heappush(ends, (now + r.steps_to_finish(chunk), k, r))
            if now or g.would_exceed(seats, blocks, need):
                return max(1, now)
        return None

    def max_blocks_for(self, tenant: str) -> int | None:
        """The most blocks a request of ``tenant`` may ever hold (None: no KV cap).  Read from the per-tenant
        cache when the engine's thread has filled it, else built from the config without storing it: only the
        engine's thread writes the cache, so another thread (the server, before its door) may ask."""
        caps = [g.max_blocks for g in self._groups.get(tenant) or self._build(tenant) if g.max_blocks is not None]
        return min(caps) if caps else None


def new_prompt_tokens(seq) -> int:
    """The prompt tokens of a scheduled chunk computed for the first time: what WFQ charges as prefill service.

    Outputs are charged when sampled, never as prefill; and a chunk that re-prefills a request preempted by
    recompute redoes work its tenant was already charged for -- the engine's loss, not service.  Charged again,
    it let two backlogged tenants preempt each other for ever with preemption protection off: each re-prefill
    pushed the preempting tenant's counter past the other's by the margin before any request finished.
    Charged once, each swing needs a margin's worth of real progress, so the requests finish."""
    req = seq.request
    first = max(seq.start, req.num_tokens_computed_once)
    return max(0, min(seq.start + seq.num_tokens, len(req.prompt_token_ids)) - first)


def uncharged_prompt_tokens(req: Request, computed_if_admitted: int = 0) -> int:
    """The prompt tokens of ``req`` that WFQ will still charge as prefill (:func:`new_prompt_tokens` summed over its
    remaining chunks): those no computation has reached yet, nor admission will skip -- ``computed_if_admitted``,
    the prefix the KV manager says it would start with (:meth:`KVCacheManager.computed_if_admitted`: a cached
    prefix is shared, not prefilled, and ``observe`` charges only what is prefilled).  What
    :meth:`WFQAdmission._merge` charges a waiting request provisionally -- not ``num_uncomputed_tokens``, which
    for a request preempted by recompute is its whole re-prefill (prompt and outputs again), nor the whole
    prompt of a request whose prefix is cached: charged either, its tenant's later requests were ordered behind
    other tenants' as if it had been served tokens it will never be charged for."""
    reached = max(req.num_computed_tokens, req.num_tokens_computed_once, computed_if_admitted)
    return max(0, len(req.prompt_token_ids) - reached)


def tenant_cache_quota(config: EngineConfig, num_blocks: int):
    """``tenant -> blocks`` it may keep in the prefix cache, or None when no tenant has its own quota.

    A tenant's ``TenantConfig.max_cache_share`` wins; under the three-class preset every
    other tenant gets ``ThreeClassConfig.tenant_cache_share`` (rule ``capped_prefix_cache``),
    unless ``prefix_cache_quota_blocks`` is set; everyone else falls back to the
    engine-wide ``prefix_cache_quota_blocks`` (the function returns None for them).
    Cached blocks shared across tenants (``share_prefix_cache_across_tenants``) count
    under the group ``None``, which has no tenant quota.
    """
    preset = None
    if config.scheduling_policy == "three_class" and config.prefix_cache_quota_blocks is None:
        preset = max(1, math.floor(config.three_class.tenant_cache_share * num_blocks))
    if preset is None and not any(tc.max_cache_share is not None for _, tc in config.tenants):
        return None

    def quota(tenant) -> int | None:
        if tenant is None:
            return None
        share = config.tenant_config(tenant).max_cache_share
        return max(1, math.floor(share * num_blocks)) if share is not None else preset

    return quota


# -- policies ---------------------------------------------------------------------------------------

class RankPreemption:
    """Preempt the running request the admission policy ranks worst (newest among ties)."""

    def __init__(self, policy) -> None:
        self.policy = policy

    def choose_victim(self, running: Sequence[Request]) -> Request:
        """``reversed``: ``max`` keeps the first of equal ranks, so ties go to the latest admitted, as FCFS's
        victim rule (:class:`~minivllm.sched.policies.RecomputeLatestPreemption`): it has done the least work."""
        return max(reversed(running), key=self.policy.rank)


class CapsAdmission(FCFSAdmission):
    """FCFS order; a tenant whose head request cannot start does not hold up other tenants."""

    head_of_line = "tenant"


def _tenant(req: Request) -> str:
    """WFQ's buckets: one per tenant (a named function, so the policy pickles)."""
    return req.tenant


class _LivePass:
    """One admission pass's view of WFQ's kept queues (one per tenant), read live instead of copied.

    The lazy order hands out each tenant's requests *as they waited when the order was made*, while admission
    changes the queues under it: it removes what it admits or rejects (a rejected leader takes its waiting samples
    with it) and puts preempted victims back at the front.  A copy of every queue kept that view for free, at a
    cost that grew with the backlog.  Here each tenant has a cursor (the kept key of its request handed out last);
    its next request is the first one past the cursor that had entered by the time of the order
    (:meth:`KeptOrder.first_after`), and a request that leaves before its turn is remembered with its key
    (``ghosts``), so it is still handed out in its place, exactly as from a copy (the scheduler passes over a
    request that ended meanwhile).  Each tenant's ghosts are a heap on their kept key: they leave in any order (a
    rejected leader takes its later samples first, an abort takes any), and a sorted list paid a shift of all the
    rest twice per ghost (``insort`` in, ``pop(0)`` out), quadratic in a pass where thousands leave early (0.67 s
    against 0.11 s for the heap at 100,000 ghosts).  Kept keys are unique (each entry numbers its own), so the heap
    never compares two requests.  Cost: O(log n) per request handed out, plus O(log g) per request that left early.
    """

    def __init__(self, kept: KeptOrder) -> None:
        self.kept = kept
        self.entries = kept.entries
        self.cursor: dict[str, tuple] = {}
        self.ghosts: dict[str, list[tuple[tuple, Request]]] = {}  # per tenant, a heap of (kept key, request)

    def left(self, req: Request) -> None:
        """``req`` is leaving its queue (called before it is removed): keep it if its turn has not come."""
        kept = self.kept
        if not kept.entered_by(req, self.entries):
            return  # entered during the pass: never part of this order
        key = kept.key(req)
        cursor = self.cursor.get(req.tenant)
        if cursor is None or key > cursor:
            heapq.heappush(self.ghosts.setdefault(req.tenant, []), (key, req))

    def next(self, tenant: str) -> Request:
        """The tenant's next request in this order (the caller asks only as often as the tenant had requests)."""
        kept = self.kept
        req = kept.first_after(tenant, self.cursor.get(tenant), self.entries)
        ghosts = self.ghosts.get(tenant)
        if ghosts and (req is None or ghosts[0][0] < kept.key(req)):
            key, req = heapq.heappop(ghosts)
        else:
            key = kept.key(req)
        self.cursor[tenant] = key
        return req


class WFQAdmission(KeepsItsOrder):
    """Weighted fair queueing over tokens: a virtual token counter per tenant (VTC).

    Admission stops at the first request that cannot start (as VTC does): a
    tenant with the lowest counter whose long prompt waits for blocks is not
    overtaken by tenants that are already ahead in service.

    The order is each tenant's queue merged by counter.  Given the scheduler's queue it is built from what was
    kept as that queue changed (:class:`~minivllm.interfaces.KeepsOrder`: each tenant's waiting requests in
    queue order, and which of them entered or left since the last order) and handed out lazily, read from the
    live queues (:class:`_LivePass`), so a step's work is the tenants and the requests admission looks at, not the
    backlog.  (Copying every tenant's queue each step, since admission changes the queues as it walks the order,
    would be one C call, but ~0.9 ms a step at 100,000 waiting requests.)  Given any other sequence it is built
    from that sequence, as a list.  The two answers are the same (a test replays engines both ways).
    """

    head_of_line = "global"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.prefill_weight = float(config.wfq_prefill_weight)
        self.decode_weight = float(config.wfq_decode_weight)
        self.margin = (config.max_num_batched_tokens or 2048) * self.prefill_weight
        self.counters: dict[str, float] = {}
        self._active: set[str] = set()
        self._last_left: float | None = None  # counter of the tenant(s) that went idle last
        # What the rejoin rule reads: the requests the last ``order`` saw waiting, by id -- as a snapshot when that
        # order was given a sequence of its own, else (None) as the scheduler's queue less what entered it since
        # (``_fresh``) plus what left it since after being seen (``_seen_left``), both kept by the hooks below.
        self._waiting_seen: dict[str, Request] | None = {}
        self._fresh: dict[Request, None] = {}
        self._seen_left: dict[str, Request] = {}
        self._kept = KeptOrder(no_rank, _tenant)  # KeepsOrder: each tenant's waiting requests, in queue order
        # This step's order: each request the last ``order`` handed out, by its place in it (what ``rank`` reads).
        self._places: dict[Request, tuple] = {}
        self._tracking = False  # hearing one scheduler's queue (until a second shares the policy)
        self._shared = False
        # What admission would find computed of a request (ReadsCachedPrefixes): its scheduler's KV manager's
        # answer; none (0) before a scheduler gives one, or once a second scheduler shares the policy
        self._computed_if_admitted: Callable[[Request], int] | None = None
        self._peeks_given = 0
        self._pass: _LivePass | None = None  # this step's lazy order, while admission may still walk it

    def track(self, waiting: Sequence[Request]) -> None:
        if self._kept.queue is None and not self._shared:
            self._kept.track(waiting)
            self._tracking = True
        elif waiting is not self._kept.queue and self._tracking:
            # A second scheduler shares this policy: both queues' changes would arrive mixed.  Keep what the last
            # order saw as a snapshot, drop what was kept, and build every later order from the sequence given.
            if self._waiting_seen is None:
                self._waiting_seen = self._seen()
            self._tracking = False
            self._shared = True
            self._pass = None
            self._kept = KeptOrder(no_rank, _tenant)
            self._fresh.clear()
            self._seen_left.clear()

    def enqueued(self, req: Request, at_front: bool) -> None:
        if self._tracking:
            self._kept.add(req, at_front)
            self._fresh[req] = None

    def dequeued(self, req: Request) -> None:
        if self._tracking:
            if self._pass is not None:
                self._pass.left(req)
            self._kept.remove(req)
            if req in self._fresh:
                del self._fresh[req]
            else:  # it was waiting when the last order was made
                self._seen_left[req.request_id] = req

    def _seen(self) -> dict[str, Request]:
        """The requests the last ``order`` saw waiting, by id."""
        if self._waiting_seen is not None:
            return self._waiting_seen
        fresh = self._fresh
        seen = {r.request_id: r for r in self._kept.queue if r not in fresh}
        seen.update(self._seen_left)
        return seen

    def read_cached_prefixes(self, computed_if_admitted: Callable[[Request], int]) -> None:
        """Charge a waiting request provisionally only the prompt admission will not find cached
        (:func:`uncharged_prompt_tokens`).  A policy shared by two schedulers cannot tell whose cache a request
        would look up, so it then counts no cached prefix for anyone (the whole prompt, as a cache without a
        peek does)."""
        self._peeks_given += 1
        self._computed_if_admitted = computed_if_admitted if self._peeks_given == 1 else None

    def _uncharged(self, req: Request) -> int:
        """:func:`uncharged_prompt_tokens` of ``req``, with what its scheduler says admission would find."""
        peek = self._computed_if_admitted
        return uncharged_prompt_tokens(req, peek(req) if peek is not None else 0)

    def weight(self, tenant: str) -> float:
        return float(self.config.tenant_config(tenant).weight)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def activity(self, tenants: Collection[str]) -> None:
        """``tenants`` have a request waiting or running now.  A newly active tenant starts at the minimum of
        the tenants already active (or, when none is, at the counter of the last tenant that went idle), as in
        VTC: idling banks no credit.  (:class:`~minivllm.interfaces.TracksActivity`: the scheduler also calls
        this in steps that do not order the queue, so a tenant that goes idle then is seen to.)"""
        self._forget_places()
        active = set(tenants)
        left = self._active - active
        if left:
            self._last_left = max(self.counter(t) for t in left)
        new = active - self._active
        if new:
            still = [self.counter(t) for t in active & self._active]
            floor = min(still) if still else self._last_left
            if floor is not None:
                for t in new:
                    self._raise_to(t, floor)
        self._active = active

    def _forget_places(self) -> None:
        """The counters an order's places were reckoned from move (a step's service is charged, a tenant is
        lifted), or a step orders nothing: its places no longer say where anyone stands, so ``rank`` falls back to
        the counters as they stand until the next ``order``."""
        if self._places:
            self._places.clear()
        self._pass = None

    def _raise_to(self, tenant: str, floor: float) -> None:
        """Lift ``tenant``'s counter to ``floor``; a counter is never lowered (that would hand out credit)."""
        if self.counter(tenant) < floor:
            self.counters[tenant] = floor

    def _backlogged(self, queues: dict[str, list[Request]]) -> set[str]:
        """The tenants in ``queues`` that kept a request waiting since the last ``order`` (see :meth:`_rejoin`)."""
        if self._waiting_seen is None:  # the scheduler's queue, read from the hooks: what entered since, per tenant
            fresh: dict[str, int] = {}
            for r in self._fresh:
                fresh[r.tenant] = fresh.get(r.tenant, 0) + 1
            left = self._seen_left
            backlogged = {t for t, q in queues.items() if len(q) > fresh.get(t, 0)}  # one of them was there then
            backlogged |= {r.tenant for r in self._fresh if r.request_id in left}  # it left and came back
        else:
            left = seen = self._waiting_seen
            backlogged = {t for t, q in queues.items() if any(r.request_id in seen for r in q)}
        return backlogged | {r.tenant for r in left.values()
                             if r.tenant in queues and r.status is RequestStatus.FINISHED_ABORTED}

    def _rejoin(self, queues: dict[str, list[Request]], running: Sequence[Request]) -> None:
        """Lift a tenant that stayed active but had *nothing waiting* and now sends again, as VTC lifts every
        client whose queue was empty when its request arrived.  Staying active through one running request (a
        long decode, or a closed loop of one call at a time) is not being backlogged: such a tenant takes less
        than its share, and unlifted its counter would fall behind by everything the backlogged tenants were
        served -- credit it could then spend on a burst, winning every admission (and preempting the others)
        until it caught up.  Its floor is the minimum of the tenants that kept requests waiting (the system's
        virtual time), or, when none did, of the other active tenants, less two steps' budget (``2 * margin``):
        a light tenant's next request still ranks first and may, with its lead of more than ``margin``, preempt a
        backlogged tenant that holds the KV cache (the low latency WFQ gives a tenant under its share: lab 6's
        quiet tenant), but it banks at most two steps' tokens, not the whole gap.

        How an empty queue is seen without a hook on arrival: a tenant none of whose waiting requests were
        waiting at the last ``order`` had an empty queue in between, since requests leave ``waiting`` only by
        being admitted (after an ``order``, before anything sent later) or by ending.  An abort can end a waiting
        request *after* its tenant's next one arrived (the queue never emptied), and which came first cannot be
        told here: a tenant one of whose seen requests was aborted is not lifted (it may have been backlogged
        throughout, e.g. behind its own cap, and keeps its deficit as such a tenant does)."""
        backlogged = self._backlogged(queues)
        rejoined = [t for t in queues if t in self._active and t not in backlogged]
        if rejoined:
            others = backlogged or (self._active & ({r.tenant for r in running} | set(queues))) - set(rejoined)
            if others:
                floor = min(self.counter(u) for u in others) - 2 * self.margin
                for t in rejoined:
                    self._raise_to(t, floor)

    def order(self, waiting: Sequence[Request], running: Sequence[Request]) -> Iterable[Request]:
        self._forget_places()
        kept = self._kept.kept(waiting) if self._tracking else None
        if kept is not None:
            queues = kept  # the live queues: read here as they stand, then through a _LivePass
            place = self._kept.key  # a tenant's place: its first request's in the queue
            ties = {t: place(q[0]) for t, q in queues.items()}
        else:
            queues = {}
            for r in waiting:
                queues.setdefault(r.tenant, []).append(r)
            ties = {t: i for i, t in enumerate(queues)}
            if self._waiting_seen is None:  # the last order was kept: what it saw, as the original keeps it
                self._waiting_seen = self._seen()
        self._rejoin(queues, running)
        self._waiting_seen = None if kept is not None else {r.request_id: r for r in waiting}
        self._fresh.clear()
        self._seen_left.clear()
        self.activity(queues.keys() | {r.tenant for r in running})
        heap = [(self.counter(t), ties[t], t) for t in queues]
        heapq.heapify(heap)
        sizes = {t: len(q) for t, q in queues.items()}
        if kept is not None:
            self._pass = _LivePass(self._kept)
            return self._merge(sizes, self._pass.next, heap)
        heads = {t: iter(q) for t, q in queues.items()}
        return list(self._merge(sizes, lambda t: next(heads[t]), heap))

    def _merge(self, sizes: dict[str, int], next_of: Callable[[str], Request], heap: list) -> Iterator[Request]:
        """Each tenant's queue in turn, lowest counter first, charging each request's prompt provisionally (the
        tokens ``observe`` will charge for it: :func:`uncharged_prompt_tokens`, less the prefix admission will find
        cached).  Handed out lazily, each request's cached prefix is counted just before admission tries it, so
        the count is what admission then finds; drawn whole (a list), a swap-in earlier in the pass may evict
        some of it, and a later request of its tenant may then rank ahead by at most the evicted tokens x
        ``wfq_prefill_weight`` / its weight (a count can only be too high: nothing is cached during admission).

        Each request handed out gets its place (what :meth:`rank` reads): the key it left the heap with -- its
        tenant's counter plus the provisional charges of its tenant's requests handed out before it -- and, to
        break ties as the heap broke them, how many requests were handed out before it.

        ``sizes`` is how many requests each tenant had waiting when the order was made, and ``next_of(t)`` the next
        of them: exactly those requests are handed out, in their queue's order, however admission changes the
        queues meanwhile.
        """
        handed = dict.fromkeys(sizes, 0)
        places = self._places
        while heap:
            vc, i, t = heapq.heappop(heap)
            k = handed[t]
            if not heap:  # the last tenant left: the rest of its queue (placed as the heap would)
                for _ in range(sizes[t] - k):
                    req = next_of(t)
                    places[req] = (vc, 1, len(places))
                    vc = vc + self.prefill_weight * self._uncharged(req) / self.weight(t)
                    yield req
                return
            req = next_of(t)
            handed[t] = k + 1
            places[req] = (vc, 1, len(places))
            if k + 1 < sizes[t]:  # provisionally charge the prompt tokens it will be charged for
                heapq.heappush(heap, (vc + self.prefill_weight * self._uncharged(req) / self.weight(t), i, t))
            yield req

    def rank(self, req: Request) -> tuple:
        """Where ``req`` stands in this step's order: one order for admission and for step 2.

        A request the last ``order`` handed out ranks by its place in that order (:meth:`_merge`), which counts
        the prompts of its tenant's requests handed out before it.  Ranked by its tenant's counter as it stands
        instead, a tenant's second request admitted in a step ranked level with its first, ahead of another
        tenant's request admitted between the two; step 2, serving prefills by rank, then gave the two the
        budget admission had counted on for the one between, which got no row: its KV blocks (or its swap-in)
        were taken a step early, from requests that could have run.  By place, a request admitted later in a
        pass ranks behind every one admitted before it, so each is admitted on the very budget step 2 leaves it.
        Any other request (running since an earlier step, or not reached) ranks by its tenant's counter as it
        stands, ahead of the requests handed out at that counter, then by arrival.
        """
        place = self._places.get(req)
        return place if place is not None else (self.counter(req.tenant), 0, req.arrival_time)

    def may_preempt_for(self, req: Request, victim: Request) -> bool:
        """Only another tenant's request, and only when that tenant is more than ``margin`` (one step's budget)
        ahead: inside one tenant a preemption would only reorder its own work, and with a smaller lead two
        backlogged tenants would preempt each other back and forth."""
        return victim.tenant != req.tenant and self.counter(victim.tenant) - self.counter(req.tenant) > self.margin

    def observe(self, batch, now: float) -> None:
        """Charge each tenant, divided by its weight, what the step that ran served it: prompt tokens computed for
        the first time (:func:`new_prompt_tokens`: a recompute's re-prefill is the engine's loss, not service)
        and one decode per row that sampled."""
        self._forget_places()
        for s in batch.seqs:
            t = s.request.tenant
            cost = (0.0 if s.is_decode else self.prefill_weight * new_prompt_tokens(s)) + (
                self.decode_weight if s.samples else 0.0)
            self.counters[t] = self.counter(t) + cost / self.weight(t)


class DeadlineAdmission(KeepsItsOrder):
    """Earliest deadline first, with aging: see the module docstring for the bound."""

    head_of_line = "global"

    def __init__(self, aging_s: float) -> None:
        self.aging_s = float(aging_s)
        self._kept = KeptOrder(self.rank)  # KeepsOrder: the order of the scheduler's queue, kept

    def key(self, req: Request) -> float:
        """The aged deadline, never before arrival: a request arriving with a deadline already past must not rank
        ahead of one that arrived more than ``aging_s`` before it (the module docstring's bound needs it)."""
        latest = req.arrival_time + self.aging_s
        d = latest if req.deadline is None else min(req.deadline, latest)
        return max(req.arrival_time, d)

    def rank(self, req: Request) -> tuple:
        """Aged deadline, then arrival: equal keys are served first come first served, and the victim rule
        (:class:`RankPreemption`) preempts the latest key."""
        return (self.key(req), req.arrival_time)

    def order(self, waiting: Sequence[Request], running: Sequence[Request]) -> list[Request]:
        kept = self._kept.kept(waiting)
        return list(kept.get(0, ())) if kept is not None else sorted(waiting, key=self.rank)


class ThreeClassAdmission(KeepsItsOrder):
    """Interactive before agent before batch; batch only while the interactive queue is short."""

    head_of_line = "tenant"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.threshold = config.three_class.batch_max_interactive_queue
        self._class: dict[str, int] = {}
        # KeepsOrder: the scheduler's queue kept class by class, each by priority then arrival
        self._kept = KeptOrder(PriorityAdmission.rank, self.class_rank)

    def class_rank(self, req: Request) -> int:
        """0, 1, 2 for interactive, agent, batch; remembered per tenant, since it is asked of every request that
        enters the queue or is ordered, and the config's lookup scans the tenant list each time."""
        c = self._class.get(req.tenant)
        if c is None:
            c = self._class[req.tenant] = CLASS_RANK[class_of(self.config, req.tenant)]
        return c

    def rank(self, req: Request) -> tuple:
        return (self.class_rank(req), req.priority, req.arrival_time)

    def order(self, waiting: Sequence[Request], running: Sequence[Request]) -> list[Request]:
        # The order of sorted(waiting, key=self.rank), class by class: kept as the scheduler's queue changed, or
        # else built here, each request's class looked up once.
        by_class = self._kept.kept(waiting)
        if by_class is not None:
            kept = tuple(by_class.get(c, []) for c in range(len(CLASS_RANK)))
        else:
            kept = ([], [], [])
            known = self._class  # class_rank's own table, read inline: this loop runs once per waiting request
            for r in waiting:
                c = known.get(r.tenant)
                kept[self.class_rank(r) if c is None else c].append(r)
            for c, by_class in enumerate(kept):  # priority, then arrival: the order inside each class
                if c < 2 or len(kept[0]) < self.threshold:  # (a batch backlog left out below is not sorted)
                    by_class.sort(key=PriorityAdmission.rank)
        interactive, agent, batch = kept
        if len(interactive) >= self.threshold:  # rule batch_only_when_interactive_idle
            return interactive + agent  # (a new list: admission changes the queue while it walks the order)
        return interactive + agent + batch

    def may_preempt_for(self, req: Request, victim: Request) -> bool:
        """Only for a strictly better class (rule ``preempt_batch_first_swap_long``): inside one class a
        preemption would trade one request's work for an equal one's, which is thrash, not priority."""
        return self.class_rank(victim) > self.class_rank(req)


@dataclass
class LongContextSwap:
    """A :class:`~minivllm.interfaces.PreemptionCostModel`: swap victims with long contexts, recompute short ones."""

    min_tokens: int

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return num_tokens >= self.min_tokens


def make_policies(config: EngineConfig, admission: AdmissionPolicy | None = None):
    """``(admission, preemption, cost_model or None)`` for ``config.scheduling_policy``.

    ``admission``: the caller's own admission policy, which then replaces the named one.  A named victim rule
    that follows the named admission's ranking (wfq, deadline, three_class) follows the caller's instead -- or,
    if it ranks nothing, preempts the newest request as FCFS does: left bound to the named admission it would
    read counters that nothing updates any more, since the scheduler calls only the caller's policy.
    """
    name = config.scheduling_policy
    costs = None
    if name == "fcfs":
        adm, pre = FCFSAdmission(), RecomputeLatestPreemption()
    elif name == "priority":
        adm, pre = PriorityAdmission(), PriorityPreemption()
    elif name == "caps":
        adm, pre = CapsAdmission(), RecomputeLatestPreemption()
    elif name == "wfq":
        adm = WFQAdmission(config)
        pre = RankPreemption(adm)
    elif name == "deadline":
        adm = DeadlineAdmission(config.deadline_aging_s)
        pre = RankPreemption(adm)
    elif name == "three_class":
        adm = ThreeClassAdmission(config)
        pre = RankPreemption(adm)
        # swap_min_tokens None: no rule of our own, so the engine installs its auto mode's cost model (or the
        # simulator its roofline one), which swaps exactly the victims whose recompute would cost more
        threshold = config.three_class.swap_min_tokens
        costs = LongContextSwap(threshold) if threshold is not None else None
    else:
        raise ValueError(f"unknown scheduling_policy {name!r}")
    if admission is not None:
        adm = admission
        if isinstance(pre, RankPreemption):
            pre = RankPreemption(admission) if implements(admission, RanksRequests) else RecomputeLatestPreemption()
    return adm, pre, costs
