"""Tests from a hand mutation pass over the engine core and its many-caller front ends (``LLMEngine``'s request
table, ``abort_request`` and ``close``; ``LLM``'s router; the server's ``AsyncEngine``; ``kv_cache``;
``startup``): each pins a behaviour that a planted bug changed while every existing test still passed.

Everything runs on the simulated executor (no model load).  The oracles are hand-traced step sequences, the
request's own contract (a finished output for every request, in order), and a recount of the per-request
containers and KV blocks the engine holds (as :mod:`tests.test_request_state_leaks` counts them).  Threads and
the event loop are synchronised with events and the engine loop's own command queue, never with sleeps.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from minivllm import LLM
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor
from tests.invariants import steps
from tests.test_request_state_leaks import _per_request_state

PROMPT = {"prompt_token_ids": [11, 12, 13]}


def _engine(executor=None, blocks: int = 64) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=4, max_model_len=96, max_num_seqs=8, device="cpu")
    return LLMEngine(cfg, executor=executor or SimulatedExecutor(), tokenizer=None, model_max_len=96,
                     eos_token_ids=set())


def _held(engine: LLMEngine) -> dict[str, int]:
    """What the engine still keeps per request, and the blocks in use (only the non-zero entries)."""
    return {k: v for k, v in _per_request_state(engine).items() if v}


# -- the engine's request table: abort and close ------------------------------------------------------------------


def test_an_abort_from_inside_a_step_says_whether_the_request_is_in_the_engine():
    """Kills: ``abort_request`` called from inside a step (a finalizer or a callback: it is deferred to the
    step's end) answering True for every id.  Outside a step an unknown id is False; the deferred path must
    give the same answer, or a server counts aborts of requests that were never there (its ``num_aborted`` and
    abort metrics come from this value).  Oracle: the ids the test added."""
    answers = {}

    class AbortsInside(SimulatedExecutor):
        def execute(self, batch):
            if not answers:
                answers["unknown"] = engine.abort_request("nobody")
                answers["known"] = engine.abort_request("r1")
            return super().execute(batch)

    engine = _engine(AbortsInside())
    engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), "r1")
    engine.step()
    assert answers == {"unknown": False, "known": True}
    assert engine.abort_request("nobody") is False  # the same answer outside a step
    assert not engine.has_unfinished_requests() and not _held(engine)  # r1 ended when the step did


def test_a_closed_engine_has_no_unfinished_work_even_with_a_sample_abort_pending():
    """Kills: ``close()`` aborting the request table's ids only (each sample), not the ``n > 1`` groups.  Each
    sample's abort then queues it for its group's next output, which a closed engine never makes:
    ``has_unfinished_requests()`` answers True for ever, so any loop that steps "while there is work" (a
    stream's pump, the server's loop) calls ``step()`` on the closed engine and gets "engine is closed"
    instead of ending.  (Dropping the explicit clear of that queue in ``close`` is equivalent: aborting a
    group already drops its queued samples.)  Oracle: after ``close`` nothing is in flight."""
    engine = _engine()
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=8, ignore_eos=True), "g")
    engine.step()
    assert engine.abort_request("g#1")  # reported with the group's next output ...
    engine.close()  # ... which never comes
    assert not engine.has_unfinished_requests()
    assert not _held(engine)


def test_close_forgets_every_n_group_and_frees_every_block():
    """Kills: ``close()`` aborting the request table's ids only (each sample of an ``n > 1`` group) and not the
    groups.  Each sample then takes the one-sample abort path, which keeps its group open to report it later,
    so the closed engine keeps every group and its output state for ever.  Oracle: a recount of everything the
    engine keeps per request, and of the blocks in use -- all zero once closed."""
    engine = _engine()
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=8, ignore_eos=True), "g")
    engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), "solo")
    engine.step()
    engine.close()
    assert not _held(engine)


def test_a_step_on_a_closed_engine_raises_even_with_nothing_in_flight():
    """Kills: ``step()`` not checking that the engine is open.  ``LLM.close`` promises that later calls raise;
    a closed engine that quietly returns ``[]`` from ``step`` lets a driver loop spin on it instead of
    stopping."""
    engine = _engine()
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()


def test_automatic_ids_skip_the_ids_of_n_groups_in_flight():
    """Kills: the automatic id loop skipping ids in the request table only.  A group's parent id is not in the
    table (its samples ``g#0``, ``g#1`` are), so a caller who named a group ``req-0`` made the next request
    *without* an id fail as a "duplicate" of an id the caller never chose.  Oracle: the ids are distinct and
    every add succeeds."""
    engine = _engine()
    params = SamplingParams(n=2, max_tokens=2, ignore_eos=True)
    taken = [engine.add_request(PROMPT, params, f"req-{i}") for i in range(3)]
    auto = [engine.add_request(PROMPT, SamplingParams(max_tokens=2, ignore_eos=True)) for _ in range(3)]
    assert len(set(taken + auto)) == 6 and not set(auto) & set(taken)


def test_a_group_whose_samples_were_all_aborted_one_by_one_still_reports_its_end():
    """Kills: ``has_unfinished_requests()`` looking at the scheduler only.  Aborting each sample of a group by
    its own id (``g#0``, then ``g#1``) leaves the scheduler empty, but the group's final output -- both samples
    ``"abort"`` -- is still due; a caller that steps while there is work (``LLM.generate``, a stream, the
    server's loop) would stop without it and report the request lost.  Hand trace: one step after the aborts
    reports ``g`` finished with two aborted completions."""
    engine = _engine()
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=8, ignore_eos=True), "g")
    engine.step()
    assert engine.abort_request("g#0") and engine.abort_request("g#1")
    assert engine.has_unfinished_requests()
    [out] = engine.step()
    assert out.request_id == "g" and out.finished
    assert [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert not engine.has_unfinished_requests() and not _held(engine)


def test_aborting_a_group_after_one_of_its_samples_reports_nothing_and_the_engine_steps_on():
    """Kills: a group abort that leaves the group's already-aborted samples in the report queue.  The caller
    gave up on the whole group, so nothing more may be reported for it; a sample left queued was reported at
    the next step although its request was gone from the table, and that step failed (the engine could no
    longer find whose output it was) -- for every request in the batch, not just the group's.  Hand trace:
    abort ``g#1``, then ``g``; the next step carries ``other``'s output only."""
    engine = _engine()
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=8, ignore_eos=True), "g")
    engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True), "other")
    engine.step()
    assert engine.abort_request("g#1")
    assert engine.abort_request("g")
    outs = engine.step()
    assert [o.request_id for o in outs] == ["other"]
    for _ in steps(engine):
        pass
    assert not _held(engine)


def test_the_id_of_an_n_group_in_flight_is_refused_as_a_duplicate():
    """Kills: the duplicate-id check looking at the request table only.  A group's parent id is not in the
    table (its samples are), so a second request with the id of a running ``n > 1`` group was accepted, and two
    callers' outputs then went out under one id.  Oracle: ``add_request``'s contract -- an id still in the
    engine is a ``ValueError`` -- and the first group finishing untouched."""
    engine = _engine()
    engine.add_request(PROMPT, SamplingParams(n=2, max_tokens=3, ignore_eos=True), "g")
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=3, ignore_eos=True), "g")
    finals = []
    for outs in steps(engine):
        finals += [o for o in outs if o.finished]
    [out] = finals
    assert out.request_id == "g" and [len(c.token_ids) for c in out.outputs] == [3, 3]


# -- LLM's router: one engine, many consumers ---------------------------------------------------------------------


def _llm(**kw) -> LLM:
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96, **kw)
    llm.engine.eos_token_ids = set()
    return llm


def test_no_other_consumer_can_step_between_an_add_and_its_mailbox_opening():
    """Kills: the router opening a request's mailbox after releasing the step lock.  Another consumer that
    takes the lock in that gap steps the engine and delivers the new request's first (here: only) output to no
    one, and ``generate`` then fails with "aborted by another caller".  Deterministic stand-in for the other
    thread: at the moment the mailbox is opened, if the step lock is free, a consumer takes it right then and
    pumps (``tests/test_llm_callers.py`` races a real thread, which a 0.3 s join does not always lose).
    Oracle: the request's single token arrives."""
    llm = _llm()
    router = llm._router
    open_box = router.open

    def open_after_any_consumer_that_can(rid):
        if router._step_lock.acquire(blocking=False):  # free: another consumer could step now, so one does
            router._step_lock.release()
            router.pump([])
        open_box(rid)

    router.open = open_after_any_consumer_that_can
    [out] = llm.generate(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == 1


def test_generate_interrupted_mid_run_aborts_its_unfinished_requests():
    """Kills: ``generate`` re-raising an error (Ctrl-C, here) from its stepping loop without aborting its
    requests.  Nobody will read them any more, yet they would keep their seats and KV blocks and be stepped
    by the next caller for nobody.  The interrupt is raised, deterministically, at the second time the
    caller reads its mailbox.  Oracle: a recount of what the engine holds -- nothing."""
    llm = _llm()
    take, calls = llm._router.take, []

    def take_then_interrupt(rid):
        calls.append(rid)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return take(rid)

    llm._router.take = take_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT, PROMPT], SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not _held(llm.engine)


def test_finished_generate_and_stream_calls_leave_no_mailbox_behind():
    """Kills: ``generate`` not closing its requests' mailboxes when it returns.  The router keeps one mailbox
    per request id; one left behind per finished request grows with every call for the life of the ``LLM``
    (a notebook, a batch job calling ``generate`` in a loop).  Oracle: the router's mailbox table is empty
    after every caller is done, whichever way it ended."""
    llm = _llm()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for _ in range(3):
        llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    outs = list(llm.stream(PROMPT, params))
    assert outs[-1].finished
    early = llm.stream(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True))
    next(early)
    early.close()
    assert llm._router._boxes == {}
    assert not _held(llm.engine)


def test_generate_returns_every_token_even_for_a_delta_request():
    """Kills: ``generate`` passing each request's ``output_kind`` through unchanged.  It returns only the final
    output, and a ``"delta"`` request's final output carries only its last step's token; a caller who reused
    streaming params for ``generate`` got one token of six.  Oracle: ``max_tokens`` with ``ignore_eos``."""
    llm = _llm()
    [out] = llm.generate(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True, output_kind="delta"), use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == 6


def test_a_stream_interrupted_while_reading_aborts_its_request_at_once():
    """Kills: a stream's ``__next__`` re-raising an error (Ctrl-C while a step runs, here) without closing
    itself.  The caller has stopped reading, but while it still holds the stream object its request kept its
    seat and blocks (and other callers' steps kept decoding it for nobody) until the object was freed.
    Oracle: the engine holds nothing right after the interrupt, with the stream still referenced, and the
    stream is over."""
    llm = _llm()
    stream = llm.stream(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, output_kind="delta"))
    next(stream)
    take = llm._router.take

    def interrupted(rid):
        llm._router.take = take
        raise KeyboardInterrupt

    llm._router.take = interrupted
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    assert not llm.engine.has_unfinished_requests() and not _held(llm.engine)
    assert list(stream) == []


# -- the server's AsyncEngine: one loop thread, a queue per request --------------------------------------------------

GUARD_S = 10  # only a hang guard: every wait below ends on an event the code under test must cause


def test_a_stream_waiting_when_the_engine_loop_dies_gets_engine_dead():
    """Kills: the loop thread's failure handler not ending the streams in flight.  A client whose request was
    running when a bug killed the loop waits on its queue, and nothing else will ever put anything there: the
    request (and the HTTP connection) hangs for ever instead of a 503.  The step fails on the loop's second
    step, after the stream got its first output.  Oracle: the stream's next read raises ``EngineDead``."""
    from minivllm.server.async_engine import AsyncEngine, EngineDead

    engine = _engine()
    step = engine.step
    steps = []

    def second_step_fails():
        steps.append(1)
        if len(steps) == 2:
            raise RuntimeError("a bug inside engine.step")
        return step()

    engine.step = second_step_fails

    async def main() -> None:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            stream = await runner.add_request(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True,
                                                                     output_kind="delta"), "a")
            first = await asyncio.wait_for(stream.get(), GUARD_S)
            assert not first.finished
            with pytest.raises(EngineDead):
                await asyncio.wait_for(stream.get(), GUARD_S)
            assert runner.dead is not None and not runner.is_running
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())


def test_an_add_that_races_the_start_of_shutdown_is_refused_not_served():
    """Kills: the loop thread's add command not checking ``shutting_down`` itself.  The event loop checks the
    flag before posting the add, but a shutdown can begin between that check and the post: its abort-all then
    runs *before* the add, which must refuse the request (``EngineShutdown``, a 503), or it is admitted after
    everything in flight was aborted and served to the end during the shutdown, or left with no answer when
    the loop stops.  The race is made deterministic by starting the shutdown inside the post of the add.
    Oracle: ``EngineShutdown``, and the engine never saw the request."""
    from minivllm.server.async_engine import AsyncEngine, EngineShutdown

    engine = _engine()

    async def main() -> None:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        post = runner._post

        def shutdown_begins_first(cmd):
            runner._post = post
            runner.begin_shutdown()  # another thread (a signal handler) gets in just before the add is posted
            post(cmd)

        runner._post = shutdown_begins_first
        try:
            with pytest.raises(EngineShutdown):
                params = SamplingParams(max_tokens=8, ignore_eos=True)
                await asyncio.wait_for(runner.add_request(PROMPT, params, "late"), GUARD_S)
            assert engine.scheduler.stats.num_steps == 0 and "late" not in engine.requests
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())


def test_an_abort_of_a_request_that_already_ended_is_not_counted():
    """Kills: the loop thread counting every abort command as an abort.  A client that disconnects just after
    its request finished (its last output still unread), or an abort of an id never added, finds nothing to
    abort; counting it anyway inflates ``num_aborted``, the abort log and the ``abort`` finish-reason metric
    with requests that in fact completed.  Commands run in order, so a ``stats()`` read after the aborts
    sees them done.  Oracle: exactly the one request still in the engine when aborted is counted."""
    from minivllm.server.async_engine import AsyncEngine

    engine = _engine()

    async def main() -> None:
        runner = AsyncEngine(engine, idle_poll_s=0.01)
        runner.start()
        try:
            done = await runner.add_request(PROMPT, SamplingParams(max_tokens=1, ignore_eos=True), "done")
            assert (await asyncio.wait_for(done.get(), GUARD_S)).finished
            gate = threading.Event()
            runner._post(gate.wait)  # holds the loop thread, so what follows runs in the order posted
            adding = asyncio.ensure_future(runner.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True),
                                                              "running"))
            await asyncio.sleep(0)  # the task runs up to its wait: the add is posted
            for rid in ("done", "never-added", "running"):
                runner.abort(rid)
            gate.set()
            await asyncio.wait_for(adding, GUARD_S)
            await asyncio.wait_for(runner.stats(), GUARD_S)  # runs after the three aborts
            assert runner.num_aborted == 1 and list(runner.aborted_ids) == ["running"]
        finally:
            await asyncio.to_thread(runner.shutdown)

    asyncio.run(main())


def test_stats_of_an_async_engine_not_started_yet_are_read_directly():
    """Kills: ``AsyncEngine.stats()`` always posting its read to the loop thread.  Before ``start()`` there is
    no loop thread to run it, so ``/metrics`` (or a lab reading the stats of a server it is about to start)
    waited for ever.  Oracle: the engine's own ``stats()``."""
    from minivllm.server.async_engine import AsyncEngine

    engine = _engine()
    engine.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), "queued")

    async def main() -> dict:
        return await asyncio.wait_for(AsyncEngine(engine).stats(), GUARD_S)

    stats = asyncio.run(main())
    assert stats["num_waiting"] == 1 and stats["num_blocks"] == 64


# -- the KV cache tensors: moving bytes in the promised order -------------------------------------------------------


def _kv_cache():
    import torch

    from minivllm.kv.kv_cache import KVCache

    cache = KVCache(2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"), num_cpu_blocks=2)
    for layer, (k, v) in enumerate(cache.layers):  # device block b of layer l holds K = 10l + b, V = -(10l + b)
        for b in range(4):
            k[b], v[b] = 10 * layer + b, -(10 * layer + b)
    return cache


def test_a_host_block_freed_by_a_swap_in_and_reused_by_a_swap_out_keeps_both_contents():
    """Kills: swap-outs copied before swap-ins.  ``BlockMoves`` promises swap-ins first because the manager may
    hand a host block that a swap-in frees to a swap-out of the same step; copied the other way round, the
    victim's K/V overwrite the host block before the returning request's K/V are read from it, and the
    returning request attends to the victim's keys.  Hand trace: host 0 holds 99/-99; swap it into device 1
    while device 2 swaps out into host 0."""
    from minivllm.kv.kv_cache_manager import BlockMoves

    cache = _kv_cache()
    for ck, cv in cache.cpu_layers:
        ck[0], cv[0] = 99, -99
    cache.apply(BlockMoves(swap_in=[(0, 1)], swap_out=[(2, 0)]))
    for layer, ((k, v), (ck, cv)) in enumerate(zip(cache.layers, cache.cpu_layers)):
        assert bool((k[1] == 99).all() and (v[1] == -99).all()), f"layer {layer}: the swap-in read the victim's K/V"
        assert bool((ck[0] == 10 * layer + 2).all() and (cv[0] == -(10 * layer + 2)).all())


def test_a_copy_on_write_alone_copies_k_and_v_in_every_layer():
    """Kills: a copy-on-write that copies K but not V, and ``apply`` returning early when a step has copies but
    no swaps (the common case: a forked ``n > 1`` sample writing into its shared last block).  The copy must
    make the destination a full duplicate of the source, or the sample attends to stale values.  Hand trace:
    device block 0 copied into block 3."""
    from minivllm.kv.kv_cache_manager import BlockMoves

    cache = _kv_cache()
    cache.apply(BlockMoves(copies=[(0, 3)]))
    for layer, (k, v) in enumerate(cache.layers):
        assert bool((k[3] == 10 * layer).all() and (v[3] == -(10 * layer)).all()), f"layer {layer}"
        assert bool((k[1] == 10 * layer + 1).all())  # nothing else moved


def test_kv_sizing_from_hand_counts():
    """Kills: a block's bytes counted for K only (the pool would then be sized for twice the blocks the memory
    holds, and the first long batch runs the device out of memory); a budget smaller than one block rounded up
    to 1 block (allocated past the budget; the engine refuses the 0-block pool at build, naming block_size --
    tests/test_config_hunt.py); and the host tier ignoring
    ``num_cpu_blocks_override``.  Oracle: hand counts -- K and V, 2 layers, 16-token blocks, 3 KV heads of
    64 dims in bf16 is 2 * 2 * 16 * 3 * 64 * 2 bytes."""
    import torch

    from minivllm.kv.kv_cache import bytes_per_block, num_host_blocks, num_kv_blocks

    per_block = bytes_per_block(2, 16, 3, 64, torch.bfloat16)
    assert per_block == 2 * 2 * 16 * 3 * 64 * 2
    assert num_kv_blocks(10 * per_block + 1, per_block, torch.device("cpu"), 0.9) == 10
    assert num_kv_blocks(per_block - 1, per_block, torch.device("cpu"), 0.9) == 0
    assert num_kv_blocks(per_block, per_block, torch.device("cpu"), 0.9) == 1
    swap = EngineConfig(preemption_mode="swap", num_cpu_blocks_override=7, device="cpu")
    assert num_host_blocks(swap, per_block) == 7
    assert num_host_blocks(EngineConfig(preemption_mode="swap", swap_space=1, device="cpu"), 1 << 20) == 1024
    assert num_host_blocks(EngineConfig(preemption_mode="recompute", num_cpu_blocks_override=7, device="cpu"), 1) == 0


def test_swap_bandwidth_of_a_cache_without_a_host_tier_is_infinite_not_an_error():
    """Kills: ``measure_swap_bandwidth`` sizing its probe by the device pool alone.  With no host tier there is
    nothing to swap into: the probe must report "free" (``inf``, so auto mode never prefers swapping), not
    fail indexing a host tier that does not exist."""
    import math

    import torch

    from minivllm.kv.kv_cache import KVCache

    cache = KVCache(1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"), num_cpu_blocks=0)
    assert math.isinf(cache.measure_swap_bandwidth())


# -- startup: freezing the start-up heap ----------------------------------------------------------------------------


def test_freezing_collects_dead_cycles_first_and_a_benchmark_block_unfreezes_after():
    """Kills: ``freeze_startup_heap`` freezing without collecting first (garbage cycles alive at the freeze --
    the loader's temporaries -- are then never freed: the permanent generation is never collected), and
    ``frozen_heap`` not unfreezing when its block ends (a benchmark run inside a notebook or the test process
    left everything made so far uncollectable).  Oracle: a weak reference to a dropped cycle, and the
    collector's own freeze count."""
    import gc
    import weakref

    from minivllm.engine.startup import frozen_heap

    class Node:
        pass

    gc.unfreeze()  # start from a heap nobody froze (an in-process `serve` in this worker would have frozen it)
    was_enabled = gc.isenabled()
    gc.disable()  # the dropped cycle must still be there when the freeze starts
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a
        dead = weakref.ref(a)
        del a, b
        assert dead() is not None
        with frozen_heap() as frozen:
            assert frozen > 0 and gc.get_freeze_count() > 0
            assert dead() is None, "a dead cycle was frozen instead of collected"
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()
