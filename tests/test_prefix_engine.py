"""Prefix caching inside the engine, on the real default model.

The oracle is the engine with the cache off: every configuration must produce
exactly the same greedy tokens, while the cache must actually skip work.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.sim.executor import SimulatedExecutor
from tests.invariants import steps

pytestmark = pytest.mark.slow
SYSTEM = (
    "You are a careful assistant for a bookshop. Answer briefly, cite the shelf number when you "
    "know it, and never invent titles. The shop opens at nine and closes at six. Shelves one to "
    "five hold fiction, six to nine hold science, ten and eleven hold history, and twelve holds maps. "
)
QUESTIONS = ["Where are the maps?", "When do you open?", "Do you sell history books?", "Where is science?"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _chat_workload(llm):
    """Shared system prompt, then a second turn that reuses the first turn's answer."""
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]
    # the first conversation alone pays for the system prompt; the other three arrive together after it
    first = llm.chat(convs[:1], GREEDY, use_tqdm=False) + llm.chat(convs[1:], GREEDY, use_tqdm=False)
    turn2 = [
        c + [{"role": "assistant", "content": o.outputs[0].text}, {"role": "user", "content": "Thanks. And on Sunday?"}]
        for c, o in zip(convs, first)
    ]
    second = llm.chat(turn2, GREEDY, use_tqdm=False)
    samples = llm.chat(convs[0], SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=10), use_tqdm=False)
    # long answers all at once: in a small pool, decode growth forces preemption
    long = llm.chat(convs, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    return first, second, samples, long


def _tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", max_model_len=1024, num_gpu_blocks_override=256)
    return [_tokens(x) for x in _chat_workload(llm)]


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("budget", [2048, 48])  # 48: every prompt is chunked, blocks cached chunk by chunk
def test_outputs_identical_with_and_without_cache(reference, kind, budget):
    llm = LLM(
        dtype="float32", max_model_len=1024, num_gpu_blocks_override=256,
        enable_prefix_caching=True, prefix_cache=kind, max_num_batched_tokens=budget, max_num_seqs=8,
    )
    first, second, samples, long = _chat_workload(llm)
    assert [_tokens(first), _tokens(second), _tokens(samples), _tokens(long)] == reference
    # the system prompt was paid for once: every later question hit it
    assert all(o.num_cached_tokens >= 64 for o in first[1:])
    # the second turn reused the first turn's prompt *and answer* blocks
    first_len = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in first]
    assert all(s.num_cached_tokens >= (n // 16 - 1) * 16 for s, n in zip(second, first_len))
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_rate"] > 0.5
    assert len(samples[0].outputs) == 3 and len({tuple(c.token_ids) for c in samples[0].outputs}) > 1


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_eviction_and_preemption_keep_outputs_exact(reference, kind):
    # 12 blocks of 16 tokens: the cache must evict to make room, and decode growth preempts
    llm = LLM(
        dtype="float32", max_model_len=192, num_gpu_blocks_override=12,
        enable_prefix_caching=True, prefix_cache=kind, max_num_seqs=8,
    )
    first, second, samples, long = _chat_workload(llm)
    assert [_tokens(first), _tokens(second), _tokens(samples), _tokens(long)] == reference
    stats = llm.engine.stats()
    assert stats["prefix_cache_evictions"] > 0 and stats["num_preemptions"] > 0


def test_copy_on_write_gives_each_sample_its_own_last_block():
    """n=4 samples fork from one prefill; the partly filled last prompt block is copied, not shared."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=64, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64)
    engine.add_request({"prompt_token_ids": list(range(10, 20))}, SamplingParams(n=4, max_tokens=3, temperature=1, seed=1))
    seen_shared = False
    for _ in steps(engine):
        running = engine.scheduler.running
        if len(running) == 4:
            tables = [r.block_ids for r in running]
            # the two full prompt blocks are shared by all four, the third (partial) block is private
            assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1
            assert len({t[2] for t in tables}) == 4
            assert engine.pool.refcount(tables[0][0]) == 4
            seen_shared = True
    assert seen_shared and engine.pool.num_free == 64


def _sim_engine(blocks=64, **options):
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_model_len=64, device="cpu",
                       enable_prefix_caching=True, **options)
    return LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64)


def _run(engine, prompt, **kw):
    engine.add_request({"prompt_token_ids": prompt, **kw.pop("extra", {})}, SamplingParams(max_tokens=2, ignore_eos=True), **kw)
    outs = []
    for new in steps(engine):
        outs += new
    return [o for o in outs if o.finished][-1]


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_tenants_are_isolated_unless_sharing_is_configured(kind):
    prompt = list(range(100, 130))
    engine = _sim_engine(prefix_cache=kind)
    assert _run(engine, prompt, tenant="alice").num_cached_tokens == 0
    assert _run(engine, prompt, tenant="bob").num_cached_tokens == 0, "bob hit alice's blocks"
    assert _run(engine, prompt, tenant="alice").num_cached_tokens == 28
    # a cache_salt splits even one tenant's space
    assert _run(engine, prompt, tenant="alice", extra={"cache_salt": "s1"}).num_cached_tokens == 0
    shared = _sim_engine(prefix_cache=kind, share_prefix_cache_across_tenants=True)
    _run(shared, prompt, tenant="alice")
    assert _run(shared, prompt, tenant="bob").num_cached_tokens == 28


def test_recompute_after_preemption_is_not_counted_as_a_hit():
    # 24 blocks of 4 tokens; two requests growing to 54 tokens each must preempt one another
    engine = _sim_engine(blocks=24, prefix_cache="radix")
    for start in (10, 50):
        engine.add_request({"prompt_token_ids": list(range(start, start + 24))}, SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in steps(engine):
        pass
    st = engine.stats()
    assert st["num_preemptions"] > 0
    assert st["prefix_cache_hits"] == 0, "a preempted request's own blocks were counted as cache hits"
    assert st["prefix_cache_queries"] == 48
    assert st["recompute_hit_tokens"] > 0


def test_a_swapped_in_request_is_neither_a_hit_nor_a_recompute_hit():
    """A swapped-out request brings its own blocks back over PCIe; the prefix cache saved it nothing.  Counting
    them as ``recompute_hit_tokens`` would credit the cache with the swap's work.  Oracle: with only swap
    preemptions there is no recompute at all, so the count must be 0 (and the prompts share nothing: 0 hits)."""
    cfg = EngineConfig(num_gpu_blocks_override=16, block_size=16, max_model_len=256, enable_prefix_caching=True,
                       preemption_mode="swap", num_cpu_blocks_override=64, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=256)
    for i in range(3):
        engine.add_request({"prompt_token_ids": [100 + i] * 40}, SamplingParams(max_tokens=120, ignore_eos=True))
    for _ in steps(engine):
        pass
    st = engine.stats()
    assert st["num_swap_preemptions"] > 0 and st["swapped_in_blocks"] > 0 and st["num_recompute_preemptions"] == 0
    assert st["recompute_hit_tokens"] == 0 and st["prefix_cache_hits"] == 0
