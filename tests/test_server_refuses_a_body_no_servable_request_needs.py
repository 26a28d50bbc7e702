"""A request body larger than any request that could run needs is a 413, before it is parsed.

Why: the body is parsed on the event loop, holding the GIL, into one Python object per token id or message.  A
90 MB body of token ids froze every other stream (and the engine loop) for 3 s and took 870 MB, only to be
refused for its length afterwards.  The limit is derived, not guessed, so it never refuses a request that
fits: a prompt of more characters than twice the longest vocabulary entry per position is refused by the
engine anyway (``InputProcessor.max_fitting_chars``), one character of JSON is at most 12 bytes (a character
outside the BMP as two ``\\uXXXX`` escapes), plus 1 MiB for every other field.

The real SmolLM2 tokenizer on the simulated executor: no model load.
"""

from __future__ import annotations

import httpx
import pytest

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.server import BackgroundServer
from minivllm.server.api_server import build_app
from minivllm.sim.executor import SimulatedExecutor

MAX_LEN = 512


def _engine(tokenizer) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=MAX_LEN, device="cpu")
    return LLMEngine(cfg, executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
                     model_max_len=MAX_LEN)


def _padded(body: bytes, size: int) -> bytes:
    """``body`` (a JSON object) grown to exactly ``size`` bytes with the whitespace JSON allows before its ``}``."""
    assert body.endswith(b"}") and len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


def test_a_body_past_what_any_servable_request_needs_is_a_413_and_one_at_the_limit_is_served(tokenizer):
    # the oracle, by hand: 1 MiB + 12 bytes for each of the 2 * longest-entry * max_model_len characters
    limit = (1 << 20) + 12 * 2 * max(map(len, tokenizer.get_vocab())) * MAX_LEN
    engine = _engine(tokenizer)
    headers = {"Content-Type": "application/json"}
    with BackgroundServer(engine, "sim", start_timeout_s=30) as srv:
        url = srv.base_url + "/v1/completions"
        fits = b'{"prompt": [11, 12, 13], "max_tokens": 2}'
        at_limit = httpx.post(url, content=_padded(fits, limit), headers=headers, timeout=60)
        assert at_limit.status_code == 200, at_limit.text[:300]

        # one byte more: refused as too large, not parsed into a million ids and then refused for their number
        ids = b'{"prompt": [' + b",".join([b"11"] * 1_000_000) + b'], "max_tokens": 2}'
        for body in (_padded(fits, limit + 1), ids):
            r = httpx.post(url, content=body, headers=headers, timeout=60)
            assert r.status_code == 413, (len(body), r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["code"] == "request_too_large" and str(limit) in err["message"], err
        # without a Content-Length (a chunked upload) the bytes are counted as they come
        chunks = (ids[i:i + 65536] for i in range(0, len(ids), 65536))
        r = httpx.post(url, content=chunks, headers=headers, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
        chat = httpx.post(srv.base_url + "/v1/chat/completions", headers=headers, timeout=60,
                          content=_padded(b'{"messages": [{"role": "user", "content": "hi"}]}', limit + 1))
        assert chat.status_code == 413, chat.text[:300]

        assert srv.async_engine.wait_idle(10) and engine.pool.num_free == engine.pool.num_blocks
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200


def test_the_limit_can_be_set_or_turned_off_and_a_bad_one_is_refused(tokenizer):
    """``max_body_bytes=None`` keeps no limit (the body is parsed, then refused for what it holds); a limit set by
    the operator is the one applied; a value that is no byte count fails at build time, not on the first request."""
    from starlette.testclient import TestClient

    body = b'{"prompt": [' + b",".join([b"11"] * 600) + b'], "max_tokens": 2}'  # 600 ids: over the context
    for limit, status in ((None, 400), (len(body) - 1, 413), (len(body), 400)):
        with TestClient(build_app(_engine(tokenizer), ["sim"], max_body_bytes=limit)) as client:
            r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (limit, r.text[:300])
    for bad in (0, -1, 1.5, True, "1MB"):
        with pytest.raises(ValueError, match="max_body_bytes"):
            build_app(_engine(tokenizer), ["sim"], max_body_bytes=bad)


def test_a_large_body_is_parsed_off_the_event_loop_and_a_small_one_on_it(tokenizer, monkeypatch):
    """Under the limit a body can still be big: at ``max_model_len=8192`` a 17 MB conversation of 500k one-word
    messages is allowed, and parsed on the event loop it held every other stream for 2.1 s (pydantic validates each
    message, holding the GIL the loop needs).  On a worker thread its per-message validators let the loop run
    between them (0.3 s).  Small bodies stay on the loop, where they take microseconds, not a thread hop.
    Oracle: whether the parse ran where an event loop is running."""
    import asyncio

    from minivllm.server.protocol import ChatCompletionRequest

    where: list[bool] = []
    validate = ChatCompletionRequest.model_validate

    def recording(cls, data, **kw):
        try:
            asyncio.get_running_loop()
            where.append(True)
        except RuntimeError:
            where.append(False)
        return validate(data, **kw)

    monkeypatch.setattr(ChatCompletionRequest, "model_validate", classmethod(recording))
    with BackgroundServer(_engine(tokenizer), "sim", start_timeout_s=30) as srv:
        url = srv.base_url + "/v1/chat/completions"
        small = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        large = {"messages": [{"role": "user", "content": "hi"}] * 5000, "max_tokens": 2}  # 150 kB
        assert httpx.post(url, json=small, timeout=60).status_code == 200
        assert httpx.post(url, json=large, timeout=60).status_code == 400  # (5000 turns: past the context)
    assert where == [True, False]


def test_a_declared_length_past_the_limit_is_refused_before_any_body_arrives(tokenizer):
    """The ``Content-Length`` alone decides: a client that declares more than the limit gets its 413 at once,
    without sending (or the server waiting for) a single byte of the body -- what an ``Expect: 100-continue``
    upload relies on, and what spares the server reading up to the limit first.  Oracle: the status line arrives
    while the client has sent only the request head; a server that counted received bytes instead would wait
    for a body that never comes (the read times out)."""
    import socket

    with BackgroundServer(_engine(tokenizer), "sim", start_timeout_s=30) as srv:
        limit = srv.app.state.handlers.max_body_bytes
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {limit + 1}\r\nExpect: 100-continue\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(head)
            reply = b""
            try:
                while b"\r\n" not in reply:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
            except TimeoutError:
                pass
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
