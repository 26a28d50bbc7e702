"""The step after a preemption admits nothing (the scheduler's thrash guard): a pause of one step, not a stall."""

from __future__ import annotations

from minivllm.bench.replay import decisions
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.run import SimRequest, drive


def _timed(engine):
    """Each step's decisions with the time the engine logged it: a virtual clock must land on the real one."""
    return list(zip((r.time for r in engine.step_log), decisions(engine)))


def test_a_step_left_empty_by_the_thrash_guard_is_not_an_idle_wait_for_the_next_arrival(monkeypatch):
    """r0 grows into a full pool and preempts r1 in the step that gives r0 its last token; the next step admits
    nothing (admit pauses a step after a preemption made while allocating) and, r0 being done, runs nothing.
    A real engine steps again at once and r1 runs in the step after; on a virtual clock drive took the empty
    step for a stall and moved the clock to the next arrival (5 s later): r1 waited 5 s for nothing in a
    simulation, and a replay of a real run left its step times from there on (the tiny model's three_class
    grid: 2 of 30 seeds).  Oracle: drive on an executor without advance_to, as on a real engine."""
    import types

    import minivllm.sim.run as sim_run
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    class RealLike:  # no advance_to: drive steps and sleeps as it does on a real engine
        def __init__(self):
            self.sim = SimulatedExecutor()

        def now(self):
            return self.sim.now()

        def execute(self, batch):
            return self.sim.execute(batch)

    def sleep(seconds):  # the wall clock is the executor's: a sleep moves it by exactly as long
        real.executor.sim.clock += seconds

    monkeypatch.setattr(sim_run, "time", types.SimpleNamespace(perf_counter=sim_run.time.perf_counter, sleep=sleep))

    reqs = [SimRequest(0, 0.0, "t", list(range(10, 27)), 2), SimRequest(1, 0.0, "t", list(range(100, 132)), 8),
            SimRequest(2, 5.0, "t", list(range(300, 310)), 2)]
    virtual = sim_engine(num_blocks=4, max_num_seqs=4)
    drive(virtual, reqs)
    log = list(virtual.step_log)
    pause = next(k for k, r in enumerate(log) if not r.seqs and r.waiting)
    assert log[pause - 1].preempted == ("r1",) and log[pause].running == 0  # the guard's pause, nothing running
    assert log[pause + 1].seqs[0][0] == "r1" and log[pause + 1].time < 1.0  # r1 runs next, not after r2 arrives

    real = sim_engine(executor=RealLike(), num_blocks=4, max_num_seqs=4)
    rec = drive(real, reqs)
    assert _timed(virtual) == _timed(real)
    replay = sim_engine(executor=ReplayExecutor(rec.check_after_step), num_blocks=4, max_num_seqs=4)
    rec_replay = drive(replay, reqs)
    assert rec_replay.injected_before_step == rec.injected_before_step
    assert decisions(replay) == decisions(real)
