"""The OpenAI-compatible server: the real server on 127.0.0.1 with the bundled model, the official client.

Two servers per module (one model load each): a main one with two API keys
(two tenants) and prefix caching, and a tiny reject-mode one for overload.
Every network call has a timeout, and the server threads are joined with one.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.slow

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from minivllm.metrics.scrape import metric_samples, metric_value  # noqa: E402

from conftest import LONG_TEXT  # noqa: E402  (rootdir conftest, on sys.path under pytest)

KEYS = {"key-alice": "alice", "key-bob": "bob"}
MODEL = "smol"
TIMEOUT = 60.0


class _Running:
    def __init__(self, llm, app, server, thread, port) -> None:
        self.llm, self.app, self.server, self.thread = llm, app, server, thread
        self.base = f"http://127.0.0.1:{port}"
        self.async_engine = app.state.async_engine

    def client(self, key: str = "key-alice") -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, timeout=TIMEOUT, max_retries=0)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server thread did not stop"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(api_keys=None, **llm_options) -> _Running:
    from minivllm import LLM
    from minivllm.server import build_app

    llm = LLM(dtype="float32", **llm_options)
    app = build_app(llm.engine, [MODEL], api_keys)
    port = _free_port()
    # not the main thread: uvicorn installs no signal handlers here
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    end = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < end and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    return _Running(llm, app, server, thread, port)


@pytest.fixture(scope="module")
def srv():
    running = _serve(KEYS, max_model_len=512, num_gpu_blocks_override=256, enable_prefix_caching=True, max_num_seqs=64)
    yield running
    running.stop()
    running.llm.close()


def _auth(key="key-alice") -> dict:
    return {"Authorization": f"Bearer {key}"}


def _scrape(base: str) -> dict:
    """{(sample name, frozenset(labels)): value} from GET /metrics, parsed by prometheus_client."""
    return metric_samples(httpx.get(base + "/metrics", timeout=TIMEOUT).text)


_value = metric_value


# -- basics --------------------------------------------------------------------------------


def test_health_models_and_auth(srv):
    assert httpx.get(srv.base + "/health", timeout=TIMEOUT).json() == {"status": "ok"}
    assert [m.id for m in srv.client().models.list()] == [MODEL]
    for headers in ({}, _auth("nope"), {"Authorization": "key-alice"}):
        r = httpx.get(srv.base + "/v1/models", headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.AuthenticationError):
        srv.client("wrong").chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_greedy_stream_equals_non_stream(srv):
    client = srv.client()
    messages = [{"role": "user", "content": "Name three planets."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=20)
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens == 20 or full.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    deltas, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            deltas.append(c.delta.content or "")
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert "".join(deltas) == text
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens

    # completions: the same with a plain prompt
    comp = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8)
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=8, stream=True) if c.choices]
    assert "".join(pieces) == comp.choices[0].text
    assert comp.usage.completion_tokens == 8 or comp.choices[0].finish_reason == "stop"


def test_stop_string_is_cut_unless_the_vllm_extra_asks_to_keep_it(srv):
    """OpenAI's rule: the matched stop sequence is not part of the text; vLLM's extra field
    ``include_stop_str_in_output`` keeps it.  Oracle: the greedy text without any stop, cut by ``str.find``."""
    client, prompt = srv.client(), "The capital of France is"
    base = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12).choices[0].text
    word = base.split()[1]
    for keep in (False, True):
        got = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=[word],
                                        extra_body={"include_stop_str_in_output": keep}).choices[0]
        assert got.finish_reason == "stop"
        assert got.text == base[: base.find(word) + (len(word) if keep else 0)]
    bad = httpx.post(srv.base + "/v1/completions", headers=_auth(), timeout=TIMEOUT,
                     json={"model": MODEL, "prompt": prompt, "include_stop_str_in_output": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "include_stop_str_in_output"


def test_requests_vllm_refuses_are_refused_with_the_field_named(srv):
    """What vLLM's OpenAI server answers with a 400, this one does too, naming the field: a prompt plus an
    explicit ``max_tokens`` past the context (the engine would quietly clamp it), sampling features minivllm
    does not implement (silently ignoring them would change the text unwarned), ``logprobs: 0``, and
    ``stream_options`` without ``stream``.  Oracle: the field each request set; a control request with the
    same features at their no-op values is served."""
    tok = srv.llm.get_tokenizer()
    n = len(tok.encode("hello " * 500))

    def post(path, **body):
        return httpx.post(srv.base + path, headers=_auth(), timeout=TIMEOUT, json={"model": MODEL, **body})

    chat = [{"role": "user", "content": "hi"}]
    cases = [("/v1/completions", {"prompt": "hello " * 500, "max_tokens": 20}, "max_tokens"),
             ("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 600}, "max_completion_tokens"),
             ("/v1/chat/completions", {"messages": chat, "max_completion_tokens": 0}, "max_completion_tokens"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 600}]}, "messages"),
             ("/v1/completions", {"prompt": "hi", "repetition_penalty": 1.3}, "repetition_penalty"),
             ("/v1/completions", {"prompt": "hi", "min_tokens": 4}, "min_tokens"),
             ("/v1/completions", {"prompt": "hi", "guided_choice": ["a", "b"]}, "guided_choice"),
             ("/v1/completions", {"prompt": "hi", "logprobs": 0}, "logprobs"),
             ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
             ("/v1/chat/completions", {"messages": chat, "echo": True}, "echo")]
    for path, body, field in cases:
        r = post(path, **body)
        assert r.status_code == 400, (field, r.status_code, r.text)
        assert r.json()["error"]["param"] == field, (field, r.json())
    too_long = post("/v1/completions", prompt="hello " * 500, max_tokens=20).json()["error"]["message"]
    assert f"maximum context length is 512 tokens and your request has {n} input tokens" in too_long
    ok = post("/v1/completions", prompt="hi", max_tokens=2, repetition_penalty=1.0, min_tokens=0, logprobs=None)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    fits = post("/v1/completions", prompt="hello " * 500, max_tokens=512 - n)
    assert fits.status_code == 200


def test_model_retrieve_and_text_parts_as_lines(srv):
    """``models.retrieve`` (the official client's ``GET /v1/models/{id}``) returns the card or a 404; a chat
    message sent as several text parts reads as those parts on separate lines, as vLLM joins them.  Oracle: the
    same message sent as one string with the newline, greedy."""
    client = srv.client()
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "Answer in one word."}]
    as_parts = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                              messages=[{"role": "user", "content": parts}])
    as_text = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6, messages=[
        {"role": "user", "content": "Name a colour.\nAnswer in one word."}])
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


def test_metrics_parse_and_move(srv):
    before = _scrape(srv.base)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:kv_cache_used_blocks", "vllm:kv_cache_free_blocks", "vllm:kv_cache_cached_blocks",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_recomputed_tokens_total"):
        assert any(n == name for n, _ in before), name
    srv.client("key-bob").completions.create(model=MODEL, prompt="One, two, three,", temperature=0, max_tokens=6)
    after = _scrape(srv.base)
    bob = {"tenant": "bob", "model_name": MODEL}
    assert _value(after, "vllm:generation_tokens_total", **bob) >= _value(before, "vllm:generation_tokens_total", **bob) + 6
    assert _value(after, "vllm:prompt_tokens_total", **bob) > _value(before, "vllm:prompt_tokens_total", **bob)
    for h in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count"):
        assert _value(after, h, **bob) > _value(before, h, **bob), h
    for h in ("vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count", "vllm:iteration_tokens_total_count"):
        assert _value(after, h) > _value(before, h), h
    assert _value(after, "vllm:request_success_total", tenant="bob", finished_reason="length") >= 1
    assert _value(after, "vllm:prefix_cache_queries_total") > _value(before, "vllm:prefix_cache_queries_total")
    assert _value(after, "vllm:num_requests_running") == 0
    # the TTFT histogram has vLLM's buckets
    les = {dict(ls)["le"] for n, ls in after if n == "vllm:time_to_first_token_seconds_bucket"}
    assert {"0.001", "0.04", "2560.0", "+Inf"} <= les


def test_cross_tenant_prompt_gets_no_cached_tokens(srv):
    prompt = LONG_TEXT[:900]
    alice, bob = srv.client("key-alice"), srv.client("key-bob")
    first = alice.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
    again = alice.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
    other = bob.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2)
    assert first.usage.prompt_tokens > 64
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # the same tenant hits its own cache
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another tenant does not
    # a client-chosen cache_salt only splits the caller's own space: no hit on alice's blocks either
    salted = bob.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=2, extra_body={"cache_salt": "x"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


# -- many clients, disconnects and bad requests --------------------------------------------------


def _bad_requests(long_ids: list[int]) -> list[tuple[str, dict, bytes | str, int]]:
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    msg = [{"role": "user", "content": "hi"}]
    return [
        (chat, _auth(), b'{"messages": [', 400),  # malformed JSON
        (comp, _auth(), b"[1, 2]", 400),  # JSON but not an object
        (chat, _auth(), json.dumps({"model": "gpt-4", "messages": msg}), 404),
        (chat, _auth(), json.dumps({"model": MODEL, "messages": msg, "max_tokens": -5}), 400),
        (comp, _auth(), json.dumps({"model": MODEL, "prompt": long_ids, "max_tokens": 4}), 400),  # oversize
        (chat, _auth(), json.dumps({"model": MODEL, "messages": msg, "max_tokens": "ten"}), 400),
        (chat, _auth(), json.dumps({"model": MODEL, "messages": "hi"}), 400),
        (chat, _auth(), json.dumps({"model": MODEL, "messages": msg, "temperature": "hot"}), 400),
        (chat, _auth(), json.dumps({"model": MODEL, "messages": msg, "top_p": 7}), 400),
        (chat, _auth(), json.dumps({"model": MODEL, "messages": msg, "n": 0}), 400),
        (comp, _auth(), json.dumps({"model": MODEL, "prompt": [10**9]}), 400),  # token id outside the vocabulary
        (comp, _auth(), json.dumps({"model": MODEL}), 400),  # no prompt
        (chat, _auth(), json.dumps({"model": MODEL, "messages": []}), 400),
        # fields the server cannot honour are refused, never silently dropped
        (chat, _auth(), json.dumps({"model": MODEL, "messages": msg, "functions": [{"name": "f"}]}), 400),
        (chat, _auth(), json.dumps({"model": MODEL, "messages": msg, "tool_choice": "required"}), 400),
        (comp, _auth(), json.dumps({"model": MODEL, "prompt": "hi", "stream": True,
                                    "stream_options": {"continuous_usage_stats": True}}), 400),
        (comp, _auth(), json.dumps({"model": MODEL, "prompt": "\ud800 lone"}), 400),  # tokenized off the loop
        (comp, _auth(), json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 1}), 400),
        (comp, _auth(), json.dumps({"model": MODEL, "prompt": ["one", "two"]}), 400),  # batched prompts
        (chat, _auth(), json.dumps({"model": MODEL, "max_tokens": "7", "messages": msg}), 400),  # a count, strictly
        (chat, _auth(), json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400),  # not a vision model
        (comp, _auth(), json.dumps({"model": MODEL, "prompt": [49152]}), 400),  # one past SmolLM2's last id
        (chat, {}, json.dumps({"model": MODEL, "messages": msg}), 401),  # missing key
        (chat, _auth("stolen"), json.dumps({"model": MODEL, "messages": msg}), 401),
    ]


def test_concurrent_streams_disconnects_and_bad_requests(srv):
    n_clients, n_leave = 24, 6
    long_ids = [100] * 600  # longer than max_model_len=512
    statuses: list[int] = []
    left_ids: list[str] = []
    texts: list[str] = []

    async def stream_client(client: "httpx.AsyncClient", i: int) -> None:
        leave = i % (n_clients // n_leave) == 0
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} upwards."}],
                "stream": True, "temperature": 0, "max_tokens": 200 if leave else 6, "ignore_eos": leave}
        async with client.stream("POST", srv.base + "/v1/chat/completions", json=body, headers=_auth()) as r:
            statuses.append(r.status_code)
            got, n_chunks = [], 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                n_chunks += 1
                got.extend(c["delta"].get("content") or "" for c in chunk["choices"])
                if leave and n_chunks >= 3:
                    left_ids.append(chunk["id"])
                    return  # leaving the context closes the connection mid-stream
            texts.append("".join(got))

    async def bad_client(client: "httpx.AsyncClient", path, headers, content, expected) -> None:
        r = await client.post(srv.base + path, content=content, headers={**headers, "Content-Type": "application/json"})
        statuses.append(r.status_code)
        assert r.status_code == expected, (path, content, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]

    async def main() -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
            jobs = [stream_client(client, i) for i in range(n_clients)]
            jobs += [bad_client(client, *b) for b in _bad_requests(long_ids)]
            await asyncio.wait_for(asyncio.gather(*jobs), timeout=120)

    asyncio.run(main())
    assert statuses and all(s < 500 for s in statuses), statuses
    assert len(left_ids) == n_leave and len(texts) == n_clients - n_leave
    assert all(t for t in texts)
    assert srv.async_engine.wait_idle(timeout=30), "requests still in the engine"
    aborted = set(srv.async_engine.aborted_ids)
    assert set(left_ids) <= aborted, set(left_ids) - aborted
    stats = srv.llm.engine.stats()
    assert stats["used_blocks"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0
    # the server still serves afterwards
    assert srv.client().completions.create(model=MODEL, prompt="Hello", max_tokens=2).choices[0].text is not None
    metrics = _scrape(srv.base)
    assert _value(metrics, "vllm:request_success_total", finished_reason="abort") >= n_leave


# -- overload: reject mode -------------------------------------------------------------------------


def test_reject_mode_answers_429_with_retry_after():
    # 8 blocks of 16 tokens: one request with a 100-token worst case fills the pool
    running = _serve(None, max_model_len=128, num_gpu_blocks_override=8, preemption_mode="reject")
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 90, "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=TIMEOUT) as client:
            with client.stream("POST", running.base + "/v1/completions", json={**body, "stream": True}) as long_one:
                assert long_one.status_code == 200
                lines = long_one.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))  # admitted and running
                assert json.loads(first[6:])["choices"]
                r = client.post(running.base + "/v1/completions", json=body)
                assert r.status_code == 429, r.text
                assert int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"]["code"] == "rate_limit_exceeded"
                rs = client.post(running.base + "/v1/completions", json={**body, "stream": True})
                assert rs.status_code == 429 and "Retry-After" in rs.headers
                rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            reasons = [c["finish_reason"] for line in rest[:-1] for c in json.loads(line[6:])["choices"]]
            assert reasons[-1] == "length"  # the admitted request finished untouched
            # once it is done, a new request fits again
            ok = client.post(running.base + "/v1/completions", json={**body, "max_tokens": 4})
            assert ok.status_code == 200, ok.text
        metrics = _scrape(running.base)
        assert _value(metrics, "vllm:num_requests_rejected_total", tenant="default") == 2
        assert _value(metrics, "vllm:num_preemptions_total") == 0
    finally:
        running.stop()
        running.llm.close()


def test_graceful_shutdown_aborts_in_flight():
    running = _serve(None, max_model_len=256, num_gpu_blocks_override=32)
    stopped = False
    try:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=TIMEOUT) as client:
            with client.stream("POST", running.base + "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                running.async_engine.begin_shutdown()  # what SIGINT/SIGTERM do in `minivllm serve`
                rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and "error" in json.loads(rest[-2][6:])
        assert running.async_engine.wait_idle(timeout=10)
        assert running.llm.engine.stats()["used_blocks"] == 0
        running.stop()
        stopped = True
        assert not running.async_engine.is_running
    finally:
        if not stopped:
            running.stop()
        running.llm.close()
