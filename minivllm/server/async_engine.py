"""The engine behind an asyncio server: one loop thread, one queue per request.

:class:`AsyncEngine` owns a :class:`~minivllm.engine.llm_engine.LLMEngine` and
runs its serving loop in ONE background thread.  While it runs, that thread is
the only one that changes the engine (others only read it: the door's snapshot,
the tokenizer off the event loop, ``stats()`` once the loop has stopped; once it
has stopped, a command posted later runs on the poster's thread): adding a
request, aborting one and shutting down are *commands* the event loop posts to
it (a thread-safe queue), run between two steps.  So the event loop never waits on the engine's lock (a step can take
tens of milliseconds on a CPU), ``engine.stats()`` is never read in the middle
of a step, and no request blocks another.  (The door's count may wait for one add command to finish moving its
request into the queue: :meth:`AsyncEngine.waiting_or_posted`.)

After each ``engine.step()`` the thread hands every ``RequestOutput`` to the
per-request :class:`asyncio.Queue` of its owner with
``loop.call_soon_threadsafe`` and records the step in the Prometheus metrics.
A consumer that goes away (a client disconnects) calls
:meth:`RequestStream.close`, which posts an abort: the request's blocks go back
before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from typing import Any, Callable

from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

log = logging.getLogger("minivllm.server")


class EngineShutdown(Exception):
    """The server is shutting down: the request was aborted."""


class EngineDead(Exception):
    """The engine loop failed; the request cannot complete."""


class RequestStream:
    """What a handler reads: the outputs of one request, in order, as they are produced."""

    def __init__(self, owner: "AsyncEngine", request_id: str, tenant: str, num_seqs: int = 1) -> None:
        self.owner = owner
        self.request_id = request_id
        self.tenant = tenant
        self.num_seqs = num_seqs  # the sequences it adds to the engine's queue (its ``n``): what the door counts
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.closed = False

    async def get(self) -> RequestOutput:
        """The next output; raises :class:`EngineShutdown` / :class:`EngineDead` if the request cannot go on."""
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()

    def close(self) -> None:
        """The consumer is done: abort the request if it is still running (idempotent, never blocks)."""
        if self.closed:
            return
        self.closed = True
        if not self.finished:
            self.owner.abort(self.request_id)
        else:
            self.owner._streams.pop(self.request_id, None)


class AsyncEngine:
    """Runs ``engine`` in one background thread; ``await add_request(...)`` returns a :class:`RequestStream`.

    An idle loop waits for a command at most ``idle_poll_s`` seconds, not for ever: an engine closed by another
    thread (``LLM.close()``) posts no command, and the loop must notice it to fail the streams still waiting, and
    keep an idle server's metrics in step with the engine.
    """

    def __init__(self, engine, metrics=None, idle_poll_s: float = 0.25) -> None:
        self.engine = engine
        self.metrics = metrics
        self.idle_poll_s = idle_poll_s
        self._cmds: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._adding: set[RequestStream] = set()  # posted adds not yet run (:meth:`waiting_or_posted`)
        self._moving = threading.Lock()  # held while a request moves from ``_adding`` to the scheduler's queue
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._drained = False  # set when the loop thread has stopped and emptied its queue
        self.shutting_down = False
        self.dead: BaseException | None = None
        self.num_aborted = 0
        self.aborted_ids: deque[str] = deque(maxlen=10_000)  # recent aborts, for tests and debugging
        self.num_steps = 0

    # -- lifecycle --------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the loop thread; outputs are delivered on ``loop`` (default: the running loop)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()

        def run_loop() -> None:
            self._thread = threading.Thread(target=self._run, name="minivllm-engine-loop", daemon=True)
            self._thread.start()

        self.engine.claim_driver(self, run_loop)  # RuntimeError if another server's loop steps this engine

    def waiting_or_posted(self) -> int:
        """The scheduler's queue plus the requests posted by :meth:`add_request` that the loop thread has not queued
        in the engine yet: the count the door compares with ``max_waiting``.  Counted in sequences, the queue's own
        unit: a request asking for ``n`` choices is ``n`` whether it is posted or queued (posted, it counted 1, and
        the same request read 4 once it reached the queue).

        Without the posted ones a burst would all see the queue as it was before it.  A request must be in exactly
        one of the two: the add command queues it and drops it from the posted set while holding ``_moving``, and
        this reads both under the same lock.  Dropped only after the engine queued it, without the lock, it was
        counted twice meanwhile (the add command also tracks its metrics and wakes the event loop in between, so
        the event loop could run a door check right then), and part of a burst that fitted ``max_waiting`` was
        shed; dropped only once the event loop heard back, that while was longer still.  The lock is held for the
        engine's ``add_request`` and two ``len`` calls, never for a step, so the door does not wait on one.
        """
        with self._moving:
            return len(self.engine.scheduler.waiting) + sum(s.num_seqs for s in self._adding)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def begin_shutdown(self) -> None:
        """Refuse new requests and abort every one in flight (their streams end).  Thread-safe, never blocks."""
        if self.shutting_down:
            return
        self.shutting_down = True
        self._post(self._abort_all)

    def shutdown(self, timeout: float = 10.0) -> None:
        """:meth:`begin_shutdown`, then stop the loop thread and wait for it (blocking)."""
        self.begin_shutdown()

        def stop() -> None:
            self._stop = True

        self._post(stop)
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            # the thread is gone (or never started): abort anything left, on this thread
            for rid in list(self._streams):
                self._abort_one(rid, EngineShutdown("the server is shutting down"))

    # -- the event loop's side ---------------------------------------------------
    async def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str, tenant: str = "default"
    ) -> RequestStream:
        """Queue a request (validated by the engine: bad input raises ``ValueError``)."""
        if self.shutting_down:
            raise EngineShutdown("the server is shutting down")
        if self.dead is not None or self._thread is None:
            raise EngineDead("the engine loop is not running")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, tenant, params.n)
        done: asyncio.Future = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if not done.done():
                done.set_exception(exc) if exc is not None else done.set_result(None)

        def add() -> None:
            try:
                queue_it()
            finally:
                with self._moving:  # (the door sums over the set under this lock: it must not shrink mid-sum)
                    self._adding.discard(stream)

        def queue_it() -> None:
            if self.shutting_down:
                loop.call_soon_threadsafe(settle, EngineShutdown("the server is shutting down"))
                return
            if self.dead is not None:  # run by the dead loop's final drain: nobody will ever step it
                loop.call_soon_threadsafe(settle, EngineDead("the engine loop is not running"))
                return
            self._streams[request_id] = stream  # before the add: the first step may already answer
            try:
                with self._moving:  # from posted to queued in one move, as the door reads them (waiting_or_posted)
                    self.engine.add_request(prompt, params, request_id, tenant=tenant)
                    self._adding.discard(stream)
            except Exception as exc:  # noqa: BLE001 - ValueError is the caller's fault; others go back too
                self._streams.pop(request_id, None)
                # closed by another thread (LLM.close()) before this loop saw it: a 503, not the engine's 500
                err = EngineDead("the engine was closed while the server was running") if self.engine.closed else exc
                loop.call_soon_threadsafe(settle, err)
                return
            if self.metrics is not None:
                self.metrics.track(request_id, tenant)
            loop.call_soon_threadsafe(settle, None)

        self._adding.add(stream)
        self._post(add)
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)  # commands run in order: this abort follows the add
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread (posted to the loop thread; never blocks)."""
        self._post(lambda: self._abort_one(request_id, None))

    def _post(self, cmd: Callable[[], None]) -> None:
        self._cmds.put(cmd)
        if self._drained:  # the loop thread has stopped and drained its queue: nobody else will run this
            self._drain()

    def _drain(self) -> None:
        """Run every queued command (each once: the queue hands it to one caller) on the calling thread."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            try:
                cmd()
            except Exception:  # noqa: BLE001
                log.exception("a command failed after the engine loop stopped")

    # -- the loop thread ------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                busy = engine.has_unfinished_requests()
                try:
                    cmd = self._cmds.get_nowait() if busy else self._cmds.get(timeout=self.idle_poll_s)
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    cmd()
                    try:
                        cmd = self._cmds.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self._stop:
                    break
                if engine.closed:
                    # Closed under the server (``LLM.close()``, a ``with`` block's exit): it aborted every request,
                    # so no output will ever reach these streams, and their clients would wait for ever.
                    self.dead = RuntimeError("the engine was closed")
                    for rid in list(self._streams):
                        self._abort_one(rid, EngineDead("the engine was closed while the server was running"))
                    break
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except RuntimeError:
                        if not engine.closed:
                            raise
                        continue  # closed by another thread since the check above: the next pass ends the streams
                    self.num_steps += 1
                    self._deliver(outputs)
                elif self.metrics is not None:
                    # idle: an abort of the last request (its client left) has no step after it to sync, and
                    # ``metrics`` read directly, not through a /metrics scrape (which syncs itself), would keep
                    # showing it running with its blocks held
                    self.metrics.sync(engine.stats())
        except BaseException as exc:  # noqa: BLE001 - a bug in the engine: fail every request, keep the process up
            log.exception("the engine loop failed")
            self.dead = exc
            for rid in list(self._streams):
                self._abort_one(rid, EngineDead(f"the engine loop failed: {type(exc).__name__}: {exc}"))
        finally:
            # anything posted after the loop stopped still gets an answer: what is queued now runs here, and
            # once _drained is set a poster runs its own command (then drains again, for one that slipped
            # in between this drain and the flag)
            self._drain()
            self._drained = True
            self._drain()
            engine.release_driver(self)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its stream on the event loop (``call_soon_threadsafe``: this runs on the loop
        thread and an :class:`asyncio.Queue` is not thread-safe); a finished request's stream leaves the table
        here, where its last output is known."""
        metrics = self.metrics
        if metrics is not None:
            metrics.observe_step(self.engine)
        loop = self._loop
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if metrics is not None:
                metrics.observe_output(out, stream.tenant if stream else None)
            if stream is None:
                continue
            if out.finished:
                self._streams.pop(out.request_id, None)
            loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _abort_one(self, request_id: str, exc: BaseException | None) -> None:
        stream = self._streams.pop(request_id, None)
        so_far = self.engine.tokens_so_far(request_id)  # before the abort lets the request go
        try:
            found = self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - a closed engine, say: nothing more to free
            found = False
        if found:
            self.num_aborted += 1
            self.aborted_ids.append(request_id)
            if self.metrics is not None:  # a dead loop failed the request: an error, not a caller's abort
                self.metrics.observe_abort(request_id, "error" if isinstance(exc, EngineDead) else "abort", so_far)
        if stream is not None and exc is not None and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            except RuntimeError:  # the event loop closed meanwhile
                pass

    def _abort_all(self) -> None:
        for rid in list(self._streams):
            self._abort_one(rid, EngineShutdown("the server is shutting down"))

    # -- introspection (runs on the loop thread, so it never sees a half-done step) ---
    async def stats(self) -> dict:
        """``engine.stats()``, read between two steps."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def read() -> None:
            try:
                value = self.engine.stats()
            except Exception as exc:  # noqa: BLE001
                # bound now: Python unbinds ``exc`` when the except block ends, before the loop runs the callback
                loop.call_soon_threadsafe(lambda err=exc: fut.done() or fut.set_exception(err))
                return
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(value))

        if not self.is_running:
            return self.engine.stats()
        self._post(read)
        return await fut

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until no request is in the engine (for tests and graceful drains)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self._streams and not self.engine.has_unfinished_requests():
                return True
            time.sleep(0.02)
        return False
