"""A hash-index prefix cache assembled from three functions a learner writes (lab 3).

Lab 3 has the learner write the chained block hash, the prefix match and the
eviction choice; :class:`LearnerHashCache` puts them together into an object
with the engine's prefix-cache methods, so the learner's code runs the same
replays, on the same :class:`~minivllm.kv.block_pool.BlockPool`, as the
engine's own :class:`~minivllm.kv.prefix.hash_index.HashIndex`.

It lives in ``kv/`` (like :class:`~minivllm.kv.block_pool.PoolAdapter` for
lab 2's pool) because it takes and drops references on the pool's blocks: the
rule that only ``minivllm/kv/`` changes refcounts holds for learners' caches too.
The learner's functions only read the index and pick keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, NamedTuple, Sequence

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix.base import InsertResult, PrefixCacheStats


class IndexEntry(NamedTuple):
    """What a hash index stores per key: the block, and what it needs to validate a hit."""

    block_id: int
    tokens: tuple
    parent: Hashable | None  # the key of the previous block, None for the first


@dataclass(eq=False)
class LearnerHashCache:
    """A hash-index prefix cache built from the learner's three functions.

    It has the methods the engine's replay needs (``match``, ``insert``,
    ``evict``, ``record_lookup``, ``is_cached``...).  ``match`` receives
    ``token_ids`` already cut before the last prompt token (the engine's
    contract), while the learner's ``match_prefix`` does that cut itself, so a
    placeholder token is appended before calling it.
    """

    pool: BlockPool
    block_size: int
    hasher: Callable
    matcher: Callable
    picker: Callable | None
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    index: dict = field(default_factory=dict)
    children: dict = field(default_factory=dict)
    last_access: dict = field(default_factory=dict)
    clock: int = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self.index)

    def is_cached(self, block_id: int) -> bool:
        return any(e.block_id == block_id for e in self.index.values())

    def num_evictable_blocks(self) -> int:
        """A walk over the learner's index.  The engine's caches keep this count as locks change (O(1)); a lab's
        cache of a few hundred blocks pays the walk where the engine asks -- twice a step (the scheduler's peak and
        the step log's ``available_blocks``), and when the free list alone cannot serve an allocation."""
        return sum(1 for e in self.index.values() if self.pool.refcount(e.block_id) == 1)

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.stats.record_lookup(query_tokens, hit_tokens)

    def match(self, token_ids: Sequence[int], namespace: str = "") -> list[int]:
        self.clock += 1
        salt = namespace or None
        hits = self.matcher(list(token_ids) + [-1], self.index, self.block_size, self.hasher, salt)
        keys = self.hasher(list(token_ids), self.block_size, salt)
        for k in keys[: len(hits)]:
            self.last_access[k] = self.clock
        return list(hits)

    def extend(self, parent_block: int, token_ids: Sequence[int], block_ids: Sequence[int],
               namespace: str = "") -> bool:
        return False  # the learner's cache is always given the whole prefix (insert below)

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], namespace: str = "") -> InsertResult:
        self.clock += 1
        bs = self.block_size
        keys = self.hasher(list(token_ids[: len(block_ids) * bs]), bs, namespace or None)
        canonical, already, parent, counting = list(block_ids), 0, None, True
        for i, k in enumerate(keys):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            entry = self.index.get(k)
            if entry is not None:
                if entry.tokens != tokens or entry.parent != parent:
                    break  # a collision: cache nothing from here on
                canonical[i] = entry.block_id
                already += bs if counting else 0
            else:
                counting = False
                self.index[k] = IndexEntry(block_ids[i], tokens, parent)
                self.pool.incref(block_ids[i])
                self.children[k] = 0
                if parent is not None:
                    self.children[parent] += 1
                self.stats.inserted_blocks += 1
            self.last_access[k] = self.clock
            parent = k
        return InsertResult(already, canonical)

    def evict(self, num_blocks: int) -> int:
        freed = 0
        if self.picker is None:  # no eviction rule yet (exercise 3): nothing is evicted
            return 0
        while freed < num_blocks:
            nodes = [{"id": k, "last_access": self.last_access[k], "locks": self.pool.refcount(e.block_id) - 1,
                      "children": self.children[k]} for k, e in self.index.items()]
            victim = self.picker(nodes)
            if victim is None:
                break
            entry = self.index.pop(victim)
            if entry.parent is not None:
                self.children[entry.parent] -= 1
            del self.children[victim], self.last_access[victim]
            self.pool.decref(entry.block_id)
            self.stats.evicted_blocks += 1
            freed += 1
        return freed

    def reset(self) -> None:
        """Evict every block the learner's rule lets go (all of them once nothing is locked)."""
        self.evict(self.num_cached_blocks)
