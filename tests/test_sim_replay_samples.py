"""Replay of a run with ``n > 1`` requests: drive submits the samples and records each one's tokens."""

from __future__ import annotations

import pytest

from minivllm.bench.replay import decisions
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.run import SimRequest, drive


@pytest.mark.slow
def test_a_replay_of_a_run_with_samples_gives_the_identical_stepdecisions(tmp_path):
    """Samples of one prompt fork its prefill (one prefill row, then one decode row per sample), and with a
    prefix cache greedy samples' equal output blocks are cached once: what a replay writes for each sample
    decides what it shares, so drive records the tokens under the engine's sample ids.  Oracle: the recorded
    run on the real (tiny, random-weight) model; the replay must schedule, share and free exactly as it did,
    and a request's result counts the tokens of all its samples."""
    from tests.paged_cases import make_tiny_llama

    options = dict(model=make_tiny_llama(tmp_path), device="cpu", dtype="float32", max_num_batched_tokens=64,
                   max_num_seqs=8, num_gpu_blocks_override=40, max_model_len=128, enable_prefix_caching=True)
    prompt = list(range(100, 124))
    # 20 outputs: each sample fills the block past its 24-token prompt, the twin blocks the cache holds once
    reqs = [SimRequest(0, 0.0, "a", prompt, 20, n=3), SimRequest(1, 0.0, "b", list(range(200, 230)), 6),
            SimRequest(2, 0.002, "a", prompt, 20, n=2)]
    real = LLMEngine(EngineConfig(**options))
    rec = drive(real, reqs)
    assert [r.outcome for r in rec.results] == ["ok"] * 3
    assert [r.output_tokens for r in rec.results] == [60, 6, 40]
    assert sorted(rec.output_token_ids) == ["r0#0", "r0#1", "r0#2", "r1", "r2#0", "r2#1"]
    assert all(len(rec.output_token_ids[f"r0#{k}"]) == 20 for k in range(3))
    assert any(s.startswith("r0#1") and n == 1 for r in real.step_log for s, _, n in r.seqs)  # a sample decodes

    replay = LLMEngine(EngineConfig(**options), executor=ReplayExecutor.from_record(rec), eos_token_ids=set())
    rec_replay = drive(replay, reqs)
    assert decisions(replay) == decisions(real)
    assert rec_replay.output_token_ids == rec.output_token_ids
    assert [r.output_tokens for r in rec_replay.results] == [60, 6, 40]
