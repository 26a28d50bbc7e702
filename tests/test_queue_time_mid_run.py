"""Queue time of a request that arrives while the engine is busy, on a clock that moves between reads.

A step starts at the end of the step before (``ScheduledBatch.started``), so a request added between two steps
-- after the last one's end, before the next one begins, as a server's engine thread adds every request that
comes in while it decodes -- arrived *after* the step that first schedules it started.  Oracle: the definition
(arrival to first scheduling: ``RequestMetrics.queue_time``) and ``ScheduledBatch.started``'s promise that a
request stops queueing when its first step begins, never before it arrived.  Scheduled in the very next step
with a seat free, it queued 0 s; stamped with the step's start alone it queued a negative time, which the
Prometheus histogram clamps but the per-tenant ``queue_time_s`` sum does not."""

from __future__ import annotations

from minivllm.labs.workloads import sim_engine
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor


class ReadsCost:
    """A wall clock stand-in: steps cost 10 ms, every read of the clock 1 ms of host work (no advance_to)."""

    def __init__(self) -> None:
        self.sim = SimulatedExecutor(fixed_overhead_s=0.01, per_token_s=0.0, per_context_token_s=0.0)

    def now(self) -> float:
        self.sim.clock += 0.001
        return self.sim.clock - 0.001

    def execute(self, batch):
        return self.sim.execute(batch)


def test_a_request_added_between_two_busy_steps_queues_zero_not_a_negative_time():
    engine = sim_engine(executor=ReadsCost(), num_blocks=64, max_num_seqs=4)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request({"prompt_token_ids": list(range(10, 30))}, params, "a", tenant="t")
    done = {}
    for _ in range(2):
        done.update({o.request_id: o.metrics for o in engine.step() if o.finished})
    end = engine.step_log[-1].time
    engine.add_request({"prompt_token_ids": list(range(40, 60))}, params, "b", tenant="t")  # busy: a decodes
    b = engine.requests["b"]
    assert b.arrival_time > end  # the case: it came in after the last step ended
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.metrics for o in engine.step() if o.finished})
    assert done["b"].first_scheduled_time >= done["b"].arrival_time
    assert done["b"].queue_time == 0.0  # scheduled by the first step after it arrived, seats free
    assert done["a"].queue_time == 0.0
    assert engine.stats()["per_tenant"]["t"]["queue_time_s"] == 0.0
