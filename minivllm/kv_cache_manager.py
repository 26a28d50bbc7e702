"""Block tables: which physical KV blocks each request owns, grown one block at a time.

The manager sits between the scheduler (which thinks in tokens) and the block
pool (which thinks in block ids).  It answers one question for the scheduler —
"can this request get room for N more tokens?" — and keeps every request's
block table exactly as long as its tokens need.

When the pool is empty it first asks the prefix cache (if any) to evict
unreferenced cached blocks; only when that fails does the scheduler have to
preempt somebody.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.block_pool import BlockPool
from minivllm.request import Request


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks ``num_tokens`` tokens occupy (ceil division)."""
    return -(-num_tokens // block_size)


@dataclass
class KVCacheManager:
    pool: BlockPool
    block_size: int
    prefix_cache: object | None = None  # a minivllm.prefix_cache.PrefixCache
    pending_copies: list[tuple[int, int]] = field(default_factory=list)

    # -- capacity ------------------------------------------------------------
    @property
    def num_available_blocks(self) -> int:
        """Free blocks plus cached blocks nobody is using (they can be evicted)."""
        evictable = self.prefix_cache.num_evictable_blocks() if self.prefix_cache else 0
        return self.pool.num_free + evictable

    def can_provide(self, num_blocks: int) -> bool:
        """Could ``num_blocks`` blocks be handed out now (evicting cached ones if needed)?

        Free blocks are checked first: counting evictable cached blocks walks the
        cache, so it is only done when the free list alone is not enough.
        """
        return num_blocks <= self.pool.num_free or num_blocks <= self.num_available_blocks

    def num_new_blocks(self, req: Request, num_new_tokens: int) -> int:
        needed = blocks_for(req.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, needed - len(req.block_ids))

    def usage(self) -> float:
        """Fraction of blocks held by running requests (cached-only blocks count as free)."""
        return 1.0 - self.num_available_blocks / self.pool.num_blocks

    # -- allocation ----------------------------------------------------------
    def _take_block(self) -> int:
        if self.pool.num_free == 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(1)
        return self.pool.allocate()

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Grow ``req``'s block table to hold ``num_new_tokens`` more tokens.

        All or nothing: returns False (and changes nothing) if the blocks are
        not there.  Before the request writes into its current last block, a
        shared last block is copied (copy-on-write), so a sibling sample or a
        cached prefix never sees another request's tokens.
        """
        n = self.num_new_blocks(req, num_new_tokens)
        cow = self._last_block_is_shared(req)
        if not self.can_provide(n + int(cow)):
            return False
        if cow:
            self._copy_on_write_last(req)
        for _ in range(n):
            req.block_ids.append(self._take_block())
        return True

    def _last_block_is_shared(self, req: Request) -> bool:
        """True when the next token lands in a partly filled block that someone else holds."""
        if not req.block_ids or req.num_computed_tokens % self.block_size == 0:
            return False
        if req.num_computed_tokens >= len(req.block_ids) * self.block_size:
            return False
        return self.pool.refcount(req.block_ids[-1]) > 1

    def _copy_on_write_last(self, req: Request) -> None:
        old = req.block_ids[-1]
        if self.pool.num_free == 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(1)
        new, needs_copy = self.pool.copy_on_write(old)
        if needs_copy:
            self.pending_copies.append((old, new))
        req.block_ids[-1] = new

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Block copies the executor must perform before this step's forward pass."""
        pairs, self.pending_copies = self.pending_copies, []
        return pairs

    def free(self, req: Request) -> None:
        """Drop the request's references; cached blocks stay alive in the prefix cache."""
        self.pool.free_all(req.block_ids)
        req.block_ids = []

    def fork(self, parent: Request, child: Request) -> None:
        """Share every block of ``parent`` with ``child`` (``n > 1`` sampling)."""
        for b in parent.block_ids:
            self.pool.incref(b)
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
