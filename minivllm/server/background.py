"""A server in a background thread: for notebooks and tests that serve and load-test in one process.

Why a thread and not ``minivllm serve`` in a subprocess?  A notebook that
starts a subprocess must find a free port, wait for the model to load twice
(once there, once for anything it compares locally) and clean up a process
that outlives a crashed cell.  Here the engine the notebook already built is
served as it is: uvicorn runs in a daemon thread on a free port of ``127.0.0.1``
by default (a lab server is not for the network), and :meth:`stop` (or leaving
the ``with`` block) shuts it down gracefully and joins the thread.
"""

from __future__ import annotations

import socket
import threading
import time


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now (another process could take it before we bind; fine for labs)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class BackgroundServer:
    """Serve ``engine`` with :func:`~minivllm.server.build_app` on ``127.0.0.1:<free port>`` in a daemon thread.

    ``base_url`` (``http://127.0.0.1:PORT``) is what an OpenAI client or the
    load generator points at (add ``/v1`` for the ``openai`` client).
    ``async_engine`` and ``metrics`` are the app's, for inspection.
    """

    def __init__(self, engine, model_name: str = "smol", api_keys: dict[str, str] | None = None,
                 host: str = "127.0.0.1", port: int | None = None, start_timeout_s: float = 30.0,
                 door=None, aliases: tuple[str, ...] = ()) -> None:
        import uvicorn

        from minivllm.server.api_server import build_app

        engine.check_unserved()  # a cell run twice: the first server's loop still steps this engine
        self.app = build_app(engine, [model_name, *aliases], api_keys, door=door)  # aliases: more served names
        self.model_name = model_name
        self.async_engine = self.app.state.async_engine
        self.metrics = self.app.state.metrics
        self.port = port or free_port(host)
        self.base_url = f"http://{host}:{self.port}"
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level="warning", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="minivllm-background-server", daemon=True)
        self._thread.start()
        end = time.monotonic() + start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self._server.should_exit = True
                raise RuntimeError(f"the server did not start on {self.base_url}")
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful shutdown (in-flight requests are aborted), then join the thread.

        The engine refuses new work and aborts what is in flight *first*, as ``minivllm serve`` does on
        Ctrl-C: uvicorn alone would wait its 5 s graceful timeout for open requests, then cancel them
        (a waiting client got a 500); aborted first, they end at once (a stream with its error event and
        ``[DONE]``, a non-streamed request with 503).
        """
        self.async_engine.begin_shutdown()
        self._server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
