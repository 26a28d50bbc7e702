"""The 429 a rejected request gets before the engine has timed any step carries the step time the README states.

Why: a retry hint is steps-to-wait times the engine's average step time, and before any step has been timed
the engine counts a fixed :data:`~minivllm.engine.llm_engine.UNTIMED_STEP_S` a step.  A mutation pass changed
that value and no test failed (in 300 random simulated workloads no hint came before a timed step: on a clock
that moves, the step that rejects already has a time).  It does come first on an executor whose clock stands
still, so that is the scene here.  Oracle: the README's sentence on the hint, read from the text, with the
steps the engine counted (the rejecting step's running request's remaining tokens) -- in exact decimal
arithmetic, rounded up to whole seconds as RFC 9110's ``Retry-After`` is.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from decimal import Decimal
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from tests.test_server_sim import _Served, _until, _WordTokenizer  # noqa: E402

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


class _StoppedClock(SimulatedExecutor):
    """The simulator with every cost 0 (its clock never moves, so no step is ever timed) that still sleeps
    ``wall_s`` of real time a step, so a request holds its seat while the next one arrives over HTTP."""

    def __init__(self, wall_s: float) -> None:
        super().__init__(fixed_overhead_s=0.0, per_token_s=0.0, per_context_token_s=0.0)
        self.wall_s = wall_s

    def execute(self, batch):
        if batch.seqs:
            time.sleep(self.wall_s)
        return super().execute(batch)


def _documented_untimed_step() -> Decimal:
    m = re.search(r"or (\d+(?:\.\d+)?) s a step before any step has been timed", " ".join(README.split()))
    assert m, "the README no longer states the step a retry hint counts before any step is timed"
    return Decimal(m.group(1))


def test_the_first_429_before_any_step_is_timed_says_the_documented_step_times_the_steps_to_wait():
    step = _documented_untimed_step()
    # reject mode, 28 blocks of 16 tokens: the first request's worst case (16 + 400 tokens) reserves 26, so the
    # second (16 + 20: 3 blocks) does not fit beside it and is turned away while the first runs
    cfg = EngineConfig(num_gpu_blocks_override=28, block_size=16, max_model_len=448, max_num_seqs=8,
                       max_num_batched_tokens=512, preemption_mode="reject", device="cpu")
    engine = LLMEngine(cfg, executor=_StoppedClock(wall_s=0.01), tokenizer=_WordTokenizer(), model_max_len=448,
                       eos_token_ids=set())
    hinted = []  # at each hint: the engine's step time, and each running request's tokens still to come
    real_hint = engine.retry_after

    def spy(req):
        hinted.append((engine.step_time_s, [r.max_tokens - len(r.output_token_ids) for r in engine.scheduler.running]))
        return real_hint(req)

    engine.retry_after = spy
    with _Served(engine) as srv:
        body = {"model": "sim", "prompt": list(range(10, 26)), "ignore_eos": True}

        async def main():
            async with httpx.AsyncClient(timeout=30) as client:
                first = asyncio.ensure_future(client.post(srv.base + "/v1/completions", json={**body, "max_tokens": 400}))
                await _until(lambda: len(engine.scheduler.running) == 1, "the first request holds its seat", engine)
                over = await client.post(srv.base + "/v1/completions", json={**body, "max_tokens": 20})
                engine.executor.wall_s = 0.0
                return await first, over

        first, over = asyncio.run(main())
    assert first.status_code == 200 and first.json()["usage"]["completion_tokens"] == 400
    assert over.status_code == 429, over.text
    assert len(hinted) == 1, hinted
    step_time_s, remaining = hinted[0]
    assert step_time_s is None, "a step was timed before the rejection: the scene tests nothing"
    assert len(remaining) == 1 and remaining[0] > 40, remaining  # enough steps that the rounding cannot hide the step
    assert int(over.headers["Retry-After"]) == max(1, math.ceil(step * remaining[0])), (step, remaining)
