"""The roofline charges ``eager_step_overhead_s`` exactly to the steps the real runner cannot replay as a CUDA graph.

Oracle: the model runner's own metadata (:func:`~minivllm.model.runner.build_attention_metadata`, run here on
CPU) -- ``DecodeGraphRunner.can_run`` replays a step only when ``num_decodes == num_seqs``, i.e. every row has one
token.  A one-token *prompt* row (the last prompt token after a prefix-cache hit) is such a row, so it must not
make the simulated step eager.
"""

import pytest
import torch

from minivllm.model.runner import build_attention_metadata
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.sched.output import ScheduledSeq
from minivllm.sim.roofline import HardwareSpec, ModelShape, roofline_time, step_cost

SHAPE = ModelShape("tiny", 2, 64, 128, 4, 2, 16, 1000)
HW = HardwareSpec("h", peak_flops=1e30, mem_bandwidth=1e30, eager_step_overhead_s=1.0)


def _runner_graphs(rows) -> bool:
    """Would the real runner replay this batch as a CUDA graph (its decode-only condition)?"""
    seqs = []
    for k, (start, n, _) in enumerate(rows):
        req = Request(f"r{k}", list(range(10, 10 + start + n)), SamplingParams(), 0.0,
                      block_ids=list(range(8 * k, 8 * k + (start + n + 15) // 16)))
        seqs.append(ScheduledSeq(req, n, start))
    meta = build_attention_metadata(seqs, 16, torch.device("cpu"))[2]
    return meta.num_decodes == meta.num_seqs


@pytest.mark.parametrize("rows", [
    [(100, 1, True), (0, 1, True)],     # a decode and a one-token prompt: all one-token rows
    [(100, 1, True), (20, 1, True)],    # the last prompt token after 20 cached ones
    [(100, 1, True), (0, 2, True)],     # a two-token prompt chunk
    [(0, 5, False)],                    # a middle prefill chunk
])
def test_eager_overhead_is_charged_exactly_where_the_runner_cannot_replay_a_graph(rows):
    graphed = _runner_graphs(rows)
    cost = step_cost(SHAPE, rows)
    assert cost.eager is (not graphed)
    assert roofline_time(cost, SHAPE, HW).overhead == pytest.approx(0.0 if graphed else 1.0)
