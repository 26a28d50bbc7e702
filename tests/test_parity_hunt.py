"""Scheduling, caching and preemption may change *when* a token comes, never *which*: combinations no other test
crosses, on the real default model, each checked token for token against HF transformers' greedy decoding.

Why these: each feature has its own parity test (test_hf_parity.py, test_prefix_engine.py), but the bugs such
engines ship live where features meet -- a swapped-out request whose head blocks are shared with the prefix cache,
a recomputed prompt whose head is a cache hit and whose tail is cut into tiny chunks, a forked sample aborted
while it sits in the host tier, a capped tenant whose salted prompt evicts another's.  The pools are sized so
that every run preempts (asserted), and every run must end with no block held but the prefix cache's own.

The workload: five prompts, four of them sharing a 32-token head (two full blocks of 16); one prompt *is* that
head (the whole prompt is a cache hit and its last token must still be computed) and one fills three blocks
exactly.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig
from minivllm.request import RequestStatus

from conftest import LONG_TEXT, hf_greedy  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.slow
MAX_TOKENS = 6


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = tokenizer.encode(LONG_TEXT * 2)
    head = ids[:32]
    return [head + ids[100:108], head + ids[120:136], list(head), ids[200:224], head + ids[150:170]]


@pytest.fixture(scope="module")
def hf_tokens(hf_model, prompts):
    return [hf_greedy(hf_model, p, MAX_TOKENS) for p in prompts]


def _assert_no_block_leaks(engine) -> None:
    """Idle, the device pool holds only the prefix cache's blocks (each held by nothing else), the host tier none."""
    st = engine.stats()
    assert st["num_running"] == st["num_waiting"] == st["num_swapped"] == 0
    assert st["used_blocks"] == 0
    assert st["free_blocks"] + st["cached_blocks"] == st["num_blocks"]
    assert engine.pool.num_free == st["free_blocks"]
    assert st["cpu_blocks_used"] == 0


def _run_llm(llm, prompts, n_of=lambda i: 1, extra=lambda i: {}):
    params = [_greedy(n_of(i)) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p, **extra(i)} for i, p in enumerate(prompts)], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_swap_with_prefix_cache_tiny_chunks_and_a_forked_group_matches_hf(prompts, hf_tokens):
    """Swap preemption x prefix caching x a 6-token chunk cap x ``n=2`` copy-on-write, in a pool of 5 blocks (one
    request of max_model_len is 4).  A swapped request's shared head blocks stay on the device for the cache and its
    neighbours; its private tail must come back bit-exact."""
    llm = LLM(dtype="float32", max_model_len=64, num_gpu_blocks_override=5, preemption_mode="swap",
              num_cpu_blocks_override=20, enable_prefix_caching=True, long_prefill_token_threshold=6)
    got = _run_llm(llm, prompts, n_of=lambda i: 2 if i == 1 else 1)
    assert got == [[ref] * (2 if i == 1 else 1) for i, ref in enumerate(hf_tokens)]
    st = llm.engine.stats()
    assert st["num_swap_preemptions"] > 0 and st["swapped_in_blocks"] == st["swapped_out_blocks"] > 0
    _assert_no_block_leaks(llm.engine)


def test_recompute_of_a_chunked_prompt_whose_head_is_a_cache_hit_matches_hf(prompts, hf_tokens):
    """Recompute preemption x prefix cache x chunks of 3 tokens in blocks of 8, with the bare head served first so
    every later prompt starts on a hit.  A recomputed victim takes its head back from the cache (counted as a
    recompute hit) and recomputes only its tail, in chunks that start mid-block."""
    cfg = EngineConfig(dtype="float32", max_model_len=64, block_size=8, num_gpu_blocks_override=8,
                       enable_prefix_caching=True, prefix_cache="hash", long_prefill_token_threshold=3,
                       max_num_batched_tokens=12, device="cpu")
    engine = LLMEngine(cfg)
    finals = {}

    def drain():
        while engine.has_unfinished_requests():
            finals.update({o.request_id: o for o in engine.step() if o.finished})

    engine.add_request({"prompt_token_ids": prompts[2]}, _greedy(), "r2")
    drain()
    for i in (0, 1, 4, 3):
        engine.add_request({"prompt_token_ids": prompts[i]}, _greedy(2 if i == 4 else 1), f"r{i}")
    drain()
    got = [[c.token_ids for c in finals[f"r{i}"].outputs] for i in range(5)]
    assert got == [[ref] * (2 if i == 4 else 1) for i, ref in enumerate(hf_tokens)]
    st = engine.stats()
    assert st["num_recompute_preemptions"] > 0 and st["recompute_hit_tokens"] > 0
    assert finals["r0"].num_cached_tokens >= 32
    _assert_no_block_leaks(engine)


def test_aborting_a_swapped_out_sample_leaves_the_rest_exact_and_frees_its_blocks(prompts, hf_tokens):
    """Abort one sample of an ``n=2`` group while it is parked in the host tier and the pool is full: its sibling
    shares its prompt blocks, the cache holds their head.  The others must finish with HF's tokens and every block
    must come back."""
    cfg = EngineConfig(dtype="float32", max_model_len=64, num_gpu_blocks_override=6, preemption_mode="swap",
                       num_cpu_blocks_override=20, enable_prefix_caching=True, long_prefill_token_threshold=6,
                       device="cpu")
    engine = LLMEngine(cfg)
    for i, p in enumerate(prompts):
        engine.add_request({"prompt_token_ids": p}, _greedy(2 if i in (1, 4) else 1), f"r{i}")
    finals, aborted = {}, None
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        victims = [r for r in engine.requests.values() if r.status is RequestStatus.SWAPPED and r.parent_id is not None]
        if aborted is None and victims:
            aborted = victims[0].request_id
            assert engine.abort_request(aborted)
    assert aborted is not None, "the pool must preempt a sample of a group"
    parent, index = aborted.split("#")
    for i, ref in enumerate(hf_tokens):
        for j, c in enumerate(finals[f"r{i}"].outputs):
            if (f"r{i}", str(j)) == (parent, index):
                assert c.finish_reason == "abort"
            else:
                assert (c.finish_reason, c.token_ids) == ("length", ref)
    _assert_no_block_leaks(engine)


def test_salted_tenants_under_capped_wfq_with_swap_match_hf(prompts, hf_tokens):
    """``cache_salt`` tenants x WFQ x per-tenant caps (running seats, KV share) x swap in a 6-block pool: salts
    split the cache, caps pick the victims, and neither may change a token."""
    tenants = {"a": TenantConfig(weight=2.0, max_running=1, max_kv_share=0.7), "b": TenantConfig(max_running=2)}
    llm = LLM(dtype="float32", max_model_len=64, num_gpu_blocks_override=6, scheduling_policy="wfq",
              enable_prefix_caching=True, long_prefill_token_threshold=8, preemption_mode="swap",
              num_cpu_blocks_override=12, tenants=tenants)
    got = _run_llm(llm, prompts, extra=lambda i: {"tenant": "ab"[i % 2], "cache_salt": ["s1", "s2"][i // 3]})
    assert got == [[ref] for ref in hf_tokens]
    assert llm.engine.stats()["num_preemptions"] > 0
    _assert_no_block_leaks(llm.engine)
