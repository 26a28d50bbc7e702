"""Replay of a run on a real clock: the engine's estimates (step time, prefill-rate fit, retry hints) are fed the
same times in both runs, so auto mode decides the same way."""

from __future__ import annotations

import types

import pytest

from minivllm.bench.replay import decisions
from minivllm.config import TenantConfig
from minivllm.labs.workloads import sim_engine
from minivllm.sim.executor import SimulatedExecutor
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.run import SimRequest, drive


class WallLike:
    """A wall clock stand-in (no advance_to: drive sleeps, as on a real engine): steps cost what the linear
    executor says (5 ms + 0.2 ms a token: a true prefill rate of 5000 tokens/s), and every read of the clock
    costs 0.1 to 1.9 ms of host work, varying from read to read, as a real step's detokenization and
    bookkeeping do."""

    def __init__(self):
        self.sim = SimulatedExecutor(fixed_overhead_s=0.005, per_token_s=0.0002, per_context_token_s=0.0)
        self.reads = 0

    def now(self):
        self.reads += 1
        t = self.sim.clock
        self.sim.clock += 0.0001 * (1 + (self.reads * 7919) % 19)
        return t

    def execute(self, batch):
        return self.sim.execute(batch)


def _record_and_replay(monkeypatch, requests, origin=0.0, **options):
    import minivllm.sim.run as sim_run

    wall = WallLike()
    wall.sim.clock = origin  # where the clock stands when the run begins (perf_counter: seconds since boot)

    def sleep(seconds):  # a sleep overshoots by 2 ms
        wall.sim.clock += seconds + 0.002

    monkeypatch.setattr(sim_run, "time", types.SimpleNamespace(perf_counter=sim_run.time.perf_counter, sleep=sleep))
    options.setdefault("preemption_mode", "auto")
    real = sim_engine(executor=wall, **options)
    rec = drive(real, requests)
    replay = sim_engine(executor=ReplayExecutor.from_record(rec), **options)
    return real, rec, replay, drive(replay, requests)


def test_a_replay_swaps_and_recomputes_the_victims_the_real_run_did(monkeypatch):
    """The engine read the clock at each stage after the forward pass (append, finish, the step log) and its
    step-time average and prefill-rate fit took append's reading, while a replay's clock stood at drive's
    next arrival check: the two fits were fed step times that differed by a varying moment of host work.  With
    the host link priced near the learnt rate (11 MB/s: swapping a victim's blocks out and back costs about
    what recomputing its tokens does), auto mode chose differently: at step 12 the real run swapped r6 out
    (4 blocks) where its replay recomputed it, having learnt 7254 prefill tokens/s against the real run's 5008
    (the stand-in's true rate: 5000).  The engine now reads the clock once per step, right after the forward
    pass, and drive checks arrivals at that reading.  Oracle: the recorded run itself (issue 11's promise: a
    replay schedules as the run did)."""
    requests = [SimRequest(k, 0.003 * k, "t", list(range(10 + k, 10 + k + 20 + (k * 37) % 60)), 8 + (k * 5) % 30)
                for k in range(24)]
    real, rec, replay, rec_replay = _record_and_replay(
        monkeypatch, requests, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=64, swap_bandwidth_gbps=0.011)
    # the run is worth replaying: victims on both sides of the threshold (swapped, and recomputed)
    assert any(r.swapped_out for r in real.step_log) and any(r.preempted and not r.swapped_out for r in real.step_log)
    assert real._prefill_fit.rate() is not None  # and its fit is trusted (it moves the threshold)
    assert decisions(replay) == decisions(real)
    assert rec_replay.injected_before_step == rec.injected_before_step
    assert replay.step_time_s == real.step_time_s
    assert replay._learnt_costs.prefill_tokens_per_s == real._learnt_costs.prefill_tokens_per_s
    # every time the engine stamped is the replay's too: token times, finishes, the step log
    def stamps(r):
        return [r.ttft, r.e2e, *r.itl]

    assert [stamps(r) for r in rec_replay.results] == [stamps(r) for r in rec.results]
    assert [r.time for r in replay.step_log] == [r.time for r in real.step_log]


def test_a_replay_gives_rejected_requests_the_retry_hints_the_real_run_gave(monkeypatch):
    """Retry hints are the step-time average times the steps to wait: fed other step times, the replay told
    rejected callers other things (every one of 36 hints differed: 0.011 s in the run, 0.016 s in its replay).
    Oracle: the recorded run's hints."""
    requests = [SimRequest(k, 0.004 * k, "t", list(range(10 + k, 18 + k + (k * 37) % 90)), 3 + (k * 5) % 12)
                for k in range(40)]
    real, rec, replay, rec_replay = _record_and_replay(
        monkeypatch, requests, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
        tenants={"t": TenantConfig(max_running=2, over_cap="reject")})
    hints = [(r.index, r.retry_after) for r in rec.results if r.outcome == "rejected"]
    assert len(hints) > 10
    assert [(r.index, r.retry_after) for r in rec_replay.results if r.outcome == "rejected"] == hints
    assert decisions(replay) == decisions(real)
    assert replay.step_time_s == real.step_time_s


@pytest.mark.parametrize("origin", [17384.123456, 0.3])  # a clock from boot; one the run outlasts many times
def test_a_replay_reads_the_recorded_clock_so_tied_deadlines_tie_again(monkeypatch, origin):
    """A deadline is ``arrival + gap`` on the engine's clock, and the deadline policy's key is
    ``min(deadline, arrival + deadline_aging_s)``.  Here several keys tie exactly in real arithmetic (gaps of
    1, 10 and 40 ms against an aging of 50 ms, arrivals on a 1 ms grid).  On a clock counting from boot (17,384 s)
    those sums round to one float or its neighbour; on a replay clock from 0 they round otherwise, and the tie is
    broken the other way: the replay served another request first (the bench ``replay`` grid found it on the
    bundled model).  ``ReplayExecutor.from_record`` now starts at the recorded clock's origin and replays its
    very readings (not the origin plus each time after it, which can round where the run outlasts the origin).
    Oracle: the recorded run's own step log and estimates, compared exactly."""
    from minivllm.bench.replay import workload

    requests = workload(0, ("a", "b"), False, 49152, deadlines=True)
    options = dict(num_blocks=14, max_num_seqs=5, max_num_batched_tokens=40, scheduling_policy="deadline",
                   deadline_aging_s=0.05, preemption_mode="recompute")
    real, rec, replay, rec_replay = _record_and_replay(monkeypatch, requests, origin=origin, **options)
    assert rec.clock_origin == origin
    assert decisions(replay) == decisions(real)
    assert replay.step_time_s == real.step_time_s  # exactly: the same readings, the same sums
    assert rec_replay.step_end_readings == rec.step_end_readings
    if origin < 1:
        return
    # the hazard is real in this workload: the same times on a clock from 0 decide otherwise
    from_zero = sim_engine(executor=ReplayExecutor(list(rec.step_ends), tokens=rec.output_token_ids), **options)
    drive(from_zero, requests)
    assert decisions(from_zero) != decisions(real)
