"""``KVCacheManager.could_start_if_freed`` answers "certainly not" (False) only when it is so.

The scheduler asks it before preempting victims to seat a better-ranked request; a wrong False keeps the
request waiting behind work ranked below it.  The bound took the cached prefix the request would share off the
room even where that prefix was pinned (not evictable now, so never counted in the room): one block counted
twice against it.  Oracles: a scene computed by hand, and brute force -- on a copy of a running engine's KV
manager, free the victims, let the request take its cached prefix as admission does, and ask the pool.
"""

from __future__ import annotations

import copy
import random

import pytest

from minivllm.kv import BlockPool, KVCacheManager
from minivllm.kv.prefix import make_prefix_cache
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

from tests.invariants import claimed_blocks, tiny_engine


def _req(rid, toks):
    return Request(rid, list(toks), SamplingParams(max_tokens=4, ignore_eos=True), 0.0)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_pinned_cached_prefix_the_request_would_share_is_not_taken_off_the_room_twice(kind):
    """Block size 2, 6 blocks.  ``A`` caches ``[1, 2]`` first; ``B``'s twin of it loses, and ``B``'s ``[3, 4]``
    is cached below ``A``'s block, which only the cache holds once ``A`` is freed, pinned by ``B``'s block.
    ``C`` takes the rest of the pool.  ``W`` = ``[1, 2, 8, 8, 8]`` hits ``A``'s block and needs 2 more.
    By hand: freeing ``B`` frees its first block and leaves ``[3, 4]`` to the cache alone (evictable once
    ``W`` locks ``A``'s block above it): 2 blocks, exactly what ``W`` needs."""
    pool = BlockPool(6)
    kv = KVCacheManager(pool, 2, make_prefix_cache(kind, pool, 2))
    b, a = _req("B", [1, 2, 3, 4, 9]), _req("A", [1, 2, 7])
    assert kv.allocate_slots(b, 4) and kv.allocate_slots(a, 2)
    a.num_computed_tokens = 2
    kv.cache_full_blocks(a)
    b.num_computed_tokens = 4
    kv.cache_full_blocks(b)
    kv.free(a)
    c = _req("C", range(100, 107))
    assert kv.allocate_slots(c, 6) and pool.num_free == 0
    w = _req("W", [1, 2, 8, 8, 8])
    assert kv.match_prefix(w).num_tokens == 2 and kv.num_available_blocks == 0
    said = kv.could_start_if_freed(w, [b], 0)
    kv.free(b)
    kv.share_computed(w)
    assert kv.can_provide(kv.num_new_blocks(w, w.num_uncomputed_tokens)), "freeing B does make room for W"
    assert said, "could_start_if_freed said 'certainly not'"


def test_certainly_not_is_never_wrong_on_running_engines():
    """Seeded workloads sharing parts of a prefix on small pools (both caches, recompute and swap); at random
    moments, a waiting request and a random set of running victims.  Each False is checked on a deep copy.
    Seeds 150-179 held four wrong answers before the fix."""
    checked = 0
    for seed in range(150, 180):
        rnd = random.Random(seed)
        kind = rnd.choice(["radix", "hash", None])
        mode = rnd.choice(["recompute", "swap"])
        opts = {"num_cpu_blocks_override": rnd.choice([4, 16])} if mode == "swap" else {}
        engine = tiny_engine(num_blocks=rnd.randrange(12, 18), max_len=48, prefix=kind, preemption_mode=mode, **opts)
        sched, kv = engine.scheduler, engine.kv
        base = [rnd.randrange(1, 40) for _ in range(16)]
        for i in range(14):
            prompt = base[:rnd.randrange(0, 17)] + [rnd.randrange(1, 40) for _ in range(rnd.randrange(1, 10))]
            engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=rnd.randrange(1, 14), ignore_eos=True), request_id=f"r{i}")
            for _ in range(rnd.randrange(0, 3)):
                engine.step()
                waiting = [r for r in sched.waiting if r.leader is None]
                if not waiting or not sched.running:
                    continue
                for _ in range(4):
                    req = rnd.choice(waiting)
                    victims = [r for r in sched.running if rnd.random() < 0.6] or [sched.running[0]]
                    reserved = claimed_blocks(kv, [r for r in sched.running if r not in victims])  # (brute force)
                    if kv.could_start_if_freed(req, victims, reserved):
                        continue
                    kv2, req2, victims2 = copy.deepcopy((kv, req, victims))
                    for r in victims2:
                        kv2.free(r)
                    if not req2.cpu_block_ids:
                        kv2.share_computed(req2)
                    need = kv2.num_new_blocks(req2, req2.num_uncomputed_tokens) + kv2.num_copy_on_write_blocks(req2)
                    assert not kv2.can_provide(reserved + need), (seed, req.request_id, [r.request_id for r in victims])
                    checked += 1
        while engine.has_unfinished_requests():
            engine.step()
    assert checked > 10, checked
