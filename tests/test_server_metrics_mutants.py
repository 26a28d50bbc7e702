"""Tests from a hand mutation pass over the serving and metrics layers past the request boundary
(``minivllm/server/api_server.py``'s responses, ``minivllm/metrics``): each pins a behaviour a planted bug
changed while every existing test still passed.

No model is loaded: the real engine runs on the simulated executor, behind the real HTTP server where the
behaviour is an HTTP one.  Oracles are independent of the code under test: the SSE framing as the HTML
living standard defines it (events end at a blank line), the OpenAI API's documented chunk shapes, the
Prometheus text format read back by prometheus_client's own parser, vLLM's published bucket boundaries, and
the engine's block-accounting identity (free + used + evictable cached = the pool).
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.metrics.scrape import label_values, metric_samples, metric_value  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from tests.invariants import steps  # noqa: E402
from tests.test_server_sim import _Served, _WordTokenizer  # noqa: E402


def _engine(*, executor=None, prefix: bool = False, blocks: int = 64) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_model_len=64, max_num_seqs=8,
                       enable_prefix_caching=prefix, device="cpu")
    return LLMEngine(cfg, executor=executor or SimulatedExecutor(), tokenizer=_WordTokenizer(), model_max_len=64,
                     eos_token_ids=set())


def _sse_data(body: str) -> list[str]:
    """The data of each event of a ``text/event-stream`` body, by the SSE spec: an event ends at a blank line,
    its ``data:`` lines (one optional space after the colon) join with newlines.  Written here, not borrowed
    from the load generator, so a framing bug both share cannot hide."""
    events, data = [], []
    for line in body.replace("\r\n", "\n").split("\n"):
        if line == "":
            if data:
                events.append("\n".join(data))
            data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    assert not data, f"an event was never terminated by a blank line: {data!r}"
    return events


# -- streaming ---------------------------------------------------------------------------------------------------


def test_a_stream_without_include_usage_has_no_usage_chunk_and_ends_with_done():
    """OpenAI sends the extra usage chunk (empty ``choices``) only when ``stream_options.include_usage`` is set;
    a client that did not ask reads every chunk's ``choices[0]`` and would crash on an empty list.  The stream
    still ends with ``data: [DONE]``.  Kills: the usage chunk sent whatever the request asked."""
    engine = _engine()
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30,
                       json={"prompt": [11, 12, 13], "max_tokens": 4, "ignore_eos": True, "stream": True})
    assert r.status_code == 200, r.text
    events = _sse_data(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["choices"] for c in chunks), chunks
    assert all("usage" not in c for c in chunks), chunks
    assert sum(1 for c in chunks if c["choices"][0]["finish_reason"] == "length") == 1


def test_each_choice_of_an_n_stream_finishes_exactly_once():
    """With ``n > 1`` the samples need not finish in the same step (here sample 0, prefilled first, finishes one
    step early), and the engine's later group outputs still list a finished sample with its finish reason.  OpenAI
    sends one chunk with a non-null ``finish_reason`` per choice; a second one makes a client that counts finished
    choices close a choice twice.  Oracle: per-index counts over the SSE events, and 12 words per choice.
    Kills: the stream forgetting which choices it already finished."""
    engine = _engine()
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30,
                       json={"prompt": [11, 12, 13], "max_tokens": 12, "n": 4, "temperature": 1.0, "seed": 1,
                             "stream": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(e) for e in _sse_data(r.text)[:-1]]
    finishes = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1, 2, 3]
    for i in range(4):
        assert len("".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i).split()) == 12


def test_streamed_completion_chunks_are_text_completion_objects():
    """OpenAI's legacy completions stream sends ``"object": "text_completion"`` in every chunk (only chat
    chunks are ``chat.completion.chunk``); clients that dispatch on ``object`` rely on it.
    Kills: the completions stream labelled as a chunk type that API does not have."""
    engine = _engine()
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30,
                       json={"prompt": [11, 12, 13], "max_tokens": 3, "stream": True})
    chunks = [json.loads(e) for e in _sse_data(r.text)[:-1]]
    assert chunks and {c["object"] for c in chunks} == {"text_completion"}


def test_a_stream_cut_by_shutdown_ends_with_an_error_event_then_done():
    """A stopping server aborts an open stream; the client must learn the answer is cut short (an error event)
    *and* that the stream is over (``data: [DONE]``), as the module documents: the ``openai`` client and the
    load generator stop reading at ``[DONE]``, and one that reads to EOF cannot tell a cut from a network drop.
    Oracle: the SSE events of the body.  Kills: the ``[DONE]`` after the shutdown error event dropped."""
    import threading

    from tests.test_server_sim import _paced_engine

    engine = _paced_engine(wall_factor=50.0)  # a 400-token reply takes minutes of wall time
    got: dict = {}
    with _Served(engine) as srv:
        def call() -> None:
            r = httpx.post(srv.base + "/v1/completions", timeout=60,
                           json={"prompt": list(range(10, 30)), "max_tokens": 400, "stream": True})
            got["status"], got["body"] = r.status_code, r.text

        t = threading.Thread(target=call)
        t.start()
        for _ in range(3000):  # until the stream has begun: its first token exists
            if any(r.output_token_ids for r in list(engine.scheduler.running)):
                break
            threading.Event().wait(0.01)
        assert any(r.output_token_ids for r in list(engine.scheduler.running)), "the stream never began"
        srv.bg.stop(20)
        t.join(30)
    assert got["status"] == 200
    events = _sse_data(got["body"])
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == 503


def test_a_stream_is_marked_uncacheable_event_stream():
    """A stream is ``text/event-stream`` with ``Cache-Control: no-cache``, as OpenAI's and vLLM's are: a caching
    proxy or CDN in front of the server would otherwise hold the chunks back (or serve one client's stream to
    another).  nginx, the usual proxy, buffers a proxied response unless it says ``X-Accel-Buffering: no`` (nginx's
    ``proxy_buffering`` documentation), which would hold a stream's chunks until the end.
    Kills: the ``Cache-Control`` or the ``X-Accel-Buffering`` header dropped from the SSE response."""
    with _Served(_engine()) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30,
                       json={"prompt": [11, 12, 13], "max_tokens": 2, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].split(";")[0].strip() == "text/event-stream"
    assert "no-cache" in r.headers.get("cache-control", "").lower()
    assert r.headers.get("x-accel-buffering", "").lower() == "no"


class _FailingExecutor(SimulatedExecutor):
    """Sampling fails for every request (as a NaN row would): the engine finishes each with ``error``."""

    def execute(self, batch):
        out = super().execute(batch)
        for rid in list(out):
            del out[rid]
            batch.errors[rid] = "sampling failed: probability tensor contains nan"
        return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_failed_is_a_500_not_a_200_with_finish_reason_error(stream):
    """``error`` is no finish reason the OpenAI API has: a client reading a 200 would take the empty text as the
    model's answer.  The server answers the engine's failure as what it is, a 500 with an ``internal_error``
    body (streamed or not: a stream answers only once its first output exists).
    Kills: the engine-error check in ``_first_or_final`` dropped."""
    engine = _engine(executor=_FailingExecutor())
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30,
                       json={"prompt": [11, 12, 13], "max_tokens": 3, "stream": stream})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "internal_error"
    assert engine.stats()["num_errors"] == 1 and engine.stats()["used_blocks"] == 0


# -- /metrics ----------------------------------------------------------------------------------------------------


def test_metrics_are_served_as_the_prometheus_text_format():
    """Prometheus picks its parser from the Content-Type: the text format is ``text/plain`` with a ``version``
    parameter (0.0.4, or 1.0.0 from newer prometheus_client); a bare ``text/plain`` leaves the scraper to guess.
    The body must parse with prometheus_client's own parser.  Kills: the media type dropped to ``text/plain``."""
    engine = _engine()
    with _Served(engine) as srv:
        r = httpx.get(srv.base + "/metrics", timeout=30)
    assert r.status_code == 200
    ctype = r.headers["content-type"].replace(" ", "").lower()
    assert ctype.startswith("text/plain;") and "version=" in ctype, ctype
    assert metric_value(metric_samples(r.text), "vllm:kv_cache_num_blocks") == 64


# vLLM's buckets, copied from vllm/v1/metrics/loggers.py (v0.8-v0.10) -- the contract a dashboard built for vLLM
# relies on (a heatmap's rows, a histogram_quantile's resolution), written out here rather than imported.
_VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:request_queue_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
}


def test_histograms_have_vllms_bucket_boundaries():
    """The module promises vLLM's names *and buckets*, so PromQL and dashboards written for vLLM work unchanged.
    Read back from a served request's page (the ``le`` labels prometheus_client's parser reports), not from the
    module's constants.  Kills: one bucket edge moved (TTFT's 0.25 s as 0.2 s)."""
    from minivllm.metrics.prometheus import EngineMetrics, observe_all

    engine = _engine()
    metrics = EngineMetrics("sim")
    engine.add_request({"prompt_token_ids": [11, 12, 13]}, SamplingParams(max_tokens=3, ignore_eos=True), "r")
    for outs in steps(engine):
        observe_all(metrics, engine, outs)
    s = metric_samples(metrics.render().decode())
    for name, edges in _VLLM_BUCKETS.items():
        les = {float(le) for le in label_values(s, name + "_bucket", "le")}
        assert les == {float(e) for e in edges} | {float("inf")}, name


def test_kv_cache_usage_is_a_fraction_of_the_pool_while_a_request_holds_blocks():
    """``vllm:kv_cache_usage_perc`` is 0..1 in vLLM ("1 means 100 percent"), despite its name: alert rules
    compare it with 0.9.  Checked mid-request, when it is not 0, against the page's own block gauges.
    Kills: the gauge exported as a percentage (x100)."""
    from minivllm.metrics.prometheus import EngineMetrics, observe_all

    engine = _engine(blocks=16)
    metrics = EngineMetrics("sim")
    engine.add_request({"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=8, ignore_eos=True), "r")
    observe_all(metrics, engine, engine.step())
    s = metric_samples(metrics.render().decode())
    used, total = metric_value(s, "vllm:kv_cache_used_blocks"), metric_value(s, "vllm:kv_cache_num_blocks")
    assert used > 0 and total == 16
    assert metric_value(s, "vllm:kv_cache_usage_perc") == pytest.approx(used / total)


def test_free_blocks_gauge_is_the_free_list_not_what_eviction_could_free():
    """``vllm:kv_cache_free_blocks`` is the free list; blocks held only by the prefix cache are in
    ``vllm:kv_cache_cached_blocks``.  With a warm cache and nothing running the pool splits into exactly those
    two, so they add up to the pool -- the accounting identity a capacity dashboard stacks.
    Kills: the free gauge set from ``available_blocks`` (free + evictable), counting cached blocks twice."""
    from minivllm.metrics.prometheus import EngineMetrics, observe_all

    engine = _engine(prefix=True, blocks=32)
    metrics = EngineMetrics("sim")
    engine.add_request({"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=4, ignore_eos=True), "r")
    for outs in steps(engine):
        observe_all(metrics, engine, outs)
    s = metric_samples(metrics.render().decode())
    cached, free = metric_value(s, "vllm:kv_cache_cached_blocks"), metric_value(s, "vllm:kv_cache_free_blocks")
    assert cached > 0 and metric_value(s, "vllm:kv_cache_used_blocks") == 0
    assert free + cached == metric_value(s, "vllm:kv_cache_num_blocks") == 32


def test_label_values_are_sorted():
    """``label_values`` is documented as sorted (labs print the tenants of a page in a stable order, and a set's
    order changes with the hash seed).  Kills: the set returned as a list in whatever order it iterates."""
    tenants = [f"t{i:02d}" for i in range(12)]
    page = "# TYPE x counter\n" + "".join(f'x_total{{tenant="{t}"}} 1\n' for t in reversed(tenants))
    s = metric_samples(page)
    assert label_values(s, "x_total", "tenant") == tenants


# -- the door ----------------------------------------------------------------------------------------------------


def test_the_door_stays_open_with_exactly_min_free_blocks_available():
    """The rule sheds when requests wait *and* fewer than ``min_free_blocks`` are available: exactly that many
    is enough (``--min-free-blocks 10`` means "keep 10 free", not "keep 11").  The brute-force check in
    ``test_server_sim`` steps its free counts by 3 and never lands on the edge.
    Kills: ``available < min_free_blocks`` written as ``<=``."""
    from minivllm.server.door import DoorRule

    rule = DoorRule(max_waiting=5, min_free_blocks=10)
    assert rule.closed({"num_waiting": 1, "available_blocks": 10}) is False
    assert rule.closed({"num_waiting": 1, "available_blocks": 9}) is True


# -- labels the server does not pass explicitly --------------------------------------------------------------------


def test_a_preempted_sample_of_an_n_request_is_charged_to_its_tenant_as_the_server_observes_it():
    """The server's loop calls ``observe_step(engine)`` with no ``tenant_of``: a preempted request is labelled by
    the tenant it was tracked with.  The engine preempts an ``n > 1`` request's *samples* (ids ``parent#i``), and
    only the parent was tracked, so the label must come from the parent, or every such preemption is billed to
    ``unknown``.  Oracle: the tenants the requests were added with, and the engine's own preemption count.
    Kills: ``tenant_of`` not resolving a sample id to its parent."""
    from minivllm.metrics.prometheus import EngineMetrics
    from tests.test_server_sim import _sim_engine

    engine = _sim_engine("recompute")
    metrics = EngineMetrics("sim")
    for i in range(3):
        rid = engine.add_request({"prompt_token_ids": list(range(10, 22))},
                                 SamplingParams(max_tokens=20, n=2, temperature=1.0, seed=i, ignore_eos=True),
                                 tenant=f"t{i % 2}")
        metrics.track(rid, f"t{i % 2}")
    for outs in steps(engine):
        metrics.observe_step(engine)
        for out in outs:
            metrics.observe_output(out)
    s = metric_samples(metrics.render().decode())
    assert engine.stats()["num_preemptions"] > 0
    assert metric_value(s, "vllm:num_preemptions_total", tenant="unknown") == 0
    assert metric_value(s, "vllm:num_preemptions_total", tenant="t0") \
        + metric_value(s, "vllm:num_preemptions_total", tenant="t1") == engine.stats()["num_preemptions"]


def test_a_background_servers_aliases_are_served_model_names():
    """``BackgroundServer(aliases=...)`` serves the engine under more names (lab 8's fleet answers to one model
    name per replica and a shared one): the ``openai`` client must list each and get an answer naming it.
    Kills: the aliases dropped on the way to ``build_app`` (a 404 for every alias)."""
    openai = pytest.importorskip("openai")
    from minivllm.server import BackgroundServer

    with BackgroundServer(_engine(), "sim", aliases=("shared",), start_timeout_s=20) as bg:
        client = openai.OpenAI(base_url=bg.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        assert {m.id for m in client.models.list()} == {"sim", "shared"}
        got = client.completions.create(model="shared", prompt=[11, 12, 13], max_tokens=2)
    assert got.model == "shared" and got.usage.completion_tokens == 2
    assert not bg.running


def test_prefix_cache_hits_count_the_tokens_the_outputs_say_were_cached():
    """``vllm:prefix_cache_hits`` over ``vllm:prefix_cache_queries`` is the hit rate a dashboard plots, so hits must
    be the tokens actually read from the cache: the sum of the outputs' ``num_cached_tokens`` (what the server
    bills as ``cached_tokens``), and fewer than the tokens looked up when the first request found nothing.
    Kills: the hits counter fed from the queries counter (a 100 % hit rate for ever)."""
    from minivllm.metrics.prometheus import EngineMetrics, observe_all

    engine = _engine(prefix=True, blocks=32)
    metrics = EngineMetrics("sim")
    cached = 0
    for rid in ("cold", "warm"):
        engine.add_request({"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=2, ignore_eos=True), rid)
        for outs in steps(engine):
            observe_all(metrics, engine, outs)
            cached += sum(int(o.num_cached_tokens or 0) for o in outs if o.finished)
    s = metric_samples(metrics.render().decode())
    assert cached > 0
    assert metric_value(s, "vllm:prefix_cache_hits_total") == cached < metric_value(s, "vllm:prefix_cache_queries_total")


def test_an_aborted_request_is_counted_under_its_own_tenant():
    """A client that leaves has its request aborted and counted as ``request_success{finished_reason="abort"}``
    -- under the tenant it was tracked with, so a per-tenant abort-rate alert fires for the tenant whose clients
    give up.  The server calls exactly ``track`` then ``observe_abort``; the oracle is the tenant passed to
    ``track``.  Kills: aborts labelled with a fixed tenant."""
    from minivllm.metrics.prometheus import EngineMetrics

    metrics = EngineMetrics("sim")
    metrics.track("r1", "alice")
    metrics.observe_abort("r1")
    metrics.observe_abort("r1")  # a second abort of the same request counts nothing
    s = metric_samples(metrics.render().decode())
    assert metric_value(s, "vllm:request_success_total", finished_reason="abort", tenant="alice") == 1
    assert metric_value(s, "vllm:request_success_total") == 1


def test_a_chat_answer_cut_by_max_tokens_says_length(tokenizer):
    """A chat answer cut at ``max_tokens`` has ``finish_reason == "length"``: clients (and agents that ask the
    model to go on) read it to tell a truncated answer from a finished one.  Read through the official ``openai``
    client; the engine's own final output is the oracle (EOS ignored, so 3 tokens can only end by length).
    Kills: the non-streamed chat answer reporting ``stop`` whatever the engine said."""
    openai = pytest.importorskip("openai")
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=256, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
                       model_max_len=256)
    with _Served(engine) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=30)
        got = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                             extra_body={"ignore_eos": True})
    assert got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 3


def test_a_step_that_both_swaps_and_recomputes_labels_each_victim_with_its_own_mode():
    """In ``preemption_mode="auto"`` one step can swap a long victim out and recompute a short one.  The engine's
    counters say only how many of each; ``vllm:num_preemptions_total{mode, tenant}`` must still put each victim
    under the mode it got, or the lab 5 dashboard of "who pays for recompute" blames the wrong tenant.
    Oracle: each victim's status right after its step (``swapped`` or ``preempted``), one tenant per request.
    Kills: the per-request choice inverted in a mixed step (a mixed-free run counts right either way)."""
    from collections import Counter

    from minivllm.metrics.prometheus import EngineMetrics
    from minivllm.request import RequestStatus
    from minivllm.sched.fairness import LongContextSwap

    cfg = EngineConfig(num_gpu_blocks_override=20, num_cpu_blocks_override=64, block_size=4, max_num_batched_tokens=64,
                       max_num_seqs=6, max_model_len=64, preemption_mode="auto", device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64, eos_token_ids=set(),
                       preemption_cost_model=LongContextSwap(12))  # swap a victim with 12 computed tokens or more
    metrics = EngineMetrics("sim")
    for i in range(8):
        rid = engine.add_request({"prompt_token_ids": [10 + i] * (24 if i % 2 else 4)},
                                 SamplingParams(max_tokens=24, ignore_eos=True), request_id=f"r{i}", tenant=f"t{i}")
        metrics.track(rid, f"t{i}")
    expected: Counter = Counter()
    mixed = 0
    for _ in steps(engine):
        metrics.observe_step(engine)
        modes = {rid: "swap" if engine.requests[rid].status is RequestStatus.SWAPPED else "recompute"
                 for rid in engine.step_log[-1].preempted}
        mixed += len(set(modes.values())) == 2
        expected.update((mode, "t" + rid[1:]) for rid, mode in modes.items())
    assert mixed > 0, "the workload must have a step that preempts in both modes"
    s = metric_samples(metrics.render().decode())
    got = Counter({(m, t): metric_value(s, "vllm:num_preemptions_total", mode=m, tenant=t)
                   for m in ("swap", "recompute") for t in [f"t{i}" for i in range(8)] + ["unknown"]})
    assert +got == expected


class _SampleOneStops(SimulatedExecutor):
    """Sample ``#1`` of an ``n > 1`` request draws the end-of-sequence token (id 0) on its third token; every
    other row draws what the simulator draws.  A known per-choice ending for the test below."""

    def execute(self, batch):
        out = super().execute(batch)
        for s in batch.seqs:
            rid = s.request.request_id
            if rid in out and rid.endswith("#1") and len(s.request.output_token_ids) == 2:
                out[rid] = 0
        return out


def test_each_choice_of_a_completion_reports_its_own_finish_reason():
    """With ``n > 1`` the choices end independently: one may stop at EOS while the others run to ``max_tokens``.
    A client that retries truncated answers reads each choice's ``finish_reason``.  Oracle: the executor above
    (choice 1 draws EOS as its third token), read through the official ``openai`` client.
    Kills: every choice reporting the group's first finish reason."""
    openai = pytest.importorskip("openai")
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=64, max_num_seqs=8, device="cpu")
    engine = LLMEngine(cfg, executor=_SampleOneStops(), tokenizer=_WordTokenizer(), model_max_len=64,
                       eos_token_ids={0})
    with _Served(engine) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=30)
        got = client.completions.create(model="sim", prompt=[11, 12, 13], max_tokens=6, n=3, temperature=1.0, seed=1)
    reasons = {c.index: c.finish_reason for c in got.choices}
    assert reasons == {0: "length", 1: "stop", 2: "length"}
    assert len(got.choices[1].text.split()) == 2 and got.usage.completion_tokens == 6 + 3 + 6


def test_a_request_the_dead_engine_loop_failed_is_counted_as_an_error_not_an_abort():
    """When the engine loop dies (a bug inside ``step()``), every request in flight ends with ``EngineDead``
    (a 503 to its client): the engine failed it, nobody gave up on it.  ``request_success`` counts every
    ending by its reason, so an alert on ``finished_reason="error"`` must see these.  Oracle: the exception the
    client itself received.  Before: ``AsyncEngine`` reported them through ``observe_abort``, labelled
    ``"abort"``, so a dead engine looked like impatient clients."""
    import asyncio

    from minivllm.metrics.prometheus import EngineMetrics
    from minivllm.server.async_engine import AsyncEngine, EngineDead

    calls = []

    def builder(running, budget, threshold):
        calls.append(len(running))
        if len(calls) > 2:
            raise RuntimeError("a bug in the batch builder")
        return [(r, min(r.num_tokens - r.num_computed_tokens, 4)) for r in running]

    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=64, max_num_seqs=8, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64, eos_token_ids=set(), batch_builder=builder)
    metrics = EngineMetrics("sim")
    async_engine = AsyncEngine(engine, metrics)

    async def run() -> BaseException | None:
        async_engine.start()
        stream = await async_engine.add_request({"prompt_token_ids": [3] * 30},
                                                SamplingParams(max_tokens=8, ignore_eos=True), "a", tenant="alice")
        try:
            while not (await stream.get()).finished:
                pass
        except EngineDead as exc:
            return exc
        return None

    try:
        got = asyncio.run(run())
    finally:
        async_engine.shutdown()
    assert isinstance(got, EngineDead)
    s = metric_samples(metrics.render().decode())
    assert metric_value(s, "vllm:request_success_total", finished_reason="error", tenant="alice") == 1
    assert metric_value(s, "vllm:request_success_total", finished_reason="abort") == 0


def test_gauges_read_zero_once_the_last_request_is_aborted_and_the_loop_idles():
    """A client that leaves aborts its request between two steps; when it was the last one, no step follows, so
    no step's sync zeroes the gauges -- only the loop's sync while idle does.  A ``/metrics`` scrape syncs on its
    own, so Prometheus never sees the stale values; but ``BackgroundServer.metrics`` is public "for inspection"
    (a lab cell, or an exporter serving the same registry, reads it between scrapes) and it would keep reporting
    a running request and its KV blocks until the next request came.  Oracle: the engine's ``stats()`` (nothing
    held), and both the direct page and the scraped page read back by prometheus_client's own parser.
    Kills: the idle sync in ``AsyncEngine._run`` deleted (the direct page then kept running 1 and the
    aborted request's blocks)."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from minivllm.server import BackgroundServer
    from tests.test_server_sim import _PacedExecutor

    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:kv_cache_used_blocks")

    def read(text: str) -> dict:
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name in gauges}

    # each step sleeps 100 ms of wall time: the 60-token request runs for 6 s, time enough, on a loaded machine
    # too, for the client to see it running and leave while it still runs
    engine = _engine(executor=_PacedExecutor(wall_factor=10.0, fixed_overhead_s=0.01, per_token_s=0.0,
                                             per_context_token_s=0.0))
    with BackgroundServer(engine, "sim", start_timeout_s=20) as bg:
        body = {"prompt": [11, 12, 13], "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", bg.base_url + "/v1/completions", json=body, timeout=30) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))  # its first token: it runs
            # the loop syncs the gauges after it has handed the step's tokens out, so the client can hold its
            # first token before the step's sync (seen on a loaded machine): wait for it, the request runs 6 s
            until = time.monotonic() + 3
            while (mid := read(bg.metrics.render().decode()))["vllm:num_requests_running"] != 1 \
                    and time.monotonic() < until:
                time.sleep(0.02)
        assert mid["vllm:num_requests_running"] == 1 and mid["vllm:kv_cache_used_blocks"] > 0, mid
        assert bg.async_engine.wait_idle(10)
        stats = engine.stats()
        assert stats["num_running"] == stats["num_waiting"] == stats["used_blocks"] == 0
        assert bg.async_engine.aborted_ids, "the client's leaving did not abort its request"
        want = dict.fromkeys(gauges, 0.0)
        deadline = time.monotonic() + 5  # a hang guard: the idle loop syncs every idle_poll_s (0.25 s)
        while (direct := read(bg.metrics.render().decode())) != want and time.monotonic() < deadline:
            time.sleep(0.02)
        assert direct == want, f"gauges read directly after the loop went idle: {direct}"
        assert read(httpx.get(bg.base_url + "/metrics", timeout=30).text) == want
