"""``python -m minivllm.bench prefill_rate``'s arithmetic, on a simulated engine whose step times are known.

The benchmark reads a real run's step log; here the same functions read a simulated run's, where every step
takes ``a + b * prefill tokens + c * decode rows`` exactly, so the least-squares check must return 1 / b, the
baseline must equal a hand-rolled moving average, and each row must be counted as the engine counts it.
"""

from __future__ import annotations

import argparse

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.bench.prefill_rate import int_range, least_squares, step_terms, whole_step_rate
from minivllm.sim import SimulatedExecutor

A, B, C = 0.010, 0.0005, 0.002


class _Exact(SimulatedExecutor):
    def step_time(self, batch) -> float:
        p = sum(s.num_tokens for s in batch.seqs if not s.is_decode)
        d = sum(1 for s in batch.seqs if s.is_decode)
        return A + B * p + C * d


def _run(blocks: int = 4096, max_len: int = 256):
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=6,
                       max_model_len=max_len, device="cpu")
    engine = LLMEngine(cfg, executor=_Exact(), model_max_len=256, eos_token_ids=set())
    lens = {}
    for k in range(10):
        prompt = list(range(5, 5 + 7 + 5 * k))
        rid = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=6 + k, ignore_eos=True))
        lens[rid] = len(prompt)
    while engine.has_unfinished_requests():
        engine.step()
    return engine, lens


def test_step_terms_count_rows_as_the_engine_does_and_time_each_step():
    engine, lens = _run()
    terms = step_terms(engine.step_log, lens)
    assert len(terms) == len(engine.step_log) - 1  # each step timed from the one before; the first has none
    for p, d, dt in terms:
        assert dt == pytest.approx(A + B * p + C * d)
    assert sum(d for _, d, _ in terms) > 0 and sum(p for p, _, _ in terms) > 0


def test_a_recompute_chunk_past_the_prompt_is_prefill():
    engine, lens = _run(blocks=24, max_len=96)  # too few blocks for six requests: recompute preemptions
    assert engine.scheduler.stats.num_preemptions > 0
    for p, d, dt in step_terms(engine.step_log, lens):
        assert dt == pytest.approx(A + B * p + C * d)  # the executor's own split of every step


def test_least_squares_recovers_the_costs_and_the_baseline_is_the_old_moving_average():
    engine, lens = _run()
    terms = step_terms(engine.step_log, lens)
    ls = least_squares(terms)
    assert ls["rate"] == pytest.approx(1 / B) and ls["per_decode_row_s"] == pytest.approx(C)
    rate = 1000.0
    for p, d, dt in terms:
        if p:
            rate = 0.8 * rate + 0.2 * (p + d) / dt
    assert whole_step_rate(terms, 1000.0) == pytest.approx(rate)
    assert whole_step_rate(terms, 1000.0) < 0.9 / B  # the baseline's bias: decode rows and the step's cost


@pytest.mark.parametrize("text", ["5", "5,5", "0,4", "a,b", "9,3"])
def test_int_range_refuses_what_is_not_lo_below_hi(text):
    with pytest.raises(argparse.ArgumentTypeError):
        int_range(text)
    assert int_range("8,40") == (8, 40)
