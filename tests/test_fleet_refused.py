"""A request a replica refuses at the door (longer than its max_model_len) is an error result; the run goes on."""

from minivllm.arrival import Arrival
from minivllm.sim.fleet import Fleet, sim_replica
from minivllm.sim.router import RoundRobinRouter


def test_a_refused_request_is_an_error_and_the_fleet_keeps_serving():
    arrivals = [Arrival(0.0, "ok", "default", tuple(range(10, 50)), 4),
                Arrival(0.1, "long", "default", tuple([11] * 5000), 4),
                Arrival(0.2, "after", "default", tuple(range(20, 60)), 4)]
    fleet = Fleet(1, RoundRobinRouter(), engine_factory=lambda ex: sim_replica(
        ex, num_blocks=256, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, model_max_len=4096))
    res = fleet.run(arrivals)
    assert [(r.index, r.outcome) for r in res.results] == [(0, "ok"), (1, "error"), (2, "ok")]
    assert "max_model_len" in res.result("long").error
    assert res.outputs["long"] == [] and len(res.outputs["after"]) == 4
    assert fleet.loads == [0]
    s = res.summary()
    assert (s["ok"], s["error"], s["requests"]) == (2, 1, 3)
