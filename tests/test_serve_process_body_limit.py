"""``minivllm serve --max-request-bytes`` checked through a real server process, over real HTTP.

Why a process: the limit is tested on ``BackgroundServer`` and the flag's parsing with a stand-in engine, but
nothing started ``python -m minivllm serve`` itself, so a break between the two (``body_limit``'s value not reaching
``build_app``, ``off`` read as "derive one", the flag parsed but dropped) passed every test.  Oracles: the limit
typed on the command line (a body one byte past it is a 413 naming it, one at it is served), the engine's own
bound when the flag is ``off`` (``default_max_body_bytes``: 1 MiB + 12 bytes x twice the longest vocabulary entry
x ``max_model_len``, computed here by hand), and argparse's documented refusal (exit status 2, one line naming the
flag) for a value that is no byte count.

Both servers load the bundled model, so the tests that talk to them are ``slow``; they start side by side, once
for the module, and are stopped whatever the tests do.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import minivllm

LIMIT = 4096
MAX_MODEL_LEN = 256
NUM_BLOCKS = 32
MODEL = "tiny"
ROOT = Path(minivllm.__file__).parent.parent  # run this checkout's package, not an installed one
HEADERS = {"Content-Type": "application/json"}
START_TIMEOUT_S = 300  # a guard against a server that never comes up, not a timing check


def _free_ports(n: int) -> list[int]:
    """``n`` ports free now and distinct: each socket stays bound until all are picked, since the kernel may hand a
    port just released to the next ``bind(0)``, and two servers told the same port leave one of them dead."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


if sys.platform.startswith("linux"):
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child after fork only calls it

    def _die_with_the_test() -> None:
        """In the child, before exec: Linux sends it SIGTERM when the test process dies.  A CI job cancelled or
        timed out kills pytest without running the fixture's teardown, and the servers lived on, each holding
        its port and a loaded model."""
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
else:
    _die_with_the_test = None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MINIVLLM_API_KEYS", None)  # one tenant, no auth: the requests below carry no key
    env.setdefault("OMP_NUM_THREADS", "1")  # two servers share the machine's cores with the test process
    return env


class _Server:
    """One ``python -m minivllm serve`` process; its output goes to a file (a full pipe would block it)."""

    def __init__(self, max_request_bytes: str, port: int, log: Path) -> None:
        self.port = port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "minivllm", "serve", "--port", str(self.port), "--served-model-name", MODEL,
                "--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", str(NUM_BLOCKS),
                "--max-request-bytes", max_request_bytes, "--log-level", "warning"]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_the_test)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"no /health within {START_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # what Ctrl-C sends: the server drains and exits
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """``{"4096": server, "off": server}``, started together (each load takes most of the module's time)."""
    logs = tmp_path_factory.mktemp("serve")
    started: dict[str, _Server] = {}
    try:
        for setting, port in zip((str(LIMIT), "off"), _free_ports(2)):
            started[setting] = _Server(setting, port, logs / f"{setting}.log")
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in started.values():
            server.wait_ready(deadline)
        yield started
    finally:
        for server in started.values():
            server.stop()


def _body(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes: a short prompt that fits, padded with the whitespace
    JSON allows before its closing brace, so only its length can be the reason for a refusal."""
    body = json.dumps({"model": MODEL, "prompt": "The capital of France is", "max_tokens": 2}).encode()
    assert len(body) <= size
    return body[:-1] + b" " * (size - len(body)) + b"}"


def _chunked(body: bytes):
    """The body as a generator: httpx then sends it chunked, with no Content-Length for the server to judge."""
    for i in range(0, len(body), 1000):
        yield body[i:i + 1000]


def _assert_refused(r: httpx.Response) -> None:
    assert r.status_code == 413, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and f"at most {LIMIT} " in err["message"], err


def _gauge(base_url: str, name: str) -> float:
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not on /metrics")


@pytest.mark.slow
def test_a_body_past_the_typed_limit_is_a_413_naming_it_and_the_server_keeps_serving(servers):
    openai = pytest.importorskip("openai")
    server = servers[str(LIMIT)]
    url = server.base_url + "/v1/completions"

    assert httpx.post(url, content=_body(LIMIT), headers=HEADERS, timeout=60).status_code == 200  # at it: served
    over = _body(5000)
    _assert_refused(httpx.post(url, content=over, headers=HEADERS, timeout=60))  # Content-Length says 5000
    chunked = httpx.post(url, content=_chunked(over), headers=HEADERS, timeout=60)
    assert "content-length" not in chunked.request.headers  # (the case where the server counts what arrives)
    _assert_refused(chunked)
    _assert_refused(httpx.post(url, content=_body(LIMIT + 1), headers=HEADERS, timeout=60))  # one byte past it

    # what an application sees through the official client: the status, and a message naming the limit
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model=MODEL, prompt="word " * 1000, max_tokens=2)
    assert exc.value.status_code == 413 and f"at most {LIMIT} " in str(exc.value), exc.value

    # refused requests left nothing behind: the next one is served, and once idle no KV block is held
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 3
    deadline = time.monotonic() + 30  # the gauge is read at scrape time; the wait only guards a hang
    while _gauge(server.base_url, "vllm:kv_cache_used_blocks") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gauge(server.base_url, "vllm:kv_cache_used_blocks") == 0
    assert _gauge(server.base_url, "vllm:kv_cache_free_blocks") == NUM_BLOCKS


@pytest.mark.slow
def test_off_serves_the_same_body_and_one_past_the_limit_the_engine_would_derive(servers, tokenizer):
    url = servers["off"].base_url + "/v1/completions"
    over = _body(5000)
    for content in (over, _chunked(over)):
        r = httpx.post(url, content=content, headers=HEADERS, timeout=60)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 2

    # 'off' is no limit, not the derived one: a body one byte past that bound (by hand, from the vocabulary) is served
    derived = (1 << 20) + 12 * 2 * max(map(len, tokenizer.get_vocab())) * MAX_MODEL_LEN
    r = httpx.post(url, content=_body(derived + 1), headers=HEADERS, timeout=60)
    assert r.status_code == 200, r.text[:300]


@pytest.mark.parametrize("value", ["-3", "12XB"])
def test_a_value_that_is_no_byte_count_stops_the_command_before_anything_loads(value):
    """argparse's refusal: exit status 2 and one ``error: argument --max-request-bytes`` line, no traceback, and
    nothing before argparse's usage line (a model load writes its progress first).  The timeout only guards a
    server that started."""
    r = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--max-request-bytes", value], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"error: argument --max-request-bytes: must be a whole number of bytes >= 1 or 'off', got {value!r}" \
        in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("usage: minivllm serve") and "Traceback" not in r.stderr and not r.stdout
