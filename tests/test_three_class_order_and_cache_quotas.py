"""Behaviours of policy code ``tools/mutation_pass.py`` did not plant bugs in: three_class's order of a queue it does
not keep and its per-tenant head of line, and the prefix-cache quota of blocks shared across tenants and of a share
under one block.  Each test kills one planted bug (its docstring names it) that the tests covering that code let
through; the bugs are now rows of the mutation pass.

Why a file of its own: these are policy details a refactor changes silently (a guard that only saves a sort, a
``None`` group, a ``max(1, ...)``), and each changes which request runs when or what stays cached.  Oracles do not
share the code under test: a plain sort by the documented rank, and schedules and cache hits counted by hand.
"""

from __future__ import annotations

import itertools
import random

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig
from minivllm.request import Request
from minivllm.sched.fairness import CLASS_RANK, ThreeClassAdmission, class_of, tenant_cache_quota

from invariants import KVContents, assert_no_leak, drain  # noqa: E402  (tests/ is on sys.path)

_ids = itertools.count()
CLASSES = {"chat": TenantConfig(priority_class="interactive"), "bot": TenantConfig(priority_class="agent"),
           "etl": TenantConfig(priority_class="batch")}


def _request(tenant: str, priority: int, arrival: float) -> Request:
    return Request(f"{tenant}-{next(_ids)}", [1, 2], SamplingParams(max_tokens=1), arrival, tenant=tenant,
                   priority=priority)


def test_three_class_orders_a_queue_it_does_not_keep_as_a_sort_by_class_priority_and_arrival():
    """Kills: the order built for a queue the policy does not keep (a lab's list, or a policy object two engines
    share, whose kept buckets then hold both queues) leaving the batch class unsorted.

    That branch sorts batch only when it will hand batch out (fewer interactive requests waiting than
    ``batch_max_interactive_queue``); a guard that skipped batch always served batch requests in queue order, so a
    priority-0 batch job queued behind priority-5 ones waited for all of them.  Oracle: ``sorted`` by
    (class, priority, arrival), with batch left out exactly when that many interactive requests wait.  (The
    property test in ``tests/test_fairness.py`` reaches this branch only in its last line, and caught the bug on
    4 of 6 Hypothesis seeds tried; this one is deterministic.)"""
    rng = random.Random(67)
    for threshold in (1, 3):
        cfg = EngineConfig(scheduling_policy="three_class", device="cpu", tenants=CLASSES,
                           three_class=ThreeClassConfig(batch_max_interactive_queue=threshold))
        policy = ThreeClassAdmission(cfg)
        for trial in range(40):
            waiting = [_request(rng.choice(["chat", "bot", "etl", "etl"]), rng.randrange(3), rng.random())
                       for _ in range(rng.randrange(1, 10))]
            want = sorted(waiting, key=lambda r: (CLASS_RANK[class_of(cfg, r.tenant)], r.priority, r.arrival_time))
            if sum(r.tenant == "chat" for r in waiting) >= threshold:
                want = [r for r in want if r.tenant != "etl"]
            assert policy.order(list(waiting), []) == want, (threshold, trial)
    # the case by hand: no interactive request waits, two batch jobs queued worst first
    policy = ThreeClassAdmission(EngineConfig(scheduling_policy="three_class", device="cpu", tenants=CLASSES))
    late, urgent = _request("etl", 5, 0.0), _request("etl", 0, 1.0)
    assert policy.order([late, urgent], []) == [urgent, late]


def test_blocks_cached_for_every_tenant_have_no_tenant_quota_under_three_class():
    """Kills: the three-class preset's per-tenant cache share (``tenant_cache_share``) applied to the group
    ``None`` too -- the blocks cached under ``share_prefix_cache_across_tenants``, which belong to no tenant.

    By hand, on a 100-block pool with the preset's 0.25: a tenant may keep 25 blocks cached, the shared group is
    unbounded (None).  Then the engine: 4-token blocks, an 80-block pool; with caching shared across tenants, ten
    20-token prompts leave 5 full blocks each in the cache (50 blocks: well inside the pool, so plain LRU evicts
    nothing).  The first prompt's 16-token system part is then still cached and a request repeating it finds
    exactly 16 tokens.  Had the shared group been held to 0.25 x 80 = 20 blocks, the first prompts would have
    been evicted to make room for the later ones, and it would find none."""
    cfg = EngineConfig(scheduling_policy="three_class", device="cpu", tenants=CLASSES, enable_prefix_caching=True,
                       share_prefix_cache_across_tenants=True)
    quota = tenant_cache_quota(cfg, 100)
    assert quota("chat") == quota("etl") == 25 and quota(None) is None

    block, system = 4, list(range(100, 116))
    cfg = EngineConfig(num_gpu_blocks_override=80, block_size=block, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=64, scheduling_policy="three_class", tenants=CLASSES, device="cpu",
                       enable_prefix_caching=True, share_prefix_cache_across_tenants=True)
    engine = LLMEngine(cfg, executor=KVContents(block), model_max_len=64, eos_token_ids=set())
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    fresh = 1000  # token ids never used before, so only ``system`` can hit
    for k in range(10):
        head = system if k == 0 else list(range(fresh, fresh + 16))
        fresh += 16
        engine.add_request({"prompt_token_ids": head + list(range(fresh, fresh + 4))}, params, f"p{k}",
                           tenant="chat" if k % 2 else "etl")
        fresh += 4
        drain(engine)
    rid = engine.add_request({"prompt_token_ids": system + list(range(fresh, fresh + 4))}, params, "again",
                             tenant="bot")
    assert drain(engine)[rid].num_cached_tokens == len(system)
    assert_no_leak(engine)


def test_a_tenants_own_cache_share_keeps_at_least_one_block():
    """Kills: a tenant's ``max_cache_share`` rounded down to zero blocks on a small pool.

    Like ``max_kv_share``, a share is rounded down but to at least one block: 0.01 of 64 blocks is 0.64, and a
    tenant given a small share still keeps its most useful block (the first of its prompt, which every later
    prompt starting the same way hits).  Hand count, 4-token blocks: a 9-token prompt leaves 2 full blocks to
    cache; the quota keeps one of them -- the first, since a cache evicts a chain from its leaf -- so a second
    request with the same first 8 tokens finds exactly 4.  Rounded to zero, the tenant could cache nothing and
    would find 0."""
    cfg = EngineConfig(device="cpu", enable_prefix_caching=True, tenants={"small": TenantConfig(max_cache_share=0.01)})
    quota = tenant_cache_quota(cfg, 64)
    assert quota("small") == 1 and quota("other") is None

    block = 4
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=block, max_num_batched_tokens=64, max_num_seqs=4,
                       max_model_len=64, tenants={"small": TenantConfig(max_cache_share=0.01)}, device="cpu",
                       enable_prefix_caching=True)
    engine = LLMEngine(cfg, executor=KVContents(block), model_max_len=64, eos_token_ids=set())
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    head = list(range(100, 108))
    engine.add_request({"prompt_token_ids": head + [1]}, params, "first", tenant="small")
    drain(engine)
    rid = engine.add_request({"prompt_token_ids": head + [2]}, params, "second", tenant="small")
    assert drain(engine)[rid].num_cached_tokens == block
    assert_no_leak(engine)


def test_three_class_lets_another_tenant_pass_a_head_request_that_does_not_fit():
    """Kills: three_class stopping admission at the first request that does not fit, whoever's it is.

    Its head of line is per tenant (``head_of_line = "tenant"``), as for caps: a long interactive prompt that
    must wait for blocks holds back its own tenant's later requests, not another tenant's short one queued
    behind it.  Hand schedule, 4-token blocks, a 12-block pool, nothing cached (each prompt its own tokens):
    step 1 seats chat0 (40 tokens, 10 blocks); chat1 (20 tokens, 5 blocks) does not fit in the 2 left, and bot0
    (4 tokens, 1 block: inside the agent class's 0.4 x 12 = 4 blocks) is admitted past it.  Stopping globally,
    bot0 waited behind chat1 until chat0 finished."""
    cfg = EngineConfig(num_gpu_blocks_override=12, num_cpu_blocks_override=32, block_size=4, max_num_batched_tokens=64,
                       max_num_seqs=6, max_model_len=48, scheduling_policy="three_class", tenants=CLASSES, device="cpu")
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=48, eos_token_ids=set())
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for rid, tenant, first, n in [("chat0", "chat", 100, 40), ("chat1", "chat", 200, 20), ("bot0", "bot", 300, 4)]:
        engine.add_request({"prompt_token_ids": list(range(first, first + n))}, params, rid, tenant=tenant)
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"chat0", "bot0"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["chat1"]
    drain(engine)
    assert_no_leak(engine)
