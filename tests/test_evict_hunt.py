"""Promises about *which* cached blocks the prefix cache keeps, checked against counts made here.

The stateful tests in ``test_prefix_cache.py`` drive a cache built on its own, where a quota counts per
namespace.  The engine builds its cache from the config, and what ``prefix_cache_quota_blocks`` bounds
there -- a namespace ``(tenant, cache_salt)`` or a tenant -- is decided in ``LLMEngine``; these tests
check that choice from outside, by counting the cached blocks of each tenant after every step.
"""

from __future__ import annotations

from collections import Counter

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig

from invariants import KVContents, assert_no_leak, drain  # noqa: E402  (tests/ is on sys.path)

BLOCK = 4
QUOTA = 4


def cached_blocks_by_tenant(cache) -> Counter:
    """Cached blocks per tenant (the first half of each block's namespace), read off the cache's index."""
    index = cache._node_of_block if hasattr(cache, "_node_of_block") else cache._entry_of_block
    return Counter(entry.namespace[0] for entry in index.values())


def engine_with_quota(kind: str, tenants=None, share: bool = False) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=96, num_cpu_blocks_override=32, block_size=BLOCK,
                       max_num_batched_tokens=64, max_num_seqs=6, max_model_len=64, device="cpu",
                       enable_prefix_caching=True, prefix_cache=kind, prefix_cache_quota_blocks=QUOTA,
                       share_prefix_cache_across_tenants=share, tenants=tenants)
    return LLMEngine(cfg, executor=KVContents(BLOCK), model_max_len=64, eos_token_ids=set())


def fill_with_salts(engine: LLMEngine, tenant: str, num_salts: int = 6) -> Counter:
    """``tenant`` sends one 24-token prompt (6 blocks) under each of ``num_salts`` salts; the peak number of
    cached blocks per tenant over the run."""
    for i in range(num_salts):
        engine.add_request({"prompt_token_ids": [100 + i] * 24, "tenant": tenant, "cache_salt": f"s{i}"},
                           SamplingParams(max_tokens=2, ignore_eos=True))
    peak = Counter()

    def each(e):
        for owner, n in cached_blocks_by_tenant(e.prefix_cache).items():
            peak[owner] = max(peak[owner], n)

    drain(engine, each=each)
    assert_no_leak(engine)
    return peak


OTHERS = [None, {"alice": TenantConfig(max_cache_share=0.5)}]
OTHERS_IDS = ["no-tenant-config", "another-tenant-has-a-share"]


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("others", OTHERS, ids=OTHERS_IDS)
def test_a_client_cannot_multiply_the_engine_quota_by_inventing_salts(kind, others):
    """``prefix_cache_quota_blocks`` is a tenant's budget, whatever salts its requests carry.

    The salt comes from the client (the server passes it through, scoped to the caller's tenant), so a
    quota counted per ``(tenant, salt)`` lets one client keep ``QUOTA`` blocks per salt it invents and
    flush everybody else's cache.  It also made the engine-wide quota mean two things: per salt when no
    tenant had a ``max_cache_share``, per tenant as soon as any *other* tenant got one (24 against 4
    blocks here).
    """
    engine = engine_with_quota(kind, others)
    peak = fill_with_salts(engine, "bob")
    assert peak["bob"] == QUOTA, f"bob kept {peak['bob']} cached blocks under a quota of {QUOTA}"
    assert engine.stats()["prefix_cache_quota_evictions"] > 0


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("others", OTHERS, ids=OTHERS_IDS)
def test_with_sharing_across_tenants_the_shared_space_is_one_quota_whatever_the_salts(kind, others):
    """With ``share_prefix_cache_across_tenants`` a namespace is ``(None, salt)`` and counts under the group
    ``None`` (``tenant_cache_quota``'s docstring), so the engine-wide quota bounds the shared space as one
    budget -- the same with or without another tenant's ``max_cache_share``."""
    engine = engine_with_quota(kind, others, share=True)
    peak = fill_with_salts(engine, "bob")
    assert peak[None] == QUOTA, f"the shared space kept {peak[None]} cached blocks under a quota of {QUOTA}"
