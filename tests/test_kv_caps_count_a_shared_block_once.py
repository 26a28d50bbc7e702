"""The scheduler's KV caps count a block a group's requests share once, as the tenant gauges do.

``TenantConfig.max_kv_share`` and the three-class reserve cap the blocks a tenant (or a class) holds.  They used to
be enforced on the sum of the members' block tables, so a tenant whose requests share a cached system prompt was
charged for that prompt once per request: capped well below the share it really held, while its gauge (which
counts a shared block once) read under the cap.  Now both count with :class:`minivllm.kv.sharing.GroupBlocks`.

Oracles: a hand count on 8-token blocks; brute force (a set of every block a group's running requests hold,
recounted from scratch) at every point where the scheduler reads its kept count; and the engine's own outputs
under no cap (caps change *when* tokens are produced, never *which*).
"""

from __future__ import annotations

import random

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig
from minivllm.kv.sharing import GroupBlocks
from minivllm.sched.scheduler import Scheduler

from invariants import KVContents, assert_no_leak, group_claims  # noqa: E402  (tests/ is on sys.path)

SYSTEM = [7] * 32  # four full 8-token blocks


def _engine(num_blocks=64, max_len=256, max_num_seqs=8, max_num_batched_tokens=512, prefix=True, **options):
    """8-token blocks, prefix caching on; KVContents checks every KV slot a step attends (under caps,
    preemptions, swaps and copy-on-write) and makes each token a function of what the model would see."""
    cfg = EngineConfig(num_gpu_blocks_override=num_blocks, block_size=8, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                       enable_prefix_caching=prefix, device="cpu", **options)
    return LLMEngine(cfg, executor=KVContents(8), model_max_len=max_len, eos_token_ids=set())


def _brute(running, keys) -> dict:
    held: dict = {}
    for r in running:
        for k in keys(r):
            held.setdefault(k, set()).update(r.block_ids)
    return {k: len(v) for k, v in held.items()}


def test_a_tenant_behind_one_system_prompt_runs_as_many_requests_as_its_distinct_blocks_allow():
    """Hand count.  Tenant ``a`` may hold 12 of 64 blocks.  Each request is the 32-token system prompt plus 8
    tokens of its own: 5 blocks.  After one step ``first`` holds 5 (the prompt now cached) and reserves a sixth for
    its next decode: 6.  Admission checks each follower's whole prompt (5 blocks: its hit is not known before it is
    seated) against what the group counts.  ``f2``: 6 + 5 = 11 <= 12, seated; it takes the 4 cached blocks, which
    the group already holds, and reserves 1 of its own: 7.  ``f3``: 7 + 5 = 12 <= 12, seated: 8.  ``f4``: 8 + 5 =
    13 > 12 on its whole prompt -- and then, that check failing on the KV cap, on what its group would gain: its
    4-block prefix is held, so 8 + 1 = 9 <= 12, seated (``tests/test_cap_need.py``; charged its whole prompt it
    waited).  Summing tables (the old count) charged ``f2`` its 4 shared blocks again -- 6 + 4 + 1 = 11 -- and
    ``f3`` (11 + 5 = 16) waited.  After the step the group holds 4 + 2 + 1 + 1 + 1 = 9 distinct blocks (a set of
    them says so) where the tables sum to 6 + 5 + 5 + 5 = 21."""
    engine = _engine(tenants={"a": TenantConfig(max_kv_share=12 / 64)}, scheduling_policy="caps")
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request({"prompt_token_ids": SYSTEM + [1] * 8}, sp, tenant="a", arrival_time=0.0, request_id="first")
    engine.step()
    assert [len(r.block_ids) for r in engine.scheduler.running] == [5]
    for i in (2, 3, 4):
        engine.add_request({"prompt_token_ids": SYSTEM + [i] * 8}, sp, tenant="a", arrival_time=0.0,
                           request_id=f"f{i}")
    engine.step()
    running = engine.scheduler.running
    # (f4 seated too since its held prefix is not charged: 9 distinct blocks of 12, tables summing to 21)
    assert [r.request_id for r in running] == ["first", "f2", "f3", "f4"]
    assert [r.request_id for r in engine.scheduler.waiting] == []
    assert all(r.block_ids[:4] == running[0].block_ids[:4] for r in running)  # the prompt is held once
    distinct = len(set().union(*[r.block_ids for r in running]))
    assert distinct == 9 and sum(len(r.block_ids) for r in running) == 21
    assert GroupBlocks(running, lambda r: (r.tenant,)).count == {"a": 9}
    assert engine.tenant_stats()["a"]["kv_blocks"] == 9  # the gauge reads what the cap counts
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)


def _shared_workload(engine, seed: int, tenants: str, count: int = 30) -> None:
    rng = random.Random(seed)
    systems = [[7] * 24, [8] * 16, [9] * 40]
    for i in range(count):
        head = systems[rng.randrange(3)] if rng.random() < 0.75 else []
        prompt = head + [rng.randrange(10, 900) for _ in range(rng.randrange(2, 20))]
        n = 2 if rng.random() < 0.25 else 1
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=rng.randrange(2, 16), n=n, ignore_eos=True),
                           tenant=tenants[i % len(tenants)], arrival_time=0.0, request_id=f"r{i}")


def _checked(monkeypatch) -> list:
    """Wrap the places the scheduler reads its kept counts, and compare each read with brute force.

    At admission's cap checks: the kept :class:`GroupBlocks` count equals a set of the members' blocks, exactly;
    the usage's blocks, kept as admission seats requests and recounted from scratch alike, are that plus what the
    members' next writes add (brute force, ``invariants.group_claims``): a leader and the samples forked onto its
    partly filled last block are charged one copy fewer than they are, since the last of them writes in place."""
    reads, live = [], []
    fit, within, usage_of = Scheduler._fit_group_kv, Scheduler._cap_failure, Scheduler._group_usage

    def keys(sched):
        return lambda r: [g.key for g in sched.caps.groups(r)]

    def checked_fit(self, req, num_tokens, batch):
        want = _brute(self.running, keys(self))
        assert {k: n for k, n in self._held.count.items() if n} == {k: n for k, n in want.items() if n}
        reads.append("allocate")
        return fit(self, req, num_tokens, batch)

    def recorded_usage(self):
        usage, held = usage_of(self)
        live.append(held)
        return usage, held

    def checked_within(self, req, usage, needs, per_step=True):
        want = _brute(self.running, keys(self))
        for k, u in usage.items():
            members = [r for r in self.running if k in keys(self)(r)]
            assert u.seats == len(members), k
            assert live[-1].count.get(k, 0) == want.get(k, 0), k
            claims = group_claims(self.kv, self.running, keys(self))
            assert u.blocks == claims[k] == usage_of(self)[0][k].blocks, (k, u, claims[k])
        reads.append("admit")
        return within(self, req, usage, needs, per_step)

    monkeypatch.setattr(Scheduler, "_fit_group_kv", checked_fit)
    monkeypatch.setattr(Scheduler, "_cap_failure", checked_within)
    monkeypatch.setattr(Scheduler, "_group_usage", recorded_usage)
    return reads


def _outputs(engine) -> dict:
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
    return out


@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("policy", ["caps", "three_class"])
def test_kept_counts_equal_a_set_of_every_block_at_every_read(monkeypatch, policy, mode, prefix):
    """Brute force at every read: allocate's count per cap group (as requests grow, copy a shared last block,
    are preempted) and admission's ``[running, blocks + reserved, tokens]`` (as requests are admitted behind
    a cached prompt or forked as samples).  Kills: an admitted request charged its whole table, a victim
    giving back blocks its group still holds, a copy-on-write not counted, a grown table's blocks lost from
    its holder count.  Then the hard guarantee (never over a cap, in distinct blocks) after every step, and the
    outputs equal an uncapped run's.  With prefix caching off no block is shared when a pass starts, and a sample
    forked in the pass is the first to share (a count that read "nothing can be shared" once, at the start of the
    pass, charged it its whole table)."""
    tenants = {"a": TenantConfig(max_kv_share=0.3, priority_class="agent"),
               "b": TenantConfig(max_kv_share=0.4, priority_class="batch"),
               "c": TenantConfig(priority_class="interactive")}
    kw = dict(num_blocks=40, max_num_batched_tokens=64, preemption_mode=mode, num_cpu_blocks_override=40, prefix=prefix)
    engine = _engine(tenants=tenants, scheduling_policy=policy,
                        three_class=ThreeClassConfig(interactive_kv_reserve=0.2, agent_kv_share=0.5), **kw)
    _shared_workload(engine, seed=5, tenants="abc")
    reads = _checked(monkeypatch)
    caps, out = engine.scheduler.caps, {}
    steps = shared_steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = [c.token_ids for c in o.outputs]
        running = engine.scheduler.running
        for r in running:
            for g in caps.groups(r):
                if g.max_blocks is not None:
                    held = len(set().union(*[m.block_ids for m in running if g in caps.groups(m)]))
                    assert held <= g.max_blocks, (g.key, held, g.max_blocks)
        shared_steps += sum(len(r.block_ids) for r in running) > len(set().union(*[r.block_ids for r in running]))
        steps += 1
    assert_no_leak(engine)
    assert reads.count("allocate") > 50 and reads.count("admit") > 10 and shared_steps > 3, (reads, shared_steps)
    monkeypatch.undo()
    free = _engine(**kw)
    _shared_workload(free, seed=5, tenants="abc")
    assert _outputs(free) == out


def test_the_reject_hint_waits_for_the_last_holder_of_a_shared_prompt():
    """``retry_steps`` walks the group's members in the order they finish and gives back, for each, only the
    blocks no member left behind it holds.  Oracle: brute force on a hand-built group -- two requests behind
    one 4-block prompt with one block each of their own: the first to finish frees 1 block, the second 5."""
    engine = _engine()
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request({"prompt_token_ids": SYSTEM + [1] * 4}, sp, tenant="a", arrival_time=0.0)
    engine.step()
    engine.add_request({"prompt_token_ids": SYSTEM + [2] * 4}, sp, tenant="a", arrival_time=0.0)
    engine.step()
    first, second = engine.scheduler.running
    held = GroupBlocks([first, second], lambda r: ("a",))
    total = held.count["a"]
    assert total == len(set(first.block_ids) | set(second.block_ids))
    assert held.remove(first) == [len(set(first.block_ids) - set(second.block_ids))]
    assert held.remove(second) == [len(second.block_ids)] and held.count["a"] == 0


class _Req:
    def __init__(self, block_ids, groups):
        self.block_ids, self.groups = block_ids, groups


@pytest.mark.parametrize("seed", range(6))
def test_group_blocks_against_a_set_of_every_block_after_every_change(seed):
    """:class:`GroupBlocks` on its own, under the changes a running request's table goes through: start with a
    prefix of another member's table (a prefix hit, a fork) or blocks of several members from anywhere in their
    tables (a prefix cache's chain can mix two requests' blocks: the twin test below), and fresh blocks, grow by fresh blocks, have its
    last block swapped for a private copy (copy-on-write, also of a one-block table, whose first block then
    changes), both at once, and leave.  Oracle: a set of every block per group, recounted after every change,
    and the difference of two such counts for what each call returns.  Kills: a copy counted as growth, a grown
    table's blocks not added to its holder count (its later removal then gives back too little), a removal that gives
    back blocks another member still holds."""
    rng = random.Random(seed)
    fresh = iter(range(10_000))
    members: list[_Req] = []
    gb = GroupBlocks([], lambda r: r.groups)

    def brute():
        return _brute(members, lambda r: r.groups)

    copies = shared_removals = 0
    for _ in range(400):
        before_counts = brute()
        op = rng.random()
        if op < 0.3 or not members:
            if members and rng.random() < 0.3:  # blocks of several members, anywhere in their tables
                pool = sorted({b for m in members for b in m.block_ids})
                table = rng.sample(pool, min(len(pool), rng.randint(1, 4))) if pool else []
            else:
                parent = rng.choice(members).block_ids if members and rng.random() < 0.7 else []
                table = parent[:rng.randint(0, len(parent))]
            table += [next(fresh) for _ in range(rng.randint(0, 3))]
            req = _Req(table, rng.choice([("g",), ("h",), ("g", "h")]))
            members.append(req)
            gained = gb.add(req)
        elif op < 0.45:
            req = members.pop(rng.randrange(len(members)))
            shared_removals += any(set(req.block_ids) & set(m.block_ids) for m in members)
            gained = [-n for n in gb.remove(req)]
        else:
            req = rng.choice(members)
            before, last = len(req.block_ids), (req.block_ids[-1] if req.block_ids else None)
            if req.block_ids and rng.random() < 0.4:
                req.block_ids[-1] = next(fresh)  # copy-on-write of the last block
                copies += 1
            req.block_ids.extend(next(fresh) for _ in range(rng.randint(0, 2)))
            gained = gb.grew(req, before, last)
        after = brute()
        assert {k: n for k, n in gb.count.items() if n} == {k: n for k, n in after.items() if n}
        assert gained == [after.get(k, 0) - before_counts.get(k, 0) for k in req.groups]
        for m in members:
            for k in m.groups:  # what a copy-on-write of its last block would cost the group
                others = [o for o in members if o is not m and k in o.groups]
                want = bool(m.block_ids) and any(m.block_ids[-1] in o.block_ids for o in others)
                assert gb.holds_last_too(m, k) == want
    assert copies > 30 and shared_removals > 10, (copies, shared_removals)


def test_allocate_keeps_a_group_under_its_cap_when_a_copy_on_write_would_pass_it(monkeypatch):
    """A copy-on-write gains the group a block when another member holds the original (a sample and its leader
    sharing the prompt's partly filled last block).  Allocation must count it: here the cap is tightened, between
    admission and allocation, to exactly the 5 blocks the leader and its just-forked sample hold together, so the
    first write into the shared fifth block (the sample's last prompt token, or the leader's first decode) would
    make 6.  Oracle: the group's count (checked against a set of every block above) is at most 5 before each row
    is allocated and a set of the group's blocks after the step is at most 5, and the engine still finishes both
    samples with the outputs of an uncapped run.  The victim is the sample, once: a stale count of the copy
    (asked before the victim left, when the block was shared, and not again after) would preempt the leader too."""
    from dataclasses import replace

    def run(tighten: bool):
        engine = _engine(tenants={"a": TenantConfig(max_kv_share=1.0)}, scheduling_policy="caps")
        engine.add_request({"prompt_token_ids": [5] * 36}, SamplingParams(max_tokens=3, n=2, ignore_eos=True),
                           tenant="a", arrival_time=0.0, request_id="p")
        sched = engine.scheduler
        allocate = Scheduler.allocate
        over = []

        def tightened(self, batch):
            if tighten and len(self.running) == 2 and not over:
                held = len(set().union(*[r.block_ids for r in self.running]))
                (g,) = self.caps.groups(self.running[0])
                self.caps._groups["a"] = (replace(g, max_blocks=held),)
                over.append(held)
            return allocate(self, batch)

        fit = Scheduler._fit_group_kv

        def within_before_each_row(self, req, num_tokens, batch):  # (the count already checked against brute force)
            for g in self.caps.groups(req):
                assert self._held.count.get(g.key, 0) <= g.max_blocks, "a row before this one passed the cap"
            return fit(self, req, num_tokens, batch)

        monkeypatch.setattr(Scheduler, "allocate", tightened)
        monkeypatch.setattr(Scheduler, "_fit_group_kv", within_before_each_row)
        out, preempted = {}, []
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    out[o.request_id] = [c.token_ids for c in o.outputs]
            preempted += list(engine.step_log[-1].preempted)
            if over and sched.running:
                assert len(set().union(*[r.block_ids for r in sched.running])) <= over[0]
        monkeypatch.undo()
        assert_no_leak(engine)
        return out, over, preempted

    free, _, _ = run(False)
    out, over, preempted = run(True)
    assert over == [5] and len(preempted) == 1, (over, preempted)
    assert out == free


def test_a_chain_cached_below_a_twin_is_counted_once():
    """Two requests that share a block need not share their first one.  Hand count, 8-token blocks: ``r1`` (A B 1)
    and ``r2`` (A C 2) prefill in one step with the cache cold, so each computes its own A block (twins); the cache
    keeps ``r1``'s, and ``r2``'s C block is cached below it.  ``r3`` (A C 3) then hits ``r1``'s A and ``r2``'s C.
    Tables ``[a, b, x] [a', c, y] [a, c, z]``: 7 distinct blocks, where grouping requests by their first block
    (the first version of this count) said 8.  The cap count, the gauge and brute force must agree, and a cap
    tightened to exactly those 7 blocks must preempt no one in a step where no table grows."""
    from dataclasses import replace

    A, B, C = [7] * 8, [8] * 8, [9] * 8
    engine = _engine(tenants={"a": TenantConfig(max_kv_share=0.5)}, scheduling_policy="caps")
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request({"prompt_token_ids": A + B + [1]}, sp, tenant="a", arrival_time=0.0, request_id="r1")
    engine.add_request({"prompt_token_ids": A + C + [2]}, sp, tenant="a", arrival_time=0.0, request_id="r2")
    engine.step()
    engine.add_request({"prompt_token_ids": A + C + [3]}, sp, tenant="a", arrival_time=0.0, request_id="r3")
    engine.step()
    sched = engine.scheduler
    r1, r2, r3 = sched.running
    assert r1.block_ids[0] != r2.block_ids[0] and r3.block_ids[:2] == [r1.block_ids[0], r2.block_ids[1]]
    distinct = len(set().union(*[r.block_ids for r in sched.running]))
    assert distinct == 7
    assert sched._group_held().count == {("tenant", "a"): 7}
    assert engine.tenant_stats()["a"]["kv_blocks"] == 7
    (g,) = sched.caps.groups(r1)
    sched.caps._groups["a"] = (replace(g, max_blocks=distinct),)
    engine.step()  # every table has room for its next token: nothing grows
    assert not engine.step_log[-1].preempted and len(sched.running) == 3
    assert len(set().union(*[r.block_ids for r in sched.running])) == 7


def test_a_sample_forked_in_the_pass_is_counted_by_what_it_shares(monkeypatch):
    """Prefix caching off: when the pass starts, no block has two holders.  The ``n=2`` prompt's sample forks from
    its prefilled leader in this pass (sharing its 3 blocks), and ``q`` is checked against the cap after it: the
    group holds 3 blocks, not 6.  Oracle: brute force at that read (``_checked``).  A count that decided "nothing
    is shared" once, at the start of the pass, charged the sample its whole table."""
    engine = _engine(prefix=False, tenants={"a": TenantConfig(max_kv_share=0.5)}, scheduling_policy="caps")
    engine.add_request({"prompt_token_ids": list(range(1, 21))}, SamplingParams(max_tokens=5, n=2, ignore_eos=True),
                       tenant="a", arrival_time=0.0, request_id="p")
    engine.step()
    assert not engine.kv.may_share()
    engine.add_request({"prompt_token_ids": list(range(30, 40))}, SamplingParams(max_tokens=5, ignore_eos=True),
                       tenant="a", arrival_time=0.0, request_id="q")
    reads = _checked(monkeypatch)
    engine.step()
    assert reads.count("admit") >= 2 and len(engine.scheduler.running) == 3, reads
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)
