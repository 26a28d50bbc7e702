"""Checkers for lab 2 (paged KV cache): the block pool, slot mapping, paged reservation.

The module ends with the lab's registration (:data:`LAB`, see :mod:`minivllm.labs.registry`).
"""

from __future__ import annotations

import random
from typing import Any, Callable

from minivllm.kv.block_pool import BlockPool, OutOfBlocksError, PoolAdapter
from minivllm.labs.checkers import Case, CheckResult, expect_raises, run_checks, wrong_container
from minivllm.labs.registry import Exercise, Lab
from minivllm.labs.workloads import random_requests, run_engine, sim_engine


def as_engine_pool(pool_cls: Callable[[int], Any], num_blocks: int) -> Any:
    """An engine-ready pool of ``num_blocks`` from the engine's or a learner's pool class: a learner's pool has
    only the lab's five members, and :class:`PoolAdapter` builds the rest the KV manager calls on them."""
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
             "position 0 lives in the first block of the table, physical block 5; a block owns block_size slots, "
             "so where does block 5's first slot start?"),
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
    def lengths_untouched(f):
        # the lab passes one list of 2,000 lengths to every block size in turn: an answer that rounds the lengths
        # up in place returns the right total once, then the later sizes (and the histogram) see rounded lengths
        lens = [40, 1, 17, 16]
        f(lens, 16)
        return lens

    cases = [
        Case("no sequences", lambda f: f([], 16), 0, "the sum over no sequences is 0"),
        Case("one token needs a whole block", lambda f: f([1], 16), 16, "a block is the unit of allocation",
             diagnose=lambda got: ("1 is the number of blocks; the answer is in slots (tokens of capacity): "
                                   "each block holds block_size of them" if got == 1 else None)),
        Case("exactly one full block", lambda f: f([16], 16), 16,
             "16 tokens fit in one 16-slot block: use ceiling division, not len // bs + 1"),
        Case("one past the boundary", lambda f: f([17], 16), 32, "17 tokens spill into a second block"),
        Case("several sequences add up", lambda f: f([1, 16, 17, 40], 16), 16 + 16 + 32 + 48,
             "every sequence gets its own blocks: sum the per-sequence reservations"),
        Case("sequences of the same length each count", lambda f: f([16, 16, 5, 5], 16), 64,
             "two sequences with equal lengths still hold two sets of blocks: sum over the list itself, not over "
             "its distinct lengths (a set, or a dict keyed by length, keeps one of each)"),
        Case("block size 1 wastes nothing", lambda f: f([3, 5, 7], 1), 15, "with 1-token blocks reserved == used"),
        Case("an empty sequence reserves nothing", lambda f: f([0, 5], 16), 16,
             "ceil(0 / 16) = 0 blocks: a sequence with no tokens yet holds no block"),
        Case("the lengths are only read", lengths_untouched, [40, 1, 17, 16],
             "add up the reservations without writing them back into seq_lens (no seq_lens[i] = ..., no sort): "
             "the caller reuses its list, here for every block size in turn"),
    ]
    return run_checks("paged reservation", fn, cases)


# -- hidden cases (the grader's, seeded at grading time) ---------------------------------


def _outcome(call):
    """What a pool call did: its return value, or the name of the error it raised."""
    try:
        return ("ok", call())
    except NotImplementedError:
        raise
    except Exception as exc:  # the engine's pool raises OutOfBlocksError / ValueError; compare the kind
        return ("raised", type(exc).__name__)


def hidden_block_pool(cls, seed: int) -> CheckResult:
    """Random sequences of pool operations (legal and illegal) replayed on the learner's pool and on the
    engine's :class:`BlockPool`, and an engine run of a random workload on a random pool size."""
    rng = random.Random(seed)

    def random_ops(c):
        for trial in range(30):
            n = rng.randint(1, 8)
            mine, ref = c(n), BlockPool(n)
            for step in range(rng.randint(5, 60)):
                op = rng.choice(["allocate", "allocate", "incref", "decref", "decref"])
                b = rng.randrange(n)
                if op == "allocate":
                    got, want = _outcome(mine.allocate), _outcome(ref.allocate)
                elif op == "incref":
                    got, want = _outcome(lambda: mine.incref(b)), _outcome(lambda: ref.incref(b))
                    got, want = got[0], want[0]  # incref returns nothing; only whether it raised matters
                else:
                    got, want = _outcome(lambda: mine.decref(b)), _outcome(lambda: ref.decref(b))
                if got != want or mine.num_free != ref.num_free or \
                        [mine.refcount(i) for i in range(n)] != [ref.refcount(i) for i in range(n)]:
                    return f"sequence {trial} differs at operation {step} ({op})"
        return "all 30 sequences match"

    def engine_run(c):
        blocks = rng.randint(16, 40)
        reqs = random_requests(rng.randint(4, 10), seed=seed, prompt_range=(4, 30), output_range=(4, 40))

        def trace(pool_cls):
            eng = sim_engine(num_blocks=blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=64,
                             model_max_len=96)
            if pool_cls is not None:
                install_pool(eng, pool_cls(blocks))
            finals = run_engine(eng, reqs, max_steps=3000)
            return len(finals), eng.pool.num_free, [(s["seqs"], s["preempted"]) for s in eng.step_log]

        return trace(c) == trace(None)

    return run_checks("block pool (hidden)", cls, [
        Case("30 random operation sequences vs the engine's BlockPool", random_ops, "all 30 sequences match"),
        Case("a random workload on a random pool size, step for step", engine_run, True),
    ], verbose=False)


def hidden_slot_mapping(fn, seed: int) -> CheckResult:
    """Random block tables and chunks, compared with the model runner's ``slot_mapping``."""
    import torch

    from minivllm.model.runner import build_attention_metadata
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams
    from minivllm.sched.output import ScheduledSeq

    rng = random.Random(seed)

    def random_chunks(f):
        for k in range(150):
            bs = rng.choice([1, 2, 4, 8, 16])
            table = rng.sample(range(64), rng.randint(1, 8))
            start = rng.randint(0, len(table) * bs - 1)
            num = rng.randint(0, len(table) * bs - start)
            got = f(list(table), start, num, bs)
            if (bad := wrong_container(got, list, f"chunk {k}")) is not None:  # as in the visible cases
                return bad
            if num == 0:
                if got != []:
                    return f"chunk {k} differs"
                continue
            req = Request("h", list(range(10, 10 + start + num)), SamplingParams(), 0.0)
            req.block_ids = list(table)
            _, _, meta = build_attention_metadata([ScheduledSeq(req, num, start)], bs, torch.device("cpu"))
            if got != meta.slot_mapping.tolist():
                return f"chunk {k} differs"
        return "all 150 match"

    return run_checks("slot mapping (hidden)", fn, [
        Case("150 random block tables and chunks vs the model runner", random_chunks, "all 150 match"),
    ], verbose=False)


def hidden_paged_slots(fn, seed: int) -> CheckResult:
    """Random length lists and block sizes, compared with the KV manager's own ``blocks_for``."""
    from minivllm.kv.kv_cache_manager import blocks_for

    rng = random.Random(seed)

    def random_lists(f):
        for k in range(200):
            bs = rng.choice([1, 3, 4, 8, 16, 32, rng.randint(1, 64)])
            lens = [rng.choice([rng.randint(1, 300), bs * rng.randint(1, 9), bs * rng.randint(0, 9) + 1])
                    for _ in range(rng.randint(0, 12))]
            if f(list(lens), bs) != sum(blocks_for(n, bs) * bs for n in lens):
                return f"list {k} differs"
        return "all 200 match"

    return run_checks("paged reservation (hidden)", fn, [
        Case("200 random length lists and block sizes", random_lists, "all 200 match"),
    ], verbose=False)


# -- the block size's time cost: decode attention through the block table ----------------


def paged_decode_step(block_size: int, *, batch: int = 32, context: int = 1024, heads: int = 9, kv_heads: int = 3,
                      head_dim: int = 64, shuffled: bool = True, repeats: int = 20, seed: int = 0):
    """One decode step's attention for ``batch`` sequences of ``context`` tokens, their K/V in blocks of
    ``block_size``: ``(median ms, output [batch, heads, head_dim], reader)``.

    The logical K/V are the same for every block size (drawn once from ``seed``); only their layout
    changes.  With ``shuffled`` the physical blocks are a random permutation: after a pool has served a
    while, a request's blocks are wherever the free list had them.  The reader is the engine's CPU decode
    kernel (``minivllm/model/csrc/paged_decode.c``, which follows the block table entry by entry), or,
    without a C compiler, the engine's torch reference path
    (:func:`~minivllm.model.attention.paged_attention_reference`), which gathers every block first.  Shapes default
    to SmolLM2-135M's attention (9 query heads, 3 KV heads of 64).
    """
    import statistics
    import time

    import torch

    from minivllm.model.attention import AttentionMetadata, paged_attention_reference
    from minivllm.model.cpu_attention import load_kernel, paged_decode

    if context % block_size:
        raise ValueError(f"context ({context}) must be a multiple of block_size ({block_size})")
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, head_dim, generator=gen)
    k, v = (torch.randn(batch, context, kv_heads, head_dim, generator=gen) for _ in range(2))
    per_seq = context // block_size
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks, generator=gen) if shuffled else torch.arange(num_blocks)
    tables = order.to(torch.int32).view(batch, per_seq).contiguous()
    k_cache = torch.empty(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.empty_like(k_cache)
    k_cache[tables.flatten().long()] = k.reshape(num_blocks, block_size, kv_heads, head_dim)
    v_cache[tables.flatten().long()] = v.reshape(num_blocks, block_size, kv_heads, head_dim)
    scale = head_dim ** -0.5
    kernel = load_kernel()
    if kernel is not None:
        reader = "the engine's C decode kernel"
        lens = torch.full((batch,), context, dtype=torch.int32)

        def attend():
            return paged_decode(q, k_cache, v_cache, tables, lens, scale, kernel)
    else:
        reader = "torch: gather the blocks (the engine's reference path, no C compiler)"
        lens = [context] * batch
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.long), query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, num_decodes=batch,
            query_lens=[1] * batch, context_lens=[n - 1 for n in lens])

        def attend():
            return paged_attention_reference(q, k_cache, v_cache, meta, scale)
    out = attend()  # a warm-up call: first-touch page faults and lazy loading are not the block size's cost
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        attend()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, out, reader


# -- quiz answers (``"compute": "minivllm.labs.check_lab02:<name>"`` in quizzes/lab02.json) ----


def quiz_slot_of_token_37() -> int:
    """Slot of position 37 with block table [4, 9, 6, 7] and 16-token blocks, via the model runner."""
    import torch

    from minivllm.model.runner import build_attention_metadata
    from minivllm.request import Request
    from minivllm.sampling_params import SamplingParams
    from minivllm.sched.output import ScheduledSeq

    req = Request("q", list(range(10, 48)), SamplingParams(), 0.0)
    req.block_ids = [4, 9, 6, 7]
    _, _, meta = build_attention_metadata([ScheduledSeq(req, 1, 37)], 16, torch.device("cpu"))
    return int(meta.slot_mapping[0])


# -- the registration ---------------------------------------------------------------------

LAB = Lab(2, "lab02_paged_kv_cache", "Paged KV cache", widgets=("next step", "run to end"), exercises=(
    Exercise("block_pool", "MyBlockPool", check_block_pool, points=2, hidden=hidden_block_pool, mutants=(
        ("refcount not decremented on decref", "self.counts[block_id] -= 1\n        if self.counts[block_id] == 0:",
         "if self.counts[block_id] == 1:"),
        ("freed block never returns to the free list", "self.free.append(block_id)\n            return True",
         "return True"),
        ("LIFO: freed block goes to the front", "self.free.append(block_id)", "self.free.appendleft(block_id)"),
        ("no double-free check", 'raise ValueError(f"decref on free block {block_id} (double free)")', "pass"),
        ("allocate leaves the count at 0", "self.counts[block_id] = 1", "self.counts[block_id] += 0"),
        # (the old text ends with the next line's indent, so that the cut leaves valid Python: a planted bug
        # that does not parse never reaches the checker)
        ("empty pool raises IndexError", 'if not self.free:\n            raise OutOfBlocksError("no free KV blocks")\n        ',
         ""),
        ("incref on a free block allowed", 'if self.counts[block_id] <= 0:\n            raise ValueError(f"incref',
         'if self.counts[block_id] < 0:\n            raise ValueError(f"incref'),
        ("decref reports a shared block as freed", "return True\n        return False", "return True\n        return True"),
        ("allocate takes from the back", "self.free.popleft()", "self.free.pop()"),
        # the engine never double-frees, so only the error-type case sees this: kills an expect_raises that
        # counts any exception as the one asked for
        ("double free caught by an assert, not a ValueError",
         'if self.counts[block_id] <= 0:\n            raise ValueError(f"decref on free block {block_id} (double free)")',
         'assert self.counts[block_id] > 0, "double free"'),
    )),
    Exercise("slot_mapping", "slot_mapping", check_slot_mapping, points=1, hidden=hidden_slot_mapping, mutants=(
        ("block index and offset swapped", "block_table[p // block_size] * block_size + p % block_size",
         "block_table[p % block_size] * block_size + p // block_size"),
        ("forgets to scale the block id", "block_table[p // block_size] * block_size + p % block_size",
         "block_table[p // block_size] + p % block_size"),
        ("one token too many", "range(start, start + num_tokens)", "range(start, start + num_tokens + 1)"),
        ("positions shifted by one", "range(start, start + num_tokens)", "range(start + 1, start + num_tokens + 1)"),
        ("ignores the block table", "block_table[p // block_size] * block_size + p % block_size", "p"),
        ("offset not taken modulo block_size", "* block_size + p % block_size", "* block_size + p"),
        ("off-by-one block index", "block_table[p // block_size]", "block_table[(p - 1) // block_size]"),
    )),
    Exercise("paged_slots", "paged_slots", check_paged_slots, points=1, hidden=hidden_paged_slots, mutants=(
        ("floor instead of ceiling", "-(-n // block_size)", "(n // block_size)"),
        ("always one block extra at an exact boundary", "-(-n // block_size)", "(n // block_size + 1)"),
        ("no rounding to blocks", "return sum(-(-n // block_size) * block_size for n in seq_lens)",
         "return sum(seq_lens)"),
        ("max instead of sum", "return sum(", "return max("),
        ("counts blocks, not slots", "* block_size for n", " for n"),
        ("block size hard-coded to 16", "-(-n // block_size) * block_size", "-(-n // 16) * 16"),
        ("an empty sequence still takes a block", "-(-n // block_size) * block_size", "max(1, -(-n // block_size)) * block_size"),
        ("one reservation per distinct length", "sum(-(-n // block_size) * block_size for n in seq_lens)",
         "sum({n: -(-n // block_size) * block_size for n in seq_lens}.values())"),
        # the right total, but the caller's list now holds reservations: the lab's later block sizes read those
        ("rounds the caller's lengths up in place", "return sum(-(-n // block_size) * block_size for n in seq_lens)",
         "seq_lens[:] = [-(-n // block_size) * block_size for n in seq_lens]\n    return sum(seq_lens)"),
    )),
))
