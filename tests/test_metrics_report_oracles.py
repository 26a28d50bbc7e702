"""Mutation hunt on what the course measures with: each test pins one number a user reads against an oracle
that does not share the code under test (numpy's percentile, a hand count, prometheus_client's own parser)."""

from __future__ import annotations

import numpy as np

from minivllm.bench import loadgen as lg


def _ok(i: int, ttft: float, itl: list[float]) -> lg.RequestResult:
    r = lg.RequestResult(index=i, tenant="t", arrival=0.0, prompt_len=4, max_tokens=len(itl) + 1)
    r.outcome, r.start, r.ttft, r.itl = "ok", 0.0, ttft, list(itl)
    r.e2e = ttft + sum(itl)
    return r


def test_goodput_judges_a_request_by_the_p99_of_its_own_gaps():
    """The default per-request ITL figure is the p99 of its gaps (numpy's default percentile), so two long stalls
    in 100 gaps fails a 0.5 s ITL SLO while the p95 (0.01 s) would have passed it."""
    gaps = [0.01] * 98 + [1.0, 1.0]
    r = _ok(0, 0.05, gaps)
    assert lg.request_itl(r) == np.percentile(gaps, 99)
    assert np.percentile(gaps, 95) <= 0.5 < np.percentile(gaps, 99)
    s = lg.summarize_group([r, _ok(1, 0.05, [0.01] * 10)], duration=2.0, slo_itl=0.5)
    assert s["good"] == 1 and s["goodput_fraction"] == 0.5


def test_summary_latency_columns_match_numpy_over_served_requests_only():
    """TTFT, ITL and e2e columns (p50/p90/p99 and the JSON's mean) against numpy over the ok requests' samples,
    each in its unit: a 429 or a timed-out request's latencies are not the server's service time."""
    rng = np.random.default_rng(3)
    served = [_ok(i, float(rng.uniform(0.01, 0.3)), list(rng.uniform(0.005, 0.05, size=int(rng.integers(1, 6)))))
              for i in range(7)]
    bad = _ok(99, 9.0, [9.0])
    bad.outcome = "timeout"
    s = lg.summarize_group(served + [bad], duration=4.0)
    cols = {"ttft_ms": ([r.ttft for r in served], 1000), "itl_ms": ([g for r in served for g in r.itl], 1000),
            "e2e_s": ([r.e2e for r in served], 1)}
    for key, (xs, scale) in cols.items():
        for p in (50, 90, 99):
            assert np.isclose(s[key][f"p{p}"], np.percentile(xs, p) * scale), (key, p)
        assert np.isclose(s[key]["mean"], np.mean(xs) * scale), key
        assert s[key]["n"] == len(xs)


def test_client_wait_is_send_time_minus_scheduled_arrival():
    """The client-side wait (the load generator falling behind its schedule) is start - arrival per request,
    p99 by numpy, in ms; a request sent late at t = 5 s waited 0.2 s, not 5 s."""
    rs = []
    for i, (arrival, start) in enumerate([(1.0, 1.0), (2.0, 2.05), (5.0, 5.2), (3.0, 3.01)]):
        r = _ok(i, 0.05, [0.01])
        r.arrival, r.start = arrival, start
        rs.append(r)
    s = lg.summarize_group(rs, duration=6.0)
    assert np.isclose(s["client_wait_ms_p99"], np.percentile([0.0, 0.05, 0.2, 0.01], 99) * 1000)


def test_report_row_prints_each_column_from_its_own_number():
    """One tenant's printed row, column by column, against a hand count and numpy: sent counts the requests that
    left the client (a send time), the err column is errors + timeouts, and each latency triple is p50/p90/p99
    in that order."""
    rng = np.random.default_rng(11)
    served = [_ok(i, float(rng.uniform(0.02, 0.9)), list(rng.uniform(0.01, 0.2, size=4))) for i in range(9)]
    for r in served:
        r.e2e = float(rng.uniform(0.5, 9.0))
        r.output_tokens = 5
    extra = []
    # the second timeout waited for a --max-concurrency slot and was never sent: no send time
    for i, (outcome, start) in enumerate([("rejected", 0.0), ("error", 0.0), ("timeout", 0.0), ("timeout", None),
                                          ("unsent", None)]):
        r = lg.RequestResult(index=100 + i, tenant="t", arrival=0.0, prompt_len=4, max_tokens=4)
        r.outcome, r.start = outcome, start
        extra.append(r)
    summary = lg.summarize(lg.RunResult(rate=2.0, duration=5.0, results=served + extra))
    row = lg.format_table(summary).splitlines()[2]
    cells = row.replace("|", " ").split()
    assert cells[:5] == ["t", "12", "9", "1", "3"]  # sent = 14 - 2 never sent; err = 1 error + 2 timeouts

    def triple(xs, scale, fmt):
        return "/".join(fmt.format(np.percentile(xs, p) * scale) for p in (50, 90, 99))

    assert cells[5] == triple([r.ttft for r in served], 1000, "{:.0f}")
    assert cells[6] == triple([g for r in served for g in r.itl], 1000, "{:.0f}")
    assert cells[7] == triple([r.e2e for r in served], 1, "{:.2f}")
    # req/s = 9 ok / 5 s; tok/s = 45 / 5 s; good (no SLO: every ok request) = 9 of 14 and 9 / 5 s
    assert cells[8:] == ["1.80", "9.0", "64%", "1.80"]


def _samples(metrics) -> dict:
    """Every sample of a render, read back with prometheus_client's own text parser (not minivllm's scraper)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(metrics.render().decode()) for s in fam.samples}


def test_a_single_unnamed_preemption_is_still_counted():
    """A preemption the step log does not name (a request it lost track of) still counts, as tenant "unknown":
    the counter must add up to the engine's own total, one unnamed preemption included."""
    from types import SimpleNamespace

    from minivllm.metrics.prometheus import EngineMetrics

    stats = {"num_running": 0, "num_waiting": 1, "kv_cache_usage": 0.0, "used_blocks": 0, "free_blocks": 8,
             "cached_blocks": 0, "num_blocks": 8, "num_recompute_preemptions": 1, "num_swap_preemptions": 0,
             "recomputed_tokens": 0}
    engine = SimpleNamespace(step_log=[SimpleNamespace(step=0, num_tokens=4, preempted=[])], stats=lambda: stats)
    m = EngineMetrics("sim")
    m.observe_step(engine)
    key = ("vllm:num_preemptions_total", (("mode", "recompute"), ("model_name", "sim"), ("tenant", "unknown")))
    assert _samples(m)[key] == 1.0


def test_sweep_rate_passes_with_p99_itl_exactly_at_the_slo():
    """The sweep's itl criterion reads "p99 within the SLO" like every SLO here (met *at* the bound, as
    ``meets_slo``): a rate whose p99 ITL is exactly 250 ms passes a 250 ms SLO; a hair above fails it."""
    def summary(p99_ms):
        return {"overall": {"itl_ms": {"p99": p99_ms}, "ttft_ms": {"p99": 10.0}, "ok": 5, "goodput_fraction": 1.0}}

    assert lg.meets(summary(250.0), "itl", None, 0.25, 0.9)
    assert not lg.meets(summary(250.001), "itl", None, 0.25, 0.9)
    assert lg.meets(summary(250.0), "itl", 0.01, 0.25, 0.9)  # p99 TTFT 10 ms at a 10 ms bound


def test_step_log_rebuild_counts_every_preemption_and_only_tokens_sampled():
    """``metrics_from_step_log`` against a hand count of a small log: a step that preempts two requests is two
    preemptions, and a chunk of a recompute that stops short of the last known token samples nothing."""
    from types import SimpleNamespace

    from minivllm.metrics.prometheus import metrics_from_step_log

    def rec(t, seqs, preempted=()):
        return SimpleNamespace(time=t, seqs=seqs, preempted=list(preempted), running=1, waiting=0, free_blocks=3,
                               available_blocks=6)  # 3 free + 3 cached no request holds

    log = [
        rec(1.0, [("a", 0, 4), ("b", 0, 4)]),  # both prefills complete: a token each (TTFTs 1.0 and 0.5)
        rec(2.0, [("a", 4, 1), ("b", 4, 1)]),  # decode: a token each
        rec(3.0, [], preempted=["a", "b"]),  # two preemptions in one step
        rec(4.0, [("a", 0, 5)]),  # a's recompute, first chunk: 5 of its 6 known tokens, no token sampled
        rec(5.0, [("a", 5, 1)]),  # the chunk reaching its last known token: a samples its third token
    ]
    m = metrics_from_step_log(log, {"a": 4, "b": 4}, {"a": 0.0, "b": 0.5}, num_blocks=8)
    assert m["preemptions"] == 2
    assert m["generation_tokens"] == 5
    assert m["ttft"] == {"a": 1.0, "b": 0.5}
    assert sorted(m["itl"]) == [1.0, 1.0, 3.0]
    assert (m["used_blocks"], m["free_blocks"]) == (2, 3)  # used: the pool less the available blocks


def test_sweep_crossing_at_a_rate_exactly_on_the_slo_and_never_at_an_unbounded_rate():
    """The crossing rate is where the straight line between the last passing and the first failing rate meets
    the SLO: the passing rate itself when its p99 is exactly on the bound (fraction 0), and none at all when
    the failing rate is unbounded ("inf": the line has no finite point to interpolate to)."""
    def row(rate, p99_ms):
        return {"rate": rate, "overall": {"itl_ms": {"p99": p99_ms}, "ttft_ms": {"p99": 1.0}, "ok": 5,
                                          "goodput_fraction": 1.0}}

    v = lg.sweep_verdict([row(1.0, 200.0), row(2.0, 250.0), row(4.0, 350.0)], "itl", None, 0.25, 0.9)
    assert (v["max_rate_meeting_slo"], v["first_failing_rate"], v["crossing_rate"]) == (2.0, 4.0, 2.0)
    v = lg.sweep_verdict([row(1.0, 200.0), row(float("inf"), 900.0)], "itl", None, 0.25, 0.9)
    assert (v["max_rate_meeting_slo"], v["crossing_rate"]) == (1.0, None)


def test_output_tokens_and_tok_s_count_only_served_requests():
    """Output tokens and tok/s are the served requests' (vLLM's serving benchmark sums only successful outputs):
    the simulator's client counts a request's tokens as they stream, so one cut off by the run's end ("timeout")
    or a stream that broke ("error") carries tokens no client got as an answer.  Oracle: a hand count, 3 served
    requests of 5 tokens over 2 s = 15 tokens, 7.5 tok/s, whatever the 40 tokens of the two failed ones.
    Kills: the token sum taken over every request, not only the ok ones."""
    served = [_ok(i, 0.05, [0.01] * 4) for i in range(3)]
    for r in served:
        r.output_tokens = 5
    cut = [_ok(10 + i, 0.05, [0.01] * 19) for i in range(2)]
    for r, outcome in zip(cut, ("timeout", "error")):
        r.outcome, r.output_tokens = outcome, 20
    s = lg.summarize_group(served + cut, duration=2.0)
    assert (s["output_tokens"], s["output_throughput"]) == (15, 7.5)


def test_sweep_rate_passes_with_goodput_exactly_at_the_minimum():
    """``--sweep-criterion goodput`` passes a rate whose goodput is *at least* ``--min-goodput`` (the README's
    "goodput >= --min-goodput", the flag's help text): 9 good requests of 10 meet a 90% goal; 8 do not.
    Oracle: the hand count (9/10 is the float 0.9 that the flag reads).  Kills: ``>=`` written as ``>``."""
    def summary(good):
        rs = [_ok(i, 0.05, [0.01]) for i in range(10)]
        for r in rs[good:]:
            r.outcome = "rejected"
        return {"overall": lg.summarize_group(rs, duration=1.0)}

    assert summary(9)["overall"]["goodput_fraction"] == 0.9
    assert lg.meets(summary(9), "goodput", None, None, 0.9)
    assert not lg.meets(summary(8), "goodput", None, None, 0.9)


def test_sent_column_leaves_out_requests_that_waited_for_a_slot_past_the_timeout():
    """A real run: three requests at t=0 under ``--max-concurrency 1`` to a server that takes 2 s, stopped by a
    0.5 s ``--timeout``.  One request left the client; the two queued behind the slot never did, yet all three
    end as timeouts (as the client's error says: "waited for a --max-concurrency slot").  The table's "sent"
    column said 3.  Oracle: the handler's own count of requests it received."""
    import asyncio

    import httpx

    received = []

    async def slow(request: httpx.Request) -> httpx.Response:
        received.append(request)
        await asyncio.sleep(2.0)
        return httpx.Response(200, text="data: [DONE]\n\n")

    plan = [lg.PlannedRequest(i, 0.0, "t", "a b c", 3, 4) for i in range(3)]
    run = asyncio.run(lg.run_load("http://x", plan, [lg.Tenant("t")], "m", max_concurrency=1, timeout=0.5,
                                  progress=False, transport=httpx.MockTransport(slow)))
    assert [r.outcome for r in run.results] == ["timeout"] * 3
    row = lg.format_table(lg.summarize(run)).splitlines()[2].split()
    assert row[:2] == ["t", str(len(received))] and len(received) == 1
