"""The step log: one small typed record per engine step, kept in a bounded ring buffer.

Widgets draw timelines from it, labs compute TTFT/ITL breakdowns from it, and
benchmarks read peak block usage from it.  Two things keep it cheap:

* a record is a slotted dataclass of plain values (ids, counts, three flat tuples
  for the scheduled sequences, read together as ``record.seqs``, and how many of
  them lead as decodes), never a reference to a live request;
* the buffer is bounded by the number of *sequence entries* it holds (a step of
  256 decodes costs 257 entries, one per sequence and one for the step, plus one
  per tenant row when tenants are logged -- 258 for one named tenant; an idle
  step one), so a long run at large
  batch sizes keeps the newest history in a fixed memory budget (about 30 bytes
  per entry at 256 decodes a step, 150 at one: a step's own record is most of a
  small step's cost) instead of growing without bound.

Records also answer ``record["seqs"]`` like the dicts they replace, so notebook
code that reads them stays short.

Per-tenant fields (fairness, lab 6) are filled once the engine has tenant
settings or has served a tenant other than ``"default"``, so a run without
tenants pays nothing for them (nor a run whose driver reads none of them and says
so: ``EngineConfig.step_log_tenants=False``, as the fleet's replicas do).
``seq_tenants`` names the tenant of each entry of ``seqs`` (same order),
and ``tenants`` holds one :class:`TenantStep` per tenant with work in the engine
after the step (tokens scheduled, KV blocks held by its running requests,
running and waiting counts).  Per-tenant queues and KV shares over time are a
loop over the log (:func:`tenant_series`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping, NamedTuple

from minivllm.kv.sharing import GroupBlocks


class TenantStep(NamedTuple):
    """One tenant's share of one step."""

    tenant: str
    tokens: int  # tokens of its requests in this step's batch (prefill chunks + decodes)
    kv_blocks: int  # device blocks held by its running requests after the step (shared ones once: tenant_blocks)
    running: int
    waiting: int  # waiting, preempted or swapped out


def tenant_blocks(running: Iterable, shared: bool = True) -> dict[str, int]:
    """Device blocks held by each tenant's running requests, a block counted once per tenant however many of its
    requests hold it (:class:`~minivllm.kv.sharing.GroupBlocks`, which says why a sum of block tables is wrong
    and what counting them costs).

    A block two *tenants* hold counts for each (each keeps it from being freed), so tenants' shares may add up
    to more than the pool's usage.  The scheduler's KV caps (``TenantConfig.max_kv_share``, the three-class
    reserve) count held blocks the same way.  ``shared``: could any block have two holders
    (:meth:`~minivllm.kv.kv_cache_manager.KVCacheManager.may_share`)?  When not, no set is built.
    """
    return GroupBlocks(running, lambda r: (r.tenant,), shared).count


def tenant_fields(seqs, running: Iterable, waiting: Mapping[str, int],
                  shared: bool = True) -> tuple[tuple[str, ...], tuple[TenantStep, ...]]:
    """``(seq_tenants, tenants)`` for a :class:`StepRecord`: one pass over the batch, two over the running requests.

    ``seqs`` are the step's scheduled sequences (``.request``, ``.num_tokens``),
    ``running`` the scheduler's running requests after the step and ``waiting`` its
    count of waiting requests per tenant (kept as the queue changes, so a long
    queue is not walked every step; tenants with none waiting absent); ``shared`` as
    :func:`tenant_blocks` reads it.  Tenants come out sorted by name, so two runs of
    the same workload log identical records.
    """
    running = list(running)
    seq_tenants = tuple([s.request.tenant for s in seqs])
    rows: dict[str, list[int]] = {}
    for s, t in zip(seqs, seq_tenants):
        row = rows.get(t)
        if row is None:
            row = rows[t] = [0, 0, 0, 0]
        row[0] += s.num_tokens
    for r in running:
        row = rows.get(r.tenant)
        if row is None:
            row = rows[r.tenant] = [0, 0, 0, 0]
        row[2] += 1
    for t, n in tenant_blocks(running, shared).items():
        rows[t][1] = n
    for t, n in waiting.items():
        row = rows.get(t)
        if row is None:
            row = rows[t] = [0, 0, 0, 0]
        row[3] += n
    return seq_tenants, tuple(TenantStep(t, *rows[t]) for t in sorted(rows))


@dataclass(slots=True, frozen=True)
class StepRecord:
    step: int
    time: float
    # Per scheduled sequence, in batch order: its request id, first position and tokens.  Kept as three flat
    # tuples (read them together as :attr:`seqs`): a step of 256 decodes would otherwise keep 256 small
    # tuples alive, and those long-lived allocations are what sets Python's garbage collector running.
    seq_ids: tuple[str, ...]
    seq_starts: tuple[int, ...]
    seq_tokens: tuple[int, ...]
    num_tokens: int
    preempted: tuple[str, ...]
    swapped_out: int  # blocks copied to the host tier this step
    swapped_in: int
    rejected: tuple[str, ...]
    failed: tuple[str, ...]
    free_blocks: int  # the free list
    available_blocks: int  # free + cached blocks an allocation could evict: ``num_blocks`` less the used ones
    running: int
    waiting: int
    seq_tenants: tuple[str, ...] = ()  # the tenant of each entry of ``seqs`` (empty: single-tenant run)
    tenants: tuple[TenantStep, ...] = ()  # per tenant with work in the engine (empty: single-tenant run)
    # The first ``num_decodes`` entries of ``seqs`` are decodes (a batch puts its decode rows first); the rest are
    # prefill.  Why it is kept: ``(id, start, tokens)`` cannot tell a decode from a one-token chunk of a re-prefill
    # past the prompt (after a recompute preemption), and one count per step can.  None: not recorded (a record
    # built by hand): :func:`decode_flags` then reads the rows by position.
    num_decodes: int | None = None
    # The ids in ``preempted`` whose KV went to the host tier (the others were dropped, to be recomputed).  Why kept:
    # a swapped request comes back where it left off, mid-prompt too, and a recomputed one computes its tokens
    # again; ``(id, start, tokens)`` rows cannot tell the two apart (a recompute may restart past 0 from cached
    # blocks), and the block counts above are the step's, not a request's.
    swapped: tuple[str, ...] = ()

    @property
    def seqs(self) -> tuple[tuple[str, int, int], ...]:
        """``(request id, first position, tokens)`` per scheduled sequence (built on each read)."""
        return tuple(zip(self.seq_ids, self.seq_starts, self.seq_tokens))

    def tenant(self, name: str) -> TenantStep:
        """``name``'s row in this step (zeros when it had no work, or tenants were not logged)."""
        for row in self.tenants:
            if row.tenant == name:
                return row
        return TenantStep(name, 0, 0, 0, 0)

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    @property
    def size(self) -> int:
        """Entries this record counts against the log's budget."""
        return 1 + len(self.seq_ids) + len(self.tenants)


def decode_flags(record, prompt_lens: Mapping[str, int] | None = None) -> list[bool]:
    """Which rows of a step record's ``seqs`` are decodes: the one reading of "is this row a decode?" for every
    reader of a step log (the lab pictures, the prefill-rate fit, the replay's chunk count).

    The engine's own count says it when the record has one (``num_decodes``: the leading rows), and nothing else
    can: a one-token chunk of a re-prefill past the prompt (after a recompute preemption) looks like a decode in
    ``(id, start, tokens)``, and only the engine knew the request had computed that position before.  A record
    written by hand, without the count, is read by position -- one token past its prompt is a decode -- or, with
    no prompt lengths to read, by size alone (a one-token row is a decode).  ``record`` is a
    :class:`StepRecord` or a dict with the same keys (``seqs``, optional ``num_decodes``).
    """
    seqs, num_decodes = record["seqs"], record.get("num_decodes")
    if num_decodes is not None:
        return [i < num_decodes for i in range(len(seqs))]
    if prompt_lens is None:
        return [n == 1 for _, _, n in seqs]
    return [n == 1 and start >= prompt_lens[rid] for rid, start, n in seqs]


class StepLog:
    """A ring buffer of :class:`StepRecord`, bounded by ``max_entries`` sequence entries."""

    def __init__(self, max_entries: int = 500_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._records: deque[StepRecord] = deque()
        self.num_entries = 0

    def append(self, record: StepRecord) -> None:
        self._records.append(record)
        self.num_entries += record.size
        while self.num_entries > self.max_entries and len(self._records) > 1:
            self.num_entries -= self._records.popleft().size

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def __getitem__(self, index):
        """``log[-1]`` in O(1); a slice is copied to a list (a deque does not slice), O(len(log)) -- for readers
        after a run, not for a per-step caller."""
        if isinstance(index, slice):
            return list(self._records)[index]
        return self._records[index]

    def clear(self) -> None:
        self._records.clear()
        self.num_entries = 0


def tenant_series(records: Iterable[StepRecord], num_blocks: int, tenants: Iterable[str] | None = None) -> dict:
    """Per-tenant time series from step records, for plots: ``{"time": [...], "step": [...],
    tenant: {"waiting": [...], "running": [...], "tokens": [...], "kv_share": [...]}}``.

    ``kv_share`` is blocks held / ``num_blocks``.  ``tenants`` fixes which tenants
    appear (default: every tenant seen in the records), so a tenant with no work
    in a step reads 0 there rather than being skipped.
    """
    records = list(records)
    names = sorted({row.tenant for r in records for row in r.tenants}) if tenants is None else list(tenants)
    out: dict = {"time": [r.time for r in records], "step": [r.step for r in records]}
    for name in names:
        rows = [r.tenant(name) for r in records]
        out[name] = {
            "waiting": [row.waiting for row in rows],
            "running": [row.running for row in rows],
            "tokens": [row.tokens for row in rows],
            "kv_share": [row.kv_blocks / num_blocks for row in rows],
        }
    return out


class FirstTimePrompt:
    """Prompt tokens computed for the first time, per tenant: a tenant's prefill *service*, read off step records.

    Why not the scheduler's per-tenant ``prompt_tokens``: that counts every prompt token the engine computed, and a
    request preempted by recompute computes its prompt again.  The repeat is the engine's loss, not service to the
    tenant -- WFQ charges a prompt token once (:func:`minivllm.sched.fairness.new_prompt_tokens`) -- so a fairness
    measurement counting it credits the tenant preempted most.  Read here from the step log, not from the policy's
    counters, so the measurement stays independent of the policy it judges.
    """

    def __init__(self) -> None:
        self.by_tenant: dict[str, int] = {}
        self._requests: dict[str, list] = {}  # request id -> [tenant, prompt length, furthest prompt position]
        self._last_step = -1

    def track(self, request_id: str, tenant: str, prompt_len: int) -> None:
        self._requests[request_id] = [tenant, prompt_len, 0]

    def observe(self, record: StepRecord) -> None:
        """Count one step (a record seen before is skipped, so calling this after every engine step is safe)."""
        if record.step <= self._last_step:
            return
        self._last_step = record.step
        for rid, start, n in zip(record.seq_ids, record.seq_starts, record.seq_tokens):
            req = self._requests.get(rid)
            if req is None:
                continue
            end = min(start + n, req[1])
            if end > req[2]:
                self.by_tenant[req[0]] = self.by_tenant.get(req[0], 0) + end - max(start, req[2])
                req[2] = end


class HeldBlocks:
    """Block-seconds each tenant's running requests held inside a window ``[0, window]``, step by step: the KV
    share a fairness table reports is ``share(tenant, num_blocks)``, the mean fraction of the pool held over the
    window.

    A step's holdings are its record's (blocks held after the step, :class:`TenantStep`: what a gauge scraped
    between steps reads), and they count for the part of the step inside the window; idle time between steps holds
    nothing.  So a request that finishes in a step is not counted for that step, though it held its blocks through
    it (a small bias, toward less, for tenants of short requests).  Why weighted by time and not a
    mean per step: steps differ in length by a factor of fifty (a 10 ms decode beside a 500 ms prefill), and a
    mean per step gives each the same vote, so a tenant whose requests sat through the long steps reads as
    holding less than it did.  One instance per run, observed after every step, so a run of any length keeps
    one number per tenant rather than its records.
    """

    def __init__(self, window: float) -> None:
        self.window = window
        self.block_s: dict[str, float] = {}

    def observe(self, started: float, record: StepRecord) -> None:
        """Count one step that began at ``started`` and ended at ``record.time``."""
        inside = min(record.time, self.window) - started
        if inside <= 0:
            return
        for row in record.tenants:
            self.block_s[row.tenant] = self.block_s.get(row.tenant, 0.0) + row.kv_blocks * inside

    def share(self, tenant: str, num_blocks: int) -> float:
        """The mean share of a ``num_blocks`` pool ``tenant`` held over the window (0 for an empty window)."""
        return self.block_s.get(tenant, 0.0) / self.window / num_blocks if self.window > 0 else 0.0
