"""Replay of a run on a real clock: the arrival checks that end a wait fall at the same times in both runs."""

from __future__ import annotations

from minivllm.bench.replay import decisions
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.run import SimRequest, drive


def test_requests_arriving_while_a_real_clock_reads_late_join_no_step_the_replay_leaves_them_out_of(monkeypatch):
    """On a real clock the loop's first arrival check comes a moment after t0, and the check after an idle
    wait comes after the sleep's overshoot; a request arriving in that moment joined the step, while a replay
    (its virtual clock exactly at t0 or at the arrival) left it for the next one: the two step logs differed
    from step 0 (a request at 0.5 ms) and after a wait (a request 1.5 ms behind the one waited for).  A check
    that ends a wait is taken at the time waited for.  Oracle: the replay's own run, whose clock has no such
    moment.  The wall clock is a stand-in: every read costs 1 ms, every sleep overshoots by 2 ms."""
    import types

    import minivllm.sim.run as sim_run
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    class WallLike:  # no advance_to: drive sleeps, as on a real engine
        def __init__(self):
            self.sim = SimulatedExecutor(fixed_overhead_s=0.01, per_token_s=0.0, per_context_token_s=0.0)

        def now(self):
            self.sim.clock += 0.001
            return self.sim.clock - 0.001

        def execute(self, batch):
            return self.sim.execute(batch)

    def sleep(seconds):
        wall.sim.clock += seconds + 0.002

    monkeypatch.setattr(sim_run, "time", types.SimpleNamespace(perf_counter=sim_run.time.perf_counter, sleep=sleep))
    for arrivals in ((0.0, 0.0005), (0.0, 0.5, 0.5015)):
        reqs = [SimRequest(k, t, "t", list(range(10 + 20 * k, 30 + 20 * k)), 1 + 2 * k) for k, t in enumerate(arrivals)]
        wall = WallLike()
        real = sim_engine(executor=wall, num_blocks=64, max_num_seqs=8)
        rec = drive(real, reqs)
        replay = sim_engine(executor=ReplayExecutor(rec.check_after_step), num_blocks=64, max_num_seqs=8)
        rec_replay = drive(replay, reqs)
        assert rec_replay.injected_before_step == rec.injected_before_step
        assert decisions(replay) == decisions(real)


def test_a_sleep_cut_short_injects_no_request_before_its_arrival(monkeypatch):
    """drive's promise after a wait: a sleep that wakes early (a signal; a clock other than the sleep's) checks
    the clock again, and a request joins only once its arrival has come.  Oracle: the wall clock stand-in's own
    time at each ``add_request``, never before the request's ``arrival_time``.  The stand-in's sleep wakes after
    half the time asked."""
    import types

    import minivllm.sim.run as sim_run
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    class Wall:  # no advance_to: drive sleeps
        def __init__(self):
            self.sim = SimulatedExecutor(fixed_overhead_s=0.01, per_token_s=0.0, per_context_token_s=0.0)

        def now(self):
            return self.sim.clock

        def execute(self, batch):
            return self.sim.execute(batch)

    wall = Wall()
    monkeypatch.setattr(sim_run, "time", types.SimpleNamespace(
        perf_counter=sim_run.time.perf_counter, sleep=lambda s: setattr(wall.sim, "clock", wall.sim.clock + s / 2)))
    engine = sim_engine(executor=wall, num_blocks=64, max_num_seqs=8)
    early = []
    add = engine.add_request

    def watched(*args, arrival_time=None, **kwargs):
        if wall.now() < arrival_time:
            early.append((kwargs.get("request_id"), wall.now(), arrival_time))
        return add(*args, arrival_time=arrival_time, **kwargs)

    engine.add_request = watched
    reqs = [SimRequest(k, t, "t", list(range(10 + 20 * k, 30 + 20 * k)), 2) for k, t in enumerate((0.0, 0.5, 1.5))]
    rec = drive(engine, reqs)
    assert [r.outcome for r in rec.results] == ["ok"] * 3
    assert not early, early
