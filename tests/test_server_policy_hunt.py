"""The server against the engine's scheduling options: what a client's request asks of the policy being served.

The oracle is the engine's own step log (who was scheduled first) beside the README's promise for request
fields: a vLLM field minivllm does not honour is "a 400 naming the field when set to anything but its no-op
value, never silently ignored".  Runs on the simulated executor (no model), so it is in the default suite.
"""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from tests.test_server_sim import _SCENE_PACE, _PacedExecutor, _Served, _until, _WordTokenizer  # noqa: E402


def _priority_engine() -> LLMEngine:
    """One seat, vLLM's priority policy: whoever waits is admitted lowest ``priority`` first."""
    cfg = EngineConfig(num_gpu_blocks_override=1024, block_size=16, max_model_len=512, max_num_seqs=1,
                       max_num_batched_tokens=1024, scheduling_policy="priority", device="cpu")
    return LLMEngine(cfg, executor=_PacedExecutor(**_SCENE_PACE), tokenizer=_WordTokenizer(), model_max_len=512,
                     eos_token_ids=set())


def test_a_vllm_priority_on_a_priority_server_is_honoured_or_refused_never_dropped():
    """vLLM's ``priority`` extra (``extra_body={"priority": -5}``) sent to a server running the priority policy.

    Two requests wait behind a seat holder: ``low`` (priority 5) arrives first, ``high`` (priority -5) second.
    Honoured, ``high`` is scheduled before ``low``; refused, the request is a 400 naming ``priority``.  The
    server used to drop the field without a word (every HTTP request ran at priority 0), so ``low`` went first
    by arrival and the client was never told its priority meant nothing.
    """
    engine = _priority_engine()
    sched = engine.scheduler
    with _Served(engine) as srv:
        body = {"model": "sim", "prompt": list(range(10, 26)), "max_tokens": 4, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                post = lambda **kw: asyncio.ensure_future(  # noqa: E731
                    client.post(srv.base + "/v1/completions", json={**body, **kw}))
                holder = post(max_tokens=450)
                await _until(lambda: len(sched.running) == 1, "the seat holder runs", engine)
                low = post(priority=5)
                await _until(lambda: low.done() or len(sched.waiting) == 1, "the low-priority request waits", engine)
                high = post(priority=-5)
                await _until(lambda: high.done() or len(sched.waiting) == 2, "the high-priority request waits", engine)
                engine.executor.wall_factor = 0.05  # the scene is set: let the queue drain
                return await asyncio.gather(holder, low, high)

        holder, low, high = asyncio.run(main())
    assert holder.status_code == 200, holder.text
    if low.status_code == 400 or high.status_code == 400:  # refused: both, naming the field
        for r in (low, high):
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
        return
    assert low.status_code == high.status_code == 200, (low.text, high.text)
    first_step = {}
    for i, rec in enumerate(engine.step_log):
        for rid, _, _ in rec["seqs"]:
            first_step.setdefault(rid, i)
    assert first_step[high.json()["id"]] < first_step[low.json()["id"]], \
        "priority -5 was scheduled after priority 5: the field was dropped"
    assert engine.stats()["used_blocks"] == 0


def _served_as_the_cli_builds_it(tmp_path, keys: dict, tenants: dict, *argv: str) -> tuple[LLMEngine, dict]:
    """The engine ``minivllm serve --api-keys-file K --tenants-file T ARGV`` would run, on the paced simulator.

    The options come from :func:`minivllm.cli.serve_options` -- the very function ``serve`` hands to ``LLM`` -- fed
    the real parser's namespace, so what is tested is what the CLI serves; only the model is swapped for the
    simulated executor (the pool and batch sizes below are the simulator's, set where the CLI leaves them unset).
    """
    from minivllm.cli import _parser, serve_options

    (tmp_path / "keys.json").write_text(json.dumps(keys))
    (tmp_path / "tenants.json").write_text(json.dumps(tenants))
    args = _parser().parse_args(["serve", "--api-keys-file", str(tmp_path / "keys.json"),
                                 "--tenants-file", str(tmp_path / "tenants.json"), *argv])
    options, api_keys = serve_options(args)
    cfg = EngineConfig(**{"num_gpu_blocks_override": 1024, "block_size": 16, "max_model_len": 512,
                          "max_num_batched_tokens": 1024, "device": "cpu", **options})
    engine = LLMEngine(cfg, executor=_PacedExecutor(**_SCENE_PACE), tokenizer=_WordTokenizer(), model_max_len=512,
                       eos_token_ids=set())
    return engine, api_keys


def test_a_tenants_file_reaches_requests_over_http(tmp_path):
    """``minivllm serve --tenants-file --scheduling-policy wfq --max-num-seqs 1``: the file binds the tenant each
    API key names, over HTTP.

    ``batch`` is ``{"max_running": 1, "over_cap": "reject"}``: while its first request holds the seat, a second is a
    429 with ``Retry-After`` (streamed or not).  ``chat`` is ``{"weight": 3}`` beside ``bulk`` (weight 1, the
    default), six equal requests each, queued alternately behind that seat: while both are backlogged WFQ serves
    chat about three times bulk's tokens (the oracle: the engine's step log, tokens per tenant); every request is
    served in full.  The CLI wiring test only saw ``TenantConfig`` objects handed to a mocked ``LLM``; here requests
    meet them.  Were the file dropped on the way (every tenant ``TenantConfig()``), batch's second request would be
    a 200 and chat would get bulk's share.
    """
    engine, api_keys = _served_as_the_cli_builds_it(
        tmp_path, {"kc": "chat", "kb": "batch", "ku": "bulk"},
        {"chat": {"weight": 3}, "batch": {"max_running": 1, "over_cap": "reject"}},
        "--scheduling-policy", "wfq", "--max-num-seqs", "1")
    sched = engine.scheduler
    with _Served(engine, api_keys) as srv:
        body = {"model": "sim", "prompt": list(range(10, 26)), "max_tokens": 16, "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                def post(key, **extra):
                    return asyncio.ensure_future(client.post(
                        srv.base + "/v1/completions", json={**body, **extra},
                        headers={"Authorization": f"Bearer {key}"}))
                holder = post("kb", max_tokens=60)
                await _until(lambda: len(sched.running) == 1, "batch's first request holds the seat", engine)
                over, over_stream = post("kb", max_tokens=5), post("kb", max_tokens=5, stream=True)
                # A request over a rejecting cap is refused by the next admission pass, so it sits in the queue for the
                # moment between its add and that pass: waiting for "answered, or queued" read that moment as
                # "queued" (a CI flake).  Answered while the holder still holds the seat is the oracle: queued
                # behind it, both would be answered only after its 60 steps.
                await _until(lambda: over.done() and over_stream.done(), "batch's others are answered", engine)
                assert not holder.done() and not sched.waiting, \
                    "batch's second request was queued, not refused: the tenants file's max_running=1 did not bind"
                queued = []
                for key in ["ku", "kc"] * 6:  # bulk, chat, bulk, ...: arrival order alone would alternate them
                    queued.append((key, post(key)))
                    n = len(queued)
                    await _until(lambda: queued[-1][1].done() or len(sched.waiting) == n, f"request {n} waits", engine)
                assert not holder.done(), "batch's first request finished before the others queued behind it"
                engine.executor.wall_factor = 0.05  # the scene is set: let the queue drain
                return await holder, over.result(), over_stream.result(), [(key, await job) for key, job in queued]

        holder, over, over_stream, queued = asyncio.run(main())
    assert holder.status_code == 200 and holder.json()["usage"]["completion_tokens"] == 60, holder.text
    for r in (over, over_stream):
        assert r.status_code == 429, f"batch's max_running=1 from the tenants file did not bind: {r.status_code}"
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert [r.status_code for _, r in queued] == [200] * 12, [r.text for _, r in queued]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for _, r in queued)
    tenant_of = {r.json()["id"]: {"kc": "chat", "ku": "bulk"}[key] for key, r in queued}
    # the window while both are backlogged: up to the step where either tenant's last request is first scheduled
    unstarted = {"chat": 6, "bulk": 6}
    served = {"chat": 0, "bulk": 0}
    started = set()
    for rec in engine.step_log:
        for rid, _, tokens in rec["seqs"]:
            if rid in tenant_of and rid not in started:
                started.add(rid)
                unstarted[tenant_of[rid]] -= 1
        if min(unstarted.values()) == 0:
            break
        for rid, _, tokens in rec["seqs"]:
            if rid in tenant_of:
                served[tenant_of[rid]] += tokens
    assert 2 * served["bulk"] <= served["chat"] <= 4 * served["bulk"], \
        f"weight 3 against weight 1 while both were backlogged served {served}: the tenants file's weight was lost"
    assert engine.stats()["per_tenant"]["batch"]["num_rejected"] == 2
    assert engine.stats()["used_blocks"] == 0
