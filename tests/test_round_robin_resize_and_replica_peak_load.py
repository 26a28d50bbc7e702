"""Two fleet contracts a mutation pass found unpinned, each checked against a hand computation.

* :class:`RoundRobinRouter` promises "the replica after the last one chosen", taken modulo the fleet *now*.
  A counter that keeps growing (``next += 1``) gives the same picks while the fleet keeps its size, and another
  replica once it shrinks after a wrap-around.
* ``ReplicaStats.peak_outstanding`` is the most tokens a replica ever had outstanding at once.  The existing
  timelines never hold two requests' tokens on one replica at their peak, so a peak taken per request (the
  largest single request) passed them.
"""

from __future__ import annotations

from minivllm.sim.executor import SimulatedExecutor
from minivllm.arrival import Arrival
from minivllm.sim.fleet import Fleet, sim_replica
from minivllm.sim.router import LeastOutstandingRouter, RoundRobinRouter


def test_round_robin_after_the_fleet_shrinks_picks_the_replica_after_the_last_one():
    r = RoundRobinRouter()
    picks = [r.route([1], [0] * 4) for _ in range(5)]
    assert picks == [0, 1, 2, 3, 0]
    # the fleet is now 3 replicas: the replica after 0 is 1 (a counter at 5 would give 5 % 3 = 2)
    assert [r.route([1], [0] * 3) for _ in range(4)] == [1, 2, 0, 1]
    # and it grows to 5: after 1 comes 2, then 3 and 4, which the 3-replica fleet never had
    assert [r.route([1], [0] * 5) for _ in range(4)] == [2, 3, 4, 0]


def test_peak_outstanding_adds_up_the_requests_held_together():
    """One replica, two requests arriving at t=0, both routed before its first step: A holds 20 prompt + 10
    output tokens, B 40 + 5, so the replica's outstanding count reaches 30 + 45 = 75 -- its peak, since nothing
    is added later and the count only falls as tokens stream back."""
    arrivals = [Arrival(0.0, "A", "default", tuple(range(10, 30)), 10),
                Arrival(0.0, "B", "default", tuple(range(100, 140)), 5)]
    fleet = Fleet(1, LeastOutstandingRouter(),
                  executor_factory=lambda: SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0,
                                                             per_context_token_s=0.0),
                  engine_factory=lambda ex: sim_replica(ex, num_blocks=64, block_size=16, max_num_seqs=4,
                                                        max_num_batched_tokens=256, model_max_len=512))
    res = fleet.run(arrivals)
    assert [r.outcome for r in res.results] == ["ok", "ok"]
    assert res.replicas[0].peak_outstanding == (20 + 10) + (40 + 5)
    assert fleet.loads == [0]  # every token streamed back by the end
