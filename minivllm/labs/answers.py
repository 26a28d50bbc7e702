"""Numeric quiz answers, computed from the engine's own functions.

Each question with ``"compute": "minivllm.labs.answers:<name>"`` in a bank
names a function here; ``tests/test_labs.py`` checks that the stored answer
equals what the function returns now, so answers follow the engine.
"""

from __future__ import annotations


def lab01_decode_tokens_per_request() -> int:
    """Decode steps of a request with max_tokens=8: the first token comes from the prefill step."""
    from minivllm.labs.workloads import run_engine, sim_engine

    eng = sim_engine(block_size=4)
    run_engine(eng, [([11] * 20, 8)])
    return sum(1 for e in eng.step_log for rid, start, n in e["seqs"] if start >= 20)


def lab01_prefill_steps_chunked() -> int:
    """Steps a 100-token prompt needs with a 32-token budget (chunked prefill)."""
    from minivllm.labs.workloads import run_engine, sim_engine

    eng = sim_engine(block_size=4, max_num_batched_tokens=32, max_num_seqs=4)
    run_engine(eng, [([11] * 100, 1)])
    return len(eng.step_log)


def lab02_blocks_for_33() -> int:
    from minivllm.kv.kv_cache_manager import blocks_for

    return blocks_for(33, 16)


def lab02_slot_of_token_37() -> int:
    """Slot of position 37 with block table [4, 9, 6, 7] and 16-token blocks, via the model runner."""
    import torch

    from minivllm.model.runner import build_attention_metadata
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams
    from minivllm.sched.scheduler import ScheduledSeq

    req = Request("q", list(range(10, 48)), SamplingParams(), 0.0)
    req.block_ids = [4, 9, 6, 7]
    _, _, meta = build_attention_metadata([ScheduledSeq(req, 1, 37)], 16, torch.device("cpu"))
    return int(meta.slot_mapping[0])


def lab02_contiguous_utilization_pct() -> int:
    from minivllm.labs.workloads import lengths_sample, reserved_slots_contiguous, utilization

    lens = lengths_sample(2000, seed=0, max_len=2048)
    return round(100 * utilization(lens, reserved_slots_contiguous(lens, 2048)))


def lab03_system_prompt_hit_tokens() -> int:
    """Tokens served from cache for the 2nd request sharing a 100-token system prompt (block 16)."""
    from minivllm.kv.block_pool import BlockPool
    from minivllm.labs.workloads import replay_prefix_cache
    from minivllm.kv.prefix.radix import RadixCache

    system = list(range(100, 200))
    prompts = [system + [7, 8, 9], system + [5, 6]]
    pool = BlockPool(64)
    recs = replay_prefix_cache(RadixCache(pool, 16), pool, prompts, block_size=16)
    return recs[1]["hit_tokens"]


def lab03_exact_repeat_hit_tokens() -> int:
    """Hit tokens when a 64-token prompt is sent twice (block 16): the last token is recomputed."""
    from minivllm.kv.block_pool import BlockPool
    from minivllm.labs.workloads import replay_prefix_cache
    from minivllm.kv.prefix.radix import RadixCache

    prompt = list(range(300, 364))
    pool = BlockPool(64)
    recs = replay_prefix_cache(RadixCache(pool, 16), pool, [prompt, prompt], block_size=16)
    return recs[1]["hit_tokens"]


def lab04_steps_to_first_token() -> int:
    """Steps from admission to the first token of a 1,000-token prompt while 3 requests decode (budget 256)."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sampling_params import SamplingParams

    eng = sim_engine(block_size=16, max_num_batched_tokens=256, max_num_seqs=8)
    for i in range(3):
        eng.add_request({"prompt_token_ids": [20 + i] * 8}, SamplingParams(max_tokens=50, ignore_eos=True), f"c{i}")
    eng.step()  # the three short prompts prefill (and sample their first tokens): from now on they decode
    eng.add_request({"prompt_token_ids": [11] * 1000}, SamplingParams(max_tokens=1, ignore_eos=True), "L")
    for steps in range(1, 100):
        if any(o.request_id == "L" and o.finished for o in eng.step()):
            return steps
    raise AssertionError("the long prompt never finished")


def lab04_stalls_p99_sees() -> int:
    """Fewest 180 ms stalls among 200 gaps (the rest 15 ms) for the nearest-rank p99 to be a stall."""
    from minivllm.labs.check_lab04 import percentile

    return next(k for k in range(201) if percentile([0.015] * (200 - k) + [0.180] * k, 99) == 0.180)


def lab05_swapped_blocks_for_100_tokens() -> int:
    """Host blocks a swap preemption fills for a victim with 100 computed tokens (block 16), via the KV manager."""
    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.kv_cache_manager import KVCacheManager
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams

    kv = KVCacheManager(BlockPool(16), 16, cpu_pool=BlockPool(16))
    req = Request("victim", list(range(10, 110)), SamplingParams(), 0.0)
    assert kv.allocate_slots(req, 100)
    req.num_computed_tokens = 100
    assert kv.swap_out(req)
    return len(req.cpu_block_ids)


def lab05_crossover_gbps() -> float:
    """Link bandwidth (GB/s, 1 decimal) at which the engine's cost model is indifferent, for lab 5's GPU:
    2 MiB blocks of 16 tokens, prefill at 50,000 tokens/s."""
    from minivllm.labs.check_lab05 import BLOCK_SIZE, KV_BYTES_PER_BLOCK, PREFILL_TOKENS_PER_S
    from minivllm.sched.scheduler import PreemptionCosts

    at_1_byte_per_s = PreemptionCosts(KV_BYTES_PER_BLOCK, 1.0, PREFILL_TOKENS_PER_S)
    return round(at_1_byte_per_s.swap_s(1) / at_1_byte_per_s.recompute_s(BLOCK_SIZE) / 1e9, 1)
