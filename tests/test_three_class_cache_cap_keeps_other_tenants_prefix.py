"""The three-class preset's cache clause, measured by what it is for.

The seed's worked policy: "enable prefix caching globally, but cap per-tenant cache share so one tenant cannot
evict everyone else".  ``tests/test_fairness.py`` checks that the cap is configured and that a capped tenant
never holds more than its quota; lab 6's "Which clause buys what" switches the clause off and sees no change on
its mix (no tenant floods the cache there).  This file measures the promise itself: a chat tenant's system prompt
survives a batch tenant's flood of one-off prompts with the clause on, and is evicted with it off.

Oracle, by hand: the chat prompt is a 16-token system prompt plus a fresh 4-token question on 4-token blocks; a
lookup covers the prompt less its last token (19 tokens), so a request whose system prompt is still cached
reuses exactly 4 full blocks = 16 tokens, and one whose system prompt was evicted reuses 0.  Each round the batch
tenant sends 10 one-off prompts of 40 tokens (100+ blocks) into an 80-block pool: without a cap plain LRU must
evict the chat blocks, which are older than the flood; with the preset's share (0.25 of the pool per tenant) the
flood evicts only its own blocks.
"""

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig

from invariants import KVContents, assert_no_leak, drain  # noqa: E402  (tests/ is on sys.path)

CLASSES = {"chat": TenantConfig(priority_class="interactive"), "bulk": TenantConfig(priority_class="batch")}
BLOCK, SYSTEM, ROUNDS = 4, list(range(100, 116)), 4


def chat_hits_per_round(tenant_cache_share: float) -> list[int]:
    cfg = EngineConfig(num_gpu_blocks_override=80, num_cpu_blocks_override=32, block_size=BLOCK,
                       max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128, scheduling_policy="three_class",
                       tenants=CLASSES, device="cpu", three_class=ThreeClassConfig(tenant_cache_share=tenant_cache_share))
    engine = LLMEngine(cfg, executor=KVContents(BLOCK), model_max_len=128, eos_token_ids=set())
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    hits, fresh = [], 1000  # fresh: token ids never used before, so nothing but SYSTEM can hit
    for r in range(ROUNDS):
        rid = engine.add_request({"prompt_token_ids": SYSTEM + list(range(fresh, fresh + 4))}, params, f"chat{r}",
                                 tenant="chat")
        fresh += 4
        hits.append(drain(engine)[rid].num_cached_tokens)
        for k in range(10):
            engine.add_request({"prompt_token_ids": list(range(fresh, fresh + 40))}, params, f"bulk{r}.{k}",
                               tenant="bulk")
            fresh += 40
        drain(engine)
    assert_no_leak(engine)
    return hits


def test_the_preset_cap_keeps_the_chat_system_prompt_through_a_batch_flood():
    assert ThreeClassConfig().tenant_cache_share == 0.25  # the preset's value, the one measured here
    assert chat_hits_per_round(0.25) == [0] + [len(SYSTEM)] * (ROUNDS - 1)


def test_without_the_cap_the_flood_evicts_the_chat_system_prompt():
    assert chat_hits_per_round(1.0) == [0] * ROUNDS
