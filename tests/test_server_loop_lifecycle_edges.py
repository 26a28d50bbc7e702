"""The server's engine loop (:class:`~minivllm.server.async_engine.AsyncEngine`) and the notebook server
(:class:`~minivllm.server.BackgroundServer`) at the edges of their lives.

Written from a mutation pass over ``async_engine.py`` and ``background.py``: each test names the mutant it kills.  No model:
the real engine on the virtual-clock executor, driven from ``asyncio.run`` (one test binds a local socket).  Every wait is guarded by
``GUARD_S``, which is only a hang guard; each test ends on an event the code under test must cause.

Oracles: the module's own promises (ONE loop thread; a request that cannot go on gets ``EngineDead`` /
``EngineShutdown`` instead of a silent wait; ``wait_idle`` is True once no request is in the engine) and the
engine's own block accounting.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from minivllm.sampling_params import SamplingParams
from minivllm.server.async_engine import AsyncEngine, EngineDead
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
