"""Tests written in a mutation pass over the code the course's numbers come from: the load generator's report
(``minivllm/bench/loadgen.py``), the Prometheus series (``minivllm/metrics/prometheus.py``) and the fleet's
summary (``minivllm/sim/fleet.py``).

Each test pins one behaviour that a small, realistic bug (a planted "mutant", named in the docstring) changed
without any other test noticing.  Expectations come from outside the code under test: numpy on the served
requests' own values, a hand count, or the engines' own counters.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")

from minivllm.bench import loadgen as lg  # noqa: E402
from minivllm.metrics.prometheus import EngineMetrics, metrics_from_step_log, observe_all  # noqa: E402
from minivllm.metrics.scrape import metric_samples, metric_value  # noqa: E402
from minivllm.metrics.step_log import StepRecord  # noqa: E402
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from tests.test_loadgen import _sse_body  # noqa: E402


def _load(handler, plan):
    return asyncio.run(lg.run_load("http://test", plan, [lg.Tenant("a")], "m", transport=httpx.MockTransport(handler),
                                   progress=False))


# -- loadgen: the client and the report ----------------------------------------------------------------------


def test_latency_percentiles_count_only_served_requests():
    """A 429 and an HTTP error still get an ``e2e`` (the time to the refusal) and a stream cut before ``[DONE]``
    has a TTFT and gaps; none of them is a served request, so none may enter the TTFT, ITL or e2e percentiles.
    And only a 429 is a reject: a 503 is an error.  Oracle: numpy on the one served request's own values.
    Kills: ``ttft``/``itl``/``e2e`` gathered from every result instead of the ``ok`` ones (three mutants), and
    a 503 counted as a reject."""
    def handler(request):
        i = int(json.loads(request.content)["prompt"].split()[-1])
        if i == 1:
            return httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"message": "busy"}})
        if i == 2:
            return httpx.Response(200, content=_sse_body(["a", "b", "c", "d"], done=False))  # cut mid-stream
        if i == 3:
            return httpx.Response(503, json={"error": {"message": "overloaded"}})
        return httpx.Response(200, content=_sse_body(["a", "b", "c"], usage=3))

    run = _load(handler, [lg.PlannedRequest(i, 0.0, "a", f"p {i}", 2, 4) for i in range(4)])
    assert [r.outcome for r in run.results] == ["ok", "rejected", "error", "error"]
    cut = run.results[2]
    assert cut.ttft is not None and len(cut.itl) == 3  # the cut stream did measure latencies ...
    assert all(r.e2e is not None for r in run.results)  # ... and every refusal an e2e
    served = run.results[0]
    s = lg.summarize(run)["overall"]
    assert (s["ttft_ms"]["n"], s["itl_ms"]["n"], s["e2e_s"]["n"]) == (1, 2, 1)
    assert s["ttft_ms"]["p99"] == pytest.approx(served.ttft * 1000)
    assert s["itl_ms"]["p50"] == pytest.approx(np.percentile(served.itl, 50) * 1000)
    assert s["e2e_s"]["p90"] == pytest.approx(served.e2e)
    assert (s["rejected"], s["error"]) == (1, 2)


def test_run_duration_runs_from_the_start_to_the_last_finish():
    """``RunResult.duration`` -- the denominator of req/s and tok/s -- is the span from the run's start to the
    last request's end (``start + e2e``), not the longest single request.  The second request is scheduled
    0.3 s in, so the run lasts at least that long whatever the machine's speed; each request takes
    milliseconds.  Kills: the duration taken as ``max(e2e)`` (throughput overstated by the arrival span)."""
    def handler(request):
        return httpx.Response(200, content=_sse_body(["a", "b"], usage=2))

    run = _load(handler, [lg.PlannedRequest(0, 0.0, "a", "p", 1, 2), lg.PlannedRequest(1, 0.3, "a", "p", 1, 2)])
    assert all(r.outcome == "ok" for r in run.results)
    assert run.duration == pytest.approx(max(r.start + r.e2e for r in run.results))
    assert run.duration >= 0.3
    s = lg.summarize(run)["overall"]
    assert s["output_throughput"] == pytest.approx(4 / run.duration)


def _ok(index, tenant, ttft=0.25, itl=(0.25,), prompt_tokens=5):
    return lg.RequestResult(index, tenant, 0.0, 5, 4, outcome="ok", start=0.0, ttft=ttft, itl=list(itl),
                            e2e=ttft + sum(itl), chunks=len(itl) + 1, output_tokens=len(itl) + 1,
                            prompt_tokens=prompt_tokens)


def test_a_tenant_whose_every_request_was_refused_keeps_its_row():
    """The per-tenant table is where a starved tenant shows: a tenant that got only 429s must have a row (zero
    served, zero goodput), not vanish from it.  Kills: the tenant list taken from the served requests."""
    rs = [_ok(0, "alice"), _ok(1, "alice"),
          lg.RequestResult(2, "bob", 0.0, 5, 4, outcome="rejected", start=0.0, retry_after=1.0),
          lg.RequestResult(3, "bob", 0.0, 5, 4, outcome="rejected", start=0.0, retry_after=3.0)]
    s = lg.summarize(lg.RunResult(1.0, 2.0, rs), slo_ttft=1.0)
    assert sorted(s["tenants"]) == ["alice", "bob"]
    bob = s["tenants"]["bob"]
    assert (bob["requests"], bob["ok"], bob["rejected"], bob["good"], bob["goodput_fraction"]) == (2, 0, 2, 0, 0.0)
    assert bob["retry_after_s_mean"] == 2.0
    assert "bob" in lg.format_table(s)


# -- fleet.py: its summary -----------------------------------------------------------------------------------

_SMALL = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, model_max_len=4096)


def _small_replica(executor):
    from minivllm.sim.fleet import sim_replica

    return sim_replica(executor, **_SMALL)


def test_prompt_tokens_count_only_served_requests_in_a_fleet():
    """A request refused at a replica's door (longer than its max_model_len) is recorded with its prompt length
    as ``prompt_tokens``, but no replica prefilled it: the summary's prompt tokens are the served requests'.
    Oracle: the served prompts' lengths, summed by hand.  Kills: prompt tokens summed over every result."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import Fleet
    from minivllm.sim.router import RoundRobinRouter

    served = [Arrival(float(i), f"q{i}", "default", tuple(range(10 + i, 40 + i)), 4) for i in range(3)]
    refused = Arrival(1.5, "long", "default", tuple([11] * 5000), 4)
    res = Fleet(1, RoundRobinRouter(), engine_factory=_small_replica).run(
        sorted(served + [refused], key=lambda a: a.time))
    assert res.result("long").outcome == "error" and res.result("long").prompt_tokens == 5000
    s = res.summary()
    assert (s["ok"], s["error"]) == (3, 1)
    assert s["prompt_tokens"] == 3 * 30


def test_windowed_rates_are_per_second_of_the_window():
    """``summary(window=(t0, t1))`` measures the steady state: req/s, tok/s and goodput/s are per second of the
    window, not of the whole run (warm-up and drain included).  Kills: the window's requests divided by the
    run's duration."""
    from minivllm.sim.fleet import FleetResult

    results = [lg.RequestResult(i, "a", t, 5, 2, outcome="ok", start=t, ttft=0.5, itl=[0.5], e2e=1.0, chunks=2,
                                output_tokens=2, prompt_tokens=5) for i, t in enumerate((0.5, 1.0, 2.0, 3.0))]
    res = FleetResult(results, [], {}, {}, 8.0, _index={f"r{i}": i for i in range(4)})
    s = res.summary(slo_ttft=1.0, window=(1.0, 3.0))  # two requests, two tokens each, in a 2 s window
    assert (s["request_throughput"], s["output_throughput"], s["goodput_rps"]) == (1.0, 2.0, 1.0)
    whole = res.summary(slo_ttft=1.0)
    assert whole["request_throughput"] == 4 / 8.0


def test_a_rejected_request_is_not_a_cache_lookup():
    """Reject mode turns a request away before admission, so it never looked the prefix cache up; the windowed
    hit rate over the whole run must equal the engines' own counters (hit tokens over queried tokens), which
    count only admitted requests.  Kills: a rejected request given a cached-tokens entry (its whole prompt
    added to the looked-up tokens, the hit rate diluted)."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import Fleet, sim_replica
    from minivllm.sim.router import RoundRobinRouter

    shared = tuple(range(10, 42))  # two full blocks every prompt starts with; r0 caches them, the rest come later
    arrivals = [Arrival(0.0 if i == 0 else 0.5, f"r{i}", "default", shared + tuple(range(100 + 10 * i, 108 + 10 * i)), 40)
                for i in range(6)]
    fleet = Fleet(1, RoundRobinRouter(), engine_factory=lambda ex: sim_replica(
        ex, num_blocks=12, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, model_max_len=512,
        preemption_mode="reject"))
    res = fleet.run(arrivals)
    outcomes = [r.outcome for r in res.results]
    assert "rejected" in outcomes and "ok" in outcomes
    rep = res.replicas[0]
    assert rep.query_tokens == 40 * outcomes.count("ok") and rep.hit_tokens > 0
    assert res.summary(window=(-1.0, 1e9))["prefix_hit_rate"] == pytest.approx(rep.hit_tokens / rep.query_tokens)


# -- prometheus.py -------------------------------------------------------------------------------------------


def _output(rid, samples, finished, arrival=1.0, times=()):
    """A RequestOutput whose ``samples`` are (token count, finish reason) per sample index."""
    outs = [CompletionOutput(i, "", list(range(n)), reason, None, "", list(range(n))[-1:]) for i, (n, reason) in
            enumerate(samples)]
    m = RequestMetrics(arrival, arrival + 0.5 if times else None, times[0] if times else None, list(times),
                       times[-1] if finished and times else (arrival if finished else None))
    return RequestOutput(rid, None, [9] * 7, outs, finished, m)


def test_a_rejected_request_adds_no_prompt_tokens():
    """``vllm:prompt_tokens`` counts prefill tokens processed; a request rejected before admission processed
    none (it still counts once as a rejected ``request_success``).  Oracle: a hand count -- 7 prompt tokens
    for the served request only.  Kills: the prompt counted on a request's first output whether or not it
    produced a token."""
    m = EngineMetrics("mm")
    m.track("no", "alice")
    m.track("yes", "alice")
    m.observe_output(_output("no", [(0, "rejected")], finished=True))
    m.observe_output(_output("yes", [(2, "length")], finished=True, times=(2.0, 2.5)))
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:prompt_tokens_total", tenant="alice") == 7
    assert metric_value(s, "vllm:generation_tokens_total", tenant="alice") == 2
    assert metric_value(s, "vllm:request_success_total", finished_reason="rejected") == 1
    assert metric_value(s, "vllm:num_requests_rejected_total", tenant="alice") == 1


def test_an_n_group_is_counted_under_sample_zeros_finish_reason():
    """An ``n > 1`` request counts once, labelled with sample 0's finish reason (the module's contract): here
    sample 0 stopped on EOS and sample 1 ran to its length.  Kills: the label taken from the last sample."""
    m = EngineMetrics("mm")
    m.track("g", "alice")
    m.observe_output(_output("g", [(2, "stop"), (4, "length")], finished=True, times=(2.0, 2.5, 3.0, 3.5)))
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:request_success_total", finished_reason="stop") == 1
    assert metric_value(s, "vllm:request_success_total") == 1


class _FakeEngine:
    def __init__(self, stats):
        self.step_log, self.requests, self._stats = [], {}, stats

    def stats(self):
        return dict(self._stats)


def _zero_stats() -> dict:
    from minivllm.metrics.engine_stats import EngineStats

    return {**{k: 0 for k in EngineStats.__required_keys__}, "kv_cache_usage": 0.0, "per_tenant": {}}


def _rec(step, preempted=(), seqs=(), free=10):
    ids, starts, ns = (tuple(x) for x in zip(*seqs)) if seqs else ((), (), ())
    return StepRecord(step, 0.0, ids, starts, ns, sum(ns), tuple(preempted), 0, 0, (), (), free, free, 0, 0)


def test_an_untracked_samples_preemption_is_charged_to_its_parents_tenant():
    """Offline, ``observe_all``'s ``tenant_of`` knows the requests the caller added, not their samples' ids
    (``parent#i``): a sample preempted before any output is labelled by its parent's tenant.  Oracle: the
    caller's own table.  Kills: ``tenant_of`` asked about the sample id itself."""
    e = _FakeEngine({**_zero_stats(), "num_recompute_preemptions": 1})
    e.step_log.append(_rec(0, preempted=["g#1"]))
    m = EngineMetrics("mm")
    observe_all(m, e, [], {"g": "alice"}.get)
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute", tenant="alice") == 1
    assert metric_value(s, "vllm:num_preemptions_total") == 1


def test_an_untracked_preemption_whose_id_holds_a_hash_is_charged_to_its_own_tenant():
    """Request ids may contain ``#``; only a ``parent#<digits>`` id is a sample, split at its *last* ``#`` (the
    input processor's rule).  A request ``user#3x`` is its own parent, and ``job#7#1`` is a sample of ``job#7``.
    Oracle: the caller's own table.  Kills: splitting at the first ``#`` (both went to "None": ``user`` and
    ``job`` are no one's ids), or at the last whatever follows it."""
    e = _FakeEngine({**_zero_stats(), "num_recompute_preemptions": 2})
    e.step_log.append(_rec(0, preempted=["user#3x", "job#7#1"]))
    m = EngineMetrics("mm")
    observe_all(m, e, [], {"user#3x": "alice", "job#7": "bob", "user": "mallory"}.get)
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute", tenant="alice") == 1
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute", tenant="bob") == 1
    assert metric_value(s, "vllm:num_preemptions_total") == 2
    m.track("user", "mallory")  # the server's path: tracked requests, by the same rule
    assert m.tenant_of("user#3") == "mallory" and m.tenant_of("user#3x") == "unknown"


def test_preemptions_never_exceed_the_engines_own_counters():
    """The preemption counter follows the engine's cumulative counters; a step record naming a preemption that
    the (possibly older) stats snapshot does not count yet adds nothing, and the scrape still works.  Oracle:
    the engine counters' values.  Kills: naming a preemption without a count left for it (the leftover loop
    then tries to decrement a Prometheus counter, which raises)."""
    e = _FakeEngine(_zero_stats())
    e.step_log.append(_rec(0, preempted=["a"]))
    m = EngineMetrics("mm")
    m.track("a", "alice")
    m.observe_step(e)
    e.step_log.append(_rec(1, preempted=["a"]))
    e._stats["num_recompute_preemptions"] = 1
    m.observe_step(e)
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:num_preemptions_total") == 1


def test_metrics_from_an_empty_step_log_are_an_idle_engine():
    """Before any step every block is free: ``free_blocks`` is the pool's size and nothing is used.  Kills:
    an empty log read as zero free blocks (a full cache)."""
    got = metrics_from_step_log([], {}, {}, num_blocks=10)
    assert (got["free_blocks"], got["used_blocks"], got["running"], got["waiting"]) == (10, 0, 0, 0)
    assert (got["preemptions"], got["generation_tokens"], got["ttft"], got["itl"]) == (0, 0, {}, [])
