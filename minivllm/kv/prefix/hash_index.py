"""A hash index over KV blocks (the vLLM design).

Why hashing?  A block's KV depends on its own tokens *and on every token
before it*.  So the key of block ``i`` chains the key of block ``i-1``::

    key_0 = hash_fn((None,  tokens_0, namespace))
    key_i = hash_fn((key_{i-1}, tokens_i, None))

and one dict lookup per block answers "is this exact prefix cached?".  The
namespace enters only the first key; the chain carries it to every later
block.  Compared with a radix tree there are no edges to split: every block
is its own entry, and the tree shape survives only as parent links and child
counts, which eviction needs (leaves go before parents).

Collisions.  Two different prefixes may hash to the same key.  Returning the
stored block then would feed the model KV computed for *other* tokens --
silently wrong output, and across tenants a leak.  So every hit is checked
against what the entry stores: its token ids, its namespace and its parent
entry (by identity; a parent cannot be evicted while it has children, so the
link is always current).  A key that matches but fails the check is treated
as a miss, and an insert that lands on an occupied key does not cache that
block or anything after it (nor makes room for them: under a quota, no block
is evicted for a block that will not be cached).  Correctness therefore never
rests on the hash; a collision only costs a cache miss.

The default ``hash_fn`` is Python's built-in ``hash``: fast, 64 bits wide, and
deterministic within a process for ints and tuples (the namespace string is
salted per process by ``PYTHONHASHSEED``, which only changes *which* rare
collisions happen).  :func:`minivllm.kv.prefix.base.sha256_block_hash` is the
stable, collision-resistant alternative; ``hash_fn`` is injectable so tests
can force collisions.

Locking and eviction follow the ownership rule in
:mod:`minivllm.kv.prefix.base`: an entry is evictable when only the cache holds
its block (``pool.refcount == 1``) and it has no children.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from minivllm.kv.prefix.base import (
    PUBLIC_NAMESPACE,
    LeafEviction,
    check_new_blocks,
    split_into_blocks,
)

TokenBlock = tuple[int, ...]
HashFn = Callable[[object], Hashable]


# Python's built-in hash of the key tuple (see the module docstring).  Bound
# directly rather than wrapped, since it runs once per block per lookup.
default_block_hash: HashFn = hash


@dataclass(eq=False)
class HashEntry:
    """One cached block.  ``eq=False``: entries are compared by identity."""

    key: Hashable
    block_id: int
    token_ids: TokenBlock
    namespace: Hashable
    parent: HashEntry | None
    num_children: int = 0
    # The last tick this entry or (once its children are gone) any entry below it was used.  Only leaves
    # are evicted, so an inner entry's value is read only when it becomes a leaf: a child hands its own
    # value up as it is evicted (``_evict_leaf``), and touching a path need not climb to the root.
    last_used: int = 0
    # ``(namespace, tokens)`` of the first entry of its chain, fixed when the entry is made (its parent never changes)
    first_key: tuple = field(default=(), init=False, repr=False)

    def __post_init__(self) -> None:
        self.first_key = self.parent.first_key if self.parent is not None else (self.namespace, self.token_ids)


@dataclass(eq=False)
class HashIndex(LeafEviction):
    """A :class:`~minivllm.interfaces.PrefixCache` backed by a dict of chained hashes."""

    # pool, block_size, quotas, stats and the shared indexes: see LeafEviction
    hash_fn: HashFn = default_block_hash
    _table: dict[Hashable, HashEntry] = field(default_factory=dict, repr=False)
    _entry_of_block: dict[int, HashEntry] = field(default_factory=dict, repr=False)

    # -- queries -------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._entry_of_block)

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entry_of_block

    def num_evictable_blocks(self) -> int:
        """Cached blocks with no locked block at or below them (kept up to date: see ``PinIndex``)."""
        return self.num_cached_blocks - self._pins.num_pinned(self.pool)

    # -- lookup (match and insert: see LeafEviction) --------------------------------
    def _key(self, parent: HashEntry | None, namespace: Hashable, tokens: TokenBlock) -> Hashable:
        return self._chain_key(None if parent is None else parent.key, namespace, tokens)

    def _chain_key(self, parent_key: Hashable | None, namespace: Hashable, tokens: TokenBlock) -> Hashable:
        """The key of ``tokens`` after the block keyed ``parent_key`` (None: the first block of a prompt)."""
        if parent_key is None:
            return self.hash_fn((None, tokens, namespace))
        return self.hash_fn((parent_key, tokens, None))

    def _lookup(
        self, parent: HashEntry | None, namespace: Hashable, tokens: TokenBlock
    ) -> HashEntry | None:
        """The entry for ``tokens`` right after ``parent``, or None.

        A key hit that fails validation is a collision and counts as a miss.
        """
        entry = self._table.get(self._key(parent, namespace, tokens))
        if entry is None:
            return None
        if entry.parent is not parent or entry.token_ids != tokens or entry.namespace != namespace:
            return None
        return entry

    def _walk(self, namespace: Hashable, blocks: Sequence[TokenBlock]) -> list[HashEntry]:
        path: list[HashEntry] = []
        parent: HashEntry | None = None
        for tokens in blocks:
            entry = self._lookup(parent, namespace, tokens)
            if entry is None:
                break
            path.append(entry)
            parent = entry
        return path

    def _count_cached(self, namespace: Hashable, blocks: Sequence[TokenBlock]) -> int:
        return len(self._walk(namespace, blocks))  # (the walk only reads the table)

    def _cached_blocks(self, namespace: Hashable, blocks: Sequence[TokenBlock]) -> list[int]:
        return self._path_blocks(self._walk(namespace, blocks))

    def _holders(self) -> dict[int, HashEntry]:
        return self._entry_of_block

    @staticmethod
    def _path_blocks(path: list[HashEntry]) -> list[int]:
        return [entry.block_id for entry in path]  # one block per entry

    # -- insertion -------------------------------------------------------------
    def extend(
        self, parent_block: int, token_ids: Sequence[int], block_ids: Sequence[int],
        namespace: Hashable = PUBLIC_NAMESPACE,
    ) -> bool:
        """See :meth:`~minivllm.interfaces.PrefixCache.extend`.

        The walk from the root is replaced by the entry that holds ``parent_block`` (its ancestors are
        the caller's earlier blocks); the rest is :meth:`insert`'s own steps in its order, except that
        only that entry is touched, not every ancestor up to the root: an ancestor's recency is read only
        when it becomes a leaf, and by then its children have handed theirs up (see ``last_used``), so
        the eviction order is the same at O(1) instead of O(depth) per filled block.  If the walk would
        have gone further -- a valid entry already follows with the same tokens, a twin -- this is left
        to :meth:`insert`, which reports it.
        """
        entry = self._entry_of_block.get(parent_block)
        if entry is None or entry.namespace != namespace:
            return False
        blocks = split_into_blocks(token_ids, self.block_size, len(block_ids))
        if blocks and self._lookup(entry, namespace, blocks[0]) is not None:
            return False
        self._cache_below([entry], namespace, blocks, list(block_ids))
        return True

    def _cache_below(self, path: list[HashEntry], namespace: Hashable, blocks: list[TokenBlock],
                     new_ids: list[int]) -> None:
        """What :meth:`insert` and :meth:`extend` do once they know the cached ``path`` (root first, or
        only its last entry: see :meth:`extend`): check the new blocks, touch it, make room under the
        quota (pinning the path's last block), add them below it.

        The path is made recent as :meth:`_touch_path` makes it, but its last entry's leaf mark waits for the
        end, where it is known whether anything was cached below it: marked first, it was unmarked as its
        first child came, and each mark is two heap entries in the LRUs -- per block a decode fills (an
        :meth:`extend`).  Nothing reads the marks in between but a quota's eviction, which skips that entry
        either way (pinned), so what is evicted, and the marks left, are the same."""
        check_new_blocks(new_ids, self.is_cached, self.pool)
        tick = self._clock.tick()
        for entry in path:
            entry.last_used = tick
        parent = below = path[-1] if path else None
        # The new blocks' keys, up to the first one a colliding block already holds -- in the table, or an
        # earlier new block of this run (a chain can collide with itself): nothing from there on is cached, so
        # room is made (and, under a quota, blocks evicted) for the free run only.  A dict: ordered, O(1) ``in``.
        keys: dict = {}
        key = None if parent is None else parent.key
        for tokens in blocks[: len(new_ids)]:
            key = self._chain_key(key, namespace, tokens)
            if key in self._table or key in keys:
                break
            keys[key] = None
        num_new = self._make_room(namespace, len(keys), parent.block_id if parent is not None else None)
        added: HashEntry | None = None
        for key, tokens, block_id in zip(itertools.islice(keys, num_new), blocks, new_ids):
            entry = self._add(key, parent, namespace, tokens, block_id, tick)
            if entry is None:  # (eviction frees keys, never takes one: cannot happen; kept as a guard)
                break
            parent = added = entry
        if added is not None:
            # Only the deepest new entry is a leaf, and only the entry the chain hangs below can have been one:
            # its first child makes it inner.  (Unmarking each new parent as its child came, as _add did, cost a
            # lookup in two LRUs per block for entries never marked.)
            if below is not None and below.num_children == 1:
                self._unmark_leaf(below)
            self._mark_leaf(added)
        elif below is not None and below.num_children == 0:
            self._mark_leaf(below)  # (nothing cached below it: a recent leaf, as _touch_path leaves one)

    def _add(
        self, key: Hashable, parent: HashEntry | None, namespace: Hashable, tokens: TokenBlock, block_id: int,
        tick: int
    ) -> HashEntry | None:
        if key in self._table:
            return None
        entry = HashEntry(key, block_id, tokens, namespace, parent, last_used=tick)
        self.pool.incref(block_id)
        self._table[key] = entry
        self._entry_of_block[block_id] = entry
        self._pins.add(block_id, parent.block_id if parent is not None else None, self.pool)
        self._counts.add(namespace, 1)
        self.stats.inserted_blocks += 1
        if parent is not None:
            parent.num_children += 1  # (no longer a leaf: _cache_below unmarks it)
        return entry

    # -- eviction ----------------------------------------------------------------
    def _evict_leaf(self, entry: HashEntry, budget: int) -> int:
        """Remove a leaf entry unless its block is locked; return blocks freed."""
        if budget < 1 or self.pool.refcount(entry.block_id) != 1:
            return 0
        del self._table[entry.key]
        del self._entry_of_block[entry.block_id]
        self._pins.remove(entry.block_id)
        self._unmark_leaf(entry)
        if not self._counts.remove(entry.namespace, 1):
            self._leaves.drop_namespace(entry.namespace)
        parent = entry.parent
        if parent is not None:
            parent.last_used = max(parent.last_used, entry.last_used)  # its subtree's recency (see HashEntry)
            parent.num_children -= 1
            if parent.num_children == 0:
                self._mark_leaf(parent)
        self.pool.decref(entry.block_id)
        return 1

    def _is_live_leaf(self, entry: HashEntry) -> bool:
        return self._entry_of_block.get(entry.block_id) is entry and entry.num_children == 0

    # -- LRU plumbing ------------------------------------------------------------
    def _touch_path(self, path: list[HashEntry], tick: int) -> None:
        for entry in path:
            entry.last_used = tick
        if path and path[-1].num_children == 0:
            self._mark_leaf(path[-1])

    def _mark_leaf(self, entry: HashEntry) -> None:
        self._leaves.mark(entry, entry.namespace, entry.last_used)

    def _unmark_leaf(self, entry: HashEntry) -> None:
        self._leaves.unmark(entry, entry.namespace)
