"""Closing an engine that a server's loop is stepping ends the server's streams; it does not strand them.

``LLM.close()`` aborts everything in flight.  An ``LLM.stream`` or ``generate`` caller notices (its router sees
its request gone and raises "the engine was closed"), but a server's :class:`AsyncEngine` stream only ever
hears from the loop thread: after the close the engine holds no work, the loop idles, and the client's
request -- and its HTTP connection -- waited for ever.  (``with LLM(...) as llm:`` around a
``BackgroundServer(llm.engine)`` that is not stopped first closes it so.)  The oracle is the stream's own
contract: it ends with an error the handler maps to a 503, and the engine holds nothing afterwards.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from minivllm import LLM, SamplingParams
from minivllm.server.async_engine import AsyncEngine, EngineDead
from minivllm.sim import SimulatedExecutor

GUARD_S = 10  # only a hang guard: every wait below ends on an event the code under test must cause


async def running_stream(runner: AsyncEngine):
    """Request "a" (80 tokens, streamed as deltas) added to ``runner``, returned once its first output arrived:
    a request the engine is still running, for a close or an abort to land on."""
    stream = await runner.add_request({"prompt_token_ids": [1, 2, 3]},
                                      SamplingParams(max_tokens=80, ignore_eos=True, output_kind="delta"), "a")
    first = await asyncio.wait_for(stream.get(), GUARD_S)
    assert not first.finished
    return stream


class _HeldAtSecondStep(SimulatedExecutor):
    """Holds the loop's second step until the test has queued the close: the close lands while the request
    is still running, however fast the simulated steps are."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.gate = threading.Event()

    def execute(self, batch):
        self.calls += 1
        if self.calls == 2:
            self.gate.wait(GUARD_S)
        return super().execute(batch)


def test_closing_the_llm_under_a_running_server_ends_its_open_streams_with_engine_dead():
    executor = _HeldAtSecondStep()
    llm = LLM(executor=executor, tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    llm.engine.eos_token_ids = set()

    async def main() -> None:
        runner = AsyncEngine(llm.engine, idle_poll_s=0.01)
        runner.start()
        try:
            stream = await running_stream(runner)
            runner._post(llm.close)  # another thread's close runs between two steps, as this does
            executor.gate.set()
            outs = []
            with pytest.raises(EngineDead, match="closed"):
                while True:  # it used to wait here for ever: the closed engine reported nothing more
                    outs.append(await asyncio.wait_for(stream.get(), GUARD_S))
            assert not any(o.finished for o in outs)
            with pytest.raises(EngineDead):  # a closed engine serves no one: a 503, not a 500 from the engine
                await runner.add_request({"prompt_token_ids": [4]}, SamplingParams(max_tokens=2), "b")
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())
    assert not llm.engine.requests and llm.engine.pool.num_free == llm.engine.pool.num_blocks
