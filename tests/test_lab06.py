"""Lab 6 extras the registry-driven tests do not cover: the timeline widget and the harness's per-tenant numbers,
checked against a recount of the engine's own step log."""

from __future__ import annotations

import pytest

from minivllm.labs import check_lab06 as lab


@pytest.fixture(scope="module")
def runs():
    arrivals = lab.noisy_quiet(3.0)
    return {"fcfs": lab.serve(lab.lab_engine(), arrivals, window=3.0),
            "wfq": lab.serve(lab.lab_engine(lab.wfq_policy(None)), arrivals, window=3.0)}


def test_serve_per_tenant_numbers_match_a_recount(runs):
    res = runs["fcfs"]
    assert len(res.step_starts) == len(res.records)
    # a step begins where the last one ended, or later (an idle engine's clock jumps to the next arrival)
    assert all(start >= prev.time for start, prev in zip(res.step_starts[1:], res.records))
    assert all(start < r.time for start, r in zip(res.step_starts, res.records))
    for tenant in ("quiet", "noisy"):  # block-seconds: each step's blocks for its part inside the window
        block_s = sum(sum(row.kv_blocks for row in r.tenants if row.tenant == tenant)
                      * max(0.0, min(r.time, res.window) - start) for start, r in zip(res.step_starts, res.records))
        assert res.kv_share(tenant) == pytest.approx(block_s / res.window / res.num_blocks)
        assert 0 < res.kv_share(tenant) < 1
        ttfts = sorted(v for k, v in res.ttft.items() if res.tenant_of[k] == tenant)
        assert res.p95_ttft(tenant) == ttfts[max(0, -(-95 * len(ttfts) // 100) - 1)]


def test_timeline_widget_draws_and_describes_each_run(runs):
    w = lab.TenantTimeline(runs, ["quiet", "noisy"])
    png = w.png()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    line = w.at(1.0)
    rec = min(runs["fcfs"].records, key=lambda r: abs(r.time - 1.0))
    assert f"step {rec.step}" in line and f"noisy {rec.tenant('noisy').running} running" in line
    assert w.pick("wfq").startswith("t = ") and w.current == "wfq"
    assert w.png() != png  # another run, another picture


def test_wfq_protects_quiet_and_keeps_noisy_busy(runs):
    fcfs, wfq = runs["fcfs"], runs["wfq"]
    assert wfq.p95_ttft("quiet") < fcfs.p95_ttft("quiet") / 3
    assert wfq.tokens_per_s("noisy") > 0.8 * fcfs.tokens_per_s("noisy")


def test_serve_builds_one_output_per_request_unless_a_client_reads_them_early():
    """Only a :class:`~minivllm.labs.check_lab06.RetryClient` reads a request before it finishes, so without one
    ``serve`` asks for final-only outputs: one per request, not one per running request per step.  Oracle: the
    outputs the engine hands back, counted per request; and each first-token time recounted from the step log
    (the end of the first step whose row reaches the end of the request's prompt, where its first token is
    sampled), which the final output must report as a streamed one did.  With a client its tenant still streams."""
    from collections import Counter

    def counted(engine, seen):
        step = engine.step

        def counting():
            outs = step()
            seen.update(o.request_id for o in outs)
            return outs

        engine.step = counting
        return engine

    arrivals = lab.noisy_quiet(3.0)
    prompt_len = {a.request_id: len(a.prompt) for a in arrivals}
    seen = Counter()
    res = lab.serve(counted(lab.lab_engine(), seen), arrivals, window=3.0)
    assert seen == Counter({a.request_id: 1 for a in arrivals})
    first = {}
    for rec in res.records:
        for rid, start, n in rec.seqs:
            if start + n >= prompt_len[rid]:
                first.setdefault(rid, rec.time)
    assert res.first_token == pytest.approx(first) and len(first) == len(arrivals)
    assert all(res.ttft[k] == pytest.approx(first[k] - res.arrival[k]) for k in first)

    seen = Counter()
    client = lab.RetryClient("app", timeout_s=1.0)
    lab.serve(counted(lab.lab_engine(), seen), lab.retry_storm(3.0), window=3.0, client=client)
    assert max(n for rid, n in seen.items() if rid in client.job_of) > 1, "the client's requests stream"
