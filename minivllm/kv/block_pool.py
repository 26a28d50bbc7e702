"""The block pool: every KV block of the paged cache, a free list and reference counts.

Why reference counts?  A physical KV block can appear in several block tables at
once: two samples of the same prompt (``n > 1``), or many requests that share a
cached system prompt.  The block may only return to the free list when *nobody*
holds it any more.  Holders are block tables of running requests and, when
prefix caching is on, the prefix cache itself (it keeps one reference on every
block it indexes, so a cached block survives the request that computed it).

Copy-on-write follows from the counts: a request that is about to write into a
block whose count is above one must first copy it into a private block
(:meth:`BlockPool.copy_on_write`).

The pool knows nothing about tokens, requests or tensors; it hands out integer
block ids.  The tensors live in :mod:`minivllm.kv.kv_cache`.
"""

from __future__ import annotations

from typing import Any

from collections import deque
from dataclasses import dataclass, field


class OutOfBlocksError(RuntimeError):
    """Raised when a block is requested and the free list is empty."""


@dataclass
class BlockPool:
    """A fixed set of ``num_blocks`` KV blocks with a FIFO free list and refcounts.

    Block ids are ``0 .. num_blocks-1``.  ``allocate`` takes the *front* of the
    free list and a freed block goes to the *back* (FIFO).  In minivllm that
    order carries no caching meaning: the prefix cache holds its own reference
    on every block it indexes, so a block on the free list is never cached and
    its contents are garbage.  (vLLM differs: its free queue doubles as the
    prefix cache's LRU list, so there the order matters for hit rates.)  FIFO
    is an arbitrary but deterministic choice; what it buys is that block ids
    are a pure function of the allocate/free history, so runs, step logs and
    pictures are reproducible and a learner's pool can be compared with this
    one step by step.
    """

    num_blocks: int
    _free: deque[int] = field(init=False, repr=False)
    _refcount: list[int] = field(init=False, repr=False)
    num_shared: int = field(init=False, default=0)  # blocks with more than one holder (kept by incref/decref)
    _watchers: list = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self._free = deque(range(self.num_blocks))
        self._refcount = [0] * self.num_blocks
        self.num_shared = 0
        self._watchers = []

    def watch_sharing(self, callback) -> bool:
        """Call ``callback(block_id, shared)`` whenever a block's refcount goes 1 -> 2 (``True``) or 2 -> 1.

        The prefix cache keeps its evictable count with it (a cached block with a
        second holder is locked).  Returns False, registering nothing, for a
        subclass with its own ``incref``/``decref``: it could not promise the reports.
        """
        if type(self).incref is not BlockPool.incref or type(self).decref is not BlockPool.decref:
            return False
        self._watchers.append(callback)
        return True

    def unwatch_sharing(self, callback) -> None:
        """Stop the reports: a prefix cache that moves to another pool (the KV manager rebinds a caller's cache,
        lab 2 replaces the pool) must not keep counting this one's sharing, nor keep this pool calling it."""
        self._watchers.remove(callback)

    # -- queries ---------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def is_free(self, block_id: int) -> bool:
        return self._refcount[block_id] == 0

    # -- allocation --------------------------------------------------------
    def allocate(self) -> int:
        """Take one block off the free list with refcount 1."""
        if not self._free:
            raise OutOfBlocksError("no free KV blocks")
        block_id = self._free.popleft()
        assert self._refcount[block_id] == 0, "free list held a referenced block"
        self._refcount[block_id] = 1
        return block_id

    def allocate_many(self, n: int) -> list[int]:
        """All-or-nothing allocation of ``n`` blocks.

        Checked before the first block is taken, not undone after a failure: blocks given back go to the
        back of the free list, so a rollback would leave the list in another order than before the call.
        """
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} blocks, {len(self._free)} free")
        return [self.allocate() for _ in range(n)]

    def incref(self, block_id: int) -> None:
        """Add a holder to a block that is already in use."""
        if self._refcount[block_id] <= 0:
            raise ValueError(f"incref on free block {block_id}")
        self._refcount[block_id] += 1
        if self._refcount[block_id] == 2:
            self.num_shared += 1
            for watcher in self._watchers:
                watcher(block_id, True)

    def decref(self, block_id: int) -> bool:
        """Drop one holder; return True when the block went back to the free list."""
        if self._refcount[block_id] <= 0:
            raise ValueError(f"decref on free block {block_id} (double free)")
        self._refcount[block_id] -= 1
        if self._refcount[block_id] == 0:
            self._free.append(block_id)
            return True
        if self._refcount[block_id] == 1:
            self.num_shared -= 1
            for watcher in self._watchers:
                watcher(block_id, False)
        return False

    def free_all(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, last block first.

        Tail-first is a fixed convention (the reverse of allocation order), so
        the ids a later request receives are deterministic.  A block the prefix
        cache also holds is not freed here: the cache's reference keeps it.
        """
        for block_id in reversed(block_ids):
            self.decref(block_id)

    def copy_on_write(self, block_id: int) -> tuple[int, bool]:
        """Make ``block_id`` private to the caller before it writes.

        Returns ``(block, needs_copy)``.  If the caller is the only holder it
        keeps the block.  Otherwise a fresh block is allocated, the caller's
        reference on the shared one is dropped, and ``needs_copy`` tells the
        caller to copy the KV contents (the pool never touches tensors).
        The new block is taken before the shared one is dropped, so a dry pool
        raises with the caller's reference still held.
        """
        if self._refcount[block_id] <= 0:
            raise ValueError(f"copy_on_write on free block {block_id}")
        if self._refcount[block_id] == 1:
            return block_id, False
        new_block = self.allocate()
        self.decref(block_id)
        return new_block, True


class PoolAdapter:
    """Gives a learner's 5-method pool the full interface the engine calls.

    The learner writes ``allocate``, ``incref``, ``decref``, ``refcount`` and
    ``num_free``; everything else the engine uses (``allocate_many``,
    ``free_all``, ``copy_on_write``...) is built on those here, so the engine
    really runs on the learner's bookkeeping.

    It lives in ``kv/`` because it is part of the pool the engine runs on: the
    rule that only ``minivllm/kv/`` changes refcounts holds for learners' pools too.
    """

    def __init__(self, inner: Any, num_blocks: int) -> None:
        self.inner = inner
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.inner.num_free

    def refcount(self, b: int) -> int:
        return self.inner.refcount(b)

    def is_free(self, b: int) -> bool:
        return self.inner.refcount(b) == 0

    def allocate(self) -> int:
        return self.inner.allocate()

    def allocate_many(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks, {self.num_free} free")
        return [self.inner.allocate() for _ in range(n)]

    def incref(self, b: int) -> None:
        self.inner.incref(b)

    def decref(self, b: int) -> bool:
        return self.inner.decref(b)

    def free_all(self, block_ids: list[int]) -> None:
        for b in reversed(block_ids):
            self.inner.decref(b)

    def copy_on_write(self, b: int) -> tuple[int, bool]:
        if self.inner.refcount(b) == 1:
            return b, False
        new = self.inner.allocate()
        self.inner.decref(b)
        return new, True
