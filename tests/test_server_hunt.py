"""What a platform engineer's load balancer and dashboards read from the server after something went wrong.

Two defects a hunt over ``minivllm/server`` found, each pinned by a test that failed on the code before its fix:

* ``/metrics`` after the engine loop failed (a bug in its step): the loop aborts its requests after its last
  gauge sync, and the scrape skipped its own read once the loop was not running, so it reported a running
  request and KV blocks held, for ever, on an engine that held none.
* A non-streamed ``n > 1`` request one of whose samples the engine failed: answered 200 with that choice's
  ``finish_reason: "error"`` (no finish reason the OpenAI API has) when the failed sample was not the first to
  finish, a 500 when it was; its streamed twin ends with an error event whichever sample failed.

No model: the real engine on the simulated executor behind the real HTTP server (``BackgroundServer``).  Oracles:
the block pool recounted by hand (no prefix cache, so every block is free once nothing runs), the Prometheus text
read back by prometheus_client's own parser, the executor's own failure message, and the OpenAI API reference's
finish reasons.
"""

from __future__ import annotations

import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from tests.test_server_sim import _Served, _WordTokenizer  # noqa: E402

# what the OpenAI API reference lists for a choice's finish_reason (completions and chat together)
OPENAI_FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls", "function_call"}
_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_used_blocks",
           "vllm:kv_cache_usage_perc")


def _engine(executor) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=128, max_num_seqs=4, device="cpu")
    return LLMEngine(cfg, executor=executor, tokenizer=_WordTokenizer(), model_max_len=128, eos_token_ids=set())


def _gauges(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name in _GAUGES}


class _Paced(SimulatedExecutor):
    """10 ms of wall time a step: the request is still running when its third token makes the step fail."""

    def execute(self, batch):
        time.sleep(0.01)
        return super().execute(batch)


def test_metrics_after_the_engine_loop_failed_show_what_the_engine_holds(monkeypatch):
    """The loop's step raises (a bug past the executor's guard) while a request runs; the waiting client gets its
    503 and the request's blocks go back with it, so a scrape must read nothing running and no block used.
    Oracle: the pool recounted (every block on the free list: no prefix cache here) and the engine's own running
    list, both checked before the scrape is read.  Before the fix the scrape kept the last step's values -- one
    request running and its two blocks held -- on a replica whose ``/health`` already said 503: the capacity
    dashboard disagreed with the health check for as long as the process lived.  (An engine closed under the
    server, ``LLM.close()``, stops the loop the same way; there the stale values showed only when the close
    landed between two particular lines of the loop, so that case is not pinned here.)"""
    engine = _engine(_Paced())
    real_step = engine.step

    def step():
        if any(len(r.output_token_ids) >= 3 for r in engine.scheduler.running):
            raise RuntimeError("a bug in the step")
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30,
                       json={"prompt": "w1 w2 w3 w4 w5", "max_tokens": 100, "ignore_eos": True})
        assert r.status_code == 503 and "a bug in the step" in r.text, r.text
        end = time.monotonic() + 10  # the loop thread ends just after the 503 goes out
        while srv.async_engine.is_running and time.monotonic() < end:
            time.sleep(0.01)
        assert httpx.get(srv.base + "/health", timeout=30).status_code == 503
        assert engine.pool.num_free == engine.pool.num_blocks and not engine.scheduler.running
        scraped = _gauges(httpx.get(srv.base + "/metrics", timeout=30).text)
    assert scraped == dict.fromkeys(_GAUGES, 0.0), scraped


class _FailsOneSample(SimulatedExecutor):
    """Sampling fails (as a NaN row would) for one sample of an ``n > 1`` request, at its second token; the
    other samples run to ``max_tokens``."""

    def __init__(self, sample: int) -> None:
        super().__init__()
        self.suffix = f"#{sample}"

    def execute(self, batch):
        out = super().execute(batch)
        for s in batch.seqs:
            rid = s.request.request_id
            if rid.endswith(self.suffix) and len(s.request.output_token_ids) == 1 and rid in out:
                del out[rid]
                batch.errors[rid] = "sampling failed: probability tensor contains nan"
        return out


@pytest.mark.parametrize("failed_sample", [0, 1])
def test_an_n_request_with_one_failed_sample_is_a_500_whichever_sample_failed(failed_sample):
    """``n=2``, non-streamed; the engine fails one sample.  The answer must not be a 200 carrying
    ``finish_reason: "error"``, which the OpenAI API does not have (a client takes the cut text as the model's
    answer); the server's rule for a request the engine failed is a 500 naming the engine's reason, and the
    streamed request ends with that reason in an error event whichever sample it was.  Oracle: the OpenAI API
    reference's finish reasons and the executor's own message.  Before the fix sample 0 failing was a 500 and
    sample 1 failing a 200 (only the first finish reason found was asked).  The pool is whole afterwards
    (recounted: no prefix cache, so every block is free)."""
    engine = _engine(_FailsOneSample(failed_sample))
    body = {"prompt": "w1 w2 w3", "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7, "ignore_eos": True}
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/completions", timeout=30, json=body)
        if r.status_code == 200:  # what the client would have read
            reasons = {c["finish_reason"] for c in r.json()["choices"]}
            assert reasons <= OPENAI_FINISH_REASONS, f"a 200 whose choices finished {sorted(reasons)}"
        assert r.status_code == 500, r.text
        assert r.json()["error"]["type"] == "internal_error"
        assert "probability tensor contains nan" in r.json()["error"]["message"]
        streamed = httpx.post(srv.base + "/v1/completions", timeout=30, json={**body, "stream": True})
        events = [line[6:] for line in streamed.text.split("\n") if line.startswith("data: ")]
        assert "probability tensor contains nan" in streamed.text and events[-1] == "[DONE]", events
    assert engine.stats()["num_errors"] == 2
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_door_counts_a_request_for_n_choices_alike_posted_or_queued():
    """The door compares ``waiting_or_posted()`` with ``max_waiting``.  The engine queues each of an ``n = 4``
    request's samples, so once queued it counts 4; posted (the event loop has handed it over, the loop thread
    has not added it yet) it counted 1, and a burst of such requests passed a door their queue then overflowed.
    Oracle: the scheduler's own queue length once the same request is queued.  The loop thread is stood in for
    by the test, which runs the posted command itself, so "posted" is a state and not a race."""
    import asyncio
    import threading

    from minivllm.sampling_params import SamplingParams
    from minivllm.server.async_engine import AsyncEngine

    engine = _engine(SimulatedExecutor())
    runner = AsyncEngine(engine)
    posted_cmds: list = []
    runner._post = posted_cmds.append  # the loop thread's queue, held by the test
    runner._thread = threading.current_thread()  # "started"; nothing runs the commands but the test

    async def main() -> tuple[int, int]:
        task = asyncio.create_task(runner.add_request({"prompt_token_ids": [5, 6, 7]},
                                                      SamplingParams(n=4, max_tokens=3, temperature=1.0), "g"))
        while not posted_cmds:
            await asyncio.sleep(0)
        posted = runner.waiting_or_posted()
        posted_cmds.pop()()  # the loop thread's turn: the request joins the engine's queue
        await task
        return posted, runner.waiting_or_posted()

    posted, queued = asyncio.run(main())
    assert posted == queued == len(engine.scheduler.waiting) == 4
