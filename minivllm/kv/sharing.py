"""How many KV blocks a *group* of running requests holds, a block its members share counted once.

Two readers ask the same question.  The step log and ``tenant_stats`` report each tenant's
blocks (:func:`~minivllm.metrics.step_log.tenant_blocks`); the scheduler enforces KV caps on a
tenant or a priority class (``TenantConfig.max_kv_share``, the three-class reserve).  Summing the
members' block tables answers it wrongly as soon as requests share blocks -- a cached system
prompt, the ``n`` samples of one prompt -- because a shared block is counted once per holder: a
tenant whose requests all start with one long prompt read as holding several pools (274% in the
fairness benchmark's shared-prefix section, 38% counted once), and a cap enforced on that sum held
the tenant far below the share it really used.

**How.**  A group's count is a set union of its members' tables, taken in C at construction (128
requests of 70 blocks: ~0.14 ms, where the plain sum takes 3 us).  No shortcut on the shape of sharing is
taken: it is tempting to assume two requests sharing a block share their first one (a prefix hit and a fork
both share from position 0), but a prefix cache breaks it -- two requests that prefill one system prompt in
the same step hold twin first blocks, the second's later blocks are cached below the first's twin, and a third
request then hits a chain made of both (``tests/test_kv_caps_count_a_shared_block_once.py`` builds that
case).  Once a member changes while the count is kept (:meth:`GroupBlocks.add` and the rest), the group gets
a count of holders per block (a ``Counter`` over every member's table, also built in C, ~0.3 ms at that size),
kept from then on at the cost of the changed table alone.

This module only reads block tables: the :class:`~minivllm.kv.kv_cache_manager.KVCacheManager`
stays the one owner of what they hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from itertools import chain


def copies_made(writers: int, holders: int) -> int:
    """The blocks added when ``writers`` of the ``holders`` of one partly filled block each write their next token
    into it: a private copy per writer, but at most ``holders - 1`` copies.

    Why not one per writer: a writer copies the block only while another holder keeps it, so when every holder
    writes into it next (a leader and the samples forked onto its last block), the last of them to write finds it
    its own and writes in place -- ``k`` holders make ``k - 1`` copies, whichever writes first.  Charging each one
    (``KVCacheManager.num_copy_on_write_blocks`` summed) kept one block per such block from admission until the
    first write.  A holder that is no writer (the prefix cache, a request writing elsewhere) keeps the original,
    so then every writer copies.  The one rule for the pool (``holders``: the block's refcount, less the holds of
    requests counted as gone: ``KVCacheManager.num_new_blocks_all``, ``claims_as_they_leave``) and for a group
    (``holders``: its members holding the block, :meth:`GroupBlocks.in_place_writes`): the last holder's write
    swaps one block of the count for another, adding none."""
    return max(0, min(writers, holders - 1))


class GroupBlocks:
    """Distinct blocks held per group, kept exact as members come, go and grow.

    ``keys(req)`` names the groups a request counts in (a tenant; a tenant and its class).
    ``shared``: could any block have two holders
    (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.may_share`)?  When not, a group's
    count is the sum of its members' tables and no set is built -- for a snapshot only: a
    count that is kept while requests are admitted must say True, since an admission (a
    prefix hit, a sample's fork) is what makes blocks shared.  Such a count may still say
    ``shared_now=False`` when nothing is shared yet, to start from the sum.

    :meth:`add` and :meth:`remove` are a request starting and stopping to count;
    :meth:`grew` is a member's table after ``allocate_slots`` (blocks appended, a shared last
    block swapped for a private copy).  Each returns, per group in ``keys(req)`` order, the
    blocks the group gained (or gave back): the blocks no other member holds.  It must be
    told of every change to a member's table while it lives (the scheduler keeps one for an
    admission pass or one ``allocate``): a holder count built later reads the tables as they
    stand, and a change it was not told of would be counted twice or never.
    """

    def __init__(self, running: Iterable, keys: Callable[[object], Iterable[Hashable]],
                 shared: bool = True, *, shared_now: bool | None = None) -> None:
        self.keys = keys
        self.shared = shared
        self._members: dict[Hashable, list] = {}
        self._holders: dict[Hashable, Counter] = {}  # group -> block -> members holding it, once a member changed
        members = self._members
        for r in running:
            for key in keys(r):
                group = members.get(key)
                if group is None:
                    members[key] = [r]
                else:
                    group.append(r)
        union = shared if shared_now is None else shared_now  # (a set only where a block may have two holders)
        self.count: dict[Hashable, int] = {
            key: (len(set().union(*[m.block_ids for m in group])) if union and len(group) > 1
                  else sum(len(m.block_ids) for m in group))
            for key, group in members.items()}

    def add(self, req) -> list[int]:
        gained = []
        for key in self.keys(req):
            n = self._insert(key, req, req.block_ids)
            self.count[key] = self.count.get(key, 0) + n
            gained.append(n)
        return gained

    def remove(self, req) -> list[int]:
        freed = []
        for key in self.keys(req):
            n = self._delete(key, req, req.block_ids)
            self.count[key] -= n
            freed.append(n)
        return freed

    def grew(self, req, before: int, old_last: int | None) -> list[int]:
        """``req``'s table had ``before`` blocks, the last of them ``old_last``, and is now ``req.block_ids``.

        Appended blocks are fresh (off the free list: no one else holds them), so a table
        that only grew gains its group exactly the appended blocks.  A copy-on-write is
        different: the old last block stays with whoever else held it, so the group gains
        the copy too when that holder is a member.  That case is counted by taking the
        member out with its old table and in with its new one.
        """
        table = req.block_ids
        if not before or table[before - 1] == old_last:  # only appended
            grown = len(table) - before
            for key in self.keys(req):
                self.count[key] += grown
                holders = self._holders.get(key)
                if holders is not None and grown:
                    holders.update(table[before:])
            return [grown] * len(list(self.keys(req)))
        old = table[:before]
        old[-1] = old_last
        gained = []
        for key in self.keys(req):
            n = -self._delete(key, req, old)  # (first: a holder count may be built from the members' tables,
            n += self._insert(key, req, table)  # and this one's already holds the copy)
            self.count[key] += n
            gained.append(n)
        return gained

    def holds_last_too(self, req, key: Hashable) -> bool:
        """Does another member of group ``key`` hold ``req``'s last block?  Then a copy-on-write of it gains the
        group a block (the copy) instead of swapping one for another."""
        table = req.block_ids
        if not self.shared or not table or len(self._members.get(key, ())) < 2:
            return False
        return self._holders_of(key)[table[-1]] > 1

    def in_place_writes(self, key: Hashable, writers: Iterable) -> int:
        """How many of the blocks ``writers`` write into next (members of group ``key``, each charged the copy
        of its shared partly filled last block) no other member holds.  For each, the group gains one copy fewer
        than it has writers there: whichever writes first, the last of them either finds the block its own and
        writes in place, or copies it and leaves the original to a holder outside the group -- one block swapped
        for another (:func:`copies_made`, counted over the group's members).  So a group recount charges
        ``len(writers)`` less this."""
        lasts = Counter(r.block_ids[-1] for r in writers)
        if not lasts:
            return 0
        if not self.shared:  # (no block has two holders: each writer is its block's only member)
            return len(lasts)
        holders = self._holders_of(key)
        return sum(n - copies_made(n, holders[b]) for b, n in lasts.items())

    def blocks(self, key: Hashable):
        """The distinct blocks group ``key`` holds (a read-only view; empty for a group with no member)."""
        if key not in self._members:
            return ()
        return self._held_set(key)

    def num_held(self, key: Hashable, block_ids: Iterable[int]) -> int:
        """How many of ``block_ids`` some member of group ``key`` holds: the blocks of a prefix the group would
        share if a request starting on them joined it, and so gain none of."""
        if key not in self._members:
            return 0
        held = self._held_set(key)
        return sum(1 for b in block_ids if b in held)

    # -- holder counts -------------------------------------------------------------------------
    def _held_set(self, key: Hashable):
        """What a membership test of group ``key``'s blocks reads: the kept holder count when blocks may be shared
        (built once, then kept: :meth:`add` builds it too), else a set of the members' tables, not kept (without
        sharing, :meth:`add` does not keep a holder count up to date)."""
        if self.shared:
            return self._holders_of(key)
        return set(chain.from_iterable(m.block_ids for m in self._members[key]))

    def _holders_of(self, key: Hashable) -> Counter:
        holders = self._holders.get(key)
        if holders is None:
            holders = self._holders[key] = Counter(chain.from_iterable(m.block_ids for m in self._members[key]))
        return holders

    def _insert(self, key: Hashable, req, table: list[int]) -> int:
        """Count ``req`` (holding ``table``) in group ``key``; the blocks of ``table`` no other member held."""
        group = self._members.get(key)
        if group is None:
            self._members[key] = [req]
            return len(table)
        if not self.shared:
            group.append(req)
            return len(table)
        holders = self._holders_of(key)
        new = len(set(table).difference(holders))  # (no block is kept at a count of 0: see _delete)
        holders.update(table)
        group.append(req)
        return new

    def _delete(self, key: Hashable, req, table: list[int]) -> int:
        """Stop counting ``req`` (holding ``table``) in group ``key``; the blocks of ``table`` no other member holds."""
        group = self._members[key]
        group.remove(req)
        if not self.shared or not group:
            if not group:
                del self._members[key]
                self._holders.pop(key, None)
            return len(table)
        holders = self._holders.get(key)
        if holders is None:  # counted from the members left
            return len(set(table).difference(self._holders_of(key)))
        freed = 0
        for b in table:
            n = holders[b] - 1
            if n:
                holders[b] = n
            else:
                del holders[b]
                freed += 1
        return freed
