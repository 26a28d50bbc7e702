"""Tests from a mutation hunt over ``minivllm/metrics/`` (stop 63): each pins a behaviour that a planted bug
changed while every earlier test still passed.

The oracles stay outside the code under test: timestamps and counts worked out by hand, the engine's own
cumulative counters, a brute-force percentile, and prometheus_client's text parser reading the exposition back.
No model runs here; the engine is a small fake that exposes ``stats()`` and ``step_log`` like the real one.
"""

from __future__ import annotations

import pytest

from minivllm.metrics.prometheus import EngineMetrics
from minivllm.metrics.scrape import label_values, metric_samples, metric_value
from minivllm.metrics.step_log import StepRecord
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput


class _FakeEngine:
    """Just the surface ``EngineMetrics.observe_step`` reads: ``stats()``, ``step_log`` and ``requests``."""

    def __init__(self, stats: dict) -> None:
        self.step_log: list[StepRecord] = []
        self.requests: dict = {}
        self._stats = stats

    def stats(self) -> dict:
        return dict(self._stats)


def _zero_stats() -> dict:
    """Every key ``stats()`` always has, at zero: an idle engine's snapshot."""
    from minivllm.metrics.engine_stats import EngineStats

    return {**{k: 0 for k in EngineStats.__required_keys__}, "kv_cache_usage": 0.0, "per_tenant": {}}


def _rec(step: int, seqs=(), preempted=(), time: float = 0.0) -> StepRecord:
    ids, starts, ns = (tuple(x) for x in zip(*seqs)) if seqs else ((), (), ())
    return StepRecord(step, time, ids, starts, ns, sum(ns), tuple(preempted), 0, 0, (), (), 10, 10, 0, 0)


def _cumulative(rid: str, times: list[float], finished: bool = False) -> RequestOutput:
    """A cumulative output of one sample that has produced ``len(times)`` tokens, the i-th at ``times[i]``."""
    n = len(times)
    c = CompletionOutput(0, "", list(range(n)), "length" if finished else None, None, "", [n - 1])
    m = RequestMetrics(0.0, 0.5, times[0], list(times), times[-1] if finished else None)
    return RequestOutput(rid, None, [7, 7, 7], [c], finished, m)


def _page(m: EngineMetrics) -> dict:
    return metric_samples(m.render().decode())


# -- prometheus.py: EngineMetrics -------------------------------------------------------------------------------


def test_itl_after_an_output_carrying_two_tokens_is_timed_from_the_newest():
    """Kills: ``last_times`` set to the *first* token time of an output (``times[0]``) instead of the last.
    ``observe_output`` takes any output of a step; a caller that reads a cumulative request every other step
    hands it two new tokens at once, and the next gap must run from the newer of them.  Oracle: the gaps of
    tokens at 1.0, 1.5, 2.5 and 2.75 worked by hand -- 0.5, 1.0, 0.25 (sum 1.75, none above 1.0)."""
    m = EngineMetrics("mm")
    m.track("a", "alice")
    m.observe_output(_cumulative("a", [1.0]))
    m.observe_output(_cumulative("a", [1.0, 1.5, 2.5]))
    m.observe_output(_cumulative("a", [1.0, 1.5, 2.5, 2.75]))
    s = _page(m)
    assert metric_value(s, "vllm:inter_token_latency_seconds_count", tenant="alice") == 3
    assert metric_value(s, "vllm:inter_token_latency_seconds_sum", tenant="alice") == pytest.approx(1.75)
    assert metric_value(s, "vllm:inter_token_latency_seconds_bucket", tenant="alice", le="1.0") == 3


def test_an_idle_step_is_not_an_iteration():
    """Kills: a step that scheduled nothing observed as a 0-token iteration.  The step log records idle steps
    too (an engine loop polling with no work), and each one would pull ``vllm:iteration_tokens_total``'s
    count up and its quantiles toward 0; vLLM observes only steps that ran a batch.  Oracle: a hand count --
    two steps ran 5 and 1 tokens, the idle one between them none."""
    e, m = _FakeEngine(_zero_stats()), EngineMetrics("mm")
    for rec in (_rec(0, [("a", 0, 5)]), _rec(1), _rec(2, [("a", 5, 1)])):
        e.step_log.append(rec)
        m.observe_step(e)
    s = _page(m)
    assert metric_value(s, "vllm:iteration_tokens_total_count") == 2
    assert metric_value(s, "vllm:iteration_tokens_total_sum") == 6
    assert metric_value(s, "vllm:iteration_tokens_total_bucket", le="1.0") == 1


def test_preemptions_the_step_log_did_not_name_are_all_counted():
    """Kills: the leftover preemptions (counted by the engine, named by no step record the metrics saw)
    added as one instead of as many.  ``observe_step`` reads only the newest record, so a caller that steps
    the engine twice between two calls misses the first step's names; the series must still add up to the
    engine's own counters.  Oracle: the engine's cumulative ``num_recompute_preemptions`` /
    ``num_swap_preemptions`` (3 and 2), and the one named victim's tenant."""
    e, m = _FakeEngine({**_zero_stats(), "num_recompute_preemptions": 3, "num_swap_preemptions": 2}), EngineMetrics("mm")
    m.track("a", "alice")
    e.step_log.append(_rec(4, preempted=["a"]))
    m.observe_step(e)
    s = _page(m)
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute") == 3
    assert metric_value(s, "vllm:num_preemptions_total", mode="swap") == 2
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute", tenant="alice") == 1
    assert metric_value(s, "vllm:num_preemptions_total", tenant="unknown") == 4



def test_a_stale_stats_snapshot_neither_raises_nor_makes_preemptions_count_twice():
    """Kills: the per-step preemption deltas used unclamped (a snapshot older than the last one seen gives a
    negative delta, and the leftover loop then decrements a Prometheus counter, which raises).  Also pins the
    rule ``sync`` documents for the engine's cumulative counters -- a snapshot older than the last adds nothing
    and a counter is never counted twice -- for the preemption counter, which ``observe_step`` keeps by the same
    delta method from a caller-supplied ``stats``.  Oracle: the engine's own cumulative counter, 5 at the end."""
    e, m = _FakeEngine(_zero_stats()), EngineMetrics("mm")
    for step, recomputes in ((0, 5), (1, 3), (2, 5)):  # step 1 brings a snapshot read before step 0's
        e.step_log.append(_rec(step))
        m.observe_step(e, stats={**_zero_stats(), "num_recompute_preemptions": recomputes})
    s = _page(m)
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute") == 5
    assert metric_value(s, "vllm:num_preemptions_total") == 5


def test_a_stale_snapshot_between_swaps_leaves_each_victim_its_own_tenant_and_no_unknown():
    """Kills: the highest-value rule applied to the recompute counter only, the swap counter's ``_last`` set from
    whatever snapshot came last (the test above moves only the recompute counter, so that half of the fix was
    free to break).  A snapshot older than the previous one must not lower the baseline: the swap after it would
    then be counted once for its named victim and once more as "unknown".  Oracle: the engine's cumulative
    ``num_swap_preemptions`` (2, then 3) and the victims the step records name -- one each for alice, bob and
    carol, none left over."""
    e, m = _FakeEngine(_zero_stats()), EngineMetrics("mm")
    for rid, tenant in (("a", "alice"), ("b", "bob"), ("c", "carol")):
        m.track(rid, tenant)
    for step, swaps, victims in ((0, 2, ["a", "b"]), (1, 1, []), (2, 3, ["c"])):  # step 1's snapshot is stale
        e.step_log.append(_rec(step, preempted=victims))
        m.observe_step(e, stats={**_zero_stats(), "num_swap_preemptions": swaps})
    s = _page(m)
    assert metric_value(s, "vllm:num_preemptions_total", mode="swap") == 3
    for tenant in ("alice", "bob", "carol"):
        assert metric_value(s, "vllm:num_preemptions_total", mode="swap", tenant=tenant) == 1
    assert metric_value(s, "vllm:num_preemptions_total", tenant="unknown") == 0
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute") == 0



def test_an_untracked_requests_output_is_labelled_with_the_tenant_the_caller_names():
    """Kills: ``observe_output`` labelling a request it was never told about "default" whatever tenant the caller
    passed.  Offline runs (``observe_all`` with a ``tenant_of`` table) do not call ``track``; the tenant comes with
    each output, and that request's tokens, latencies and ending belong to it.  Oracle: the caller's table --
    every series of request "a" under "alice", none under "default"."""
    m = EngineMetrics("mm")
    m.observe_output(_cumulative("a", [1.0]), "alice")
    m.observe_output(_cumulative("a", [1.0, 1.5], finished=True), "alice")
    s = _page(m)
    assert metric_value(s, "vllm:generation_tokens_total", tenant="alice") == 2
    assert metric_value(s, "vllm:prompt_tokens_total", tenant="alice") == 3
    assert metric_value(s, "vllm:time_to_first_token_seconds_count", tenant="alice") == 1
    assert metric_value(s, "vllm:request_success_total", finished_reason="length", tenant="alice") == 1
    assert metric_value(s, "vllm:generation_tokens_total", tenant="default") == 0



def test_the_cached_blocks_gauge_counts_cached_blocks_a_request_still_holds():
    """Kills: ``vllm:kv_cache_cached_blocks`` derived as the pool less free and used blocks, which is only the
    *evictable* part of the cache.  A running request's full blocks are in the prefix cache too (the next request
    with that prefix reuses them), so the gauge is ``stats()["cached_blocks"]``, held ones included.  Oracle: a
    hand-built snapshot obeying ``EngineStats``' block identity -- 10 = 4 free + 5 used + 1 evictable, with 3
    blocks cached of which 2 are held."""
    m = EngineMetrics("mm")
    m.sync({**_zero_stats(), "num_blocks": 10, "free_blocks": 4, "used_blocks": 5, "cached_blocks": 3,
            "available_blocks": 5, "kv_cache_usage": 0.5})
    s = _page(m)
    assert metric_value(s, "vllm:kv_cache_cached_blocks") == 3
    assert (metric_value(s, "vllm:kv_cache_used_blocks"), metric_value(s, "vllm:kv_cache_free_blocks")) == (5, 4)



def test_prompt_tokens_count_the_whole_prompt_cached_part_included():
    """Kills: ``vllm:prompt_tokens`` counting only the prompt tokens not read from the prefix cache.  vLLM adds a
    request's whole prompt length once (the cache's share is what ``prefix_cache_hits`` is for), and PromQL written
    for vLLM divides the two.  Oracle: vLLM's definition on a hand-built output -- a 3-token prompt, 2 of them
    cached, counts 3."""
    m = EngineMetrics("mm")
    m.track("a", "alice")
    out = _cumulative("a", [1.0], finished=True)
    out.num_cached_tokens = 2
    m.observe_output(out)
    assert metric_value(_page(m), "vllm:prompt_tokens_total", tenant="alice") == 3


# -- stats.py ---------------------------------------------------------------------------------------------------


def test_nearest_rank_clamps_a_rank_past_the_samples_to_the_largest():
    """Kills: ``nearest_rank`` without its upper clamp (``min(len, rank)``), which indexes past the samples.  The
    docstring promises a rank clamped to the samples, so a ``q`` a hair over 100 (a percentage computed in
    floats: ``100.00000000000001``) reads the maximum rather than raising.  Oracle: brute force -- the smallest
    sample with at least ``q`` % of the samples at or below it, capped at all of them, is the maximum."""
    from minivllm.metrics.stats import nearest_rank

    values = [0.3, 0.1, 0.2]
    for q in (100, 100.00000000000001, 150):
        assert nearest_rank(values, q) == max(values)
    assert nearest_rank(values, -5) == min(values)



# -- scrape.py --------------------------------------------------------------------------------------------------


def test_label_values_skip_samples_without_the_label():
    """Kills: ``label_values`` reading the label off every sample of the name (a ``KeyError`` on one without it).
    Pages merged from replicas (the module's ``{**a, **b}``) can mix a minivllm replica, whose token counter has a
    ``tenant`` label, with a vLLM one, whose has none; the tenants are those of the samples that have one.
    Oracle: two hand-written pages read by prometheus_client's parser."""
    ours = ("# TYPE vllm:generation_tokens counter\n"
            'vllm:generation_tokens_total{model_name="a",tenant="bob"} 3\n'
            'vllm:generation_tokens_total{model_name="a",tenant="alice"} 4\n')
    theirs = '# TYPE vllm:generation_tokens counter\nvllm:generation_tokens_total{model_name="b"} 5\n'
    s = {**metric_samples(ours), **metric_samples(theirs)}
    assert label_values(s, "vllm:generation_tokens_total", "tenant") == ["alice", "bob"]
    assert label_values(s, "vllm:generation_tokens_total", "model_name") == ["a", "b"]
    assert metric_value(s, "vllm:generation_tokens_total") == 12
