"""A served engine closed from another thread (``LLM.close()``) answers its clients "the engine is gone", not a crash.

``LLM.close()`` may come from any thread -- a notebook's ``with LLM(...) as llm:`` ending around a
``BackgroundServer(llm.engine)`` that is still up, a second caller shutting the shared engine down.  The server's
loop thread notices the close only between two steps, after it has run the commands queued meanwhile; so a request
that reached the loop in that window (up to a whole ``idle_poll_s`` while the loop idles) met the closed engine's
``RuntimeError`` and the client got a 500 with a traceback in the log, and a close that landed between the loop's
"is there work?" check and its step failed the loop itself ("the engine loop failed", with a traceback).  The
oracle is the server's own contract, already pinned for a close the loop has seen: :class:`EngineDead` (a 503)
naming the close, and an engine that holds nothing afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from minivllm import LLM, SamplingParams
from minivllm.server.async_engine import AsyncEngine, EngineDead
from minivllm.sim import SimulatedExecutor
from tests.test_lifecycle_hunt import running_stream

GUARD_S = 10  # only a hang guard: every wait below ends on an event the code under test must cause


def _llm() -> LLM:
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    llm.engine.eos_token_ids = set()
    return llm


def test_a_request_reaching_the_loop_after_another_thread_closed_the_engine_is_engine_dead_not_a_runtime_error():
    llm = _llm()

    async def main() -> None:
        # A long idle poll: the loop sleeps on its command queue, so the close below is not seen before the add
        # (with the default 0.25 s the same happens to any request sent within a quarter second of the close).
        runner = AsyncEngine(llm.engine, idle_poll_s=GUARD_S)
        runner.start()
        try:
            await asyncio.to_thread(llm.close)  # another thread's close, not a command posted to the loop
            with pytest.raises(EngineDead, match="closed"):  # it used to be the engine's RuntimeError: a 500
                await asyncio.wait_for(runner.add_request({"prompt_token_ids": [1, 2, 3]},
                                                          SamplingParams(max_tokens=2), "a"), GUARD_S)
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())
    assert not llm.engine.requests and llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_a_close_between_the_loops_work_check_and_its_step_ends_the_streams_as_closed_not_as_a_loop_failure(caplog):
    llm = _llm()
    engine = llm.engine
    step, calls = engine.step, []
    armed = threading.Event()

    def closed_just_before_the_step():
        calls.append(1)
        if len(calls) == 2:  # the loop has seen work and is about to step: another thread's close lands now
            armed.wait(GUARD_S)  # (once the test has read the first output: the request is still running)
            closer = threading.Thread(target=llm.close)
            closer.start()
            closer.join(GUARD_S)
        return step()

    engine.step = closed_just_before_the_step

    async def main() -> None:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            stream = await running_stream(runner)
            armed.set()
            with pytest.raises(EngineDead, match="closed") as info:
                while True:
                    await asyncio.wait_for(stream.get(), GUARD_S)
            assert "loop failed" not in str(info.value)  # it used to read "the engine loop failed: RuntimeError"
        finally:
            await asyncio.to_thread(runner.shutdown)

    with caplog.at_level(logging.ERROR, logger="minivllm.server"):
        asyncio.run(main())
    assert not [r for r in caplog.records if "loop failed" in r.getMessage()]  # no traceback for a plain close
    assert not engine.requests and engine.pool.num_free == engine.pool.num_blocks


# ``engine.stats()`` read by another caller while a step runs: a whole snapshot, not a crash.

class _StatsReadMidStep(SimulatedExecutor):
    """At its second step, asks another thread for ``engine.stats()`` and waits until that read has begun (or,
    with the engine lock held by the step, until the short guard passes: a read that waits for the step is right)."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = None
        self.calls = 0
        self.reading = threading.Event()
        self.reader: threading.Thread | None = None
        self.results: list = []

    def execute(self, batch):
        self.calls += 1
        if self.calls == 2:
            def read() -> None:
                try:
                    self.results.append(self.engine.stats())
                except Exception as exc:  # noqa: BLE001 - what the test checks
                    self.results.append(exc)

            self.reader = threading.Thread(target=read)
            self.reader.start()
            self.reading.wait(0.5)
        return super().execute(batch)


def test_stats_read_by_another_thread_during_a_step_waits_for_the_step_and_never_sees_it_half_done():
    """``LLM`` is shared by threads, and ``llm.engine.stats()`` is what a caller reads to watch it; it took no lock,
    so a read from a monitoring thread while another thread's ``generate`` stepped walked the scheduler's dicts
    as the step changed them (``RuntimeError: dictionary changed size during iteration`` in most runs of a
    two-thread loop).  Oracle: the engine's own in-step flag, seen by the read."""
    executor = _StatsReadMidStep()
    llm = LLM(executor=executor, tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    engine = executor.engine = llm.engine
    engine.eos_token_ids = set()
    tenant_stats, seen_in_step = engine.tenant_stats, []

    def tenant_stats_noting_the_step():
        seen_in_step.append(engine._in_step)
        executor.reading.set()
        return tenant_stats()

    engine.tenant_stats = tenant_stats_noting_the_step
    outs = llm.generate([{"prompt_token_ids": [1, 2, 3], "tenant": t} for t in ("a", "b", "c")],
                        SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    executor.reader.join(GUARD_S)
    assert all(o.finished for o in outs)
    assert seen_in_step == [False]  # it used to read the engine in the middle of the step
    [stats] = executor.results
    assert isinstance(stats, dict), stats


# Two servers started at once on one engine: one serves, the other is refused.

def test_a_second_loop_claiming_the_engine_before_the_first_loops_thread_runs_is_refused():
    """A driver counts as serving once its thread runs, and the first loop claimed the engine before it started
    its thread: a second server starting in that gap (two ``BackgroundServer(engine)`` built at once: both
    started in most of 15 tries) claimed it too, and two loops stepped one engine, each dropping the other's
    outputs.  The gap is forced here: the second loop starts right after the first one's claim returns.
    Oracle: the refusal a second server already gets once the first runs (``test_server_sim``)."""
    llm = _llm()
    engine = llm.engine
    first, second = AsyncEngine(engine, idle_poll_s=0.01), AsyncEngine(engine, idle_poll_s=0.01)
    claim, outcome = engine.claim_driver, []

    def second_starts_right_after_a_claim(driver, *args, **kwargs):
        claim(driver, *args, **kwargs)
        if driver is first:
            def start_second() -> None:
                try:
                    second.start(asyncio.new_event_loop())
                    outcome.append("started")
                except RuntimeError as exc:
                    outcome.append(str(exc))

            other = threading.Thread(target=start_second)
            other.start()
            other.join(GUARD_S)

    engine.claim_driver = second_starts_right_after_a_claim
    loop = asyncio.new_event_loop()
    try:
        first.start(loop)
        assert len(outcome) == 1 and "already served" in outcome[0]  # it used to be "started": two loops
        assert engine.served_by() is first
    finally:
        second.shutdown()
        first.shutdown()
        loop.close()
