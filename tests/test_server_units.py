"""Server details the end-to-end tests cannot see, checked without a model or a socket.

Found by a mutation pass over ``minivllm/server``: the end-to-end 429 tests only assert ``Retry-After >= 1``, and
every retry hint they produce is under a second, so rounding the hint down instead of up went unnoticed.
RFC 9110 section 10.2.3: ``Retry-After`` is whole seconds to wait; a client honouring a rounded-down value retries
before the server said it could be served.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from minivllm.metrics.prometheus import EngineMetrics
from minivllm.metrics.scrape import metric_samples, metric_value
from minivllm.sampling_params import SamplingParams
from minivllm.server.api_server import APIError, OpenAIServer, _retry_after
from minivllm.server.door import DoorRule, door_snapshot


@pytest.mark.parametrize("hint, header", [(0.2, "1"), (1.0, "1"), (1.5, "2"), (2.01, "3"), (7.0, "7"),
                                          (float("inf"), "1"), (float("nan"), "1"), (None, "1"),
                                          (0.0, "1"), (-2.5, "1")])
def test_reject_retry_after_is_the_engines_hint_rounded_up_to_whole_seconds(hint, header):
    """The header is at least 1 whatever the hint: a zero or negative hint (no producer sends one today: the
    engine floors its hints at 1 ms and ``DoorRule`` refuses ``retry_after_s <= 0``) must not become
    ``Retry-After: 0`` -- "retry now" into the pool that just refused -- or a negative value RFC 9110 does not
    allow.  The last two cases catch a floor of 0 instead of 1."""
    assert _retry_after(SimpleNamespace(retry_after_s=hint)) == header


def test_door_snapshot_takes_a_count_of_zero_from_the_caller():
    """``num_waiting=0`` is the caller's count (nothing queued or posted), not "no count": the snapshot must not
    fall back to the scheduler's queue, which the caller read under its own lock and this read does not.  Catches
    ``if not num_waiting`` for ``if num_waiting is None``."""
    engine = SimpleNamespace(kv=SimpleNamespace(num_available_blocks=9), scheduler=SimpleNamespace(waiting=[1, 2]))
    assert door_snapshot(engine, num_waiting=0) == {"num_waiting": 0, "available_blocks": 9}
    assert not DoorRule(max_waiting=1).closed(door_snapshot(engine, num_waiting=0))


def test_door_snapshot_falls_back_to_the_free_list_when_the_cache_count_fails_mid_resize():
    """The snapshot is read without the engine lock, so counting the cache's evictable blocks can meet a structure
    the engine thread is resizing (RuntimeError); then the free list alone is the count -- a lower bound of the
    available blocks (free plus evictable), never an invented number.  Catches the fallback reporting 0 (a dry
    pool: every request shed while anything waits) or anything other than ``pool.num_free``."""

    class Resizing:
        @property
        def num_available_blocks(self):
            raise RuntimeError("dictionary changed size during iteration")

    engine = SimpleNamespace(kv=Resizing(), pool=SimpleNamespace(num_free=7), scheduler=SimpleNamespace(waiting=[1]))
    assert door_snapshot(engine) == {"num_waiting": 1, "available_blocks": 7}
    assert not DoorRule(max_waiting=4, min_free_blocks=5).closed(door_snapshot(engine))


def test_a_door_rule_without_min_free_blocks_sheds_on_the_queue_alone():
    """``min_free_blocks`` defaults to 0, "no pool criterion": no count of blocks is below 0, so a rule built with
    ``max_waiting`` only refuses exactly when the queue holds ``max_waiting``, even on a dry pool.  Catches a
    default of 1 (a short queue shed whenever the pool is momentarily empty)."""
    rule = DoorRule(max_waiting=3)
    assert rule.min_free_blocks == 0
    for waiting in range(6):
        assert rule.closed({"num_waiting": waiting, "available_blocks": 0}) == (waiting >= 3)


def test_door_429_has_retry_after_rounded_up_and_counts_the_shed_request():
    asked = []  # a request that could never run is refused before the door: the engine is asked first
    engine = SimpleNamespace(scheduler=SimpleNamespace(waiting=[object()]),
                             kv=SimpleNamespace(num_available_blocks=100),
                             never_runs=lambda total, tenant: asked.append((total, tenant)))
    metrics = EngineMetrics("m")
    srv = OpenAIServer(SimpleNamespace(engine=engine, metrics=metrics, shutting_down=False,
                                       waiting_or_posted=lambda: len(engine.scheduler.waiting)), ["m"], 64,
                       DoorRule(max_waiting=1, retry_after_s=2.5))
    with pytest.raises(APIError) as err:
        asyncio.run(srv._submit({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=4), "alice", "cmpl"))
    assert asked == [(6, "alice")]  # 2 prompt tokens + 4 asked
    assert (err.value.status, err.value.code) == (429, "queue_full")
    assert err.value.headers == {"Retry-After": "3"}
    s = metric_samples(metrics.render().decode())
    assert metric_value(s, "vllm:num_requests_shed_total", tenant="alice") == 1


def test_the_door_counts_a_queued_request_once_while_its_handler_has_not_resumed():
    """The door's count is the scheduler's queue plus the requests posted to the engine thread but not queued yet
    (``door_snapshot``'s ``pending``).  Once the engine thread has queued a request, it is in the queue: counting
    it as pending too, until its handler resumes on the event loop, closed the door early.  Scene: one seat, held;
    request A is queued behind it while the event loop is busy (a handler parsing a large body, say); then request
    B arrives.  Oracle, by hand: one request waits, ``max_waiting=2``, so B gets in.  (Before: B saw 1 + 1 and got a
    429; a burst of 32 at ``max_waiting=32``, which fits by the same count, had 10 of them shed.)"""
    import time

    from minivllm.server import build_app
    from tests.test_server_sim import _SCENE_PACE, _paced_engine

    engine = _paced_engine(max_seqs=1, **_SCENE_PACE)  # 0.1 s a step: the holder keeps its seat for the test
    app = build_app(engine, ["sim"], door=DoorRule(max_waiting=2))
    handlers, sched = app.state.handlers, engine.scheduler

    def submit(first: int, max_tokens: int):
        return handlers._submit({"prompt_token_ids": list(range(first, first + 8))},
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True), "default", "cmpl")

    async def main():
        async with app.router.lifespan_context(app):
            _, holder = await submit(10, 400)
            end = time.monotonic() + 30
            while len(sched.running) != 1 and time.monotonic() < end:
                await asyncio.sleep(0.01)
            a = asyncio.ensure_future(submit(20, 1))
            await asyncio.sleep(0)  # A runs until it waits for the engine thread: posted
            while len(sched.waiting) != 1 and time.monotonic() < end:
                time.sleep(0.01)  # blocking: the event loop does not run A's handler on
            time.sleep(0.2)  # the engine thread finishes its add command
            assert (len(sched.running), len(sched.waiting)) == (1, 1), "the scene: one seat held, A queued"
            try:
                _, b = await submit(30, 1)
            finally:
                _, a_stream = await a
                a_stream.close()
                holder.close()
            b.close()

    asyncio.run(main())


def test_the_door_counts_a_request_once_while_the_engine_thread_moves_it_into_the_queue():
    """The engine thread's add command puts a request in the scheduler's queue and then drops it from the posted
    count; a door check between the two counted it twice.  (That while is more than a few bytecodes: the command
    also tracked the request's metrics and woke the event loop -- a write that lets it run a door check right
    then.)  Stepped by hand: the engine's ``add_request`` is held open just after it queued request A, and request
    B comes to the door then.  Oracle, by hand: one request waits, ``max_waiting=2``, so B gets in.  (Before: B
    saw 1 queued + 1 posted and got a 429.)"""
    import threading

    from minivllm.server import build_app
    from tests.test_server_sim import _SCENE_PACE, _paced_engine

    engine = _paced_engine(max_seqs=1, **_SCENE_PACE)
    app = build_app(engine, ["sim"], door=DoorRule(max_waiting=2))
    handlers = app.state.handlers
    queued, b_checked = threading.Event(), threading.Event()
    real_add = engine.add_request

    def add_request(*args, **kwargs):
        request_id = real_add(*args, **kwargs)
        if not queued.is_set():
            queued.set()
            b_checked.wait(1.0)  # A is queued and not yet dropped from the posted count (a door that waits for the
        return request_id  # move to finish waits out this second)

    engine.add_request = add_request

    def submit(first: int):
        return handlers._submit({"prompt_token_ids": list(range(first, first + 8))},
                                SamplingParams(max_tokens=1, ignore_eos=True), "default", "cmpl")

    async def main():
        async with app.router.lifespan_context(app):
            a = asyncio.ensure_future(submit(20))
            for _ in range(3000):
                if queued.is_set():
                    break
                await asyncio.sleep(0.01)
            assert queued.is_set() and len(engine.scheduler.waiting) == 1, "the scene: A queued, its add still open"
            try:
                _, b = await submit(30)
            finally:
                b_checked.set()
                _, a_stream = await a
                a_stream.close()
            b.close()

    asyncio.run(main())


def test_bearer_scheme_is_case_insensitive():
    """RFC 9110 section 11.1: the auth scheme is case-insensitive (``curl -H 'Authorization: bearer KEY'``)."""
    from minivllm.server.api_server import _AuthMiddleware

    auth = _AuthMiddleware(None, {"key1": "alice"})
    for scheme in (b"Bearer", b"bearer", b"BEARER"):
        assert auth.tenant_for([(b"authorization", scheme + b" key1")]) == "alice"
    assert auth.tenant_for([(b"authorization", b"Basic key1")]) is None
    assert auth.tenant_for([(b"authorization", b"Bearer nope")]) is None


def test_a_401_carries_a_bearer_challenge():
    """RFC 9110 section 11.6.1: "A server generating a 401 (Unauthorized) response MUST send a WWW-Authenticate
    header field containing at least one challenge"; RFC 6750 section 3 names the challenge for a bearer-token
    resource, scheme ``Bearer``.  Without it a client cannot tell which credentials to send (curl's
    ``--anyauth`` and other generic HTTP clients read the scheme from it).  Missing and wrong keys alike; a
    request with the right key gets no challenge.  Driven over ASGI through the middleware alone."""
    import httpx

    from minivllm.server.api_server import _AuthMiddleware

    async def inner(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def main():
        transport = httpx.ASGITransport(app=_AuthMiddleware(inner, {"key1": "alice"}))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.get("/v1/models", headers=h)
                    for h in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key1"},
                              {"Authorization": "Bearer key1"})]

    *refused, ok = asyncio.run(main())
    for r in refused:
        assert r.status_code == 401, r.text
        challenge = r.headers.get("WWW-Authenticate", "")
        assert challenge.split(" ", 1)[0].lower() == "bearer", r.headers  # the auth-scheme is case-insensitive
    assert ok.status_code == 200 and "WWW-Authenticate" not in ok.headers


@pytest.mark.parametrize("running, stopping, code", [(True, False, 200), (True, True, 503), (False, False, 503)])
def test_health_is_503_while_shutting_down(running, stopping, code):
    """A draining server must leave the load balancer's pool: ``/health`` is 503 once shutdown has begun."""
    eng = SimpleNamespace(engine=SimpleNamespace(), metrics=None, is_running=running, shutting_down=stopping)
    assert asyncio.run(OpenAIServer(eng, ["m"]).health(None)).status_code == code


def test_streamed_chat_opens_every_choice_with_the_assistant_role():
    """OpenAI's stream sends ``delta.role`` once per choice, so an ``n = 2`` client that keys choices by index
    learns both roles (the ``openai`` helpers and LangChain read the role from the first delta of each)."""
    import json

    outs = [SimpleNamespace(index=i, delta_text="hi", finish_reason="stop", token_ids=[7]) for i in range(2)]
    first = SimpleNamespace(outputs=outs, finished=True, prompt_token_ids=[1], num_cached_tokens=0)
    srv = OpenAIServer(SimpleNamespace(engine=SimpleNamespace(), metrics=None), ["m"])

    async def collect():
        return [c async for c in srv._stream_chat("id", "m", 0, first, SimpleNamespace(finished=True), False)]

    chunks = [json.loads(c[6:]) for c in asyncio.run(collect()) if c != "data: [DONE]\n\n"]
    roles = {ch["choices"][0]["index"] for ch in chunks if ch["choices"][0]["delta"].get("role") == "assistant"}
    assert roles == {0, 1}
    finished = [ch["choices"][0]["index"] for ch in chunks if ch["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]


def test_a_rejected_request_counts_as_rejected_and_stays_out_of_the_latency_histograms():
    """A 429'd request was never served: counting its (tiny) arrival-to-rejection time as an end-to-end latency
    would pull the e2e percentiles down exactly when the server is overloaded."""
    from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

    m = EngineMetrics("m")
    m.track("r", "alice")
    m.observe_output(RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [], "rejected")], True,
                                   RequestMetrics(arrival_time=0.0, finished_time=0.01), retry_after_s=1.0))
    m.track("s", "alice")
    m.observe_output(RequestOutput("s", None, [1, 2], [CompletionOutput(0, "x", [5], "stop", None, "x", [5])], True,
                                   RequestMetrics(0.0, 0.1, 0.2, [0.2], 2.0)))
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:num_requests_rejected_total", tenant="alice") == 1
    assert metric_value(s, "vllm:request_success_total", finished_reason="rejected") == 1
    assert metric_value(s, "vllm:e2e_request_latency_seconds_count") == 1
    assert metric_value(s, "vllm:e2e_request_latency_seconds_sum") == 2.0
    assert metric_value(s, "vllm:request_queue_time_seconds_count") == 1
