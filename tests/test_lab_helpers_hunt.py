"""A learner's-advocate hunt through the labs' engine-facing helpers: what a click or a plausible input leaves behind.

Lab 3 steps :class:`~minivllm.labs.workloads.PrefixReplay` from a :class:`~minivllm.labs.widgets.Stepper`'s
"next step" button and from cells a learner edits (``for _ in range(5): replay.step()``).  A call that fails there
must say why and leave the pool and the cache as a recount says they should be; otherwise the tree drawn after it
shows paths locked by nobody and the cache's hit rate counts prompts that were never served.  The oracles are
recounts by hand: which blocks the cache holds (one reference each), which one request still runs (one more).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minivllm.kv.block_pool import BlockPool  # noqa: E402
from minivllm.kv.prefix.radix import RadixCache  # noqa: E402
from minivllm.labs import widgets, workloads  # noqa: E402

BS = 16


def _expected_refcounts(pool, cache, running_blocks=()):
    """Every reference there should be: one per block the cache indexes, one more per block a running request holds."""
    return [int(cache.is_cached(b)) + (b in running_blocks) for b in range(pool.num_blocks)]


def test_a_prompt_the_pool_cannot_hold_is_refused_and_leaves_no_reference_or_lookup_behind():
    """A 4-block pool: prompt 0 (64 tokens) fills it and is cached; prompt 1 shares its first 48 tokens (3 blocks)
    and needs 3 more blocks of its own, 6 in all.  Refused -- but each click used to take a reference on the 3 hit
    blocks that no request ever dropped (refcounts 2, 3, 4 ... after one, two, three clicks: drawn locked for good,
    never evictable), and to count the refused prompt's 48 hit tokens in the cache's hit rate.

    Oracle, by hand: once prompt 0 has finished (the refused click finished it), each of the 4 cached blocks has
    the cache's one reference; the cache's counters hold prompt 0's lookup alone (63 tokens looked up, 0 hit),
    as the engine counts a lookup only once a request is admitted (``KVCacheManager.record_admission``).
    """
    pool = BlockPool(4)
    cache = RadixCache(pool, BS)
    prompts = [list(range(100, 164)), list(range(100, 148)) + list(range(500, 540))]
    stepper = widgets.Stepper(workloads.PrefixReplay(cache, pool, prompts), draw=None,
                              describe=lambda r: str(r.records[-1]))
    assert stepper.step() == str({"request": 0, "prompt_tokens": 64, "hit_tokens": 0})
    for _ in range(3):  # a learner clicks again and again
        line = stepper.press("next step")
        assert [pool.refcount(b) for b in range(4)] == _expected_refcounts(pool, cache) == [1, 1, 1, 1]
        assert (cache.stats.queries_tokens, cache.stats.hits_tokens) == (63, 0)
        assert line.startswith("next step: ValueError: PrefixReplay: prompt 1 (88 tokens, 48 of them cached)")
    assert cache.evict(4) == 4  # nothing is locked: the whole cache can go, and the pool is whole again
    assert pool.num_free == 4


def test_stepping_past_the_last_prompt_says_so_and_keeps_the_last_request_running():
    """Lab 3's walk relies on it: "the last one is still running", so evicting everything leaves its path.  A learner
    who steps once too often (``range(5)`` made ``range(10)`` over 9 prompts) got an IndexError -- after the call
    had already finished the last request, unlocking the path the next cell says survives.

    Oracle, by hand: two 32-token prompts sharing their first block; after both are sent, the cache holds the
    three full blocks (one reference each) and the second request still holds its two (one more each).
    """
    pool = BlockPool(8)
    cache = RadixCache(pool, BS)
    first = list(range(100, 132))
    second = first[:BS] + list(range(300, 316))
    replay = workloads.PrefixReplay(cache, pool, [first, second])
    replay.step()
    replay.step()
    running = set(replay.held.block_ids)
    assert len(running) == 2 and cache.num_cached_blocks == 3
    with pytest.raises(Exception) as refused:
        replay.step()
    assert [pool.refcount(b) for b in range(8)] == _expected_refcounts(pool, cache, running)
    assert cache.evict(8) == 1  # only the first prompt's second block is nobody's: the running path survives
    assert refused.type is ValueError and "all 2 prompts were sent" in str(refused.value)


def test_a_namespace_list_that_does_not_match_the_prompts_is_refused_before_anything_is_cached():
    """``namespaces`` names each prompt's tenant.  One too few (a learner's loop that appends a prompt and forgets its
    tenant) used to replay the prompts it had names for and fail on the next with an IndexError, the cache already
    filled.  Oracle: the call is refused by name and the pool is untouched (8 blocks free, nothing cached)."""
    pool = BlockPool(8)
    cache = RadixCache(pool, BS)
    prompts = [list(range(100, 132)), list(range(200, 232))]
    with pytest.raises(Exception) as refused:
        workloads.replay_prefix_cache(cache, pool, prompts, namespaces=["alice"])
    assert pool.num_free == 8 and cache.num_cached_blocks == 0
    assert refused.type is ValueError and "one namespace per prompt, got 1 namespaces for 2 prompts" in str(refused.value)
