"""The load generator (``minivllm bench serve``): arrivals, workload, trace parser, SSE parser,
percentile / goodput math against numpy, the streaming client against fake transports, and
one end-to-end run against the real server on 127.0.0.1 (marked slow)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

httpx = pytest.importorskip("httpx")

from minivllm.bench import loadgen as lg  # noqa: E402
from tests.fuzz import examples  # noqa: E402

# -- arrivals ------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_arrival_mean_rate(rate, burstiness):
    t = lg.arrival_times(20000, rate, burstiness, np.random.default_rng(1))
    assert t[0] == 0 and np.all(np.diff(t) >= 0)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    # gamma(shape k): squared coefficient of variation 1/k (Poisson: exponential gaps, CV 1)
    assert gaps.var() / gaps.mean() ** 2 == pytest.approx(1 / burstiness, rel=0.1)


def test_burstier_means_higher_variance_same_rate():
    rng = lambda: np.random.default_rng(7)  # noqa: E731
    var = {b: np.diff(lg.arrival_times(10000, 2.0, b, rng())).var() for b in (0.2, 1.0, 5.0)}
    assert var[0.2] > 3 * var[1.0] > 9 * var[5.0]
    # counts in 1-second windows: bursty arrivals are overdispersed (Poisson: variance = mean)
    t = lg.arrival_times(20000, 5.0, 0.2, rng())
    counts = np.bincount(t.astype(int))
    assert counts.var() > 2 * counts.mean()


def test_arrivals_seeded_and_edge_cases():
    a = lg.arrival_times(100, 3.0, 1.0, np.random.default_rng(3))
    b = lg.arrival_times(100, 3.0, 1.0, np.random.default_rng(3))
    assert np.array_equal(a, b)
    assert np.array_equal(lg.arrival_times(5, math.inf), np.zeros(5))
    assert len(lg.arrival_times(0, 1.0)) == 0
    for bad in (dict(rate=0), dict(rate=-1), dict(rate=1, burstiness=0)):
        with pytest.raises(ValueError):
            lg.arrival_times(3, **bad)


# -- workload ------------------------------------------------------------------------------


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert lg.LengthDist.parse("32").sample(rng) == 32 == lg.LengthDist.parse("fixed:32").sample(rng)
    u = lg.LengthDist.parse("uniform:4:9")
    xs = [u.sample(rng) for _ in range(2000)]
    assert min(xs) == 4 and max(xs) == 9
    ln = lg.LengthDist.parse("lognormal:100:0.5:150")
    xs = np.array([ln.sample(rng) for _ in range(4000)])
    assert xs.min() >= 1 and xs.max() == 150
    assert np.median(xs) == pytest.approx(100, rel=0.08)
    assert str(ln) == "lognormal:100:0.5:150" and str(u) == "uniform:4:9"
    for bad in ("0", "x", "uniform:5:2", "uniform:0:3", "lognormal:10:-1", "normal:3:4", "fixed:"):
        with pytest.raises(ValueError):
            lg.LengthDist.parse(bad)


def test_parse_tenant():
    t = lg.parse_tenant("name=alice,key=k1,share=3,input=uniform:8:16,output=4,prefix=sys:32")
    assert (t.name, t.api_key, t.share, str(t.input_len), str(t.output_len), t.prefix_group, t.prefix_len) == (
        "alice", "k1", 3.0, "uniform:8:16", "fixed:4", "sys", 32)
    d = lg.parse_tenant("name=bob", "fixed:10", "fixed:2", "dflt")
    assert (d.api_key, str(d.input_len), str(d.output_len), d.prefix_len) == ("dflt", "fixed:10", "fixed:2", 0)
    for bad in ("key=x", "name=a,share=0", "name=a,colour=red", "name=a,prefix=32", "name=a,share=nan"):
        with pytest.raises(ValueError):
            lg.parse_tenant(bad)


def test_plan_shares_prefixes_and_reproducibility():
    ts = [lg.parse_tenant("name=a,share=3,input=uniform:5:10,output=7,prefix=g1:20"),
          lg.parse_tenant("name=b,share=1,input=fixed:6,output=3,prefix=g1:20"),
          lg.parse_tenant("name=c,share=1,input=fixed:6,prefix=g2:20")]
    plan = lg.plan_requests(ts, 5000, 10.0, 1.0, seed=4)
    assert plan == lg.plan_requests(ts, 5000, 10.0, 1.0, seed=4)
    assert plan != lg.plan_requests(ts, 5000, 10.0, 1.0, seed=5)
    share_a = sum(p.tenant == "a" for p in plan) / len(plan)
    assert share_a == pytest.approx(0.6, abs=0.03)
    pre = {p.tenant: p.prompt.split("\n")[0] for p in plan}
    assert pre["a"] == pre["b"] != pre["c"]  # one system prompt per group
    assert len(pre["a"].split()) == 20
    for p in plan:
        n_words = len(p.prompt.split())
        assert n_words == p.prompt_len
        assert p.max_tokens == {"a": 7, "b": 3, "c": 16}[p.tenant]
        if p.tenant == "a":
            assert 25 <= p.prompt_len <= 30
    # unique parts differ (no accidental prefix sharing beyond the group's)
    assert len({p.prompt for p in plan}) > 0.99 * len(plan)


# -- trace ---------------------------------------------------------------------------------


def test_parse_trace_and_plan():
    text = "\n".join([
        "# a comment",
        json.dumps({"timestamp": 12.5, "tenant": "bob", "prompt_len": 8, "max_tokens": 3}),
        "",
        json.dumps({"arrival": 10.0, "tenant": "alice", "prompt": "hello there", "output_len": 5}),
        json.dumps({"time": 11, "prompt_len": 4}),
    ])
    es = lg.parse_trace(text.splitlines())
    assert [e.timestamp for e in es] == [0.0, 1.0, 2.5]
    assert [e.tenant for e in es] == ["alice", None, "bob"]
    assert es[0].prompt == "hello there" and es[0].max_tokens == 5 and es[2].prompt_len == 8
    ts = [lg.parse_tenant("name=alice,output=9"), lg.parse_tenant("name=bob,prefix=s:5")]
    plan = lg.plan_from_trace(es, ts)
    assert [p.arrival for p in plan] == [0.0, 1.0, 2.5]
    assert [p.tenant for p in plan] == ["alice", "alice", "bob"]  # no tenant: the first declared
    assert [p.max_tokens for p in plan] == [5, 9, 3]
    assert plan[0].prompt == "hello there" and plan[2].prompt_len == 13 and len(plan[2].prompt.split()) == 13
    fast = lg.plan_from_trace(es, ts, rate=8.0)  # 2 gaps in 2.5 s = 0.8 req/s -> 10x faster
    assert [p.arrival for p in fast] == pytest.approx([0.0, 0.1, 0.25])
    with pytest.raises(ValueError, match="not declared"):
        lg.plan_from_trace(es, [lg.parse_tenant("name=carol")])


@pytest.mark.parametrize("line,msg", [
    ("{not json", "line 1: not JSON"),
    ("[1, 2]", "expected an object"),
    ('{"prompt_len": 3}', "timestamp"),
    ('{"timestamp": -1, "prompt_len": 3}', "timestamp"),
    ('{"timestamp": true, "prompt_len": 3}', "timestamp"),
    ('{"timestamp": 1}', "prompt"),
    ('{"timestamp": 1, "prompt_len": 0}', "prompt_len"),
    ('{"timestamp": 1, "prompt": ""}', "prompt"),
    ('{"timestamp": 1, "prompt_len": 3, "max_tokens": 2.5}', "max_tokens"),
    ('{"timestamp": 1, "prompt_len": 3, "tenant": 7}', "tenant"),
])
def test_parse_trace_errors(line, msg):
    with pytest.raises(ValueError, match=msg):
        lg.parse_trace([line])
    with pytest.raises(ValueError, match="no requests"):
        lg.parse_trace(["", "# nothing"])


# -- SSE -----------------------------------------------------------------------------------


def test_sse_decoder():
    lines = [
        ": keep-alive comment",
        "data: {\"a\": 1}",
        "",
        "event: message",
        "id: 7",
        "data:first",
        "data:  second",  # one leading space is stripped, not two
        "",
        "",  # extra blank lines dispatch nothing
        "retry: 100",
        "data: [DONE]\r",
        "",
        "data: unterminated",
    ]
    assert list(lg.iter_sse(lines)) == ['{"a": 1}', "first\n second", "[DONE]", "unterminated"]
    dec = lg.SSEDecoder()
    assert dec.feed("data") is None and dec.feed("") == ""  # a bare "data" field is an empty line of data
    assert dec.flush() is None


@given(st.lists(st.sampled_from(["data: ", "x", "\u2028", "\u2029", "\x85", "\r", "\n", "\r\n", "é"]),
                max_size=30), st.data())
@settings(max_examples=examples(300), deadline=None)
def test_sse_lines_split_only_where_sse_does(pieces, data):
    """Lines end at CR LF, LF or CR, wherever the chunks happen to be cut, and never at U+2028, U+2029 or
    U+0085 (``str.splitlines`` -- httpx's ``aiter_lines`` -- breaks there, cutting a JSON data line in two).
    Oracle: ``re.split`` on the whole body."""
    import re

    body = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=6)))
    chunks = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)])]

    async def collect():
        async def gen():
            for c in chunks:
                yield c
        return [line async for line in lg.sse_lines(gen())]

    want = re.split(r"\r\n|\r|\n", body)
    if want and want[-1] == "":
        want.pop()  # a body ending in a line break has no unterminated last line
    assert asyncio.run(collect()) == want


# -- statistics against numpy --------------------------------------------------------------


def test_percentile_matches_numpy():
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101, 1000):
        xs = rng.lognormal(0, 1, n)
        for p in (0, 1, 50, 90, 99, 99.9, 100):
            assert lg.percentile(list(xs), p) == pytest.approx(np.percentile(xs, p), rel=1e-12)
    assert math.isnan(lg.percentile([], 50))


def _random_results(rng, n=400):
    out = []
    for i in range(n):
        r = lg.RequestResult(i, rng.choice(["a", "b", "c"]), 0.0, 10, 8)
        r.outcome = str(rng.choice(["ok"] * 6 + ["rejected", "error", "timeout", "unsent"]))
        if r.outcome == "ok":
            r.start = float(rng.uniform(0, 10))
            k = int(rng.integers(0, 9))
            r.ttft = float(rng.lognormal(-1, 0.7)) if k else None
            r.itl = [float(g) for g in rng.lognormal(-2.5, 0.8, max(0, k - 1))]
            r.chunks = k
            r.output_tokens = k
            r.e2e = (r.ttft or 0) + sum(r.itl) + 0.01
        elif r.outcome == "rejected":
            r.retry_after = float(rng.integers(1, 5))
        out.append(r)
    return out


@pytest.mark.parametrize("stat", ["p99", "max", "mean"])
def test_summary_and_goodput_against_numpy(stat):
    rng = np.random.default_rng(11)
    rs = _random_results(rng)
    slo_ttft, slo_itl, duration = 0.5, 0.09, 12.5
    s = lg.summarize(lg.RunResult(2.0, duration, rs), slo_ttft, slo_itl, stat)
    agg = {"p99": lambda x: np.percentile(x, 99), "max": np.max, "mean": np.mean}[stat]
    for name, group in [("overall", rs)] + [(t, [r for r in rs if r.tenant == t]) for t in "abc"]:
        g = s["overall"] if name == "overall" else s["tenants"][name]
        ok = [r for r in group if r.outcome == "ok"]
        good = np.array([r.outcome == "ok" and r.ttft is not None and r.ttft <= slo_ttft
                         and (len(r.itl) == 0 or agg(np.array(r.itl)) <= slo_itl) for r in group])
        assert g["good"] == good.sum()
        assert g["goodput_fraction"] == pytest.approx(good.mean())
        assert g["goodput_rps"] == pytest.approx(good.sum() / duration)
        assert g["requests"] == len(group) and g["ok"] == len(ok)
        assert g["rejected"] == sum(r.outcome == "rejected" for r in group)
        assert g["output_tokens"] == sum(r.output_tokens for r in ok)
        assert g["request_throughput"] == pytest.approx(len(ok) / duration)
        ttft = np.array([r.ttft for r in ok if r.ttft is not None])
        itl = np.concatenate([r.itl for r in ok if r.itl])
        e2e = np.array([r.e2e for r in ok])
        for p in (50, 90, 99):
            assert g["ttft_ms"][f"p{p}"] == pytest.approx(np.percentile(ttft, p) * 1000)
            assert g["itl_ms"][f"p{p}"] == pytest.approx(np.percentile(itl, p) * 1000)
            assert g["e2e_s"][f"p{p}"] == pytest.approx(np.percentile(e2e, p))
    assert sum(s["tenants"][t]["requests"] for t in "abc") == len(rs)
    # no SLO: every served request is good
    s0 = lg.summarize(lg.RunResult(2.0, duration, rs))
    assert s0["overall"]["good"] == s0["overall"]["ok"]
    assert "overall" in lg.format_table(s)


def _fake_summary(rate, p99_itl_ms, good=1.0, p99_ttft_ms=100.0):
    return {"rate": rate, "overall": {"ok": 10, "itl_ms": {"p99": p99_itl_ms}, "ttft_ms": {"p99": p99_ttft_ms},
                                      "goodput_fraction": good}}


def test_sweep_verdict():
    rows = [_fake_summary(4, 700, 0.5), _fake_summary(1, 100), _fake_summary(2, 300, 0.95), _fake_summary(8, 900, 0.1)]
    v = lg.sweep_verdict(rows, "itl", None, 0.5, 0.9)
    assert v["max_rate_meeting_slo"] == 2 and v["first_failing_rate"] == 4
    assert v["crossing_rate"] == pytest.approx(2 + 2 * (500 - 300) / (700 - 300))
    v = lg.sweep_verdict(rows, "goodput", None, None, 0.9)
    assert v["max_rate_meeting_slo"] == 2 and v["crossing_rate"] == pytest.approx(2 + 2 * (0.9 - 0.95) / (0.5 - 0.95))
    v = lg.sweep_verdict(rows, "itl", 0.05, 0.5, 0.9)  # TTFT SLO of 50 ms: nothing passes
    assert v["max_rate_meeting_slo"] is None and v["first_failing_rate"] == 1 and v["crossing_rate"] is None
    assert v["failing_below"] == []
    bumpy = [_fake_summary(1, 600), _fake_summary(2, 400), _fake_summary(4, 900)]
    v = lg.sweep_verdict(bumpy, "itl", None, 0.5, 0.9)
    assert (v["max_rate_meeting_slo"], v["first_failing_rate"], v["failing_below"]) == (2, 4, [1])
    assert v["crossing_rate"] == pytest.approx(2 + 2 * (500 - 400) / (900 - 400))
    all_pass = lg.sweep_verdict(rows, "itl", None, 1.0, 0.9)
    assert (all_pass["max_rate_meeting_slo"], all_pass["first_failing_rate"], all_pass["crossing_rate"]) == (8, None, None)



def test_the_sweep_crossing_is_where_the_first_slo_breaks_ttft_included():
    """With a TTFT SLO beside the ITL one, the next rate can fail on TTFT alone.  The crossing was interpolated on
    p99 ITL only, which both rates meet, so it was clamped to the failing rate itself (4 req/s) -- a rate the
    sweep had just measured as failing.  The oracle is the line through the two measured p99 TTFTs: 200 ms at
    2 req/s, 1,000 ms at 4, the 500 ms SLO crossed at 2.75 req/s.  With both SLOs broken, the earlier crossing."""
    rows = [_fake_summary(2, 300, p99_ttft_ms=200), _fake_summary(4, 400, p99_ttft_ms=1000)]
    v = lg.sweep_verdict(rows, "itl", 0.5, 0.5, 0.9)
    assert (v["max_rate_meeting_slo"], v["first_failing_rate"]) == (2, 4)
    assert v["crossing_rate"] == pytest.approx(2.75)
    rows[1]["overall"]["itl_ms"]["p99"] = 1300  # ITL crosses 500 ms at 2 + 2 * 200 / 1000 = 2.4 req/s, first
    assert lg.sweep_verdict(rows, "itl", 0.5, 0.5, 0.9)["crossing_rate"] == pytest.approx(2.4)


# -- the client against fake transports ----------------------------------------------------


def _sse_body(chunks: list[str], usage: int | None = None, done: bool = True) -> bytes:
    parts = [f"data: {json.dumps({'choices': [{'index': 0, 'text': c, 'finish_reason': None}]})}\n\n" for c in chunks]
    if usage is not None:
        parts.append(f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 5, 'completion_tokens': usage}})}\n\n")
    if done:
        parts.append("data: [DONE]\n\n")
    return "".join(parts).encode()


def _run(handler, plan, **kw):
    tenants = [lg.Tenant("a", "ka"), lg.Tenant("b", None)]
    return asyncio.run(lg.run_load("http://test", plan, tenants, "m", transport=httpx.MockTransport(handler),
                                   progress=False, **kw))


def _plan(n, rate=math.inf):
    return [lg.PlannedRequest(i, float(t), "ab"[i % 2], "x y z", 3, 4)
            for i, t in enumerate(lg.arrival_times(n, rate, 1.0, np.random.default_rng(0)))]


def test_client_ok_reject_error_and_keys():
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.headers.get("authorization"), body))
        i = int(body["prompt"].split()[-1])
        if i == 1:
            return httpx.Response(429, headers={"Retry-After": "3"}, json={"error": {"message": "busy"}})
        if i == 2:
            return httpx.Response(400, json={"error": {"message": "bad"}})
        if i == 3:
            return httpx.Response(200, content=b'data: {"error": {"message": "engine died"}}\n\n')
        if i == 4:
            return httpx.Response(200, content=_sse_body(["a", "b"], done=False))
        return httpx.Response(200, content=_sse_body(["", "He", "llo", " you"], usage=4))

    plan = [lg.PlannedRequest(i, 0.0, "ab"[i % 2], f"p {i}", 2, 4) for i in range(6)]
    run = _run(handler, plan)
    by = {r.index: r for r in run.results}
    assert [by[i].outcome for i in range(6)] == ["ok", "rejected", "error", "error", "error", "ok"]
    assert by[1].retry_after == 3.0 and by[1].status == 429 and by[2].status == 400
    ok = by[0]
    assert ok.chunks == 3 and len(ok.itl) == 2 and ok.ttft > 0 and ok.output_tokens == 4 and ok.prompt_tokens == 5
    assert ok.e2e >= ok.ttft + sum(ok.itl) - 1e-9
    assert sorted(h for h, _ in seen if h) == ["Bearer ka"] * 3  # tenant a's key; tenant b sends none
    body = seen[0][1]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    s = lg.summarize(run)
    assert (s["overall"]["ok"], s["overall"]["rejected"], s["overall"]["error"]) == (2, 1, 3)
    assert s["overall"]["retry_after_s_mean"] == 3.0


def test_client_chat_endpoint():
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/chat/completions"
        assert json.loads(request.content)["messages"][0]["role"] == "user"
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}] + [
            {"choices": [{"index": 0, "delta": {"content": c}}]} for c in ("A", "B")]
        return httpx.Response(200, content="".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n")

    run = _run(handler, _plan(2), endpoint="chat")
    assert all(r.outcome == "ok" and r.chunks == 2 and len(r.itl) == 1 and r.output_tokens == 2 for r in run.results)


def test_client_hard_timeouts_and_concurrency():
    """The fast requests (two rounds of two under the cap) must end before the overall --timeout; they take
    ~0.05 s of the 1.5 s, so a stall of the test process (a GC pause, a loaded CI box) cannot push them past it."""
    inflight, peak = [0], [0]

    async def slow(request: httpx.Request) -> httpx.Response:
        inflight[0] += 1
        peak[0] = max(peak[0], inflight[0])
        try:
            await asyncio.sleep(0.02 if b"fast" in request.content else 30)
        finally:
            inflight[0] -= 1
        return httpx.Response(200, content=_sse_body(["a"], usage=1))

    plan = [lg.PlannedRequest(i, 0.0, "a", "fast" if i < 4 else "slow", 1, 1) for i in range(8)]
    t = time.monotonic()
    run = _run(slow, plan, timeout=1.5, max_concurrency=2)
    assert time.monotonic() - t < 5
    assert peak[0] <= 2
    outs = [r.outcome for r in run.results]
    assert outs[:4] == ["ok"] * 4 and set(outs[4:]) == {"timeout"}
    t = time.monotonic()
    run = _run(slow, plan[4:6], timeout=30, request_timeout=0.5)
    assert time.monotonic() - t < 5 and all("request-timeout" in r.error for r in run.results)


def test_request_timeout_holds_without_asyncio_timeout(monkeypatch):
    """Python 3.10 has no ``asyncio.timeout`` (the package supports 3.10): the per-request deadline must not
    silently disappear there (before, the request waited for the overall --timeout instead)."""
    async def slow(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(30)
        return httpx.Response(200, content=_sse_body(["a"], usage=1))

    monkeypatch.delattr(asyncio, "timeout", raising=False)
    plan = [lg.PlannedRequest(i, 0.0, "a", "slow", 1, 1) for i in range(2)]
    t = time.monotonic()
    run = _run(slow, plan, timeout=20, request_timeout=0.5)
    assert time.monotonic() - t < 5 and all("request-timeout" in r.error for r in run.results), run.results


def test_open_loop_arrivals_are_kept():
    def handler(request):
        return httpx.Response(200, content=_sse_body(["a", "b"], usage=2))

    plan = _plan(6, rate=20.0)
    run = _run(handler, plan)
    assert all(r.outcome == "ok" for r in run.results)
    for r in run.results:  # each request left at (about) its scheduled time
        assert r.arrival - 1e-3 <= r.start <= r.arrival + 0.25


def test_cli_errors_exit_2(capsys):
    from minivllm.cli import main as cli_main

    assert lg.main(["--tenant", "key=x"]) == 2
    assert lg.main(["--rates", "1,0"]) == 2
    assert cli_main(["bench", "serve", "--input-len", "uniform:9:1"]) == 2
    assert "error" in capsys.readouterr().err


# -- end to end: the real server on 127.0.0.1 ----------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_end_to_end_against_own_server(tmp_path):
    uvicorn = pytest.importorskip("uvicorn")
    from minivllm import LLM
    from minivllm.cli import main as cli_main
    from minivllm.server import build_app

    llm = LLM(dtype="float32", max_model_len=512, num_gpu_blocks_override=128, enable_prefix_caching=True)
    app = build_app(llm.engine, ["smol"], {"key-alice": "alice", "key-bob": "bob"})
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="test-loadgen-uvicorn", daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < end and thread.is_alive(), "the server did not start"
            time.sleep(0.05)
        out, figs = tmp_path / "r.json", tmp_path / "figs"
        rc = cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-requests", "8",
                       "--request-rate", "8", "--output-len", "fixed:4", "--input-len", "uniform:8:24",
                       "--tenant", "name=alice,key=key-alice,share=1,prefix=sys:16",
                       "--tenant", "name=bob,key=key-bob,share=1",
                       "--slo-ttft-ms", "60000", "--slo-itl-ms", "60000", "--timeout", "120", "--request-timeout", "60",
                       "--out", str(out), "--figures", str(figs), "--no-progress"])
        assert rc == 0
        doc = json.loads(out.read_text())
        (run,) = doc["runs"]
        o = run["summary"]["overall"]
        assert (o["requests"], o["ok"], o["rejected"], o["error"], o["timeout"], o["unsent"]) == (8, 8, 0, 0, 0, 0)
        assert o["output_tokens"] == 32 and o["good"] == 8
        tenants = run["summary"]["tenants"]
        assert set(tenants) <= {"alice", "bob"} and sum(t["requests"] for t in tenants.values()) == 8
        assert doc["config"]["model"] == "smol"
        assert len(run["requests"]) == 8
        for r in run["requests"]:
            assert r["outcome"] == "ok" and r["status"] == 200
            assert r["output_tokens"] == 4 and r["prompt_tokens"] > 0
            assert r["ttft"] is not None and 0 < r["ttft"] <= r["e2e"]
            assert 1 <= r["chunks"] <= 4 and len(r["itl"]) == r["chunks"] - 1
            assert all(g >= 0 for g in r["itl"])
        assert {p.name for p in figs.iterdir()} == {"latency_cdf.png", "itl_over_time.png"}
        # a trace, through the chat endpoint
        trace = tmp_path / "trace.jsonl"
        trace.write_text("\n".join(json.dumps(e) for e in [
            {"timestamp": 0.0, "tenant": "bob", "prompt_len": 12, "max_tokens": 3},
            {"timestamp": 0.2, "tenant": "alice", "prompt": "Name a planet.", "max_tokens": 2},
            {"timestamp": 0.3, "tenant": "bob", "prompt_len": 5, "max_tokens": 3}]) + "\n")
        rc = cli_main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--trace", str(trace), "--endpoint", "chat",
                       "--tenant", "name=alice,key=key-alice", "--tenant", "name=bob,key=key-bob", "--timeout", "120",
                       "--out", str(out), "--no-progress"])
        assert rc == 0
        reqs = json.loads(out.read_text())["runs"][0]["requests"]
        assert [(r["tenant"], r["outcome"], r["output_tokens"]) for r in reqs] == [("bob", "ok", 3), ("alice", "ok", 2),
                                                                                  ("bob", "ok", 3)]
        assert [r["arrival"] for r in reqs] == pytest.approx([0.0, 0.2, 0.3])
        # the server saw two tenants: its per-tenant token counter moved for each one that sent requests
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        for name in tenants:
            assert f'tenant="{name}"' in text
    finally:
        server.should_exit = True
        thread.join(30)
        llm.close()
    assert not thread.is_alive(), "the server thread did not stop"


def test_a_trace_prompt_len_above_the_length_cap_is_refused_at_the_line():
    """The cap that refuses ``--tenant input=2000000`` holds for a trace's ``prompt_len`` too: a trace line asking
    for 10^12 tokens was accepted and the planner died in a MemoryError traceback writing its words out.  The
    oracle is :data:`MAX_LENGTH` itself: the cap passes, one token more is a ValueError naming the line."""
    ok = lg.parse_trace([json.dumps({"timestamp": 0, "prompt_len": lg.MAX_LENGTH})])
    assert ok[0].prompt_len == lg.MAX_LENGTH
    for n in (lg.MAX_LENGTH + 1, 10**12):
        with pytest.raises(ValueError, match="trace line 2: 'prompt_len'"):
            lg.parse_trace(["# header", json.dumps({"timestamp": 0, "prompt_len": n})])


def test_tenant_shares_whose_sum_overflows_still_split_the_arrivals_by_share():
    """Each share is a finite number > 0, so the spec is valid; two of 1e308 sum to inf, and the plan died in
    numpy's "Probabilities do not sum to 1", naming no tenant.  Equal shares, however large, are a 50/50 split:
    the plan must match the one with shares 1 and 1 (same seed, same draws)."""
    big = [lg.parse_tenant("name=a,share=1e308"), lg.parse_tenant("name=b,share=1e308")]
    unit = [lg.parse_tenant("name=a,share=1"), lg.parse_tenant("name=b,share=1")]
    assert [p.tenant for p in lg.plan_requests(big, 40, 5.0, seed=3)] == [p.tenant for p in lg.plan_requests(unit, 40, 5.0, seed=3)]


def test_a_near_regular_gamma_process_still_spaces_arrivals_one_over_the_rate_apart():
    """Burstiness is the gamma shape: the larger it is, the closer the gaps come to exactly 1/rate.  With shape
    1e308 the scale 1/(rate*shape) overflowed to 1/inf = 0 and every request arrived at t=0, the opposite of
    the smooth process asked for.  Oracle: the gaps' mean is 1/rate (and 1e300, which never overflowed, agrees)."""
    for shape in (1e300, 1e308):
        t = lg.arrival_times(6, 10.0, shape, np.random.default_rng(0))
        assert np.allclose(np.diff(t), 0.1, rtol=1e-6), (shape, t)


def test_a_tenant_named_overall_keeps_its_row_in_the_table():
    """format_table told the overall row from a tenant's by its name: a lone tenant called "overall" was taken
    for the overall row and skipped, so the table had a header and no rows at all.  Oracle: the row shows the
    tenant's request count (5) next to its name."""
    rs = [lg.RequestResult(i, "overall", 0.1 * i, 8, 4, outcome="ok", start=0.1 * i, ttft=0.05, itl=[0.01] * 3,
                           e2e=0.08, output_tokens=4) for i in range(5)]
    table = lg.format_table(lg.summarize(lg.RunResult(10.0, 1.0, rs)))
    rows = [line for line in table.splitlines() if line.startswith("overall ")]
    assert len(rows) == 1 and rows[0].split()[1] == "5", table
    two = rs + [lg.RequestResult(9, "b", 0.0, 8, 4, outcome="ok", start=0.0, ttft=0.05, e2e=0.08, output_tokens=4)]
    table = lg.format_table(lg.summarize(lg.RunResult(10.0, 1.0, two)))
    assert [line.split()[:2] for line in table.splitlines() if line.split()[:1] in (["b"], ["overall"])] == [
        ["b", "1"], ["overall", "5"], ["overall", "6"]], table  # both tenants, then the overall row last


@pytest.mark.parametrize("rate,burstiness", [(1.0, 1e-310), (0.1, 5e-324)])
def test_a_gap_scale_past_a_float_is_refused_not_turned_into_nan_arrivals(rate, burstiness):
    """``--burstiness`` takes any positive float, and a shape whose product with the rate underflows made the
    gap scale ``1 / (rate x burstiness)`` infinite (numpy then drew NaN gaps: every arrival after the first
    was NaN, which the client sends at once and the report prints as NaN waits) or divided by zero (a
    traceback, where ``bench serve`` turns a ValueError into its one-line usage error).  Oracle: the
    documented mean gap 1/rate is not a float here, so there is no schedule to draw."""
    with pytest.raises(ValueError, match="burstiness"):
        lg.arrival_times(4, rate, burstiness)
