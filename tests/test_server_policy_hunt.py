"""The server against the engine's scheduling options: what a client's request asks of the policy being served.

The oracle is the engine's own step log (who was scheduled first) beside the README's promise for request
fields: a vLLM field minivllm does not honour is "a 400 naming the field when set to anything but its no-op
value, never silently ignored".  Runs on the simulated executor (no model), so it is in the default suite.
"""

from __future__ import annotations

import asyncio

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
