"""``EngineMetrics.observe_output`` counts the same tokens and latencies whatever a request's ``output_kind``.

Bug fixed: generation tokens were summed from ``delta_token_ids`` and ITLs from ``metrics.itls``.  A
``final_only`` output (what ``LLM.generate`` uses) carries only the last token in its delta, so a 5-token
request counted 1 generation token; a ``delta`` output carries only this step's token time, so a streamed
request observed no inter-token latency at all.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.metrics.prometheus import EngineMetrics, observe_all
from minivllm.metrics.scrape import metric_samples, metric_value
from minivllm.sim import SimulatedExecutor
from tests.invariants import steps


def _run(kind: str, n: int = 1):
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    engine = llm.engine
    engine.eos_token_ids = set()
    metrics = EngineMetrics("sim")
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=n, max_tokens=5, ignore_eos=True,
                                                                       output_kind=kind), request_id="r")
    for outs in steps(engine):
        observe_all(metrics, engine, outs)
    return metric_samples(metrics.render().decode())


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_tokens_and_itls_do_not_depend_on_the_output_kind(kind):
    s = _run(kind)
    ref = _run("cumulative")
    assert metric_value(s, "vllm:generation_tokens_total") == 5
    assert metric_value(s, "vllm:inter_token_latency_seconds_count") == 4
    assert metric_value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        metric_value(ref, "vllm:inter_token_latency_seconds_sum"))
    assert metric_value(s, "vllm:time_to_first_token_seconds_count") == 1


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_n_samples_count_every_generated_token(kind):
    s = _run(kind, n=3)
    assert metric_value(s, "vllm:generation_tokens_total") == 15


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_n_samples_observe_every_samples_gaps(kind):
    """vLLM times each child of an ``n > 1`` request: the histogram holds every sample's gaps.  Oracle: a
    recount from each sample's own token times (3 samples x 4 gaps).  It held one sample's gaps (cumulative)
    or none at all (delta), because a group's output carries the metrics of one sample."""
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    engine = llm.engine
    engine.eos_token_ids = set()
    metrics = EngineMetrics("sim")
    engine.add_request({"prompt_token_ids": list(range(1, 33))}, SamplingParams(
        n=3, max_tokens=5, ignore_eos=True, temperature=1.0, output_kind=kind), request_id="g")
    times = {}
    while engine.has_unfinished_requests():
        times.update({rid: r.token_times for rid, r in engine.requests.items()})  # live lists, kept after finish
        observe_all(metrics, engine, engine.step())
    gaps = [b - a for ts in times.values() for a, b in zip(ts, ts[1:])]
    assert sorted(times) == ["g#0", "g#1", "g#2"] and len(gaps) == 12
    s = metric_samples(metrics.render().decode())
    assert metric_value(s, "vllm:inter_token_latency_seconds_count") == 12
    assert metric_value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(gaps))


def test_queue_time_ends_when_the_first_step_begins():
    """Queue time is arrival to first scheduling, so it holds no prefill.  Hand count on 1 s steps, one seat:
    a and b arrive at 0; a runs steps [0,1], [1,2], [2,3] (3 tokens); b is first scheduled in the step that
    starts at 3, so it queued 3 s, and a queued 0 s (it was stamped at its first step's end: 1 s and 4 s)."""
    from minivllm.metrics.prometheus import EngineMetrics

    ex = SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)
    llm = LLM(executor=ex, tokenizer=None, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=1)
    engine = llm.engine
    engine.eos_token_ids = set()
    metrics = EngineMetrics("sim")
    for rid in ("a", "b"):
        engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=3, ignore_eos=True),
                           request_id=rid, arrival_time=0.0, tenant="t")
        metrics.track(rid, "t")
    done = {}
    for outs in steps(engine):
        observe_all(metrics, engine, outs)
        done.update({o.request_id: o.metrics for o in outs if o.finished})
    assert (done["a"].queue_time, done["b"].queue_time) == (0.0, 3.0)
    assert (done["a"].ttft, done["b"].ttft) == (1.0, 4.0)
    assert engine.stats()["per_tenant"]["t"]["queue_time_s"] == 3.0
    s = metric_samples(metrics.render().decode())
    assert metric_value(s, "vllm:request_queue_time_seconds_sum") == 3.0


def test_an_untracked_request_preempted_before_its_first_token_is_charged_to_its_tenant():
    """Offline (``observe_all`` without ``track``) a request is known to the metrics only from its first output,
    so a preemption before it was labelled tenant "unknown" while its tokens went to ``tenant_of``'s answer.
    Oracle: the engine's own per-tenant count (or all of it under "default" when no ``tenant_of`` is given)."""
    tenants = ["alice", "bob", "alice", "bob"]

    def run(tenant_of):
        llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=6, block_size=4,
                  max_model_len=24, long_prefill_token_threshold=8, max_num_batched_tokens=8)
        engine = llm.engine
        engine.eos_token_ids = set()
        metrics = EngineMetrics("sim")
        for i, tenant in enumerate(tenants):
            engine.add_request({"prompt_token_ids": list(range(10 + i, 22 + i))},
                               SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"r{i}", tenant=tenant)
        for outs in steps(engine):
            observe_all(metrics, engine, outs, tenant_of)
        return metric_samples(metrics.render().decode()), engine.stats()["per_tenant"]

    s, per_tenant = run(lambda rid: tenants[int(rid[1:])])
    assert [per_tenant[t]["num_preemptions"] for t in ("alice", "bob")] == [1, 2]  # each before a first token
    for t in ("alice", "bob"):
        assert metric_value(s, "vllm:num_preemptions_total", tenant=t) == per_tenant[t]["num_preemptions"]
    assert metric_value(s, "vllm:num_preemptions_total", tenant="unknown") == 0
    s, per_tenant = run(None)
    total = sum(per_tenant[t]["num_preemptions"] for t in ("alice", "bob"))
    assert metric_value(s, "vllm:num_preemptions_total", tenant="default") == total
    assert metric_value(s, "vllm:num_preemptions_total", tenant="unknown") == 0


def test_an_n_group_queue_time_is_the_groups_not_its_last_samples():
    """An ``n > 1`` group queues until its *first* sample is scheduled, as its TTFT counts to its first token.
    Hand count on 1 s steps, one seat, n=2, max_tokens=2: g#0 runs steps [0,1], [1,2]; g#1 is first scheduled
    in the step that starts at 2.  The group queued 0 s and its first token came at 1 s.  It observed 2 s (the
    queue of g#1, whose metrics the finishing output carries): a request queued longer than its own TTFT."""
    ex = SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)
    llm = LLM(executor=ex, tokenizer=None, num_gpu_blocks_override=64, max_model_len=96, max_num_seqs=1)
    engine = llm.engine
    engine.eos_token_ids = set()
    metrics = EngineMetrics("sim")
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2, max_tokens=2, ignore_eos=True,
                       temperature=1.0), request_id="g", arrival_time=0.0)
    seen = []
    for outs in steps(engine):
        seen += [(o.metrics.queue_time, o.metrics.ttft) for o in outs]
        observe_all(metrics, engine, outs)
    # every output of the group, the last included, carries the group's times, not the sample's that stepped
    assert seen and set(seen) == {(0.0, 1.0)}, seen
    s = metric_samples(metrics.render().decode())
    assert metric_value(s, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert metric_value(s, "vllm:request_queue_time_seconds_count") == 1
    assert metric_value(s, "vllm:request_queue_time_seconds_sum") == 0.0


def test_each_final_output_reports_how_often_its_request_was_preempted():
    """A request's ``metrics.num_preemptions`` is what a caller (``sim.fleet``, Lab 5's checker) reads to see
    which requests were pushed out and how often.  Kills: the output built with a constant 0 (every existing
    assertion was of a request never preempted).  The scenario of the test above, where each request is
    preempted before its first token: alice's two requests once in all, bob's twice.  Oracle: that hand count,
    which the engine's per-tenant counter (kept by the scheduler, not read from the request) agrees with."""
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=6, block_size=4,
              max_model_len=24, long_prefill_token_threshold=8, max_num_batched_tokens=8)
    engine = llm.engine
    engine.eos_token_ids = set()
    tenants = ["alice", "bob", "alice", "bob"]
    for i, tenant in enumerate(tenants):
        engine.add_request({"prompt_token_ids": list(range(10 + i, 22 + i))},
                           SamplingParams(max_tokens=8, ignore_eos=True), request_id=f"r{i}", tenant=tenant)
    finals = {o.request_id: o for outs in steps(engine) for o in outs if o.finished}
    by_tenant = {t: sum(finals[f"r{i}"].metrics.num_preemptions for i, u in enumerate(tenants) if u == t)
                 for t in ("alice", "bob")}
    assert by_tenant == {"alice": 1, "bob": 2}
    assert by_tenant == {t: engine.stats()["per_tenant"][t]["num_preemptions"] for t in by_tenant}


class _Counting(SimulatedExecutor):
    """The oracle's side: every token the executor hands the engine, per request id, and a real pause per step
    so that a request is still running when the test aborts it."""

    def __init__(self) -> None:
        super().__init__()
        self.sampled: dict[str, int] = {}

    def execute(self, batch):
        import time

        time.sleep(0.002)
        out = super().execute(batch)
        for rid in out:
            self.sampled[rid] = self.sampled.get(rid, 0) + 1
        return out


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("kind", ["final_only", "delta"])
def test_an_aborted_request_still_counts_the_tokens_it_generated(kind, n):
    """vLLM counts every token its engine generates, aborted or not.  A ``final_only`` request (a non-streamed
    answer) reports its tokens only when it finishes, so one the client gave up on counted none: the old code left
    ``generation_tokens_total`` at 0 and ``prompt_tokens_total`` at 0 here.  Oracle: the tokens the executor
    handed the engine for the request's samples, counted in the executor, and the prompt's length."""
    import asyncio

    from minivllm.server.async_engine import AsyncEngine

    ex = _Counting()
    llm = LLM(executor=ex, tokenizer=None, num_gpu_blocks_override=512, max_model_len=2048)
    engine = llm.engine
    engine.eos_token_ids = set()
    metrics = EngineMetrics("sim")
    prompt = list(range(1, 12))

    async def main() -> None:
        runner = AsyncEngine(engine, metrics=metrics, idle_poll_s=0.01)
        runner.start()
        try:
            await runner.add_request({"prompt_token_ids": prompt}, SamplingParams(
                n=n, max_tokens=2000, ignore_eos=True, temperature=1.0 if n > 1 else 0.0, output_kind=kind), "r")
            for _ in range(2000):  # until every sample has a few tokens (a hang guard, not a timing)
                if sum(ex.sampled.values()) >= 5 * n and len(ex.sampled) == n:
                    break
                await asyncio.sleep(0.005)
            runner.abort("r")
            assert await asyncio.to_thread(runner.wait_idle, 5.0)
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())
    s = metric_samples(metrics.render().decode())
    generated = sum(ex.sampled.values())
    assert generated >= 5 * n
    assert metric_value(s, "vllm:generation_tokens_total") == generated
    assert metric_value(s, "vllm:prompt_tokens_total") == len(prompt)
    assert engine.stats()["used_blocks"] == 0
