"""KV-manager edges found by a bug hunt through the public engine API, each pinned by a test that failed before.

1. A prefix cache object of the caller's (``LLMEngine(prefix_cache=...)``, ``LLM(prefix_cache=...)``) serves exactly
   as the engine's own cache does.  The seam is documented ("a prefix cache of your own go[es] in as keyword
   arguments"), and its obvious use is the hash index with a stable hash (``HashIndex(pool, block_size,
   hash_fn=sha256_block_hash)``).  But a cache holds references on *a pool*, and the engine builds its pool inside
   its constructor, after the caller built the cache: a cache bound to any pool but the engine's takes references
   on blocks the engine never handed out.  The first filled block then failed the cache's own check ("block 0 is
   free; the caller must hold it") and the step raised.  Nor was a cache of another block size refused: its block
   ids cannot line up with the engine's blocks (an 8-token cache in a 4-token engine failed later, inside a step).
2. A request swapped out in a step whose execution failed is recomputed, not swapped back in: the executor
   performs a step's block moves first and may fail right there, so its host copy may hold nothing.  The engine
   failed the batch's rows but left the victim, which is in no row, SWAPPED, and it came back attending garbage.
3. Likewise a request swapped *in* by a failed step but given no row in it (a batch builder may leave anyone out,
   and the scheduler's own step 2 did under WFQ until admission and step 2 shared one order): it stayed RUNNING on
   device blocks its copy in may never have reached, and attended garbage from its next step on (the real model
   then decoded other tokens than HF: ``test_hf_parity``).  It is now recomputed.

The oracles are independent of the code under test: every KV slot each step attends is checked against the token
written there (:class:`invariants.KVContents`), block ownership is recounted after every step
(:func:`invariants.check_both_tiers`), and for 1 the engine with its built-in hash index runs the same workload.
The swap counts in ``stats()`` are checked against the copies the executor performed: a failed step performed none,
whoever they were for (a row that failed, a request with no row, one swapped in and out again in that very step).
"""

from __future__ import annotations

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.kv import BlockPool
from minivllm.kv.prefix import HashIndex, RadixCache, sha256_block_hash
from minivllm.request import RequestStatus

from invariants import KVContents, assert_no_leak, check_both_tiers, drain, serve_arrivals  # noqa: E402  (tests/ is on sys.path)

SYSTEM = list(range(100, 123))  # 23 tokens: five full 4-token blocks and a partial one


def _engine(cache=None, **options) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=24, block_size=4, max_num_batched_tokens=32, max_num_seqs=4,
                       max_model_len=64, device="cpu", **options)
    return LLMEngine(cfg, executor=KVContents(4), prefix_cache=cache, model_max_len=64, eos_token_ids=set())


def _workload(engine: LLMEngine) -> dict:
    """Requests sharing a system prompt, arriving one after another, so later ones hit the cache."""
    finals = {}
    for i in range(4):
        engine.add_request({"prompt_token_ids": SYSTEM + [200 + i] * (i + 1)},
                           SamplingParams(max_tokens=6, ignore_eos=True), f"r{i}")
        finals.update(drain(engine))
    return finals


@pytest.mark.parametrize("make", [
    lambda pool: HashIndex(pool, 4, hash_fn=sha256_block_hash),
    lambda pool: RadixCache(pool, 4),
], ids=["hash-sha256", "radix"])
def test_a_callers_prefix_cache_object_serves_like_the_engines_own(make):
    own = _engine(enable_prefix_caching=True, prefix_cache="hash")
    expected = _workload(own)
    # The caller cannot reach the engine's pool before the engine exists: it builds the cache on a pool of its own.
    cache = make(BlockPool(24))
    engine = _engine(cache=cache)
    finals = _workload(engine)
    tokens = {rid: out.outputs[0].token_ids for rid, out in finals.items()}
    assert tokens == {rid: out.outputs[0].token_ids for rid, out in expected.items()}
    cached = [finals[f"r{i}"].num_cached_tokens for i in range(4)]
    assert cached == [expected[f"r{i}"].num_cached_tokens for i in range(4)]
    assert finals["r3"].num_cached_tokens == 20, "the later requests hit the five cached system-prompt blocks"
    assert_no_leak(engine)


def test_a_callers_prefix_cache_of_another_block_size_is_refused_when_the_engine_is_built():
    """An 8-token cache in a 4-token engine would match 8 tokens per 4-token block: refused up front, not in a step."""
    with pytest.raises(ValueError, match="block_size"):
        _engine(cache=HashIndex(BlockPool(24), 8))


def test_a_callers_prefix_cache_that_already_holds_blocks_is_refused():
    """Blocks cached on another pool name memory this engine never wrote."""
    pool = BlockPool(24)
    cache = HashIndex(pool, 4)
    blocks = pool.allocate_many(2)
    cache.insert(list(range(8)), blocks)
    with pytest.raises(ValueError, match="already"):
        _engine(cache=cache)


class FailsBeforeItsFirstSwapOut(KVContents):
    """An executor whose step fails once, before it performs any block move: the first step that swaps a request out."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.victims: list[str] = []

    def execute(self, batch):
        if batch.moves.swap_out and not self.victims:
            self.victims = [r.request_id for r in batch.preempted if r.status is RequestStatus.SWAPPED]
            raise RuntimeError("device copy failed")
        return super().execute(batch)


def _swapping_engine(executor, n: int) -> LLMEngine:
    """``n`` requests of 6 + 16 tokens on an 8-block pool (blocks of 4) with a 16-block host tier: decode growth
    swaps some out."""
    cfg = EngineConfig(num_gpu_blocks_override=8, num_cpu_blocks_override=16, block_size=4, max_num_batched_tokens=32,
                       max_num_seqs=4, max_model_len=32, preemption_mode="swap", device="cpu")
    engine = LLMEngine(cfg, executor=executor, model_max_len=32, eos_token_ids=set())
    for i in range(n):
        engine.add_request({"prompt_token_ids": [10 + i] * 6}, SamplingParams(max_tokens=16, ignore_eos=True), f"r{i}")
    return engine


def test_a_request_swapped_out_in_a_failed_step_is_recomputed_not_swapped_back_in_with_garbage():
    """Three requests outgrow an 8-block pool, so decode growth swaps one out; that step fails before any copy.
    The two in the batch end with "error"; the victim must still finish whole, attending only its own tokens."""
    executor = FailsBeforeItsFirstSwapOut(4)
    engine = _swapping_engine(executor, 3)
    finals = drain(engine)  # check_both_tiers after every step: no slot attended holds another token
    assert executor.victims, "the workload must swap a request out"
    for rid in executor.victims:
        assert finals[rid].outputs[0].finish_reason == "length"
        assert len(finals[rid].outputs[0].token_ids) == 16
    assert any(out.outputs[0].finish_reason == "error" for out in finals.values())
    check_both_tiers(engine)
    assert_no_leak(engine)


def test_the_swapped_count_in_stats_equals_a_recount_of_the_queue_through_swaps_aborts_and_a_failed_step():
    """``stats()["num_swapped"]`` is kept by the KV manager as host blocks change hands (a walk over the waiting
    queue on every served step cost 1.4 ms with 10,000 waiting).  Oracle: the requests waiting with status
    SWAPPED, recounted after every step of a run that swaps in and out, aborts swapped and running requests, and
    has one step fail before its copies (the victim is then recomputed, so it no longer counts)."""
    cfg = EngineConfig(num_gpu_blocks_override=10, num_cpu_blocks_override=24, block_size=4, max_num_batched_tokens=32,
                       max_num_seqs=6, max_model_len=36, preemption_mode="swap", device="cpu")
    engine = LLMEngine(cfg, executor=FailsBeforeItsFirstSwapOut(4), model_max_len=36, eos_token_ids=set())
    for i in range(8):
        engine.add_request({"prompt_token_ids": [10 + i] * (5 + i % 3)},
                           SamplingParams(max_tokens=20, ignore_eos=True), f"r{i}")
    seen_swapped, step, aborted = 0, 0, 0
    while engine.has_unfinished_requests():
        engine.step()
        step += 1
        waiting = list(engine.scheduler.waiting)
        recount = sum(r.status is RequestStatus.SWAPPED for r in waiting)
        assert engine.stats()["num_swapped"] == recount, f"step {step}"
        assert recount == sum(bool(r.cpu_block_ids) for r in engine.requests.values())
        seen_swapped = max(seen_swapped, recount)
        if seen_swapped >= 2 and aborted < 2:  # abort a swapped request if there is one, else the newest running
            aborted += 1
            victim = next((r for r in waiting if r.status is RequestStatus.SWAPPED), None)
            victim = victim or (engine.scheduler.running[-1] if engine.scheduler.running else None)
            if victim is not None:
                engine.abort_request(victim.request_id)
                assert engine.stats()["num_swapped"] == sum(
                    r.status is RequestStatus.SWAPPED for r in engine.scheduler.waiting)
        assert step < 500
    assert seen_swapped >= 2 and aborted == 2, "the workload must hold several requests in the host tier at once"
    assert engine.stats()["num_swapped"] == 0
    assert_no_leak(engine)


class FailsAtTheStepThatSwapsBIn(KVContents):
    """An executor whose step fails once, before any block move: the step that swaps request ``b`` back in."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.b = None  # request b, once it is added
        self.failed_rows: list[str] | None = None  # the rows of the failed step, once it failed

    def execute(self, batch):
        swapped_in = {gpu for _, gpu in batch.moves.swap_in}
        if self.failed_rows is None and swapped_in and swapped_in <= set(self.b.block_ids):
            self.failed_rows = [s.request.request_id for s in batch.seqs]
            raise RuntimeError("device copy failed")
        return super().execute(batch)


def test_a_request_swapped_in_during_a_failed_step_without_a_row_is_recomputed_not_run_on_garbage():
    """A swap-in is a copy the executor performs before the forward pass, and a failed step may not have run it.
    A request swapped in by that step's admission but given no row (here a batch builder -- a supported seam --
    holds it back for that step) does not fail with the rows, so it must not keep RUNNING on device blocks that
    never received its KV: it is recomputed, and finishes whole, attending only its own tokens
    (:class:`invariants.KVContents` checks every slot it reads), with every block back at the end."""
    held: set[str] = set()

    def holds_back(running, budget, threshold):
        """The scheduler's order, each request's whole remaining tokens, but never a request in ``held``."""
        rows = []
        for r in running:
            n = min(r.num_uncomputed_tokens, budget)
            if r.request_id not in held and n > 0:
                rows.append((r, n))
                budget -= n
        return rows

    cfg = EngineConfig(num_gpu_blocks_override=10, num_cpu_blocks_override=16, block_size=4, max_num_batched_tokens=32,
                       max_num_seqs=4, max_model_len=32, preemption_mode="swap", device="cpu")
    executor = FailsAtTheStepThatSwapsBIn(4)
    engine = LLMEngine(cfg, executor=executor, model_max_len=32, eos_token_ids=set(), batch_builder=holds_back)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [11] * 6}, params, "a")
    engine.add_request({"prompt_token_ids": [12] * 6}, params, "b")
    executor.b = b = engine.requests["b"]
    finals: dict = {}

    def step() -> None:
        finals.update({out.request_id: out for out in engine.step() if out.finished})
        check_both_tiers(engine)  # block ownership recounted, and no slot attended holds another token

    while b.status is not RequestStatus.SWAPPED:  # a and b outgrow the pool: the newer, b, is swapped out
        step()
        assert len(engine.step_log) < 100, "the workload must swap b out"
    held.add("b")  # from now on b gets no row until the failed step is over
    engine.add_request({"prompt_token_ids": [13] * 5}, SamplingParams(max_tokens=3, ignore_eos=True), "c")
    while executor.failed_rows is None:
        before = engine.stats()
        step()
        assert len(engine.step_log) < 100, "b must be swapped back in"
    assert "b" not in executor.failed_rows and executor.failed_rows, "b swapped in with no row, beside failed rows"
    held.clear()
    assert b.status is RequestStatus.PREEMPTED and not b.block_ids and not b.cpu_block_ids, \
        "b must not keep running on device blocks its KV may never have been copied into"
    assert engine.scheduler.waiting[0] is b and b.num_computed_tokens == 0 and b.num_preemptions == 2
    after = engine.stats()
    assert (after["num_preemptions"], after["num_recompute_preemptions"], after["num_swap_preemptions"]) == (
        before["num_preemptions"] + 1, before["num_recompute_preemptions"] + 1, before["num_swap_preemptions"])
    assert after["swapped_in_blocks"] == before["swapped_in_blocks"], "a swap-in that may not have run is not counted"
    # b gave way because its copy in may not have run, not because the pool ran dry (the failed rows gave their
    # blocks back): the next admission is not paused, and b, first in the queue, starts over in the next step
    assert engine.pool.num_free * 4 >= b.num_tokens
    step()
    assert b.status is RequestStatus.RUNNING, "the step after a failed swap-in paused admission as if the pool ran dry"
    while engine.has_unfinished_requests():
        step()
        assert len(engine.step_log) < 300
    assert {rid: out.outputs[0].finish_reason for rid, out in finals.items()} == {
        **{rid: "error" for rid in executor.failed_rows}, **{rid: "length" for rid in {"a", "b", "c"} - set(executor.failed_rows)}}
    assert finals["b"].outputs[0].token_ids == b.output_token_ids and len(b.output_token_ids) == 20
    assert_no_leak(engine)


class NotesSwapIns(KVContents):
    """Notes, step by step, each request whose copies in a step carries, with a row in that step or without
    (found by asking the engine it serves, ``engine``, which running requests the copies land in)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.engine = None
        self.with_row: list[str] = []
        self.left_out: list[str] = []

    def execute(self, batch):
        if batch.moves.swap_in:
            swapped_in, rows = {gpu for _, gpu in batch.moves.swap_in}, {id(s.request) for s in batch.seqs}
            for r in self.engine.scheduler.running:
                if swapped_in & set(r.block_ids):
                    (self.with_row if id(r) in rows else self.left_out).append(r.request_id)
        return super().execute(batch)


def test_under_wfq_the_schedulers_own_batch_gives_each_request_it_swaps_in_its_row():
    """The workload (found by a seeded search) on which the default step 2 left a swapped-in request out.  In step
    20 WFQ admits c5, whose provisional charge puts c past b, then swaps b2 back in, then admits c6; ranked by c's
    counter as it stood, c6 went level with c5, ahead of b2, and step 2 gave c5 and c6 the budget admission had
    counted on for b2, which got no row: its copy in ran a step early, into blocks others could have used (and in
    a step that failed it would have been left on blocks its copy never reached: the test above).  Step 2 now
    follows admission's order, so every request swapped in, b2 among them, gets its row in the step that swaps it
    in, and every request finishes whole, attending only its own tokens.  (Searched for again once a swapped-out
    request stopped preempting a victim that would be swapped out for nothing: the first workload's swap-in came
    after such a preemption.  Checked by planting the old rank, ``WFQAdmission.rank`` reading the counters only:
    b2 is left out.)  ``(step it arrives, tenant, prompt tokens, max_tokens)``."""
    work = [(0, "b", 29, 9), (0, "c", 23, 6), (3, "b", 25, 1), (4, "a", 34, 5), (6, "c", 20, 1), (8, "c", 8, 6),
            (9, "c", 13, 4)]
    cfg = EngineConfig(num_gpu_blocks_override=16, num_cpu_blocks_override=64, block_size=4, max_num_batched_tokens=16,
                       max_num_seqs=3, max_model_len=48, preemption_mode="swap", scheduling_policy="wfq", device="cpu")
    executor = NotesSwapIns(4)
    engine = LLMEngine(cfg, executor=executor, model_max_len=48, eos_token_ids=set())
    executor.engine = engine
    # block ownership recounted after every step, and no slot attended holds another token
    finals = serve_arrivals(engine, work, max_steps=300, each=check_both_tiers)
    assert executor.left_out == [], "admitted by a swap-in, then given no row"
    assert "b2" in executor.with_row, "the workload must swap b2 back in"
    assert len(finals) == len(work)
    for i, (_, tenant, _, max_tokens) in enumerate(work):
        done = finals[f"{tenant}{i}"].outputs[0]
        assert (done.finish_reason, len(done.token_ids)) == ("length", max_tokens)
    assert_no_leak(engine)


class CountsMovesPerformed(FailsBeforeItsFirstSwapOut):
    """Counts the swap copies the executor really performs: a failed step performs none."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.out = self.into = self.swapped_victims = 0

    def execute(self, batch):
        failing = bool(batch.moves.swap_out) and not self.victims
        result = super().execute(batch)  # raises on the failing step, before the counts below
        assert not failing
        self.out += len(batch.moves.swap_out)
        self.into += len(batch.moves.swap_in)
        self.swapped_victims += sum(r.status is RequestStatus.SWAPPED for r in batch.preempted)
        return result


def test_swap_block_counts_in_stats_leave_out_the_copies_of_a_failed_step():
    """Kills: undoing a swap-out whose step failed (the victim is recomputed instead) without taking its blocks
    back out of ``swapped_out_blocks``.  That count, and ``swapped_out_bytes`` made from it, is what lab 5 weighs
    swap against recompute with; it must say what crossed to the host, and a failed step copied nothing.
    Oracle: the swap moves of the steps the executor performed, counted by the executor."""
    executor = CountsMovesPerformed(4)
    engine = _swapping_engine(executor, 5)
    drain(engine)
    stats = engine.stats()
    assert executor.victims and executor.out > 0, "a step must fail on its swap-out and a later one swap out"
    assert stats["swapped_out_blocks"] == executor.out
    assert stats["swapped_in_blocks"] == executor.into
    assert stats["swapped_out_bytes"] == executor.out * engine.bytes_per_block
    # and the preemption counts: the failed step's victim was recomputed, not swapped (a swap preemption counted
    # for it as well would count one preemption twice)
    assert stats["num_swap_preemptions"] == executor.swapped_victims > 0
    assert stats["num_swap_preemptions"] + stats["num_recompute_preemptions"] == stats["num_preemptions"]
    assert_no_leak(engine)


class FailsWhenASwapInIsSwappedOutAgain(KVContents):
    """Counts the swap copies the executor performs, and fails once, before any copy: in the first step that
    swaps a request in and out again."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.into = self.out = 0
        self.back_out: list[str] = []  # the requests of the failed step swapped in and out again

    def execute(self, batch):
        if not self.back_out:
            self.back_out = [r.request_id for r in batch.swapped_in if r in batch.preempted]
            if self.back_out:
                raise RuntimeError("device copy failed")
        result = super().execute(batch)
        self.into += len(batch.moves.swap_in)
        self.out += len(batch.moves.swap_out)
        return result


def test_a_request_swapped_in_and_out_again_by_a_failed_step_leaves_neither_copy_counted():
    """Kills: taking a failed step's copies in out of ``swapped_in_blocks`` only for the requests still running
    without a row.  A request that step swapped in and then, short of blocks, swapped out again is SWAPPED when the
    step fails: its copy out is dropped (it is recomputed), and its copy in, which may never have run either,
    stayed counted.  The engine's own admission reserves every block a step will claim, so the squeeze comes from
    outside: in the step that swaps b back in, every free block is held elsewhere while step 3 allocates, and b,
    the newest, gives way again.  Oracle: the swap moves of the steps the executor performed, counted by it."""
    cfg = EngineConfig(num_gpu_blocks_override=10, num_cpu_blocks_override=16, block_size=4, max_num_batched_tokens=32,
                       max_num_seqs=4, max_model_len=32, preemption_mode="swap", device="cpu")
    executor = FailsWhenASwapInIsSwappedOutAgain(4)
    engine = LLMEngine(cfg, executor=executor, model_max_len=32, eos_token_ids=set())
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request({"prompt_token_ids": [11] * 6}, params, "a")
    engine.add_request({"prompt_token_ids": [12] * 6}, params, "b")
    b, pool, allocate = engine.requests["b"], engine.kv.pool, engine.scheduler.allocate

    def allocate_with_no_block_free(batch):
        if b not in batch.swapped_in:
            return allocate(batch)
        held = pool.allocate_many(pool.num_free)
        try:
            return allocate(batch)
        finally:
            pool.free_all(held)

    engine.scheduler.allocate = allocate_with_no_block_free
    finals = drain(engine)  # check_both_tiers after every step: no slot attended holds another token
    assert executor.back_out == ["b"], "the workload must swap b in and out again in one step"
    stats = engine.stats()
    assert stats["swapped_in_blocks"] == executor.into  # (b, recomputed since, is never swapped in again: 0)
    assert stats["swapped_out_blocks"] == executor.out > 0  # b's first swap out, the one step 3 of a step that ran
    assert finals["b"].outputs[0].finish_reason == "length" and len(finals["b"].outputs[0].token_ids) == 20
    assert_no_leak(engine)


class FailsAtItsFirstSwapIn(KVContents):
    """Counts the swap copies the executor performs, and fails once, before any copy: in the first step that
    swaps a request in."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.into = self.out = 0
        self.rows_of_failed: list[str] = []  # the requests swapped in by the failed step that had a row in it

    def execute(self, batch):
        if batch.moves.swap_in and not self.rows_of_failed:
            rows = {id(s.request) for s in batch.seqs}
            self.rows_of_failed = [r.request_id for r in batch.swapped_in if id(r) in rows]
            raise RuntimeError("device copy failed")
        result = super().execute(batch)
        self.into += len(batch.moves.swap_in)
        self.out += len(batch.moves.swap_out)
        return result


def test_the_copy_in_of_a_failed_step_is_not_counted_for_a_request_with_a_row_in_it_either():
    """Kills: leaving a failed step's copy in counted when its request had a row (the row failed with the step).
    A failed step copied nothing, whoever its copies were for.  Oracle: the swap moves of the steps the executor
    performed, counted by it."""
    executor = FailsAtItsFirstSwapIn(4)
    engine = _swapping_engine(executor, 3)
    drain(engine)
    assert executor.rows_of_failed, "a step must fail that swaps a request in and gives it a row"
    stats = engine.stats()
    assert stats["swapped_in_blocks"] == executor.into
    assert stats["swapped_out_blocks"] == executor.out > 0
    assert_no_leak(engine)
