""":func:`minivllm.sim.run.drive` keeps its module's promise: its own work per step is proportional to what changed,
never to everything running.

``StepRecord.seqs`` builds one ``(id, start, tokens)`` tuple per scheduled row on every read (256 tuples, ~6 us,
for a 256-decode step), so a driver that reads it once a step does work proportional to the whole batch whatever
changed.  Oracle: the count of those reads, which the promise makes 0 (the driver only needs to know whether the
step ran anything).
"""

from minivllm.metrics.step_log import StepRecord
from minivllm.sim.executor import SimulatedExecutor
from minivllm.sim.run import SimRequest, drive
from minivllm.labs.workloads import sim_engine


def test_drive_never_builds_the_step_records_rows(monkeypatch):
    reads = []
    rows = StepRecord.seqs

    def counting(self):
        reads.append(self.step)
        return rows.fget(self)

    monkeypatch.setattr(StepRecord, "seqs", property(counting))
    engine = sim_engine(executor=SimulatedExecutor(), max_num_seqs=16)
    reqs = [SimRequest(k, 0.01 * k, "default", list(range(10, 30 + k)), 5) for k in range(16)]
    rec = drive(engine, reqs)
    assert all(r.outcome == "ok" for r in rec.results) and len(rec.step_end_readings) > 5
    assert reads == []
