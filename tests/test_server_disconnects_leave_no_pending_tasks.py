"""Clients that leave a non-streamed request leave nothing behind on the server: no pending task, no KV block.

Why: a mutation pass over ``api_server.py`` found that no test noticed ``_unless_disconnected`` no longer
cancelling its waiting task when the client went away.  The request was still aborted (its blocks came back),
but the task that awaited its final output waited for ever on a queue nobody would fill again: one pending
task (with its request's stream and queue) per disconnect, kept until a full garbage collection happens to find
its reference cycle and destroys it still pending.  The test turns the collector off while it counts, so that
the count does not depend on when the collector runs.

Oracles: ``asyncio.all_tasks`` of the server's own event loop, read on that loop, before and after (it counts
every task, whoever made it), and the engine's KV pool (its free count before any request).  The clients are raw
sockets that send a whole request and close only once every request runs and holds blocks, so each disconnect
surely comes while its handler is waiting for the output.
"""

from __future__ import annotations

import asyncio
import gc
import json
import socket
import time

import pytest

pytest.importorskip("uvicorn")

from tests.test_server_sim import _paced_engine, _Served  # noqa: E402

N = 20
GUARD_S = 20  # only a hang guard for a loaded 2-core box: each wait ends on the state it waits for


def _pending_tasks(loop: asyncio.AbstractEventLoop) -> int:
    """The number of unfinished tasks on ``loop``, counted on the loop itself (its task set is not thread-safe)."""
    async def count() -> int:
        return sum(not t.done() for t in asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), loop).result(GUARD_S)


def _wait_for(cond, what: str) -> None:
    end = time.monotonic() + GUARD_S
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_disconnected_non_streamed_requests_leave_no_pending_task_and_free_their_blocks():
    """``N`` non-streamed completions (200 tokens each: seconds of paced steps) run and hold blocks; then every
    client closes its socket.  Every request must be aborted, the pool's free count must return to its start,
    and the loop's pending tasks to their count before the first connection."""
    engine = _paced_engine(fixed_overhead_s=0.01, per_token_s=0.0, per_context_token_s=0.0, wall_factor=2.0)
    free_at_start = engine.stats()["free_blocks"]
    body = json.dumps({"model": "sim", "prompt": list(range(10, 26)), "max_tokens": 200,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    was_enabled = gc.isenabled()
    gc.disable()  # a leaked task sits in a reference cycle: a collection would hide it from all_tasks
    try:
        with _Served(engine) as srv:
            loop = srv.async_engine._loop
            port = int(srv.base.rsplit(":", 1)[1])
            tasks_at_start = _pending_tasks(loop)
            clients = []
            for _ in range(N):
                s = socket.create_connection(("127.0.0.1", port), timeout=GUARD_S)
                s.sendall(head + body)
                clients.append(s)
            _wait_for(lambda: engine.stats()["num_running"] == N, f"{N} running requests")
            assert engine.stats()["free_blocks"] < free_at_start
            for s in clients:
                s.close()
            _wait_for(lambda: srv.async_engine.num_aborted == N and not engine.requests, f"{N} aborts")
            assert engine.stats()["free_blocks"] == free_at_start
            end = time.monotonic() + GUARD_S  # uvicorn's per-connection tasks end a moment after the sockets
            while (pending := _pending_tasks(loop)) > tasks_at_start and time.monotonic() < end:
                time.sleep(0.02)
            assert pending == tasks_at_start, f"{pending - tasks_at_start} tasks still pending after {N} disconnects"
    finally:
        if was_enabled:
            gc.enable()
