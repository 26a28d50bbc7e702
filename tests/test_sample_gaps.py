"""Per-sample token times of an ``n > 1`` request, and the chunked-prefill count across a swap.

The oracle is the step log, counted by hand: which step sampled each sample's tokens (a row samples a token when
it reaches the request's last known token, prompt plus tokens so far), and which rows continue a prompt that an
earlier step cut.  The engine runs on the simulated executor (:func:`tests.invariants.tiny_engine`): the
scheduling, the preemptions and the clock are the real engine's, no model runs.
"""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.bench.replay import continued_prefill_steps
from minivllm.metrics.prometheus import EngineMetrics, observe_all
from minivllm.metrics.scrape import metric_samples, metric_value
from minivllm.metrics.step_log import StepRecord
from tests.invariants import steps, tiny_engine

STOP = 127  # the simulator's 6th token for "g#1" (a CRC of id and position); "g#0" never samples it


def _group_run(kind: str):
    """``g`` (n = 2, a 4-token prompt, up to 10 tokens, stops on ``STOP``) beside ``h`` on seven 4-token blocks.

    In step 5 the pool runs dry and ``g#1`` is pushed out (recompute); it comes back in step 8, and in step 9 it
    samples ``STOP`` as ``g#0`` reaches ``max_tokens``: two samples ending in one step, with 6 and 10 tokens, the
    shorter one with a hole in its times.  Returns the engine, its metrics (observed after every step, as the
    server does) and every output of ``g``."""
    engine = tiny_engine(num_blocks=7, max_len=24)
    metrics = EngineMetrics("m")
    engine.add_request([1, 2, 3, 4], SamplingParams(n=2, max_tokens=10, ignore_eos=True, output_kind=kind,
                                                    stop_token_ids=[STOP]), request_id="g")
    engine.add_request([20, 21, 22, 23], SamplingParams(max_tokens=8, ignore_eos=True), request_id="h")
    metrics.track("g", "t")
    metrics.track("h", "other")  # (its gaps apart from g's)
    outs = []
    for step_outputs in steps(engine):
        observe_all(metrics, engine, step_outputs)
        outs += [o for o in step_outputs if o.request_id == "g"]
    return engine, metrics, outs


def _rows(log, rid: str) -> list[tuple[int, int, int]]:
    return [(k, start, n) for k, r in enumerate(log) for i, start, n in r.seqs if i == rid]


@pytest.mark.parametrize("kind", ["final_only", "cumulative", "delta"])
def test_each_sample_of_a_group_is_timed_by_its_own_steps_across_a_preemption(kind):
    """A final_only group's output carried one sample's token times (the longest), and the ITL histogram timed every
    sample by them: ``g#1``, preempted in step 5, was timed by ``g#0``'s steps 4-9 instead of its own steps 1-4
    and 8-9, so its 45 ms gap across the preemption was lost and a 10 ms one counted in its place (sum 56 ms where
    its gaps add up to 90 ms).  Each completion now carries its own times, and the metrics read those.

    Hand count from the log: ``g#0`` has a row in every step 0-9, each reaching its last token (0-3 in step 0,
    then position 3 + k in step k): a token in each.  ``g#1`` forks in step 1 and samples from position 3 in
    steps 1-4 (rows ending at 4, 5, 6, 7 = its prompt plus 0..3 tokens), is preempted in step 5, recomputes
    positions 3-7 in step 8 (ending at 8 = 4 + 4: its 5th token) and decodes in step 9: tokens in steps
    1, 2, 3, 4, 8, 9.  Every token is timed at its step's log time."""
    engine, metrics, outs = _group_run(kind)
    log = engine.step_log
    assert _rows(log, "g#0") == [(0, 0, 4)] + [(k, 3 + k, 1) for k in range(1, 10)]
    assert _rows(log, "g#1") == [(1, 3, 1), (2, 4, 1), (3, 5, 1), (4, 6, 1), (8, 3, 5), (9, 8, 1)]
    assert [r.preempted for r in log].count(("g#1",)) == 1 and log[5].preempted == ("g#1",)
    want = {0: [log[k].time for k in range(10)], 1: [log[k].time for k in (1, 2, 3, 4, 8, 9)]}

    final = outs[-1]
    assert final.finished and [c.finish_reason for c in final.outputs] == ["length", "stop"]
    if kind == "delta":  # this step's tokens and times only: a client joins them up
        tokens, times = ({i: [x for o in outs for c in o.outputs if c.index == i for x in getattr(c, field)]
                          for i in want} for field in ("token_ids", "token_times"))
    else:
        tokens, times = ({c.index: getattr(c, field) for c in final.outputs} for field in ("token_ids", "token_times"))
    assert [len(tokens[i]) for i in want] == [10, 6] and tokens[1][-1] == STOP
    assert times == want

    gaps = [b - a for ts in want.values() for a, b in zip(ts, ts[1:])]
    page = metric_samples(metrics.render().decode())
    assert metric_value(page, "vllm:inter_token_latency_seconds_count", tenant="t") == len(gaps) == 9 + 5
    assert metric_value(page, "vllm:inter_token_latency_seconds_sum", tenant="t") == pytest.approx(sum(gaps))
    # every gap is one step (~11 ms) but g#1's across its preemption (steps 4 -> 8, ~45 ms)
    assert metric_value(page, "vllm:inter_token_latency_seconds_bucket", tenant="t", le="0.025") == len(gaps) - 1


def _chunked_swap_run(mode: str):
    """``a`` (8-token prompt) then ``x`` (20-token prompt) on eight 4-token blocks and a 4-token budget: ``x``'s
    prompt goes in 3-token chunks beside ``a``'s decodes, until in step 7 the pool runs dry and ``x`` is pushed out
    with 15 of its 20 prompt tokens computed."""
    engine = tiny_engine(num_blocks=8, budget=4, max_len=32, preemption_mode=mode, num_cpu_blocks_override=16)
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=8, ignore_eos=True), request_id="a")
    engine.add_request(list(range(100, 120)), SamplingParams(max_tokens=2, ignore_eos=True), request_id="x")
    for _ in steps(engine):
        pass
    return engine.step_log


def test_a_prompt_swapped_out_at_its_cut_resumes_as_a_chunked_step():
    """``continued_prefill_steps`` forgot a prompt's cut at any preemption, so a swap that brings the prompt back
    where it stopped did not count the step carrying its next chunk (6 here, not 7).  The step log now names the
    victims it swapped.

    Hand count: ``a``'s prompt is cut at 4 (step 1 continues it); ``x``'s prompt is cut at 3, 6, 9, 12 (steps 3-6
    continue it), swapped out in step 7 with 15 computed, swapped back in step 9 at 15 (continues the cut) and its
    last prompt token is a row of its own in step 10 (continues): 1 + 4 + 2 = 7."""
    log = _chunked_swap_run("swap")
    assert _rows(log, "a")[:3] == [(0, 0, 4), (1, 4, 4), (2, 8, 1)]
    assert _rows(log, "x") == [(2, 0, 3), (3, 3, 3), (4, 6, 3), (5, 9, 3), (6, 12, 3), (9, 15, 4), (10, 19, 1),
                               (11, 20, 1)]
    assert [log[k].num_decodes for k in (9, 10, 11)] == [0, 0, 1]  # x alone: two prompt rows, then its decode
    assert log[7].preempted == ("x",) and log[7].swapped == ("x",) and log[7].swapped_out == 4
    assert continued_prefill_steps(log) == 7


def test_a_prompt_recomputed_after_a_preemption_starts_over():
    """The same run with recompute: ``x``'s prompt starts again at 0 in step 9 (not a continuation) and goes in
    4-token chunks, steps 10-13 continuing it: 1 + 4 + 4 = 9, and the log names no swapped victim."""
    log = _chunked_swap_run("recompute")
    assert _rows(log, "x")[5:] == [(9, 0, 4), (10, 4, 4), (11, 8, 4), (12, 12, 4), (13, 16, 4), (14, 20, 1)]
    assert log[7].preempted == ("x",) and log[7].swapped == ()
    assert continued_prefill_steps(log) == 9


def _record(k: int, rows, num_decodes: int, preempted=(), swapped=()) -> StepRecord:
    ids, starts, tokens = zip(*rows)
    return StepRecord(step=k, time=float(k), seq_ids=ids, seq_starts=starts, seq_tokens=tokens,
                      num_tokens=sum(tokens), preempted=preempted, swapped_out=0, swapped_in=0, rejected=(), failed=(),
                      free_blocks=0, available_blocks=0, running=len(rows), waiting=0, num_decodes=num_decodes,
                      swapped=swapped)


def test_only_a_swap_keeps_the_cut():
    """A hand-made log, counted by hand.  A's and B's prompts are cut at 8 in step 0.  Step 1 continues B to 16 (1)
    while A is swapped out; step 2 resumes A at its cut (2) while B is preempted by recompute; step 3 restarts B at
    16, its very cut, from cached blocks -- the rest of its prompt computed again in one step, as a cache hit, not a
    chunk (still 2)."""
    log = [_record(0, [("A", 0, 8), ("B", 0, 8)], 0),
           _record(1, [("B", 8, 8)], 0, preempted=("A",), swapped=("A",)),
           _record(2, [("A", 8, 8)], 0, preempted=("B",)),
           _record(3, [("A", 16, 1), ("B", 16, 4)], 1)]
    assert [continued_prefill_steps(log[:k + 1]) for k in range(len(log))] == [0, 1, 2, 2]
