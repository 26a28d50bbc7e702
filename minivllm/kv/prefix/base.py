"""The pieces both prefix caches share: results, stats, the LRU of leaves, quotas.

Why a prefix cache?  Many requests start with the same tokens (a system
prompt, a few-shot preamble, the earlier turns of a chat).  Their KV blocks
are identical, so a request whose prompt starts with an already computed,
block-aligned prefix can reuse those blocks and prefill only the rest.

Two classic data structures answer "which blocks hold the longest cached
prefix of these tokens?":

* :class:`minivllm.kv.prefix.radix.RadixCache` -- an SGLang-style radix tree whose
  edges are spans of whole blocks;
* :class:`minivllm.kv.prefix.hash_index.HashIndex` -- a vLLM-style dict from a chained
  block hash to the block.

Both satisfy the :class:`~minivllm.interfaces.PrefixCache` protocol, so the
engine is written once and the two can be compared
(``minivllm.bench.prefix_structures``).  :func:`minivllm.kv.prefix.make_prefix_cache`
builds either by name.

Ownership rule (the one idea to remember)
-----------------------------------------
The cache holds **exactly one** pool reference on every block it indexes: it
calls ``pool.incref`` when it starts caching a block and ``pool.decref`` when it
evicts it.  Running requests hold their own references through their block
tables.  Hence, for a cached block ``b``:

* ``pool.refcount(b) > 1``  -> some request uses it: *locked*, never evicted;
* ``pool.refcount(b) == 1`` -> only the cache holds it: evictable once no other
  cached block depends on it as a parent (leaves go before parents, so that
  every cached block's prefix stays cached).

Only *full* blocks are cached.  A partially filled block is still being
written by its request, so sharing it would need copy-on-write of a half
block for little gain; the partial tail of a sequence is simply ignored.

Namespaces and quotas
---------------------
``namespace`` is an opaque hashable value built by the KV cache manager: the
tuple ``(tenant, cache_salt)``, e.g. ``("alice", "x")``, never a joined string
(``"a|salt=x"`` as a tenant name must not land in tenant ``"a"``'s space).
With ``share_across_tenants`` and no salt it is ``(None, None)``, the shared
space; a cache used on its own (tests, labs) defaults to ``()``.
A block cached under one namespace is never matched under another, so one
tenant cannot learn from timing whether another tenant sent some prompt.

``quota_blocks`` bounds how many blocks each namespace may keep cached.
Per-tenant quotas refine it: ``quota_group`` maps a namespace to the key its
blocks are counted under (the KV manager passes "the tenant", so all of a
tenant's salted namespaces share one budget and a client cannot multiply its
share by inventing salts), and ``quota_for(group)`` gives that group's quota
(``None``: ``quota_blocks``).  An
insert that would go over the quota first evicts that namespace's *own*
least-recently-used evictable blocks; when nothing more can go, the extra
blocks are simply not cached.  So no tenant can push out another tenant's
blocks through the quota path.  The global :meth:`~minivllm.interfaces.PrefixCache.evict`, which the
engine calls when the pool runs dry, is plain LRU across all namespaces: at
that point memory is genuinely short and the oldest block should go whoever
owns it.

Determinism
-----------
Recency is measured with a logical clock (:class:`LogicalClock`), an integer
that advances once per ``match``/``insert``/``extend``; wall time never enters, so the
same sequence of calls always evicts the same blocks.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from minivllm.kv.block_pool import BlockPool

PUBLIC_NAMESPACE: Hashable = ()
"""The default namespace of a cache used on its own (tests, labs).  The engine never uses it: a request's
namespace is ``(tenant, cache_salt)`` -- ``("default", None)`` without either -- and the space tenants share
when ``share_prefix_cache_across_tenants`` is on is ``(None, None)``."""


# -- values returned to the engine -------------------------------------------


@dataclass(frozen=True)
class InsertResult:
    """What :meth:`~minivllm.interfaces.PrefixCache.insert` did.

    ``num_already_cached_tokens`` is the length of the leading part that was
    already cached *before* this call (a multiple of ``block_size``).
    ``block_ids`` is the canonical block list for the inserted full blocks:
    where a position was already cached under a different block, the cached
    (canonical) id is reported.  The engine does not swap: a block table is
    append-only, so the request keeps its own (duplicate) block and stops
    caching (see ``KVCacheManager.cache_full_blocks``); a caller that owns its
    tables could swap.  Positions that could not be cached (quota) keep the
    caller's own id.
    """

    num_already_cached_tokens: int
    block_ids: list[int]


@dataclass
class PrefixCacheStats:
    """Counters the engine reports.

    Lookups are counted through :meth:`~minivllm.interfaces.PrefixCache.record_lookup`, not by
    ``match`` itself, so the engine can keep recomputation after preemption
    (which hits blocks the request itself just wrote) out of the hit rate.
    ``evicted_blocks`` counts every eviction; ``quota_evictions`` is the part
    of it caused by a namespace reaching its quota.
    """

    queries_tokens: int = 0
    hits_tokens: int = 0
    inserted_blocks: int = 0
    evicted_blocks: int = 0
    quota_evictions: int = 0

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """One first lookup of a request: ``query_tokens`` looked up, ``hit_tokens`` of them served."""
        self.queries_tokens += query_tokens
        self.hits_tokens += hit_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up tokens that were served from the cache."""
        if self.queries_tokens == 0:
            return 0.0
        return self.hits_tokens / self.queries_tokens


# -- shared pieces ----------------------------------------------------------------


def sha256_block_hash(key: object) -> bytes:
    """A hash that is stable across processes (and costly to collide on purpose).

    An alternative ``hash_fn`` for :class:`~minivllm.kv.prefix.hash_index.HashIndex`;
    ``repr`` of nested tuples of ints, bytes and strings is deterministic.
    """
    return hashlib.sha256(repr(key).encode()).digest()


def split_into_blocks(
    token_ids: Sequence[int], block_size: int, num_blocks: int | None = None
) -> list[tuple[int, ...]]:
    """Cut ``token_ids`` into full blocks, each a hashable tuple.

    With ``num_blocks`` given, exactly that many blocks are returned and the
    tokens must cover them; otherwise every full block is returned and a
    partial tail is dropped.  Blocks are compared and hashed by value, so
    pass Python ints (a list or tuple), not a tensor, whose elements hash by
    identity.
    """
    num_full = len(token_ids) // block_size
    if num_blocks is None:
        num_blocks = num_full
    elif num_blocks > num_full:
        raise ValueError(
            f"{num_blocks} block ids need {num_blocks * block_size} tokens, "
            f"got {len(token_ids)}"
        )
    # one way to cut blocks: LazyBlocks' (in C for a list or tuple), read whole here
    return list(itertools.islice(LazyBlocks(token_ids, block_size), num_blocks))


class TokenRun(Sequence[int]):
    """The first ``length`` tokens of ``parts`` laid end to end (a request's prompt, then its output), read in place.

    Why: a lookup wants a request's tokens less the last one (:meth:`KVCacheManager.match_prefix`, whose last
    token is never matched) or its prompt and output as one sequence (a peek); building either as a list copied
    the whole sequence -- 3.6 of the 5.7 us a lookup took at 4,000 tokens when its first block missed -- before
    the cache compared a block.  :class:`LazyBlocks` iterates a run in C as it does a list (stopping after its last full
    block); any other reader (a learner's cache) gets an ordinary sequence.  ``parts`` are read in place, never
    copied: they must not change while the run is in use.
    """

    __slots__ = ("parts", "_len")

    def __init__(self, parts: tuple[list[int], ...], length: int) -> None:
        if not 0 <= length <= sum(map(len, parts)):
            raise ValueError(f"a run of {length} tokens over parts of {[len(p) for p in parts]}")
        self.parts = parts
        self._len = length

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(itertools.chain.from_iterable(self.parts), self._len)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if step != 1:
                return list(self)[i]
            out: list[int] = []
            for part in self.parts:  # each part's share of [start, stop), in its own coordinates
                if start < len(part) and stop > 0:
                    out += part[max(start, 0) : stop]
                start -= len(part)
                stop -= len(part)
            return out
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"token {i} of {self._len}")
        for part in self.parts:
            if i < len(part):
                return part[i]
            i -= len(part)
        raise AssertionError("unreachable: the length was checked against the parts")


class LazyBlocks(Sequence[tuple[int, ...]]):
    """The full blocks of ``token_ids`` -- what :func:`split_into_blocks` returns -- each cut only when read.

    Why: a lookup walks blocks in order and stops at its first miss, so cutting the whole prompt into tuples
    first cost O(prompt) even when block 0 misses.  :meth:`LeafEviction.peek` runs for every waiting request
    an admission policy hands out (WFQ), most of them not admitted in that step, and :meth:`LeafEviction.match`
    for every request admitted; read lazily, either costs the blocks it compares.  The walks iterate, once and
    in order, and keep none of the blocks they read (a radix edge split stores slices of the tree's own
    tuples), so they take this as they take a list.  Iterating a list or tuple groups its own iterator into
    blocks in C (``zip`` of one iterator ``block_size`` times), which cuts a block faster than slicing does, so
    a fully cached prompt costs no more than cutting it whole first did; a :class:`TokenRun` (a request's
    tokens less the last, or its prompt and output) is grouped the same way from its parts' iterators, cut off
    after its last full block (a cut per block, not per token: an ``islice`` over every token doubled the cost);
    other sequences are sliced block by block.  Indexing a block (a method call) is for other callers.
    ``token_ids`` is read in place, never copied: it must not change while this is in use.
    """

    __slots__ = ("_tokens", "_block_size", "_len")

    def __init__(self, token_ids: Sequence[int], block_size: int) -> None:
        self._tokens = token_ids
        self._block_size = block_size
        self._len = len(token_ids) // block_size

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        tokens, size = self._tokens, self._block_size
        if isinstance(tokens, (list, tuple)):
            return zip(*[iter(tokens)] * size)  # each step takes the next ``size`` tokens; a partial tail is dropped
        if isinstance(tokens, TokenRun):
            parts = tokens.parts
            it = iter(parts[0]) if len(parts) == 1 else itertools.chain.from_iterable(parts)
            return itertools.islice(zip(*[it] * size), self._len)
        return self._sliced(tokens, size)

    def _sliced(self, tokens: Sequence[int], size: int) -> Iterator[tuple[int, ...]]:
        for start in range(0, self._len * size, size):
            yield tuple(tokens[start : start + size])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"block {i} of {self._len}")
        start = i * self._block_size
        return tuple(self._tokens[start : start + self._block_size])


def check_new_blocks(
    new_block_ids: Sequence[int], is_cached: Callable[[int], bool], pool: BlockPool
) -> None:
    """Validate blocks about to be cached, before any is cached or any recency changes: if this raises, what
    is cached and what a lookup returns are as before (a radix walk may have split an edge on the way, which
    changes neither).

    A block holds the KV of one token prefix, so it can sit at one place in
    the cache only; seeing it elsewhere means the caller's table is wrong.
    And the caller must hold the blocks it hands over: caching a free block
    would index memory that the pool may give to someone else.
    """
    if len(set(new_block_ids)) != len(new_block_ids):
        raise ValueError(f"duplicate block ids in {list(new_block_ids)}")
    for block_id in new_block_ids:
        if is_cached(block_id):
            raise ValueError(f"block {block_id} is already cached at another position")
        if pool.is_free(block_id):
            raise ValueError(f"block {block_id} is free; the caller must hold it")


@dataclass
class LogicalClock:
    """A counter that stands in for time, so LRU order is reproducible."""

    now: int = 0

    def tick(self) -> int:
        self.now += 1
        return self.now


QuotaGroup = Callable[[Hashable], Hashable]
QuotaFor = Callable[[Hashable], "int | None"]


@dataclass
class NamespaceCounts:
    """How many blocks each quota group has cached, against an optional quota.

    Every method takes a *namespace* and counts it under ``group_of(namespace)``
    (the namespace itself by default), so callers never handle group keys.
    """

    quota_blocks: int | None = None
    group_of: QuotaGroup | None = None
    quota_for: QuotaFor | None = None
    _counts: dict[Hashable, int] = field(default_factory=dict)

    def key(self, namespace: Hashable) -> Hashable:
        return namespace if self.group_of is None else self.group_of(namespace)

    def quota(self, namespace: Hashable) -> int | None:
        """The quota of ``namespace``'s group (its own, else ``quota_blocks``; None: unbounded)."""
        if self.quota_for is not None:
            q = self.quota_for(self.key(namespace))
            if q is not None:
                return q
        return self.quota_blocks

    def count(self, namespace: Hashable) -> int:
        return self._counts.get(self.key(namespace), 0)

    def add(self, namespace: Hashable, n: int) -> None:
        k = self.key(namespace)
        self._counts[k] = self._counts.get(k, 0) + n

    def remove(self, namespace: Hashable, n: int) -> int:
        """Subtract ``n``; return what is left in the group (empty groups are forgotten)."""
        k = self.key(namespace)
        left = self._counts.get(k, 0) - n
        if left:
            self._counts[k] = left
        else:
            self._counts.pop(k, None)
        return left

    def excess(self, namespace: Hashable, wanted: int) -> int:
        """How many blocks must go before ``wanted`` more fit in the quota."""
        quota = self.quota(namespace)
        if quota is None:
            return 0
        return max(0, self.count(namespace) + wanted - quota)

    def room(self, namespace: Hashable, wanted: int) -> int:
        """How many of ``wanted`` new blocks the quota lets in now."""
        quota = self.quota(namespace)
        if quota is None:
            return wanted
        return max(0, min(wanted, quota - self.count(namespace)))


K = TypeVar("K", bound=Hashable)


@dataclass
class LeafLru(Generic[K]):
    """The eviction candidates (leaves) ordered by last use.

    A binary heap with *lazy invalidation*: re-touching a leaf pushes a new
    heap entry instead of searching for the old one, and a side dict records
    each leaf's current ``(tick, seq)``.  A popped entry whose stamp differs
    from the dict is stale and skipped.  :meth:`discard` is O(1), and
    :meth:`touch` and :meth:`pop_oldest` are O(log n) *amortized*, not each
    call: a pop may skip many stale entries, and the touch that finds the
    heap above ``2n + 64`` entries (``n`` live leaves, so more stale entries
    than live ones) rebuilds it from the dict in O(n).  Each stale entry was
    left by one earlier touch or discard, which pays for skipping or dropping
    it, so the work stays O(log n) per operation over any sequence of them.

    Whether a leaf is *evictable* also depends on pool refcounts, which
    change in the pool; this LRU is not told (the pool reports sharing to the
    cache's :class:`PinIndex`, which only counts).  So :meth:`evict` pops leaves
    in LRU order, asks the owner to evict from each, and pushes back the ones
    that turned out to be locked.
    """

    _stamp: dict[K, tuple[int, int]] = field(default_factory=dict)
    _heap: list[tuple[int, int, K]] = field(default_factory=list)
    _seq: int = 0

    def __len__(self) -> int:
        return len(self._stamp)

    def touch(self, leaf: K, tick: int) -> None:
        """Record ``leaf`` as a candidate last used at ``tick``."""
        self._seq += 1
        self._stamp[leaf] = (tick, self._seq)
        heapq.heappush(self._heap, (tick, self._seq, leaf))
        if len(self._heap) > 2 * len(self._stamp) + 64:
            self._compact()

    def discard(self, leaf: K) -> None:
        """``leaf`` is no longer a candidate (it got a child, or was removed)."""
        self._stamp.pop(leaf, None)

    def pop_oldest(self) -> tuple[K, int] | None:
        """Remove and return the least recently used leaf and its tick."""
        while self._heap:
            tick, seq, leaf = heapq.heappop(self._heap)
            if self._stamp.get(leaf) == (tick, seq):
                del self._stamp[leaf]
                return leaf, tick
        return None

    def evict(
        self,
        budget: int,
        evict_leaf: Callable[[K, int], int],
        still_leaf: Callable[[K], bool],
    ) -> int:
        """Evict up to ``budget`` blocks, oldest leaf first.

        ``evict_leaf(leaf, n)`` frees at most ``n`` blocks from the tail of
        ``leaf`` (0 when its last block is locked) and, when the leaf
        disappears, registers its parent if that became a leaf.
        ``still_leaf(leaf)`` tells whether a popped leaf survived and must
        be put back.
        """
        freed = 0
        survivors: list[tuple[K, int]] = []
        while freed < budget:
            popped = self.pop_oldest()
            if popped is None:
                break
            leaf, tick = popped
            freed += evict_leaf(leaf, budget - freed)
            if still_leaf(leaf):
                survivors.append((leaf, tick))
        for leaf, tick in survivors:
            self.touch(leaf, tick)
        return freed

    def _compact(self) -> None:
        self._heap = [(tick, seq, leaf) for leaf, (tick, seq) in self._stamp.items()]
        heapq.heapify(self._heap)


@dataclass
class LeafIndex(Generic[K]):
    """Eviction candidates kept in two orders at once.

    ``all`` is LRU across every namespace (what :meth:`~minivllm.interfaces.PrefixCache.evict` uses
    when the pool runs dry); ``by_namespace`` holds one LRU per namespace (what
    the quota path uses, so a tenant over quota only ever evicts its own
    blocks).  Both structures index their leaves through this one class.
    """

    all: LeafLru[K] = field(default_factory=LeafLru)
    by_namespace: dict[Hashable, LeafLru[K]] = field(default_factory=dict)
    group_of: QuotaGroup | None = None  # same grouping as the quota counts (per tenant, say)

    def namespace(self, namespace: Hashable) -> LeafLru[K]:
        """The LRU of ``namespace``'s quota group."""
        key = namespace if self.group_of is None else self.group_of(namespace)
        leaves = self.by_namespace.get(key)
        if leaves is None:
            leaves = self.by_namespace[key] = LeafLru()
        return leaves

    def mark(self, leaf: K, namespace: Hashable, tick: int) -> None:
        self.all.touch(leaf, tick)
        self.namespace(namespace).touch(leaf, tick)

    def unmark(self, leaf: K, namespace: Hashable) -> None:
        self.all.discard(leaf)
        key = namespace if self.group_of is None else self.group_of(namespace)
        leaves = self.by_namespace.get(key)
        if leaves is not None:
            leaves.discard(leaf)

    def drop_namespace(self, namespace: Hashable) -> None:
        """Forget the LRU of ``namespace``'s group (call once the group holds no block)."""
        self.by_namespace.pop(namespace if self.group_of is None else self.group_of(namespace), None)


class PinIndex:
    """The cached blocks that cannot be evicted now, kept up to date instead of recounted.

    A cached block is *pinned* when it or a block below it (later in the same
    prefix) is locked, i.e. held by a request too (pool refcount > 1): evicting it
    would orphan the locked block's prefix.  Counting that by walking every cached
    block made ``num_evictable_blocks`` O(cached blocks), and the scheduler asks
    it while admitting whenever the free list alone is short -- with a warm cache,
    every step.  Here each pinned block keeps ``pins[b]`` = (1 if ``b`` is locked)
    + (number of pinned blocks right below it); a change walks up only while a
    block switches between pinned and unpinned, so locking a prefix root-first
    costs O(1) per block.

    Locks change in the pool, not in the cache, so the pool reports them
    (:meth:`~minivllm.kv.block_pool.BlockPool.watch_sharing`: a block's count
    crossing between 1 and 2).  The cache calls :meth:`follow` when it is built,
    and :meth:`num_pinned` follows a pool that replaced it (lab 2 swaps in a
    learner's pool); a pool that cannot report is recounted on every call
    (:meth:`_pinned_set`, the scan this index replaces).
    """

    def __init__(self) -> None:
        self.parent: dict[int, int | None] = {}  # cached block -> the cached block before it (None: first)
        self.pins: dict[int, int] = {}
        self._pool = None  # the pool whose reports keep ``pins`` current (None: not listening)

    def add(self, block: int, parent: int | None, pool) -> None:
        """``block`` became cached right below ``parent`` (the cache already holds its reference)."""
        self.parent[block] = parent
        if pool is self._pool and pool.refcount(block) > 1:
            self._change(block, 1)

    def remove(self, block: int) -> None:
        """``block`` was evicted (never a pinned one: eviction takes unlocked leaves only)."""
        del self.parent[block]
        if self.pins.pop(block, 0):
            raise AssertionError(f"evicted block {block} was pinned")

    def on_sharing(self, block: int, shared: bool) -> None:
        """The pool's report: ``block``'s refcount went 1 -> 2 (``shared``) or 2 -> 1."""
        if block in self.parent:
            self._change(block, 1 if shared else -1)

    def follow(self, pool) -> bool:
        """Listen to ``pool``'s reports from now on (recounting once); False if it cannot report."""
        if self._pool is not None:
            self._pool.unwatch_sharing(self.on_sharing)
            self._pool = None
        watch = getattr(pool, "watch_sharing", None)
        if watch is None or not watch(self.on_sharing):
            return False
        self._pool = pool
        self.pins = {}
        for block in self.parent:
            if pool.refcount(block) > 1:
                self._change(block, 1)
        return True

    def num_pinned(self, pool) -> int:
        return len(self.pinned(pool))

    def pinned(self, pool):
        """The pinned blocks themselves (read-only): the index's keys, or a fresh count for a pool it cannot follow."""
        if pool is not self._pool and not self.follow(pool):  # (a pool replaced since, or one that cannot report)
            return self._pinned_set(pool)
        return self.pins.keys()

    def unpinned_if_released(self, pool, released: Mapping[int, int]) -> set[int]:
        """The blocks pinned now that nothing would pin once ``released[b]`` references to each block ``b`` went:
        every block at or below one stays unlocked (the cache's own reference aside).  Side-effect free.

        Why: a victim's release unpins a cached block only where every lock below it is the victims'; one held
        by a request that keeps running keeps the block, and everything above it, pinned.  What stays pinned is
        :meth:`_pinned_set` of the locks left, walked from the blocks pinned now only (a release only drops
        references, so no other block is locked after it): O(pinned blocks), not O(cached blocks)."""
        pinned = self.pinned(pool)
        stays = self._pinned_set(pool, released, pinned)
        return {b for b in pinned if b not in stays}

    def _pinned_set(self, pool, released: Mapping[int, int] | None = None, blocks: Iterable[int] | None = None
                    ) -> set[int]:
        """Pinned blocks counted from scratch: every block still locked once ``released[b]`` of each block ``b``'s
        references went (none by default), and the blocks above it; ``blocks`` (default: every cached block) are
        the ones looked at for a lock.  Each block is marked once: a climb stops at the first block already marked,
        since everything above a pinned block is pinned.  (Names bound once: without ``released`` this is the recount
        every read of a learner's pool makes, once per cached block.)"""
        refcount, parent, pinned = pool.refcount, self.parent, set()
        get = released.get if released else None
        for block in self.parent if blocks is None else blocks:
            if block not in pinned and refcount(block) - (get(block, 0) if get else 0) > 1:  # locked
                b: int | None = block
                while b is not None and b not in pinned:
                    pinned.add(b)
                    b = parent[b]
        return pinned

    def _change(self, block: int | None, delta: int) -> None:
        pins, parent = self.pins, self.parent
        while block is not None:
            n = pins.get(block, 0) + delta
            if n:
                pins[block] = n
            else:
                del pins[block]
            if n != (1 if delta > 0 else 0):
                return  # it was pinned before and still is: nothing above changes
            block = parent[block]


@dataclass(eq=False)
class LeafEviction:
    """What both caches share: their settings, counters and indexes, and the eviction and quota logic.

    Lookup and insertion are one algorithm on either structure (:meth:`match`, :meth:`insert`); what
    differs is how a structure is walked and grown.  A subclass adds its structure (a tree, a dict) after
    these fields, the protocol members this class does not supply (``num_cached_blocks``, ``is_cached``,
    ``num_evictable_blocks``, ``extend``) and these hooks:

    - ``_walk(namespace, blocks) -> path``: the entries (nodes) holding the longest cached prefix of
      ``blocks``, root first; ``blocks`` is a list (:meth:`insert`) or a :class:`LazyBlocks` (:meth:`match`),
      so iterate it, read only the blocks compared and keep none of them;
    - ``_count_cached(namespace, blocks) -> int``: how many leading ``blocks`` are cached, the structure left
      exactly as it is (:meth:`peek`); ``blocks`` is a :class:`LazyBlocks`, so read only the blocks compared;
    - ``_cached_blocks(namespace, blocks) -> block ids``: the KV blocks of the longest cached prefix of
      ``blocks``, the structure left exactly as it is (:meth:`peek_blocks`); ``blocks`` as for ``_count_cached``;
    - ``_holders() -> {block id: entry}``: the entry (node) holding each cached block, each with ``first_key``,
      ``(namespace, tokens of its first block)`` of the prefix it belongs to, kept as entries are made;
    - ``_path_blocks(path) -> block ids``: the KV blocks that path holds, in order;
    - ``_touch_path(path, tick)``: make the path recent;
    - ``_cache_below(path, namespace, blocks, new_ids)``: cache ``new_ids`` (holding ``blocks``) after
      the path, under the namespace's quota;
    - ``_evict_leaf(leaf, budget) -> freed`` and ``_is_live_leaf(leaf) -> bool``: eviction.
    """

    pool: BlockPool
    block_size: int = 16
    quota_blocks: int | None = None
    quota_group: QuotaGroup | None = None  # namespace -> the key its quota is counted under (module docstring)
    quota_for: QuotaFor | None = None  # group -> its quota in blocks (None: quota_blocks)
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    _counts: NamespaceCounts = field(init=False, repr=False)
    _clock: LogicalClock = field(default_factory=LogicalClock, repr=False)
    _leaves: LeafIndex = field(default_factory=LeafIndex, repr=False)
    _pins: PinIndex = field(default_factory=PinIndex, repr=False)

    def __post_init__(self) -> None:
        self._counts = NamespaceCounts(self.quota_blocks, self.quota_group, self.quota_for)
        self._leaves.group_of = self.quota_group
        self._pins.follow(self.pool)

    def match(self, token_ids: Sequence[int], namespace: Hashable = PUBLIC_NAMESPACE) -> list[int]:
        """See :meth:`~minivllm.interfaces.PrefixCache.match`: walk, make the matched path recent, return
        its blocks.

        The blocks are cut as the walk reads them (:class:`LazyBlocks`), as in :meth:`peek`: a lookup runs
        for every admitted request, and cutting its whole prompt first cost O(prompt) tuples even when block 0
        misses; now it costs the blocks compared.  The walk keeps no block it reads (see ``LazyBlocks``)."""
        path = self._walk(namespace, LazyBlocks(token_ids, self.block_size))
        self._touch_path(path, self._clock.tick())
        return self._path_blocks(path)

    def peek(self, token_ids: Sequence[int], namespace: Hashable = PUBLIC_NAMESPACE) -> int:
        """See :meth:`~minivllm.interfaces.PeeksPrefix.peek`: the blocks :meth:`match` would return, counted
        without its effects (nothing made recent, no tree edge split, no reference taken).

        The blocks are cut as the walk reads them (:class:`LazyBlocks`), so a peek costs the blocks it
        compares -- one when the first block misses -- not the length of the prompt."""
        return self._count_cached(namespace, LazyBlocks(token_ids, self.block_size))

    def peek_blocks(self, token_ids: Sequence[int], namespace: Hashable = PUBLIC_NAMESPACE) -> list[int]:
        """See :meth:`~minivllm.interfaces.PeeksPrefixBlocks.peek_blocks`: :meth:`peek`'s walk, naming the blocks it
        counts (read lazily in the same way)."""
        return self._cached_blocks(namespace, LazyBlocks(token_ids, self.block_size))

    def first_block_keys(self, block_ids: Iterable[int]) -> set:
        """See :meth:`~minivllm.interfaces.PeeksPrefixBlocks.first_block_keys`: each cached block's entry names its
        prefix's first block (``first_key``, set when the entry is made).

        Why kept and not climbed: capped admission asks it once per tenant per pass for every block the tenant's
        groups hold, and climbing each block to its first one (memoised) cost 2-3 times reading a kept key (72 held
        blocks: ~40 us against ~14, 2,256: ~1.2-1.9 ms against ~0.6, on a busy 2-core VM).  One first block per
        request would not do: a request whose prefix twin was cached first caches its later blocks below the twin,
        so its blocks' prefix is the twin's.  The cached ones among ``block_ids`` are picked out in C."""
        holders = self._holders()
        return {holders[b].first_key for b in holders.keys() & block_ids}

    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[int], namespace: Hashable = PUBLIC_NAMESPACE
    ) -> InsertResult:
        """See :meth:`~minivllm.interfaces.PrefixCache.insert`.

        The part of the sequence already cached keeps its cached blocks (they become the canonical ones,
        reported in the result; the engine does not swap its duplicates for them: a block table is
        append-only, so ``KVCacheManager.cache_full_blocks`` keeps its own blocks and stops caching); only
        the blocks past it are cached, below it.

        The blocks are cut whole here, unlike in :meth:`match`: every block is read, by the walk or as a new
        block to cache, so cutting them as they are read would save nothing.
        """
        blocks = split_into_blocks(token_ids, self.block_size, len(block_ids))
        path = self._walk(namespace, blocks)
        canonical = self._path_blocks(path)
        num_cached = len(canonical)
        new_ids = list(block_ids[num_cached:])
        self._cache_below(path, namespace, blocks[num_cached:], new_ids)
        return InsertResult(num_cached * self.block_size, canonical + new_ids)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        """See :meth:`~minivllm.interfaces.PrefixCache.record_lookup`."""
        self.stats.record_lookup(query_tokens, hit_tokens)

    def pinned_blocks(self):
        """Cached blocks not evictable now: locked, or above a locked block (read-only view).

        The KV manager's room bound reads it: a block the cache alone holds, pinned only by a victim's
        block below it, becomes evictable once the victim goes (:meth:`KVCacheManager.could_start_if_freed`).
        """
        return self._pins.pinned(self.pool)

    def unpinned_if_released(self, released: Mapping[int, int]) -> set[int]:
        """The blocks pinned now (:meth:`pinned_blocks`) that would be evictable if ``released[b]`` of each block
        ``b``'s references were let go (a victim's table), nothing changed (:meth:`PinIndex.unpinned_if_released`).

        The KV manager's room bound reads it: a cached block the cache alone holds is room once the victims go
        only if no block below it stays held by a request that keeps running
        (:meth:`KVCacheManager.could_start_if_freed`)."""
        return self._pins.unpinned_if_released(self.pool, released)

    def evict(self, num_blocks: int) -> int:
        """See :meth:`~minivllm.interfaces.PrefixCache.evict`; LRU across all namespaces."""
        if num_blocks <= 0:
            return 0
        return self._evict_with(self._leaves.all, num_blocks)

    def reset(self) -> None:
        self.evict(self.num_cached_blocks)

    def _evict_with(self, leaves: LeafLru, budget: int) -> int:
        freed = leaves.evict(budget, self._evict_leaf, self._is_live_leaf)
        self.stats.evicted_blocks += freed
        return freed

    def _make_room(self, namespace: Hashable, wanted: int, pin: int | None) -> int:
        """Apply the namespace quota; return how many new blocks may be cached.

        The last matched block is pinned with an extra pool reference (what a
        running request would hold) while the namespace evicts its own
        blocks, so the prefix being extended cannot be evicted from under us.
        """
        excess = self._counts.excess(namespace, wanted)
        if excess:
            if pin is not None:
                self.pool.incref(pin)
            try:
                freed = self._evict_with(self._leaves.namespace(namespace), excess)
            finally:
                if pin is not None:
                    self.pool.decref(pin)
            self.stats.quota_evictions += freed
        return self._counts.room(namespace, wanted)

