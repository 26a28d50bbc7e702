"""Tests from a hand mutation pass over the server's boundary (``minivllm/server``) and the load generator's
parsers: each pins a behaviour a planted bug changed while every existing test still passed.

They run the real engine on the simulated executor behind the real HTTP server (no model load), so each takes
a second or two.  Oracles are the OpenAI API's documented semantics and hand counts, and the engine's own block
accounting (``engine.stats()``) for leaks.
"""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.bench.loadgen import iter_sse  # noqa: E402
from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from tests.test_server_sim import _Served, _WordTokenizer  # noqa: E402


def _engine(max_len: int = 64, blocks: int = 64) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_model_len=max_len, max_num_seqs=8,
                       device="cpu")
    return LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_WordTokenizer(), model_max_len=max_len,
                     eos_token_ids=set())


def _events(text: str) -> list:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as the string)."""
    return [data if data == "[DONE]" else json.loads(data) for data in iter_sse(text.splitlines())]


# -- usage with several choices --------------------------------------------------------------------------------


def test_usage_counts_the_completion_tokens_of_every_choice():
    """OpenAI's ``usage.completion_tokens`` is the tokens generated for the whole request: with ``n=3`` and
    ``max_tokens=5`` (EOS ignored) that is 15, in the plain answer and in a stream's usage chunk alike.
    Kills: usage counting only the first choice's tokens (5)."""
    engine = _engine()
    with _Served(engine) as srv:
        body = {"prompt": [11, 12, 13, 14], "max_tokens": 5, "n": 3, "ignore_eos": True, "temperature": 1.0}
        plain = httpx.post(srv.base + "/v1/completions", json=body, timeout=30)
        streamed = httpx.post(srv.base + "/v1/completions", timeout=30,
                              json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert plain.status_code == 200, plain.text
    assert len(plain.json()["choices"]) == 3
    assert plain.json()["usage"]["completion_tokens"] == 15
    assert plain.json()["usage"]["total_tokens"] == 4 + 15
    assert streamed.status_code == 200, streamed.text
    usage = [e["usage"] for e in _events(streamed.text) if isinstance(e, dict) and e.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == 15 and usage[-1]["prompt_tokens"] == 4
    assert engine.stats()["used_blocks"] == 0


# -- validation bounds at their edges --------------------------------------------------------------------------


def test_exactly_the_stop_string_limit_is_served_and_one_more_is_a_400():
    """``MAX_STOP_STRINGS`` (64) stop strings are allowed, 65 are refused naming ``stop``.
    Kills: the bound compared with ``>=`` (a request with exactly the documented maximum refused)."""
    from minivllm.server.protocol import MAX_STOP_STRINGS

    engine = _engine()
    with _Served(engine) as srv:
        def post(k):
            return httpx.post(srv.base + "/v1/completions", timeout=30,
                              json={"prompt": [11, 12], "max_tokens": 3, "stop": [f"zz{i}" for i in range(k)]})
        at, over = post(MAX_STOP_STRINGS), post(MAX_STOP_STRINGS + 1)
    assert at.status_code == 200, at.text
    assert over.status_code == 400 and over.json()["error"]["param"] == "stop"


def test_seed_range_is_the_documented_half_open_int64_range():
    """``seed`` is in ``[0, 2**63)``: the largest int64 is served, ``2**63`` is a 400 naming ``seed``.
    Kills: the upper bound made inclusive."""
    engine = _engine()
    with _Served(engine) as srv:
        def post(seed):
            return httpx.post(srv.base + "/v1/completions", timeout=30,
                              json={"prompt": [11, 12], "max_tokens": 2, "seed": seed})
        top, over = post(2**63 - 1), post(2**63)
    assert top.status_code == 200, top.text
    assert over.status_code == 400 and over.json()["error"]["param"] == "seed"


def test_a_one_string_list_prompt_is_tokenized_like_the_string():
    """OpenAI's ``prompt`` may be a list holding one string; it means that string.  With the word tokenizer
    ``"w11 w12 w13"`` is three tokens.  Kills: only a list of token lists being unwrapped (the string then
    taken as a token id and refused)."""
    engine = _engine()
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30,
                       json={"prompt": ["w11 w12 w13"], "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 3


def test_a_refused_request_does_not_hold_a_place_at_the_door():
    """Requests the engine refuses (a 400) never reach the queue, so they must not count against the door's
    ``max_waiting``: after several bad requests a good one, into an empty queue, is served, not shed with a 429.
    Kills: the door's in-flight count decremented only when the add succeeds."""
    from minivllm.server.door import DoorRule

    engine = _engine(max_len=16)
    with _Served(engine, door=DoorRule(max_waiting=2)) as srv:
        bad = [httpx.post(srv.base + "/v1/completions", timeout=30, json={"prompt": list(range(10, 40)), "max_tokens": 1})
               for _ in range(3)]
        good = httpx.post(srv.base + "/v1/completions", timeout=30, json={"prompt": [11, 12], "max_tokens": 2})
    assert [r.status_code for r in bad] == [400] * 3
    assert good.status_code == 200, good.text
    assert engine.stats()["used_blocks"] == 0


# -- the load generator's workload specs ----------------------------------------------------------------------


def test_uniform_lengths_include_both_bounds_and_a_one_point_range():
    """``uniform:LO:HI`` is inclusive at both ends (a hand check over many draws), and ``uniform:5:5`` is the
    one-point distribution, not an error.  Kills: ``LO < HI`` required; HI never drawn."""
    import numpy as np

    from minivllm.bench import loadgen as lg

    rng = np.random.default_rng(0)
    draws = {lg.LengthDist.parse("uniform:3:5").sample(rng) for _ in range(300)}
    assert draws == {3, 4, 5}
    one = lg.LengthDist.parse("uniform:5:5")
    assert {one.sample(rng) for _ in range(20)} == {5}


def test_length_and_prefix_specs_that_allow_no_token_are_refused():
    """Every length is at least one token: a lognormal capped at 0 could only draw 0 (a request the server
    refuses), and a prefix group of 0 tokens shares nothing.  Both are spec errors at parse time.
    Kills: the cap and the prefix length checked against 0 instead of 1."""
    from minivllm.bench import loadgen as lg

    with pytest.raises(ValueError):
        lg.LengthDist.parse("lognormal:10:1:0")
    assert lg.LengthDist.parse("lognormal:10:1:1").hi == 1
    with pytest.raises(ValueError, match="prefix"):
        lg.parse_tenant("name=a,prefix=sys:0")
    assert lg.parse_tenant("name=a,prefix=sys:1").prefix_len == 1


# -- a streaming client that leaves while its request still waits ---------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_before_its_first_token_is_aborted(stream):
    """A streamed request answers only once its first output exists, a plain one once its last does; a client
    that leaves while the request still waits in the queue must have it aborted then, not run later for nobody
    (its blocks and steps taken from the clients still there).  One seat (``max_num_seqs=1``) held by a slow
    request keeps the other one waiting.  Oracle: the abort log, the engine's block pool, and the seat holder
    still running when the abort lands (the abort came at the disconnect, not once the seat freed).
    Kills: the request stream closed on that early exit only for non-streamed requests; the disconnect watch
    never firing while a handler waits for its output (the streamed request was aborted only at its first
    token, once the holder had finished, and the plain one ran to its end)."""
    import time

    class Paced(SimulatedExecutor):
        def execute(self, batch):
            if batch.seqs:
                time.sleep(0.01)
            return super().execute(batch)

    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=256, max_num_seqs=1, device="cpu")
    engine = LLMEngine(cfg, executor=Paced(), tokenizer=_WordTokenizer(), model_max_len=256, eos_token_ids=set())
    with _Served(engine) as srv:
        runner = srv.bg.async_engine

        async def until(cond, what):
            for _ in range(2000):
                if cond():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"never held: {what}")

        async def main():
            async with httpx.AsyncClient(timeout=60) as holder_client, httpx.AsyncClient(timeout=60) as leaver:
                holder = asyncio.ensure_future(holder_client.post(
                    srv.base + "/v1/completions", json={"prompt": [11, 12], "max_tokens": 150, "ignore_eos": True}))
                await until(lambda: len(engine.scheduler.running) == 1, "the holder has the seat")
                gone = asyncio.ensure_future(leaver.post(
                    srv.base + "/v1/completions",
                    json={"prompt": [21, 22], "max_tokens": 50, "ignore_eos": True, "stream": stream}))
                await until(lambda: len(engine.scheduler.waiting) == 1, "the other request waits")
                gone.cancel()
                await asyncio.gather(gone, return_exceptions=True)
                await until(lambda: len(runner.aborted_ids) == 1, "the waiting request is aborted")
                assert [r.max_tokens for r in list(engine.scheduler.running)] == [150], "aborted only once the seat freed"
                assert not engine.scheduler.waiting
                return await holder

        holder = asyncio.run(main())
        assert holder.status_code == 200 and holder.json()["usage"]["completion_tokens"] == 150
        assert runner.wait_idle(10)
    assert engine.stats()["used_blocks"] == 0


# -- the async engine's bookkeeping -----------------------------------------------------------------------------


def test_a_stream_read_to_its_end_leaves_no_entry_behind_without_close():
    """``close()`` is for a consumer that *leaves*; one that reads its stream to the finished output is done
    too, and the loop thread must forget the request then: otherwise every served request stays in
    ``_streams`` (a leak that grows with traffic) and ``wait_idle`` -- "no request is in the engine" -- never
    holds again.  Oracle: ``wait_idle`` and the engine's block pool.
    Kills: the loop thread not dropping a finished request's stream."""
    from minivllm.sampling_params import SamplingParams
    from minivllm.server.async_engine import AsyncEngine

    engine = _engine()

    async def main() -> list:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            stream = await runner.add_request({"prompt_token_ids": [11, 12, 13]},
                                              SamplingParams(max_tokens=4, ignore_eos=True), "r1")
            outs = [out async for out in stream]
            assert await asyncio.to_thread(runner.wait_idle, 5), "a finished, fully read request is still tracked"
            return outs
        finally:
            await asyncio.to_thread(runner.shutdown)

    outs = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert engine.stats()["used_blocks"] == 0


# -- stream_options.include_usage -------------------------------------------------------------------------------


def test_with_include_usage_every_chunk_carries_usage_null_until_the_usage_chunk(tokenizer):
    """OpenAI's documented ``stream_options.include_usage``: one extra chunk before ``[DONE]`` has the usage and
    empty ``choices``, and "all other chunks will also include a usage field, but with a null value" (clients
    that read ``chunk.usage`` rely on the key).  Checked on both endpoints, hand-counting the tokens.
    Kills: chat's role chunk and deltas sent without the ``usage`` key."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=256, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
                       model_max_len=256)
    opts = {"max_tokens": 3, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    with _Served(engine) as srv:
        chat = httpx.post(srv.base + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": "Hi"}], **opts})
        comp = httpx.post(srv.base + "/v1/completions", timeout=30, json={"prompt": "Hello there", **opts})
    for r in (chat, comp):
        assert r.status_code == 200, r.text
        events = _events(r.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all("usage" in c for c in chunks), [c for c in chunks if "usage" not in c]
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert engine.stats()["used_blocks"] == 0


def test_an_empty_model_name_means_the_served_model_as_in_vllm():
    """vLLM answers a request whose ``model`` is empty (``""``, like an absent one) with its first served model
    (``_is_model_supported``: ``if not model_name: return True``); a client moving over must not get a 404.
    An unknown name is still a 404.  Kills: only ``None`` taken as the default."""
    engine = _engine()
    with _Served(engine) as srv:
        empty = httpx.post(srv.base + "/v1/completions", timeout=30, json={"model": "", "prompt": [11], "max_tokens": 2})
        other = httpx.post(srv.base + "/v1/completions", timeout=30, json={"model": "x", "prompt": [11], "max_tokens": 2})
    assert empty.status_code == 200 and empty.json()["model"] == "sim", empty.text
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


# -- the checks tests/test_server.py makes with the real model, made here without it -------------------------


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 0}, "logprobs"),  # a number, even 0, asks for log-probabilities (vLLM returns them for 0)
    ({"logprobs": 1}, "logprobs"),
    ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream: OpenAI's and vLLM's 400
], ids=["logprobs 0", "logprobs 1", "continuous_usage_stats", "stream_options without stream"])
def test_what_minivllm_cannot_do_is_a_400_naming_the_field_and_the_engine_stays_clean(body, param):
    """The fast suite's copy of ``test_server.py``'s refusals (which load the model): a field minivllm cannot
    honour is refused with the field named, never silently ignored, and a control request without it is
    served.  Kills: ``logprobs: 0`` taken as "no" (a truthiness test), ``continuous_usage_stats`` accepted,
    ``stream_options`` accepted without ``stream``."""
    engine = _engine()
    with _Served(engine) as srv:
        bad = httpx.post(srv.base + "/v1/completions", timeout=30, json={"prompt": [11, 12], "max_tokens": 2, **body})
        ok = httpx.post(srv.base + "/v1/completions", timeout=30, json={"prompt": [11, 12], "max_tokens": 2})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == param
    assert ok.status_code == 200, ok.text
    assert engine.stats()["used_blocks"] == 0


def test_a_request_that_exactly_fills_the_context_is_served_and_one_token_more_is_a_400():
    """OpenAI's and vLLM's rule: prompt plus ``max_tokens`` may reach ``max_model_len`` but not pass it.  A
    4-token prompt in a 64-token model may ask for 60 tokens (and gets all 60, EOS ignored); 61 is a 400
    naming ``max_tokens``.  Kills: the room check made with ``<`` (a request that exactly fills the context
    refused)."""
    engine = _engine(max_len=64, blocks=64)
    with _Served(engine) as srv:
        def post(n):
            return httpx.post(srv.base + "/v1/completions", timeout=30,
                              json={"prompt": [11, 12, 13, 14], "max_tokens": n, "ignore_eos": True})
        fills, over = post(60), post(61)
    assert fills.status_code == 200, fills.text
    assert fills.json()["usage"]["completion_tokens"] == 60
    assert fills.json()["choices"][0]["finish_reason"] == "length"
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert engine.stats()["used_blocks"] == 0
