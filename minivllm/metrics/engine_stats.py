"""The shape of ``LLMEngine.stats()``: one typed definition that the engine fills and loggers read.

Why a ``TypedDict`` and not a dataclass: labs, benchmarks and the server have read ``stats()["key"]`` since the
first lab, and a dict is cheap to build per step and to send across the server's thread boundary.  Typing it
keeps both: a checker (and a reader) sees every key with its meaning in one place, and a logger that indexes a
key instead of ``.get(key, 0)`` fails loudly the day a key is renamed rather than reporting 0 for ever.

Blocks: ``free_blocks`` (the free list) + ``used_blocks`` (held by requests, or cached and pinned by a held
block after them) + evictable cached blocks =
``num_blocks``; ``available_blocks`` = free + evictable, what an allocation can get (the door rule's number).
"""

from __future__ import annotations

from typing import TypedDict


class TenantStats(TypedDict):
    """One tenant's row of ``stats()["per_tenant"]``: work in the engine now and what it has been served.

    Counted as the scheduler sees work, not as a client is billed: each sample of an ``n > 1`` request is
    a request here (``num_finished``, the latencies), and ``prompt_tokens`` counts the prompt tokens
    computed: again after a preemption, not those read from the prefix cache.  ``/metrics`` counts as the client sees it (see ``minivllm.metrics.prometheus``).

    ``num_finished`` counts every sample that left the engine, whatever ended it: stop, length, rejected, error
    and abort -- a whole request aborted (waiting or running; each sample of an ``n > 1`` group still in the
    engine) as well as one sample aborted alone -- each sample once, with its latencies and queue time like any
    other's.  Why every ending: ``num_finished + num_running + num_waiting`` is then every sample the tenant
    sent, so a sample lost by the engine shows as a gap, and it counts what ``vllm:request_success`` counts
    (aborts too, under ``finished_reason="abort"``, as vLLM does) -- per sample here, per request there, so the
    two agree where ``n = 1``.  How a request ended is told by
    ``/metrics``'s label and ``num_rejected``, not here.  An abort is one rule whichever way it is asked for: a
    sample aborted alone reports its abort in an output, a whole request ends with none, and both count.
    """

    prompt_tokens: int
    output_tokens: int
    kv_blocks: int
    kv_share: float  # kv_blocks / the pool
    num_running: int
    num_waiting: int
    num_finished: int  # samples ended, abort included (see above)
    queue_time_s: float  # total seconds its finished requests waited before their first step
    num_preemptions: int
    num_rejected: int
    ttft_p50_s: float | None  # nearest rank over its newest finished requests; None before the first
    ttft_p95_s: float | None
    itl_p50_s: float | None
    itl_p95_s: float | None


class _EngineCounters(TypedDict):
    """The keys every engine's ``stats()`` has."""

    num_blocks: int
    free_blocks: int
    available_blocks: int
    cached_blocks: int
    used_blocks: int
    kv_cache_usage: float  # used_blocks / num_blocks, as vLLM's gauge: evictable cached blocks count as free
    num_cpu_blocks: int
    cpu_blocks_used: int
    num_running: int
    num_waiting: int
    num_swapped: int
    num_preemptions: int
    num_recompute_preemptions: int
    num_swap_preemptions: int
    recomputed_tokens: int
    swapped_out_blocks: int
    swapped_in_blocks: int
    swapped_out_bytes: int
    swapped_in_bytes: int
    num_rejected: int  # requests turned away (an n > 1 request once, as Prometheus and the server count it)
    num_errors: int
    num_stalls: int  # times stuck requests were failed (see ``llm_engine.STALL_STEPS``)
    recompute_hit_tokens: int
    per_tenant: dict[str, TenantStats]


class EngineStats(_EngineCounters, total=False):
    """Gauges (now) and cumulative counters (since the engine started) of one engine; the keys below are there
    only when the engine has a prefix cache (every key of the base is always there)."""

    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of them, found cached
    prefix_cache_hit_rate: float
    prefix_cache_evictions: int  # blocks
    prefix_cache_quota_evictions: int
