"""Engine invariants the test files share: block conservation on both tiers, queues, no leaks.

The oracle is a brute-force recount, independent of the engine's own bookkeeping: every block's
refcount must equal the number of block tables (and the prefix cache) that hold it.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterator

from minivllm import EngineConfig, LLMEngine
from minivllm.labs import workloads
from minivllm.metrics.scrape import metric_samples, metric_value  # noqa: F401  (re-exported: older imports)
from minivllm.request import RequestStatus
from minivllm.sim.executor import SimulatedExecutor


class KVContents(SimulatedExecutor):
    """The simulated executor, plus a brute-force model of what every KV slot holds: the token written there.

    Why: block accounting can be perfect while the bytes are wrong -- a swap-in landing in a block whose old
    contents a victim's swap-out has not copied yet, a copy-on-write source freed first, a cached block that
    another request overwrote.  A real model would then attend to the wrong keys and its outputs would drift,
    but only a model run shows that.  Here each step applies the batch's block moves in the order
    :mod:`minivllm.kv.kv_cache` promises the executor keeps (swap-ins, then swap-outs, then copies), writes
    every scheduled token into its slot, and then requires each scheduled sequence to find its own token at
    every position it attends (``0 .. start + num_tokens``), on its own block table
    (:func:`check_both_tiers` reads what it found).
    """

    def __init__(self, block_size: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.block_size = block_size
        self.device: dict[tuple[int, int], int] = {}  # (block, slot) -> token id
        self.host: dict[tuple[int, int], int] = {}
        # What went wrong, kept rather than raised: the engine turns an executor's exception into "error"
        # outputs and keeps serving, so a raise here would read as a request failing, not as a test failing.
        self.wrong: list[str] = []

    def _copy(self, src: dict, s: int, dst: dict, d: int) -> None:
        for slot in range(self.block_size):
            if (s, slot) in src:
                dst[(d, slot)] = src[(s, slot)]
            else:
                dst.pop((d, slot), None)

    def execute(self, batch):
        moves = batch.moves
        for cpu, gpu in moves.swap_in:
            self._copy(self.host, cpu, self.device, gpu)
        for gpu, cpu in moves.swap_out:
            self._copy(self.device, gpu, self.host, cpu)
        for src, dst in moves.copies:
            self._copy(self.device, src, self.device, dst)
        bs = self.block_size
        # Every write of the step first, then every check: a slot another sequence wrote must hold this one's token.
        seqs = [(s.request, s.request.block_ids, s.request.all_token_ids, s.start + s.num_tokens) for s in batch.seqs]
        for (req, table, tokens, end), s in zip(seqs, batch.seqs):
            for p in range(s.start, end):
                self.device[(table[p // bs], p % bs)] = tokens[p]
        for req, table, tokens, end in seqs:
            wrong = [p for p in range(end) if self.device.get((table[p // bs], p % bs)) != tokens[p]]
            if wrong:
                self.wrong.append(f"{req.request_id} attends wrong KV at positions "
                                  f"{wrong[:8]} (blocks {[table[p // bs] for p in wrong[:8]]})")
        return super().execute(batch)


def block_tokens(*blocks: int, extra=(), block_size: int = 4) -> list[int]:
    """Token ids made of whole blocks -- block ``k`` is ``[k] * block_size`` -- then ``extra``: prompts whose
    block boundaries and shared prefixes a prefix-cache test can read off its arguments."""
    return [t for b in blocks for t in [b] * block_size] + list(extra)


def cached_then_released(cache, pool, tokens, ns=(), block_size: int = 4) -> list[int]:
    """Cache ``tokens`` under fresh blocks the way a finished request that matched nothing leaves them: inserted,
    then released, so only the cache holds them (evictable).  Returns the blocks."""
    blocks = pool.allocate_many(len(tokens) // block_size)
    cache.insert(tokens, blocks, ns)
    pool.free_all(blocks)
    return blocks


def tiny_engine(*, num_blocks: int = 24, block_size: int = 4, budget: int = 32, max_seqs: int = 6, max_len: int = 64,
                prefix: str | None = None, chunked: bool = True, **options) -> LLMEngine:
    """A real engine on the simulated executor, small enough (a few dozen 4-token blocks, a 32-token budget)
    that a random workload runs the pool dry, chunks prompts and preempts within a few steps; its executor
    checks every KV slot a step attends (:class:`KVContents`).
    ``prefix``: "radix" or "hash" turns prefix caching on; ``options`` go to :class:`EngineConfig`."""
    cfg = EngineConfig(enable_prefix_caching=prefix is not None, prefix_cache=prefix or "radix",
                       num_gpu_blocks_override=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs, max_model_len=max_len, enable_chunked_prefill=chunked, device="cpu",
                       **options)
    return LLMEngine(cfg, executor=KVContents(block_size), model_max_len=max_len, eos_token_ids=set())


def check_both_tiers(engine: LLMEngine) -> None:
    """Brute-force recount: every block's refcount equals its holders, on the device and the host tier."""
    sched, kv = engine.scheduler, engine.kv
    if isinstance(engine.executor, KVContents):
        assert not engine.executor.wrong, engine.executor.wrong[0]
    live = list(sched.running) + list(sched.waiting)
    assert len({id(r) for r in live}) == len(live), "a request sits in two queues"
    holders = Counter(b for r in live for b in r.block_ids)
    cache = engine.prefix_cache
    if cache is not None:
        holders.update(b for b in range(kv.pool.num_blocks) if cache.is_cached(b))
    for b in range(kv.pool.num_blocks):
        assert kv.pool.refcount(b) == holders.get(b, 0), f"device block {b}"
    assert kv.pool.num_free == sum(1 for b in range(kv.pool.num_blocks) if not holders.get(b))
    assert len(set(kv.pool._free)) == len(kv.pool._free), "a block is on the free list twice"
    if kv.cpu_pool is not None:
        host = Counter(b for r in live for b in r.cpu_block_ids)
        assert all(n == 1 for n in host.values()), "a host block is held twice"
        for b in range(kv.cpu_pool.num_blocks):
            assert kv.cpu_pool.refcount(b) == host.get(b, 0), f"host block {b}"
    for r in live:
        assert r.request_id in engine.requests
        if r.status is RequestStatus.SWAPPED:
            assert r in sched.waiting and not r.block_ids and r.cpu_block_ids
            assert len(r.cpu_block_ids) == -(-r.num_computed_tokens // engine.config.block_size)
        else:
            assert not r.cpu_block_ids
        if r in sched.running:
            assert r.status is RequestStatus.RUNNING
            assert len(r.block_ids) >= -(-r.num_computed_tokens // engine.config.block_size)


def assert_no_leak(engine: LLMEngine) -> None:
    if engine.prefix_cache is not None:
        engine.prefix_cache.reset()
    assert engine.pool.num_free == engine.pool.num_blocks
    if engine.kv.cpu_pool is not None:
        assert engine.kv.cpu_pool.num_free == engine.kv.cpu_pool.num_blocks


def steps(engine: LLMEngine, max_steps: int = 5000, stalls_ok: bool = False) -> Iterator[list]:
    """Step ``engine`` while it has unfinished requests, yielding each ``engine.step()``'s outputs.

    Why not ``while engine.has_unfinished_requests()``: a bug that keeps one request from ever finishing (a
    length check that never fires, a starved or deadlocked queue) spins such a loop until pytest-timeout kills
    it 900 s later, with nothing named; here it is an ``AssertionError`` after ``max_steps`` steps.  The
    default is far above any workload in these tests; pass more for one that needs it.  The engine's own stall
    watchdog (``llm_engine.STALL_STEPS``) ends a deadlock sooner, failing the stuck requests; a working
    scheduler never sets it off, so that too fails here unless ``stalls_ok``.
    """
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        yield engine.step()
    _assert_drained(engine, max_steps, stalls_ok)


def _assert_drained(engine: LLMEngine, max_steps: int, stalls_ok: bool) -> None:
    if engine.has_unfinished_requests():
        raise AssertionError(f"engine did not drain in {max_steps} steps "
                             "(a request that never finishes, starvation or deadlock)")
    if not stalls_ok and getattr(engine, "num_stalls", 0):
        raise AssertionError(f"the engine's stall watchdog fired {engine.num_stalls} time(s): requests stuck "
                             "with nothing scheduled were failed (a deadlock)")


def drain(engine: LLMEngine, max_steps: int = 5000, each: Callable[[LLMEngine], object] | None = None,
          stalls_ok: bool = False) -> dict:
    """Step ``engine`` until every request has finished; ``{request_id: final output}``.

    After every step both tiers are recounted (:func:`check_both_tiers`) and ``each(engine)`` runs, if
    given.  Fails when requests are left after ``max_steps`` (a policy that starves one, or a deadlock), or
    when the engine's stall watchdog failed any (unless ``stalls_ok``; see :func:`steps`).
    """
    def check(e: LLMEngine) -> None:
        check_both_tiers(e)
        if each is not None:
            each(e)

    finals = workloads.drain(engine, max_steps=max_steps, each=check)
    _assert_drained(engine, max_steps, stalls_ok)
    return finals


def serve_arrivals(engine: LLMEngine, work, max_steps: int = 400,
                   each: Callable[[LLMEngine], object] | None = None) -> dict:
    """Serve a workload that arrives over steps: ``work`` is ``(step it arrives, tenant, prompt tokens,
    max_tokens)`` per request, request ``i`` named ``f"{tenant}{i}"`` with a prompt of its own token,
    ``100 + i``, and ``ignore_eos`` (so each runs to ``max_tokens``).  Steps until the last has arrived and
    every request finished, running ``each(engine)`` after every step; ``{request_id: final output}``.  Fails,
    as :func:`steps` does, when requests are left after ``max_steps``."""
    from minivllm.sampling_params import SamplingParams

    last = max(at for at, *_ in work)
    finals: dict = {}
    for step in range(max_steps):
        for i, (at, tenant, prompt, max_tokens) in enumerate(work):
            if at == step:
                engine.add_request({"prompt_token_ids": [100 + i] * prompt},
                                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"{tenant}{i}", tenant=tenant)
        if step > last and not engine.has_unfinished_requests():
            break
        finals.update({out.request_id: out for out in engine.step() if out.finished})
        if each is not None:
            each(engine)
    _assert_drained(engine, max_steps, stalls_ok=False)
    return finals



def _next_write_targets(reqs, block_size: int) -> Counter:
    """Per partly filled block, the requests of ``reqs`` whose next token lands in it (a block none of them has
    begun is not a target: its writer takes a fresh block)."""
    targets: Counter = Counter()
    for r in reqs:
        at = r.num_computed_tokens
        if at % block_size and at // block_size < len(r.block_ids):
            targets[r.block_ids[at // block_size]] += 1
    return targets


def claimed_blocks(kv, reqs, worst_case: bool = False) -> int:
    """Brute force: the blocks ``reqs`` will still claim.  Each request's missing blocks for the tokens it has
    (``worst_case``: for prompt + ``max_tokens``), plus, per partly filled block ``B`` that ``w`` of them write into
    next, ``min(w, refcount(B) - 1)`` copies: every writer copies while someone else still holds ``B``, so when
    the writers are all of its holders the last one writes in place, and when another holder (the prefix cache, a
    request writing elsewhere) keeps ``B`` every writer copies.  :func:`claimed_by_stepping` checks it."""
    bs, total = kv.block_size, 0
    for r in reqs:
        tokens = r.num_prompt_tokens + (r.max_tokens if worst_case else len(r.output_token_ids))
        total += max(0, -(-tokens // bs) - len(r.block_ids))
    for b, writers in _next_write_targets(reqs, bs).items():
        total += min(writers, kv.pool.refcount(b) - 1)
    return total


def room_after(kv, reqs, gone, req=None):
    """Brute force on a copy of ``kv`` (the room :meth:`KVCacheManager.could_start_if_freed` bounds): free ``gone`` (some of ``reqs``), let ``req`` (if given, and not swapped
    out) take its cached prefix as admission would, then evict every cached block the cache can give up.
    Returns the copy's free blocks, the blocks the requests left in ``reqs`` will still claim
    (:func:`claimed_blocks`, recounted from their tables as they then stand), and what ``req`` still needs for
    its tokens (its own next write's copy included)."""
    kv2, reqs2, gone2, req2 = copy.deepcopy((kv, list(reqs), list(gone), req))
    for r in gone2:
        kv2.free(r)
    claimed = claimed_blocks(kv2, [r for r in reqs2 if not any(r is g for g in gone2)])
    need = 0
    if req2 is not None:
        if not req2.cpu_block_ids:
            kv2.share_computed(req2)
        bs, table = kv2.block_size, req2.block_ids
        need = -(-req2.num_tokens // bs) - len(table)
        at = req2.num_computed_tokens
        if at % bs and at < len(table) * bs and kv2.pool.refcount(table[at // bs]) > 1:
            need += 1  # its next token lands in a block someone else holds: a private copy first
    if kv2.prefix_cache is not None:
        while kv2.prefix_cache.evict(kv2.pool.num_blocks):
            pass
    return kv2.pool.num_free, claimed, need


def group_claims(kv, running, keys: Callable, worst_case: bool = False) -> dict:
    """Brute force, per group (``keys(r)``: the groups ``r`` counts in): the distinct blocks its members hold plus
    the blocks their next writes add to that set -- each member's missing blocks for the tokens it has, plus, per
    partly filled block ``B`` that ``w`` members write into next and ``m`` members hold, ``min(w, m - 1)``: a copy
    made while another member holds ``B`` adds a block to the group, while the last member to let ``B`` go (by
    copying it or by writing in place) only swaps one block for another.  ``worst_case``: missing blocks for
    prompt + ``max_tokens`` (reject mode).  :func:`claimed_by_stepping` checks it."""
    bs, groups = kv.block_size, {}
    for r in running:
        for k in keys(r):
            groups.setdefault(k, []).append(r)
    out = {}
    for k, members in groups.items():
        holders = Counter(b for r in members for b in set(r.block_ids))
        total = len(holders)
        for r in members:
            tokens = r.num_prompt_tokens + (r.max_tokens if worst_case else len(r.output_token_ids))
            total += max(0, -(-tokens // bs) - len(r.block_ids))
        for b, writers in _next_write_targets(members, bs).items():
            total += min(writers, holders[b] - 1)
        out[k] = total
    return out


def claimed_by_stepping(kv, running, keys: Callable, rng=None) -> tuple[int, dict] | None:
    """What :func:`claimed_blocks` and :func:`group_claims` predict, found by doing it: on a deep copy of ``kv``
    and ``running``, every request gets room for all the tokens it has (``allocate_slots``, copy-on-write
    included), in ``rng``'s order if given.  Returns the blocks the pool handed out and each group's distinct
    blocks afterwards, or None when the pool could not give them all (nothing to compare)."""
    kv2, running2 = copy.deepcopy((kv, list(running)))
    handed = 0
    allocate = kv2.pool.allocate

    def counting_allocate():
        nonlocal handed
        handed += 1
        return allocate()

    kv2.pool.allocate = counting_allocate
    order = list(running2)
    if rng is not None:
        rng.shuffle(order)
    for r in order:
        if not kv2.allocate_slots(r, r.num_uncomputed_tokens):
            return None
    groups: dict = {}
    for r in running2:
        for k in keys(r):
            groups.setdefault(k, set()).update(r.block_ids)
    return handed, {k: len(v) for k, v in groups.items()}
