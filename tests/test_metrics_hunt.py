"""Defects an operator reading minivllm's metrics would hit, found by recounting latencies from the requests' own
token times (the engine's ``Request`` objects, held from the moment they are added) rather than from the code that
exports them.

Each test runs the real engine on the simulated executor (:func:`tests.invariants.tiny_engine`), so the steps,
token times and failures are the engine's own; no model runs.
"""

from __future__ import annotations

import pytest
from invariants import tiny_engine

from minivllm import SamplingParams
from minivllm.metrics.prometheus import EngineMetrics, metrics_from_step_log, observe_all
from minivllm.metrics.scrape import metric_samples, metric_value


def _gaps(requests) -> list[float]:
    """Every inter-token gap of every request (each sample its own), from the requests' token times."""
    return [b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:])]


def _late_sample_run(stop_token_ids=()):
    """A group of two final_only samples whose second one starts three steps after the first.

    Two seats: ``x`` holds one for its three tokens, so ``g#1`` waits until ``x`` is gone and then forks from its
    leader ``g#0``, which is still decoding.  Returns the engine, its metrics (observed as the server does, after
    every step) and every request it held, ``x`` first."""
    engine = tiny_engine(max_seqs=2)
    metrics = EngineMetrics("m")
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True), request_id="x")
    engine.add_request([6, 7, 8, 9, 10, 11], SamplingParams(n=2, max_tokens=6, ignore_eos=True, output_kind="final_only",
                                                            stop_token_ids=list(stop_token_ids)), request_id="g")
    held = dict(engine.requests)
    for rid in ("x", "g"):
        metrics.track(rid, "t")
    while engine.has_unfinished_requests():
        observe_all(metrics, engine, engine.step())
    return engine, metrics, [held["x"], held["g#0"], held["g#1"]]


def test_a_final_only_group_times_every_token_of_a_sample_that_finishes_beside_a_shorter_one():
    """An ``n > 1`` final_only request (what ``LLM.generate`` sends) reports a sample's tokens only when it ends,
    and the group's output carries one sample's token times.  When a late-starting sample stops in the same step
    as the leader hits ``max_tokens``, both end on the same times but the leader has more tokens; the group carried
    the *shorter* sample's times, so the leader's early gaps were never observed (6 of 9 in this run) and the
    ITL histogram under-counted.  Oracle: the gaps recounted from each sample's own token times."""
    _, _, (_, _, late) = _late_sample_run()
    stop = late.output_token_ids[2]  # g#1's third token: it stops there, in the step g#0 reaches max_tokens
    engine, metrics, requests = _late_sample_run(stop_token_ids=[stop])
    x, leader, late = requests
    # the case this test is about: two samples that end in one step with different numbers of tokens
    assert late.token_times[-1] == leader.token_times[-1]
    assert (len(leader.output_token_ids), len(late.output_token_ids)) == (6, 3)
    assert stop not in leader.output_token_ids
    want = _gaps(requests)
    page = metric_samples(metrics.render().decode())
    assert metric_value(page, "vllm:inter_token_latency_seconds_count") == len(want) == 2 + 5 + 2
    assert metric_value(page, "vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(want))
    assert metric_value(page, "vllm:generation_tokens_total") == 3 + 6 + 3


def _failing_run(fail_call: int):
    """Two requests on an engine whose executor raises on its ``fail_call``-th call (1-based): every row of that
    step fails, so both requests end with ``"error"`` and the step samples nothing."""
    engine = tiny_engine()
    executor = engine.executor
    real, calls = executor.execute, [0]

    def execute(batch):
        calls[0] += 1
        if calls[0] == fail_call:
            raise RuntimeError("injected failure")
        return real(batch)

    executor.execute = execute
    for i, (plen, max_tokens) in enumerate([(6, 5), (10, 4)]):
        engine.add_request(list(range(1, plen + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           request_id=f"r{i}")
    held = dict(engine.requests)
    while engine.has_unfinished_requests():
        engine.step()
    assert all(r.status.value == "error" for r in held.values())  # (the failure did happen)
    got = metrics_from_step_log(engine.step_log, {k: len(r.prompt_token_ids) for k, r in held.items()},
                                {k: r.arrival_time for k, r in held.items()}, engine.pool.num_blocks)
    return got, list(held.values())


@pytest.mark.parametrize("fail_call", [1, 3], ids=["prefill_fails", "decode_fails"])
def test_the_step_log_rebuild_counts_no_token_for_a_row_that_failed(fail_call):
    """``metrics_from_step_log`` took every row that reached a request's last known token for a sampled token; a
    row whose execution failed samples nothing (the step log names it in ``record.failed``), so the rebuild
    counted a generated token, an ITL (a decode that failed) or a TTFT (a prefill that failed) that never was.
    Oracle: the requests' own output tokens and token times."""
    got, requests = _failing_run(fail_call)
    assert got["generation_tokens"] == sum(len(r.output_token_ids) for r in requests)
    assert sorted(got["itl"]) == pytest.approx(sorted(_gaps(requests)))
    assert got["ttft"] == {r.request_id: pytest.approx(r.first_token_time - r.arrival_time)
                           for r in requests if r.first_token_time is not None}


def test_a_request_whose_swap_in_failed_is_a_named_preemption():
    """A request swapped in for a step that gives it no row (a batch builder may leave one out, lab 4's) and whose
    execution fails is preempted again by recompute, and the engine counts that preemption -- but the step log did
    not name it, so ``/metrics`` put it under tenant ``"unknown"`` (a tenant no API key has) and the rebuild from
    the log counted one preemption fewer.  Oracle: the preemptions recounted from the requests themselves
    (``Request.num_preemptions``), per tenant."""
    from minivllm import EngineConfig, LLMEngine
    from minivllm.sim.executor import SimulatedExecutor

    skip: list[str] = []  # the swapped-out request the builder leaves without a row, once it is chosen

    def builder(running, budget, threshold):
        rows = []
        for r in running:
            if budget > 0 and r.request_id not in skip:
                n = min(r.num_tokens - r.num_computed_tokens, budget, threshold or budget)
                rows.append((r, n))
                budget -= n
        return rows

    class FailsTheSwapIn(SimulatedExecutor):
        def execute(self, batch):
            if skip and batch.moves.swap_in and not failed:
                failed.append(batch)
                raise RuntimeError("injected failure")
            return super().execute(batch)

    failed: list = []
    cfg = EngineConfig(num_gpu_blocks_override=8, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                       max_model_len=32, preemption_mode="swap", num_cpu_blocks_override=16, device="cpu")
    engine = LLMEngine(cfg, executor=FailsTheSwapIn(), batch_builder=builder, model_max_len=32, eos_token_ids=set())
    metrics = EngineMetrics("m")
    for i, tenant in enumerate(["a", "b", "a"]):
        engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=12, ignore_eos=True), request_id=f"r{i}",
                           tenant=tenant)
        metrics.track(f"r{i}", tenant)
    held = dict(engine.requests)
    while engine.has_unfinished_requests():
        swapped = [rid for rid, r in held.items() if r.status.value == "swapped"]
        if swapped and not skip:
            skip.append(swapped[0])
        observe_all(metrics, engine, engine.step())
    # the case this test is about: the failed step swapped the skipped request in and gave it no row
    (rec,) = [r for r in engine.step_log if r.failed]
    assert rec.swapped_in and skip[0] not in rec.seq_ids
    want = {t: sum(r.num_preemptions for r in held.values() if r.tenant == t) for t in ("a", "b")}
    page = metric_samples(metrics.render().decode())
    got = {t: metric_value(page, "vllm:num_preemptions_total", tenant=t) for t in ("a", "b", "unknown")}
    assert got == {**want, "unknown": 0}
    rebuilt = metrics_from_step_log(engine.step_log, {k: len(r.prompt_token_ids) for k, r in held.items()},
                                    {k: r.arrival_time for k, r in held.items()}, engine.pool.num_blocks)
    assert rebuilt["preemptions"] == sum(want.values())
