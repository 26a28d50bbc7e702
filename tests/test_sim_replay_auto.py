"""Replay of a real run in auto preemption mode: the replayed engine starts from the recorded engine's
measured costs, so it swaps and recomputes the same victims."""

from __future__ import annotations

from minivllm.bench.replay import decisions
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.run import SimRequest, drive


def test_a_replayed_auto_mode_run_starts_from_the_recorded_engines_measured_costs(tmp_path, monkeypatch):
    """Auto mode prices a recompute by a prefill rate the real engine *times* at start-up (and a swap by a timed
    link), which no step time carries: a plain replay started from the simulator's guess, 1,000 tokens/s, where
    a tiny model on a CPU measures thousands to tens of thousands, and swapped the victims the real run
    recomputed (steps 13 and 14 here: 2 blocks swapped out against none).  Its fit could not correct that: a
    rate 20x away from its prior is distrusted.  The probe is pinned at 50,000 tokens/s so the choice does not
    hang on this machine's speed; the link is 3 MB/s (it was 10) because the real engine's fit also learns from its
    timed steps, and under CI's parallel load it once fell below the 10 MB/s crossover (~5k tokens/s) and swapped.
    At 3 MB/s (crossover ~1.5k) a replay that ignores the recorded costs still swaps from its 1,000 tokens/s guess.  Oracle: the real run's own step log, preemption kinds included."""
    from minivllm.model.runner import ModelRunner
    from tests.paged_cases import make_tiny_llama

    monkeypatch.setattr(ModelRunner, "measure_prefill_rate", lambda self, num_tokens: 50_000.0)
    options = dict(model=make_tiny_llama(tmp_path), device="cpu", dtype="float32", max_num_batched_tokens=48,
                   max_num_seqs=4, num_gpu_blocks_override=8, num_cpu_blocks_override=16, max_model_len=128,
                   preemption_mode="auto", swap_bandwidth_gbps=0.003)  # a slow link: recompute wins above ~1.5k tok/s
    reqs = [SimRequest(i, 0.0, "t", list(range(10 + i, 30 + i)), 24) for i in range(4)]
    real = LLMEngine(EngineConfig(**options))
    rec = drive(real, reqs)
    assert any(r.preempted for r in real.step_log) and not any(r.swapped_out for r in real.step_log)
    sim = LLMEngine(EngineConfig(**options), executor=ReplayExecutor.from_record(rec), eos_token_ids=set())
    drive(sim, reqs)
    assert decisions(sim) == decisions(real)
