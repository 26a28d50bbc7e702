"""``used_blocks`` has one definition -- the pool less what an allocation could get -- offline and live alike.

Oracle: a hand count.  Three prompts of 40 tokens (each of one repeated id, so no prompt shares a block with
another) on 8-token blocks: 5 full blocks each, 15 in all, stay in the prefix cache once the requests end, and
no request holds any block then.  Before the step log kept ``available_blocks``, the offline count read the
free list alone and called those 15 cached blocks used, where the live gauge said 0.
"""

from minivllm import SamplingParams
from minivllm.labs.workloads import sim_engine
from minivllm.metrics.prometheus import EngineMetrics, metrics_from_step_log


def _value(metrics, name):
    return next(s.value for f in metrics.registry.collect() for s in f.samples if s.name == name)


def _cached_run():
    engine = sim_engine(num_blocks=64, block_size=8, enable_prefix_caching=True)
    metrics = EngineMetrics("sim")
    prompt_lens = {}
    for i in range(3):
        rid = engine.add_request({"prompt_token_ids": [100 + i] * 40}, SamplingParams(max_tokens=5, ignore_eos=True),
                                 arrival_time=0.0)
        prompt_lens[rid] = 40
    used_each_step = []
    while engine.has_unfinished_requests():
        engine.step()
        metrics.observe_step(engine)
        used_each_step.append(_value(metrics, "vllm:kv_cache_used_blocks"))
    return engine, metrics, prompt_lens, used_each_step


def test_offline_used_blocks_leave_out_cached_blocks_as_the_live_gauge_does():
    engine, metrics, prompt_lens, _ = _cached_run()
    got = metrics_from_step_log(engine.step_log, prompt_lens, dict.fromkeys(prompt_lens, 0.0), 64)
    assert _value(metrics, "vllm:kv_cache_cached_blocks") == 3 * (40 // 8)
    assert _value(metrics, "vllm:kv_cache_used_blocks") == 0  # no request holds a block any more
    assert got["used_blocks"] == 0
    assert got["free_blocks"] == 64 - 15 == _value(metrics, "vllm:kv_cache_free_blocks")  # the free list agrees


def test_every_records_available_blocks_give_the_live_used_gauge_of_its_step():
    """Not only the last record: step by step, ``num_blocks - available_blocks`` is what the live gauge read then,
    and the scheduler's peak is the largest of them (a count that read the free list would peak at 15 or more
    here only because finished requests' cached blocks pile up)."""
    engine, _, _, used_each_step = _cached_run()
    offline = [64 - rec.available_blocks for rec in engine.step_log]
    assert offline == used_each_step
    assert max(offline) > 0 and offline[-1] == 0
    assert engine.scheduler.stats.peak_used_blocks == max(offline)
    assert engine.stats()["used_blocks"] == 0 and engine.stats()["kv_cache_usage"] == 0.0


def test_the_schedulers_peak_leaves_out_blocks_an_earlier_request_left_cached():
    """The peak counts what requests use, not what the prefix cache keeps: request A ends (its 5 full prompt blocks
    stay cached, unheld), then B runs alone beside them.  Oracle, by hand: a 40-token prompt that samples 5 tokens
    computes 44 tokens at most (the last sampled one is never computed), 6 blocks of 8, so each request uses 6 at
    its peak, and nothing else is used then; the free list alone would read 6 + A's 5 cached blocks = 11 while B
    runs.  (Three requests at once, as above, never show it: their cached blocks appear only as they all end.)"""
    engine = sim_engine(num_blocks=64, block_size=8, enable_prefix_caching=True)
    for i in range(2):
        engine.add_request({"prompt_token_ids": [100 + i] * 40}, SamplingParams(max_tokens=5, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    assert engine.stats()["cached_blocks"] == 2 * 5
    assert engine.scheduler.stats.peak_used_blocks == 6
    assert max(64 - rec.available_blocks for rec in engine.step_log) == 6
