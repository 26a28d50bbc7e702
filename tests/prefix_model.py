"""A brute-force model of a prefix cache, the oracle the radix tree and the hash index are both held to.

Why spell every cached prefix out?  The two real structures share nothing but their contract, and the contract is
easy to state on a plain dict -- ``(namespace, prefix tokens) -> block`` -- and hard to get right in a tree or a
chained hash: a prefix is evictable when its block has pool refcount 1 and no cached prefix extends it by one
block; the evictable prefix used least recently goes first; a quota counts the blocks of a quota group (a
namespace alone, or every namespace of a tenant, salts included) and evicts within that group, never the prefix
being extended for its own extension.  One model for every test that needs it (``test_prefix_cache``'s state
machine, the KV hunt's tenant quotas over salts), so the policy is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix import InsertResult

Key = tuple[Hashable, tuple[int, ...]]  # (namespace, token prefix ending at a block boundary)


@dataclass
class ModelBlock:
    block_id: int
    last_used: int


class BruteForceModel:
    """Every cached prefix spelled out, with the policy applied literally (see the module docstring).

    ``group`` maps a namespace to its quota group (default: itself); ``quota_for`` a group to its own quota
    (None: the shared ``quota``).  The real pool is read (refcounts), never changed."""

    def __init__(self, pool: BlockPool, quota: int | None, block_size: int,
                 group: Callable[[Hashable], Hashable] | None = None,
                 quota_for: Callable[[Hashable], int | None] | None = None) -> None:
        self.pool, self.quota, self.bs = pool, quota, block_size
        self._group, self._quota_for = group, quota_for
        self.cached: dict[Key, ModelBlock] = {}
        self.clock = 0

    def group(self, ns: Hashable) -> Hashable:
        return self._group(ns) if self._group is not None else ns

    def quota_of(self, ns: Hashable) -> int | None:
        own = self._quota_for(self.group(ns)) if self._quota_for is not None else None
        return own if own is not None else self.quota

    def count(self, ns: Hashable) -> int:
        """Blocks cached in ``ns``'s quota group."""
        return sum(1 for key in self.cached if self.group(key[0]) == self.group(ns))

    def path(self, ns: Hashable, tokens: Sequence[int], limit: int) -> list[Key]:
        keys = []
        for i in range(1, limit + 1):
            key = (ns, tuple(tokens[: i * self.bs]))
            if key not in self.cached:
                break
            keys.append(key)
        return keys

    def touch(self, keys: list[Key]) -> None:
        self.clock += 1
        for key in keys:
            self.cached[key].last_used = self.clock

    def match(self, ns: Hashable, tokens: Sequence[int]) -> list[int]:
        keys = self.path(ns, tokens, len(tokens) // self.bs)
        self.touch(keys)
        return [self.cached[k].block_id for k in keys]

    def insert(self, ns: Hashable, tokens: Sequence[int], block_ids: list[int]) -> InsertResult:
        """What caching ``block_ids`` (the prefix of ``tokens`` they hold) leaves: the hit and the canonical list."""
        keys = self.path(ns, tokens, len(block_ids))
        self.touch(keys)
        new = block_ids[len(keys):]
        room, quota = len(new), self.quota_of(ns)
        if quota is not None:
            excess = self.count(ns) + len(new) - quota
            if excess > 0:
                self.evict(excess, self.group(ns), pinned=keys[-1] if keys else None)
            room = max(0, min(len(new), quota - self.count(ns)))
        for i, block_id in enumerate(new[:room], start=len(keys) + 1):
            self.cached[(ns, tuple(tokens[: i * self.bs]))] = ModelBlock(block_id, self.clock)
        return InsertResult(len(keys) * self.bs, [self.cached[k].block_id for k in keys] + new)

    def has_child(self, key: Key) -> bool:
        ns, prefix = key
        n = len(prefix)
        return any(k[0] == ns and len(k[1]) == n + self.bs and k[1][:n] == prefix for k in self.cached)

    def evictable_now(self, group: Hashable | None, pinned: Key | None) -> list[Key]:
        return [key for key, blk in self.cached.items()
                if (group is None or self.group(key[0]) == group) and key != pinned
                and self.pool.refcount(blk.block_id) == 1 and not self.has_child(key)]

    def evict(self, n: int, group: Hashable | None = None, pinned: Key | None = None) -> list[int]:
        """Block ids freed, in eviction order: LRU among unlocked leaves (of ``group``, if given; never ``pinned``)."""
        gone = []
        while len(gone) < n:
            candidates = self.evictable_now(group, pinned)
            if not candidates:
                break
            oldest = min(self.cached[k].last_used for k in candidates)
            victims = [k for k in candidates if self.cached[k].last_used == oldest]
            assert len(victims) == 1, "two leaves last used at one tick: the model's LRU is ambiguous"
            gone.append(self.cached.pop(victims[0]).block_id)
        return gone

    def num_evictable(self) -> int:
        def all_unlocked_below(key: Key) -> bool:
            ns, prefix = key
            return all(self.pool.refcount(blk.block_id) == 1 for k, blk in self.cached.items()
                       if k[0] == ns and k[1][: len(prefix)] == prefix)

        return sum(1 for key in self.cached if all_unlocked_below(key))

    def block_ids(self) -> set[int]:
        return {blk.block_id for blk in self.cached.values()}
