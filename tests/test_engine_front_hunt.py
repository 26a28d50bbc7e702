"""Defects a hunt in the engine's front (``LLM``, ``LLMEngine``'s caller-facing calls, the ``n > 1`` fold) found.

Each test failed on the code before its fix.  The oracles are the engine's step log (which names every
preempted request id, step by step, and is written by the scheduler's side, not by the output fold) and the
documented contract of ``LLM.close``.
"""

from collections import Counter

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sim import SimulatedExecutor
from tests.invariants import steps


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_an_n_group_reports_the_preemptions_of_all_its_samples(kind):
    """A group's output carried the metrics of one sample, its ``num_preemptions`` included: here a pool of six
    blocks pushes out one of the three samples, the group's final output carries another's metrics, and the
    request said it was never preempted (0) while the engine counted one preemption for it.  Oracle: the step
    log's preempted ids, counted per caller id; and every final output's count adds up to the engine's total."""
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=6, block_size=4,
              max_model_len=24)
    engine = llm.engine
    engine.eos_token_ids = set()
    engine.add_request({"prompt_token_ids": list(range(1, 9))},
                       SamplingParams(n=3, max_tokens=4, ignore_eos=True, output_kind=kind), request_id="g")
    engine.add_request({"prompt_token_ids": list(range(20, 28))},
                       SamplingParams(max_tokens=10, ignore_eos=True, output_kind=kind), request_id="h")
    finals = {o.request_id: o for outs in steps(engine) for o in outs if o.finished}
    logged = Counter(rid.split("#")[0] for record in engine.step_log for rid in record.preempted)
    assert logged["g"] >= 1  # the scenario does push a sample of the group out
    assert {rid: o.metrics.num_preemptions for rid, o in finals.items()} == {"g": logged["g"], "h": logged["h"]}
    assert sum(o.metrics.num_preemptions for o in finals.values()) == engine.stats()["num_preemptions"]


def test_generate_of_an_empty_batch_after_close_raises():
    """``close()`` promises that later calls raise; ``generate([])`` reached no ``add_request`` (the engine's own
    check) and returned ``[]`` as if the LLM still served.  Before the close it returns ``[]``, as vLLM's does."""
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=16, max_model_len=32)
    assert llm.generate([], use_tqdm=False) == []
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([], use_tqdm=False)
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate({"prompt_token_ids": [1, 2]}, use_tqdm=False)
