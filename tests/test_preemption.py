"""Preemption by recompute, swap, reject and auto: block conservation on both tiers, no leaks,
no starvation, the swap data path, the cost model and the anti-thrash rule.  No model needed
(the simulated executor); the HF-parity versions on the real model are in test_hf_parity.py.
"""

from __future__ import annotations

import math
import zlib
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.kv import BlockPool, KVCacheManager
from minivllm.kv.kv_cache import KVCache
from minivllm.request import Request, RequestStatus
from minivllm.sched.scheduler import PreemptionCosts
from minivllm.sim import SimulatedExecutor

from invariants import KVContents, assert_no_leak, check_both_tiers, drain, tiny_engine  # noqa: E402  (tests/ is on sys.path)
from tests.fuzz import examples

MODES = ["recompute", "swap", "reject", "auto"]


def make_engine(mode="recompute", cpu_blocks=16, **options):
    """:func:`invariants.tiny_engine` in preemption ``mode`` with a host tier of ``cpu_blocks`` blocks."""
    return tiny_engine(preemption_mode=mode, num_cpu_blocks_override=cpu_blocks, **options)


# -- the state machine: random programs in every mode ------------------------------------------

op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24)),
    st.tuples(st.just("add_n"), st.integers(2, 30), st.integers(2, 3)),
    st.tuples(st.just("step"), st.integers(1, 5), st.just(0)),
    st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
    st.tuples(st.just("abort_swapped"), st.integers(0, 30), st.just(0)),
)


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=40),
    mode=st.sampled_from(MODES),
    blocks=st.integers(16, 32),
    cpu_blocks=st.integers(0, 24),
    prefix=st.sampled_from([None, "radix", "hash"]),
    protect=st.integers(0, 3),
)
def test_invariants_in_every_preemption_mode(ops, mode, blocks, cpu_blocks, prefix, protect):
    engine = make_engine(mode, num_blocks=blocks, cpu_blocks=cpu_blocks, prefix=prefix,
                         preemption_protect_after=protect, swap_bandwidth_gbps=1.0, prefill_tokens_per_s=2000.0)
    added: list[str] = []
    finished: set[str] = set()
    for kind, a, b in ops:
        prompt = ([5, 6, 7, 8] * 10)[: max(1, a - 3)] + [a % 3] * min(a, 3)
        if kind == "add":
            added.append(engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=b, ignore_eos=True)))
        elif kind == "add_n":
            params = SamplingParams(n=b, max_tokens=6, temperature=1.0, seed=a, ignore_eos=True)
            added.append(engine.add_request({"prompt_token_ids": prompt}, params))
        elif kind == "abort" and added:
            if engine.abort_request(added[a % len(added)]):
                finished.add(added[a % len(added)])
        elif kind == "abort_swapped":
            # A request sits swapped out only between a swap-out and the next admission, rarely at the moment an
            # op is drawn (250 programs found one 0 times); step until one does, so the abort of a request that
            # holds host blocks only -- the one path that frees host blocks outside a swap-in -- is exercised.
            swapped = []
            for _ in range(8):
                swapped = [r for r in engine.scheduler.waiting if r.status is RequestStatus.SWAPPED]
                if swapped or not engine.has_unfinished_requests():
                    break
                for out in engine.step():
                    if out.finished:
                        finished.add(out.request_id)
                check_both_tiers(engine)
            if swapped:
                victim = swapped[a % len(swapped)]
                assert engine.abort_request(victim.parent_id or victim.request_id)
        else:
            for _ in range(a):
                waiting = {r.request_id for r in engine.scheduler.waiting}
                for out in engine.step():
                    if out.finished:
                        finished.add(out.request_id)
                        assert out.outputs and all(c.finish_reason for c in out.outputs)
                # admission reserves what this step's allocation needs, so it never preempts whom it just let in
                # (a request that waited before the step can only be preempted in it if it was admitted in it)
                assert not waiting & set(engine.step_log[-1].preempted), "admitted and preempted in one step"
        check_both_tiers(engine)
    drain(engine)
    assert_no_leak(engine)
    st_ = engine.stats()
    if mode == "reject":
        assert st_["num_preemptions"] == 0, "reject mode must never preempt running work"
    if mode == "recompute" or cpu_blocks == 0:
        assert st_["num_swap_preemptions"] == 0
    assert st_["swapped_in_blocks"] <= st_["swapped_out_blocks"]


# -- the modes, one by one ------------------------------------------------------------------------

def overload(engine: LLMEngine, n: int = 10, max_tokens: int = 30) -> list[str]:
    import random

    rng = random.Random(0)
    return [
        engine.add_request(
            {"prompt_token_ids": [rng.randrange(10, 900) for _ in range(rng.randrange(5, 30))]},
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )
        for _ in range(n)
    ]


def step_until_swapped(engine: LLMEngine, max_steps: int) -> Request:
    """Step until some request sits swapped out in the queue; return the first such request."""
    for _ in range(max_steps):
        engine.step()
        swapped = [r for r in engine.scheduler.waiting if r.status is RequestStatus.SWAPPED]
        if swapped:
            return swapped[0]
    raise AssertionError("the workload should swap a request out")


def test_swap_mode_swaps_and_every_request_finishes_whole():
    engine = make_engine("swap", num_blocks=40, cpu_blocks=64, max_len=128, budget=64)
    ids = overload(engine)
    finals = drain(engine)
    st_ = engine.stats()
    assert st_["num_swap_preemptions"] > 0 and st_["num_recompute_preemptions"] == 0
    assert st_["swapped_out_blocks"] == st_["swapped_in_blocks"] > 0
    assert st_["swapped_out_bytes"] == st_["swapped_out_blocks"] * engine.bytes_per_block
    assert st_["recomputed_tokens"] == 0
    assert all(len(finals[i].outputs[0].token_ids) == 30 for i in ids)
    assert_no_leak(engine)


def test_aborting_a_swapped_out_request_gives_its_host_blocks_back():
    """The random programs rarely catch a request while it is swapped out; this one does, on purpose."""
    engine = make_engine("swap", num_blocks=40, cpu_blocks=64, max_len=128, budget=64)
    overload(engine)
    victim = step_until_swapped(engine, 500)
    held, free_before = len(victim.cpu_block_ids), engine.kv.cpu_pool.num_free
    assert held > 0
    assert engine.abort_request(victim.parent_id or victim.request_id)
    assert engine.kv.cpu_pool.num_free == free_before + held and victim not in engine.scheduler.waiting
    check_both_tiers(engine)
    drain(engine)
    assert_no_leak(engine)


@pytest.mark.parametrize("seed", range(12))
def test_swap_heavy_traffic_never_preempts_whom_it_just_admitted(seed):
    """A small pool, a large host tier and a steady trickle of requests: many swap-outs and swap-ins.  A
    swapped request comes back only if its blocks fit beside what the running requests will need this step;
    otherwise the step that swapped it in would preempt it again (found by a planted bug that ignored the
    running requests' reservation, which the random programs above almost never reach)."""
    import random

    rng = random.Random(seed)
    engine = make_engine("swap", num_blocks=rng.randint(16, 28), cpu_blocks=64, max_seqs=8, max_len=64)
    swaps = 0
    for _ in range(400):
        if rng.random() < 0.3:
            engine.add_request({"prompt_token_ids": [rng.randrange(5, 50)] * rng.randint(1, 20)},
                               SamplingParams(max_tokens=rng.randint(5, 40), ignore_eos=True))
        if not engine.has_unfinished_requests():
            continue
        waiting = {r.request_id for r in engine.scheduler.waiting}
        engine.step()
        rec = engine.step_log[-1]
        assert not waiting & set(rec.preempted), "admitted (or swapped in) and preempted in one step"
        swaps += rec.swapped_in > 0
        check_both_tiers(engine)
    drain(engine)
    assert_no_leak(engine)
    assert swaps > 0, "the workload should swap requests back in"


def test_swap_falls_back_to_recompute_when_the_host_tier_is_full():
    engine = make_engine("swap", num_blocks=40, cpu_blocks=12, max_len=128, budget=64)
    overload(engine)
    drain(engine)
    st_ = engine.stats()
    assert st_["num_swap_preemptions"] > 0 and st_["num_recompute_preemptions"] > 0
    assert_no_leak(engine)


def test_swapped_requests_come_back_ahead_of_new_admissions():
    engine = make_engine("swap", num_blocks=20, cpu_blocks=32, max_len=64, budget=64, max_seqs=4)
    overload(engine, n=6, max_tokens=40)
    victim = step_until_swapped(engine, 200)
    assert engine.scheduler.waiting[0] is victim, "a swapped-out request waits at the front"
    engine.add_request({"prompt_token_ids": [3] * 8}, SamplingParams(max_tokens=2, ignore_eos=True), "late")
    while victim.status is RequestStatus.SWAPPED:
        engine.step()
        late = engine.requests.get("late")
        assert late is None or late.status is RequestStatus.WAITING or victim.status is not RequestStatus.SWAPPED, \
            "a new request was admitted before the swapped-out one came back"
    drain(engine)
    assert_no_leak(engine)


def test_reject_mode_rejects_new_work_and_never_harms_running_requests():
    engine = make_engine("reject", num_blocks=40, max_len=128, budget=64)
    ids = overload(engine)
    finals = drain(engine)
    reasons = Counter(finals[i].outputs[0].finish_reason for i in ids)
    assert reasons["rejected"] > 0 and reasons["length"] > 0
    for i in ids:
        out = finals[i]
        if out.outputs[0].finish_reason == "rejected":
            assert out.retry_after_s is not None and out.retry_after_s > 0 and not out.outputs[0].token_ids
        else:
            assert len(out.outputs[0].token_ids) == 30 and out.metrics.num_preemptions == 0
    st_ = engine.stats()
    assert st_["num_preemptions"] == 0 and st_["num_rejected"] == reasons["rejected"]
    assert_no_leak(engine)


def test_reject_mode_accepts_or_rejects_an_n_group_whole():
    """n > 1 in reject mode: never some samples served and the others "rejected" (the server would owe a 200
    and a 429 for one call).  A group that gets in runs its samples as room frees; one that does not is turned
    away with every sample."""
    engine = make_engine("reject", num_blocks=10, max_len=24, budget=64)  # one worst case (6 blocks) at a time
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)
    rid = engine.add_request({"prompt_token_ids": [1] * 8}, params, "group")
    finals = drain(engine)
    assert [o.finish_reason for o in finals[rid].outputs] == ["length"] * 3
    assert all(len(o.token_ids) == 16 for o in finals[rid].outputs)
    assert engine.stats()["num_rejected"] == 0 and engine.stats()["num_preemptions"] == 0
    assert_no_leak(engine)

    engine.add_request({"prompt_token_ids": [2] * 8}, SamplingParams(max_tokens=16, ignore_eos=True), "big")
    engine.step()
    rid = engine.add_request({"prompt_token_ids": [1] * 8}, params, "late")  # no room beside "big"
    finals = drain(engine)
    assert [o.finish_reason for o in finals[rid].outputs] == ["rejected"] * 3
    assert not any(o.token_ids for o in finals[rid].outputs) and finals[rid].retry_after_s > 0
    assert finals["big"].outputs[0].finish_reason == "length"
    # one request turned away, as the server's 429 and Prometheus's counter have it (each sample was counted)
    assert engine.stats()["num_rejected"] == 1 and engine.stats()["per_tenant"]["default"]["num_rejected"] == 1
    assert_no_leak(engine)


def test_reject_mode_reserves_one_copy_per_forked_sample_not_two():
    """A leader and its sample share a partly filled last block; the pair needs one private copy between them
    (whichever writes first copies, the other then holds the block alone).  Hand count, 4-token blocks: the pair
    (6-token prompt, 2 tokens each) holds 2 blocks and needs 1 copy; x (4 + 4 tokens) needs 2: 5 in all.  So 5
    blocks serve everyone and 4 must turn x away -- and reject mode never preempts.  (Reserving a copy for the
    leader too rejected x at 5; reserving none admitted x at 4 and then ran out of blocks.)"""
    for num_blocks, x_served in ((4, False), (5, True)):
        engine = make_engine("reject", num_blocks=num_blocks, max_len=16, budget=64)
        params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=2, ignore_eos=True)
        engine.add_request({"prompt_token_ids": [1, 2, 3, 4, 5, 6]}, params, "pair")
        engine.step()  # the leader prefills; its sample forks in the next step, beside x
        engine.add_request({"prompt_token_ids": [7, 8, 9, 10]}, SamplingParams(max_tokens=4, ignore_eos=True), "x")
        finals = drain(engine, each=check_both_tiers)
        assert [len(o.token_ids) for o in finals["pair"].outputs] == [2, 2]
        assert finals["x"].outputs[0].finish_reason == ("length" if x_served else "rejected"), num_blocks
        assert engine.stats()["num_preemptions"] == 0
        assert_no_leak(engine)


def test_a_swapped_out_request_comes_back_only_with_room_for_the_rest_of_its_prefill():
    """A swap-in is an admission, so it sets aside what any admission does: its swapped blocks *and* the rest of
    its prefill -- not just room for this step's chunk, or it runs dry halfway and is preempted again.  Hand
    count, 4-token blocks, 6 device blocks, 2 host blocks, 2-token chunks: A (2 + 6 tokens) and B (2 + 10) run;
    C (16-token prompt) arrives at step 1 and is swapped out at step 5 with 8 tokens (2 host blocks).  At step 7
    B still needs one block and 4 are free: C's 2 blocks plus its next chunk's one would fit, but its 16 tokens
    need 4, and 1 + 4 > 4 -- it waits until A finishes.  Coming back on one chunk's room, C ran dry at step 9 and,
    with 12 tokens and a 2-block host tier, was recomputed from scratch (12 tokens thrown away)."""
    engine = make_engine("swap", cpu_blocks=2, num_blocks=6, budget=16, max_len=24, max_seqs=4,
                         long_prefill_token_threshold=2)
    engine.add_request({"prompt_token_ids": [10, 10]}, SamplingParams(max_tokens=6, ignore_eos=True), "A")
    engine.add_request({"prompt_token_ids": [11, 11]}, SamplingParams(max_tokens=10, ignore_eos=True), "B")
    engine.step()
    engine.add_request({"prompt_token_ids": [12] * 16}, SamplingParams(max_tokens=1, ignore_eos=True), "C")
    finals = drain(engine, each=check_both_tiers)
    moves = [(r.step, r.preempted, r.swapped_in) for r in engine.step_log if r.preempted or r.swapped_in]
    assert moves == [(5, ("C",), 0), (10, (), 2)], moves
    assert engine.stats()["num_recompute_preemptions"] == 0 and engine.scheduler.stats.num_recomputed_tokens == 0
    assert [len(finals[r].outputs[0].token_ids) for r in "ABC"] == [6, 10, 1]
    assert_no_leak(engine)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_reject_mode_turns_a_better_ranked_request_away_rather_than_preempt(policy):
    """Reject mode's promise holds under a policy that may preempt to seat a better-ranked request: nothing
    running is preempted; the newcomer that does not fit is rejected.  Hand count, 8 blocks of 4 tokens: L (8 + 8
    tokens: 4 blocks at worst) holds 2 and has 2 set aside; H (priority 0, 8 + 12 tokens: 5 blocks) finds 4."""
    engine = make_engine("reject", num_blocks=8, max_len=32, budget=64, scheduling_policy=policy)
    engine.add_request({"prompt_token_ids": [1] * 8}, SamplingParams(max_tokens=8, ignore_eos=True), "L", priority=5)
    engine.step()
    engine.add_request({"prompt_token_ids": [2] * 8}, SamplingParams(max_tokens=12, ignore_eos=True), "H", priority=0)
    finals = drain(engine, each=check_both_tiers)
    assert finals["H"].outputs[0].finish_reason == "rejected" and len(finals["L"].outputs[0].token_ids) == 8
    assert engine.stats()["num_preemptions"] == 0 and finals["L"].metrics.num_preemptions == 0
    assert_no_leak(engine)


def test_reject_mode_retry_hint_grows_with_the_work_ahead():
    engine = make_engine("reject", num_blocks=20, max_len=80, budget=64)
    engine.add_request({"prompt_token_ids": [1] * 8}, SamplingParams(max_tokens=60, ignore_eos=True), "long")
    engine.step()
    engine.step()
    engine.add_request({"prompt_token_ids": [2] * 8}, SamplingParams(max_tokens=60, ignore_eos=True), "r1")
    out = [o for o in engine.step() if o.request_id == "r1"][0]
    assert out.outputs[0].finish_reason == "rejected"
    # the running request still has ~57 tokens to go, each a step of the measured length
    assert out.retry_after_s == pytest.approx(engine.step_time_s * 57, rel=0.1)


def _reject_scene_with_a_prompt_in_chunks(extra_steps: int | None = None):
    """Reject mode, 12 blocks of 4 tokens, prompts in chunks of 4.  ``A`` (a 24-token prompt, 2 outputs: 7 blocks
    worst case) and ``B`` (4 tokens, 6 outputs: 3 blocks) run; ``X`` (12 tokens + 4 outputs: 4 blocks) finds 2
    blocks beside their worst cases and is turned away.  With ``extra_steps``, the scene goes on that many steps
    and ``X`` comes again: the engine's own admission then says whether it fits."""
    engine = make_engine("reject", num_blocks=12, max_len=32, budget=32, long_prefill_token_threshold=4)
    engine.add_request({"prompt_token_ids": list(range(1, 25))}, SamplingParams(max_tokens=2, ignore_eos=True), "A")
    engine.add_request({"prompt_token_ids": list(range(30, 34))}, SamplingParams(max_tokens=6, ignore_eos=True), "B")
    engine.step()
    x = {"prompt_token_ids": list(range(40, 52))}, SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(*x, request_id="X")
    rejected = {o.request_id: o for o in engine.step() if o.finished}
    assert list(rejected) == ["X"] and rejected["X"].outputs[0].finish_reason == "rejected"
    if extra_steps is None:
        return engine, rejected["X"]
    for _ in range(extra_steps):
        engine.step()
    engine.add_request(*x, request_id="X again")
    return not any(o.request_id == "X again" and o.finished for o in engine.step())


def test_reject_mode_retry_hint_counts_a_prompt_still_in_chunks():
    """Who leaves first is read from the steps each running request still needs, prompt chunks included: ``A``
    has only 2 outputs to go but 4 chunks of its prompt before them (5 steps), ``B`` 4 outputs (4 steps).
    Counting outputs alone, the hint waited for ``A`` and said 2 steps -- when nothing has left yet.
    Oracle: run the scene on and offer ``X`` again after each number of steps."""
    fits_after = next(k for k in range(12) if _reject_scene_with_a_prompt_in_chunks(k))
    engine, out = _reject_scene_with_a_prompt_in_chunks()
    a = next(r for r in engine.scheduler.running if r.request_id == "A")
    assert a.num_computed_tokens < len(a.prompt_token_ids), "A finished its prompt: the scene tests nothing"
    xreq = Request("X", list(range(40, 52)), SamplingParams(max_tokens=4), 0.0, max_tokens=4)
    assert fits_after == 4 and engine.retry_steps(xreq) == fits_after
    assert out.retry_after_s == pytest.approx(engine.step_time_s * fits_after, abs=1e-3)


# -- auto mode with the engine's own, learnt cost model: random programs on a noisy clock ------------------

class NoisyHistory(KVContents):
    """A stand-in model for the learnt prefill rate: the next token is a function of the whole context (so
    "the same tokens as a recompute-only run" checks that a swap or a recompute gave each request exactly its
    own context back), every KV slot a step attends is checked (:class:`KVContents`), and each step's time is
    the simulator's price times the next of ``factors`` in turn (jitter, a rare 10x step, a step the clock does
    not see: factor 0), and three times that from step ``slow_after`` on (a machine that slows down mid-run),
    so the fit sees the noise and the drift it was built to survive."""

    def __init__(self, block_size: int, factors: list[float], slow_after: int | None = None, **kwargs) -> None:
        super().__init__(block_size, **kwargs)
        self.factors, self.slow_after, self.k = factors, slow_after, 0

    def step_time(self, batch):
        self.k += 1
        slow = 3.0 if self.slow_after is not None and self.k >= self.slow_after else 1.0
        return super().step_time(batch) * self.factors[self.k % len(self.factors)] * slow

    def execute(self, batch):
        out = super().execute(batch)
        for s in batch.seqs:
            if s.samples:
                out[s.request.request_id] = 10 + zlib.crc32(repr(s.request.all_token_ids).encode()) % 900
        return out


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 24), st.integers(1, 10)),
        st.tuples(st.just("step"), st.integers(1, 8), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0), st.just(0)),
        st.tuples(st.just("idle"), st.integers(1, 60), st.just(0), st.just(0)),
    ), min_size=1, max_size=30),
    blocks=st.integers(16, 32),
    cpu_blocks=st.integers(0, 24),
    gbps=st.sampled_from([0.001, 0.002, 0.005, 0.01, 1.0]),  # around the crossover (~2-5 MB/s here) and far past it
    # each step's time is the simulator's times one of these, in turn: a quiet machine, jitter, rare extremes
    factors=st.sampled_from([[1.0], [0.9, 1.1, 1.0, 1.05], [1.0] * 6 + [0.0, 10.0], [0.1, 2.0, 0.5, 1.0, 1.0]]),
    slow_after=st.sampled_from([None, 20, 60]),
    prefix=st.sampled_from([None, "radix", "hash"]),
)
def test_auto_mode_with_a_learnt_prefill_rate_keeps_every_invariant(ops, blocks, cpu_blocks, gbps, factors, slow_after,
                                                                    prefix):
    """Auto mode on the engine's own cost model (no ``prefill_tokens_per_s`` given: the rate is fitted from the
    steps, :class:`~minivllm.sched.scheduler.PrefillRateFit`), under random arrivals, aborts and idle stretches
    on a noisy clock that may slow down.  After every step both tiers recount and the rate auto mode prices a recompute by is
    positive, finite and within the fit's bounds around its prior; the engine drains and holds nothing; and every
    request that ran to its length got the tokens a recompute-only engine gives it alone."""
    def build(mode, executor, **options):  # tiny_engine's sizes, on the given executor
        cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=6,
                           max_model_len=64, preemption_mode=mode, device="cpu", **options)
        return LLMEngine(cfg, executor=executor, model_max_len=64, eos_token_ids=set())

    ex = NoisyHistory(4, factors, slow_after)
    engine = build("auto", ex, num_cpu_blocks_override=cpu_blocks, swap_bandwidth_gbps=gbps,
                   enable_prefix_caching=prefix is not None, prefix_cache=prefix or "radix")
    costs, fit = engine.scheduler.costs, engine._prefill_fit
    assert engine._learnt_costs is costs and fit is not None, "auto mode should learn into its own cost model"
    prior = costs.prefill_tokens_per_s
    lo, hi = prior / fit.max_ratio, prior * fit.max_ratio

    def check(e):
        check_both_tiers(e)
        rate = e.scheduler.costs.prefill_tokens_per_s
        assert math.isfinite(rate) and lo <= rate <= hi, f"learnt prefill rate {rate} (prior {prior})"

    added, aborted, finals = {}, set(), {}
    # a warm-up burst of mixed lengths, so that the random program mostly runs on a fitted rate, not the prior
    for i in range(8):
        prompt, params = [9 + i] * (4 + 4 * i), SamplingParams(max_tokens=6 + 3 * i, temperature=0, ignore_eos=True)
        added[engine.add_request({"prompt_token_ids": prompt}, params)] = (prompt, params)
    for kind, a, b, count in ops:
        if kind == "add":
            for i in range(count):  # a burst: enough at once to run the pool dry and preempt
                prompt = ([5, 6, 7, 8] * 10)[: max(1, a - 3 - i)] + [(a + i) % 3] * min(a, 3)
                params = SamplingParams(max_tokens=b + i, temperature=0, ignore_eos=True)
                added[engine.add_request({"prompt_token_ids": prompt}, params)] = (prompt, params)
        elif kind == "abort" and added:
            rid = list(added)[a % len(added)]
            if engine.abort_request(rid):
                aborted.add(rid)
        elif kind == "idle":
            ex.advance_to(ex.now() + a)
        else:
            for _ in range(a):
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                check(engine)
    finals.update(drain(engine, each=check))
    assert_no_leak(engine)
    event(f"learnt rate moved off the prior: {costs.prefill_tokens_per_s != prior}")
    event(f"swap preemptions: {engine.stats()['num_swap_preemptions'] > 0}, "
          f"recompute preemptions: {engine.stats()['num_recompute_preemptions'] > 0}")
    for rid, (prompt, params) in added.items():
        out = finals.get(rid)
        if rid in aborted or out is None or out.outputs[0].finish_reason != "length":
            continue
        solo = build("recompute", NoisyHistory(4, [1.0]))
        solo.add_request({"prompt_token_ids": prompt}, params, rid)
        want = drain(solo)[rid].outputs[0].token_ids
        assert out.outputs[0].token_ids == want, f"{rid} differs from a recompute-only run alone"


def test_auto_mode_follows_the_cost_model():
    def run(gbps: float):
        engine = make_engine("auto", num_blocks=40, cpu_blocks=64, max_len=128, budget=64,
                             swap_bandwidth_gbps=gbps, prefill_tokens_per_s=1000.0)
        overload(engine)
        drain(engine)
        assert_no_leak(engine)
        return engine.stats()

    fast, slow = run(1e3), run(1e-6)
    assert fast["num_swap_preemptions"] > 0 and fast["num_recompute_preemptions"] == 0
    assert slow["num_recompute_preemptions"] > 0 and slow["num_swap_preemptions"] == 0


def test_the_prefill_rate_is_learnt_only_into_the_engines_own_cost_model():
    """Auto mode learns the prefill rate from measured steps (a fit of their times), but a cost model the caller
    passed in is the caller's object: the engine uses it and leaves its numbers alone."""
    mine = PreemptionCosts(bytes_per_block=1_000_000, swap_bytes_per_s=10e9, prefill_tokens_per_s=5000.0)
    cfg = EngineConfig(num_gpu_blocks_override=40, num_cpu_blocks_override=64, block_size=4, max_num_batched_tokens=64,
                       max_num_seqs=6, max_model_len=128, preemption_mode="auto", device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=128, eos_token_ids=set(),
                       preemption_cost_model=mine)
    overload(engine)
    drain(engine)
    assert engine.scheduler.costs is mine and mine.prefill_tokens_per_s == 5000.0
    own = make_engine("auto", num_blocks=40, cpu_blocks=64, max_len=128, budget=64)
    start = own.scheduler.costs.prefill_tokens_per_s
    overload(own)
    drain(own)
    assert own.scheduler.costs.prefill_tokens_per_s != start  # its own model did learn


def test_cost_model_rule():
    costs = PreemptionCosts(bytes_per_block=1_000_000, swap_bytes_per_s=10e9, prefill_tokens_per_s=5000)
    # 64 blocks of 16 tokens: swap 2*64 MB over 10 GB/s = 12.8 ms; recompute 1024 tokens = 205 ms
    assert costs.prefers_swap(1024, 64)
    assert costs.swap_s(64) == pytest.approx(0.0128)
    slow_link = PreemptionCosts(bytes_per_block=1_000_000, swap_bytes_per_s=0.1e9, prefill_tokens_per_s=5000)
    assert not slow_link.prefers_swap(1024, 64)  # 1.28 s of copying vs 0.2 s of prefill


def test_a_request_preempted_k_times_is_protected_from_admission_too():
    """``preemption_protect_after`` also holds when admission preempts to seat a better-ranked request (the
    test above covers the allocator's victims).  Oracle: a hand-traced run.  One seat, protection after one
    preemption: ``low`` (priority 2) runs, ``h1`` (priority 0) takes its seat, ``low`` comes back; then ``h2``
    (priority 0) must wait for ``low`` to finish instead of preempting it a second time."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=1,
                       max_model_len=64, scheduling_policy="priority", preemption_protect_after=1, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64, eos_token_ids=set())
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [5] * 8}, params, request_id="low", priority=2)
    engine.step()
    engine.add_request({"prompt_token_ids": [6] * 8}, params, request_id="h1", priority=0)
    while engine.requests["low"].num_computed_tokens == 0 or engine.requests["low"].num_preemptions == 0:
        engine.step()  # h1 preempts low, runs to the end, and low starts over
    assert engine.requests["low"].status is RequestStatus.RUNNING and "h1" not in engine.requests
    engine.add_request({"prompt_token_ids": [7] * 8}, params, request_id="h2", priority=0)
    order = list(drain(engine))  # request ids in the order they finished
    assert order == ["low", "h2"] and sum(len(rec.preempted) for rec in engine.step_log) == 1


def test_a_request_preempted_k_times_is_protected():
    limit = 2
    offered: list[tuple[list[int], int]] = []

    class Recording:
        """The default victim rule, recording the preemption counts of the candidates it is offered."""

        def choose_victim(self, running):
            offered.append(([r.num_preemptions for r in running], len(engine.scheduler.running)))
            return running[-1]

    cfg = EngineConfig(num_gpu_blocks_override=20, block_size=4, max_num_batched_tokens=64, max_num_seqs=8,
                       max_model_len=64, preemption_protect_after=limit, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=64, eos_token_ids=set(),
                       preemption_policy=Recording())
    overload(engine, n=10, max_tokens=40)
    drain(engine)
    assert offered, "the workload should preempt"
    for counts, _ in offered:
        protected = [c >= limit for c in counts]
        assert all(protected) or not any(protected), f"a protected request was offered beside others: {counts}"
    assert any(len(counts) < n_running for counts, n_running in offered), "protection never kicked in"
    assert_no_leak(engine)


# -- the data path: swapped bytes come back intact ------------------------------------------------

def test_a_swap_in_waits_for_the_step_after_an_admission_swapped_a_victim_out():
    """The executor copies a step's swap-ins before its swap-outs (:mod:`minivllm.kv.kv_cache`), so a swap-in
    must not land in blocks that a victim preempted in the same admission pass is still to copy out: the
    victim's host copy would hold the other request's K/V.  Admission therefore defers such a swap-in by one
    step.  The program below (found by a random search, then shrunk) reaches it: ``r4`` (priority 0) swaps
    ``r0`` out to get in while ``r3`` waits swapped out.  Oracle: :class:`invariants.KVContents`, a brute-force
    model of every KV slot, which finds ``r0``'s context wrong when it comes back if the swap-in is not deferred."""
    cfg = EngineConfig(num_gpu_blocks_override=23, num_cpu_blocks_override=64, block_size=4, max_num_batched_tokens=64,
                       max_num_seqs=4, max_model_len=64, scheduling_policy="priority", preemption_mode="swap",
                       device="cpu")
    engine = LLMEngine(cfg, executor=KVContents(4), model_max_len=64, eos_token_ids=set())
    # (prompt tokens, max_tokens, priority, steps run after adding it)
    program = [(37, 13, 2, 1), (1, 1, 3, 4), (23, 8, 0, 4), (16, 2, 2, 2), (9, 1, 0, 0)]
    for i, (n, m, priority, steps) in enumerate(program):
        engine.add_request({"prompt_token_ids": [7 + i] * n}, SamplingParams(max_tokens=m, ignore_eos=True),
                           priority=priority, request_id=f"r{i}")
        for _ in range(steps):
            engine.step()
    r3 = engine.requests["r3"]
    while True:
        assert r3.status is RequestStatus.SWAPPED
        engine.step()
        if engine.step_log[-1].preempted:
            break
    rec = engine.step_log[-1]
    assert rec.preempted == ("r0",) and rec.swapped_out > 0  # r4's admission swapped r0 out ...
    assert rec.swapped_in == 0  # ... so r3, waiting swapped out, comes back only in the next step
    drain(engine)  # KVContents: every attended slot holds its request's own token, r0's too
    assert engine.step_log[-1].step > rec.step and not engine.executor.wrong
    assert_no_leak(engine)


def test_swap_round_trip_restores_kv_contents_and_redirects_pending_copies():
    cache = KVCache(2, num_blocks=6, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"), num_cpu_blocks=6)
    kv = KVCacheManager(BlockPool(6), 4, cpu_pool=BlockPool(6))
    params = SamplingParams(max_tokens=4)
    parent = Request("p", list(range(10)), params, 0.0)
    assert kv.allocate_slots(parent, 10)
    parent.num_computed_tokens = 10
    for layer, (k, v) in enumerate(cache.layers):
        for i, b in enumerate(parent.block_ids):
            k[b] = 100 * layer + i
            v[b] = -(100 * layer + i)
    cache.apply(kv.take_block_moves())
    child = Request("c", list(range(10)), params, 0.0)
    kv.fork(parent, child)
    assert kv.allocate_slots(child, 1)  # copy-on-write of the shared last block, pending until execute
    assert kv.swap_out(child)  # the child's last block is not written yet: its source must be swapped
    moves = kv.take_block_moves()
    assert not moves.copies, "a copy into a block that left the device is dropped"
    cache.apply(moves)
    kv.free(parent)
    # scribble over the freed device blocks, then bring the child back
    for k, v in cache.layers:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    kv.swap_in(child)
    cache.apply(kv.take_block_moves())
    for layer, (k, v) in enumerate(cache.layers):
        for i, b in enumerate(child.block_ids):
            assert torch.all(k[b] == 100 * layer + i) and torch.all(v[b] == -(100 * layer + i))
    assert child.num_computed_tokens == 9 and not child.cpu_block_ids
    kv.free(child)
    assert kv.pool.num_free == 6 and kv.cpu_pool.num_free == 6


def test_swap_out_uses_a_host_tier_that_fits_exactly_and_refuses_one_block_short():
    """All or nothing, with the boundary where it matters: a tier with exactly the blocks needed takes the victim."""
    params = SamplingParams(max_tokens=4)
    for host_blocks, fits in ((3, True), (2, False)):
        kv = KVCacheManager(BlockPool(8), 4, cpu_pool=BlockPool(host_blocks))
        req = Request("r", list(range(10)), params, 0.0)
        assert kv.allocate_slots(req, 10)
        req.num_computed_tokens = 10  # 3 blocks of 4
        assert kv.swap_out(req) is fits
        if fits:
            assert (kv.pool.num_free, kv.cpu_pool.num_free, len(req.cpu_block_ids)) == (8, 0, 3)
        else:  # nothing changed: the scheduler recomputes instead
            assert (kv.pool.num_free, kv.cpu_pool.num_free, len(req.block_ids)) == (5, 2, 3)
        kv.free(req)
        assert kv.pool.num_free == 8 and kv.cpu_pool.num_free == host_blocks


def test_no_refcount_call_outside_the_kv_package():
    """The memory manager is the one owner of blocks: nothing else increfs, decrefs or edits a block table."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "minivllm"
    offenders = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("kv/") or rel.startswith("labs/"):
            continue  # labs/ holds learner-facing stand-ins of the kv classes themselves
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.(incref|decref|free_all|copy_on_write)\(", line) or re.search(
                r"block_ids(\[[^]]*\])? *(=|\+=)[^=]|block_ids\.(append|extend|pop|clear|insert|remove)\(", line
            ):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_package_has_no_import_cycles():
    """Import every module in a fresh interpreter, each first, so a cycle would fail at import time."""
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    mods = []
    for path in (root / "minivllm").rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        if "kernels" in parts or parts[-1] == "__main__" or "bench" in parts:
            continue
        mods.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    for k in [k for k in sys.modules if k.startswith('minivllm')]: del sys.modules[k]\n    importlib.import_module(m)\n"
    subprocess.run([sys.executable, "-c", code, *sorted(mods)], check=True, cwd=root)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_room_bound_counts_cached_blocks_pinned_only_by_a_victim(kind):
    """``could_start_if_freed`` may only say "certainly not" when it is so.  A request whose prefix twin was
    cached first caches its later blocks *below the twin*: the twin's block, held by the cache alone, is then
    pinned by a block only the victim holds -- not evictable now, not in the victim's table, yet evictable once
    the victim goes.  The oracle is the pool itself: free the victim, then ask whether the blocks are there."""
    from minivllm.kv.prefix import make_prefix_cache

    def req(rid, toks):
        return Request(rid, list(toks), SamplingParams(max_tokens=4, ignore_eos=True), 0.0)

    pool = BlockPool(6)
    kv = KVCacheManager(pool, 2, make_prefix_cache(kind, pool, 2))
    b, a = req("B", [1, 2, 3, 4, 9]), req("A", [1, 2, 7])
    assert kv.allocate_slots(b, 4) and kv.allocate_slots(a, 2)
    a.num_computed_tokens = 2
    kv.cache_full_blocks(a)  # A's [1, 2] is cached first
    b.num_computed_tokens = 4
    kv.cache_full_blocks(b)  # B's twin of it loses; B's [3, 4] is cached below A's block
    kv.free(a)  # A's block: only the cache holds it, but B's [3, 4] below it pins it
    c = req("C", range(100, 107))
    assert kv.allocate_slots(c, 6) and pool.num_free == 0
    w = req("W", range(200, 205))  # 3 blocks, nothing cached
    said = kv.could_start_if_freed(w, [b], 0)
    kv.free(b)
    assert kv.can_provide(3), "freeing B does make room for W"
    assert said, "could_start_if_freed said 'certainly not'"
    assert not kv.could_start_if_freed(req("X", range(300, 309)), [], 0)  # 5 blocks with nothing freed: no


def test_an_idle_stretch_between_requests_is_not_measured_as_step_time_or_prefill_rate():
    """A server steps only while it has work, so the time from the last step of one burst to the first step of
    the next is idle, not a step.  Counted as one, a quiet minute made the next prefill look 100x slower (auto
    mode then swapped victims that were far cheaper to recompute) and the measured step, which every reject
    hint multiplies, minutes long.  The oracle is the simulated executor's own price of each step."""
    engine = make_engine("auto", num_blocks=40, cpu_blocks=64, max_len=128, budget=64, swap_bandwidth_gbps=1.0)
    ex = engine.executor
    durations = []

    def serve(prompt):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished_requests():
            start = ex.now()
            engine.step()
            durations.append(ex.now() - start)

    for k in range(3):
        serve([5 + k] * 32)
    ex.advance_to(ex.now() + 60.0)  # a quiet minute
    serve([9] * 32)
    assert engine.step_time_s <= max(durations)
    # (the prefill rate's side is test_prefill_rate_fit's quiet-minute test: one request at a time never feeds
    # the fit a trusted rate, so a bound on it here held whether or not the quiet minute was counted)


def test_auto_mode_on_a_real_model_starts_from_a_measured_prefill_rate_not_a_guess(tmp_path, monkeypatch):
    """Auto mode prices a recompute by a prefill rate it learns from prefill steps; a run in which every victim
    is swapped has none, and the starting guess (1,000 tokens/s, a CPU's order) stood for ever: 10-50x too slow
    on a GPU, so swap won choices it should lose (8x the cost per victim on a slow link).  The engine now times
    one prefill at start-up, as it times the link.  Oracles: a model slowed by a known sleep bounds the measured
    rate from above (tokens / sleep), and the probe writes only the blocks its tokens need, all free."""
    import time

    from minivllm import LLM
    from minivllm.model.runner import ModelRunner
    from tests.paged_cases import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path)
    seen = []
    real = ModelRunner.measure_prefill_rate

    def slowed(self, num_tokens):
        forward = self.model.forward

        def slow_forward(ids, positions, layers, meta):
            seen.append((ids.numel(), int(meta.slot_mapping.max())))
            time.sleep(0.05)
            return forward(ids, positions, layers, meta)

        monkeypatch.setattr(self.model, "forward", slow_forward)
        try:
            return real(self, num_tokens)
        finally:
            monkeypatch.setattr(self.model, "forward", forward)

    monkeypatch.setattr(ModelRunner, "measure_prefill_rate", slowed)
    llm = LLM(model_dir, preemption_mode="auto", max_num_batched_tokens=64, max_model_len=64, device="cpu")
    rate = llm.engine.scheduler.costs.prefill_tokens_per_s
    assert seen == [(64, 63)] * 3  # the budget's tokens: a warm-up, then the faster of two timed; blocks 0-3 only
    assert 0 < rate <= 64 / 0.05
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks  # nothing allocated, nothing left held
    given = LLM(model_dir, preemption_mode="auto", prefill_tokens_per_s=777.0, max_model_len=64, device="cpu")
    assert given.engine.scheduler.costs.prefill_tokens_per_s == 777.0
    assert len(seen) == 3  # a given rate is not measured


def test_auto_mode_starts_on_a_model_whose_context_is_shorter_than_the_prefill_probe(tmp_path):
    """The start-up prefill probe (128 tokens of the budget on a CPU) placed its tokens at positions 0..127, but a
    model trained for fewer positions has no RoPE row past its context: ``LLM(..., preemption_mode="auto")``
    crashed with an IndexError in the rotary lookup before serving anything, where recompute mode starts.  The
    probe is a prompt like any other, so it is no longer than ``max_model_len`` (which the config keeps within
    the model's positions).  Oracle: the same model starts in recompute mode, and the probe's rate is positive."""
    import transformers

    from minivllm import LLM

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=96, vocab_size=128, num_hidden_layers=2,
                                   max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(tmp_path))
    assert LLM(str(tmp_path), preemption_mode="recompute", device="cpu").engine.config.max_model_len == 64
    llm = LLM(str(tmp_path), preemption_mode="auto", device="cpu")  # budget 2,048 > 64 positions
    assert llm.engine.scheduler.costs.prefill_tokens_per_s > 0
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
