"""A streamed request the engine fails after its stream began: what the official ``openai`` client sees.

A stream answers 200 with its first output, so a failure later cannot be a status code.  The server used to
send the failing choice with ``finish_reason: "error"`` and then ``[DONE]``: the ``openai`` client yielded that
chunk without a word and the reason (the engine's ``error``) was lost, while the same failure on a
non-streamed request is a 500 carrying it.  Now the stream ends with an error event, which the client raises
as ``APIError``.  The oracle is the executor's own exception message, raised at a step the test chooses.
Runs on the simulated executor (no model).
"""

from __future__ import annotations

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
