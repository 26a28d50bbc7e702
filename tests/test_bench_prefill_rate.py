"""``python -m minivllm.bench prefill_rate``'s arithmetic, on a simulated engine whose step times are known.

The benchmark reads a real run's step log; here the same functions read a simulated run's, where every step
takes ``a + b * prefill tokens + c * decode rows`` exactly, so the least-squares check must return 1 / b, the
baseline must equal a hand-rolled moving average, and each row must be counted as the engine counts it.
"""

from __future__ import annotations

import argparse
import dataclasses

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


def _run(blocks: int = 4096, max_len: int = 256, executor=None, **options):
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=6,
                       max_model_len=max_len, device="cpu", **options)
    engine = LLMEngine(cfg, executor=executor or _Exact(), model_max_len=256, eos_token_ids=set())
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


SWAP_S = 0.05  # each block moved over the host link: time that is neither prefill nor decode


class _ExactWithSwaps(_Exact):
    def step_time(self, batch) -> float:
        return super().step_time(batch) + SWAP_S * (len(batch.moves.swap_in) + len(batch.moves.swap_out))


def test_steps_that_move_kv_over_the_host_link_are_left_out():
    """A swap step's time holds copies, so its (tokens, time) would bias the check; the step after it is timed
    from the swap step's end, not from the step before."""
    engine, lens = _run(24, 96, _ExactWithSwaps(), preemption_mode="swap", num_cpu_blocks_override=256)
    assert any(rec.swapped_in or rec.swapped_out for rec in engine.step_log)  # the run did swap
    terms = step_terms(engine.step_log, lens)
    assert terms
    for p, d, dt in terms:
        assert dt == pytest.approx(A + B * p + C * d)  # no swap time in any kept step


def test_a_record_without_the_decode_count_reads_one_token_past_the_prompt_as_a_decode():
    """Records built by hand carry no ``num_decodes``; the fallback must agree with the engine's count where
    there is no preemption (the first decode starts exactly at the prompt's length), and never count a row of
    several tokens as a decode (a decode computes one token), even a re-prefill chunk past the prompt."""
    engine, lens = _run()
    counted = step_terms(engine.step_log, lens)
    bare = [dataclasses.replace(rec, num_decodes=None) for rec in engine.step_log]
    assert step_terms(bare, lens) == counted

    cfg = EngineConfig(num_gpu_blocks_override=16, block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
                       max_model_len=64, device="cpu")
    engine = LLMEngine(cfg, executor=_Exact(), model_max_len=256, eos_token_ids=set())
    lens = {}
    for k in range(4):  # short prompts, long answers, a budget of 8: re-prefills in chunks past the prompt
        prompt = list(range(5, 8 + k))
        lens[engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, ignore_eos=True))] = len(prompt)
    while engine.has_unfinished_requests():
        engine.step()
    records = [rec for rec in engine.step_log]
    assert any(n > 1 and start >= lens[rid] for rec in records for rid, start, n in rec.seqs)
    bare = [dataclasses.replace(rec, num_decodes=None) for rec in records]
    timed = [rec for rec, last in zip(records[1:], records) if rec.seq_ids and rec.time > last.time]
    for (p, d, _), rec in zip(step_terms(bare, lens), timed, strict=True):
        assert d <= sum(1 for n in rec.seq_tokens if n == 1)
        assert p + d == rec.num_tokens


def test_the_report_is_read_from_the_run_it_served(tmp_path, monkeypatch):
    """``main`` end to end on the simulated engine (the real model stands behind ``LLM`` in a real run): the
    requests it serves, the flag saying whether the fit replaced the probe, the per-step means and the baseline
    are recomputed here from the same engine's step log."""
    import json
    from types import SimpleNamespace

    import minivllm
    from minivllm.bench import prefill_rate

    engines = []

    class SimulatedLLM:
        def __init__(self, *, preemption_mode, device, max_num_seqs, max_num_batched_tokens, max_model_len):
            cfg = EngineConfig(num_gpu_blocks_override=4096, block_size=4, max_num_batched_tokens=max_num_batched_tokens,
                               max_num_seqs=max_num_seqs, max_model_len=max_model_len, device="cpu",
                               preemption_mode=preemption_mode)
            self.engine = LLMEngine(cfg, executor=_Exact(), model_max_len=max_model_len, eos_token_ids=set())
            self.engine.model_runner = SimpleNamespace(measure_prefill_rate=lambda n: 1 / B)  # the plain prefill
            engines.append(self.engine)

        def close(self) -> None:
            pass

    monkeypatch.setattr(minivllm, "LLM", SimulatedLLM)
    path = tmp_path / "result.json"
    argv = ["--requests", "9", "--max-num-seqs", "3", "--budget", "48", "--prompt-range", "8,40",
            "--output-range", "4,12", "--json", str(path)]
    assert prefill_rate.main(argv) == 0
    doc = json.loads(path.read_text())
    (engine,) = engines
    served = {rid for rec in engine.step_log for rid in rec.seq_ids}
    assert len(served) == 9 == doc["requests"]  # one new request per finish, until --requests were added
    lens = {rid: 0 for rid in served}
    for rec in engine.step_log:  # a prompt's length: where its first decode row starts
        for i, (rid, start, _) in enumerate(rec.seqs):
            if i < rec.num_decodes and not lens[rid]:
                lens[rid] = start
    terms = step_terms(engine.step_log, lens)
    with_prefill = [t for t in terms if t[0]]
    assert doc["steps"] == len(terms) and doc["steps_with_prefill"] == len(with_prefill)
    assert doc["mean_prefill_tokens_in_prefill_steps"] == pytest.approx(sum(p for p, _, _ in with_prefill) / len(with_prefill))
    assert doc["mean_decode_rows_in_prefill_steps"] == pytest.approx(sum(d for _, d, _ in with_prefill) / len(with_prefill))
    assert doc["startup_probe_rate"] == 1000.0  # no model runner at start-up: the engine's default rate
    assert doc["learnt_rate"] == pytest.approx(1 / B) and doc["learnt_from_fit"] is True  # exact steps: the fit is 1 / b
    assert doc["whole_step_rate_baseline"] == pytest.approx(whole_step_rate(terms, 1000.0))
    assert doc["least_squares"]["rate"] == pytest.approx(1 / B)
    assert doc["plain_prefill_rate"] == {"64": 1 / B, "128": 1 / B, "256": 1 / B}


def test_a_step_after_an_empty_one_is_timed_from_the_empty_steps_end():
    """The engine's fit restarts its clock at the end of every step, one that ran nothing included
    (``LLMEngine._observe_step`` reads ``now`` for each), so the benchmark's terms must too: a step after an empty
    one (here 3 ms after it) took those 3 ms, not the empty step's time as well.  The log is a simulated run's with
    one empty record put in by hand.  Oracle: the hand subtraction of the two clock readings."""
    engine, lens = _run()
    log = list(engine.step_log)
    k = next(i for i in range(1, len(log)) if log[i].seq_ids and log[i - 1].seq_ids)
    empty = dataclasses.replace(log[k - 1], seq_ids=(), seq_starts=(), seq_tokens=(), seq_tenants=(), num_tokens=0,
                                num_decodes=0, time=log[k].time - 0.003)
    terms = step_terms(log[:k] + [empty] + log[k:], lens)
    assert len(terms) == len(log) - 1
    p, d, dt = terms[k - 1]  # the term of log[k]: the empty record adds none of its own
    assert (p, d) == (log[k].num_tokens - log[k].num_decodes, log[k].num_decodes) and dt == pytest.approx(0.003)
