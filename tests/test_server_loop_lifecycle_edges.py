"""The server's engine loop (:class:`~minivllm.server.async_engine.AsyncEngine`) and the notebook server
(:class:`~minivllm.server.BackgroundServer`) at the edges of their lives.

Written from a mutation pass over ``async_engine.py`` and ``background.py``: each test names the mutant it kills.  No model:
the real engine on the virtual-clock executor, driven from ``asyncio.run`` (two tests bind a local socket).  Every wait is guarded by
``GUARD_S``, which is only a hang guard; each test ends on an event the code under test must cause.

Oracles: the module's own promises (ONE loop thread; a request that cannot go on gets ``EngineDead`` /
``EngineShutdown`` instead of a silent wait; ``wait_idle`` is True once no request is in the engine) and the
engine's own block accounting and clock.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from minivllm.sampling_params import SamplingParams
from minivllm.server.async_engine import AsyncEngine, EngineDead, EngineShutdown
from minivllm.sim.executor import SimulatedExecutor
from tests.test_engine_mutants import PROMPT, _engine

GUARD_S = 5


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "minivllm-engine-loop" and t.is_alive()]


def test_a_request_sent_before_the_loop_starts_is_refused_not_left_waiting():
    """Kills: ``add_request`` checking only ``dead`` and not whether the loop thread was ever started.  The add is
    a command for the loop thread; with no thread nothing ever runs it, and the caller (a handler, a lab cell that
    built the app but not its lifespan) waits for ever.  Oracle: ``EngineDead`` at once, and the engine never saw
    the request."""
    engine = _engine()

    async def main() -> None:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        with pytest.raises(EngineDead):
            await asyncio.wait_for(runner.add_request(PROMPT, SamplingParams(max_tokens=4), "early"), GUARD_S)

    asyncio.run(main())
    assert not engine.requests and not engine.has_unfinished_requests()


def test_a_request_the_engine_refuses_leaves_no_stream_behind():
    """Kills: the add command keeping the request's stream registered when ``engine.add_request`` raised.  The
    caller gets the ``ValueError`` (a 400), but a stream left in the loop's table is a request the server still
    thinks is in flight: ``wait_idle`` (the graceful drain's test) never comes true, and every refused request
    leaks one for the server's life.  Oracle: the engine holds nothing, so ``wait_idle`` is True."""
    engine = _engine()
    too_long = {"prompt_token_ids": list(range(200))}  # max_model_len is 96: the engine refuses it

    async def main() -> bool:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            for i in range(3):
                with pytest.raises(ValueError):
                    await asyncio.wait_for(runner.add_request(too_long, SamplingParams(max_tokens=4), f"bad{i}"),
                                           GUARD_S)
            return await asyncio.to_thread(runner.wait_idle, 2.0)
        finally:
            await asyncio.to_thread(runner.shutdown)

    idle = asyncio.run(main())
    assert not engine.has_unfinished_requests() and engine.stats()["used_blocks"] == 0  # the oracle's side
    assert idle, "refused requests still count as in flight"


def test_starting_twice_keeps_one_loop_thread():
    """Kills: ``start`` without its already-started guard.  The module's design is ONE thread that changes the
    engine; a second ``start`` (a lifespan entered twice, a notebook cell run again) started a second thread
    stepping the same engine, so two steps could run at once.  Oracle: one live ``minivllm-engine-loop``
    thread, and a request still completes with all its tokens."""
    engine = _engine()
    before = len(_loop_threads())

    async def main() -> int:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        runner.start()
        try:
            threads = len(_loop_threads()) - before
            stream = await runner.add_request(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), "r")
            outs = [out async for out in stream]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
            return threads
        finally:
            await asyncio.to_thread(runner.shutdown)

    assert asyncio.run(main()) == 1


def test_a_request_queued_in_the_engine_before_the_server_started_does_not_kill_the_loop():
    """Kills: ``_deliver`` handing an output to a stream that does not exist.  A request added to the engine
    directly before the server started (a lab queues work, then serves the same engine) has outputs but no
    stream; handing one to ``None`` raised inside the loop thread, which then failed every request the server
    had and refused every later one with a 503.  Oracle: the engine runs the queued request to its end and the
    server's own request gets all its tokens."""
    engine = _engine()
    engine.add_request(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True), "queued-offline")

    async def main() -> int:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            stream = await runner.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), "served")
            outs = await asyncio.wait_for(_read_all(stream), GUARD_S)
            assert outs[-1].finished and runner.dead is None and runner.is_running
            assert await asyncio.to_thread(runner.wait_idle, 2.0)
            return len(outs[-1].outputs[0].token_ids)
        finally:
            await asyncio.to_thread(runner.shutdown)

    assert asyncio.run(main()) == 4
    assert not engine.has_unfinished_requests() and engine.stats()["used_blocks"] == 0


async def _read_all(stream) -> list:
    return [out async for out in stream]


def test_a_busy_loop_steps_without_waiting_out_the_idle_poll():
    """Kills: the loop thread waiting up to ``idle_poll_s`` for a command before *every* step, busy or not.  The
    wait is for an idle engine (nothing to step, so sleep until a command comes); taken while requests run, it
    puts the whole poll interval between two tokens of every stream (0.25 s by default: 4 tokens a second,
    however fast the model).  With a 5 s poll, 12 tokens on the zero-cost simulator must arrive well within
    the 5 s guard.  Oracle: the simulator's steps cost no wall time, so only the loop can make them slow."""
    engine = _engine()

    async def main() -> int:
        runner = AsyncEngine(engine, idle_poll_s=5.0)
        runner.start()
        try:
            stream = await runner.add_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                     output_kind="delta"), "r")

            async def read_all() -> int:
                return sum([len(out.outputs[0].token_ids) async for out in stream])

            return await asyncio.wait_for(read_all(), GUARD_S)
        finally:
            await asyncio.to_thread(runner.shutdown)

    assert asyncio.run(main()) == 12


# uvicorn ends its thread with SystemExit when the bind fails: that exit is the event under test, not a stray error
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_background_server_that_cannot_bind_its_port_fails_at_once():
    """Kills: ``BackgroundServer`` waiting out its whole start timeout when the server thread has already died.
    uvicorn cannot bind a port another socket holds and its thread exits; the constructor must say so then, not
    after ``start_timeout_s`` (30 s by default: a notebook cell that looks hung).  Oracle: the thread is gone
    within a second or two, so the error comes well inside a 20 s timeout."""
    pytest.importorskip("uvicorn")
    from minivllm.server import BackgroundServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="did not start"):
            BackgroundServer(_engine(), "sim", port=taken.getsockname()[1], start_timeout_s=20)
        assert time.monotonic() - t0 < 10


def test_shutdown_returns_only_once_the_loop_thread_has_stopped():
    """Kills: ``shutdown`` not joining the loop thread.  It promises to stop the thread and wait for it: the
    app's lifespan returns on it, and whoever serves the same engine next (a notebook cell run again, an
    offline ``generate`` after ``stop()``) is refused while the old loop still runs.  The loop is held inside a
    command so that it cannot stop at once.  Oracle: ``shutdown`` is still blocked while the loop is held, and
    once it returns the loop no longer runs."""
    engine = _engine()
    gate = threading.Event()

    async def main() -> None:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        runner._post(lambda: gate.wait(GUARD_S))  # the loop thread is busy in this command
        stopper = threading.Thread(target=runner.shutdown)
        stopper.start()
        stopper.join(0.3)
        blocked = stopper.is_alive()
        gate.set()
        stopper.join(GUARD_S)
        assert blocked, "shutdown returned while the loop thread was still running"
        assert not stopper.is_alive() and not runner.is_running

    asyncio.run(main())


class _HoldsItsSecondStep(SimulatedExecutor):
    """Holds the loop's second step (``entered`` set while it waits for ``gate``): whatever the test posts
    meanwhile is queued for the loop thread all at once, however fast the simulated steps are."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.entered, self.gate = threading.Event(), threading.Event()

    def execute(self, batch):
        self.calls += 1
        if self.calls == 2:
            self.entered.set()
            self.gate.wait(GUARD_S)
        return super().execute(batch)


def test_requests_that_arrive_during_a_step_all_start_in_the_next_one():
    """Three requests arrive while a step runs: all three join the very next step, as a burst does in vLLM.
    Kills: the loop thread running one queued command per pass (one add, then a step, then the next add), which
    served a burst of N arrivals over N steps: the k-th waited k-1 steps more for its first token, and an abort
    queued behind them freed its blocks as late.  Oracle: the engine's own clock, one first-token time for the
    three (one step), and each gets all its tokens."""
    executor = _HoldsItsSecondStep()
    engine = _engine(executor)
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def main() -> dict:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            first = await runner.add_request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True), "a")
            assert not (await asyncio.wait_for(first.get(), GUARD_S)).finished
            assert await asyncio.to_thread(executor.entered.wait, GUARD_S), "the second step never ran"
            adds = [asyncio.ensure_future(runner.add_request({"prompt_token_ids": [20 + i, 21, 22]}, params, rid))
                    for i, rid in enumerate("bcd")]
            for _ in range(GUARD_S * 100):  # each add is posted on its task's first run
                if runner._cmds.qsize() == 3:
                    break
                await asyncio.sleep(0.01)
            executor.gate.set()
            finals = {}
            for rid, task in zip("bcd", adds):
                stream = await asyncio.wait_for(task, GUARD_S)
                async for out in stream:
                    finals[rid] = out
            first.close()
            return finals
        finally:
            await asyncio.to_thread(runner.shutdown)

    finals = asyncio.run(main())
    starts = {rid: out.metrics.first_token_time for rid, out in finals.items()}
    assert len(set(starts.values())) == 1, starts
    assert all(len(out.outputs[0].token_ids) == 4 for out in finals.values())
    assert engine.pool.num_free == engine.pool.num_blocks


def test_reading_stats_during_a_long_step_leaves_the_event_loop_free():
    """The module's promise: the event loop never waits on the engine's lock.  ``stats()`` (what a ``/metrics``
    scrape awaits) is read on the loop thread between two steps; the event loop only awaits it.  Kills: ``stats``
    reading ``engine.stats()`` directly while the loop runs: it then blocked the event loop for the rest of the
    step in progress (a step can take tens of milliseconds on a CPU, seconds under load), and with it every
    stream's next token and every other request.  The step is held for 1 s from another thread.  Oracle: a
    ticker task on the event loop keeps ticking while ``stats()`` waits, and the numbers come after the step."""
    executor = _HoldsItsSecondStep()
    engine = _engine(executor)

    async def main() -> tuple[int, dict]:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        try:
            stream = await runner.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), "a")
            assert not (await asyncio.wait_for(stream.get(), GUARD_S)).finished
            assert await asyncio.to_thread(executor.entered.wait, GUARD_S), "the second step never ran"
            threading.Timer(1.0, executor.gate.set).start()
            tick_task = asyncio.ensure_future(ticker())
            stats = await asyncio.wait_for(runner.stats(), GUARD_S)
            tick_task.cancel()
            async for _ in stream:
                pass
            return ticks, stats
        finally:
            await asyncio.to_thread(runner.shutdown)

    ticks, stats = asyncio.run(main())
    assert ticks >= 10, f"the event loop ran {ticks} ticks of 10 ms during a 1 s step"
    assert stats["num_running"] == 1


def test_a_request_whose_add_is_queued_just_after_shutdown_began_is_refused_not_run():
    """Another thread begins the shutdown (``BackgroundServer.stop``, a signal handler) between a handler's
    ``shutting_down`` check and its add command: the shutdown's abort-all is queued first, the add after it.
    Kills: the add command not checking ``shutting_down`` again on the loop thread; the request then joined the
    engine after every request in flight had been aborted, and ran on a server that was leaving (a stream got
    its 200 and tokens, then the cut).  The race is made deterministic by letting the shutdown win it.  Oracle:
    the documented ``EngineShutdown`` (a 503), and the engine holds nothing afterwards."""
    engine = _engine()

    async def main() -> None:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        post = runner._post

        def shutdown_wins_the_race(cmd) -> None:
            runner._post = post
            runner.begin_shutdown()
            post(cmd)

        try:
            runner._post = shutdown_wins_the_race
            with pytest.raises(EngineShutdown):
                await asyncio.wait_for(runner.add_request(PROMPT, SamplingParams(max_tokens=40), "late"), GUARD_S)
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())
    assert not engine.requests and engine.pool.num_free == engine.pool.num_blocks


def test_leaving_a_background_servers_with_block_stops_it_and_frees_its_engine():
    """The module's promise: leaving the ``with`` block shuts the server down and joins its thread.  Kills:
    ``__exit__`` not stopping it; the server then answered on its port after the block, and its loop kept the
    engine claimed, so the notebook's next cell (a new server, an offline ``generate``) was refused.  Oracle: the
    port refuses connections, the thread is gone, and ``check_unserved`` (what a new server asks) passes."""
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from minivllm.server import BackgroundServer

    engine = _engine()
    with BackgroundServer(engine, "sim", start_timeout_s=20) as bg:
        assert httpx.get(bg.base_url + "/health", timeout=30).status_code == 200
    assert not bg.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(bg.base_url + "/health", timeout=5)
    engine.check_unserved()
