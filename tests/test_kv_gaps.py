"""The KV manager's preemption bounds, reached through ``LLMEngine.step`` rather than set up by hand.

Before preempting running work to seat a better-ranked request, admission asks two things of the KV manager:
``claims_as_they_leave`` (what the requests left running will still claim, and what the victims give back, as
they go one by one) and ``could_start_if_freed`` (could the request start at all once they are gone -- "no"
must be certain, or the request waits behind work ranked below it).  Both were checked on scenes built by hand;
here real engines (a simulated executor that checks every KV slot a step attends, ranked policies, tenant KV
caps, both prefix caches, recompute / swap / auto preemption, aborts) reach them, and every answer is checked as
it is given against a recount on a copy of the engine: free the victims, let the request take its cached prefix,
evict everything the cache can give up, and count free blocks; recount the claims from the tables as they then
stand (:func:`tests.invariants.claimed_blocks`).  After every step the refcounts are recounted from the tables
(:func:`tests.invariants.check_both_tiers`) and each capped tenant's distinct blocks are held to its cap.
"""

from __future__ import annotations

import copy
import math
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig
from minivllm.request import RequestStatus

from tests.fuzz import examples
from tests.invariants import KVContents, assert_no_leak, check_both_tiers, claimed_blocks, drain, room_after


def _recount_claims(kv, reqs, leaving, worst_case):
    """What ``claims_as_they_leave`` must yield, recounted from scratch: on a copy, free ``leaving`` one by one
    and after each (and before any) recount the claims of those left (:func:`claimed_blocks`) and the blocks of
    those gone that no one but the prefix cache holds any more."""
    kv2, reqs2, leaving2 = copy.deepcopy((kv, list(reqs), list(leaving)))
    cache, gone, tables = kv2.prefix_cache, [], set()

    def now():
        left = [r for r in reqs2 if not any(r is g for g in gone)]
        back = sum(1 for b in tables
                   if kv2.pool.refcount(b) == (1 if cache is not None and cache.is_cached(b) else 0))
        return claimed_blocks(kv2, left, worst_case), back

    out = [now()]
    for r in leaving2:
        tables.update(r.block_ids)
        gone.append(r)
        kv2.free(r)
        out.append(now())
    return out


class Watch:
    """Wraps an engine's KV manager so that every ``could_start_if_freed`` and ``claims_as_they_leave`` the
    scheduler or the engine asks is checked against the recounts above as it is answered; counts what it saw."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seen: Counter = Counter()
        kv = engine.kv
        real_could, real_claims = kv.could_start_if_freed, kv.claims_as_they_leave

        def could_start_if_freed(req, reqs, reserved):
            said = real_could(req, reqs, reserved)
            running = self.engine.scheduler.running
            free, left, need = room_after(kv, running, reqs, req)
            if len(reqs) and all(any(r is c for c in running) for r in reqs):
                assert reserved == left, f"{reserved} blocks reserved, {left} by a recount"
            if not said:
                assert free < reserved + need, (
                    f"'certainly not' for {req.request_id} with victims {[r.request_id for r in reqs]}: "
                    f"{free} blocks free once they go, {reserved} promised, {need} needed")
            self.seen["no" if not said else "yes"] += 1
            return said

        def claims_as_they_leave(reqs, leaving, worst_case=False):
            reqs, leaving = list(reqs), list(leaving)
            said = list(real_claims(reqs, leaving, worst_case))
            assert said == _recount_claims(kv, reqs, leaving, worst_case), (
                [r.request_id for r in leaving], said, _recount_claims(kv, reqs, leaving, worst_case))
            self.seen["claims_preempt" if len(leaving) < len(reqs) else "claims_all"] += 1
            return iter(said)

        kv.could_start_if_freed = could_start_if_freed
        kv.claims_as_they_leave = claims_as_they_leave


def _check_caps(engine: LLMEngine) -> None:
    """No capped tenant holds more distinct blocks than its share of the pool, nor (three classes) the agent and
    batch tenants together more than the pool less the interactive reserve -- worked out here from the config,
    not read from the scheduler's cap table."""
    config, n = engine.config, engine.kv.pool.num_blocks
    held: dict[str, set] = {}
    for r in engine.scheduler.running:
        held.setdefault(r.tenant, set()).update(r.block_ids)
    for tenant, blocks in held.items():
        share = config.tenant_config(tenant).max_kv_share
        if share is not None:
            assert len(blocks) <= max(1, math.floor(share * n)), (tenant, len(blocks))
    if config.scheduling_policy == "three_class":
        classed = set().union(*(b for t, b in held.items() if config.tenant_config(t).priority_class
                                not in (None, "interactive")))
        assert len(classed) <= max(1, math.floor((1 - config.three_class.interactive_kv_reserve) * n)), len(classed)


# A random program: each op adds a request (tenant, shared-head tokens, own tokens, max_tokens, priority, n) or
# aborts one of those added so far, then runs some steps.
_add = st.tuples(st.just("add"), st.sampled_from(["a", "b", "c"]), st.integers(0, 24), st.integers(1, 16),
                 st.integers(1, 12), st.integers(0, 2), st.integers(1, 2), st.integers(0, 3))
_abort = st.tuples(st.just("abort"), st.integers(0, 40), st.integers(0, 2))
_op = st.one_of(_add, _add, _add, _abort)


def _engine(policy, mode, prefix, blocks, budget, caps, cache_share=None):
    tenants = {"a": TenantConfig(weight=1.0, max_kv_share=caps), "b": TenantConfig(weight=2.0,
                                                                                  max_cache_share=cache_share),
               "c": TenantConfig(max_kv_share=caps, priority_class="batch" if policy == "three_class" else None)}
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_num_batched_tokens=budget, max_num_seqs=4,
                       max_model_len=40, scheduling_policy=policy, preemption_mode=mode,
                       num_cpu_blocks_override=8 if mode in ("swap", "auto") else None,
                       enable_prefix_caching=prefix is not None, prefix_cache=prefix or "radix",
                       tenants=tenants, device="cpu")
    return LLMEngine(cfg, executor=KVContents(4), model_max_len=40, eos_token_ids=set())


def _run(engine: LLMEngine, ops, head) -> None:
    ids: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, tenant, shared, own, max_tokens, priority, n, run = op
            prompt = head[:shared] + [50 + len(ids)] * own
            try:
                ids.append(engine.add_request({"prompt_token_ids": prompt},
                                              SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True),
                                              f"{tenant}{len(ids)}", tenant=tenant, priority=priority))
            except ValueError:  # longer than max_model_len, or than its tenant's cap: refused at the door
                pass
        else:
            _, which, run = op
            if ids:
                engine.abort_request(ids[which % len(ids)])
        for _ in range(run):
            engine.step()
            check_both_tiers(engine)
            _check_caps(engine)
    drain(engine, max_steps=3000, each=_check_caps)  # fails when it does not drain, or the stall watchdog fired
    assert_no_leak(engine)


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=1, max_size=24), policy=st.sampled_from(["wfq", "priority", "three_class"]),
       mode=st.sampled_from(["recompute", "swap", "auto", "reject"]), prefix=st.sampled_from([None, "radix", "hash"]),
       blocks=st.integers(10, 24), budget=st.sampled_from([8, 16, 32]), caps=st.sampled_from([None, 0.5, 0.75]),
       cache_share=st.sampled_from([None, 0.25]))
def test_aborts_preemption_and_prefix_caching_under_caps_keep_every_count(ops, policy, mode, prefix, blocks, budget,
                                                                          caps, cache_share):
    """Hypothesis programs mixing aborts, preemption (recompute, swap, auto; reject mode's retry hints), both
    prefix caches, ``n=2`` forks, tenant KV caps and a tenant cache quota.  After every step: refcounts equal their
    holders on both tiers, no capped tenant (or class) over its cap; every preemption bound the scheduler asks is
    checked as :class:`Watch` does; at the end the engine drains and holds no block."""
    engine = _engine(policy, mode, prefix, blocks, budget, caps, cache_share)
    Watch(engine)
    _run(engine, ops, [1 + (i % 7) for i in range(24)])


def _wfq_engine(num_blocks, **options):
    cfg = EngineConfig(num_gpu_blocks_override=num_blocks, block_size=4, max_num_batched_tokens=16, max_num_seqs=8,
                       max_model_len=64, scheduling_policy="wfq", device="cpu", **options)
    return LLMEngine(cfg, executor=KVContents(4), model_max_len=64, eos_token_ids=set())


def _claims_asked(engine) -> list:
    """``(step, leaving, answer)`` for every ``claims_as_they_leave`` asked of ``engine`` (checked by :class:`Watch`
    first, when it watches)."""
    kv, asked = engine.kv, []
    real = kv.claims_as_they_leave

    def claims(reqs, leaving, worst_case=False):
        out = list(real(reqs, leaving, worst_case))
        asked.append((engine.scheduler.stats.num_steps, [r.request_id for r in leaving], out))
        return iter(out)

    kv.claims_as_they_leave = claims
    return asked


def _preemptions_to_admit(sched) -> list:
    """``(request id, preempted?)`` for every preemption admission tries to seat a request, as it answers."""
    made, real = [], sched._preempt_to_admit

    def preempt(req, admitted):
        done = real(req, admitted)
        made.append((req.request_id, done))
        return done

    sched._preempt_to_admit = preempt
    return made


def _sp(max_tokens, n=1):
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)


def test_wfq_says_certainly_not_through_the_engine_and_it_is_so():
    """WFQ, 16 blocks of 4, a 16-token budget (so a waiting request may preempt a tenant more than 16 tokens ahead).
    ``y`` keeps ``Y0`` (a 20-token prompt, decoding) running and nothing waiting while ``x``'s eight 12-token
    prompts are served; then ``y`` sends ``Y1``: ``Y0``'s first 16 tokens and 44 of its own (15 blocks, 4 of them
    cached and held by ``Y0``).  Rejoining 17 tokens behind ``x``, ``Y1`` may preempt ``x``'s running ``X0`` and
    ``X1``.  By hand, at that pass: ``Y0`` holds 6 blocks, ``X0`` and ``X1`` 8 others, 2 are free, and ``Y0`` will
    claim nothing more this step; gone, they leave 10 blocks for ``Y1``'s 11 new ones -- certainly not, by one
    block.  So nothing is preempted for ``Y1``, and with one block more (``reserved=-1``) the bound says perhaps.
    Every answer is also checked by :class:`Watch`, and ``Y1`` is served once ``Y0`` is done."""
    engine = _wfq_engine(16, enable_prefix_caching=True)
    Watch(engine)
    sched, kv = engine.scheduler, engine.kv
    bound = type(kv).could_start_if_freed.__get__(kv)  # the method itself, unwatched
    watched, seen = kv.could_start_if_freed, []

    def first_ask(req, reqs, reserved):
        if not seen:  # the pass as it stands when the scheduler asks
            seen.append(dict(step=sched.stats.num_steps, req=req.request_id, victims=[r.request_id for r in reqs],
                             reserved=reserved, free=kv.pool.num_free, hit=kv.computed_if_admitted(req) // 4,
                             tables={r.request_id: list(r.block_ids) for r in sched.running},
                             lead=sched.admission_policy.counter("x") - sched.admission_policy.counter("y"),
                             one_more=bound(req, reqs, reserved - 1)))
        said = watched(req, reqs, reserved)
        seen[-1].setdefault("said", said)
        return said

    kv.could_start_if_freed = first_ask
    made = _preemptions_to_admit(sched)
    head = list(range(1, 21))
    engine.add_request({"prompt_token_ids": head}, _sp(24), "Y0", tenant="y")
    for i in range(8):
        engine.add_request({"prompt_token_ids": [200 + i] * 12}, _sp(8), f"X{i}", tenant="x")
    for _ in range(6):
        engine.step()
    engine.add_request({"prompt_token_ids": head[:16] + [91] * 44}, _sp(2), "Y1", tenant="y")
    engine.step()
    (at,) = seen
    tables = at["tables"]
    assert {k: at[k] for k in ("step", "req", "victims", "reserved", "said")} == dict(
        step=6, req="Y1", victims=["X0", "X1"], reserved=0, said=False)
    # the hand count, from the tables as the pass found them
    assert sorted(tables) == ["X0", "X1", "Y0"] and len(tables["Y0"]) == 6 and at["free"] == 2
    assert len(set(tables["X0"] + tables["X1"]) - set(tables["Y0"])) == 8
    assert at["hit"] == 4 and all(engine.prefix_cache.is_cached(b) for b in tables["Y0"][:4])
    assert -(-60 // 4) - at["hit"] == 11 > 2 + 8
    assert at["one_more"] is True and at["lead"] == 17
    assert made and not any(done for rid, done in made if rid == "Y1"), made
    finals = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        check_both_tiers(engine)
    assert not engine.has_unfinished_requests() and len(finals["Y1"].outputs[0].token_ids) == 2
    assert_no_leak(engine)


def test_wfq_preempts_a_leader_whose_sample_then_writes_in_place():
    """The preemption case of ``claims_as_they_leave`` through the engine under WFQ.  20 blocks of 4, a 16-token
    budget, prompts chunked at 4 tokens; ``x`` weighs 0.25, so its service counts four times.  ``y`` keeps ``Y0``
    decoding; ``x`` sends three 8-token prompts and ``L``, 8 tokens with ``n=2``.  The step after ``L`` prefilled,
    ``y`` sends ``Ya`` (36 tokens) and ``Yb`` (28): ``y`` rejoins 32 behind ``x``, so the pass hands out ``Ya``,
    then ``L``'s sample ``S`` (``Ya``'s charge put ``y`` past ``x``), then ``Yb``.  ``S`` forks onto ``L``'s 2 blocks
    and will write its last prompt token into the second, which ``L`` holds too: a copy.  By hand, for ``Yb``:
    16 blocks free; claimed: ``L``'s block for its 9th token, ``Ya``'s 9, ``S``'s copy = 11; ``Yb`` needs 7 -- no
    room, but ``y`` is more than 16 behind, so ``L`` may be preempted.  With ``L`` gone: no block comes back (``S``
    holds both), ``L``'s claim goes, and ``S`` holds its block alone and writes in place: 9 claimed, and 16 = 9 + 7
    fits.  So the claims are (11, 0) then (9, 0), ``L`` is preempted and ``Yb`` seated in that very pass.  Kept
    charged, ``S``'s copy (10 after) refused a preemption that had room.  :class:`Watch` checks both answers."""
    engine = _wfq_engine(20, long_prefill_token_threshold=4, tenants={"x": TenantConfig(weight=0.25)})
    Watch(engine)
    sched = engine.scheduler
    claims = _claims_asked(engine)
    made = _preemptions_to_admit(sched)
    policy = sched.admission_policy
    engine.add_request({"prompt_token_ids": [7] * 4}, _sp(60), "Y0", tenant="y")
    for i in range(3):
        engine.add_request({"prompt_token_ids": [200 + i] * 8}, _sp(2), f"X{i}", tenant="x")
    engine.add_request({"prompt_token_ids": [300] * 8}, _sp(20, n=2), "L", tenant="x")
    leader = sched.waiting[-2]
    for _ in range(4):
        engine.step()
        check_both_tiers(engine)
    assert leader.num_computed_tokens == 8 and len(leader.block_ids) == 2 and sched.waiting[0].leader is leader
    engine.add_request({"prompt_token_ids": [400] * 36}, _sp(2), "Ya", tenant="y")
    engine.add_request({"prompt_token_ids": [500] * 28}, _sp(2), "Yb", tenant="y")
    real_order, handed = policy.order, []

    def order(waiting, running):  # what the pass is handed, and y's lag once the order lifted it
        for r in real_order(waiting, running):
            handed.append((r.request_id, policy.counter("x") - policy.counter("y")))
            yield r

    policy.order = order
    engine.step()
    assert handed[:3] == [("Ya", 32), ("L#1", 32), ("Yb", 32)]
    assert claims == [(4, ["L#0"], [(11, 0), (9, 0)])]
    assert made == [("Yb", True)] and leader.status is RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.running] == ["Y0", "Ya", "L#1", "Yb"]
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        check_both_tiers(engine)
    assert not engine.has_unfinished_requests()
    assert_no_leak(engine)
