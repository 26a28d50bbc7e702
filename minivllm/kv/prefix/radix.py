"""A radix tree over KV blocks (the SGLang design), one tree per namespace.

Why a tree?  Cached prefixes share their beginnings, and a tree stores each
shared beginning once.  Looking up a prompt is a walk from the root that
follows the prompt's blocks; the walk stops where the prompt leaves the
tree, and the blocks passed on the way are the cached prefix.

Why a *radix* tree?  A chain of nodes that never branches is merged into one
node whose edge spans several blocks, so a long system prompt is one node,
not hundreds.  The price is that an edge is split in two when a new prompt
(or a lookup) leaves it halfway.  Edges always hold whole blocks: sharing is
block-granular, so every split happens at a block boundary.

Node layout::

    node.token_blocks = [(t0..t15), (t16..t31), ...]   # one tuple per block
    node.block_ids    = [  17,         4,        ...]   # the KV blocks
    node.children     = {first token block of the child's edge: child}

Locking.  SGLang keeps a ``lock_ref`` counter per node: a running request
increments it on every node of its path and eviction skips nodes with a
non-zero count.  Here running requests already hold *pool* references on
exactly those blocks (they are in their block tables), and the cache holds
one more, so ``pool.refcount(b) - 1`` *is* the lock count, kept per block
instead of per node.  Deriving the lock from the pool means there is no
second counter that could drift from the first.

Eviction takes the least recently used leaf whose last block is not locked
and frees blocks from the tail of its edge (deepest first, so a cached
block's prefix always stays cached).  A node whose edge becomes empty is
removed, and its parent may then become a leaf and a candidate itself.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from minivllm.kv.prefix.base import (
    PUBLIC_NAMESPACE,
    LeafEviction,
    check_new_blocks,
    split_into_blocks,
)

TokenBlock = tuple[int, ...]


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree: a span of whole blocks and the node it leads to.

    ``eq=False`` keeps identity hashing, so nodes can be dict keys even though
    their contents change (splits, evictions).  A root has an empty edge and
    no parent.
    """

    namespace: Hashable
    token_blocks: list[TokenBlock]
    block_ids: list[int]
    parent: RadixNode | None
    children: dict[TokenBlock, RadixNode] = field(default_factory=dict)
    last_access: int = 0
    # ``(namespace, tokens of its first block)`` of the prefix this edge belongs to (a root: None), fixed when the
    # node is made: a split's upper half starts where the node did, and an edge only grows or shrinks at its end.
    first_key: tuple | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.parent is not None:
            self.first_key = (self.parent.first_key if not self.parent.is_root
                              else (self.namespace, self.token_blocks[0]))

    @property
    def is_root(self) -> bool:
        return self.parent is None


@dataclass(eq=False)
class RadixCache(LeafEviction):
    """A :class:`~minivllm.interfaces.PrefixCache` backed by radix trees."""

    # pool, block_size, quotas, stats and the shared indexes: see LeafEviction
    _roots: dict[Hashable, RadixNode] = field(default_factory=dict, repr=False)  # namespace (a tuple) -> root
    _node_of_block: dict[int, RadixNode] = field(default_factory=dict, repr=False)

    # -- queries -------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return len(self._node_of_block)

    @property
    def num_nodes(self) -> int:
        """Non-root nodes; shows the effect of splitting and merging edges."""
        return len({id(node) for node in self._node_of_block.values()})

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._node_of_block

    def roots(self) -> list[tuple[Hashable, RadixNode]]:
        """``(namespace, root)`` per namespace, in a stable order: what a picture of the trees walks (read-only)."""
        return sorted(self._roots.items(), key=lambda item: repr(item[0]))

    def num_evictable_blocks(self) -> int:
        """Cached blocks with no locked block at or below them.

        A locked block at index ``j`` of an edge pins blocks ``0..j`` of that
        edge and every block above it.  Kept up to date as locks change (see
        :class:`~minivllm.kv.prefix.base.PinIndex`), so O(1) to ask.
        """
        return self.num_cached_blocks - self._pins.num_pinned(self.pool)

    # -- lookup (match and insert: see LeafEviction) --------------------------------
    @staticmethod
    def _path_blocks(path: list[RadixNode]) -> list[int]:
        return [b for node in path for b in node.block_ids]  # an edge holds one block or many

    # -- insertion -------------------------------------------------------------
    def extend(
        self, parent_block: int, token_ids: Sequence[int], block_ids: Sequence[int],
        namespace: Hashable = PUBLIC_NAMESPACE,
    ) -> bool:
        """See :meth:`~minivllm.interfaces.PrefixCache.extend`.

        The walk from the root is replaced by the node that holds ``parent_block``: a block sits at one
        place in the tree, and the caller's earlier blocks are its path.  The rest is :meth:`insert`'s
        own steps in its order (check, touch the path, make room, attach).  The cases where the walk
        would have split an edge or gone further -- ``parent_block`` inside an edge, or a child that
        starts with the same tokens -- are left to :meth:`insert`.
        """
        node = self._node_of_block.get(parent_block)
        if node is None or node.namespace != namespace or node.block_ids[-1] != parent_block:
            return False
        blocks = split_into_blocks(token_ids, self.block_size, len(block_ids))
        if blocks and blocks[0] in node.children:
            return False
        path = []
        up = node
        while not up.is_root:
            path.append(up)
            up = up.parent
        self._cache_below(path[::-1], namespace, blocks, list(block_ids))
        return True

    def _cache_below(self, path: list[RadixNode], namespace: Hashable, blocks: list[TokenBlock],
                     new_ids: list[int]) -> None:
        """What :meth:`insert` and :meth:`extend` do once they know the cached ``path`` (root first):
        check the new blocks, touch it, make room under the quota (pinning the path's last block), attach.

        The new blocks become a new child edge, or extend the last edge when it is a leaf, so a request
        that inserts again after generating more tokens keeps a single edge."""
        check_new_blocks(new_ids, self.is_cached, self.pool)
        tick = self._clock.tick()
        self._touch_path(path, tick)
        num_new = self._make_room(namespace, len(new_ids), path[-1].block_ids[-1] if path else None)
        if num_new:
            self._attach(path[-1] if path else self._root(namespace), blocks[:num_new], new_ids[:num_new], tick)

    def _attach(
        self, parent: RadixNode, token_blocks: list[TokenBlock], block_ids: list[int], tick: int
    ) -> None:
        for block_id in block_ids:
            self.pool.incref(block_id)
        above = parent.block_ids[-1] if parent.block_ids else None  # the block before the new ones (root: none)
        if not parent.is_root and not parent.children:
            node = parent
            node.token_blocks.extend(token_blocks)
            node.block_ids.extend(block_ids)
        else:
            node = RadixNode(parent.namespace, list(token_blocks), list(block_ids), parent)
            parent.children[token_blocks[0]] = node
        for block_id in block_ids:
            self._node_of_block[block_id] = node
            self._pins.add(block_id, above, self.pool)
            above = block_id
        self._counts.add(parent.namespace, len(block_ids))
        self.stats.inserted_blocks += len(block_ids)
        self._touch(node, tick)

    # -- eviction ----------------------------------------------------------------
    def _evict_leaf(self, node: RadixNode, budget: int) -> int:
        """Free up to ``budget`` unlocked blocks from the end of ``node``'s edge."""
        first_block = node.token_blocks[0]
        freed = 0
        while freed < budget and node.block_ids and self.pool.refcount(node.block_ids[-1]) == 1:
            block_id = node.block_ids.pop()
            node.token_blocks.pop()
            del self._node_of_block[block_id]
            self._pins.remove(block_id)
            self.pool.decref(block_id)
            freed += 1
        left = self._counts.remove(node.namespace, freed)
        if not node.block_ids:
            self._remove_node(node, first_block)
        if not left:
            self._leaves.drop_namespace(node.namespace)
        return freed

    def _remove_node(self, node: RadixNode, first_block: TokenBlock) -> None:
        self._unmark_leaf(node)
        parent = node.parent
        assert parent is not None, "roots are never evicted"
        del parent.children[first_block]
        if parent.children:
            return
        if parent.is_root:
            del self._roots[parent.namespace]
        else:
            self._mark_leaf(parent)

    @staticmethod
    def _is_live_leaf(node: RadixNode) -> bool:
        return bool(node.block_ids) and not node.children

    # -- tree plumbing ----------------------------------------------------------
    def _root(self, namespace: Hashable) -> RadixNode:
        root = self._roots.get(namespace)
        if root is None:
            root = RadixNode(namespace, [], [], None)
            self._roots[namespace] = root
        return root

    def _descend(self, namespace: Hashable, blocks: Sequence[TokenBlock]) -> tuple[list[RadixNode], int, int]:
        """The nodes whose edges the longest cached prefix of ``blocks`` enters, root first, how many blocks it
        covers, and how many of them lie on the last node's edge (fewer than it holds: the prefix ends inside
        it).  Only reads the tree: :meth:`_walk` splits what this finds, :meth:`_count_cached` does not.

        ``blocks`` is iterated once, up to the first block that differs: a lookup hands in a
        :class:`~minivllm.kv.prefix.base.LazyBlocks`, which cuts each block as it is read, and iterating it is
        cheaper than indexing it (a method call per block; indexing also read each edge's first block twice, as
        a child's key and to compare it), which made a fully cached 4,000-token prompt slower to look up than
        cutting it whole first."""
        node = self._roots.get(namespace)
        path: list[RadixNode] = []
        matched = last = 0
        if node is None:
            return path, matched, last
        it = iter(blocks)
        block = next(it, None)
        while block is not None:
            child = node.children.get(block)
            if child is None:
                break
            path.append(child)
            edge = child.token_blocks
            last = 1  # its first block is the key it was found under
            block = next(it, None)
            while block is not None and last < len(edge) and edge[last] == block:
                last += 1
                block = next(it, None)
            matched += last
            if last < len(edge):
                break
            node = child
        return path, matched, last

    def _walk(self, namespace: Hashable, blocks: Sequence[TokenBlock]) -> list[RadixNode]:
        """The nodes covering the longest cached prefix of ``blocks``.

        The last node is split if the prefix ends inside its edge, so the
        returned nodes cover exactly the matched blocks: after a match, only
        the blocks actually used become recent, and the unused tail keeps its
        old access time and is evicted first.
        """
        path, _, last = self._descend(namespace, blocks)
        if path and last < len(path[-1].block_ids):
            path[-1] = self._split(path[-1], last)
        return path

    def _count_cached(self, namespace: Hashable, blocks: Sequence[TokenBlock]) -> int:
        return self._descend(namespace, blocks)[1]

    def _cached_blocks(self, namespace: Hashable, blocks: Sequence[TokenBlock]) -> list[int]:
        path, _, last = self._descend(namespace, blocks)  # (no split: the last edge is cut in the answer only)
        if not path:
            return []
        return [b for node in path[:-1] for b in node.block_ids] + path[-1].block_ids[:last]

    def _holders(self) -> dict[int, RadixNode]:
        return self._node_of_block

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut ``node``'s edge after ``n`` blocks; return the new upper node.

        The *lower* half keeps the original node object, so its place in the
        leaf LRU (if it is a leaf) stays valid.  The upper half inherits the
        old access time; the caller touches it if it was used.
        """
        parent = node.parent
        assert parent is not None and 0 < n < len(node.block_ids)
        head = RadixNode(
            node.namespace,
            node.token_blocks[:n],
            node.block_ids[:n],
            parent,
            last_access=node.last_access,
        )
        parent.children[node.token_blocks[0]] = head
        node.token_blocks = node.token_blocks[n:]
        node.block_ids = node.block_ids[n:]
        node.parent = head
        head.children[node.token_blocks[0]] = node
        for block_id in head.block_ids:
            self._node_of_block[block_id] = head
        return head

    def _touch_path(self, path: list[RadixNode], tick: int) -> None:
        for node in path:
            self._touch(node, tick)

    def _touch(self, node: RadixNode, tick: int) -> None:
        node.last_access = tick
        if not node.children:
            self._mark_leaf(node)

    def _mark_leaf(self, node: RadixNode) -> None:
        self._leaves.mark(node, node.namespace, node.last_access)

    def _unmark_leaf(self, node: RadixNode) -> None:
        self._leaves.unmark(node, node.namespace)
