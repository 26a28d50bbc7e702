"""Checkers for lab 2 (paged KV cache): the block pool, slot mapping, paged reservation."""

from __future__ import annotations

from typing import Any, Callable

from minivllm.kv.block_pool import BlockPool, OutOfBlocksError
from minivllm.labs.checkers import Case, CheckResult, expect_raises, run_checks
from minivllm.labs.workloads import random_requests, run_engine, sim_engine


class PoolAdapter:
    """Gives a learner's 5-method pool the full interface the engine calls.

    The learner writes ``allocate``, ``incref``, ``decref``, ``refcount`` and
    ``num_free``; everything else the engine uses (``allocate_many``,
    ``free_all``, ``copy_on_write``...) is built on those here, so the engine
    really runs on the learner's bookkeeping.
    """

    def __init__(self, inner: Any, num_blocks: int) -> None:
        self.inner = inner
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return self.inner.num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.inner.num_free

    def refcount(self, b: int) -> int:
        return self.inner.refcount(b)

    def is_free(self, b: int) -> bool:
        return self.inner.refcount(b) == 0

    def allocate(self) -> int:
        return self.inner.allocate()

    def allocate_many(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} blocks, {self.num_free} free")
        return [self.inner.allocate() for _ in range(n)]

    def incref(self, b: int) -> None:
        self.inner.incref(b)

    def decref(self, b: int) -> bool:
        return self.inner.decref(b)

    def free_all(self, block_ids: list[int]) -> None:
        for b in reversed(block_ids):
            self.inner.decref(b)

    def copy_on_write(self, b: int) -> tuple[int, bool]:
        if self.inner.refcount(b) == 1:
            return b, False
        new = self.inner.allocate()
        self.inner.decref(b)
        return new, True


def as_engine_pool(pool_cls: Callable[[int], Any], num_blocks: int) -> Any:
    """An engine-ready pool of ``num_blocks`` from the engine's or a learner's pool class."""
    if isinstance(pool_cls, type) and issubclass(pool_cls, BlockPool):
        return pool_cls(num_blocks)
    return PoolAdapter(pool_cls(num_blocks), num_blocks)


def install_pool(engine, pool: Any) -> None:
    """Swap the engine's block pool for ``pool`` (before any request is added).

    The pool must have as many blocks as the engine's: with a real model the
    KV tensors were sized for that many.
    """
    adapter = pool if isinstance(pool, (BlockPool, PoolAdapter)) else PoolAdapter(pool, engine.pool.num_blocks)
    if adapter.num_blocks != engine.pool.num_blocks:
        raise ValueError(f"the engine has {engine.pool.num_blocks} blocks, this pool {adapter.num_blocks}")
    engine.kv.replace_pool(adapter)


def _engine_trace(pool_cls: Callable[[int], Any] | None) -> tuple:
    """A tight pool (preemptions happen): the step log and final free count."""
    eng = sim_engine(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, model_max_len=96)
    if pool_cls is not None:
        install_pool(eng, pool_cls(24))
    finals = run_engine(eng, random_requests(8, seed=3, prompt_range=(4, 30), output_range=(4, 40)), max_steps=2000)
    log = [(s["seqs"], s["preempted"]) for s in eng.step_log]
    return len(finals), eng.pool.num_free, log


def check_block_pool(cls) -> CheckResult:
    """Check a learner's block pool class ``cls(num_blocks)``."""
    def fresh(p):
        return (p.num_free, [p.refcount(b) for b in range(4)])

    def alloc3(c):
        p = c(4)
        ids = [p.allocate() for _ in range(3)]
        return ids, [p.refcount(b) for b in ids], p.num_free

    def exhaust(c):
        p = c(2)
        p.allocate(), p.allocate()
        return expect_raises(OutOfBlocksError, p.allocate)

    def free_one(c):
        p = c(3)
        b = p.allocate()
        back = p.decref(b)
        return back, p.num_free, p.refcount(b)

    def fifo(c):
        p = c(4)
        a = p.allocate()
        p.allocate()
        p.decref(a)
        return [p.allocate() for _ in range(3)]

    def shared(c):
        p = c(4)
        b = p.allocate()
        p.incref(b)
        first = p.decref(b)
        mid = (p.refcount(b), p.num_free)
        second = p.decref(b)
        return first, mid, second, p.num_free

    def double_free(c):
        p = c(2)
        b = p.allocate()
        p.decref(b)
        return expect_raises(ValueError, lambda: p.decref(b))

    def incref_free(c):
        p = c(2)
        return expect_raises(ValueError, lambda: p.incref(1))

    reference = _engine_trace(None)

    cases = [
        Case("a fresh pool: all free, refcounts 0", lambda c: fresh(c(4)), (4, [0, 0, 0, 0]),
             "start with every block on the free list and every count at 0"),
        Case("allocate hands out 0, 1, 2 with refcount 1", alloc3, ([0, 1, 2], [1, 1, 1], 1),
             "take blocks from the FRONT of the free list and set the new block's count to 1"),
        Case("allocate on an empty pool raises OutOfBlocksError", exhaust, "OutOfBlocksError",
             "check for an empty free list yourself and raise OutOfBlocksError (a deque raises IndexError)"),
        Case("decref of the only holder frees the block", free_one, (True, 3, 0),
             "decrement first; when the count reaches 0 append the block to the free list and return True"),
        Case("a freed block goes to the BACK of the free list", fifo, [2, 3, 0],
             "append freed blocks at the back (FIFO): the engine's pool does, so block ids stay reproducible and match it step for step"),
        Case("a shared block survives one decref", shared, (False, (1, 3), True, 4),
             "with two holders, one decref leaves the block in use (count 1) and returns False"),
        Case("double free raises ValueError", double_free, "ValueError",
             "decref on a block whose count is already 0 is a bug in the caller: raise ValueError"),
        Case("incref on a free block raises ValueError", incref_free, "ValueError",
             "only a block somebody holds can gain a holder; a free block must be allocated first"),
        Case("the engine runs on your pool (preemptions included) exactly as on its own",
             _engine_trace, reference, "compare with the cases above: the engine relies on every rule",
             show_expected=f"8 requests finish, all 24 blocks free, the engine's own {len(reference[2])}-step schedule"),
    ]
    return run_checks("block pool", cls, cases)


def check_slot_mapping(fn) -> CheckResult:
    """Check ``fn(block_table, start, num_tokens, block_size) -> list[int]``."""
    import torch

    from minivllm.model.runner import build_attention_metadata

    def engine_case(f):
        eng = sim_engine(num_blocks=64, block_size=4, max_num_batched_tokens=32)
        for i, (p, m) in enumerate(random_requests(3, seed=1, prompt_range=(5, 13), output_range=(2, 3))):
            eng.add_request({"prompt_token_ids": p}, __import__("minivllm").SamplingParams(max_tokens=m), f"r{i}")
        eng.step()  # some blocks are allocated now
        batch = eng.scheduler.allocate(eng.scheduler.build_batch())
        _, _, meta = build_attention_metadata(batch.seqs, 4, torch.device("cpu"))
        mine = []
        for s in sorted(batch.seqs, key=lambda s: s.num_tokens != 1):
            mine += f(list(s.request.block_ids), s.start, s.num_tokens, 4)
        return mine == meta.slot_mapping.tolist()

    cases = [
        Case("one token at position 0", lambda f: f([5], 0, 1, 4), [20],
             "slot = block_table[pos // block_size] * block_size + pos % block_size"),
        Case("tokens inside the first block", lambda f: f([5, 9], 0, 3, 4), [20, 21, 22],
             "positions run from start to start + num_tokens - 1"),
        Case("empty chunk", lambda f: f([5], 0, 0, 4), [], "zero tokens map to no slots"),
        Case("crossing into the second block", lambda f: f([5, 9], 2, 4, 4), [22, 23, 36, 37],
             "position 4 is the FIRST slot of block_table[1]; check // vs % and the offset"),
        Case("a decode token exactly at a block boundary", lambda f: f([5, 9, 2], 8, 1, 4), [8],
             "position 8 with block_size 4 is logical block 2 (the third entry), offset 0"),
        Case("a scattered block table", lambda f: f([7, 2, 9], 3, 6, 4), [31, 8, 9, 10, 11, 36],
             "logical block i lives in physical block block_table[i], wherever that is"),
        Case("matches the engine's slot_mapping for a real batch", engine_case, True,
             "the model runner computes the same mapping for every token of a step"),
    ]
    return run_checks("slot mapping", fn, cases)


def check_paged_slots(fn) -> CheckResult:
    """Check ``fn(seq_lens, block_size) -> int`` (KV slots reserved with paging)."""
    cases = [
        Case("no sequences", lambda f: f([], 16), 0, "the sum over no sequences is 0"),
        Case("one token needs a whole block", lambda f: f([1], 16), 16, "a block is the unit of allocation"),
        Case("exactly one full block", lambda f: f([16], 16), 16,
             "16 tokens fit in one 16-slot block: use ceiling division, not len // bs + 1"),
        Case("one past the boundary", lambda f: f([17], 16), 32, "17 tokens spill into a second block"),
        Case("several sequences add up", lambda f: f([1, 16, 17, 40], 16), 16 + 16 + 32 + 48,
             "every sequence gets its own blocks: sum the per-sequence reservations"),
        Case("block size 1 wastes nothing", lambda f: f([3, 5, 7], 1), 15, "with 1-token blocks reserved == used"),
    ]
    return run_checks("paged reservation", fn, cases)
