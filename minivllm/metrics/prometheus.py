"""Prometheus metrics for a minivllm engine, named and bucketed like vLLM's.

**Naming choice: the ``vllm:`` prefix.**  Every series that has a vLLM
counterpart carries vLLM's exact name, type, unit and buckets
(``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``,
``vllm:prefix_cache_queries_total``, ``vllm:time_to_first_token_seconds``, ...)
and vLLM's ``model_name`` label, so Grafana dashboards, alert rules and
PromQL written for vLLM work unchanged against ``minivllm serve`` -- the same
reason ``minivllm bench``-style load tools speak only the OpenAI API.  Series
vLLM does not have keep the same prefix so one ``{__name__=~"vllm:.*"}``
selector finds them all; they are marked *(minivllm)* below.

Gauges (refreshed from ``engine.stats()`` by whoever owns the engine loop):
``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0..1), and *(minivllm)*
``vllm:kv_cache_used_blocks`` / ``vllm:kv_cache_free_blocks`` /
``vllm:kv_cache_cached_blocks`` / ``vllm:kv_cache_num_blocks``.

Counters (exposed with ``_total``): ``vllm:prefix_cache_queries`` and
``vllm:prefix_cache_hits`` (tokens; the hit rate is
``rate(hits)/rate(queries)``), ``vllm:num_preemptions{mode, tenant}``
(``mode`` is ``recompute`` or ``swap``), ``vllm:prompt_tokens{tenant}``,
``vllm:generation_tokens{tenant}``, ``vllm:request_success{finished_reason, tenant}``
(every ending: stop, length, abort, rejected, error), and *(minivllm)*
``vllm:num_recomputed_tokens``, ``vllm:num_requests_rejected{tenant}`` and
``vllm:num_requests_shed{tenant}`` (the server's door: never reached the engine, so no ``request_success``).

Histograms: ``vllm:time_to_first_token_seconds{tenant}``,
``vllm:inter_token_latency_seconds{tenant}``, ``vllm:e2e_request_latency_seconds``,
``vllm:request_queue_time_seconds``, ``vllm:iteration_tokens_total`` (tokens per
engine step).

**An ``n > 1`` request counts once**, as the client and its bill see it: one
``request_success`` (labelled with sample 0's finish reason), one TTFT (its first
sample's first token), one queue time (its first sample's first step), one e2e and
its prompt tokens once -- while its generation tokens and ITLs are every sample's.
vLLM v1 counts each sample as a finished request instead; ``engine.stats()``'s
per-tenant rows count samples too.

**The ``tenant`` label** is what neither vLLM nor SGLang exports: per-tenant
token throughput, latency and preemptions.  Tenants come from the server's API
key table (or ``"default"``), never from a client-chosen string, so the label's
cardinality is bounded by configuration.  Queries that ignore it (``sum by
(model_name)``) see exactly vLLM's series.

Every :class:`EngineMetrics` owns its own :class:`~prometheus_client.CollectorRegistry`
(no global state: two servers, or a test and a server, never share a
counter).  It reads the engine only through its public surface:
``engine.stats()``, ``engine.step_log[-1]`` and the ``RequestOutput`` objects
(and, to label an ``auto`` preemption swap or recompute, ``engine.requests``).
It works offline too: call :meth:`EngineMetrics.observe_step` after each
``engine.step()`` and :meth:`EngineMetrics.observe_output` for each output.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from minivllm.engine.input_processor import InputProcessor
from minivllm.metrics.engine_stats import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _Tracked:
    """What the metrics remember about one live request (for incremental TTFT/ITL/token counts)."""

    __slots__ = ("tenant", "ttft_done", "prompt_done", "seen", "last_times")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self.ttft_done = False
        self.prompt_done = False
        self.seen: dict[int, int] = {}  # output tokens counted so far, per sample index
        self.last_times: dict[int, float] = {}  # per sample index: the last token an ITL was measured to


class EngineMetrics:
    """vLLM-named Prometheus series for one engine, in a registry of their own.

    One engine for its whole life: the engine's cumulative counters become increments against the highest value
    seen, so a stale snapshot adds nothing -- and a replacement engine, its counters from 0 again, would add
    nothing either until it passed its predecessor's totals.  A new engine gets a new ``EngineMetrics``.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        r, m = self.registry, ["model_name"]
        mt = ["model_name", "tenant"]
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting (or swapped out).", m, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.", m, registry=r)
        self.used_blocks = Gauge("vllm:kv_cache_used_blocks", "KV blocks held by requests (minivllm).", m, registry=r)
        self.free_blocks = Gauge("vllm:kv_cache_free_blocks", "KV blocks on the free list (minivllm).", m, registry=r)
        self.cached_blocks = Gauge("vllm:kv_cache_cached_blocks", "KV blocks in the prefix cache (minivllm).", m, registry=r)
        self.num_blocks = Gauge("vllm:kv_cache_num_blocks", "KV blocks in the device pool (minivllm).", m, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.", m, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", m, registry=r)
        self.preemptions = Counter(
            "vllm:num_preemptions", "Preemptions, by mode (recompute|swap) and tenant.", ["model_name", "mode", "tenant"], registry=r
        )
        self.recomputed = Counter("vllm:num_recomputed_tokens", "Tokens computed again after preemption (minivllm).", m, registry=r)
        self.rejected = Counter("vllm:num_requests_rejected", "Requests turned away by reject mode or a tenant cap with over_cap=reject, an n > 1 request once (minivllm).", mt, registry=r)
        self.shed = Counter("vllm:num_requests_shed", "Requests turned away at the server's door before the queue "
                            "(--max-waiting-requests), 429 queue_full (minivllm).", mt, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", mt, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", mt, registry=r)
        self.request_success = Counter(
            "vllm:request_success", "Finished requests, by finish reason.", ["model_name", "finished_reason", "tenant"], registry=r
        )
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", mt, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", mt, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency.", m, buckets=REQUEST_LATENCY_BUCKETS, registry=r
        )
        self.queue_time = Histogram(
            "vllm:request_queue_time_seconds", "Time from arrival to first scheduling.", m, buckets=REQUEST_LATENCY_BUCKETS, registry=r
        )
        self.iteration_tokens = Histogram(
            "vllm:iteration_tokens_total", "Tokens per engine step.", m, buckets=ITERATION_TOKEN_BUCKETS, registry=r
        )
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._last_step = -1

    # -- requests ---------------------------------------------------------------
    def track(self, request_id: str, tenant: str) -> None:
        """Remember a request's tenant (call when it is added)."""
        with self._lock:
            self._tracked[request_id] = _Tracked(tenant)

    def tenant_of(self, request_id: str) -> str:
        """The tenant ``request_id`` was tracked with, else "unknown".  A sample of an ``n > 1`` request is looked
        up by its parent: only the id the caller added is tracked, and a sample can be preempted under its own."""
        t = self._tracked.get(request_id)
        if t is None and (parent := InputProcessor.sample_parent(request_id)) is not None:  # a sample of an n > 1 group
            t = self._tracked.get(parent)
        return t.tenant if t is not None else "unknown"

    def observe_output(self, out, tenant: str | None = None) -> None:
        """One ``RequestOutput`` of a step: tokens, TTFT and new ITLs; latencies once it finishes."""
        with self._lock:
            t = self._tracked.get(out.request_id)
            if t is None:
                t = self._tracked[out.request_id] = _Tracked(tenant or "default")
        name, tenant = self.model_name, t.tenant
        # New tokens per sample, whatever the output kind: a cumulative or final_only output lists all of a
        # sample's token ids (final_only's delta holds only the last one), a delta output only this step's.
        fresh = []
        for o in out.outputs:
            seen = t.seen.get(o.index, 0)
            n = len(o.token_ids) - seen if len(o.token_ids) > len(o.delta_token_ids) else len(o.delta_token_ids)
            n = max(0, n)
            t.seen[o.index] = seen + n
            fresh.append(n)
        new_tokens = sum(fresh)
        if new_tokens:
            self.generation_tokens.labels(name, tenant).inc(new_tokens)
            if not t.prompt_done:
                t.prompt_done = True
                self.prompt_tokens.labels(name, tenant).inc(len(out.prompt_token_ids))
        m = out.metrics
        if not t.ttft_done and m.ttft is not None:
            t.ttft_done = True
            self.ttft.labels(name, tenant).observe(max(0.0, m.ttft))
        # Each sample's gaps are its own (vLLM times each child request), timed by its own token times (its
        # completion's: all so far, or with delta output only this step's).  Not by the request's metrics: an
        # n > 1 group's are one sample's, and a final_only group brings a sample's tokens at once, so a sample
        # preempted part-way would be timed by another's steps -- its gap across the preemption lost, another's
        # gaps counted in its place.  An output built without per-sample times (by hand, vLLM-shaped) falls back
        # to its metrics' times, its one sample's.
        for o, n in zip(out.outputs, fresh):
            times = (o.token_times or m.token_times)[-n:] if n else []
            if not times:
                continue
            last = t.last_times.get(o.index)
            gaps = [b - a for a, b in zip([last, *times], times) if a is not None]
            t.last_times[o.index] = times[-1]
            if gaps:
                hist = self.itl.labels(name, tenant)
                for gap in gaps:
                    hist.observe(max(0.0, gap))
        if out.finished:
            reason = next((o.finish_reason for o in out.outputs if o.finish_reason), None) or "stop"
            self.request_success.labels(name, reason, tenant).inc()
            if reason == "rejected":
                self.rejected.labels(name, tenant).inc()
            else:
                if m.e2e_latency is not None:
                    self.e2e.labels(name).observe(max(0.0, m.e2e_latency))
                if m.queue_time is not None:  # an n > 1 group's: its earliest sample's (OutputProcessor.fold)
                    self.queue_time.labels(name).observe(max(0.0, m.queue_time))
            with self._lock:
                self._tracked.pop(out.request_id, None)

    def observe_abort(self, request_id: str, reason: str = "abort", so_far: tuple[int, tuple[int, ...]] = (0, ())
                      ) -> None:
        """A request ended outside the engine's outputs (the engine reports nothing more for it): one the caller
        gave up on (``"abort"``), or one failed because the engine loop died (``"error"``).

        ``so_far`` is :meth:`LLMEngine.tokens_so_far` read just before the abort: the tokens it generated that no
        output showed (all of a ``final_only`` request's, the last step's of a streamed one) are counted here, as
        vLLM counts every token its engine generates, aborted or not; the prompt too, if no output counted it.
        """
        with self._lock:
            t = self._tracked.pop(request_id, None)
        if t is None:
            return
        name = self.model_name
        prompt_len, per_sample = so_far
        unseen = sum(max(0, n - t.seen.get(i, 0)) for i, n in enumerate(per_sample))
        if unseen:
            self.generation_tokens.labels(name, t.tenant).inc(unseen)
            if not t.prompt_done:
                self.prompt_tokens.labels(name, t.tenant).inc(prompt_len)
        self.request_success.labels(name, reason, t.tenant).inc()

    # -- the engine ---------------------------------------------------------------
    def observe_step(self, engine, stats: dict | None = None, tenant_of: Callable[[str], str] | None = None) -> None:
        """After ``engine.step()``: iteration tokens, preemptions (by mode and tenant), then :meth:`sync`.

        ``tenant_of`` labels a preempted request (default: the tenant it was tracked with, else "unknown").
        """
        stats = engine.stats() if stats is None else stats
        log = engine.step_log
        rec = log[-1] if len(log) else None
        if rec is not None and rec.step != self._last_step:
            self._last_step = rec.step
            if rec.num_tokens:
                self.iteration_tokens.labels(self.model_name).observe(rec.num_tokens)
            self._count_preemptions(engine, rec.preempted, stats, tenant_of)
        self.sync(stats)

    def _count_preemptions(self, engine, preempted, stats: dict, label: Callable[[str], str] | None) -> None:
        left = {"recompute": self._advance("num_recompute_preemptions", stats.get("num_recompute_preemptions", 0)),
                "swap": self._advance("num_swap_preemptions", stats.get("num_swap_preemptions", 0))}
        for rid in preempted:
            if left["swap"] == 0:
                mode = "recompute"
            elif left["recompute"] == 0:
                mode = "swap"
            else:  # both modes in one step ("auto"): ask the request where its KV went
                req = getattr(engine, "requests", {}).get(rid)
                mode = "swap" if getattr(getattr(req, "status", None), "value", None) == "swapped" else "recompute"
            if left[mode] == 0:
                continue
            left[mode] -= 1
            self.preemptions.labels(self.model_name, mode, (label or self.tenant_of)(rid)).inc()
        for mode, n in left.items():  # preemptions the step log did not name (should not happen)
            if n:
                self.preemptions.labels(self.model_name, mode, "unknown").inc(n)

    def sync(self, stats: EngineStats) -> None:
        """Gauges from a ``stats()`` dict; cumulative engine counters become counter increments.

        Called by the engine loop after each step and by a ``/metrics`` scrape (which wants fresh gauges
        while the loop idles), from two threads and with snapshots that can arrive out of order.  The
        engine's counters only ever grow, so a snapshot older than the last one seen adds nothing: a
        counter moves to the highest value seen, under the lock, and is never counted twice.
        """
        name = self.model_name
        # indexed, not .get(key, 0): a key the engine renamed must fail here, not read 0 on every dashboard
        self.running.labels(name).set(stats["num_running"])
        self.waiting.labels(name).set(stats["num_waiting"])
        self.kv_usage.labels(name).set(stats["kv_cache_usage"])
        self.used_blocks.labels(name).set(stats["used_blocks"])
        self.free_blocks.labels(name).set(stats["free_blocks"])
        self.cached_blocks.labels(name).set(stats["cached_blocks"])
        self.num_blocks.labels(name).set(stats["num_blocks"])
        with self._lock:
            for key, counter in (
                ("prefix_cache_queries", self.prefix_queries),
                ("prefix_cache_hits", self.prefix_hits),
                ("recomputed_tokens", self.recomputed),
            ):
                child = counter.labels(name)  # exists from the start (at 0), so dashboards see the series
                value = stats.get(key)  # the prefix-cache keys exist only with a cache (EngineStats)
                delta = 0 if value is None else self._advance(key, value)
                if delta > 0:
                    child.inc(delta)

    def _advance(self, key: str, value: int) -> int:
        """How far the engine's cumulative counter ``key`` moved past the highest value seen, remembering the new
        highest: a stale snapshot (a lower value) adds 0 and does not lower the mark, so the next fresh one is not
        counted twice.  The one rule every engine counter follows here."""
        delta = value - self._last.get(key, 0)
        if delta <= 0:
            return 0
        self._last[key] = value
        return delta

    # -- exposition -----------------------------------------------------------------
    def render(self) -> bytes:
        """The text exposition format (what ``GET /metrics`` returns)."""
        return generate_latest(self.registry)


def metrics_from_step_log(step_log, prompt_lens: dict[str, int], arrivals: dict[str, float], num_blocks: int) -> dict:
    """The operator's metric list rebuilt offline from a step log (no metrics object attached while it ran).

    Why from the log?  A recorded run (a benchmark, a replay, a lab) can be
    analysed afterwards with the same definitions the live series use: gauges
    (running, waiting, free/used blocks) as of the last record; preemptions,
    sampled tokens, TTFT per request and every ITL from all records.  A step
    samples a token for a request exactly when it computes the request's last
    known token (prompt + generated so far) -- the one rule that covers prefill
    chunks (no token), decode, and the recompute after a preemption (one new
    token, however long the recomputed prefill) -- unless the row failed in execution
    (``record.failed``), which samples nothing.  ``used_blocks`` is ``num_blocks``
    less the record's ``available_blocks`` (free + evictable cached), not less its
    free list: with prefix caching on, finished requests leave cached blocks that
    are neither free nor used, and the live ``vllm:kv_cache_used_blocks`` does not
    count them (0, not 15, at the end of three 40-token prompts on 8-token blocks).
    """
    generated: dict[str, int] = {}
    last: dict[str, float] = {}
    ttft: dict[str, float] = {}
    itl: list[float] = []
    preemptions = 0
    for rec in step_log:
        preemptions += len(rec.preempted)
        failed = getattr(rec, "failed", ())  # (a record written by hand may not say)
        for rid, start, n in rec.seqs:
            if rid in failed:  # its row failed in execution: nothing was sampled for it
                continue
            if start + n == prompt_lens[rid] + generated.get(rid, 0):
                generated[rid] = generated.get(rid, 0) + 1
                if rid in last:
                    itl.append(rec.time - last[rid])
                else:
                    ttft[rid] = rec.time - arrivals[rid]
                last[rid] = rec.time
    end = step_log[-1] if len(step_log) else None
    return {
        "running": end.running if end else 0,
        "waiting": end.waiting if end else 0,
        "used_blocks": num_blocks - end.available_blocks if end else 0,
        "free_blocks": end.free_blocks if end else num_blocks,
        "preemptions": preemptions,
        "generation_tokens": sum(generated.values()),
        "ttft": ttft,
        "itl": itl,
    }


def observe_all(metrics: EngineMetrics, engine, outputs, tenant_of: Callable[[str], str] | None = None) -> None:
    """Offline helper: after ``outputs = engine.step()``, record the step and its outputs.

    A request nobody tracked is labelled ``tenant_of(request_id)`` (an ``n > 1`` sample: its parent's), else
    "default" -- in its preemptions too, which can come before its first output.
    """

    def label(rid: str) -> str:
        known = metrics.tenant_of(rid)
        if known != "unknown":
            return known
        return tenant_of(InputProcessor.sample_parent(rid) or rid) if tenant_of else "default"

    metrics.observe_step(engine, tenant_of=label)
    for out in outputs:
        metrics.observe_output(out, tenant_of(out.request_id) if tenant_of else None)
