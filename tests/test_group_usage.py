"""What an ``n > 1`` request reports as a whole: its prompt once, its completion tokens summed over its samples, and
the cached part of its prompt -- ``RequestOutput.num_cached_tokens``, the server's
``usage.prompt_tokens_details.cached_tokens`` -- as its first prefix-cache lookup found it.

Why the last needs a rule: each sample carries a cached count of its own.  A sample forked from its leader
inherits the leader's; a sample admitted once its leader has gone (one seat, so it waits for the leader to finish)
looks the cache up itself and finds the prompt blocks its own leader just computed.  The group's output is built
from whichever sample got a token last, so the count it reported was the carrier's: 0 or 8 for the same request on
the same cold cache, depending on the number of seats and on which sample finished last.  OpenAI counts the prompt
once (``prompt_tokens``), and ``cached_tokens`` is the part of that prompt served from a cache the request found
-- never the blocks the request computed itself.

Oracles: hand counts (4-token blocks, a 9-token prompt: a warm cache holds its first two blocks, 8 tokens; a cold
one none; ``max_tokens`` tokens per sample with ``ignore_eos``), and, over seeded workloads whose prompts share no
block, the rule that no output may report a cached token.
"""

from __future__ import annotations

import json
import random

import pytest

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.metrics.scrape import metric_samples, metric_value
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor

from tests.invariants import assert_no_leak, block_tokens, drain, tiny_engine

PROMPT_LEN, MAX_TOKENS = 9, 3
WARM = 8  # a 9-token prompt on 4-token blocks: two full blocks in the cache


def _prompt(base: int) -> list[int]:
    return list(range(base, base + PROMPT_LEN))


def _outputs(engine, request_id: str) -> list:
    """Every output the caller sees for ``request_id``, stepping until it finishes."""
    seen = []
    for _ in range(500):
        seen += [out for out in engine.step() if out.request_id == request_id]
        if seen and seen[-1].finished:
            return seen
    raise AssertionError(f"{request_id} did not finish")


@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
@pytest.mark.parametrize("seats", [1, 4])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_groups_cached_tokens_are_what_its_prompt_found_whatever_the_seats_and_the_carrier(n, seats, kind):
    """A prompt on a cold cache reports 0 cached tokens in every output, then the same prompt again (a warm cache)
    reports 8 in every output -- for n = 1, 2, 3, in every output kind, with one seat (each sample after its
    leader has finished: the old code reported 8 on the cold cache once sample 1 carried the output) or four
    (the samples fork).  The final output holds ``n * max_tokens`` tokens, counted once per sample."""
    engine = tiny_engine(num_blocks=24, max_seqs=seats, prefix="radix")
    for rid, want in (("cold", 0), ("warm", WARM)):
        params = SamplingParams(n=n, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind, temperature=1.0, seed=1)
        engine.add_request({"prompt_token_ids": _prompt(20)}, params, request_id=rid)
        outs = _outputs(engine, rid)
        assert [out.num_cached_tokens for out in outs] == [want] * len(outs), (rid, kind)
        final = outs[-1]
        got = {i: [] for i in range(n)}
        for out in outs if kind == "delta" else [final]:
            for o in out.outputs:
                got[o.index] += o.token_ids
        assert [len(got[i]) for i in range(n)] == [MAX_TOKENS] * n
        assert len(final.prompt_token_ids) == PROMPT_LEN
        assert final.metrics.num_preemptions == 0
    assert_no_leak(engine)


def test_no_output_reports_a_cached_token_when_no_prompt_shares_a_block():
    """Seeded workloads of n = 1..3 requests on a pool small enough to preempt by recompute, one to three seats;
    every prompt is its own tokens, so no request finds a block of its prompt that it did not compute itself, and
    no output may report a cached token -- though samples admitted after their leader do find their leader's
    blocks (counted over the seeds, or the case went untested)."""
    own_lookups = preempted = 0
    for seed in range(8):
        rnd = random.Random(seed)
        engine = tiny_engine(num_blocks=10, max_seqs=rnd.randrange(1, 4), max_len=40, prefix="radix")
        for i in range(10):
            engine.add_request({"prompt_token_ids": list(range(50 * i + 10, 50 * i + 10 + rnd.randrange(5, 14)))},
                               SamplingParams(n=rnd.choice([1, 2, 3]), max_tokens=rnd.randrange(1, 12), ignore_eos=True,
                                              output_kind=rnd.choice(["cumulative", "delta", "final_only"]),
                                              temperature=1.0, seed=i), request_id=f"r{i}")
        reported: list[tuple[str, int]] = []
        looked: set[str] = set()
        for _ in range(2000):
            reported += [(out.request_id, out.num_cached_tokens) for out in engine.step()]
            looked.update(r.request_id for r in engine.requests.values() if r.num_cached_tokens)
            if not engine.requests:
                break
        drain(engine)
        assert reported and all(cached == 0 for _, cached in reported), (seed, [r for r in reported if r[1]])
        own_lookups += len(looked)
        preempted += engine.stats()["num_recompute_preemptions"]
        assert_no_leak(engine)
    assert own_lookups and preempted, (own_lookups, preempted)


def _found_in_cache(engine, prompt: list[int]) -> int:
    """Brute force: the prompt tokens a lookup would find now -- its leading full blocks (all but the last token,
    which is always computed) that some cached block really holds, read slot by slot from the executor's model of
    the KV (``KVContents``), not from the cache's index.  (Block contents alone decide: every block of the prompts
    here is a distinct token, so a block's tokens name its place in the prompt.)"""
    bs, cache, kv = engine.kv.block_size, engine.kv.prefix_cache, engine.executor.device
    held = {tuple(kv.get((b, s)) for s in range(bs)) for b in range(engine.kv.pool.num_blocks) if cache.is_cached(b)}
    n = 0
    while (n + 1) * bs <= len(prompt) - 1 and tuple(prompt[n * bs:(n + 1) * bs]) in held:
        n += 1
    return n * bs


def _evict_to(engine, req, blocks: int) -> None:
    """Evict least recently used cached blocks until a lookup of ``req``'s prompt finds at most ``blocks``."""
    cache = engine.kv.prefix_cache
    while cache.peek(req.prompt_token_ids, engine.kv.namespace(req)) > blocks:
        assert cache.evict(1) == 1


@pytest.mark.parametrize("prefix", ["radix", "hash"])
@pytest.mark.parametrize("kind", ["cumulative", "delta", "final_only"])
@pytest.mark.parametrize("lost_before_leader", [0, 1])
def test_a_groups_cached_tokens_are_what_its_leader_found_when_the_cache_loses_blocks_before_a_sample_looks(
        prefix, kind, lost_before_leader):
    """A warm cache holds two blocks of a 9-token prompt; ``lost_before_leader`` of them are evicted before an
    ``n = 2`` request on it is admitted, and once its leader has finished (one seat) the cache loses one block
    more of the prompt than the leader found, before the second sample looks the cache up itself.  Every output
    of the group reports what the leader's lookup found, recounted by brute force from the KV slots at the
    leader's admission (8 or 4 tokens) -- not the second sample's own, smaller count, which a rule taking the
    carrying sample's count reports (and vLLM does: its final-only output is the last child's)."""
    engine = tiny_engine(num_blocks=24, max_seqs=1, prefix=prefix)
    prompt = block_tokens(1, 2, extra=(3,))
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                       request_id="warm")
    drain(engine)
    params = SamplingParams(n=2, max_tokens=MAX_TOKENS, ignore_eos=True, output_kind=kind, temperature=1.0, seed=1)
    engine.add_request({"prompt_token_ids": prompt}, params, request_id="g")
    leader, sample = engine.requests["g#0"], engine.requests["g#1"]
    _evict_to(engine, leader, 2 - lost_before_leader)
    found = sibling_found = None
    outs = []
    for _ in range(200):
        if leader.first_scheduled_time is None:
            before_admission = _found_in_cache(engine, prompt)
        elif leader.status.finished and sample.first_scheduled_time is None:
            _evict_to(engine, sample, found // 4 - 1)
            sibling_found = _found_in_cache(engine, prompt)
        outs += [out for out in engine.step() if out.request_id == "g"]
        if found is None and leader.first_scheduled_time is not None:
            found = before_admission
        if outs and outs[-1].finished:
            break
    assert found == 4 * (2 - lost_before_leader) and sibling_found == found - 4  # the case is real
    assert sample.num_cached_tokens == sibling_found  # the sample looked the cache up itself, and found less
    assert [out.num_cached_tokens for out in outs] == [found] * len(outs)
    assert outs[-1].finished and len(outs[-1].outputs) == 2
    assert_no_leak(engine)


# -- the server: usage, streamed and not, and the per-request counters ----------------------------------------------


@pytest.fixture(scope="module")
def one_seat():
    """The real server on a simulated engine with prefix caching and one seat, so every sample of a group runs
    after the one before it has finished."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from sim_server import serving

    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=64, max_num_seqs=1,
                       enable_prefix_caching=True, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64, eos_token_ids=set())
    with serving(engine) as srv:
        yield srv


def _usage(srv, prompt: list[int], n: int, stream: bool) -> dict:
    import httpx

    body = {"model": "sim", "prompt": prompt, "max_tokens": MAX_TOKENS, "n": n, "temperature": 1.0, "seed": 5,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    usage = None
    with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    assert usage is None, "a second usage chunk"
                    usage = chunk["usage"]
    assert usage is not None
    return usage


def test_usage_counts_the_prompt_once_and_its_cached_part_as_found_streamed_or_not(one_seat):
    """For n = 1, 2, 3, streamed and not: ``prompt_tokens`` 9, ``completion_tokens`` n * 3, ``total_tokens`` their
    sum, ``cached_tokens`` 0 for a prompt never seen (the old code: 8 for n > 1, sample 1's own lookup) and 8 for
    the same prompt again.  Then /metrics: the prompt once per request, every sample's tokens, one success each."""
    import httpx

    sent = tokens = 0
    for case, (n, stream) in enumerate((n, s) for n in (1, 2, 3) for s in (False, True)):
        prompt = _prompt(100 + 20 * case)
        for want_cached in (0, WARM):
            usage = _usage(one_seat, prompt, n, stream)
            sent, tokens = sent + 1, tokens + n * MAX_TOKENS
            assert usage == {"prompt_tokens": PROMPT_LEN, "completion_tokens": n * MAX_TOKENS,
                             "total_tokens": PROMPT_LEN + n * MAX_TOKENS,
                             "prompt_tokens_details": {"cached_tokens": want_cached}}, (n, stream)
    s = metric_samples(httpx.get(one_seat.base_url + "/metrics", timeout=30).text)
    assert metric_value(s, "vllm:prompt_tokens_total") == sent * PROMPT_LEN
    assert metric_value(s, "vllm:generation_tokens_total") == tokens
    assert metric_value(s, "vllm:request_success_total") == sent
