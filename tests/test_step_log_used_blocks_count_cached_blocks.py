"""``metrics_from_step_log``'s ``used_blocks`` against the live gauge when prefix caching keeps blocks.

Oracle: a hand count.  Three prompts of 40 tokens (each of one repeated id, so no prompt shares a block with
another) on 8-token blocks: 5 full blocks each, 15 in all, stay in the prefix cache once the requests end, and
no request holds any block then.
"""

from minivllm import SamplingParams
from minivllm.labs.workloads import sim_engine
from minivllm.metrics.prometheus import EngineMetrics, metrics_from_step_log


def _value(metrics, name):
    return next(s.value for f in metrics.registry.collect() for s in f.samples if s.name == name)


def test_offline_used_blocks_count_cached_blocks_the_live_gauge_does_not():
    engine = sim_engine(num_blocks=64, block_size=8, enable_prefix_caching=True)
    metrics = EngineMetrics("sim")
    prompt_lens = {}
    for i in range(3):
        rid = engine.add_request({"prompt_token_ids": [100 + i] * 40}, SamplingParams(max_tokens=5, ignore_eos=True),
                                 arrival_time=0.0)
        prompt_lens[rid] = 40
    while engine.has_unfinished_requests():
        engine.step()
        metrics.observe_step(engine)
    got = metrics_from_step_log(engine.step_log, prompt_lens, dict.fromkeys(prompt_lens, 0.0), 64)
    assert _value(metrics, "vllm:kv_cache_cached_blocks") == 3 * (40 // 8)
    assert _value(metrics, "vllm:kv_cache_used_blocks") == 0  # no request holds a block any more
    assert got["used_blocks"] == 15 == 64 - got["free_blocks"]  # the offline count: the cached blocks
    assert got["free_blocks"] == _value(metrics, "vllm:kv_cache_free_blocks")  # the free list agrees
