"""How many KV blocks a *group* of running requests holds, a block its members share counted once.

Two readers ask the same question.  The step log and ``tenant_stats`` report each tenant's
blocks (:func:`~minivllm.metrics.step_log.tenant_blocks`); the scheduler enforces KV caps on a
tenant or a priority class (``TenantConfig.max_kv_share``, the three-class reserve).  Summing the
members' block tables answers it wrongly as soon as requests share blocks -- a cached system
prompt, the ``n`` samples of one prompt -- because a shared block is counted once per holder: a
tenant whose requests all start with one long prompt read as holding several pools (274% in the
fairness benchmark's shared-prefix section, 38% counted once), and a cap enforced on that sum held
the tenant far below the share it really used.

**Why sharing can be found cheaply.**  Requests come to share blocks only from position 0: a
prefix-cache hit takes the cached blocks of a prompt's first tokens, a sample forks its parent's
first blocks (``KVCacheManager.share_prefix`` / ``fork``, both before the request holds a block of
its own), and a request whose prefix has a cached twin caches nothing more (``cache_full_blocks``),
so a cached block's chain is always one table's prefix.  Two requests that share any block therefore
share their first one.  Members are bucketed by their first block; a request alone in its bucket
shares nothing and adds its table's length, and only a bucket of several (the requests behind one
cached prompt) keeps a count of holders per block.

This module only reads block tables: the :class:`~minivllm.kv.kv_cache_manager.KVCacheManager`
stays the one owner of what they hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable


class GroupBlocks:
    """Distinct blocks held per group, kept exact as members come, go and grow.

    ``keys(req)`` names the groups a request counts in (a tenant; a tenant and its class).
    ``shared``: could any block have two holders
    (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.may_share`)?  When not, a group's
    count is the sum of its members' tables and no bucket is built.

    :meth:`add` and :meth:`remove` are a request starting and stopping to count;
    :meth:`grew` is a member's table after ``allocate_slots`` (blocks appended, a shared last
    block swapped for a private copy).  Each returns, per group in ``keys(req)`` order, the
    blocks the group gained (or gave back): the blocks no other member holds.

    Built in one pass (a set union per bucket of several, in C), so a reader that only counts --
    the step log, once a step -- pays no more than that.  A bucket that changes afterwards gets a
    count of holders per block the first time it does (``_holders``), kept from then on.  So it
    must be told of every change to a member's table while it lives (the scheduler keeps one for
    an admission pass or one ``allocate``): a holder count built later reads the tables as they
    stand, and a change it was not told of would be counted twice or never.
    """

    def __init__(self, running: Iterable, keys: Callable[[object], Iterable[Hashable]],
                 shared: bool = True) -> None:
        self.keys = keys
        self.shared = shared
        self.count: dict[Hashable, int] = {}
        self._buckets: dict[Hashable, dict[int, list]] = {}  # group -> first block -> members
        self._holders: dict[tuple, Counter] = {}  # (group, first block) -> block -> members holding it
        count, buckets = self.count, self._buckets
        for r in running:
            table = r.block_ids
            for key in keys(r):
                count[key] = count.get(key, 0) + len(table)
                if shared and table:
                    by_first = buckets.get(key)
                    if by_first is None:
                        by_first = buckets[key] = {}
                    members = by_first.get(table[0])
                    if members is None:
                        by_first[table[0]] = [r]
                    else:
                        members.append(r)
        for key, by_first in buckets.items():
            for members in by_first.values():
                if len(members) > 1:
                    tables = [m.block_ids for m in members]
                    count[key] -= sum(map(len, tables)) - len(set().union(*tables))

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
        the copy too when that holder is a member.  That case (and a table whose first block
        was the one copied) is counted by taking the member out with its old table and in
        with its new one.
        """
        table = req.block_ids
        if before == 0:  # it held nothing, so it was in no bucket
            return self.add(req)
        if table[before - 1] == old_last:  # only appended
            grown = len(table) - before
            for key in self.keys(req):
                self.count[key] += grown
                holders = self._holders.get((key, table[0])) if self.shared and grown else None
                if holders is not None:
                    holders.update(table[before:])
            return [grown] * len(list(self.keys(req)))
        old = table[:before]
        old[-1] = old_last
        gained = []
        for key in self.keys(req):
            n = -self._delete(key, req, old)  # (first: a bucket's holders may be counted from its members'
            n += self._insert(key, req, table)  # tables, and this one's already holds the copy)
            self.count[key] += n
            gained.append(n)
        return gained

    def holds_last_too(self, req, key: Hashable) -> bool:
        """Does another member of group ``key`` hold ``req``'s last block?  Then a copy-on-write of it gains the
        group a block (the copy) instead of swapping one for another."""
        table = req.block_ids
        if not self.shared or not table:
            return False
        members = self._buckets[key][table[0]]
        return len(members) > 1 and self._holders_of(key, table[0], members)[table[-1]] > 1

    # -- buckets -------------------------------------------------------------------------------
    def _holders_of(self, key: Hashable, first: int, members: list) -> Counter:
        holders = self._holders.get((key, first))
        if holders is None:
            holders = self._holders[key, first] = Counter()
            for m in members:
                holders.update(m.block_ids)
        return holders

    def _insert(self, key: Hashable, req, table: list[int]) -> int:
        """Put ``req`` (holding ``table``) in its bucket; the blocks of ``table`` no other member held."""
        if not table:
            return 0
        if not self.shared:
            return len(table)
        by_first = self._buckets.setdefault(key, {})
        members = by_first.get(table[0])
        if members is None:
            by_first[table[0]] = [req]
            return len(table)
        holders = self._holders_of(key, table[0], members)
        new = len(set(table).difference(holders))  # (no block is kept at a count of 0: see _delete)
        holders.update(table)
        members.append(req)
        return new

    def _delete(self, key: Hashable, req, table: list[int]) -> int:
        """Take ``req`` (holding ``table``) out of its bucket; the blocks of ``table`` no other member holds."""
        if not table:
            return 0
        if not self.shared:
            return len(table)
        by_first = self._buckets[key]
        members = by_first[table[0]]
        holders = self._holders.get((key, table[0]))
        members.remove(req)
        if not members:
            del by_first[table[0]]
            self._holders.pop((key, table[0]), None)
            return len(table)
        if holders is None:  # counted from the members left
            return len(set(table).difference(self._holders_of(key, table[0], members)))
        freed = 0
        for b in table:
            n = holders[b] - 1
            if n:
                holders[b] = n
            else:
                del holders[b]
                freed += 1
        return freed
