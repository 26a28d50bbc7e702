"""Every seam of the engine, in one place: small protocols a learner's class can stand in for.

Each protocol is the *whole* contract the engine relies on.  Pass your own
object with these methods into :class:`~minivllm.engine.LLMEngine` (or ``LLM``)
and the real serving loop runs with it:

* :class:`AdmissionPolicy` -- which waiting request to admit next (FCFS,
  priorities, weighted fair queueing, per-tenant caps...); a policy may also
  rank requests, preempt to admit, observe each step, hear which tenants are
  active on steps it orders nothing, set its head-of-line rule, keep its order
  as the queue changes and count cached prefixes in it (:class:`RanksRequests`,
  :class:`PreemptsToAdmit`, :class:`ObservesSteps`, :class:`TracksActivity`,
  :class:`HeadOfLine`, :class:`KeepsOrder`, :class:`ReadsCachedPrefixes`).
* :class:`BatchBuilder` -- step 2 of the loop: how many tokens each running
  request computes this step (lab 4 writes one).
* :class:`PreemptionPolicy` -- who gives up its KV blocks when they run out.
* :class:`PreemptionCostModel` -- in ``preemption_mode="auto"``, whether a
  victim is swapped out or recomputed.
* :class:`Executor` -- what "run the batch" means: the real model runner, or a
  simulated executor with a virtual clock for fast what-if studies.  A
  simulator may also be a :class:`SimulatedDevice` (the engine sizes its KV
  pool and prices swaps from it), a :class:`VirtualClock` (an idle engine jumps
  to the next arrival instead of sleeping) and :class:`PricesRecompute`.
* :class:`PrefixCache` -- which cached blocks hold the longest prefix of a
  prompt (a radix tree or a hash index; see :mod:`minivllm.kv.prefix`); it may
  also count them without acting on them (:class:`PeeksPrefix`), name them (:class:`PeeksPrefixBlocks`) and say
  which it cannot evict, now and once some requests let go (:class:`TracksPins`).
* :class:`AttentionBackend` -- how the model writes K/V into the paged cache and
  attends through block tables (plain torch, a C kernel for CPU decodes, or
  Triton kernels; see :mod:`minivllm.model.backends`).
* :class:`Router` -- which replica of a fleet serves a request (round-robin,
  least outstanding tokens, prefix affinity; see :mod:`minivllm.sim.router`).
* :class:`Tokenizer` -- text to token ids and back (a Hugging Face tokenizer
  fits; the simulator runs with none, on token ids only).

Why one module?  A reader who wants to know "what can I replace?" reads one
file, and no implementation module has to import another to learn a contract,
so the package has no import cycles.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from minivllm.kv.prefix.base import InsertResult, PrefixCacheStats
    from minivllm.model.attention import AttentionMetadata
    from minivllm.request import Request
    from minivllm.sched.output import ScheduledBatch


@runtime_checkable
class AdmissionPolicy(Protocol):
    """Which waiting request to admit next.  ``order`` is the whole required contract.

    A policy may also be any of the seven protocols after this one (the scheduler asks once, with
    :func:`implements`; a policy that is none of them behaves exactly as FCFS-style policies always have):
    :class:`RanksRequests`, :class:`PreemptsToAdmit` (with a rank), :class:`ObservesSteps`,
    :class:`TracksActivity`, :class:`HeadOfLine`, :class:`KeepsOrder` and :class:`ReadsCachedPrefixes`.
    """

    def order(self, waiting: Sequence["Request"], running: Sequence["Request"]) -> Iterable["Request"]:
        """Waiting requests in the order to try admitting them.

        A request left out is held back this step (a tenant over its cap, say).
        Preempted and swapped-out requests sit at the front of ``waiting``.  The
        scheduler walks the answer once and often stops early (at the first
        request that cannot start), so a policy may hand it out lazily, as WFQ
        does with the scheduler's own queue; a list is the usual answer.
        """
        ...


@runtime_checkable
class RanksRequests(Protocol):
    """An admission policy with a preference among requests, not only an order of the waiting ones."""

    def rank(self, req: "Request") -> Any:
        """A sortable key, smaller is better.  With it the scheduler gives a batch's prefill chunks to
        better-ranked requests first and, when admitting ``req``, counts against the token budget every running
        decode but only the running prefills ranked at or ahead of ``req``.  So within a step it must agree with
        ``order``: a request handed out later must not rank ahead of one handed out before it, or step 2 gives
        the later one the budget admission counted on for the earlier, which is then admitted without a row
        (WFQ ranks by each request's place in its merged order for this reason)."""
        ...


@runtime_checkable
class PreemptsToAdmit(Protocol):
    """An admission policy (that also ranks) which may take a running request's place for a waiting one."""

    def may_preempt_for(self, req: "Request", victim: "Request") -> bool:
        """May waiting ``req`` preempt running ``victim`` when no seat (``max_num_seqs``) or no KV is left for
        it?  (A short token budget is never a reason: it comes back next step.)  The scheduler preempts only if
        preempting every allowed victim could make the room; the victim among those allowed is chosen by the
        :class:`PreemptionPolicy`; requests protected by the anti-thrash rule are never preempted this way."""
        ...


@runtime_checkable
class ObservesSteps(Protocol):
    """An admission policy that learns from what ran (weighted fair queueing charges its counters here)."""

    def observe(self, batch: "ScheduledBatch", now: float) -> None:
        """Called once per step after execution with the batch that ran (tokens served per request:
        ``seq.num_tokens``, ``seq.is_decode``, ``seq.samples``)."""
        ...


@runtime_checkable
class TracksActivity(Protocol):
    """An admission policy that must know when a tenant goes idle (weighted fair queueing: idling banks no
    credit).  ``order`` sees who is active whenever admission walks the waiting queue; this hook covers the
    steps it is not called in -- nothing waiting, the step after a preemption, or every seat taken with no
    policy able to free one (no ``may_preempt_for``, no caps) -- when a tenant can finish its last request, or
    have its last waiting one aborted, and go idle unseen.  So each admission calls exactly one of the two."""

    def activity(self, tenants: Collection[str]) -> None:
        """The tenants with a request waiting or running, at a step whose admission did not call ``order``."""
        ...


@runtime_checkable
class HeadOfLine(Protocol):
    """An admission policy that says what a request that cannot start holds up."""

    head_of_line: str
    """``"global"`` (the default for a policy without it): stop admitting this step; ``"tenant"``: skip only
    the rest of that request's tenant."""


@runtime_checkable
class KeepsOrder(Protocol):
    """An admission policy that keeps its order of the scheduler's waiting queue up to date as requests enter and
    leave it, so that a step costs the requests that changed, not the whole backlog.

    A sorting policy re-sorts every waiting request every step, though between two steps only a few arrive or
    are admitted: beside lab 6's backlog of 1,800 batch prompts that was a sixth of the simulated run (and WFQ,
    regrouping the queue by tenant and merging it whole, cost 130 Python opcodes per waiting request per step).
    The scheduler calls ``track`` once with its queue, then ``enqueued`` / ``dequeued`` at every change to it;
    ``order`` given that queue may answer from what it kept, and given any other sequence builds it from that
    sequence as before.  Both answers must be the same (the tests hold each such policy to it).
    """

    def track(self, waiting: Sequence["Request"]) -> None:
        """``waiting`` (empty now) is the queue the calls below describe."""
        ...

    def enqueued(self, req: "Request", at_front: bool) -> None:
        """``req`` entered the queue: at the back (new), or at the front (preempted, swapped out)."""
        ...

    def dequeued(self, req: "Request") -> None:
        """``req`` left the queue (admitted, rejected, aborted)."""
        ...


@runtime_checkable
class ReadsCachedPrefixes(Protocol):
    """An admission policy whose order depends on how much of a waiting request's prompt is computed already.

    Weighted fair queueing charges a tenant only the prompt tokens its requests prefill, and a prefix the cache
    holds is not prefilled.  The cache is looked up when a request is admitted, after the order was drawn, so
    without this hook the order could only count the whole prompt: a tenant whose prompts hit the cache was
    ordered as if it had more work ahead than it would be charged.
    """

    def read_cached_prefixes(self, computed_if_admitted: Callable[["Request"], int]) -> None:
        """Called once by the scheduler.  ``computed_if_admitted(req)``: the tokens of ``req`` that would count as
        computed were it admitted now (its cached prefix, its leader's prompt for a sample that forks, what a
        swapped-out request brings back), read without taking a reference or making a cached block recent."""
        ...


@runtime_checkable
class BatchBuilder(Protocol):
    """Step 2 of the loop, *build the batch*, done by someone other than the scheduler (lab 4's learner).

    The scheduler's own step 2 (decodes first, then prefill chunks, under the token budget, a capped group's
    token limit and the admission policy's rank) is replaced as a whole; steps 1 and 3, admission and KV
    allocation, stay the engine's.  What comes back is checked at the boundary, so a wrong answer is a
    ``ValueError`` naming the request, not a corrupt batch.
    """

    def __call__(self, running: list["Request"], budget: int, threshold: int) -> list[tuple["Request", int]]:
        """``(request, tokens)`` for the requests that compute this step: each one of ``running`` at most
        once, ``1 <= tokens <=`` its uncomputed tokens, ``budget`` tokens in all; ``threshold`` is the most
        one prompt may take in a step (``long_prefill_token_threshold``; 0: no cap)."""
        ...


@runtime_checkable
class PreemptionPolicy(Protocol):
    def choose_victim(self, running: Sequence["Request"]) -> "Request":
        """The running request that gives up its blocks when the pool is empty.

        ``running`` is in admission order and never empty.  (The scheduler has
        already left out requests that the anti-thrash rule protects -- unless
        every candidate is protected: then it offers them all.)
        """
        ...


@runtime_checkable
class PreemptionCostModel(Protocol):
    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        """Should a victim with ``num_tokens`` computed tokens in ``num_blocks`` blocks be swapped out
        (True) rather than recomputed (False)?  Asked before the host tier's room is checked: a victim it
        would swap is recomputed when the host tier is full."""
        ...


@runtime_checkable
class Executor(Protocol):
    """What "run the batch" means.  An executor may also be any of the three protocols after this one; the
    engine asks with :func:`implements` and falls back to its defaults for one that is not."""

    def execute(self, batch: "ScheduledBatch") -> dict[str, int]:
        """Run one step: perform the batch's block moves (swap in, swap out,
        copy-on-write, in that order), write K/V for every scheduled token,
        and return the sampled next token for each request whose last
        scheduled token was its last uncomputed one (``request_id -> token``)."""
        ...

    def now(self) -> float:
        """The executor's clock in seconds (wall clock, or virtual in a simulator)."""
        ...


@runtime_checkable
class SimulatedDevice(Protocol):
    """An executor that stands for a device it does not have (the simulators).

    On a real device the engine measures these: the KV pool is what the model's cache layout leaves of the
    device's memory, and a swap's cost is a timed copy to pinned host memory.  A simulated device says them,
    so the pool (``kv_cache_memory_bytes // kv_bytes_per_block``) and the swap-or-recompute choice come out
    as they would on the device simulated.  One more number is optional (read with ``getattr``, so not a member
    here): ``prefill_tokens_per_s``, the rate auto mode starts from where a real engine would time a probe (a
    replay of a recorded run says that run's probe: :meth:`~minivllm.sim.replay.ReplayExecutor.from_record`)."""

    kv_bytes_per_block: int
    swap_bytes_per_s: float


@runtime_checkable
class VirtualClock(Protocol):
    """An executor whose :meth:`~Executor.now` is virtual: a step advances it by the step's cost.

    A driver with nothing in flight jumps the clock to the next arrival instead of sleeping until it, which
    is what lets an hour of traffic be simulated in seconds (:func:`minivllm.sim.run.drive`)."""

    def advance_to(self, t: float) -> None:
        """Move the clock forward to ``t`` (never back)."""
        ...


@runtime_checkable
class PricesRecompute(Protocol):
    """An executor that can price a recompute by the victim's length supplies ``preemption_mode="auto"``'s
    cost model.  The roofline simulator can: in a memory-bound step a short victim's prefill rides almost
    free, so recomputing it beats a swap, while a long one is cheaper to swap (lab 5's crossover)."""

    def preemption_cost_model(self, chunk: int) -> PreemptionCostModel:
        """The cost model for steps of at most ``chunk`` prefill tokens (the engine's token budget)."""
        ...


Namespace = Hashable
"""A prefix-cache namespace: an opaque, *structured* value (a tuple), never a joined string."""


class PrefixCache(Protocol):
    """What the KV cache manager may ask of *any* prefix cache.

    Implementations are single-threaded (the scheduler's thread owns them).
    Ownership rule: the cache holds exactly one pool reference on every block
    it indexes; see :mod:`minivllm.kv.prefix.base`.
    """

    block_size: int
    stats: "PrefixCacheStats"

    def match(self, token_ids: Sequence[int], namespace: Namespace = ()) -> list[int]:
        """Block ids of the longest cached, block-aligned prefix of ``token_ids``.

        Takes no pool reference (the caller increfs what it uses) and marks
        the hit blocks as recently used.  The caller passes ``token_ids[:-1]``
        when the last token must be recomputed for its logits.
        """
        ...

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], namespace: Namespace = ()) -> "InsertResult":
        """Cache the full blocks ``token_ids[:len(block_ids)*block_size]``.

        One pool reference is taken on each block that becomes newly cached;
        a position already cached under another block keeps the cached one.
        """
        ...

    def extend(self, parent_block: int, token_ids: Sequence[int], block_ids: Sequence[int],
               namespace: Namespace = ()) -> bool:
        """Cache the full blocks ``block_ids`` (of ``token_ids``) right after the cached block
        ``parent_block``, the last one the caller cached before; return False, changing nothing,
        to have the caller :meth:`insert` the whole prefix instead.

        Why: a decoding request fills a block every ``block_size`` tokens, and inserting its whole
        prefix each time -- copy the tokens, cut them into blocks, walk from the root -- costs a
        request of ``n`` tokens ``O(n)`` per block, ``O(n^2)`` over its life, on the engine's
        thread.  When it returns True the cache must be exactly as :meth:`insert` of the whole
        prefix would have left it (same entries, same LRU ticks), and that insert would have
        returned the caller's own blocks.  Returning False is always allowed.
        """
        ...

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` evictable blocks, LRU first, leaves first; return how many."""
        ...

    @property
    def num_cached_blocks(self) -> int:
        """Number of blocks currently indexed."""
        ...

    def num_evictable_blocks(self) -> int:
        """How many blocks repeated :meth:`evict` calls could free right now."""
        ...

    def is_cached(self, block_id: int) -> bool:
        """Whether ``block_id`` is indexed by the cache."""
        ...

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """Add one lookup to :attr:`stats`."""
        ...

    def reset(self) -> None:
        """Evict everything evictable (locked blocks stay)."""
        ...


@runtime_checkable
class PeeksPrefix(Protocol):
    """A prefix cache that can say how much of a prompt it holds without acting on it (both built-in caches do;
    a cache without ``peek`` still works: an order that wanted to count cached prefixes counts none)."""

    def peek(self, token_ids: Sequence[int], namespace: Namespace = ()) -> int:
        """How many blocks :meth:`PrefixCache.match` would return for these arguments now, found without its
        side effects: no block is made recent and the structure is left as it is (no reference is taken, as
        with ``match``).  Why: an admission policy reads it for every request it hands out, most of which are
        not admitted in that step; making their prefixes recent would reorder eviction for lookups that never
        happened."""
        ...


@runtime_checkable
class PeeksPrefixBlocks(Protocol):
    """A prefix cache that can name the blocks a lookup would return, and the prefixes that hold given blocks,
    without acting on either (both built-in caches can).  A cache without these still works: a KV cap then
    charges a waiting request its whole prompt, the cached blocks its cap group already holds included.

    Why: admission under a KV cap (``TenantConfig.max_kv_share``, the three-class reserve) charges a request only the
    blocks its group would gain, and a cached prefix the group already holds is shared, not gained.  Which blocks
    those are is asked of requests the pass may not admit at all, so the answer must leave the cache as it is."""

    def peek_blocks(self, token_ids: Sequence[int], namespace: Namespace = ()) -> list[int]:
        """The block ids :meth:`PrefixCache.match` would return for these arguments now (in order), found without its
        side effects: no block is made recent, the structure is left as it is, no reference is taken."""
        ...

    def first_block_keys(self, block_ids: Iterable[int]) -> set:
        """``(namespace, tokens of its first block)`` of every cached prefix that holds one of ``block_ids`` (blocks
        not cached are ignored), read without side effects.  A lookup can only return blocks of prefixes whose first
        block is its own, so a prompt whose ``(namespace, first block)`` is not in this set shares none of
        ``block_ids``."""
        ...


@runtime_checkable
class TracksPins(Protocol):
    """A prefix cache that can say which cached blocks it cannot evict now, and which of them a release would free
    for eviction (both built-in caches can).  A cached block is *pinned* while a request holds it or a block cached
    below it in its prefix.  A cache without these still works: the room bound then takes every cached block the
    victims alone hold for room once they go, and the scheduler may preempt for a request that still does not fit.

    Why: before preempting running requests to seat a waiting one, the scheduler asks whether their release could
    seat it (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.could_start_if_freed`), and a block only the cache
    holds is room only if no block below it stays held by a request left running -- which only the cache, knowing
    what lies below what, can say."""

    def pinned_blocks(self) -> Collection[int]:
        """The cached blocks not evictable now: held by a request, or above such a block (a read-only view)."""
        ...

    def unpinned_if_released(self, released: Mapping[int, int]) -> set[int]:
        """The blocks of :meth:`pinned_blocks` that nothing would pin once ``released[b]`` of each block ``b``'s
        references were let go (the victims' tables), found without changing anything."""
        ...


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation."""

    name: str

    def write_kv(
        self,
        k: "torch.Tensor",
        v: "torch.Tensor",
        k_cache: "torch.Tensor",
        v_cache: "torch.Tensor",
        meta: "AttentionMetadata",
    ) -> None: ...

    def attend(
        self,
        q: "torch.Tensor",
        k_cache: "torch.Tensor",
        v_cache: "torch.Tensor",
        meta: "AttentionMetadata",
        scale: float,
    ) -> "torch.Tensor": ...


@runtime_checkable
class Router(Protocol):
    """Which replica of a fleet serves the next request (see :mod:`minivllm.sim.router`).

    A router sees only what a load balancer in front of the engines sees: the
    prompt and each replica's outstanding tokens (sent there, not yet streamed
    back).  It may keep state (a round-robin counter, a hash ring).
    """

    def route(self, prompt_token_ids: Sequence[int], loads: Sequence[int]) -> int:
        """Index into ``loads`` (one entry per replica, outstanding tokens) of the replica to use."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    """Text to token ids and back: what the input processor, the detokenizer and the server call.

    A Hugging Face ``PreTrainedTokenizerFast`` satisfies it, and so does a three-method stand-in (the tests'
    word tokenizer).  ``apply_chat_template`` is needed only by ``LLM.chat`` and the server's chat endpoint,
    and ``eos_token_id`` only when the caller does not give the stop ids; neither is part of this protocol.
    A tokenizer with a ``len()`` (its vocabulary, as Hugging Face's) bounds the prompt ids an engine on a
    stand-in executor accepts: an id it could not decode is refused at the door, not failed mid-step.
    """

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (the detokenizer decodes growing windows of them)."""
        ...


def seam_members(protocol: type) -> list[str]:
    """What ``protocol`` promises: the methods and attributes its class body declares (and ``__call__``).
    (A protocol here never inherits another's members, so its own class body is the whole contract.)"""
    names = {n for n in vars(protocol) if not n.startswith("_") or n == "__call__"}
    names.update(n for n in getattr(protocol, "__annotations__", {}) if not n.startswith("_"))
    return sorted(names)


def implements(value: object, protocol: type) -> bool:
    """Has ``value`` every member ``protocol`` declares?  How the engine asks about the optional protocols.

    ``hasattr``, not ``isinstance``: since Python 3.12 ``isinstance`` on a runtime protocol no longer calls
    ``__getattr__``, so a wrapper that forwards attributes (calibrate's ``RecordingExecutor``) would stop
    counting as what it wraps on some Pythons and not others.
    """
    return not missing_members(value, protocol)


def missing_members(value: object, protocol: type) -> list[str]:
    """The members ``protocol`` declares that ``value`` lacks (by ``hasattr``: see :func:`implements`)."""
    return [m for m in seam_members(protocol) if not hasattr(value, m)]


def check_seam(name: str, value: object, protocol: type) -> None:
    """Refuse, when the engine is built, an object that lacks what ``protocol`` promises the engine.

    Why here: a policy without ``order`` would otherwise fail as an ``AttributeError`` inside some later
    step, far from the mistake, with requests already admitted.  The common slip, a class passed where an
    instance belongs (``admission_policy=TenantCap`` for ``TenantCap(...)``), gets its own message.
    ``None`` (the engine's own) is always fine.
    """
    if value is None:
        return
    if isinstance(value, type):
        raise ValueError(f"{name} must be an object, got the class {value.__name__} itself "
                         f"(make one: {value.__name__}(...))")
    missing = missing_members(value, protocol)
    if missing:
        raise ValueError(f"{name}={type(value).__name__} does not implement {protocol.__name__} (minivllm.interfaces): "
                         f"it has no {', '.join(missing)}")
