"""Real engine vs simulator: with the real run's step times replayed, the scheduling decisions are identical.

The simulator's whole claim is that it runs the *real* scheduler and only fakes
the clock.  So: run a small open-loop arrival sequence through the real engine
on the bundled model (chunked prefill, a seat limit, requests arriving
mid-run), record the clock at every step boundary, replay those times in a
:class:`~minivllm.sim.replay.ReplayExecutor`, and compare the two step logs
entry by entry.  The oracle is the real run itself.
"""

from __future__ import annotations

import pytest

from minivllm.bench.replay import decisions
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.run import SimRequest, drive


@pytest.mark.slow
def test_replayed_step_times_give_identical_step_logs(tokenizer):
    options = dict(max_num_batched_tokens=48, max_num_seqs=3, num_gpu_blocks_override=24, max_model_len=128,
                   device="cpu")
    ids = tokenizer.encode("The history of computing is a story of layers, " * 8)
    # arrivals spread over the run (spaced well beyond a sleep's overshoot), prompts longer than the token budget
    spec = [(0.0, 30, 6), (0.0, 70, 4), (0.12, 12, 8), (0.25, 55, 5), (0.6, 20, 6), (0.61, 90, 3), (1.5, 16, 4)]
    reqs = [SimRequest(i, t, "a" if i % 2 else "b", ids[i:i + n], m) for i, (t, n, m) in enumerate(spec)]

    real = LLMEngine(EngineConfig(**options))
    rec = drive(real, reqs)
    assert all(r.outcome == "ok" for r in rec.results)
    real_log = decisions(real)
    # the run is worth replaying: chunked prefills, mixed batches, requests joining mid-run
    assert any(n > 1 and start > 0 for rec_ in real.step_log for _, start, n in rec_.seqs)
    assert any(len(r.seqs) > 1 and any(n == 1 for _, _, n in r.seqs) and any(n > 1 for _, _, n in r.seqs)
               for r in real.step_log)
    assert rec.injected_before_step == sorted(rec.injected_before_step) and rec.injected_before_step[-1] == len(reqs)
    if rec.step_ends[0] < 0.1:  # a machine not starved by other processes: the late arrivals joined mid-run
        assert rec.injected_before_step[0] < len(reqs)

    sim = LLMEngine(EngineConfig(**options), executor=ReplayExecutor.from_record(rec), model_max_len=8192,
                    eos_token_ids=set())
    rec_sim = drive(sim, reqs)
    assert decisions(sim) == real_log
    assert rec_sim.injected_before_step == rec.injected_before_step
    # and the clocks agree at every step boundary, so the latencies the two report agree too
    assert rec_sim.check_after_step == rec.check_after_step


def test_a_replayed_idle_step_keeps_its_own_end_time():
    """A step can run nothing (the admission policy holds every request back until a second one arrives); drive
    then waits for the next arrival.  The replay must end that step where the recorded one ended, not after the
    wait: every field of the two step logs, times included, is the same.  Oracle: the recorded run (steps of
    exactly 1 s on the linear executor: idle step at 0 s, then steps ending at 6 s and 7 s)."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    class Pairs:  # admit only two at a time
        def order(self, waiting, running):
            return list(waiting) if len(waiting) >= 2 else []

    reqs = [SimRequest(0, 0.0, "t", list(range(10, 30)), 2), SimRequest(1, 5.0, "t", list(range(11, 31)), 2)]

    def engine(executor):
        return sim_engine(executor=executor, admission_policy=Pairs(), num_blocks=64, max_num_seqs=8)

    real = engine(SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0))
    rec = drive(real, reqs)
    assert [r.time for r in real.step_log] == [0.0, 6.0, 7.0] and not real.step_log[0].seqs
    replay = engine(ReplayExecutor(rec.check_after_step))
    rec_replay = drive(replay, reqs)
    assert list(replay.step_log) == list(real.step_log)
    assert [(r.ttft, r.e2e) for r in rec_replay.results] == [(r.ttft, r.e2e) for r in rec.results]


def test_drive_refuses_requests_out_of_arrival_order():
    """drive admits a prefix of its list, so a request listed after a later one would wait for it (here: one
    arriving at 0 s behind one at 5 s would start at 5 s).  An unsorted list is refused with the culprit named;
    sorted, the 0 s request starts at once (oracle: 1 s steps of the linear executor, first token after 1 s)."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    late, early = SimRequest(0, 5.0, "t", list(range(10, 30)), 2), SimRequest(1, 0.0, "t", list(range(11, 31)), 2)

    def engine():
        return sim_engine(executor=SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0),
                          num_blocks=64, max_num_seqs=8)

    with pytest.raises(ValueError, match=r"sorted by arrival: request 1 arrives at 0 s"):
        drive(engine(), [late, early])
    rec = drive(engine(), [early, late])
    assert [(r.index, r.ttft) for r in rec.results] == [(1, 1.0), (0, 1.0)]


def test_sim_runs_kv_usage_mean_is_weighted_by_time():
    """``sim run``'s mean KV usage weighs each sample by how long it held, idle stretches included.  Hand count
    (1 s steps, 64 blocks of 16): a 20-token prompt with 2 outputs holds 2 blocks from its first step's end
    (1 s) to its second's (2 s), then nothing; a second one arrives at 10 s: 2 block-seconds each over 12 s is
    4 / 64 / 12 = 1/192.  The plain mean of the four samples taken after steps said 1/64, three times more."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor
    from minivllm.sim.run import report_extras

    engine = sim_engine(executor=SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0),
                        num_blocks=64, max_num_seqs=8)
    reqs = [SimRequest(0, 0.0, "t", list(range(10, 30)), 2), SimRequest(1, 10.0, "t", list(range(40, 60)), 2)]
    rec = drive(engine, reqs)
    assert rec.duration == 12.0 and [round(u * 64) for _, u in rec.kv_usage] == [2, 0, 2, 0]
    assert report_extras(engine, rec)["kv_usage_mean"] == pytest.approx(1 / 192)


def test_sim_runs_kv_usage_mean_counts_every_step_not_only_the_samples():
    """The mean must not depend on how often the curve is sampled.  Oracle: the same run sampled after every
    step (``kv_samples`` far above the step count), its samples integrated by hand, each held until the next.
    With one sample over the run, a sample-and-hold mean reads the few sampled levels for the whole run."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor
    from minivllm.sim.run import report_extras

    def run(kv_samples: int):
        engine = sim_engine(executor=SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0),
                            num_blocks=64, max_num_seqs=8)
        reqs = [SimRequest(k, 3.0 * k, "t", list(range(100 * k, 100 * k + 16 + 20 * k)), 4 + 3 * k) for k in range(6)]
        rec = drive(engine, reqs, kv_samples=kv_samples)
        return rec, report_extras(engine, rec)["kv_usage_mean"]

    dense, exact = run(10_000)
    assert len(dense.kv_usage) >= len(dense.step_ends)  # every step sampled
    span = max(dense.duration, dense.kv_usage[-1][0])
    area = sum(u * (t_next - t) for (t, u), (t_next, _) in zip(dense.kv_usage, [*dense.kv_usage[1:], (span, 0.0)]))
    assert exact == pytest.approx(area / span) and exact > 0
    sparse, mean = run(1)
    assert len(sparse.kv_usage) < len(sparse.step_ends) / 2  # sampled far less often than it stepped...
    assert mean == pytest.approx(exact)  # ...and the same mean


def test_sim_runs_kv_usage_peak_is_the_peak_of_every_step():
    """``sim run`` samples KV usage at most ``kv_samples`` times over the run, but its "peak" must be the
    highest usage any step left, not the highest sample.  Hand count (1 s steps, 64 blocks of 16; one sample
    every 20 s, the span of the arrivals): 20-token prompts with 2 outputs hold 2 blocks after their first step
    (1 s and 21 s, both sampled); a 40-token one arriving at 5 s holds 3 blocks after its first step (6 s),
    between samples.  The sampled peak said 2/64."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor
    from minivllm.sim.run import report_extras

    engine = sim_engine(executor=SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0),
                        num_blocks=64, max_num_seqs=8)
    reqs = [SimRequest(0, 0.0, "t", list(range(10, 30)), 2), SimRequest(1, 5.0, "t", list(range(40, 80)), 2),
            SimRequest(2, 20.0, "t", list(range(100, 120)), 2)]
    rec = drive(engine, reqs, kv_samples=1)
    assert report_extras(engine, rec)["kv_usage_peak"] == pytest.approx(3 / 64)
