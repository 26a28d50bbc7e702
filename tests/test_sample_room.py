"""Preempting to seat a sample of an ``n > 1`` request: the room bound weighs what the sample's start really takes.

Before each preemption made to seat a waiting request, admission asks whether every candidate victim gone would
leave it room (``Scheduler._victims_could_make_room``); a preemption after which the request is still not admitted
throws the victim's work away for nothing.  A sample whose leader runs used to skip that question ("a fork needs a
block or two: always worth trying"), and only a *waiting* one could skip it.  Both halves are checked here:

* a waiting sample that can fork still needs one block -- the private copy of the partly filled block it shares
  with its leader, or a new block -- and with the pool dry and the requests left running claiming what the victim
  gives back, that block is not there (found by a random search over priority-policy programs with ``n > 1``);
* a swapped-out sample whose leader runs needs all its swapped blocks back, not a fork's block: it must be bounded
  like any request (the ``WAITING`` half of the old rule, which nothing tested);
* a sample preempted by recompute forks again (its outputs recomputed on top), so its need is the fork's start plus
  its outputs -- not its whole sequence, as if it had to start alone.

Oracles: :func:`tests.test_scheduler_invariants.fail_on_futile_preemption` (each request preempted for is admitted
in the same pass); a brute-force recount on a copy of the engine (:func:`tests.invariants.room_after`: free the
victims, let the request start as admission would, count free blocks and the claims of those left); the hand-traced
state; and the tokens each request produced against a run on a pool large enough that nobody is preempted (a policy
changes when tokens come, never which).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.kv import BlockPool, KVCacheManager
from minivllm.request import Request, RequestStatus

from tests.fuzz import examples
from tests.invariants import KVContents, assert_no_leak, drain, room_after
from tests.test_kv_gaps import Watch, _run
from tests.test_scheduler_invariants import fail_on_futile_preemption


def _engine(mode: str, blocks: int, *, budget: int = 32, seqs: int = 6, max_len: int = 48,
            cpu_blocks: int | None = None, prefix: str | None = None) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_num_batched_tokens=budget,
                       max_num_seqs=seqs, max_model_len=max_len, scheduling_policy="priority", preemption_mode=mode,
                       num_cpu_blocks_override=cpu_blocks if cpu_blocks is not None else (16 if mode == "swap" else None),
                       enable_prefix_caching=prefix is not None, prefix_cache=prefix or "radix", device="cpu")
    return LLMEngine(cfg, executor=KVContents(4), model_max_len=max_len, eos_token_ids=set())


def _record_sample_asks(engine: LLMEngine, asked: list) -> None:
    """Record every room bound the scheduler asks for a sample that could fork from its leader now, with the
    brute-force answer (:func:`tests.invariants.room_after`) beside the scheduler's."""
    sched = engine.scheduler
    bound = sched._victims_could_make_room

    def recorded(req, cands):
        forkable, status = sched.kv.can_fork(req), req.status
        said = bound(req, cands)
        if forkable:
            free, claimed, need = room_after(sched.kv, sched.running, cands, req)
            asked.append((req.request_id, status, said, free >= claimed + need))
        return said

    sched._victims_could_make_room = recorded


# (prompt, n, max_tokens, priority, steps run after adding it): the shrunk program of the random search
_FORK_SCENE = [([5, 20], 4, 5, 0, 0), ([5, 21], 1, 1, 0, 2), ([5, 22], 1, 3, 1, 1),
               ([5, 6, 7, 8, 5, 6, 7, 8, 5, 23, 23, 23], 2, 2, 0, 0)]


def _play(engine: LLMEngine, program) -> dict:
    for i, (prompt, n, max_tokens, priority, run) in enumerate(program):
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True),
                           f"r{i}", priority=priority)
        for _ in range(run):
            engine.step()
    finals = drain(engine)
    assert_no_leak(engine)
    return {rid: [c.token_ids for c in out.outputs] for rid, out in finals.items()}


def test_a_waiting_sample_that_can_fork_preempts_only_when_its_block_is_there():
    """The search's scene, hand-traced: 12 blocks of 4, 6 seats, the priority policy.  In step 3 ``r3#0`` (priority
    0) has prefilled its 12-token prompt and ``r3#1`` may fork: it shares the leader's first 3 blocks (11 tokens,
    the third partly filled), so its first write copies that block -- it needs 1 block.  3 blocks are free, and the
    running requests claim 4 (``r0#1..3`` each a new block, ``r3#0`` one); the only candidate, ``r2`` (priority 1),
    holds 1.  With ``r2`` gone: 3 + 1 - 4 = 0 blocks for a need of 1.  The old shortcut preempted ``r2`` anyway,
    and ``r3#1`` was not admitted.  Now the bound says no, in recompute and swap mode alike, and nobody is preempted
    for it; every request gets the tokens it gets on a pool where nobody is preempted."""
    for mode in ("recompute", "swap"):
        engine = _engine(mode, blocks=12)
        fail_on_futile_preemption(engine.scheduler)
        asked: list = []
        _record_sample_asks(engine, asked)
        got = _play(engine, _FORK_SCENE)
        assert ("r3#1", RequestStatus.WAITING, False, False) in asked, (mode, asked)  # reached, and said no
        assert all(said == fits for *_, said, fits in asked), (mode, asked)
        assert got == _play(_engine(mode, blocks=64), _FORK_SCENE), mode


def test_a_swapped_out_sample_whose_leader_runs_is_bounded_by_its_swap_in():
    """A sample swapped out while its leader keeps running may fork no more: it swaps its own blocks back in.  The
    program (a random search's, shrunk; tests/test_kv_gaps.py's ``_run`` reads it): priority policy, swap mode,
    11 blocks of 4, 4 seats.  ``b2`` is three samples of a 25-token prompt; ``b2#1`` is swapped out in step 3 and
    in step 8, its leader running, it ranks first with 7 host blocks to bring back, 3 blocks free and ``b3#0``
    (priority 1, 1 block) the only candidate: 3 + 1 - 1 claimed < 7.  A bound that took the fork's one block for
    its need (the old shortcut without its ``WAITING`` clause) swapped ``b3#0`` out for nothing.  Oracles: the
    brute-force recount for every bound asked for such a sample, and :func:`fail_on_futile_preemption`."""
    cfg = EngineConfig(num_gpu_blocks_override=11, block_size=4, max_num_batched_tokens=16, max_num_seqs=4,
                       max_model_len=40, scheduling_policy="priority", preemption_mode="swap",
                       num_cpu_blocks_override=8, device="cpu")
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=40, eos_token_ids=set())
    fail_on_futile_preemption(engine.scheduler)
    asked: list = []
    _record_sample_asks(engine, asked)
    # (tenant, shared head tokens, own tokens, max_tokens, priority, n, steps run after it)
    ops = [("add", "c", 0, 1, 1, 0, 2, 0), ("add", "b", 0, 5, 6, 0, 2, 0), ("add", "b", 19, 6, 5, 0, 3, 0),
           ("add", "b", 0, 1, 2, 1, 2, 0)]
    _run(engine, ops, [1 + (i % 7) for i in range(24)])
    assert ("b2#1", RequestStatus.SWAPPED, False, False) in asked, asked  # the state was reached: the bound said no
    assert all(said == fits for *_, said, fits in asked), asked


def _forked_scene(prompt_len: int, outputs: int, victim_blocks: int, forked_sibling: bool = False):
    """A KV manager on a built state, its pool dry: leader ``L`` has prefilled a ``prompt_len``-token prompt, ``S``
    is its sample -- waiting, or (``outputs`` > 0) preempted by recompute after that many tokens, holding no blocks
    --, ``V`` holds ``victim_blocks`` blocks and ``F`` one.  With ``forked_sibling`` another sample ``T`` has forked
    from ``L`` and written its last prompt token (so it holds ``L``'s blocks but a private copy of the last one)."""
    bs = 4
    sibling = 1 if forked_sibling else 0
    kv = KVCacheManager(BlockPool(-(-prompt_len // bs) + sibling + victim_blocks + 1), bs)
    params = SamplingParams(n=2, max_tokens=8, ignore_eos=True)

    def running(rid: str, prompt: list[int], computed: int) -> Request:
        r = Request(rid, prompt, params, 0.0, max_tokens=8)
        assert kv.allocate_slots(r, computed)
        r.num_computed_tokens, r.status = computed, RequestStatus.RUNNING
        return r

    prompt = list(range(1, prompt_len + 1))
    leader = running("L", prompt, prompt_len)
    sample = Request("S", prompt, params, 0.0, max_tokens=8)
    sample.leader, sample.parent_id = leader, "L"
    sample.output_token_ids.extend(range(100, 100 + outputs))
    sample.status = RequestStatus.PREEMPTED if outputs else RequestStatus.WAITING
    reqs = [leader]
    if forked_sibling:
        twin = Request("T", prompt, params, 0.0, max_tokens=8)
        twin.leader, twin.parent_id, twin.status = leader, "L", RequestStatus.RUNNING
        kv.fork(leader, twin)
        assert kv.allocate_slots(twin, 1)  # its copy of the shared last block
        twin.num_computed_tokens = prompt_len
        reqs.append(twin)
    victim = running("V", list(range(200, 200 + 4 * victim_blocks)), 4 * victim_blocks)
    filler = running("F", [7] * 4, 4)
    assert kv.pool.num_free == 0 and kv.can_fork(sample)
    return kv, sample, reqs + [victim, filler]


def _fits(kv, running, gone, req) -> bool:
    """Brute force (:func:`tests.invariants.room_after`): with ``gone`` freed, does ``req`` find room?"""
    free, claimed, need = room_after(kv, running, gone, req)
    return free >= claimed + need


def test_the_room_bound_weighs_a_forking_sample_by_its_fork_and_its_outputs():
    """Built states, each asked of ``could_start_if_freed`` and checked against the brute-force recount.  ``S``
    forks from ``L``'s 10-token prompt: it shares 3 blocks (9 tokens, the third partly filled) and copies the third.
    Waiting (no outputs), it needs 1 block; preempted by recompute after 6 outputs (16 tokens), it forks again and
    needs 4 - 3 + 1 = 2 -- not the 4 it would need alone, as the bound counted it before (no prefix cache, so
    nothing cached to start on), saying "certainly not" to a preemption that would seat it.  ``V`` gone gives its
    ``victim_blocks`` back, and nobody left claims more."""
    for outputs, victim_blocks, fits in ((0, 1, True), (0, 0, False), (6, 2, True), (6, 1, False)):
        kv, sample, running = _forked_scene(10, outputs, victim_blocks)
        victim = running[-2]
        assert _fits(kv, running, [victim], sample) == fits, (outputs, victim_blocks)
        *_, (left, _) = kv.claims_as_they_leave(running, [victim])
        assert left == 0
        assert kv.could_start_if_freed(sample, [victim], left) == fits, (outputs, victim_blocks)


def test_a_sample_never_preempts_its_own_leader():
    """No built-in policy offers a sample its own leader as a victim (a sample ranks with its leader), but a policy
    may.  Gone, the leader takes the sample's start with it: the sample starts alone on its whole prompt.  ``L``'s
    10-token prompt holds 3 blocks, and its sibling ``T`` holds the first two as well (and a copy of the third):
    ``L`` gone gives back 1 block.  With ``V`` holding 1: alone, 2 blocks for a need of 3 -- no; forking, ``V``'s 1
    for the copy of 1 -- yes.  A first version asked the bound again with the leader kept, and the review found
    the policy could then still pick the leader (a yes the victim choice wasted); now the leader is no candidate:
    the bound is asked of the others, and says yes exactly when the brute force finds room for the fork."""
    from minivllm.sched.policies import PriorityAdmission
    from minivllm.sched.scheduler import Scheduler

    for victim_blocks in (0, 1, 2):
        kv, sample, running = _forked_scene(10, 0, victim_blocks, forked_sibling=True)
        leader, victim = running[0], running[-2]
        cfg = EngineConfig(num_gpu_blocks_override=kv.pool.num_blocks, block_size=4, max_model_len=16,
                           scheduling_policy="priority", device="cpu")
        sched = Scheduler(cfg, kv, admission_policy=PriorityAdmission())
        sched.running = running
        forked = _fits(kv, running, [victim], sample)
        assert forked == (victim_blocks > 0), victim_blocks
        sched._may_preempt_for = lambda req, r: r is leader or r is victim  # a policy that offers the leader
        asked = []

        def bound(req, cands):
            asked.append(list(cands))
            return False  # (stop before anything is preempted)

        sched._victims_could_make_room = bound
        assert not sched._preempt_to_admit(sample, [])
        assert asked == [[victim]], victim_blocks  # the leader was no candidate
        del sched._victims_could_make_room
        assert sched._victims_could_make_room(sample, [victim]) == forked, victim_blocks
        # The bound itself still answers for a caller that does offer the leader: the sample then starts alone
        # (3 blocks for its 10 tokens against the leader's 1 + the victim's), which only 2 victim blocks cover.
        alone = _fits(kv, running, [leader, victim], sample)
        assert alone == (victim_blocks == 2), victim_blocks
        *_, (left, _) = kv.claims_as_they_leave(running, [leader, victim])
        assert kv.could_start_if_freed(sample, [leader, victim], left) == alone, victim_blocks


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=st.lists(st.tuples(st.integers(1, 24), st.integers(1, 4), st.integers(1, 10), st.integers(0, 2),
                                  st.integers(0, 3)), min_size=2, max_size=10),
       mode=st.sampled_from(["recompute", "swap"]), blocks=st.integers(12, 24), budget=st.sampled_from([8, 16, 32]),
       seqs=st.integers(2, 6), prefix=st.sampled_from([None, "radix", "hash"]))
def test_samples_preempt_only_for_room_they_then_take(program, mode, blocks, budget, seqs, prefix):
    """Random programs of ``n > 1`` requests under the priority policy on a small pool: every room bound asked is
    checked against the brute-force recount as it is answered (a "no" must be certain: :class:`Watch`), every
    sample's preemption ends with it admitted (where no victim was swapped: a swapped-out request cannot swap in
    during the pass that swaps a victim out, by design -- ``tests/test_futile_swap.py``), and the engine drains with
    no block held."""
    engine = _engine(mode, blocks, budget=budget, seqs=seqs, prefix=prefix)
    Watch(engine)
    sched = engine.scheduler
    wanted: list = []
    real_preempt, real_admit = sched._preempt_to_admit, sched.admit

    def preempt(req, admitted):
        done = real_preempt(req, admitted)
        if done and req.leader is not None:
            wanted.append(req)
        return done

    def admit():
        wanted.clear()
        admitted = real_admit()
        swapped = any(v.status is RequestStatus.SWAPPED for v in sched._admission_preempted)
        assert swapped or all(r in admitted for r in wanted), [r.request_id for r in wanted]
        return admitted

    sched._preempt_to_admit, sched.admit = preempt, admit
    head = [5, 6, 7, 8] * 8
    for i, (length, n, max_tokens, priority, run) in enumerate(program):
        prompt = head[: max(1, length - 3)] + [i + 20] * min(length, 3)
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True),
                           f"r{i}", priority=priority)
        for _ in range(run):
            engine.step()
    drain(engine, 3000)
    assert_no_leak(engine)
