"""Each cached block's prefix key is kept on its entry, not climbed to: the keys equal the climb's on random caches.

``first_block_keys`` (read by capped admission through ``KVCacheManager.prefix_keys_holding``, once per tenant per
pass for every block the tenant's groups hold) climbed each block to the first block of its prefix; now each radix
node and hash entry keeps ``first_key`` from when it is made.  Reading one first block per request would be wrong:
a request whose prefix twin was cached first caches its later blocks below the twin, so their prefix is the twin's.
Oracle: the climb itself, done independently of the entries -- up the pin index's block-to-parent links
(:class:`~minivllm.kv.prefix.base.PinIndex`) to a first block, whose namespace and tokens the test recorded when
a request wrote it.  The random caches have two tenants, heads that share a first block, twins, frees, evictions
(a radix edge shrinks from its end) and lookups that split radix edges.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.kv import BlockPool, KVCacheManager
from minivllm.kv.prefix import make_prefix_cache
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

from tests.fuzz import examples

_HEADS = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 3, 4])


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["radix", "hash"]), data=st.data())
def test_first_block_keys_equal_a_climb_to_each_prefixs_first_block(kind, data):
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 2, make_prefix_cache(kind, pool, 2))
    cache, written, live = kv.prefix_cache, {}, []  # written: block -> (namespace, its tokens)
    for i in range(data.draw(st.integers(1, 12))):
        toks = data.draw(st.sampled_from(_HEADS)) + data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
        r = Request(f"r{i}", toks, SamplingParams(max_tokens=4, ignore_eos=True), 0.0,
                    tenant=data.draw(st.sampled_from(["a", "b"])))
        action = data.draw(st.sampled_from(["share", "twin", "match", "evict"]))
        if action == "match":
            kv.match_prefix(r)  # (a radix walk may split an edge)
            continue
        if action == "evict":
            cache.evict(data.draw(st.integers(1, 4)))
            continue
        if action == "share":
            kv.share_computed(r)
        if not kv.allocate_slots(r, len(toks) - r.num_computed_tokens):
            kv.free(r)
            continue
        r.num_computed_tokens = len(toks)
        for j, b in enumerate(r.block_ids[: len(toks) // 2]):
            written[b] = (kv.namespace(r), tuple(toks[2 * j: 2 * j + 2]))
        kv.cache_full_blocks(r)
        live.append(r)
        if data.draw(st.booleans()):
            kv.free(live.pop(data.draw(st.integers(0, len(live) - 1))))
    parent = cache._pins.parent  # cached block -> the cached block before it

    def climbed(b: int) -> tuple:
        while parent[b] is not None:
            b = parent[b]
        return written[b]

    for b in range(18):  # each block alone (16, 17: never a block; a free one: not cached)
        assert cache.first_block_keys([b]) == ({climbed(b)} if cache.is_cached(b) else set()), b
    asked = data.draw(st.lists(st.integers(0, 17), max_size=16))
    assert cache.first_block_keys(asked) == {climbed(b) for b in asked if cache.is_cached(b)}
    assert cache.first_block_keys(iter(asked)) == cache.first_block_keys(asked)  # any iterable, read once
    assert kv.prefix_keys_holding(asked) == {hash(climbed(b)) for b in asked if cache.is_cached(b)}
