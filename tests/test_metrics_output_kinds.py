"""``EngineMetrics.observe_output`` counts the same tokens and latencies whatever a request's ``output_kind``.

Bug fixed: generation tokens were summed from ``delta_token_ids`` and ITLs from ``metrics.itls``.  A
``final_only`` output (what ``LLM.generate`` uses) carries only the last token in its delta, so a 5-token
request counted 1 generation token; a ``delta`` output carries only this step's token time, so a streamed
request observed no inter-token latency at all.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.metrics.prometheus import EngineMetrics, observe_all
from minivllm.metrics.scrape import metric_samples, metric_value
from minivllm.sim import SimulatedExecutor


def _run(kind: str, n: int = 1):
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    engine = llm.engine
    engine.eos_token_ids = set()
    metrics = EngineMetrics("sim")
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=n, max_tokens=5, ignore_eos=True,
                                                                       output_kind=kind), request_id="r")
    while engine.has_unfinished_requests():
        observe_all(metrics, engine, engine.step())
    return metric_samples(metrics.render().decode())


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_tokens_and_itls_do_not_depend_on_the_output_kind(kind):
    s = _run(kind)
    ref = _run("cumulative")
    assert metric_value(s, "vllm:generation_tokens_total") == 5
    assert metric_value(s, "vllm:inter_token_latency_seconds_count") == 4
    assert metric_value(s, "vllm:inter_token_latency_seconds_sum") == pytest.approx(
        metric_value(ref, "vllm:inter_token_latency_seconds_sum"))
    assert metric_value(s, "vllm:time_to_first_token_seconds_count") == 1


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
def test_n_samples_count_every_generated_token(kind):
    s = _run(kind, n=3)
    assert metric_value(s, "vllm:generation_tokens_total") == 15
