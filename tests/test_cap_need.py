"""A KV cap charges a waiting request only the blocks its group would gain: a cached prefix the group holds is free.

``TenantConfig.max_kv_share`` and the three-class reserve cap the distinct blocks a group of requests holds.
Admission used to charge a waiting request its whole prompt (reject mode: its worst case), the cached prefix its
group already holds included -- blocks admission shares, so the group gains none of them.  With a cap of 5 blocks,
two requests behind one 3-block system prompt fit together (3 shared + 1 + 1), yet the second waited until the
first finished, or under ``over_cap="reject"`` got a 429.  Now the fixed need is still checked first, and only when
it fails on a KV cap is the held prefix taken off, found by a lookup that leaves the cache as it was.

Oracles, independent of the scheduler's own counts:

* a brute-force count of whether a waiting request fits: per cap group, the group's claims
  (``invariants.group_claims``: a set of every block its running members hold, plus what their next writes add)
  plus the request's blocks less the ones it would share -- a block counts as shared when some member holds it at
  a position whose whole token prefix equals the request's and the prefix cache holds it (a cached block sits
  only at its own prefix, so a lookup of the request reaches it).  The request must be admitted in the first step
  where that count says it fits;
* a set of the blocks each capped group's running requests hold, after every step: never over the cap;
* the tokens of an uncapped run of the same workload (caps change *when* tokens come, never *which*);
* for the caches' new lookups: ``match`` on a deep copy (same blocks), and the eviction order, counters, clock
  and refcounts of the cache left as they were.
"""

from __future__ import annotations

import copy

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix import make_prefix_cache
from minivllm.sched.scheduler import Scheduler

from tests.invariants import KVContents, assert_no_leak, group_claims

BS = 8
SYSTEM = [7] * 24  # three full 8-token blocks
NUM_BLOCKS = 64
CAP5 = 5 / NUM_BLOCKS  # max_kv_share of exactly 5 blocks


def _engine(kind="radix", **options) -> LLMEngine:
    """8-token blocks, prefix caching on; KVContents checks every KV slot a step attends.  ``options`` add to or
    replace these settings."""
    if "tenants" in options:
        options.setdefault("scheduling_policy", "caps")
    cfg = EngineConfig(**{**dict(num_gpu_blocks_override=NUM_BLOCKS, block_size=BS, max_num_seqs=8,
                                 max_num_batched_tokens=256, max_model_len=128, enable_prefix_caching=True,
                                 prefix_cache=kind, device="cpu"), **options})
    return LLMEngine(cfg, executor=KVContents(BS), model_max_len=128, eos_token_ids=set())


def _keys(engine):
    caps = engine.scheduler.caps
    return lambda r: [g.key for g in caps.groups(r)]


def _brute_shared(engine, req, members) -> int:
    """Blocks of ``req``'s cached prefix that ``members`` hold, found from their tables and tokens alone."""
    kv, tokens = engine.kv, req.all_token_ids
    full = (len(tokens) - 1) // BS  # (the last token is never matched)
    shared = set()
    for m in members:
        if kv.namespace(m) != kv.namespace(req):
            continue
        mine = m.all_token_ids
        for i, b in enumerate(m.block_ids[:full]):
            if mine[:(i + 1) * BS] != tokens[:(i + 1) * BS]:
                break
            if kv.prefix_cache.is_cached(b):
                shared.add(b)
    return len(shared)


def _brute_fits(engine, req) -> bool:
    """Would ``req`` keep every cap of its groups if admitted now, charged only what its groups would gain?"""
    sched = engine.scheduler
    reject = engine.config.preemption_mode == "reject"
    keys = _keys(engine)
    claims = group_claims(engine.kv, sched.running, keys, worst_case=reject)
    tokens = req.max_total_tokens if reject else req.num_tokens
    need = -(-tokens // BS)
    for g in sched.caps.groups(req):
        members = [m for m in sched.running if g.key in keys(m)]
        if g.max_running is not None and len(members) >= g.max_running:
            return False
        if g.max_blocks is not None and claims.get(g.key, 0) + need - _brute_shared(engine, req, members) > g.max_blocks:
            return False
    return True


def _held_within_caps(engine) -> None:
    sched = engine.scheduler
    for r in sched.running:
        for g in sched.caps.groups(r):
            if g.max_blocks is not None:
                held = set().union(*[m.block_ids for m in sched.running if g in sched.caps.groups(m)])
                assert len(held) <= g.max_blocks, (g.key, len(held), g.max_blocks)


def _run(engine, watch: str, arrivals: dict, sp: SamplingParams) -> tuple[int, int | None, dict]:
    """Step ``engine`` to the end, adding ``arrivals[step] = [(request_id, prompt, tenant), ...]`` before that step
    (a fourth item: that request's own SamplingParams instead of ``sp``).
    Returns the first step at which the brute force said ``watch`` fits (checked before each step, while it waits),
    the step that admitted it, and every request's tokens and finish reason."""
    first_fit = admitted = None
    out, step = {}, 0
    while step == 0 or engine.has_unfinished_requests() or step in arrivals:
        _arrive(engine, arrivals.get(step, ()), sp)
        waiting = {r.request_id: r for r in engine.scheduler.waiting}
        if first_fit is None and watch in waiting and _brute_fits(engine, waiting[watch]):
            first_fit = step
        for o in engine.step():
            if o.finished:
                out[o.request_id] = ([c.token_ids for c in o.outputs], o.outputs[0].finish_reason)
        if admitted is None and any(r.request_id == watch for r in engine.scheduler.running):
            admitted = step
        _held_within_caps(engine)
        step += 1
        assert step < 200
    assert_no_leak(engine)
    return first_fit, admitted, out


def _arrive(engine, arrivals, sp) -> None:
    for rid, prompt, tenant, *own in arrivals:
        engine.add_request({"prompt_token_ids": prompt}, own[0] if own else sp, tenant=tenant, arrival_time=0.0,
                           request_id=rid)


def _uncapped(arrivals, sp, kind="radix", **options) -> dict:
    engine = _engine(kind, **options)
    *_, out = _run_free(engine, arrivals, sp)
    return out


def _run_free(engine, arrivals, sp):
    out, step = {}, 0
    while step == 0 or engine.has_unfinished_requests() or step in arrivals:
        _arrive(engine, arrivals.get(step, ()), sp)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = ([c.token_ids for c in o.outputs], o.outputs[0].finish_reason)
        step += 1
    return step, out


SP = SamplingParams(max_tokens=3, ignore_eos=True)
# ``first`` runs a step on its own (its prompt's three full blocks are then cached and held); ``second`` shares
# them.  Hand count at a cap of 5: ``first`` holds 4 blocks (28 tokens; its 3 outputs fit the fourth), ``second``
# needs 4 of which 3 are held: 4 + 1 = 5 fits -- the whole prompt, 4 + 4 = 8, did not.
TWO = {0: [("first", SYSTEM + [1] * 4, "a")], 1: [("second", SYSTEM + [2] * 4, "a")]}


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("mode", ["recompute", "reject"])
def test_a_request_whose_prefix_its_tenant_holds_starts_in_the_first_step_it_fits(kind, mode):
    """Waiting mode (recompute: its tokens so far) and reject mode (its worst case, prompt + max_tokens: 31 tokens,
    still 4 blocks): the old charge made ``second`` wait until ``first`` finished."""
    engine = _engine(kind, tenants={"a": TenantConfig(max_kv_share=CAP5)}, preemption_mode=mode)
    first_fit, admitted, out = _run(engine, "second", TWO, SP)
    assert first_fit == 1 and admitted == 1, (first_fit, admitted)
    assert out == _uncapped(TWO, SP, kind, preemption_mode=mode)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_reject_cap_does_not_turn_away_a_request_that_fits_once_its_held_prefix_is_free(kind):
    """``TenantConfig(over_cap="reject")``: the old charge answered ``second`` with a 429 (4 + 4 > 5)."""
    engine = _engine(kind, tenants={"a": TenantConfig(max_kv_share=CAP5, over_cap="reject")})
    first_fit, admitted, out = _run(engine, "second", TWO, SP)
    assert first_fit == 1 and admitted == 1, (first_fit, admitted)
    assert out["second"][1] == "length" and engine.scheduler.stats.num_rejected == 0
    assert out == _uncapped(TWO, SP, kind)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_reject_cap_beside_a_full_token_cap_makes_it_wait_not_turns_it_away(kind):
    """A review of the first version: the held prefix was taken off only when a KV cap alone failed, so with another
    cap failing in the same pass the reject group charged the whole prompt and turned the request away.  Here
    ``max_tokens_per_step=1``: ``first`` prefills a token a step (28 steps), then decodes one a step, which fills the
    token cap.  ``second`` arrives at step 29, sharing ``first``'s 3 cached blocks: 4 held + (4 - 3) = 5 blocks, at
    the cap -- it waits for the token cap (a per-step cap never rejects), and runs once ``first`` is done.  The old
    charge, 4 + 4 > 5, answered it with a 429 at step 29.  Oracle: the hand count, and each request's tokens equal
    to an uncapped run's (greedy: when it runs does not change what it says)."""
    tenants = {"a": TenantConfig(max_kv_share=CAP5, over_cap="reject", max_tokens_per_step=1)}
    sp = SamplingParams(max_tokens=4, ignore_eos=True)  # (first ends at 32 tokens: its 4 blocks, no fifth)
    engine = _engine(kind, tenants=tenants)
    first_fit, admitted, out = _run(engine, "second", {0: TWO[0], 29: TWO[1]}, sp)
    assert engine.scheduler.stats.num_rejected == 0 and out["second"][1] == "length", out
    assert first_fit == 29 and admitted > 29, (first_fit, admitted)  # (it fits its KV cap; the token cap holds it)
    assert out == _uncapped(TWO, sp, kind)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_shared_cap_group_charges_a_prefix_another_tenant_of_its_class_holds_once(kind):
    """A cap group of several tenants: the three-class reserve leaves agent and batch work 5 of 64 blocks, two batch
    tenants share one cache (``share_prefix_cache_across_tenants``), and ``second`` (tenant ``b2``) starts on the
    prompt ``first`` (tenant ``b1``) holds.  Each tenant has no cap of its own: only the class group's count is cut."""
    engine = _engine(kind, scheduling_policy="three_class", share_prefix_cache_across_tenants=True,
                     preemption_mode="recompute",
                     three_class=ThreeClassConfig(interactive_kv_reserve=1 - CAP5),
                     tenants={"b1": TenantConfig(priority_class="batch"), "b2": TenantConfig(priority_class="batch")})
    arrivals = {0: [("first", SYSTEM + [1] * 4, "b1")], 1: [("second", SYSTEM + [2] * 4, "b2")]}
    assert engine.scheduler.caps.max_blocks_for("b2") == 5 and engine.config.tenant_config("b2").max_kv_share is None
    first_fit, admitted, out = _run(engine, "second", arrivals, SP)
    assert first_fit == 1 and admitted == 1, (first_fit, admitted)
    assert out == _uncapped(arrivals, SP, kind)


def _passed_over(monkeypatch) -> dict:
    """Count, per request id, the cap checks admission makes (``Scheduler._cap_failure``)."""
    checks: dict = {}
    failure = Scheduler._cap_failure

    def counted(self, req, usage, needs, per_step=True):
        checks[req.request_id] = checks.get(req.request_id, 0) + 1
        return failure(self, req, usage, needs, per_step)

    monkeypatch.setattr(Scheduler, "_cap_failure", counted)
    return checks


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_failure_stands_only_for_requests_that_share_no_more_and_still_spares_the_check(kind, monkeypatch):
    """Cap 6; ``first`` holds 4 blocks (the 3-block prompt and its own).  Waiting in this order:

    * ``alone`` (24 tokens of its own: 3 blocks, nothing shared) fails, 4 + 3 > 6;
    * ``sharer`` (the prompt + 4 tokens: 4 blocks, 3 of them held) needs as many blocks or more, yet fits:
      4 + 1 = 5.  A failure of ``alone`` must not stand for it (the old charge, 4 + 4 > 6, skipped it);
    * ``alone2`` (another 3 blocks of its own) cannot share: ``alone``'s failure stands for it, and it is passed
      over without a cap check of its own -- the shortcut that keeps a long capped backlog cheap still holds.

    Then everything runs to the end under the cap, with the tokens of an uncapped run."""
    engine = _engine(kind, tenants={"a": TenantConfig(max_kv_share=6 / NUM_BLOCKS)})
    arrivals = {0: [("first", SYSTEM + [1] * 4, "a")],
                1: [("alone", [30 + i for i in range(24)], "a"), ("sharer", SYSTEM + [2] * 4, "a"),
                    ("alone2", [60 + i for i in range(24)], "a")]}
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    for step in (0, 1):
        for rid, prompt, tenant in arrivals[step]:
            engine.add_request({"prompt_token_ids": prompt}, sp, tenant=tenant, arrival_time=0.0, request_id=rid)
        if step == 1:
            waiting = {r.request_id: r for r in engine.scheduler.waiting}
            fits = {rid: _brute_fits(engine, r) for rid, r in waiting.items()}
            assert fits == {"alone": False, "sharer": True, "alone2": False}, fits
            checks = _passed_over(monkeypatch)
        engine.step()
        _held_within_caps(engine)
    monkeypatch.undo()
    assert [r.request_id for r in engine.scheduler.running] == ["first", "sharer"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["alone", "alone2"]
    assert checks.get("alone2", 0) == 0 and checks["alone"] >= 1, checks
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = ([c.token_ids for c in o.outputs], o.outputs[0].finish_reason)
        _held_within_caps(engine)
    assert_no_leak(engine)
    free = _engine(kind)
    for step in (0, 1):
        for rid, prompt, tenant in arrivals[step]:
            free.add_request({"prompt_token_ids": prompt}, sp, tenant=tenant, arrival_time=0.0, request_id=rid)
        free.step()
    _, rest = _run_free(free, {}, sp)
    assert {k: v for k, v in out.items() if k != "first"} == {k: v for k, v in rest.items() if k != "first"}


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_a_failure_behind_one_held_prefix_does_not_stand_for_a_request_behind_another(kind):
    """Cap 8; the tenant holds two prompts: ``short`` (one cached block of 7s + 4 tokens: 2 blocks) and ``long``
    (three cached blocks of 8s + 4 tokens: 4 blocks), 6 in all.  ``x`` starts on the one-block prefix (4 blocks, 1
    held: 6 + 3 > 8, fails); ``y``, after it, starts on the three-block one (4 blocks, 3 held: 6 + 1 <= 8) and is
    admitted in the same step, though it needs as many blocks as ``x`` did."""
    engine = _engine(kind, tenants={"a": TenantConfig(max_kv_share=8 / NUM_BLOCKS)})
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    arrivals = {0: [("short", [7] * 8 + [1] * 4, "a"), ("long", [8] * 24 + [2] * 4, "a")],
                1: [("x", [7] * 8 + [3] * 20, "a"), ("y", [8] * 24 + [4] * 4, "a")]}
    first_fit, admitted, out = _run(engine, "y", arrivals, sp)
    assert first_fit == 1 and admitted == 1, (first_fit, admitted)
    assert out == _uncapped(arrivals, sp, kind)


def _brute_retry_steps(engine, req) -> int:
    """Steps until ``req``'s reject group has room for it, recounted from the tables.  Its running members leave in
    the order of the steps they still need (the hint's model: ``Request.steps_to_finish``); after each, the group's
    claims (``group_claims`` of the members left) plus ``req``'s blocks less those the members left share with it
    (:func:`_brute_shared`: a prefix is free only while a member holds it) are checked against the caps.  The
    steps of the member whose leaving makes room, or 1 when there is room now (the engine's floor)."""
    sched, chunk, keys = engine.scheduler, engine.config.prefill_chunk_tokens, _keys(engine)
    need = -(-req.num_tokens // BS)
    (g,) = [g for g in sched.caps.groups(req) if g.over_cap == "reject"]
    order = sorted((m for m in sched.running if g.key in keys(m)), key=lambda r: r.steps_to_finish(chunk))
    for j in range(len(order) + 1):
        left = order[j:]
        blocks = group_claims(engine.kv, left, keys).get(g.key, 0) + need - _brute_shared(engine, req, left)
        if (g.max_running is None or len(left) < g.max_running) and (g.max_blocks is None or blocks <= g.max_blocks):
            return max(1, order[j - 1].steps_to_finish(chunk)) if j else 1
    raise AssertionError("an accepted request always fits its group alone")


# ``first`` (the 3-block system prompt + 1 token: 4 blocks, its outputs included) and ``other`` start at step 0;
# ``second`` arrives at step 1 on ``first``'s cached prompt and gets a 429.  Its hint is taken at the end of step 1,
# when each member has 2 outputs: ``steps_to_finish`` = 1 + (max_tokens - 2 - 1).
RETRY = {
    # Cap 6: 4 + 2 held; ``second`` (4 blocks, 3 held) 6 + 1 > 6.  ``other`` (12 tokens, 4 outputs: 2 steps left)
    # leaves first: 4 + 1 <= 6, so the hint is 2.  Charged its whole prompt, 4 + 4 > 6 waited for ``first`` (7
    # outputs: 5 steps) too: the old hint, 5.
    "while_its_holder_runs": (6, [("other", [40 + i for i in range(12)], 4)], 7, SYSTEM + [2] * 4, 2),
    # Cap 8: 4 + 3 held; ``second`` (44 tokens: 6 blocks, 3 held) 7 + 3 > 8.  ``first`` (3 outputs: 1 step left)
    # leaves first and takes the held prefix with it: 3 + 6 > 8 still, so the hint waits for ``other`` (18 tokens,
    # 6 outputs: 4 steps).  The need as the rejection charged it (3 + 3 <= 8) would have said 1.
    "once_its_holder_left": (8, [("other", [40 + i for i in range(18)], 6)], 3, SYSTEM + [2] * 20, 4),
}


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("case", sorted(RETRY))
def test_a_reject_caps_retry_hint_charges_the_need_its_rejection_charged(kind, case, monkeypatch):
    """The 429's hint (``Scheduler.cap_retry_steps``) charged the whole prompt while admission charged the exact
    need, so a request turned away beside the holder of its prefix was told to wait for that holder too (first
    case: 5 steps where 2 make room).  Oracle: :func:`_brute_retry_steps` at the moment the hint is taken, and the
    hand count in ``RETRY``."""
    cap, others, first_outputs, prompt, steps = RETRY[case]
    engine = _engine(kind, tenants={"a": TenantConfig(max_kv_share=cap / NUM_BLOCKS, over_cap="reject")})
    arrivals = {0: [("first", SYSTEM + [1], "a", SamplingParams(max_tokens=first_outputs, ignore_eos=True))]
                + [(rid, p, "a", SamplingParams(max_tokens=n, ignore_eos=True)) for rid, p, n in others],
                1: [("second", prompt, "a")]}
    hints = {}
    hint_of = Scheduler.cap_retry_steps

    def recorded(self, req):
        want = _brute_retry_steps(engine, req) if req in self._cap_rejected else None
        hints[req.request_id] = (hint_of(self, req), want)
        return hints[req.request_id][0]

    monkeypatch.setattr(Scheduler, "cap_retry_steps", recorded)
    _, admitted, out = _run(engine, "second", arrivals, SamplingParams(max_tokens=1, ignore_eos=True))
    assert admitted is None and out["second"][1] == "rejected", out
    assert hints == {"second": (steps, steps)}, hints


@pytest.mark.parametrize("kind", ["radix", "hash"])
@pytest.mark.parametrize("arrives", [1, 3])
def test_a_sample_keeps_its_seat_when_its_leaders_held_prefix_lets_it_fit(kind, arrives):
    """FCFS (a global head of line) with two seats and a cap of 5 blocks.  ``L`` (n=2, 28 tokens: 4 blocks)
    prefills 8 tokens a step, its sample ``S`` waiting behind it; ``X``, another tenant's, arrives at step
    ``arrives``.  A waiting sample keeps a seat only if its caps would let it run -- charged as admission will charge
    it, without the blocks of its prompt its leader already holds cached.  At step 1 ``L`` holds 1 of them (and is
    charged 3 more for its prefill): 4 + (4 - 1) > 5, ``S`` could not run, ``X`` takes the seat.  At step 3 it holds
    3: 4 + (4 - 3) = 5 fits, so ``S`` keeps its seat, ``X`` waits, and ``S`` starts at step 4, when ``L`` is ready.
    Charged its whole prompt (4 + 4 > 5) it kept none, ``X`` took the seat, and ``S`` waited for ``X`` to finish.
    Oracle: the brute-force fit (:func:`_brute_fits`) of ``S`` when ``X`` arrives decides whether ``X`` starts then,
    and every request's tokens equal an uncapped run's."""
    engine = _engine(kind, tenants={"a": TenantConfig(max_kv_share=CAP5)}, scheduling_policy="fcfs", max_num_seqs=2,
                     long_prefill_token_threshold=8)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    arrivals = {0: [("L", SYSTEM + [1] * 4, "a", SamplingParams(n=2, max_tokens=3, ignore_eos=True))],
                arrives: [("X", [50 + i for i in range(12)], "b")]}
    started, fits, out, step = {}, None, {}, 0
    while step == 0 or engine.has_unfinished_requests():
        _arrive(engine, arrivals.get(step, ()), sp)
        sample = next((r for r in engine.scheduler.waiting if r.leader is not None), None)
        if step == arrives:
            fits = _brute_fits(engine, sample)
        for o in engine.step():
            if o.finished:
                out[o.request_id] = ([c.token_ids for c in o.outputs], o.outputs[0].finish_reason)
        for r in engine.scheduler.running:
            started.setdefault("S" if r.leader is not None else r.request_id, step)
        _held_within_caps(engine)
        step += 1
    assert_no_leak(engine)
    assert fits == (arrives == 3), fits
    if fits:
        assert started["S"] == 4 and started["X"] > 4, started
    else:
        assert started["X"] == arrives, started
    assert out == _uncapped(arrivals, sp, kind, scheduling_policy="fcfs", max_num_seqs=2,
                            long_prefill_token_threshold=8)


# -- the caches' side-effect-free lookups ------------------------------------------------------------------------

def _state(cache, pool):
    """What a lookup must leave alone: eviction order (evict one block at a time from a deep copy), counters,
    clock, refcounts, and the radix tree's shape."""
    c2 = copy.deepcopy(cache)
    order = []
    while c2.num_cached_blocks:
        before = set(b for b in range(pool.num_blocks) if c2.is_cached(b))
        if not c2.evict(1):
            break
        order.append(before - set(b for b in range(pool.num_blocks) if c2.is_cached(b)))
    stats = copy.deepcopy(cache.stats)
    refs = [pool.refcount(b) for b in range(pool.num_blocks)]
    return order, stats, cache._clock.now, refs, getattr(cache, "num_nodes", None)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_peek_blocks_and_first_block_keys_name_what_match_would_and_change_nothing(kind):
    pool = BlockPool(32)
    cache = make_prefix_cache(kind, pool, 4)
    runs = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], "b": [1, 2, 3, 4, 5, 6, 7, 8, 20, 21, 22, 23],
            "c": [30, 31, 32, 33, 34, 35, 36, 37]}
    tables = {}
    for name, tokens in runs.items():
        ns = ("t", None) if name != "c" else ("u", None)
        blocks = [pool.allocate() for _ in range(len(tokens) // 4)]
        res = cache.insert(tokens, blocks, ns)
        tables[name] = (res.block_ids, ns)
        for b in blocks:
            pool.decref(b)  # the cache keeps its own reference; the "request" is gone
    held = tables["a"][0][:1]  # one block held by a request: pinned, not evictable
    pool.incref(held[0])
    before = _state(cache, pool)
    queries = [([1, 2, 3, 4, 5, 6, 7, 8, 99, 99, 99, 99], ("t", None)), ([1, 2, 3, 4, 5, 6, 7, 8, 20, 21], ("t", None)),
               ([1, 2, 3, 4], ("u", None)), ([30, 31, 32, 33, 34, 35, 36, 37, 1], ("u", None))]
    for tokens, ns in queries:
        assert cache.peek_blocks(tokens, ns) == copy.deepcopy(cache).match(tokens, ns), (tokens, ns)
    keys = cache.first_block_keys([tables["b"][0][-1], tables["c"][0][0], 31])  # 31: never cached
    assert keys == {(("t", None), (1, 2, 3, 4)), (("u", None), (30, 31, 32, 33))}
    assert _state(cache, pool) == before
