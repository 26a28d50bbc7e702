"""The server's HTTP status codes and headers, driven in-process (no socket, no model) so the default suite checks them.

``tests/test_server.py`` checks 429 + ``Retry-After``, the ``/v1/models`` key rule and the shutdown error event
with the real model, so only under ``-m slow``; the fast tests before this file asserted ``Retry-After >= 1``
over HTTP (every hint they produced was under a second), never asked ``/v1/models`` for a key, and read only
the shutdown event's ``code``.  Here the real FastAPI app (:func:`~minivllm.server.build_app`) runs under its
own lifespan, reached through ``httpx.ASGITransport``, in front of the real engine on the simulated executor.

Oracles: RFC 9110 (``Retry-After`` is whole delay-seconds), the OpenAI error body ``{"error": {"message",
"type", "param", "code"}}`` with ``param`` naming the offending field, OpenAI's documented request rules
(``n`` from 1 to 128, ``best_of`` "must be greater than n"; minivllm refuses ``best_of > 1`` outright), the
README's key rule (with keys, a missing or wrong ``Authorization: Bearer`` key is a 401, as vLLM's
``--api-key`` guards every ``/v1`` path), and the engine's own retry hint and block accounting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import re

import pytest

httpx = pytest.importorskip("httpx")

from minivllm.server import build_app  # noqa: E402
from minivllm.server.door import DoorRule  # noqa: E402
from tests.test_server_sim import _paced_engine, _until  # noqa: E402
from tests.test_serving_boundary_hunt import _chat_engine  # noqa: E402

OK_BODY = {"model": "sim", "prompt": list(range(10, 26)), "max_tokens": 4}
ERROR_KEYS = {"message", "type", "param", "code"}


@contextlib.asynccontextmanager
async def _app(engine, keys=None, door=None):
    """The app ``minivllm serve`` runs, with its lifespan (the engine loop thread) and an httpx client reaching it
    in-process: each request costs a few milliseconds, where a uvicorn server on a port costs a second to start."""
    app = build_app(engine, ["sim"], keys, door=door)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim", timeout=30) as c:
            yield app, c


def _sse_events(body: str) -> list:
    """The ``data:`` payloads of an SSE body (events end at a blank line), JSON-decoded; ``[DONE]`` kept as text."""
    events = [e[len("data: "):] for e in body.replace("\r\n", "\n").split("\n\n") if e.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_a_rejected_request_gets_429_with_the_engines_own_hint_rounded_up_to_whole_seconds():
    """Reject mode, the pool held by one long request: a second one (plain, then streamed) is turned away with 429
    and ``Retry-After``.  RFC 9110 section 10.2.3: the value is delay-seconds, a non-negative integer; rounding the
    engine's hint *up* keeps a client that honours it from retrying before the engine said room could exist.

    The hint is the engine's own (``LLMEngine.retry_after``, recorded as it is computed): on the virtual clock
    each step is 0.13 s, so the hint is 0.13 s per remaining token of the seat holder: several seconds, and not a
    whole number.  The header must be exactly its ceiling: a constant ``"1"`` or a rounded-down hint fails."""
    # 8 blocks of 16 tokens; the holder's 16 + 99 tokens reserve all 8, so the next request cannot be admitted.
    # 99, not 100: the hint is 0.13 s x the holder's remaining tokens (1..99), so never a whole number
    engine = _paced_engine(blocks=8, mode="reject", max_len=128, fixed_overhead_s=0.13, per_token_s=0.0,
                           per_context_token_s=0.0, wall_factor=1.0)
    hints: list[float] = []
    engine_hint = engine.retry_after

    def recording(req):
        hints.append(engine_hint(req))
        return hints[-1]

    engine.retry_after = recording

    async def main():
        async with _app(engine) as (_, client):
            holder = asyncio.ensure_future(client.post("/v1/completions",
                                                       json={**OK_BODY, "max_tokens": 99, "ignore_eos": True}))
            await _until(lambda: len(engine.scheduler.running) == 1, "the seat holder is admitted", engine)
            plain = await client.post("/v1/completions", json=OK_BODY)
            streamed = await client.post("/v1/completions", json={**OK_BODY, "stream": True})
            assert not holder.done(), "the seat holder finished before the others were judged"
            engine.executor.wall_factor = 0.0  # the scene is set: let the holder finish at once
            return await holder, plain, streamed

    holder, plain, streamed = asyncio.run(main())
    assert holder.status_code == 200 and holder.json()["usage"]["completion_tokens"] == 99, holder.text
    assert len(hints) == 2 and all(h > 1 and h != int(h) for h in hints), hints  # else "1" or int() could pass
    for r, hint in zip((plain, streamed), hints):
        assert r.status_code == 429, r.text
        assert re.fullmatch(r"[0-9]+", r.headers["Retry-After"]), r.headers  # delay-seconds, not "2.2"
        assert r.headers["Retry-After"] == str(math.ceil(hint)), (r.headers["Retry-After"], hint)
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert engine.stats()["num_rejected"] == 2 and engine.stats()["used_blocks"] == 0


def test_with_api_keys_every_v1_path_needs_one_and_health_and_metrics_do_not():
    """README: "with keys a missing or wrong ``Authorization: Bearer`` key is a 401" -- on ``/v1/models`` as on a
    completion (vLLM's ``--api-key`` guards every ``/v1`` path; the list would otherwise tell anyone what is
    served).  ``/health`` and ``/metrics`` stay open: a load balancer's probe and a Prometheus scrape carry no
    key.  The 401 has OpenAI's error body and code ``invalid_api_key``, which the ``openai`` client reads."""
    engine = _paced_engine(fixed_overhead_s=0.001, wall_factor=0.0)

    async def main():
        async with _app(engine, {"ka": "alice"}) as (_, client):
            got = {}
            for path in ("/v1/models", "/v1/models/sim", "/v1/completions"):
                call = (lambda h, p=path: client.post(p, json=OK_BODY, headers=h)) if path == "/v1/completions" \
                    else (lambda h, p=path: client.get(p, headers=h))
                for label, headers in (("no key", {}), ("wrong key", {"Authorization": "Bearer kb"}),
                                       ("no scheme", {"Authorization": "ka"}), ("key", {"Authorization": "Bearer ka"})):
                    got[path, label] = await call(headers)
            got["/health"] = await client.get("/health")
            got["/metrics"] = await client.get("/metrics")
            return got

    got = asyncio.run(main())
    for (path, label), r in [(k, v) for k, v in got.items() if isinstance(k, tuple)]:
        if label == "key":
            assert r.status_code == 200, (path, r.text)
            continue
        assert r.status_code == 401, (path, label, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and err["code"] == "invalid_api_key", (path, label, err)
    assert [m["id"] for m in got["/v1/models", "key"].json()["data"]] == ["sim"]
    assert got["/health"].status_code == 200 and got["/health"].json() == {"status": "ok"}
    assert got["/metrics"].status_code == 200 and "vllm:" in got["/metrics"].text


def _refused_and_served(engine, path: str, base: dict, extra: dict, param: str) -> None:
    """``base + extra`` is a 400 whose ``param`` is ``param``, in OpenAI's error body; ``base`` alone is served."""
    async def main():
        async with _app(engine) as (_, client):
            return await client.post(path, json={**base, **extra}), await client.post(path, json=base)

    bad, ok = asyncio.run(main())
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert set(err) == ERROR_KEYS and err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"], err
    assert ok.status_code == 200, ok.text
    assert engine.stats()["used_blocks"] == 0 and not engine.requests


@pytest.mark.parametrize("extra, param", [
    # OpenAI: n is 1..128; best_of must be greater than n -- and minivllm samples no extra candidates at all
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "2"}, "n"),  # a count, strictly
    ({"best_of": 2}, "best_of"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"best_of": "2"}, "best_of"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 113}, "max_tokens"),  # 16 prompt tokens + 113 > max_model_len 128
], ids=["n 0", "n 129", "n string", "best_of 2", "best_of over n", "best_of string", "max_tokens bool",
        "max_tokens past context"])
def test_a_bad_completion_body_is_a_400_naming_the_field(extra, param):
    """A request the server cannot serve as asked is a 400 whose ``param`` names the field (OpenAI's error body),
    never served differently from what was asked (``best_of=2`` served as one sample) and never a 5xx.  The
    same body without the field is served, so the refusal is the field's.  Oracle: OpenAI's documented rules."""
    _refused_and_served(_paced_engine(max_len=128, fixed_overhead_s=0.001, wall_factor=0.0), "/v1/completions",
                        OK_BODY, extra, param)


@pytest.mark.parametrize("extra, param", [
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
], ids=["max_completion_tokens past context", "max_completion_tokens 0", "max_tokens past context"])
def test_a_chat_400_names_the_token_limit_field_the_client_set(tokenizer, extra, param):
    """Chat has two names for one limit (OpenAI deprecated ``max_tokens`` for ``max_completion_tokens``): the 400
    must name the one the client sent, or a client that never sent ``max_tokens`` is told to fix it."""
    base = {"model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "Count to ten."}]}
    if "max_completion_tokens" in extra:
        base = {k: v for k, v in base.items() if k != "max_tokens"} | {"max_completion_tokens": 4}
    _refused_and_served(_chat_engine(tokenizer), "/v1/chat/completions", base, extra, param)


@dataclasses.dataclass(frozen=True)
class _Switch(DoorRule):
    """A door the test opens and shuts (the real rule's inputs are timing-dependent)."""

    shut: list = dataclasses.field(default_factory=lambda: [False])

    def closed(self, stats: dict) -> bool:
        return self.shut[0]


def test_shutdown_is_503_for_new_and_waiting_requests_an_error_event_for_streams_and_unhealthy():
    """The module docstring's shutdown contract, in one scene: a non-streamed request in flight gets a 503, an open
    stream ends with an error event (OpenAI's error object, ``type`` ``service_unavailable``, ``code`` 503) and
    then ``[DONE]``, ``/health`` turns 503 so load balancers stop sending, and a new request is a 503
    ``shutting_down`` even where the door would have answered 429: 429 means "retry here after Retry-After",
    503 from a leaving replica means "go elsewhere" (RFC 9110 sections 15.5.20 and 15.6.4)."""
    engine = _paced_engine(fixed_overhead_s=0.01, per_token_s=0.0, per_context_token_s=0.0, wall_factor=10.0)
    door = _Switch(max_waiting=1)

    async def main():
        async with _app(engine, door=door) as (app, client):
            long = {**OK_BODY, "max_tokens": 300, "ignore_eos": True}
            waiting = asyncio.ensure_future(client.post("/v1/completions", json=long))
            streamed = asyncio.ensure_future(client.post("/v1/completions", json={**long, "stream": True}))
            await _until(lambda: sum(1 for r in list(engine.scheduler.running) if r.output_token_ids) == 2,
                         "both long requests are running", engine)
            door.shut[0] = True
            shed = await client.post("/v1/completions", json=OK_BODY)  # the door is live: 429 while serving
            app.state.async_engine.begin_shutdown()  # what SIGINT/SIGTERM do in `minivllm serve`
            late = await client.post("/v1/completions", json=OK_BODY)
            late_chat = await client.post("/v1/chat/completions",
                                          json={"model": "sim", "messages": [{"role": "user", "content": "w5"}]})
            health = await client.get("/health")
            return shed, late, late_chat, health, await waiting, await streamed

    shed, late, late_chat, health, waiting, streamed = asyncio.run(main())
    assert shed.status_code == 429 and shed.json()["error"]["code"] == "queue_full", shed.text
    for r in (late, late_chat):
        assert r.status_code == 503 and "Retry-After" not in r.headers, r.text
        assert r.json()["error"]["code"] == "shutting_down" and r.json()["error"]["type"] == "service_unavailable"
    assert health.status_code == 503 and health.json()["error"]["code"] == "unhealthy", health.text
    assert waiting.status_code == 503, waiting.text
    assert set(waiting.json()["error"]) == ERROR_KEYS and waiting.json()["error"]["type"] == "service_unavailable"
    assert streamed.status_code == 200  # its 200 went out with its first token; the cut can only be an event
    events = _sse_events(streamed.text)
    assert events[-1] == "[DONE]" and all("choices" in e for e in events[:-2]), events[-3:]
    error = events[-2]
    assert set(error) == {"error"} and set(error["error"]) == ERROR_KEYS, error
    assert (error["error"]["type"], error["error"]["code"]) == ("service_unavailable", 503), error
    assert error["error"]["message"], error
    assert engine.stats()["used_blocks"] == 0 and not engine.requests


def test_vllms_chat_template_inputs_are_refused_not_silently_dropped():
    """``protocol``'s promise: a field whose non-default value minivllm cannot honour is a 400, "never silently
    dropped".  vLLM's chat request takes the conversation's template (``chat_template``), documents for a RAG
    template (``documents``) and ``add_special_tokens`` (special tokens on top of what the template writes);
    minivllm renders every conversation with the model's own template and adds nothing, so a client moving from
    vLLM got a 200 built from a prompt other than the one it asked for.  Oracle: vLLM's field documentation, and
    the sibling ``chat_template_kwargs``, already refused.  Their defaults (null, empty, false) still serve."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.executor import SimulatedExecutor
    from tests.test_serving_boundary_hunt import _ChatWords

    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=256, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_ChatWords(), model_max_len=256,
                       eos_token_ids=set())
    chat = {"model": "sim", "messages": [{"role": "user", "content": "w11 w12"}], "max_tokens": 2}
    asked = {"chat_template": "{{ 'w99' }}", "documents": [{"title": "t", "text": "w5"}], "add_special_tokens": True}
    defaults = {"chat_template": None, "documents": [], "add_special_tokens": False}

    async def main():
        async with _app(engine) as (_, client):
            refused = {name: await client.post("/v1/chat/completions", json={**chat, name: value})
                       for name, value in asked.items()}
            served = await client.post("/v1/chat/completions", json={**chat, **defaults})
            return refused, served

    refused, served = asyncio.run(main())
    for name, r in refused.items():
        assert r.status_code == 400, (name, r.text)
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (name, "unsupported"), r.text
    assert served.status_code == 200, served.text
