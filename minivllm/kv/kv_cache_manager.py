"""The memory manager: the one owner of every KV block.

    *The scheduler decides who runs; the memory manager decides who can run.*

The scheduler thinks in tokens and requests.  The pool thinks in block ids and
reference counts.  This class stands between them and is the **only** code
that changes a refcount or a block table (the prefix cache, which it owns,
holds its own references by the same rule).  Its questions and verbs:

* capacity -- :meth:`can_provide`, :meth:`num_new_blocks`,
  :meth:`worst_case_new_blocks`: "could this request get room for N more tokens?"
* sharing -- :meth:`match_prefix` (vLLM's ``get_computed_blocks``: which cached
  blocks already hold this prompt's prefix), :meth:`share_prefix` (take them),
  :meth:`fork` (``n > 1``: a sample shares its leader's prompt blocks),
  :meth:`share_computed` (admission's choice between the two) and
  :meth:`cache_full_blocks` (offer newly filled blocks to the prefix cache; the engine calls
  :meth:`cache_new_full_blocks` once a step, and a block filled after ones already cached goes to
  the cache's ``extend``, so the cost does not grow with the request's length);
* growth -- :meth:`allocate_slots`: grow a table, copy-on-write a shared last block;
* giving back -- :meth:`free` (finish, abort, recompute preemption),
  :meth:`swap_out` / :meth:`swap_in` (swap preemption to and from a host tier).

**Block tables are append-only while a request runs.**  A block is never
replaced under a running request: if the request computes a block whose twin
is already cached, it keeps its own copy and the cache keeps its own (vLLM
does the same), so ids the executor already saw never change meaning.  The
one exception is copy-on-write: when a request is about to write into a last
block it shares (n>1 after :meth:`fork`), :meth:`allocate_slots` swaps that
last entry for a private copy first, and the copy is recorded as a block move
that the executor performs before the forward pass that writes it.

Data movement (swap copies, copy-on-write copies) is only *recorded* here as
:class:`BlockMoves`; the executor performs them before the next forward pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

from minivllm.interfaces import PeeksPrefix, PeeksPrefixBlocks, PrefixCache, TracksPins, implements
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix.base import TokenRun
from minivllm.kv.sharing import copies_made
from minivllm.request import Request, RequestStatus


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks ``num_tokens`` tokens occupy (ceil division)."""
    return -(-num_tokens // block_size)


def _looked_up_tokens(req: Request) -> TokenRun:
    """The tokens a prefix lookup of ``req`` compares: all but the last (never matched: the model must run on it
    to produce the logits the next token is sampled from), read in place from the prompt and output lists.

    Why a view: ``req.all_token_ids[:-1]`` would build the concatenation and then cut it, two copies of the whole
    sequence on every lookup (a first-block miss at 4,000 tokens: 5.7 us that way, 2.1 us this way).  The built-in caches
    group a :class:`TokenRun` into blocks in C, as they do a list, so a full hit costs no more (27 us against 31
    on the radix tree).
    """
    prompt, output = req.prompt_token_ids, req.output_token_ids
    return TokenRun((prompt, output) if output else (prompt,), max(len(prompt) + len(output) - 1, 0))


def _swapped_out(req: Request) -> bool:
    """Is ``req``'s KV parked on the host tier?  Then it shares no cached block: a swap-in brings its own back.

    Either mark says so: the host blocks come with the swap-out, a moment before the status does, and the status
    stays ``SWAPPED`` after a swap-in handed the host blocks back, until the request runs."""
    return req.status is RequestStatus.SWAPPED or bool(req.cpu_block_ids)


@dataclass
class BlockMoves:
    """Copies the executor performs before a step's forward pass, in this order.

    ``swap_in`` are ``(cpu, gpu)`` pairs, ``swap_out`` ``(gpu, cpu)`` pairs and
    ``copies`` ``(src, dst)`` device pairs (copy-on-write).  Swap-ins go first
    because a host block freed by a swap-in may be reused by a swap-out in the
    same step; swap-outs go before copies because a device block freed by a
    swap-out may be handed out as a copy's destination.
    """

    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.swap_in or self.swap_out or self.copies)


@dataclass(frozen=True)
class PrefixHit:
    """The cached blocks that already hold a prompt's first ``num_tokens`` tokens."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


@dataclass
class KVStats:
    """Counters the memory manager keeps (read by ``LLMEngine.stats()`` and the labs)."""

    # tokens a preempted request did not compute again when re-admitted (not hits): its cached prefix, or, for a
    # sample whose leader still runs, the prompt it shares again with the leader (:meth:`KVCacheManager.fork`)
    # when the cache holds less of the sample's own tokens than that (:meth:`KVCacheManager.share_computed`)
    recompute_hit_tokens: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0


class KVCacheManager:
    """Owner of the block pool, the host (swap) tier, the prefix cache and every block table."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        prefix_cache: PrefixCache | None = None,
        cpu_pool: BlockPool | None = None,
        share_prefix_cache_across_tenants: bool = False,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.cpu_pool = cpu_pool
        self.share_across_tenants = share_prefix_cache_across_tenants
        self.stats = KVStats()
        self._moves = BlockMoves()
        # Requests whose KV is parked in the host tier (each holds host blocks, and only they do), kept here where
        # the host blocks change hands: ``LLMEngine.stats()`` runs every served step, and counting them by a
        # walk over the waiting queue cost 1.4 ms a step with 10,000 waiting, eight times the step's own host work.
        self.num_swapped = 0
        # Bumped by every change this manager makes to any block table (the only code that makes one): a reader
        # that kept something computed from the tables (``LLMEngine``'s per-tenant block count, kept from the step
        # log for the ``stats()`` read after the step) knows it still holds while this is unchanged, in O(1)
        # instead of comparing each table with a copy.  It lives here and not in the pool because the pool never
        # sees a table: a learner's pool (lab 2) plugs in below this class and cannot change one unseen.
        self.table_changes = 0
        self._peek = None  # the cache's side-effect-free count of a cached prefix, if it has one
        self._names = None  # the cache itself if it can name those blocks without side effects (PeeksPrefixBlocks)
        self._pins = None  # the cache itself if it can say which cached blocks a release unpins (TracksPins)
        if prefix_cache is not None:
            self._adopt(prefix_cache)

    def _adopt(self, cache: PrefixCache) -> None:
        """Make ``cache`` take its references on this manager's pool.

        A cache built by its caller (``LLM(prefix_cache=HashIndex(...))``) was built before the engine's pool
        existed, so on a pool of its own: it would incref blocks this pool never handed out ("block 0 is free"
        at the first filled block).  It is rebound here, as :meth:`replace_pool` rebinds, if it holds nothing
        yet; one that already holds blocks names memory this pool never wrote, and one of another block size
        would match other tokens per block: both are refused before anything runs.
        """
        if cache.block_size != self.block_size:
            raise ValueError(f"prefix_cache has block_size={cache.block_size}, the engine block_size="
                             f"{self.block_size}; build it with the engine's block size")
        if getattr(cache, "pool", self.pool) is not self.pool:
            if cache.num_cached_blocks:
                raise ValueError(f"prefix_cache already holds {cache.num_cached_blocks} cached block(s) of "
                                 f"another pool; pass an empty cache")
            cache.pool = self.pool
        self._peek = cache.peek if implements(cache, PeeksPrefix) else None
        self._names = cache if implements(cache, PeeksPrefixBlocks) else None
        self._pins = cache if implements(cache, TracksPins) else None

    def replace_pool(self, pool) -> None:
        """Run on another pool object (lab 2's learner pool); only before any request is added."""
        if self.pool.num_used:
            raise ValueError("the pool can only be replaced while no block is in use")
        self.pool = pool
        if self.prefix_cache is not None:
            self.prefix_cache.pool = pool

    # -- capacity ------------------------------------------------------------
    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus the cached blocks that can be evicted now: held by no request, nor pinned by a
        held block cached after them (a cached block only the cache holds may still be pinned: not counted)."""
        evictable = self.prefix_cache.num_evictable_blocks() if self.prefix_cache else 0
        return self.pool.num_free + evictable

    @property
    def num_used_blocks(self) -> int:
        """Blocks requests hold (and cached blocks a held block pins): the pool less what an allocation could get.

        The one definition of "used": a cached block no request holds is reusable on demand, so it is not used -- as
        vLLM's ``kv_cache_usage_perc``.  :meth:`usage` and the scheduler's peak read it; ``stats()`` subtracts the
        available count it has already read (a learner's cache walks its index for it), and a step record keeps
        ``available_blocks`` so that counts rebuilt from the log (``metrics_from_step_log``, bench offline's peak)
        subtract the same number."""
        return self.pool.num_blocks - self.num_available_blocks

    def can_provide(self, num_blocks: int) -> bool:
        """Could ``num_blocks`` blocks be handed out now (evicting cached ones if needed)?

        Free blocks are checked first: the engine's caches keep their evictable
        count up to date (O(1) to ask, see :class:`~minivllm.kv.prefix.base.PinIndex`),
        but a learner's cache, or one on a pool that cannot report sharing, counts
        it by a walk over every cached block -- asked only when the free list alone
        is not enough.
        """
        return num_blocks <= self.pool.num_free or num_blocks <= self.num_available_blocks

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        """Blocks ``req`` must gain to hold ``num_new_tokens`` more tokens.

        While a request is swapped out its device table is empty, so this also
        counts the blocks a swap-in needs.
        """
        needed = blocks_for(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(req.block_ids))

    def num_copy_on_write_blocks(self, req: Request) -> int:
        """1 when ``req``'s next token lands in a partly filled block someone else holds (a sample
        just forked from its leader): writing it takes one more block, a private copy.  Admission charges a
        new sample this copy; a recount of several holders charges fewer (:func:`~minivllm.kv.sharing.copies_made`)."""
        return int(self._last_block_is_shared(req))

    def num_new_blocks_all(self, reqs, worst_case: bool = False) -> int:
        """Blocks still needed to hold every token the requests have (``worst_case``: every token they may come
        to hold, ``max_total_tokens``), plus the private copies their next writes make of shared partly filled
        last blocks (:meth:`_claims_of` counts both).  The scheduler asks it for all running requests in every
        step that something waits for admission."""
        total, writers = self._claims_of(reqs, worst_case)
        if writers:
            refcount = self.pool.refcount
            for b, n in writers.items():  # copies_made(n, refcount(b)), inlined (n >= 1, refcount >= 2): a call
                total += min(n, refcount(b) - 1)  # per block cost 8-16 us a count with 32 forked groups writing
        return total

    def _claims_of(self, reqs, worst_case: bool) -> tuple[int, dict[int, int]]:
        """The one count of what requests still claim, as ``(missing, writers)``: ``missing``, the blocks they
        still need for every token they have (``worst_case``: for ``max_total_tokens``), summed; ``writers``, per
        shared partly filled last block, how many of them write into it next (each makes a private copy first,
        :func:`~minivllm.kv.sharing.copies_made` says how many are made).  :meth:`num_new_blocks_all` reads it for
        all of ``reqs``, :meth:`claims_as_they_leave` for all and then for each request that leaves.

        One loop with no call per request, because the scheduler asks it for all running requests in every step
        that something waits for admission.  The writer test is :meth:`_last_block_is_shared`'s, inlined; it is
        skipped when no block has two holders (:meth:`may_share`)."""
        bs, refcount, total = self.block_size, self.pool.refcount, 0
        shared = self.may_share()
        writers: dict[int, int] = {}
        for r in reqs:
            table = r.block_ids
            held = r.max_total_tokens if worst_case else len(r.prompt_token_ids) + len(r.output_token_ids)
            need = -(-held // bs) - len(table)
            if need > 0:
                total += need
            done = r.num_computed_tokens
            if shared and done % bs and table and done < len(table) * bs and refcount(table[-1]) > 1:
                b = table[-1]  # (the next write lands in it: see _last_block_is_shared)
                writers[b] = writers.get(b, 0) + 1
        return total, writers

    def claims_as_they_leave(self, reqs, leaving, worst_case: bool = False) -> Iterator[tuple[int, int]]:
        """What :meth:`num_new_blocks_all` counts for ``reqs``, and the blocks given back, as ``leaving`` (some of
        ``reqs``, each once) let go of their blocks one by one in that order: ``(claimed, given_back)`` with none
        gone, then after each.  ``claimed`` counts the requests still there; ``given_back``, the blocks of those
        gone that no one but the prefix cache holds any more (free, or cached and evictable).

        Why not :meth:`num_new_blocks_all` of the requests left, less the gone requests' tables: both counts read
        the holders of a block as they stand.  A block the gone requests shared with one another or with one that
        stays comes back once, or not at all; and a copy charged because a gone request held the block its writer
        writes into is not made once it left (the writer finds the block its own).  A leader and its samples made
        reject mode's hint (:meth:`~minivllm.engine.llm_engine.LLMEngine.retry_steps`) count both wrong, and a
        victim's co-holder made :meth:`~minivllm.sched.scheduler.Scheduler._victims_could_make_room` refuse a
        preemption that had room.  Kept per gone request at the cost of its table (a generator: a caller stops
        once it has room), not recounted from all that stay.  (A cached block that a prompt twin's held block
        below it pins is counted as given back all the same: not evictable yet, though no request holds it.)
        Refcounts, tables and computed counts must not change while it is read (each leaving request's own claim
        is read again as it goes), and ``leaving`` must be some of ``reqs``: neither is checked, for the cost."""
        refcount, cache = self.pool.refcount, self.prefix_cache
        claimed, writers = self._claims_of(reqs, worst_case)
        gone: Counter = Counter()  # block -> references the gone requests held

        def copies(b: int) -> int:  # the copies the writers still there make, the gone requests' holds let go
            return copies_made(writers[b], refcount(b) - gone[b])

        claimed += sum(copies(b) for b in writers)
        given_back = 0
        yield claimed, given_back
        for r in leaving:
            missing, mine = self._claims_of((r,), worst_case)  # its own claim, and the block it writes next
            claimed -= missing
            for b in r.block_ids:
                if b in writers:
                    claimed -= copies(b)
                gone[b] += 1
                if b in mine:
                    writers[b] -= 1
                if b in writers:
                    claimed += copies(b)
                if refcount(b) - gone[b] == (1 if cache is not None and cache.is_cached(b) else 0):
                    given_back += 1
            yield claimed, given_back

    def may_share(self) -> bool:
        """Could any block have two holders (so a write may have to copy it first)?  ``False`` only when the
        engine's own pool counts none: then the copy-on-write checks of a whole batch or of every running
        request are skipped, which at block size 16 is a refcount lookup for 15 of 16 decodes.  Only the
        engine's own pool is trusted with the count (a learner's pool, or a subclass overriding
        incref/decref, may not keep it)."""
        return not (type(self.pool) is BlockPool and self.pool.num_shared == 0)

    def could_start_if_freed(self, req: Request, reqs, reserved: int) -> bool:
        """Could a waiting ``req`` get its blocks if ``reqs`` gave theirs back, ``reserved`` blocks staying
        promised to others?  ``False`` means certainly not; ``True``, perhaps.

        The scheduler asks before preempting ``reqs`` to seat ``req``: a preemption that ends without
        ``req`` admitted throws the victims' work away for nothing.  The room is bounded from above: the
        blocks available now (free or evictable), plus each block of theirs no one else holds (one still
        in another table stays taken; one only the prefix cache keeps becomes evictable -- unless a block below
        it that a request left running holds keeps it pinned, which the last clauses check), less the
        cached blocks ``req`` would share that were counted so far (shared, they stop being evictable; one
        pinned now was not counted), less ``reserved``.  The need is its tokens in blocks, less the blocks it
        would start on (:meth:`_start_blocks`, admission's own choice: its cached prefix, or, a sample, its
        leader's blocks), plus the private copy its first write makes when those end in a partly filled block
        (a fork's: the leader still holds it).  A sample whose leader is among ``reqs`` starts alone once they
        go: its cached prefix.  A swapped-out request shares nothing: it needs its swapped blocks back and room
        for the rest of its tokens, what its admission checks (:meth:`Scheduler._try_admit`).  (Reject mode
        never asks: it never preempts.)
        """
        held: dict[int, int] = {}
        for r in reqs:
            for b in r.block_ids:
                held[b] = held.get(b, 0) + 1
        cache, refcount = self.prefix_cache, self.pool.refcount
        room, victims_cached = self.num_available_blocks - reserved, []
        for b, n in held.items():  # each block's fate once the victims let go, found once
            left = refcount(b) - n
            if left == 0:
                room += 1  # back to the free list
            elif left == 1 and cache is not None and cache.is_cached(b):
                victims_cached.append(b)  # the cache's alone: room once nothing below it stays held
        if _swapped_out(req):
            start = PrefixHit()
        elif req.leader is not None and any(r is req.leader for r in reqs):
            start = self.match_prefix(req)  # its leader gone, it cannot fork (can_fork): it starts alone
        else:
            start = self._start_blocks(req)[0]
        hit = set(start.block_ids)  # (distinct: one block per position)
        need = blocks_for(req.num_tokens, self.block_size) - len(hit) + (start.num_tokens % self.block_size > 0)
        # A hit block that only the cache holds now and no victim holds is counted in ``room`` if evictable now;
        # shared, it stops being room.  (A leader's block that stays is never evictable.)
        idle_hits = [b for b in hit if b not in held and refcount(b) == 1 and cache is not None and cache.is_cached(b)]
        room -= len(idle_hits)
        if self._pins is None:  # (a cache that cannot say what pins what, lab 3's: each victims' cached block is room)
            return room + sum(1 for b in victims_cached if b not in hit) >= need
        if room >= need:  # yes without any victim's cached block: the cache need not be asked
            return True
        # A cached block that only the cache holds may still be pinned by a block below it (a request whose
        # prefix twin was cached first caches its later blocks below the twin): not evictable now, yet evictable
        # once the victims go -- if every held block below it is the victims' alone.  One that a request left
        # running holds keeps it pinned (counting it anyway, the bound preempted two victims for a request that
        # still did not fit), and keeps pinned the victims' own cached blocks above it.  The cache, which knows
        # what pins what, says which blocks pinned now the release unpins (O(pinned blocks), asked only where the
        # answer turns on it); every victims' cached block is among the pinned now (a victim holds it), so these
        # are all the room the cache gains.  One the request would share stays taken; and a hit block taken off
        # ``room`` above that is pinned now was never in it: it goes back.
        pinned, unpinned = self._pins.pinned_blocks(), self._pins.unpinned_if_released(held)
        room += sum(1 for b in unpinned if b not in hit) + sum(1 for b in idle_hits if b in pinned)
        return room >= need

    def worst_case_new_blocks(self, req: Request) -> int:
        """Blocks ``req`` could still need if it ran to ``max_tokens`` (reject mode reserves these)."""
        cow = int(self._last_block_is_shared(req))
        return max(0, blocks_for(req.max_total_tokens, self.block_size) - len(req.block_ids)) + cow

    def could_ever_hold(self, num_tokens: int) -> bool:
        """Would ``num_tokens`` tokens of one request fit the whole pool if it were alone?"""
        return blocks_for(num_tokens, self.block_size) <= self.pool.num_blocks

    def usage(self) -> float:
        """Fraction of blocks an allocation cannot get (:attr:`num_used_blocks` of the pool)."""
        return self.num_used_blocks / self.pool.num_blocks

    # -- sharing ---------------------------------------------------------------
    def namespace(self, req: Request) -> Hashable:
        """The prefix-cache namespace of a request: ``(tenant, cache_salt)``.

        A tuple, never a joined string: ``("a|salt=x", None)`` and
        ``("a", "x")`` are different spaces whatever characters the names
        hold.  Tenants do not share cached blocks by default, because a shared
        cache leaks across users by timing: a fast first token tells an
        attacker that somebody else recently sent the same prefix (vLLM
        CVE-2025-46570).  The salt splits a space further on request.
        """
        tenant = None if self.share_across_tenants else req.tenant
        return (tenant, req.cache_salt or None)  # "" (refused at the boundary; a Request built directly): no salt

    @staticmethod
    def namespace_tenant(namespace: Hashable):
        """The tenant a namespace of :meth:`namespace` belongs to (None: shared): per-tenant cache quotas group by it."""
        return namespace[0] if isinstance(namespace, tuple) and namespace else None

    def match_prefix(self, req: Request) -> PrefixHit:
        """The longest cached prefix of ``req``'s tokens (a lookup: no reference is taken).

        The last token is never matched: the model must run on it to produce
        the logits the next token is sampled from.
        """
        if self.prefix_cache is None:
            return PrefixHit()
        blocks = self.prefix_cache.match(_looked_up_tokens(req), self.namespace(req))
        return PrefixHit(tuple(blocks), len(blocks) * self.block_size)

    def computed_if_admitted(self, req: Request) -> int:
        """The tokens of ``req`` that would count as computed once admitted, as admission would find them now:

        - a swapped-out request: its own, brought back from the host tier;
        - a sample whose leader is live: what :meth:`fork` leaves (all but the last prompt token) or, for a
          restarted sample, its own cached blocks where they hold more (:meth:`share_computed`).  Admission waits
          for the leader's prefill, so while the leader lives the sample is admitted no other way -- unless the
          leader samples one token only: it finishes in the step that prefills it, and its samples start alone.
          A sample whose leader was rejected keeps this answer: a group is turned away whole, so it is never
          served, and the answer does not change halfway through the pass that rejected it;
        - any other request: the cached prefix :meth:`match_prefix` would return, counted without taking a
          reference or making a cached block recent (:class:`~minivllm.interfaces.PeeksPrefix`).

        The fork counted is the one :meth:`can_fork` will allow once the leader holds blocks, not whether it allows
        it now: a leader still prefilling counts, and so does one swapped out.  (A sample admitted while its leader
        is off the device after its prefill starts alone -- :meth:`Scheduler._leader_ready` -- and this answer is
        then up to ``prompt - 1`` tokens high, which moves only its own tenant's later requests in that pass.)

        Why: an admission policy that charges only the prompt a request will prefill (WFQ) must know what the
        cache will spare it before admission looks the cache up.  Exact while the cache keeps what it holds and
        each sample's leader holds its blocks: within one pass only an eviction (a swap-in taking blocks) or a
        leader leaving the device changes it, so the count can only be more than admission then finds, never
        less.  A cache without ``peek`` counts nothing cached.  Cost: the blocks the cache compares (the built-in
        caches stop at the first miss; no tokens are copied).
        """
        if _swapped_out(req):
            return req.num_computed_tokens
        leader = req.leader
        if (leader is not None and leader.max_tokens > 1
                and (not leader.status.finished or leader.status is RequestStatus.FINISHED_REJECTED)):
            # what fork leaves computed, or, a restarted sample, its own cached blocks if they hold more
            return max(req.num_prompt_tokens - 1, self._restart_tokens(req))
        return self._peeked_tokens(req)

    def _peeked_tokens(self, req: Request) -> int:
        """The tokens of ``req`` :meth:`match_prefix` would find now, counted by the cache's ``peek`` (no reference
        taken, no block made recent); 0 for a cache without ``peek``."""
        if self._peek is None:
            return 0
        tokens, limit = self._peeked_run(req)
        return min(self._peek(tokens, self.namespace(req)), limit) * self.block_size

    def _peeked_run(self, req: Request) -> tuple[Sequence[int], int]:
        """What a peek of ``req`` looks up, and the most blocks of it that count: the tokens :meth:`match_prefix`
        looks up (all but the last), read as :func:`_looked_up_tokens` -- or, a prompt alone, the prompt list itself,
        capped at the blocks of all but its last token (they lead the prompt, so the capped count is the run's).

        Why the list: a peek runs for every request WFQ hands out, and building the run cost a first-block miss
        half again (1.1 -> 1.55 us at 4,000 tokens).  Both peeks (:meth:`_peeked_tokens`, :meth:`held_prefix_blocks`)
        read it, so they look up the same tokens."""
        if req.output_token_ids:
            tokens = _looked_up_tokens(req)
            return tokens, len(tokens) // self.block_size
        prompt = req.prompt_token_ids
        return prompt, max(len(prompt) - 1, 0) // self.block_size

    # -- what a waiting request would share with a group (KV caps) ------------------------------------
    def share_key(self, req: Request) -> int | None:
        """The hash of ``(namespace, its first block of tokens)`` for a waiting ``req`` that could start on cached
        blocks, the key :meth:`prefix_keys_holding` answers in; None when it can share no cached block -- a
        swapped-out request (it brings its own blocks back), fewer tokens than a full block to look up, or a cache
        that cannot name blocks without side effects (:class:`~minivllm.interfaces.PeeksPrefixBlocks`).

        Why a key: a lookup returns blocks of one prefix only, the one whose first block is the request's own, so
        two requests with different keys can never share the same cached blocks, and a request whose key no held
        prefix has shares none.  Fixed while it waits (its tokens, tenant and salt do not change), so the scheduler
        works it out once, when the request enters its queue: a tuple of ``block_size`` tokens, no lookup.  Hashed
        once here because the scheduler files it in dicts at every change to its queue (a tuple's hash is not
        kept: a nested one of 16 tokens cost ~0.3 us a time).  Two keys whose hashes collide (2^-64 a pair) only
        count as one class in the scheduler's shortcuts (``Scheduler._share_class``): a failure may then stand for
        a request that would share more, the over-charge the cap always made; what a request is charged is found
        by its own lookup (:meth:`held_prefix_blocks`), never from its key."""
        if self._names is None or _swapped_out(req):
            return None
        bs, prompt = self.block_size, req.prompt_token_ids
        if len(prompt) > bs:  # (all of the prompt but its last token is looked up: a full first block)
            first = tuple(prompt[:bs])
        else:
            tokens = _looked_up_tokens(req)
            if len(tokens) < bs:
                return None
            first = tuple(tokens[:bs])
        return hash((self.namespace(req), first))

    def prefix_keys_holding(self, block_ids) -> set:
        """The :meth:`share_key` of every cached prefix holding one of ``block_ids`` (a cap group's blocks): a waiting
        request whose key is not among them shares none of those blocks.  Read without side effects; empty for a
        cache that cannot say (:meth:`share_key` is then None for every request)."""
        if self._names is None:
            return set()
        return {hash(key) for key in self._names.first_block_keys(block_ids)}

    def cached_prefix_blocks(self, req: Request) -> list[int]:
        """The blocks of the cached prefix a waiting ``req`` would start on (empty when :meth:`share_key` is None:
        it can share no cached block).  Found by :meth:`~minivllm.interfaces.PeeksPrefixBlocks.peek_blocks` on the
        tokens :meth:`match_prefix` looks up: no reference taken, no block made recent, no hit counted -- the
        request may not be admitted in this pass.  Never more than admission then spares: the cached prefix is
        what :meth:`share_computed` takes (a held block cannot be evicted, nor the blocks before it in its
        prefix); a sample that forks from its leader instead takes all of its prompt but the last token from the
        leader, which its group holds, less the copy of a partly filled last block -- at least the cached prefix of
        that prompt."""
        if self._names is None or _swapped_out(req):
            return []
        tokens, limit = self._peeked_run(req)
        return self._names.peek_blocks(tokens, self.namespace(req))[:limit]

    def held_prefix_blocks(self, req: Request, held, keys, blocks: Sequence[int] | None = None) -> list[int]:
        """Per group key in ``keys``: how many blocks of the cached prefix a waiting ``req`` would start on
        (:meth:`cached_prefix_blocks`) the group already holds (``held``, a :class:`~minivllm.kv.sharing.GroupBlocks`
        kept for the running requests).  Admission shares those blocks, so the group gains none of them: ``req``
        costs its group its KV cap need less this.  ``blocks``: that prefix as the caller already peeked it, while
        the cache is unchanged -- the 429 retry hint asks each request again as the group's members leave, and the
        lookup, not the count, is what costs (1,000 waiting members: 1,904 lookups per hint, 1,001 once each)."""
        if blocks is None:
            blocks = self.cached_prefix_blocks(req)
        return [held.num_held(k, blocks) if blocks else 0 for k in keys]

    def _restart_tokens(self, req: Request) -> int:
        """What the cache holds of a restarted sample's own tokens (:meth:`_peeked_tokens`); 0 for a sample that
        has generated nothing, without a lookup.

        Why: a sample preempted by recompute had its full blocks cached, output included, so the cache may
        hold more of it than the ``prompt - 1`` tokens :meth:`fork` gives back (in a fuzz, 194 of 687 fork
        re-admissions, 313 tokens computed again for nothing).  Only a sample with output tokens is looked up: one that never ran shares its prompt
        with its leader, and the leader's blocks already cover all of it but the last token, which no lookup
        matches beyond.  That keeps the lookup off every first admission of a sample.  Both
        :meth:`computed_if_admitted` and :meth:`share_computed` decide by this one count, so the charge a
        policy reads and the tokens admission finds agree (a cache without ``peek`` counts 0: such a sample
        forks, as the charge says).
        """
        return self._peeked_tokens(req) if req.output_token_ids else 0

    def share_prefix(self, req: Request, hit: PrefixHit) -> None:
        """``req`` (holding no blocks) takes a reference on each hit block and skips computing them."""
        assert not req.block_ids, "a request shares a prefix only before it holds blocks"
        for b in hit.block_ids:
            self.pool.incref(b)
        req.block_ids = list(hit.block_ids)
        self.table_changes += 1
        req.num_computed_tokens = hit.num_tokens
        req.num_inserted_blocks = len(hit.block_ids)

    def share_computed(self, req: Request) -> None:
        """Give a waiting ``req`` (holding no blocks, not swapped out) the KV it need not compute: admission's one
        way to start a request on the device.

        A sample whose leader holds blocks (:meth:`can_fork`) forks from it (``prompt - 1`` tokens), unless it is a
        restarted sample whose own blocks the cache holds further (:meth:`_restart_tokens`): then it shares
        those.  Any other request shares its cached prefix (:meth:`match_prefix`).  On a tie it forks: a match
        would give it no more and make the cached blocks it walked recent for nothing.  Why here and not in the
        scheduler: the choice decides which blocks gain a reference, and :meth:`computed_if_admitted` must promise
        the same count.
        """
        start, forks = self._start_blocks(req)
        if forks:
            self.fork(req.leader, req)
        else:
            self.share_prefix(req, start)

    def _start_blocks(self, req: Request) -> tuple[PrefixHit, bool]:
        """The blocks :meth:`share_computed` would give ``req`` now and the tokens they hold, and whether they are
        its leader's (a fork, which leaves ``prompt - 1`` tokens computed: a partly filled last block is shared
        with the leader, and ``req``'s first write copies it).  One choice, read by admission and by the room
        bound (:meth:`could_start_if_freed`) alike, so the bound weighs the start admission will make."""
        if self.can_fork(req):
            fork_tokens = req.num_prompt_tokens - 1
            if self._restart_tokens(req) > fork_tokens:
                hit = self.match_prefix(req)
                if hit.num_tokens > fork_tokens:  # (what peek counted, unless a learner's match disagrees)
                    return hit, False
            return PrefixHit(tuple(req.leader.block_ids[:self._fork_blocks(req)]), fork_tokens), True
        return self.match_prefix(req), False

    def _fork_blocks(self, child: Request) -> int:
        """How many of its leader's blocks a forking sample shares: those of all its prompt but the last token
        (the one it computes itself, to sample from)."""
        return blocks_for(child.num_prompt_tokens - 1, self.block_size)

    @staticmethod
    def can_fork(req: Request) -> bool:
        """May ``req`` start by sharing its leader's blocks (:meth:`fork`) rather than looking the cache up?
        A sample of an ``n > 1`` request may while its leader runs; once the leader is gone it starts alone.
        (A restarted sample forks only when the cache holds no more of its own tokens: :meth:`share_computed`.)"""
        leader = req.leader
        return leader is not None and bool(leader.block_ids) and not leader.status.finished

    def fork(self, parent: Request, child: Request) -> None:
        """``n > 1``: ``child`` shares ``parent``'s prompt blocks and recomputes only the last prompt token.

        The child writes that token's K/V into the last shared block, so
        :meth:`allocate_slots` copies it first (copy-on-write) unless the token
        starts a new block.
        """
        assert not child.block_ids, "a sample forks only before it holds blocks"
        child.block_ids = list(parent.block_ids[:self._fork_blocks(child)])
        self.table_changes += 1
        for b in child.block_ids:
            self.pool.incref(b)
        child.num_computed_tokens = child.num_prompt_tokens - 1
        child.num_inserted_blocks = 0

    def record_admission(self, req: Request) -> None:
        """Hit accounting, once a request is really admitted (never for tried-and-undone admissions).

        Only a request's first admission counts as a lookup.  A preempted request
        that finds its tokens again (in the cache, or, a sample, in its leader's blocks: whichever
        :meth:`share_computed` found to hold more) saved recompute; that is reported apart
        (``recompute_hit_tokens``) and never inflates the hit rate.  A sample forked from its leader at its first
        admission counts nothing (the leader's lookup did); one whose leader was gone looked the cache up like any
        request, and counts like one.
        """
        if self.prefix_cache is None or _swapped_out(req):
            return  # (called before the status becomes RUNNING: a swap-in brought its own blocks back)
        if req.prefix_lookup_recorded:
            self.stats.recompute_hit_tokens += req.num_computed_tokens
        elif self.can_fork(req):  # (asked in the same pass as the admission: the leader has not changed)
            req.prefix_lookup_recorded = True
            req.num_cached_tokens = req.leader.num_cached_tokens
        else:
            req.prefix_lookup_recorded = True
            self.prefix_cache.record_lookup(req.num_prompt_tokens, req.num_computed_tokens)
            req.num_cached_tokens = req.num_computed_tokens

    def cache_new_full_blocks(self, seqs: list) -> None:
        """:meth:`cache_full_blocks` for the step's sequences that filled a block (1 step in ``block_size``
        for a decode): one comprehension finds them, instead of a call per sequence per step.  A row that
        failed in execution computed nothing, so it is not found; its status is checked all the same."""
        bs = self.block_size
        for seq in [s for s in seqs if (r := s.request).num_computed_tokens // bs > r.num_inserted_blocks >= 0]:
            if seq.request.status is not RequestStatus.FINISHED_ERROR:
                self.cache_full_blocks(seq.request)

    def cache_full_blocks(self, req: Request) -> None:
        """Offer every newly filled block of ``req`` to the prefix cache (prompt chunks and decodes alike).

        Where the cache already holds the same tokens in another block, the
        request keeps its own block (tables are append-only); the cache keeps
        its copy, and the request caches nothing more (see the comment below).
        """
        if self.prefix_cache is None or req.num_inserted_blocks < 0:
            return
        bs = self.block_size
        full = min(req.num_computed_tokens // bs, len(req.block_ids))
        done = req.num_inserted_blocks
        if full <= done:
            return
        # The blocks cached before are this request's path in the cache: only the new ones are handed over
        # (one decode's block every block_size steps costs the same at token 50 as at token 5,000).
        if done and self.prefix_cache.extend(req.block_ids[done - 1], req.token_ids_slice(done * bs, full * bs),
                                             req.block_ids[done:full], self.namespace(req)):
            req.num_inserted_blocks = full
            return
        result = self.prefix_cache.insert(req.all_token_ids[: full * bs], req.block_ids[:full], self.namespace(req))
        if result.block_ids != req.block_ids[:full]:
            # A twin of this request's prefix was cached first.  Caching our later blocks would hang
            # them below the twin and pin blocks we do not hold, so this request caches no more.
            req.num_inserted_blocks = -1
            return
        req.num_inserted_blocks = full

    # -- growth ------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_new_tokens`` more tokens.

        All or nothing: returns False (and changes nothing) if the blocks are
        not there.  Before the request writes into its current last block, a
        shared last block is copied (copy-on-write), so a sibling sample or a
        cached prefix never sees another request's tokens.

        The first test is the common decode case: the new tokens fit the table as
        it is and the block they land in is the request's own (15 of 16 decode
        steps at block size 16), so nothing is computed beyond two comparisons.
        (Without KV caps the scheduler hands the 16th step's decodes, whose tables
        are full, to :meth:`grow_full_tables` first; with them every scheduled
        sequence comes here, after its group's cap check.)
        """
        blocks, computed, bs = req.block_ids, req.num_computed_tokens, self.block_size
        if computed + num_new_tokens <= len(blocks) * bs and (
            computed % bs == 0 or self.pool.refcount(blocks[-1]) == 1
        ):
            return True
        n = self.num_new_blocks(req, num_new_tokens)
        cow = self._last_block_is_shared(req)
        if not self.can_provide(n + int(cow)):
            return False
        if cow:
            self._copy_on_write_last(req)
        if n:
            self.table_changes += 1
        for _ in range(n):
            req.block_ids.append(self._take_block())
        return True

    def seqs_needing_blocks(self, seqs: list) -> list:
        """The scheduled sequences whose tokens do not fit their block tables as they stand.

        That is: they need a new block, or the block their next token lands in is
        shared (copy-on-write).  The others would get ``True`` from
        :meth:`allocate_slots` without any change, so the scheduler skips them (without KV caps;
        with them it checks every sequence against its group's cap); at block size 16 that is
        15 of 16 decodes.  One comprehension, no call per sequence.
        """
        bs, refcount = self.block_size, self.pool.refcount
        if not self.may_share():  # no block with two holders: no copy-on-write to look for
            return [s for s in seqs if (r := s.request).num_computed_tokens + s.num_tokens > len(r.block_ids) * bs]
        return [s for s in seqs
                if (c := (r := s.request).num_computed_tokens) + s.num_tokens > len(r.block_ids) * bs
                or (c % bs and refcount(r.block_ids[-1]) > 1)]

    def grow_full_tables(self, seqs: list) -> list:
        """Give new blocks, in order, to the sequences whose held blocks are all full; return the rest.

        That is the decode crossing into a new block (1 step in 16 at block size
        16): there is no last block to copy, and while the free list has room no
        cached block needs evicting, so the new blocks come straight off the free
        list -- the same blocks :meth:`allocate_slots` would hand out.  It stops at
        the first sequence that needs more than that; that one and those after it
        are returned, for :meth:`allocate_slots` (and preemption) one by one, in order.
        """
        pool, bs = self.pool, self.block_size
        free = pool.num_free
        if seqs:
            self.table_changes += 1  # (once, before any grows: a bump with no change only costs a reader a recount)
        for i, s in enumerate(seqs):
            blocks = s.request.block_ids
            n = -(-s.num_tokens // bs)
            if s.request.num_computed_tokens != len(blocks) * bs or n > free:
                return seqs[i:]
            free -= n
            for _ in range(n):
                blocks.append(pool.allocate())
        return []

    def _take_block(self) -> int:
        """One block off the free list, evicting one cached block only when the list is empty: cached blocks
        stay reusable as long as possible, and the caller asked :meth:`can_provide` first, so one eviction
        always frees one."""
        if self.pool.num_free == 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(1)
        return self.pool.allocate()

    def _last_block_is_shared(self, req: Request) -> bool:
        """True when the next token lands in a partly filled block that someone else holds."""
        if not req.block_ids or req.num_computed_tokens % self.block_size == 0:
            return False
        if req.num_computed_tokens >= len(req.block_ids) * self.block_size:
            return False
        return self.pool.refcount(req.block_ids[-1]) > 1

    def _copy_on_write_last(self, req: Request) -> None:
        """Swap ``req``'s shared last block for a private one.  The pool allocates the copy before it drops the
        shared original (which stays in use by its other holders), so a free block is needed: one cached
        block is evicted first if the list is empty.  The data copy is only recorded, for the executor."""
        old = req.block_ids[-1]
        if self.pool.num_free == 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(1)
        new, needs_copy = self.pool.copy_on_write(old)
        if needs_copy:
            self._moves.copies.append((old, new))
        req.block_ids[-1] = new
        self.table_changes += 1

    def take_block_moves(self) -> BlockMoves:
        """The copies the executor must perform before this step's forward pass."""
        moves, self._moves = self._moves, BlockMoves()
        return moves

    # -- giving back -------------------------------------------------------------
    def free(self, req: Request) -> None:
        """Drop all of ``req``'s references, on both tiers; cached blocks stay alive in the prefix cache.

        Also resets what the request had computed: a freed request starts over.
        """
        self._forget_pending_copies(req.block_ids)
        self.pool.free_all(req.block_ids)
        if req.cpu_block_ids:
            self.cpu_pool.free_all(req.cpu_block_ids)
            self.num_swapped -= 1
        req.block_ids = []
        self.table_changes += 1
        req.cpu_block_ids = []
        req.num_computed_tokens = 0
        req.num_inserted_blocks = 0

    def swap_out(self, req: Request) -> bool:
        """Move ``req``'s computed KV to the host tier and free its device blocks.

        Returns False (and changes nothing) when the host tier lacks room; the
        scheduler then recomputes instead.  Blocks the request holds beyond its
        computed tokens (allocated this step, never written) are just freed.
        """
        keep = blocks_for(req.num_computed_tokens, self.block_size)
        if self.cpu_pool is None or keep == 0 or self.cpu_pool.num_free < keep:
            return False
        # A block copied-on-write in this very step is not written yet: swap its source instead.
        pending = {dst: src for src, dst in self._moves.copies}
        self._forget_pending_copies(req.block_ids)
        for gpu in req.block_ids[:keep]:
            req.cpu_block_ids.append(self.cpu_pool.allocate())
            self._moves.swap_out.append((pending.get(gpu, gpu), req.cpu_block_ids[-1]))
        self.pool.free_all(req.block_ids)
        req.block_ids = []
        self.table_changes += 1
        self.stats.swapped_out_blocks += keep
        self.num_swapped += 1
        return True

    def drop_swapped_copy(self, req: Request) -> None:
        """Undo :meth:`swap_out` for a request whose copy out never ran (the step that carried it failed): its host
        blocks hold nothing it wrote, so they go back and the request starts over, as a recomputed one does."""
        self.stats.swapped_out_blocks -= len(req.cpu_block_ids)
        self.free(req)

    def uncount_swap_ins(self, moves: BlockMoves) -> None:
        """Take back the count of :meth:`swap_in` for the copies in of a step that failed (``moves``, the step's
        block moves): the executor performs them first and may fail right there, so they may never have run,
        and ``swapped_in_blocks`` counts what crossed the link, as :meth:`drop_swapped_copy` keeps
        ``swapped_out_blocks``.  Counted from the moves, not per request: a request swapped in by that step may
        since have been preempted again (freed, its computed tokens forgotten, or swapped out once more), and
        its copy in was counted all the same.  The blocks themselves are the scheduler's to deal with."""
        self.stats.swapped_in_blocks -= len(moves.swap_in)

    def swap_in(self, req: Request) -> None:
        """Bring a swapped-out request's KV back into fresh device blocks (the caller checked room)."""
        assert req.cpu_block_ids and not req.block_ids, "swap_in needs a swapped-out request"
        if not self.can_provide(len(req.cpu_block_ids)):
            raise RuntimeError("swap_in without room: the scheduler must check can_provide first")
        self.table_changes += 1
        for cpu in req.cpu_block_ids:
            req.block_ids.append(self._take_block())
            self._moves.swap_in.append((cpu, req.block_ids[-1]))
        self.cpu_pool.free_all(req.cpu_block_ids)
        self.stats.swapped_in_blocks += len(req.cpu_block_ids)
        req.cpu_block_ids = []
        self.num_swapped -= 1

    def _forget_pending_copies(self, block_ids: list[int]) -> None:
        """Copies into blocks that are being given back need not happen."""
        if self._moves.copies and block_ids:
            gone = set(block_ids)
            self._moves.copies = [(s, d) for s, d in self._moves.copies if d not in gone]
