"""Tests written in a mutation pass over the prefix caches (``minivllm/kv/prefix/``) and the step metrics
(``minivllm/metrics/step_log.py``, ``minivllm/metrics/stats.py``).

Each test pins one behaviour that a small, realistic bug (a planted "mutant", named first in the docstring)
changed without any other test noticing.  Expectations come from outside the code under test: a hand count,
a brute-force longest common block prefix over what was inserted, or the definition written out by hand.
The lab-3 cache is driven by a hasher, matcher and picker written here, not by the lab's reference ones.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix import make_prefix_cache
from minivllm.kv.prefix.learner import LearnerHashCache
from minivllm.labs import check_lab03
from minivllm.metrics.stats import jain, meets_slo
from minivllm.metrics.step_log import FirstTimePrompt, StepLog, StepRecord, TenantStep, tenant_fields, tenant_series

from invariants import block_tokens as toks, cached_then_released  # noqa: E402 (tests/ is on sys.path)

BS = 4


def brute_force_hit(inserted: list[tuple[list[int], list[int]]], tokens: list[int]) -> list[int]:
    """The blocks of the longest block-aligned prefix of ``tokens`` that one of the ``(tokens, blocks)`` inserted
    (and still cached, the caller's business) covers."""
    best: list[int] = []
    for seq, blocks in inserted:
        n = 0
        while (n < len(blocks) and (n + 1) * BS <= len(tokens)
               and seq[n * BS:(n + 1) * BS] == tokens[n * BS:(n + 1) * BS]):
            n += 1
        if n > len(best):
            best = blocks[:n]
    return best


# -- the prefix caches -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_extend_onto_a_twin_reports_false_and_caches_nothing(kind):
    """Kills: ``RadixCache.extend`` dropping its ``blocks[0] in node.children`` check, and ``HashIndex.extend``
    dropping its twin check (``_lookup(entry, ...) is not None``).  ``extend`` may return True only when the cache
    ends up as a whole insert would leave it *and* that insert would return the caller's own blocks.  When another
    request already cached the same next block (a twin), the insert returns the twin, so ``extend`` must say False
    and leave the caller to insert.  Otherwise the radix tree replaces the twin's edge in its parent's children
    (the twin's blocks stay indexed but unreachable, and a later prompt misses them), and the hash index caches
    nothing while the KV manager believes its block is cached.  A second prompt that branches after the first
    block makes that block end an edge (the only place a radix ``extend`` goes on from).  Oracle: a hand count of
    cached blocks and a brute-force match over the prompts inserted."""
    pool = BlockPool(8)
    cache = make_prefix_cache(kind, pool, BS)
    prompt, branch = toks(1, 2), toks(1, 3)
    first, second = cached_then_released(cache, pool, prompt)
    third = pool.allocate_many(1)
    cache.insert(branch, [first] + third)
    pool.free_all(third)
    inserted = [(prompt, [first, second]), (branch, [first] + third)]
    mine = pool.allocate_many(1)
    assert cache.extend(first, toks(2), mine) is False
    assert cache.num_cached_blocks == 3 and not cache.is_cached(mine[0])
    assert cache.match(prompt) == brute_force_hit(inserted, prompt) == [first, second]
    assert cache.insert(prompt, [first] + mine).block_ids == [first, second]


# -- the lab-3 cache, built from a learner's three functions -----------------------------------------------------


def _hasher(token_ids, block_size, salt=None):
    """Chained keys: a block's key is the tuple of every token up to its end (collision-free), salted."""
    return [(salt, tuple(token_ids[: (i + 1) * block_size])) for i in range(len(token_ids) // block_size)]


def _matcher(token_ids, index, block_size, hasher, salt=None):
    """The cached blocks of the longest prefix of ``token_ids`` without its last token."""
    out = []
    for key in hasher(token_ids[:-1], block_size, salt):
        if key not in index:
            break
        out.append(index[key].block_id)
    return out


def _leaves_first(nodes):
    """LRU among unlocked leaves."""
    free = [n for n in nodes if n["locks"] == 0 and n["children"] == 0]
    return min(free, key=lambda n: n["last_access"])["id"] if free else None


def _oldest_first(nodes):
    """A learner's wrong rule: the oldest unlocked block, leaf or not (it can orphan a cached block)."""
    free = [n for n in nodes if n["locks"] == 0]
    return min(free, key=lambda n: n["last_access"])["id"] if free else None


def _learner(pool: BlockPool, picker=_leaves_first) -> LearnerHashCache:
    return LearnerHashCache(pool, BS, _hasher, _matcher, picker)


def test_the_learners_cache_counts_what_it_inserts_and_evicts():
    """Kills: the lab-3 cache's ``inserted_blocks`` or ``evicted_blocks`` not incremented.  Lab 3 sets a learner's
    cache beside the engine's on the same replay and reads these counters, so each must count what happened.
    Hand count: two blocks inserted, then a prompt sharing the first (one new block, the shared one not counted
    again), then all three evicted."""
    pool = BlockPool(8)
    cache = _learner(pool)
    cached_then_released(cache, pool, toks(1, 2))
    table = cache.match(toks(1, 3)) + pool.allocate_many(1)  # block 1 a hit, block 3 new
    assert len(table) == 2
    pool.incref(table[0])
    cache.insert(toks(1, 3), table)
    pool.free_all(table)
    assert cache.stats.inserted_blocks == 3
    assert cache.evict(10) == 3 and cache.stats.evicted_blocks == 3 and cache.num_cached_blocks == 0


def test_the_learners_cache_tells_the_picker_which_blocks_have_children():
    """Kills: ``LearnerHashCache.insert`` not counting a new block as its parent's child.  The picker only sees the
    ``children`` the cache reports; with every count 0, a leaves-first rule evicts the first block of a prompt
    and leaves its second cached but unreachable (a hit walks from the first block).  Oracle: the brute-force
    prefix over the one prompt inserted, cut to the one block that is left."""
    pool = BlockPool(8)
    cache = _learner(pool)
    prompt = toks(1, 2)
    blocks = cached_then_released(cache, pool, prompt)
    assert cache.evict(1) == 1
    assert cache.match(prompt) == brute_force_hit([(prompt, blocks[:1])], prompt) == blocks[:1]


def test_the_learners_cache_counts_locked_blocks_as_not_evictable():
    """Kills: ``num_evictable_blocks`` counting every block with a reference.  The scheduler admits against free +
    evictable blocks; a block a running request holds cannot be evicted, so counting it admits a request the pool
    cannot serve.  Hand count: two cached blocks, the first still held by a request."""
    pool = BlockPool(8)
    cache = _learner(pool)
    first, _ = cached_then_released(cache, pool, toks(1, 2))
    pool.incref(first)
    assert cache.num_evictable_blocks() == 1


def test_the_learners_insert_reports_only_the_leading_cached_run():
    """Kills: ``already`` counting every block found in the index, not only those before the first new one.
    ``num_already_cached_tokens`` is the leading part a request did not have to compute; a block found *after* a
    gap (left behind by a learner's picker that evicted its parent) is no saving.  Hand count: the first block was
    evicted, so the re-insert had 0 tokens cached in front."""
    pool = BlockPool(8)
    cache = _learner(pool, picker=_oldest_first)
    prompt = toks(1, 2)
    cached_then_released(cache, pool, prompt)
    assert cache.evict(1) == 1 and cache.match(prompt) == []  # the parent went; its child is orphaned
    fresh = pool.allocate_many(2)
    assert cache.insert(prompt, fresh).num_already_cached_tokens == 0


def _sum_hasher(token_ids, block_size, salt=None):
    """A weak chained hash for collisions on purpose: a block counts only by the sum of its tokens, so
    ``[1, 1, 1, 1]`` and ``[0, 0, 2, 2]`` collide, and so do the keys of every block after them."""
    sums = [sum(token_ids[i * block_size:(i + 1) * block_size]) for i in range(len(token_ids) // block_size)]
    return [(salt, tuple(sums[: i + 1])) for i in range(len(sums))]


# A validated matcher, as lab 3 asks for (a hit only where the entry holds these very tokens below the previous
# key): the lab's own reference, the one its checker falls back to.
_validating_matcher = check_lab03._ref_matcher


def test_the_learners_insert_caches_nothing_past_a_colliding_block():
    """Kills: ``LearnerHashCache.insert`` going on past a key collision instead of stopping.  A prompt whose first
    block collides with a cached block of other tokens is not cached from there on: its second block's K/V were
    computed after *its* first block, so an entry for it belongs to no cached path (no validated match can reach
    it), and it held a pool reference for nothing.  Hand count: the cache holds only the colliding block, the
    insert reports the caller's own blocks with nothing already cached, and freeing the prompt's blocks returns
    both to the pool."""
    pool = BlockPool(8)
    cache = LearnerHashCache(pool, BS, _sum_hasher, _validating_matcher, _leaves_first)
    x, y = [1, 1, 1, 1], [0, 0, 2, 2]
    assert _sum_hasher(x, BS) == _sum_hasher(y, BS)  # the collision the test is about
    (held,) = cached_then_released(cache, pool, x)
    mine = pool.allocate_many(2)
    result = cache.insert(y + toks(5), mine)
    assert (result.num_already_cached_tokens, result.block_ids) == (0, mine)
    assert cache.num_cached_blocks == 1 and cache.stats.inserted_blocks == 1 and not cache.is_cached(mine[1])
    pool.free_all(mine)
    assert pool.num_free == 7
    assert cache.match(x + toks(5)) == [held]  # the other prompt's block never serves this one's second


def test_a_learners_lookup_that_missed_makes_no_block_recent():
    """Kills: ``LearnerHashCache.match`` stamping every key of the query, not only the hits.  A lookup of a block
    whose key collides with a cached block of other tokens is a miss; it used nothing, so it must not make the
    colliding block recent and save it from eviction (nor leave access stamps for keys nothing caches).  LRU by
    hand: X cached first, Z second, then a missed lookup of X's colliding twin; the oldest used block is X."""
    pool = BlockPool(8)
    cache = LearnerHashCache(pool, BS, _sum_hasher, _validating_matcher, _leaves_first)
    x, y, z = [1, 1, 1, 1], [0, 0, 2, 2], toks(7)
    (bx,) = cached_then_released(cache, pool, x)
    cached_then_released(cache, pool, z)
    assert cache.match(y + toks(8)) == []  # (the query cut before its last token: y and a whole block of 8s)
    assert set(cache.last_access) == set(cache.index)
    assert cache.evict(1) == 1 and not cache.is_cached(bx)


# -- the step log ------------------------------------------------------------------------------------------------


def _record(step: int, seqs: int = 0, tenants: tuple[TenantStep, ...] = ()) -> StepRecord:
    ids = tuple(f"r{step}.{i}" for i in range(seqs))
    return StepRecord(step, float(step), ids, (0,) * seqs, (1,) * seqs, seqs, (), 0, 0, (), (), 0, 0, seqs, 0,
                      seq_tenants=tuple(t.tenant for t in tenants)[:seqs], tenants=tenants)


def test_the_step_log_keeps_exactly_its_budget_of_entries():
    """Kills: the trim comparing with ``>=`` (a record lost at the exact budget), and a record's size leaving out
    its tenant rows (a many-tenant log overruns the memory budget ``step_log_max_entries`` promises).  The bound is
    "at most ``max_entries``": records adding up to it exactly are all kept, one entry more drops the oldest.
    Entries per record, by hand: 1 for the step, 1 per sequence, 1 per tenant row."""
    rows = (TenantStep("a", 1, 0, 1, 0), TenantStep("b", 1, 0, 1, 0))
    log = StepLog(max_entries=10)
    log.append(_record(0, seqs=2, tenants=rows))  # 1 + 2 + 2 = 5
    log.append(_record(1, seqs=2, tenants=rows))  # 10 in all: exactly the budget
    assert (len(log), log.num_entries) == (2, 10)
    log.append(_record(2))  # 11: the oldest goes
    assert [r.step for r in log] == [1, 2] and log.num_entries == 6


def test_a_record_larger_than_the_budget_is_still_kept():
    """Kills: the trim allowed to pop the last record.  The newest step is always kept, even alone over the
    budget: an empty log loses the one record widgets and benchmarks read for "now" (``step_log[-1]``)."""
    log = StepLog(max_entries=2)
    log.append(_record(0, seqs=5))
    assert [r.step for r in log] == [0] and log.num_entries == 6


def test_a_cleared_step_log_starts_its_budget_from_zero():
    """Kills: ``clear`` emptying the records but not ``num_entries``.  A benchmark clears the log between runs; the
    stale count then trims every later record against entries that are gone, and the next run keeps only its
    last step.  Hand count: two 2-entry records fit a budget of 4."""
    log = StepLog(max_entries=4)
    log.append(_record(0, seqs=3))
    log.clear()
    log.append(_record(1, seqs=1))
    log.append(_record(2, seqs=1))
    assert [r.step for r in log] == [1, 2] and log.num_entries == 4


def test_a_slice_of_the_step_log_is_oldest_first():
    """Kills: a slice built from the records reversed.  ``log[a:b]`` must read like a list in append order, as
    ``log[i]`` does, or a timeline drawn from a slice runs backwards."""
    log = StepLog()
    for step in range(4):
        log.append(_record(step))
    assert [r.step for r in log[1:3]] == [1, 2]
    assert [r.step for r in log[-2:]] == [log[-2].step, log[-1].step] == [2, 3]


def test_tenant_rows_come_out_sorted_by_name_whatever_the_batch_order():
    """Kills: the per-tenant rows listed in first-seen order.  Two runs of one workload must log identical records
    (a replay and its recording are compared record by record), and the first-seen order changes with the batch
    order a policy picks.  Hand-built step: ``b``'s sequence before ``a``'s, ``c`` only waiting; ``seq_tenants``
    keeps the batch order, the rows are sorted, each with its own hand-counted numbers."""
    seqs = [SimpleNamespace(request=SimpleNamespace(tenant="b"), num_tokens=5),
            SimpleNamespace(request=SimpleNamespace(tenant="a"), num_tokens=1)]
    running = [SimpleNamespace(tenant="b", block_ids=[1, 2]), SimpleNamespace(tenant="a", block_ids=[3])]
    seq_tenants, rows = tenant_fields(seqs, running, {"c": 2, "b": 1})
    assert seq_tenants == ("b", "a")
    assert rows == (TenantStep("a", 1, 1, 1, 0), TenantStep("b", 5, 2, 1, 1), TenantStep("c", 0, 0, 0, 2))


def test_tenant_series_shows_exactly_the_tenants_asked_for():
    """Kills: ``tenant_series`` ignoring its ``tenants`` argument.  A plot that fixes its tenants (to compare two
    runs, say) gets those rows and only those, zeros where a tenant had no work.  Hand-built records: tenant ``a``
    in the first step only, ``z`` never."""
    records = [_record(0, seqs=1, tenants=(TenantStep("a", 3, 2, 1, 0),)), _record(1)]
    out = tenant_series(records, num_blocks=4, tenants=["a", "z"])
    assert set(out) == {"time", "step", "a", "z"}
    assert out["a"]["tokens"] == [3, 0] and out["a"]["kv_share"] == [0.5, 0.0] and out["z"]["running"] == [0, 0]
    assert set(tenant_series(records, num_blocks=4, tenants=["z"])) == {"time", "step", "z"}


def test_first_time_prompt_counts_a_chunk_past_the_old_front_only_once():
    """Kills: ``FirstTimePrompt`` counting a whole chunk (``end - start``) instead of the part past the furthest
    prompt position already served.  A request preempted in the middle of a chunked prefill recomputes from 0 and
    goes further in the same chunk: only the new part is service, or the fairness measurement credits the tenant
    preempted most.  Hand count, a 10-token prompt: chunk 0..4 (4 new), preempted, chunk 0..8 (4 new), chunk 8..11
    (2 prompt tokens, one decode); the service is the prompt, 10."""
    served = FirstTimePrompt()
    served.track("r", "a", 10)
    for step, (start, n) in enumerate([(0, 4), (0, 8), (8, 3)]):
        served.observe(StepRecord(step, float(step), ("r",), (start,), (n,), n, (), 0, 0, (), (), 0, 0, 1, 0))
    assert served.by_tenant == {"a": 10}


def test_tenant_series_against_hand_built_records():
    """Kills: ``tenant_series`` with ``waiting`` and ``running`` swapped, and ``time`` read from the step number.
    Every column of ``tenant_series`` read back against records built by hand: the clock (not the step
    number) as ``time``, each tenant's own waiting, running, tokens and KV share, and by default every tenant
    seen in *any* record -- ``b`` first has work in the second step, ``a`` has none there (zeros).  Distinct
    numbers in every field, so two swapped columns cannot agree."""
    def rec(step, time, rows):
        return StepRecord(step, time, (), (), (), 0, (), 0, 0, (), (), 0, 0, 0, 0, tenants=rows)

    records = [rec(3, 0.25, (TenantStep("a", 7, 2, 1, 4),)),
               rec(4, 0.75, (TenantStep("b", 5, 6, 3, 9),))]
    out = tenant_series(records, num_blocks=8)
    assert set(out) == {"time", "step", "a", "b"}
    assert out["time"] == [0.25, 0.75] and out["step"] == [3, 4]
    assert out["a"] == {"waiting": [4, 0], "running": [1, 0], "tokens": [7, 0], "kv_share": [0.25, 0.0]}
    assert out["b"] == {"waiting": [0, 9], "running": [0, 3], "tokens": [0, 5], "kv_share": [0.0, 0.75]}


def test_first_time_prompt_skips_an_untracked_request_and_counts_the_rest_of_the_step():
    """Kills: ``FirstTimePrompt.observe`` stopping at the first untracked request of a step (``return`` for
    ``continue``).  A request nobody tracked (another tenant's, or one added before tracking began) is skipped, and the
    tracked requests after it in the same step still count.  Hand count: ``r`` prefills 6 of its 6 prompt
    tokens in the step, behind ``x``."""
    served = FirstTimePrompt()
    served.track("r", "a", 6)
    served.observe(StepRecord(0, 0.0, ("x", "r"), (0, 0), (4, 6), 10, (), 0, 0, (), (), 0, 0, 2, 0))
    assert served.by_tenant == {"a": 6}


def test_a_step_log_needs_room_for_one_entry():
    """Kills: the guard letting ``max_entries=0`` through.  ``max_entries`` below 1 is refused when the log is made (a budget of 0 cannot hold even an idle step's
    one entry, so it would silently keep only the newest record); 1 is the smallest budget."""
    with pytest.raises(ValueError, match="max_entries"):
        StepLog(max_entries=0)
    assert StepLog(max_entries=1).max_entries == 1


def test_a_record_answers_get_like_the_dict_it_replaced():
    """Kills: ``get`` answering its default for a field the record has.  ``record.get(key, default)`` reads the field whenever the record has one (the per-tenant rows too), and the
    default only for a key no record has."""
    rows = (TenantStep("a", 1, 0, 1, 0),)
    r = StepRecord(0, 0.0, ("q",), (0,), (1,), 1, (), 0, 0, (), (), 0, 0, 1, 0, seq_tenants=("a",), tenants=rows)
    assert r.get("tenants") == rows and r.get("seq_tenants") == ("a",) and r["seqs"] == (("q", 0, 1),)
    assert r.get("no_such_field", 5) == 5


# -- the summary statistics --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ttft, itl, slo_ttft, slo_itl, met",
    [
        (0.5, 0.05, 0.5, 0.05, True),  # at both bounds: "within 500 ms" holds at 500 ms
        (0.5000001, 0.05, 0.5, 0.05, False),
        (0.5, 0.0500001, 0.5, 0.05, False),
        (None, None, 0.5, None, False),  # never produced a first token: misses a TTFT bound
        (None, None, None, 0.05, True),  # no gaps and no TTFT bound: nothing to miss
        (0.1, None, 0.5, 0.05, True),  # one chunk streamed: no gap to miss
        (9.0, 9.0, None, None, True),
    ],
)
def test_an_slo_is_met_at_its_bounds_and_missed_past_them(ttft, itl, slo_ttft, slo_itl, met):
    """Kills: a request with no first token passing a TTFT bound (``ttft is None`` read as "met").  Goodput counts
    requests that kept their latency promise, and a request that failed or was cut before its first token kept
    none: counting it as good inflates goodput exactly when the server is failing.  The rule, by hand: met *at* a
    bound, missed past it (the rows ``test_sim_mutants`` pins through the simulator, restated at the source), a
    missing first token misses any TTFT bound, a request with no gaps misses no ITL bound."""
    assert meets_slo(ttft, itl, slo_ttft, slo_itl) is met


def test_jains_index_counts_a_tenant_that_got_nothing():
    """Kills: ``n`` taken as the tenants with a non-zero share.  Jain's index divides by *every* tenant: one tenant
    served everything and the other nothing is the most unfair split of two, 1/2, not a perfect 1 -- or a starved
    tenant makes the fairness benchmark read perfectly fair.  Hand-computed: ``(4 + 0)^2 / (2 * 16) = 0.5``;
    nobody served at all has no split to judge (NaN)."""
    assert jain([4, 0]) == 0.5
    assert jain([1, 1, 0, 0]) == 0.5
    assert jain([3, 3]) == 1.0
    assert math.isnan(jain([0, 0])) and math.isnan(jain([]))
