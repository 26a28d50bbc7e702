"""A streamed request the engine fails after its stream began: what the official ``openai`` client sees.

A stream answers 200 with its first output, so a failure later cannot be a status code.  The server used to
send the failing choice with ``finish_reason: "error"`` and then ``[DONE]``: the ``openai`` client yielded that
chunk without a word and the reason (the engine's ``error``) was lost, while the same failure on a
non-streamed request is a 500 carrying it.  Now the stream ends with an error event, which the client raises
as ``APIError``.  The oracle is the executor's own exception message, raised at a step the test chooses.
The engine loop's own death (a bug in ``engine.step``, past the executor's guard) ends a stream the same way:
an error event coded 503 (``EngineDead``, the request cannot complete), as a waiting non-streamed request gets a 503.
Runs on the simulated executor (no model).
"""

from __future__ import annotations

import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from tests.test_server_sim import _Served, _WordTokenizer  # noqa: E402


class _FailsAtItsFifthDecode(SimulatedExecutor):
    """Fails the step that would give a request its sixth token, once: the stream has sent five by then."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def execute(self, batch):
        if not self.failed and any(len(s.request.output_token_ids) == 5 for s in batch.seqs):
            self.failed = True
            raise RuntimeError("the device fell off the bus")
        return super().execute(batch)


def test_a_stream_the_engine_fails_midway_ends_with_an_error_event_the_client_raises():
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=128, max_num_seqs=4,
                       max_num_batched_tokens=256, device="cpu")
    engine = LLMEngine(cfg, executor=_FailsAtItsFifthDecode(), tokenizer=_WordTokenizer(), model_max_len=128,
                       eos_token_ids=set())
    with _Served(engine) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=60)
        received = []
        with pytest.raises(openai.APIError, match="the device fell off the bus"):
            for chunk in client.completions.create(model="sim", prompt="w10 w11 w12", max_tokens=20, stream=True,
                                                   extra_body={"ignore_eos": True}):
                received.append(chunk.choices[0])
        assert len(engine_tokens(received)) == 5, "the five tokens before the failed step reach the client"
        assert received[-1].finish_reason == "error"
        # the engine keeps serving, and the failed request left no block behind
        ok = client.completions.create(model="sim", prompt="w10 w11", max_tokens=3, extra_body={"ignore_eos": True})
        assert ok.choices[0].finish_reason == "length"
    assert engine.stats()["used_blocks"] == 0


def engine_tokens(received) -> list[int]:
    """The token ids the streamed text names (the word tokenizer writes token ``i`` as ``w<i>``)."""
    return [int(w[1:]) for c in received for w in c.text.split()]


class _StepBug(Exception):
    """A bug in the engine's own step (not the executor's, which the engine reports per request): the loop dies."""


def test_an_engine_loop_failure_ends_every_waiting_caller_with_a_503_and_frees_their_blocks(monkeypatch):
    """The engine loop dies (``engine.step`` itself raises, a bug the executor guard cannot report per request)
    while a plain request waits for its end and a stream is open.  Each caller hears it as an error, none waits:
    the plain request is a 503 (``EngineDead``: the request cannot complete, the server's fault, not a 500's
    "bug in this request"), the stream ends with an error event naming the exception, which the ``openai``
    client raises (its 200 is already out); a request after it is a 503, and the KV pool is whole again.
    Oracles: the exception's own message, the documented 503s, and the pool's free count (back to the count
    before the requests).  Kills: the stream body catching only ``EngineShutdown`` (the loop failure escaped it
    and the stream was cut with neither the error event nor ``[DONE]``: the client saw a dropped connection
    instead of the reason); the plain request's wait catching only ``EngineShutdown`` (a 500); and the loop's
    failure handler not ending the streams it held (both clients waited until their own timeouts)."""

    class Paced(SimulatedExecutor):  # 10 ms a step: the plain request's 120 tokens outlast the stream's arrival
        def execute(self, batch):
            time.sleep(0.01)
            return super().execute(batch)

    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=128, max_num_seqs=4,
                       max_num_batched_tokens=256, device="cpu")
    engine = LLMEngine(cfg, executor=Paced(), tokenizer=_WordTokenizer(), model_max_len=128, eos_token_ids=set())
    free_before = engine.pool.num_free
    real_step = engine.step

    def step():
        if sum(1 for r in engine.scheduler.running if r.output_token_ids) == 2:  # both callers have tokens
            raise _StepBug("a bug in the step")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with _Served(engine) as srv:
        client = openai.OpenAI(base_url=srv.base + "/v1", api_key="x", max_retries=0, timeout=20)
        plain: list[BaseException] = []

        def wait_for_the_end() -> None:
            try:
                client.completions.create(model="sim", prompt="w20 w21", max_tokens=120, extra_body={"ignore_eos": True})
            except openai.APIError as exc:
                plain.append(exc)

        waiter = threading.Thread(target=wait_for_the_end)
        waiter.start()
        for _ in range(2000):
            if engine.scheduler.running:
                break
            time.sleep(0.01)
        received = []
        with pytest.raises(openai.APIError, match="a bug in the step"):
            for chunk in client.completions.create(model="sim", prompt="w10 w11 w12", max_tokens=60, stream=True,
                                                   extra_body={"ignore_eos": True}):
                received.append(chunk.choices[0])
        waiter.join(30)
        assert 0 < len(engine_tokens(received)) < 60
        assert len(plain) == 1 and getattr(plain[0], "status_code", None) == 503, plain
        with pytest.raises(openai.InternalServerError) as late:  # the loop is gone: 503, not a hang
            client.completions.create(model="sim", prompt="w10 w11", max_tokens=3)
        assert late.value.status_code == 503
    assert engine.pool.num_free == free_before and not engine.has_unfinished_requests()
