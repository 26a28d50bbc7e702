"""Lab 7, section 4: counting the operations an eager step launches.

Two oracles.  On a hand-built sequence of operations the count is known by
inspection (views are free, every other operation is one).  On the real model,
torch's own profiler records every operator the forward calls; for the
operations that nothing decomposes (mul, add, pow, mean, rsqrt) its count must
equal ours exactly, and the architecture fixes one of them: each RMSNorm is one
``pow``/``mean``/``rsqrt``, two per layer plus the final norm.
"""

import pytest
import torch

from minivllm.bench.eager_step import OpCounter
from minivllm.labs.check_lab07 import op_floor_us, step_operations
from minivllm.sampling_params import SamplingParams
from tests.invariants import steps


def test_op_counter_counts_each_operation_once_and_views_not_at_all():
    x = torch.ones(4, 4)
    with OpCounter() as c:
        y = x + 1                 # add
        z = y.view(16)[2:]        # two views: no work, no launch
        w = (z * 2).sum()         # mul, sum
        torch.rsqrt(w)            # rsqrt
    assert c.n == 4
    assert dict(c.names) == {"add": 1, "mul": 1, "sum": 1, "rsqrt": 1}
    with c:                       # re-entering starts a new count
        x - 1
    assert c.n == 1 and dict(c.names) == {"sub": 1}


def test_op_floor_measures_one_value_per_size_and_restores_the_threads():
    threads = torch.get_num_threads()
    us = op_floor_us([64, 4096], repeats=5, rounds=2)
    assert len(us) == 2 and all(t > 0 for t in us)
    assert torch.get_num_threads() == threads


@pytest.mark.slow
def test_step_operations_agree_with_the_profiler_and_the_architecture(small_llm):
    engine = small_llm.engine
    ops = step_operations(engine)
    layers = len(engine.model_runner.model.model.layers)
    assert not engine.has_unfinished_requests()
    for kind in ("prompt", "decode"):
        names = ops[kind].names
        assert names["pow"] == names["mean"] == names["rsqrt"] == 2 * layers + 1, (kind, names)

    # the profiler's count of a decode step, for the operators nothing decomposes
    engine.add_request({"prompt_token_ids": [100 + i for i in range(64)]},
                       SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), request_id="profiled")
    engine.step()
    model = engine.model_runner.model
    forward, seen = model.forward, {}

    def profiled(*args, **kwargs):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = forward(*args, **kwargs)
        seen.update({e.key: e.count for e in prof.key_averages()})
        return out

    model.forward = profiled
    try:
        engine.step()
    finally:
        del model.forward
    for _ in steps(engine):
        pass
    for name in ("mul", "add", "pow", "mean", "rsqrt"):
        assert ops["decode"].names[name] == seen[f"aten::{name}"], name
