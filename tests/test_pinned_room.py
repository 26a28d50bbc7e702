"""The room bound counts a pinned cached block only when the victims' release unpins it.

``KVCacheManager.could_start_if_freed`` bounds the room a waiting request would find if some running requests
(the victims) gave their blocks back; the scheduler preempts them only if it says "perhaps" (True).  A cached
block that only the cache holds may still be pinned -- not evictable -- by a held block cached below it (a request
whose prefix twin was cached first caches its later blocks below the twin).  The bound counted every such block
as room, as if each became evictable once the victims go; but one pinned by a block that a request left running
holds stays pinned.  A search (the strict futile-preemption check over :func:`tests.test_futile_swap._searched_program`'s
programs) found seed 1745 (WFQ, swap, hash prefix cache, 14 blocks of 4): at step 44 ``c10#0``, preempted by
recompute and needing 7 blocks, preempted ``a11#1`` and then ``a11#0`` and was still not seated -- the bound
counted 8 blocks of room, three of them cached blocks pinned by ``b9#1``, which kept running; a recount finds 5
(:func:`tests.test_futile_swap.test_seed_1745_preempts_only_for_requests_it_seats` replays it).

Now the prefix cache says which pinned blocks the release unpins
(:meth:`~minivllm.kv.prefix.base.LeafEviction.unpinned_if_released`, the :class:`~minivllm.interfaces.TracksPins`
seam).  Oracles here: built states asked of the bound and checked against the brute-force recount
(:func:`tests.invariants.room_after`: free the victims on a copy, let the request take its cached prefix, evict all
the cache can give up, count), and the pinned sets against a recount from scratch (every block held by a request
left running, and the blocks above it)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm.kv import BlockPool, KVCacheManager
from minivllm.kv.block_pool import PoolAdapter
from minivllm.kv.prefix import make_prefix_cache
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

from tests.fuzz import examples
from tests.invariants import room_after
from tests.learner_pools import LearnersPool


def _req(rid, toks):
    return Request(rid, list(toks), SamplingParams(max_tokens=4, ignore_eos=True), 0.0)


def _running(kv, rid, toks, computed):
    """A request holding blocks for its first ``computed`` tokens, its full blocks offered to the cache."""
    r = _req(rid, toks)
    assert kv.allocate_slots(r, computed)
    r.num_computed_tokens = computed
    kv.cache_full_blocks(r)
    return r


def _scene(kind):
    """Block size 2, 8 blocks.  ``A`` caches ``[1, 2]`` (block ``a0``) first; ``B`` = ``[1, 2, 3, 4, 9]`` computes
    its own twin of it (not cached), and its ``[3, 4]`` is cached below ``a0``.  Likewise ``D`` caches ``[5, 6]``
    (``d0``) and ``E`` = ``[5, 6, 8, 8, 9]`` caches its ``[8, 8]`` below it; ``D`` is then freed, so only the cache
    holds ``d0``, pinned by ``E``'s block.  ``C`` takes the last 2 blocks: nothing is free or evictable."""
    pool = BlockPool(8)
    kv = KVCacheManager(pool, 2, make_prefix_cache(kind, pool, 2))
    a = _running(kv, "A", [1, 2, 7], 2)
    b = _running(kv, "B", [1, 2, 3, 4, 9], 4)
    d = _running(kv, "D", [5, 6, 9], 2)
    d0 = d.block_ids[0]
    e = _running(kv, "E", [5, 6, 8, 8, 9], 4)
    kv.free(d)
    c = _running(kv, "C", [50, 51, 52], 3)
    a0 = a.block_ids[0]
    assert b.block_ids[0] != a0 and e.block_ids[0] != d0  # twins, not shared
    assert pool.num_free == 0 and kv.num_available_blocks == 0
    assert {a0, d0} <= set(kv.prefix_cache.pinned_blocks())
    return kv, a, b, c, e, a0, d0


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_pinned_block_is_room_only_when_the_victims_alone_pin_it(kind):
    """Each victim set and waiting request ``W`` of 2..5 blocks (no cached prefix), with the claims of those left
    promised (the recount's) and with none, asked of the bound and checked against the brute force.  By hand,
    nothing promised: ``C`` gone frees its 2 blocks, and ``d0`` stays pinned by ``E``, which keeps running -- 2,
    where the old bound counted ``d0`` too and said "perhaps" to a ``W`` of 3; ``B`` gone frees its twin block
    and its cached block below ``a0`` (``A`` keeps ``a0``) -- 2, again not 3; ``E`` gone frees its twin block, its
    cached block and ``d0`` above it -- 3, room ``d0`` included.  ``A`` and ``E`` gone with 1 block promised:
    ``a0`` stays pinned by ``B``, so ``A``'s release gives nothing (the old bound counted ``a0`` among the freed
    blocks); 3 - 1 = 2 for a ``W`` of 3: no.

    ``C`` and ``A`` gone, nothing promised, ``W`` of 3: ``A``'s ``a0`` stays pinned by ``B`` -- 2, no.  The first
    version of the fix still counted ``a0`` there: it asked the cache only when the blocks counted before the
    pinned clause fell short, and they (``a0`` among them) reached 3.  Now a victim's cached block is left out of
    that early yes, and the cache is asked whenever the answer turns on such blocks."""
    by_hand = {(("C",), 3, 0): False, (("B",), 3, 0): False, (("E",), 3, 0): True, (("A", "E"), 3, 1): False,
               (("A", "C"), 3, 0): False}
    seen, no_room = set(), 0
    for victims in (["E"], ["A"], ["A", "E"], ["B"], ["A", "B"], ["B", "E"], ["C"], ["A", "C"]):
        for blocks in range(2, 6):
            kv, a, b, c, e, a0, d0 = _scene(kind)
            running = [a, b, c, e]
            gone = [r for r in running if r.request_id in victims]
            w = _req("W", range(100, 100 + 2 * blocks))
            free, claimed, need = room_after(kv, running, gone, w)
            for reserved in (claimed, 0):
                fits = free >= reserved + need
                said = kv.could_start_if_freed(w, gone, reserved)
                case = (tuple(victims), blocks, reserved)
                assert said or not fits, case  # "certainly not" is never wrong
                assert said == fits, (case, free, need)
                if case in by_hand:
                    assert fits == by_hand[case], case
                    seen.add(case)
                no_room += not fits
    assert seen == by_hand.keys() and no_room >= 20


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_the_release_query_names_the_blocks_only_the_victims_pin(kind):
    """The cache's own answer, against the hand trace of :func:`_scene`: ``E``'s release unpins ``d0`` and its own
    cached block; ``A``'s unpins nothing (``B`` pins ``a0``); ``A`` and ``B`` together unpin ``a0`` and ``B``'s
    cached block.  Asking changes nothing: the pinned set is the same after."""
    kv, a, b, c, e, a0, d0 = _scene(kind)
    cache = kv.prefix_cache
    before = set(cache.pinned_blocks())

    def holds(*reqs):
        out = {}
        for r in reqs:
            for blk in r.block_ids:
                out[blk] = out.get(blk, 0) + 1
        return out

    assert cache.unpinned_if_released(holds(e)) == {d0, e.block_ids[1]}
    assert cache.unpinned_if_released(holds(a)) == set()
    assert cache.unpinned_if_released(holds(a, b)) == {a0, b.block_ids[1]}
    assert cache.unpinned_if_released({}) == set()
    assert set(cache.pinned_blocks()) == before


def _after_evicting_all(kv, gone=()) -> set[int]:
    """Brute force on a copy of ``kv``: free ``gone``, evict every cached block the cache gives up, and return the
    blocks still cached -- exactly the pinned ones (eviction takes every block nothing pins)."""
    kv2, gone2 = copy.deepcopy((kv, list(gone)))
    for r in gone2:
        kv2.free(r)
    while kv2.prefix_cache.evict(kv2.pool.num_blocks):
        pass
    return {b for b in range(kv2.pool.num_blocks) if kv2.prefix_cache.is_cached(b)}


class _Unpinned:
    """A prefix cache without :class:`~minivllm.interfaces.TracksPins` (the wrapped cache's other members): as lab 3's
    learner cache, it counts every block only it holds as evictable, pinned or not."""

    def __init__(self, cache) -> None:
        self.cache = cache

    def num_evictable_blocks(self) -> int:
        pool = self.cache.pool
        return sum(1 for b in range(pool.num_blocks) if self.cache.is_cached(b) and pool.refcount(b) == 1)

    def __getattr__(self, name):
        if name in ("pinned_blocks", "unpinned_if_released"):
            raise AttributeError(name)
        return getattr(self.cache, name)


_HEADS = ([1, 2, 3, 4], [1, 2, 5, 6], [7, 8, 3, 4])  # two share a first block; twins arise where one is computed anew


@st.composite
def _scenes(draw):
    """A pool of 16 blocks of 2 tokens and up to 7 requests on it, each started on its cached prefix or computed
    anew beside it (a twin, whose later blocks are cached below the cached twin), some computed part-way, some
    then freed; the cache is built on the engine's pool (its pins kept as the pool reports) or on a learner's
    (recounted at each ask)."""
    kind, learner = draw(st.sampled_from(["radix", "hash"])), draw(st.booleans())
    pool = PoolAdapter(LearnersPool(16), 16) if learner else BlockPool(16)
    kv = KVCacheManager(pool, 2, make_prefix_cache(kind, pool, 2))
    running = []
    for i in range(draw(st.integers(1, 7))):
        toks = draw(st.sampled_from(_HEADS)) + draw(st.lists(st.integers(1, 3), min_size=1, max_size=5))
        r = _req(f"r{i}", toks)
        if draw(st.booleans()):
            kv.share_computed(r)  # its cached prefix
        computed = draw(st.integers(r.num_computed_tokens, len(toks)))
        if computed > r.num_computed_tokens:
            if not kv.allocate_slots(r, computed - r.num_computed_tokens):
                kv.free(r)
                continue
            r.num_computed_tokens = computed
            kv.cache_full_blocks(r)
        if r.block_ids and draw(st.integers(0, 2)) == 0:
            kv.free(r)  # its cached blocks stay, held by the cache alone
        elif r.block_ids:
            running.append(r)
    return kv, running


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scene=_scenes(), data=st.data())
def test_the_release_query_and_the_bound_match_a_recount_on_random_caches(scene, data):
    """Random caches with twins (both caches, the engine's pool and a learner's): the blocks pinned now and those a
    release unpins equal a recount by eviction on a copy (before, and after the victims are freed); the bound says
    "perhaps" exactly where the brute-force room recount (:func:`tests.invariants.room_after`) finds room, for a
    waiting request that may share a cached head, with the claims of those left promised and with none; a cache
    that cannot say what pins what gets a bound that never says "certainly not" where the recount finds room."""
    kv, running = scene
    cache = kv.prefix_cache
    pinned = _after_evicting_all(kv)
    assert set(cache.pinned_blocks()) == pinned
    gone = data.draw(st.lists(st.sampled_from(running), unique_by=id, max_size=4)) if running else []
    released: dict[int, int] = {}
    for r in gone:
        for b in r.block_ids:
            released[b] = released.get(b, 0) + 1
    assert cache.unpinned_if_released(released) == pinned - _after_evicting_all(kv, gone)
    assert set(cache.pinned_blocks()) == pinned  # asking changed nothing
    blind = KVCacheManager(kv.pool, 2, _Unpinned(cache))  # a cache that cannot say what pins what
    for head in _HEADS + ([50, 51],):  # a waiting request of 3 to 16 blocks on each cached head (or none)
        for n in range(1, 29, 3):
            w = _req("W", head + [60 + i % 3 for i in range(n)])
            free, claimed, need = room_after(kv, running, gone, w)
            for reserved in (claimed, 0):
                fits = free >= reserved + need
                assert kv.could_start_if_freed(w, gone, reserved) == fits, (head, n, reserved, free, need)
                assert blind.could_start_if_freed(w, gone, reserved) or not fits  # more room, never less
