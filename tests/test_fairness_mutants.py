"""Behaviours of the fairness policies that a hand mutation pass found unpinned: each test kills one planted bug
(named in its docstring) with an oracle computed by hand from the policy's documented rule, on the policies alone
(no engine, no timing), so the file runs in well under a second.
"""

from __future__ import annotations

import itertools

from minivllm import EngineConfig, SamplingParams
from minivllm.config import TenantConfig
from minivllm.request import Request
from minivllm.sched.fairness import CapTable, DeadlineAdmission, GroupUsage, ThreeClassAdmission, WFQAdmission
from tests.test_fairness import make_engine

_ids = itertools.count()


def request(tenant: str, prompt_len: int = 2, arrival: float = 0.0, deadline: float | None = None) -> Request:
    """A request outside any engine, for the policies' own arithmetic."""
    r = Request(f"{tenant}-{next(_ids)}", [1] * prompt_len, SamplingParams(max_tokens=1), arrival)
    r.tenant, r.deadline = tenant, deadline
    return r


def wfq(**kw) -> WFQAdmission:
    return WFQAdmission(EngineConfig(scheduling_policy="wfq", device="cpu", **kw))


def brute_wfq_order(queues: dict[str, list[Request]], counters: dict[str, float], weights: dict[str, float],
                    prefill_weight: float = 1.0) -> list[Request]:
    """A reference WFQ merge: repeatedly take the head of the tenant with the smallest counter (ties: the tenant
    whose queue came first), then charge that tenant what WFQ will charge for the head's prefill / its weight:
    the prompt tokens no computation has reached yet (the module's rule, "a prompt token once, however often a
    recompute preemption makes the engine compute it again")."""
    queues = {t: list(q) for t, q in queues.items()}
    vc = dict(counters)
    place = {t: i for i, t in enumerate(queues)}
    out = []
    while any(queues.values()):
        t = min((t for t in queues if queues[t]), key=lambda t: (vc[t], place[t]))
        r = queues[t].pop(0)
        reached = max(r.num_computed_tokens, r.num_tokens_computed_once)
        vc[t] += prefill_weight * max(0, len(r.prompt_token_ids) - reached) / weights.get(t, 1.0)
        out.append(r)
    return out


def test_wfq_ties_between_equal_counters_go_to_the_tenant_queued_first_not_the_first_name():
    """Kills: WFQ ties by tenant name instead of the tenant's place in the queue.

    Two tenants with equal counters are equally entitled; the one whose request came first goes first, as FCFS
    would.  Broken by name, tenant "aaa" wins every tie against "zzz" -- a bias no weight asked for."""
    policy = wfq()
    z1, a1 = request("zzz", 8), request("aaa", 8)
    got = policy.order([z1, a1], [])
    assert got == brute_wfq_order({"zzz": [z1], "aaa": [a1]}, {"zzz": 0.0, "aaa": 0.0}, {}) == [z1, a1]


def test_wfq_provisional_charge_divides_a_prompt_by_its_tenants_weight():
    """Kills: the provisional charge within one admission pass multiplies by the weight instead of dividing.

    A tenant of weight 2 is owed twice the service, so each of its queued prompts advances its counter by half
    the prompt.  Hand count (prompts of 100, prefill weight 1): heavy 0 -> 50 -> 100 -> 150, light at 150, so
    heavy's three prompts rank before light's one (at 150 a tie that heavy, queued first, wins)."""
    policy = wfq(tenants={"heavy": TenantConfig(weight=2.0)})
    h = [request("heavy", 100) for _ in range(3)]
    l1 = request("light", 100)
    policy.counters.update({"heavy": 0.0, "light": 150.0})
    policy._active = {"heavy", "light"}
    expected = brute_wfq_order({"heavy": h, "light": [l1]}, {"heavy": 0.0, "light": 150.0}, {"heavy": 2.0})
    assert expected == [*h, l1]
    assert policy.order([*h, l1], []) == expected


def test_wfq_does_not_charge_a_re_prefill_provisionally_since_it_never_charges_it():
    """Kills: the merge's provisional charge counting a recomputed request's whole re-prefill.

    ``a1`` was preempted by recompute after its 8-token prompt and 4 outputs (12 tokens computed, all thrown
    away): readmitted, it computes 12 tokens again, but ``observe`` charges none of them (its prompt was charged
    once, its outputs when sampled).  Hand count (counters a 0, b 4): a1 leaves ``a`` at 0, so a2 (at 0) ranks
    before b1 (at 4).  Charged the 12 re-prefilled tokens, ``a`` stood at 12 and b1 went first -- in 403 of 9,223
    admission passes over 300 seeded recompute workloads, admission walked such an order (measured against this
    brute force)."""
    policy = wfq()
    a1, a2, b1 = request("a", 8), request("a", 8), request("b", 8)
    a1.output_token_ids = [5] * 4
    a1.num_tokens_computed_once = 12  # what a recompute preemption at 12 computed tokens records
    policy.counters.update({"a": 0.0, "b": 4.0})
    policy._active = {"a", "b"}
    expected = brute_wfq_order({"a": [a1, a2], "b": [b1]}, {"a": 0.0, "b": 4.0}, {})
    assert expected == [a1, a2, b1]
    assert policy.order([a1, a2, b1], []) == expected


def test_wfq_a_rejoining_tenant_is_lifted_from_the_least_served_backlogged_tenant():
    """Kills: the rejoin floor taken from the most-served backlogged tenant (max instead of min).

    The system's virtual time is the *minimum* counter of the backlogged tenants.  Lifted to two margins below the
    maximum instead, a light tenant that sent again would rank behind the least-served backlogged tenant and lose
    the low latency WFQ owes a tenant under its share.  Hand count: margin 100, backlogged at 1000 and 2000, so the
    rejoiner goes to 1000 - 200 = 800 (not 1800) and its request is ordered first."""
    policy = wfq(max_num_batched_tokens=100)
    lo, hi, running = request("lo"), request("hi"), request("run")
    policy.counters.update({"lo": 1000.0, "hi": 2000.0, "run": 0.0})
    policy.order([lo, hi], [running])
    policy.order([lo, hi], [running])
    again = request("run")
    order = policy.order([lo, hi, again], [running])
    assert policy.counter("run") == 800.0
    assert order[0] is again


def test_wfq_a_newcomer_after_several_tenants_went_idle_together_starts_at_the_highest_of_them():
    """Kills: the counter of the tenants that went idle together taken as their minimum.

    When nothing is active a newcomer starts at the counter the last idle tenants reached (their maximum), so it
    banks no credit over any of them: started at the minimum, it would be 200 tokens ahead of "y" the moment "y"
    came back, and could preempt it for service "y" had really received."""
    policy = wfq()
    policy.counters.update({"x": 100.0, "y": 300.0})
    policy.order([request("x"), request("y")], [])
    policy.activity(set())  # both finish in the same step
    policy.order([request("z")], [])
    assert policy.counter("z") == 300.0


def test_deadline_ties_between_equal_keys_go_to_the_earlier_arrival():
    """Kills: the deadline rank breaking ties newest first.

    Two requests with the same deadline (key 5.0) are equally urgent; the one that has waited longer goes first,
    and the newer one is the victim when one must be preempted.  Broken the other way, a stream of same-deadline
    requests would serve last-come-first and starve the oldest until the aging bound."""
    edf = DeadlineAdmission(aging_s=30.0)
    old, new = request("t", arrival=0.0, deadline=5.0), request("t", arrival=1.0, deadline=5.0)
    assert edf.key(old) == edf.key(new) == 5.0
    assert edf.order([new, old], []) == [old, new]
    assert edf.rank(old) < edf.rank(new)


def test_three_class_never_preempts_within_a_class():
    """Kills: three_class preempting a victim of the same class (>= instead of >).

    Only a higher class may take a lower class's seat or blocks (batch before agent before interactive).  Two
    interactive requests preempting each other would thrash, recomputing each other's prefills for no gain."""
    cfg = EngineConfig(scheduling_policy="three_class", device="cpu",
                       tenants={"chat": TenantConfig(priority_class="interactive"),
                                "bot": TenantConfig(priority_class="agent"),
                                "etl": TenantConfig(priority_class="batch")})
    policy = ThreeClassAdmission(cfg)
    chat, chat2, bot, etl = request("chat"), request("chat"), request("bot"), request("etl")
    assert not policy.may_preempt_for(chat2, chat)
    assert not policy.may_preempt_for(bot, request("bot")) and not policy.may_preempt_for(etl, request("etl"))
    assert policy.may_preempt_for(chat, bot) and policy.may_preempt_for(chat, etl) and policy.may_preempt_for(bot, etl)
    assert not policy.may_preempt_for(etl, chat) and not policy.may_preempt_for(bot, chat)


def test_a_reject_kv_cap_admits_a_request_that_fills_it_exactly():
    """Kills: the reject-mode KV cap check off by one (>= instead of >).

    A tenant's ``max_kv_share`` is the most it may hold: a request that brings it to exactly its cap fits and must
    not be turned away with a 429.  Hand count: 48 blocks x 0.25 = 12; 8 held + 4 needed = 12 fits, + 5 does not."""
    cfg = EngineConfig(scheduling_policy="caps", device="cpu",
                       tenants={"t": TenantConfig(max_kv_share=0.25, over_cap="reject")})
    caps = CapTable(cfg, num_blocks=48)
    req = request("t")
    (group,) = caps.groups(req)
    assert group.max_blocks == 12
    usage = {group.key: GroupUsage(seats=0, blocks=8, tokens=0)}
    assert caps.rejecting_group(req, usage, needs=(4,)) is None
    assert caps.rejecting_group(req, usage, needs=(5,)) is group


def member(tenant: str, prompt_len: int, max_tokens: int) -> Request:
    """A running request that needs ``ceil(prompt_len / chunk) + max_tokens - 1`` more steps (nothing computed)."""
    r = Request(f"{tenant}-{next(_ids)}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), 0.0)
    r.tenant, r.max_tokens = tenant, max_tokens  # the engine resolves max_tokens on arrival; done here by hand
    return r


def reject_caps(max_running: int) -> CapTable:
    cfg = EngineConfig(scheduling_policy="caps", device="cpu", max_num_batched_tokens=16,
                       tenants={"t": TenantConfig(max_running=max_running, over_cap="reject")})
    return CapTable(cfg, num_blocks=48)


def test_the_retry_hint_waits_for_the_member_that_finishes_first():
    """Kills: the retry hint freeing the group's members longest first.

    A tenant at its seat cap of 2 needs one seat back: the member that finishes first (1 prefill step + 2 more
    outputs = 3 steps) frees it, not the one with 8 steps left.  A hint of 8 would tell the client to back off
    almost three times longer than it must."""
    caps = reject_caps(max_running=2)
    short, long = member("t", 16, 3), member("t", 16, 8)  # 3 and 8 steps left (chunk 16)
    assert caps.retry_steps(member("t", 4, 1), [long, short], needs=lambda r, held: (0,), reserved=lambda r: 0) == 3


def test_the_retry_hint_counts_only_the_rejecting_tenants_own_running_requests():
    """Kills: the retry hint counting every running request against the tenant's seat cap (per system, not per
    tenant).

    Tenant "t" (max_running=1) gets its seat back when its own member finishes (5 steps); another tenant's longer
    request (9 steps) holds no seat of t's, so the hint is 5, not 9."""
    caps = reject_caps(max_running=1)
    mine, other = member("t", 16, 5), member("other", 16, 9)
    assert caps.retry_steps(member("t", 4, 1), [mine, other], needs=lambda r, held: (0,), reserved=lambda r: 0) == 5


def test_the_retry_hint_seats_the_groups_waiting_requests_first_and_frees_them_as_they_finish():
    """Kills: the retry hint leaving out the group's waiting requests, or freeing a seated one's seat but not its
    blocks.

    KV cap 10 blocks (25% of 40).  A running member holds 6 blocks for 8 more steps; a waiting member of the group,
    ahead of a re-sent request, needs 4 and then 3 steps; the re-sent request needs 4.  The waiting one takes the
    room first (6 + 4 = 10) and gives its 4 blocks back after 3 steps: hint 3.  Left out, the request "fits now"
    (6 + 4); its blocks kept, the hint waits for the running member: 8.  Another tenant's waiting request counts
    for nothing."""
    cfg = EngineConfig(scheduling_policy="caps", device="cpu", max_num_batched_tokens=16,
                       tenants={"t": TenantConfig(max_kv_share=0.25, over_cap="reject")})
    caps = CapTable(cfg, num_blocks=40)
    running, ahead, other = member("t", 16, 8), member("t", 16, 3), member("u", 16, 20)
    assert caps.retry_steps(member("t", 4, 1), [running], needs=lambda r, held: (4,) if r.tenant == "t" else (),
                            reserved=lambda r: 6 if r is running else 0, waiting=[other, ahead]) == 3


def test_the_retry_hint_counts_a_waiting_sample_of_a_running_leader_as_its_fork():
    """Kills: the retry hint charging a waiting sample its whole need where it will fork from its running leader.

    KV cap 10 blocks.  A leader holds blocks 1-3 (1 more set aside) for 5 more steps; two samples of it wait, each
    needing 4 blocks, 2 of them the leader's whole prompt blocks they fork onto, and 9 steps; the re-sent request
    needs 4.  Forked, the samples add 2 blocks each (4 + 2 + 2 = 8), and when the leader goes only its block 3
    and its reserve come back: the samples keep blocks 1-2 between them (2 + 2 + 2 = 6), and 6 + 4 fits at step 5.
    Charged whole, the second sample only fits once the leader is gone, and the request waits for the first
    sample to finish: 9.  The same with no block shared yet (prefix caching off, the leader alone): the walk's count
    must still see the forks share the leader's blocks (counted as a sum of tables, it said 9)."""
    cfg = EngineConfig(scheduling_policy="caps", device="cpu", max_num_batched_tokens=16,
                       tenants={"t": TenantConfig(max_kv_share=0.25, over_cap="reject")})
    caps = CapTable(cfg, num_blocks=40)
    leader, samples = member("t", 16, 5), [member("t", 16, 9), member("t", 16, 9)]
    leader.block_ids = [1, 2, 3]
    for s in samples:
        s.leader = leader
    for shared in (True, False):  # (False: no block has two holders yet -- the samples' forks will share them)
        hint = caps.retry_steps(member("t", 4, 1), [leader],
                                needs=lambda r, held, start=(): (4 - held.num_held(("tenant", "t"), start),),
                                reserved=lambda r: 1 if r is leader else 0, shared=shared, waiting=samples,
                                forks=lambda r: [1, 2] if r.leader is leader else [])
        assert hint == 5, shared


def test_the_agent_seat_cap_rounds_down():
    """Kills: the agent class's seat cap rounded up.

    ``agent_max_running_share`` is the most the agent queue may hold: half of 5 seats is 2 seats, not 3 (which
    would give agents 60% and leave interactive requests fewer seats than the preset promises)."""
    cfg = EngineConfig(scheduling_policy="three_class", device="cpu", max_num_seqs=5,
                       tenants={"bot": TenantConfig(priority_class="agent")})
    caps = CapTable(cfg, num_blocks=48)
    (agent,) = [g for g in caps.groups(request("bot")) if g.rule == "bounded_agent_queue"]
    assert cfg.three_class.agent_max_running_share == 0.5 and agent.max_running == 2


def add(engine, rid: str, tenant: str, prompt_len: int, max_tokens: int = 2, **kw) -> None:
    engine.add_request({"prompt_token_ids": [7] * prompt_len}, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       rid, tenant=tenant, **kw)


def test_caps_a_tenant_whose_head_request_does_not_fit_does_not_block_the_next_tenant():
    """Kills: the caps policy stopping admission globally at the first request that cannot start.

    That is the caps policy's promise (head of line per tenant): A's second prompt (20 tokens, 5 blocks) does not fit
    beside A's first (40 tokens, 10 of the 12 blocks), but B's 4-token prompt queued behind it does and starts in the
    same step.  Hand schedule, step 1: a0 and b0 run, a1 waits."""
    from invariants import drain  # noqa: E402

    not_binding = {"A": TenantConfig(max_running=4)}  # the caps policy needs a cap; this one never bites here
    engine = make_engine("caps", num_blocks=12, budget=64, max_len=48, tenants=not_binding)
    add(engine, "a0", "A", 40)
    add(engine, "a1", "A", 20)
    add(engine, "b0", "B", 4)
    engine.step()
    assert {r.request_id for r in engine.scheduler.running} == {"a0", "b0"}
    assert [r.request_id for r in engine.scheduler.waiting] == ["a1"]
    drain(engine)


def test_a_priority_policy_shared_by_two_engines_admits_only_each_engines_own_requests():
    """Kills: the kept order handed out without its count guard.

    One policy object given to two engines hears both queues' changes; its kept order holds both engines' waiting
    requests.  Only the count tells the engine that asks that the kept order is not its queue.  Without it, engine 2
    is handed engine 1's waiting request to admit.  Oracle: each engine runs exactly the requests added to it."""
    from invariants import drain  # noqa: E402
    from minivllm.sched.policies import PriorityAdmission

    shared = PriorityAdmission()
    one = make_engine("priority", admission=shared)
    two = make_engine("priority", admission=shared)
    add(one, "one-a", "t", 4, priority=0)  # engine 1's request waits (engine 1 has not stepped)
    add(two, "two-a", "t", 4, priority=1)
    two.step()
    assert [r.request_id for r in two.scheduler.running] == ["two-a"]
    assert [r.request_id for r in one.scheduler.waiting] == ["one-a"]
    assert set(drain(one)) == {"one-a"} and set(drain(two)) == {"two-a"}


def test_wfq_a_tenant_whose_queue_emptied_is_lifted_toward_the_other_active_tenants_when_none_is_backlogged():
    """Kills: the rejoin floor taken over the rejoining tenant itself too, when no tenant kept requests waiting.

    With nothing backlogged, a tenant that sends again is lifted to two margins below the *other* active tenants.
    Counting itself, its own (lowest) counter would set the floor and it would keep the whole gap of 1000 as
    credit.  Hand count: margin 100, "other" (running only) at 1000, "r" at 0: "r" rejoins at 800."""
    policy = wfq(max_num_batched_tokens=100)
    other, mine = request("other"), request("r")
    policy.counters.update({"other": 1000.0, "r": 0.0})
    policy.order([], [other, mine])
    policy.order([], [other, mine])
    policy.order([request("r")], [other, mine])
    assert policy.counter("r") == 800.0


def test_deadline_admission_stops_at_the_first_request_that_does_not_fit_whatever_its_tenant():
    """Kills: the deadline policy's head of line kept per tenant instead of globally.

    The aging bound (no request is admitted after one that arrived more than ``deadline_aging_s`` later) holds only
    because admission stops at the first request that does not fit.  Per tenant, a stream of small requests from
    other tenants would pass a large earlier one every step, and it would starve.  Hand schedule: a0 (36 tokens, 9 of
    12 blocks) runs; x (tenant A, 20 tokens, 5 blocks) arrives before y (tenant B, 3 tokens); x does not fit, so y
    waits behind it."""
    from invariants import drain  # noqa: E402

    engine = make_engine("deadline", num_blocks=12, budget=64, max_len=48)
    add(engine, "a0", "A", 36, max_tokens=3)
    engine.step()
    add(engine, "x", "A", 20)
    add(engine, "y", "B", 3)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a0"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["x", "y"]
    finals = drain(engine)
    assert set(finals) == {"a0", "x", "y"}


def test_wfq_preemption_margin_is_one_steps_budget_in_weighted_prefill_tokens():
    """Kills: the margin left in raw tokens when ``wfq_prefill_weight`` is not 1.  Counters are charged in
    weighted tokens, so the margin must be too: one step's budget times the prefill weight (the module
    docstring).  Hand count: budget 100 at weight 0.5 is a margin of 50; a victim's tenant 60 ahead may be
    preempted, one 50 ahead may not."""
    policy = wfq(max_num_batched_tokens=100, wfq_prefill_weight=0.5)
    poor, rich = request("poor"), request("rich")
    policy.counters.update({"poor": 0.0, "rich": 60.0})
    assert policy.may_preempt_for(poor, rich)
    policy.counters["rich"] = 50.0
    assert not policy.may_preempt_for(poor, rich)


def test_a_tenants_kv_cap_is_the_tightest_of_its_groups():
    """Kills: ``CapTable.max_blocks_for`` answering the loosest of a request's KV caps.  The engine refuses at
    the door a request that could never fit its cap (it would otherwise preempt its own group for ever), so the
    answer must be the tightest.  Hand count, 100 blocks under three_class: a batch tenant with its own share of
    0.9 (90 blocks) also counts against agent+batch, which leaves the 50% interactive reserve out (50 blocks)."""
    from minivllm.config import ThreeClassConfig

    cfg = EngineConfig(scheduling_policy="three_class", device="cpu",
                       tenants={"etl": TenantConfig(priority_class="batch", max_kv_share=0.9)},
                       three_class=ThreeClassConfig(interactive_kv_reserve=0.5))
    assert CapTable(cfg, 100).max_blocks_for("etl") == 50
