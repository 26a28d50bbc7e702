"""Tests from a mutation hunt over ``minivllm/server`` (protocol, door, async engine, HTTP handlers): each pins a
behaviour that a planted one-line bug changed while every server test file then in the suite still passed.

Nothing loads a model: one server runs the real engine on the simulated executor behind the real HTTP stack, with
a word tokenizer whose chat template writes each message's words.  Oracles are the OpenAI API's documented
semantics (a field asks for something, or it does not; a bad type is a 400) and hand counts of tokens.
"""

from __future__ import annotations

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from tests.test_server_sim import _Served  # noqa: E402
from tests.test_serving_boundary_hunt import _ChatWords  # noqa: E402

MAX_LEN = 64


@pytest.fixture(scope="module")
def srv():
    """A served engine of ``MAX_LEN`` tokens; a word is one token, so prompts are counted by hand."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=MAX_LEN, max_num_seqs=8, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_ChatWords(), model_max_len=MAX_LEN,
                       eos_token_ids=set())
    with _Served(engine) as served:
        yield served
    assert engine.stats()["used_blocks"] == 0


def _post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.base + path, json=body, timeout=30)


def test_the_test_server_serves_the_plain_requests_the_refusals_below_differ_from(srv):
    """The control for every refusal here: without the refused field, the same completion and chat bodies are
    served (so a 400 below is about that field alone)."""
    r = _post(srv, "/v1/completions", {"prompt": "w11 w12", "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": "w11 w12"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                                 "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("path, extra, param", [
    # OpenAI's ``suffix`` asks for text inserted *before* it (fill in the middle): a plain continuation ignores it.
    # Kills: protocol.py ``CompletionRequest.unsupported`` no longer refusing ``suffix``.
    ("/v1/completions", {"suffix": " w99"}, "suffix"),
    # ``tool_choice: "required"`` asks that the reply call a tool; minivllm never calls one, so a plain text reply
    # breaks the request's contract.  Kills: ``"required"`` added to the tool_choice values that ask for nothing.
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    # vLLM's chat ``echo`` prefixes the reply with the last message; ignored, the client gets a reply without it.
    # Kills: ``echo`` dropped from ChatCompletionRequest.unsupported's list of asked-for flags.
    ("/v1/chat/completions", {"echo": True}, "echo"),
])
def test_a_field_asking_for_what_minivllm_cannot_do_is_a_400_naming_it(srv, path, extra, param):
    """The protocol module's promise: a field whose value minivllm cannot honour is refused with a 400 naming it,
    never silently dropped (the client would take the reply for what it asked).  Oracle: the OpenAI and vLLM
    documentation of each field's meaning."""
    base = ({"prompt": "w11 w12", "max_tokens": 2} if path == "/v1/completions"
            else {"messages": [{"role": "user", "content": "w11 w12"}], "max_tokens": 2})
    r = _post(srv, path, {**base, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("value", ["true", 1])
def test_stream_must_be_a_json_boolean(srv, value):
    """``stream`` is typed strictly like the counts: ``"true"`` or ``1`` is a 400 naming ``stream``, not a guess at
    what the client meant (lax parsing turned ``"true"`` into a stream for a client that would then read the SSE
    body as JSON).  Oracle: the OpenAI API reference's type, boolean.  Kills: ``stream: Optional[bool]`` for
    ``Optional[StrictBool]``."""
    r = _post(srv, "/v1/completions", {"prompt": "w11 w12", "max_tokens": 2, "stream": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "stream", r.json()


def test_a_conversation_longer_than_the_context_is_a_400_naming_messages(srv):
    """A chat request has no ``prompt``: a conversation too long for the context is refused naming ``messages``,
    the field the client must shorten (the ``openai`` client surfaces ``param`` as ``BadRequestError.param``).
    Oracle: a hand count -- 70 words plus the template's one generation-prompt word is 71 tokens, past 64.
    Kills: the chat handler's context check naming the completions field ``prompt``."""
    words = " ".join(f"w{10 + i}" for i in range(70))
    r = _post(srv, "/v1/chat/completions", {"messages": [{"role": "user", "content": words}], "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages", r.json()
    assert "71" in r.json()["error"]["message"], r.json()


def test_closing_a_stream_whose_request_already_finished_counts_no_abort():
    """``AsyncEngine.aborted_ids`` / ``num_aborted`` (public on ``BackgroundServer.async_engine``, "for
    inspection") record requests an abort actually cut short; the tests that check a disconnect aborted its request
    read them.  A consumer that leaves after its request finished but before reading the last output (a client
    gone in the last step) posts an abort the engine no longer has anything for: nothing was cut short, so nothing
    is recorded.  Oracle: the engine's own word -- the request ran its 3 tokens to ``finish_reason == "length"``
    before the close.  Kills: ``_abort_one`` recording the abort whether or not the engine found the request."""
    import asyncio

    from minivllm.sampling_params import SamplingParams
    from minivllm.server.async_engine import AsyncEngine

    cfg = EngineConfig(num_gpu_blocks_override=16, block_size=4, max_model_len=MAX_LEN, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_ChatWords(), model_max_len=MAX_LEN,
                       eos_token_ids=set())

    async def main():
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            stream = await runner.add_request({"prompt_token_ids": [11, 12]}, SamplingParams(max_tokens=3), "r1")
            for _ in range(1000):  # until the loop thread has delivered the final output (and forgotten the stream)
                if "r1" not in runner._streams and not engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the request never finished")
            stream.close()  # the final output is still unread: the stream does not know it finished
            assert await asyncio.to_thread(runner.wait_idle, 5)
            await asyncio.to_thread(runner.shutdown)  # commands run in order: the posted abort has run by now
            outs = []
            while not stream.queue.empty():
                outs.append(stream.queue.get_nowait())
            return runner, outs
        finally:
            await asyncio.to_thread(runner.shutdown)

    runner, outs = asyncio.run(main())
    assert outs and outs[-1].finished and outs[-1].outputs[0].finish_reason == "length", outs
    assert len(outs[-1].outputs[0].token_ids) == 3
    assert runner.num_aborted == 0 and list(runner.aborted_ids) == []
    assert engine.stats()["used_blocks"] == 0
