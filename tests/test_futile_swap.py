"""Preempting to seat a request: what a swapped-out request may take, and when a sample of an ``n > 1`` request is
bounded before it preempts.

A request waiting on the host tier cannot swap in during the admission pass that swaps a victim out (the
executor copies swap-ins before swap-outs, so the swap-in could land in the victim's blocks before they are
copied out: ``test_preemption.test_a_swap_in_waits_for_the_step_after_an_admission_swapped_a_victim_out``).  So a
swapped-out request that preempts a worse-ranked one, which is then swapped out, gets back in one pass later.  A
hunt took that for a futile preemption and filtered such victims out; a review showed the filter left the
better-ranked request waiting behind the worse-ranked one until it finished (first test), so the rule stays: a
step's delay, not a wait for the whole of the other request.

The scene: 8 or 16 blocks of 4 tokens, 2 seats, the priority policy, and allocation victims chosen newest-admitted
first (:class:`~minivllm.sched.policies.RecomputeLatestPreemption`).  ``L`` (priority 2) prefills its 4 tokens
in step 0, ``S`` (priority 0) joins in step 1, and both decode.  When ``L`` needs a block and the pool is dry,
``S``, the newer, is preempted -- swapped out; later ``S`` ranks first, a seat is free, but its blocks are not:
it may preempt ``L``.

Oracles: the hand trace, :func:`tests.test_scheduler_invariants.fail_on_futile_preemption` where no victim is
swapped (each request preempted for is admitted in the same pass), and :class:`tests.invariants.KVContents` (every
attended KV slot holds its request's own token).

The known cases a search reported as futile preemptions (stop 72: :func:`_searched_program`'s programs with
:func:`~tests.test_scheduler_invariants.fail_on_futile_preemption` on, seeds 0-599), each traced to this delay -- a
swapped-out request preempted a worse-ranked one, which was swapped out, and was seated in the next pass
(:func:`test_the_searched_futile_preemptions_are_the_swap_delay` replays them; the same search over seeds 600-1,999
found ten more of this kind: 659, 1488, 1509, 1610, 1675, 1678, 1755, 1774, 1797, 1872):

* 34 (WFQ, auto): ``c14#0`` (3 host blocks) swaps ``a10#0`` out, and is back the next step.
* 307 (WFQ, auto, a 50% KV cap): ``a3#1``, a sample whose leader had finished (so it cannot fork: it swaps its own
  block back in), swaps ``b8#0`` out; the pool has no free block until that copy-out runs, so it is back next step.
* 388 (WFQ, swap): ``a2#0`` swaps ``b4#1`` out, and is back the next step.
* 389 (WFQ, auto): ``c5#0`` swaps ``a11`` out, and is back the next step.
* 418 (WFQ, swap): ``c5#1``, its leader finished, swaps ``a3#1`` out, and is back the next step.
* 510 (WFQ, swap, 11 blocks): ``a3#2``, a sample whose leader had finished, with 5 host blocks to bring back, swaps
  ``c8`` out with the pool dry; nothing may swap in during that pass, so it swaps in the next step, as the others.
"""

from __future__ import annotations

import random

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.sched.policies import RecomputeLatestPreemption

from tests.invariants import KVContents, assert_no_leak, drain
from tests.test_scheduler_invariants import fail_on_futile_preemption


class SwapsFrom:
    """An ``auto`` mode cost model: swap a victim with at least ``tokens`` computed tokens, recompute a shorter one."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return num_tokens >= self.tokens


def _scene(mode: str, *, host_blocks: int = 64, costs=None, prompt_l: int = 4, prompt_s: int = 4) -> LLMEngine:
    """The scene of the module docstring, run to the end; every admission pass checked for a futile preemption."""
    cfg = EngineConfig(num_gpu_blocks_override=8, num_cpu_blocks_override=host_blocks, block_size=4,
                       max_num_batched_tokens=64, max_num_seqs=2, max_model_len=32, scheduling_policy="priority",
                       preemption_mode=mode, device="cpu")
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=32, eos_token_ids=set(),
                       preemption_policy=RecomputeLatestPreemption(), preemption_cost_model=costs)
    fail_on_futile_preemption(engine.scheduler)
    engine.add_request({"prompt_token_ids": [7] * prompt_l}, SamplingParams(max_tokens=16, ignore_eos=True), priority=2,
                       request_id="L")
    engine.step()
    engine.add_request({"prompt_token_ids": [8] * prompt_s}, SamplingParams(max_tokens=16, ignore_eos=True),
                       priority=0, request_id="S")
    finals = drain(engine)
    assert {rid: len(out.outputs[0].token_ids) for rid, out in finals.items()} == {"L": 16, "S": 16}
    assert not engine.executor.wrong, engine.executor.wrong
    assert_no_leak(engine)
    return engine


def _rows(engine: LLMEngine, step: int) -> tuple:
    return next(rec for rec in engine.step_log if rec.step == step).seqs


def test_a_swapped_out_request_preempts_a_worse_ranked_victim_that_is_swapped_and_is_back_a_step_later():
    """The review's scene: 16 blocks, ``L`` (priority 2) asks 60 tokens, ``S`` (priority 0) 40.  ``L``'s growth
    swaps ``S`` out; when ``S`` ranks first again it preempts ``L``, which is swapped out too -- so ``S`` cannot swap
    in during that pass, and comes back in the next step.  With the hunt's filter (no victim that would be swapped)
    ``S`` was not let preempt ``L`` at all and waited for ``L``'s last token (finishing at step 71 where it
    finishes at 43 here).  Oracle: the priority policy's promise -- the better-ranked request is seated ahead of
    the worse-ranked one -- read from the step log by hand: the step after ``L``'s preemption runs ``S``, and ``S``
    ends before ``L``."""
    cfg = EngineConfig(num_gpu_blocks_override=16, num_cpu_blocks_override=64, block_size=4,
                       max_num_batched_tokens=64, max_num_seqs=2, max_model_len=64, scheduling_policy="priority",
                       preemption_mode="swap", device="cpu")
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=64, eos_token_ids=set(),
                       preemption_policy=RecomputeLatestPreemption())
    engine.add_request({"prompt_token_ids": [7] * 4}, SamplingParams(max_tokens=60, ignore_eos=True), priority=2,
                       request_id="L")
    engine.step()
    engine.add_request({"prompt_token_ids": [8] * 4}, SamplingParams(max_tokens=40, ignore_eos=True), priority=0,
                       request_id="S")
    finals = drain(engine)
    assert {rid: len(out.outputs[0].token_ids) for rid, out in finals.items()} == {"L": 60, "S": 40}
    assert not engine.executor.wrong, engine.executor.wrong
    assert_no_leak(engine)
    preempted = [(rec.step, rec.preempted, rec.swapped) for rec in engine.step_log if rec.preempted]
    assert [p[1:] for p in preempted] == [(("S",), ("S",)), (("L",), ("L",))]  # S for L's growth, then L for S
    l_out = preempted[1][0]
    rows = {rec.step: {seq[0] for seq in rec.seqs} for rec in engine.step_log}
    assert "S" not in rows[l_out] and "S" in rows[l_out + 1]  # a step's delay, then S is back
    last = {rid: max(step for step, ids in rows.items() if rid in ids) for rid in ("L", "S")}
    assert last["S"] < last["L"]


def test_a_swapped_out_request_still_preempts_a_victim_the_full_host_tier_would_recompute():
    """The same scene with a host tier of exactly ``S``'s 4 blocks: once ``S`` is out, ``L`` (5 blocks) cannot be
    swapped, so preempting it recomputes it and frees its blocks at once -- ``S`` swaps back in during the same
    pass, in step 15, and ``L`` starts over once ``S`` is done (step 19, its 4 prompt tokens and 15 outputs)."""
    engine = _scene("swap", host_blocks=4)
    preempted = [(rec.step, rec.preempted, rec.swapped) for rec in engine.step_log if rec.preempted]
    assert preempted == [(13, ("S",), ("S",)), (15, ("L",), ())]  # L recomputed, S swapped
    assert _rows(engine, 15) == (("S", 15, 1),)
    assert _rows(engine, 19) == (("L", 0, 19),)


def test_a_swapped_out_request_still_preempts_a_victim_the_cost_model_would_recompute():
    """``auto`` mode with a cost model that swaps from 16 computed tokens, ``L`` of 1 prompt token and ``S`` of 5
    (the same steps otherwise): in step 13 ``S`` (16 computed) is swapped out; in step 15 ``L`` (15 computed) would
    be recomputed, so preempting it seats ``S`` in that very pass, and ``L`` starts over in step 19."""
    engine = _scene("auto", costs=SwapsFrom(16), prompt_l=1, prompt_s=5)
    preempted = [(rec.step, rec.preempted, rec.swapped) for rec in engine.step_log if rec.preempted]
    assert preempted == [(13, ("S",), ("S",)), (15, ("L",), ())]
    assert _rows(engine, 15) == (("S", 16, 1),)
    assert _rows(engine, 19) == (("L", 0, 16),)


def test_a_sample_whose_leader_has_finished_is_bounded_before_it_preempts():
    """Admission skips its room bound for a sample of an ``n > 1`` request ("it forks from its leader: a block or
    two"), but a sample whose leader has finished cannot fork: it starts alone and needs its whole prompt.  Skipping
    the bound for it, WFQ preempted a running request for a sample that still did not fit (the sweep behind this
    module found it under recompute, swap and auto alike).  The program (a random search's, shrunk): WFQ, 21 blocks
    of 4, 4 seats, a 4-token budget; ``a7`` is three samples of a 27-token prompt, and once its leader has finished
    its next sample finds no room even with every worse-ranked request gone.  Oracles:
    :func:`tests.test_scheduler_invariants.fail_on_futile_preemption`, and the bound asked (and saying no) for such
    a sample -- the state is reached; :func:`tests.test_kv_gaps._run` recounts both tiers after every step and
    drains the engine."""
    from minivllm.config import TenantConfig

    from tests.test_kv_gaps import _run

    cfg = EngineConfig(num_gpu_blocks_override=21, block_size=4, max_num_batched_tokens=4, max_num_seqs=4,
                       max_model_len=40, long_prefill_token_threshold=0, preemption_protect_after=0,
                       scheduling_policy="wfq", device="cpu",
                       tenants={"a": TenantConfig(weight=1.0), "b": TenantConfig(weight=2.0, max_tokens_per_step=6),
                                "c": TenantConfig()})
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=40, eos_token_ids=set())
    sched = engine.scheduler
    fail_on_futile_preemption(sched)
    asked = []
    bound = sched._victims_could_make_room

    def recorded(req, cands):
        said = bound(req, cands)
        if req.leader is not None and req.leader.status.finished:
            asked.append(said)
        return said

    sched._victims_could_make_room = recorded
    # (tenant, shared head tokens, own tokens, max_tokens, priority, n, steps run after it) as test_kv_gaps reads them
    ops = [("add", "a", 20, 13, 8, 0, 3, 1), ("add", "b", 24, 4, 1, 2, 3, 3), ("abort", 20, 2),
           ("add", "c", 4, 13, 8, 0, 1, 1), ("add", "b", 13, 14, 11, 2, 1, 0), ("add", "b", 9, 8, 8, 2, 1, 1),
           ("add", "c", 6, 15, 9, 1, 1, 1), ("add", "b", 21, 7, 7, 0, 1, 2), ("abort", 11, 2),
           ("add", "a", 13, 14, 11, 1, 3, 3)]
    _run(engine, ops, [1 + (i % 7) for i in range(24)])
    assert False in asked  # a sample with a finished leader was bounded, and the bound said no
    assert not engine.executor.wrong


def _searched_program(seed: int) -> tuple[tuple, list]:
    """The search's program for ``seed``: ``(policy, mode, prefix cache, blocks, budget, KV cap)`` for
    :func:`tests.test_kv_gaps._engine`, and ops for :func:`tests.test_kv_gaps._run` (adds of ``n`` up to 3 among
    three tenants, aborts).  Its random draws stay in this order: the seeds above name these programs."""
    rng = random.Random(seed)
    config = (rng.choice(["priority", "priority", "wfq", "three_class"]), rng.choice(["recompute", "swap", "auto"]),
              rng.choice([None, "radix", "hash"]), rng.randint(10, 24), rng.choice([8, 16, 32]),
              rng.choice([None, 0.5, 0.75]))
    ops = []
    for _ in range(rng.randint(4, 24)):
        if rng.random() < 0.8:
            ops.append(("add", rng.choice("abc"), rng.randint(0, 24), rng.randint(1, 16), rng.randint(1, 12),
                        rng.randint(0, 2), rng.choice([1, 2, 2, 3]), rng.randint(0, 3)))
        else:
            ops.append(("abort", rng.randint(0, 40), rng.randint(0, 2)))
    return config, ops


def _completions(config: tuple, ops: list, blocks: int, refuse: set | None = None) -> tuple[dict, list, set]:
    """Run a searched program on ``blocks`` blocks, every admission pass checked for a futile preemption (the swap
    delay allowed, and recorded).  Returns the completions that finished by length, the delays, and which adds (by
    their order) were refused at the door -- a tenant's KV cap is a share of the pool, so a roomy pool takes
    prompts a small one refuses; given those as ``refuse``, a roomy run refuses them too, and every request keeps
    its id (the simulated executor's tokens are drawn from the id and the position)."""
    from tests.test_kv_gaps import _engine, _run

    engine = _engine(config[0], config[1], config[2], blocks, *config[4:])
    delayed = fail_on_futile_preemption(engine.scheduler, swap_delay=True)
    done, refused, adds = {}, set(), [0]
    real_step, real_add = engine.step, engine.add_request

    def step():
        outs = real_step()
        for o in outs:
            if o.finished:
                done.update({(o.request_id, i): c.token_ids for i, c in enumerate(o.outputs) if c.finish_reason == "length"})
        return outs

    def add_request(*args, **kwargs):
        adds[0] += 1
        try:
            if refuse is not None and adds[0] in refuse:
                raise ValueError("refused in the run compared with")
            return real_add(*args, **kwargs)
        except ValueError:
            refused.add(adds[0])
            raise

    engine.step, engine.add_request = step, add_request
    _run(engine, ops, [1 + (i % 7) for i in range(24)])  # recounts both tiers each step; drains; no leak
    assert not engine.executor.wrong, engine.executor.wrong
    return done, delayed, refused


@pytest.mark.parametrize("seed, config", [
    (34, ("wfq", "auto", None, 23, 8, None)),
    (307, ("wfq", "auto", "radix", 18, 16, 0.5)),
    (388, ("wfq", "swap", "radix", 20, 8, 0.75)),
    (389, ("wfq", "auto", "radix", 18, 8, None)),
    (418, ("wfq", "swap", None, 14, 8, 0.5)),
    (510, ("wfq", "swap", "radix", 11, 8, None)),
])
def test_the_searched_futile_preemptions_are_the_swap_delay(seed, config):
    """Each seed the search reported (module docstring; at this commit, one delay each, the request named there):
    its preemption that seated nobody in its pass is the swap delay -- a victim of that pass swapped out, the
    request preempted for swapped out too -- and the request is seated by the next admission pass; every other
    preemption seats its request in its own pass.  Oracles:
    :func:`~tests.test_scheduler_invariants.fail_on_futile_preemption` with ``swap_delay``; the completions that
    finished by length equal a run of the same requests on a roomy pool (200 blocks; which tokens come never depends
    on when)."""
    got, ops = _searched_program(seed)
    assert got == config  # the search's program for this seed
    done, delayed, refused = _completions(config, ops, config[3])
    assert delayed and all(seated == step + 1 for _, step, seated in delayed), delayed  # reached, and one step
    roomy, _, _ = _completions(config, ops, 200, refuse=refused)
    shared = done.keys() & roomy.keys()
    assert len(shared) > 5 and {k: done[k] for k in shared} == {k: roomy[k] for k in shared}


def test_seed_1745_preempts_only_for_requests_it_seats():
    """Seed 1745's program under the strict futile-preemption check (the swap delay allowed, seated the next pass);
    the requests that finished by length produced the same tokens as on a 200-block pool.  Its futile preemption was
    the room bound counting cached blocks that a request left running kept pinned (``tests/test_pinned_room.py``)."""
    config, ops = _searched_program(1745)
    assert config == ("wfq", "swap", "hash", 14, 8, 0.75)  # the search's program
    done, delayed, refused = _completions(config, ops, config[3])
    assert all(seated == step + 1 for _, step, seated in delayed), delayed
    roomy, _, _ = _completions(config, ops, 200, refuse=refused)
    shared = done.keys() & roomy.keys()
    assert len(shared) > 5 and {k: done[k] for k in shared} == {k: roomy[k] for k in shared}
