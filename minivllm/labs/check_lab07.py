"""Checkers for lab 7 (Triton paged attention): the block-table gather in torch, then a decode kernel.

The lab goes from an oracle to a kernel.  Exercise 1 is the gather that every
paged-attention implementation starts from (logical token -> block table ->
physical block), written in torch and checked against the engine's
:func:`minivllm.model.attention.gather_kv`.  Exercise 2 is the inner loop of a
Triton decode kernel -- load one KV block through the table, fold it into an
online softmax -- checked in Triton's CPU interpreter against the engine's torch
reference :func:`~minivllm.model.attention.paged_attention_reference`.

Why the launch wrapper lives here: a kernel launch is bookkeeping (strides,
grid, constants) that teaches nothing and hides the interesting part.  The
learner writes only the ``@triton.jit`` function; :func:`launch_decode` feeds it.

How the cases catch kernel bugs rather than rounding noise: every cache slot a
correct kernel must not read (the tail of a sequence's last block, spare blocks,
block-table padding) holds NaN, and so does every output element before the
launch.  Reading one slot too many, or trusting a padding entry, gives NaN, not
a small error.  One case puts the blocks beyond 2^32 elements from the cache's
start (a sparse, mostly unbacked mapping), where a block offset computed in
int32 wraps around to the wrong block.

On a CPU, Triton can only run interpreted, and Triton reads
``TRITON_INTERPRET`` when a kernel is *decorated*; so importing this module
switches the interpreter on when no CUDA device exists (before the lab's kernel
cell runs).
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

if not torch.cuda.is_available():  # must precede the first @triton.jit of the lab (see the module docstring)
    _tl = sys.modules.get("triton.language")
    if _tl is not None and type(getattr(_tl, "cdiv", None)).__name__ == "JITFunction":
        # Too late to switch: Triton decorated its own library (tl.cdiv, the reductions' combine functions) as
        # compiled code when triton.language was first imported (transformers imports it), and an interpreted
        # kernel cannot call those.  Say so here rather than through the interpreter's error in every case.
        # The library itself is asked, not the variable: the lab's first cell sets TRITON_INTERPRET=1 just
        # before importing this module, which is too late when something above it imported Triton first.
        warnings.warn("Triton was imported before minivllm.labs.check_lab07, without TRITON_INTERPRET=1: kernels "
                      "interpreted on this CPU will fail with \"Cannot call @triton.jit'd outside of the scope of a "
                      "kernel\". Restart the kernel (or the process) and run the lab's first cell before anything "
                      "else, or set TRITON_INTERPRET=1 in the environment.", RuntimeWarning, stacklevel=2)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm.labs.checkers import Case, CheckResult, run_checks  # noqa: E402
from minivllm.labs.registry import Exercise, Lab  # noqa: E402
from minivllm.labs.widgets import PictureWidget  # noqa: E402
from minivllm.model.attention import AttentionMetadata, gather_kv, paged_attention_reference  # noqa: E402

PAGE = 16  # block size of the checker's caches

# The engine's own gather, by name: the fallback while exercise 1 has not passed.
engine_gather_kv = gather_kv


# -- building paged caches -----------------------------------------------------------------


def make_paged(lens: list[int], *, kv_heads: int = 1, group: int = 1, head_dim: int = 16, page: int = PAGE,
               dtype: torch.dtype = torch.float32, shuffle: bool = True, share_first: bool = False,
               q_scale: float = 1.0, seed: int = 0, device: str = "cpu", interleaved: bool = False,
               spike_first: float = 0.0, scale: float | None = None, heads_apart: bool = False) -> dict:
    """A filled paged cache for sequences of ``lens`` tokens, and one decode query per sequence.

    Blocks are handed out in a random order (``shuffle``) from a pool with
    spare blocks; everything a correct reader must skip is NaN: spare blocks,
    the tail of each last block, block-table padding (one extra column per row,
    pointing at a spare block).  ``share_first`` makes every sequence longer
    than a block reuse the first such sequence's block 0 (a shared prefix).
    The pool has one more block than the caches show, so a kernel that strays
    a few slots past the end reads NaN instead of memory it does not own.
    ``interleaved`` stores each block's K and then its V next to each other in
    one pool, so a block's stride is twice its K rows: only ``stride_kv_block``
    finds it (``block * PAGE * stride_kv_token`` lands in the wrong block).
    ``heads_apart`` stores each KV head's K next to its V (``[block, slot, head, K|V, dim]``), so consecutive
    heads are ``2 * head_dim`` apart: only ``stride_kv_head`` finds head 1 (``kv_head * HEAD_DIM`` lands on
    head 0's V, finite and wrong).
    ``spike_first`` gives each sequence's token 0 a score of that much (its K is
    the query, rescaled), so the largest score is in the first block and the
    running max must *not* fall when later blocks score lower.  ``scale``: the
    softmax scale the case passes (default ``1 / sqrt(head_dim)``); another value
    tells a kernel that multiplies by its ``scale`` argument from one that
    hard-codes the textbook value.
    """
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    gen = torch.Generator().manual_seed(seed)
    per_seq = [max(1, math.ceil(n / page)) for n in lens]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=gen) if shuffle else torch.arange(num_blocks)
    spare = int(order[-1])
    width = max(per_seq) + 1
    tables = torch.full((len(lens), width), spare, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[cursor:cursor + n].to(torch.int32)
        cursor += n
    if share_first:
        donors = [i for i, n in enumerate(lens) if n > page]
        for i in donors[1:]:
            tables[i, 0] = tables[donors[0], 0]
    if interleaved and heads_apart:
        raise ValueError("interleaved and heads_apart are two layouts of one pool: pick one")
    if interleaved:
        pool = torch.full((num_blocks + 1, 2, page, kv_heads, head_dim), float("nan"), dtype=dtype)

        def views(p):
            return p[:num_blocks, 0], p[:num_blocks, 1]
    elif heads_apart:
        pool = torch.full((num_blocks + 1, page, kv_heads, 2, head_dim), float("nan"), dtype=dtype)

        def views(p):
            return p[:num_blocks, :, :, 0], p[:num_blocks, :, :, 1]
    else:
        pool = torch.full((2, num_blocks + 1, page, kv_heads, head_dim), float("nan"), dtype=dtype)

        def views(p):
            return p[0, :num_blocks], p[1, :num_blocks]
    k_cache, v_cache = views(pool)
    for i, n in enumerate(lens):
        for pos in range(n):
            block, slot = int(tables[i, pos // page]), pos % page
            k_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[block, slot] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
    q = (torch.randn(len(lens), kv_heads * group, head_dim, generator=gen) * q_scale).to(dtype)
    if spike_first:
        for i in range(len(lens)):
            for h in range(kv_heads):
                qh = q[i, h * group].float()  # the group's first query head gets the spike
                k_cache[int(tables[i, 0]), 0, h] = (qh * spike_first / (scale * float(qh @ qh))).to(dtype)
    case = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "seq_lens": torch.tensor(lens, dtype=torch.int32), "scale": scale}
    if device != "cpu":
        case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        # the caches again from the moved POOL: ``.to(device)`` of a view that skips part of its pool (K next to
        # V) is a contiguous copy, so on a GPU the layout an interleaved case exists for would be gone
        case["k_cache"], case["v_cache"] = views(pool.to(device))
    return case


def reference_decode(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """The engine's torch reference (fp32) for one decode query per sequence.

    It gathers whole rows of the block table (padding included) and masks the
    padding afterwards; 0 x NaN is NaN, so the poison is zeroed in *its* copy
    of the cache.  That is the oracle's business, not the kernel's.
    """
    lens = [int(n) for n in seq_lens]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.int64, device=q.device),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32, device=q.device),
        seq_lens=seq_lens, block_tables=block_tables, num_decodes=len(lens),
        query_lens=[1] * len(lens), context_lens=[n - 1 for n in lens])
    return paged_attention_reference(q.float(), torch.nan_to_num(k_cache.float()),
                                     torch.nan_to_num(v_cache.float()), meta, scale)


def make_big(batch: int, seq_len: int, *, kv_heads: int = 3, group: int = 3, head_dim: int = 64, page: int = 16,
             dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0) -> dict:
    """A measurement-sized paged cache (no NaN poison, built without Python loops): ``batch`` sequences of
    ``seq_len`` tokens whose blocks are scattered over the pool in random order.  Defaults: SmolLM2's
    attention shape (9 query heads over 3 KV heads, head_dim 64)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(seq_len / page)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, generator=gen).view(batch, per_seq).to(torch.int32)
    k_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, page, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(dtype)
    case = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "seq_lens": torch.full((batch,), seq_len, dtype=torch.int32), "scale": 1 / math.sqrt(head_dim)}
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}


def kv_bytes(case: dict) -> int:
    """Bytes a decode step must read: every cached K and V element of every sequence, once."""
    _, _, kv_heads, head_dim = case["k_cache"].shape
    return int(case["seq_lens"].sum()) * kv_heads * head_dim * 2 * case["k_cache"].element_size()


def online_softmax_trace(scores: list[float], page: int) -> list[dict]:
    """The running state of an online softmax after each block of ``scores`` (plain Python, for the picture)."""
    m, l_i, out = float("-inf"), 0.0, []
    for b in range(0, len(scores), page):
        chunk = scores[b:b + page]
        m_new = max(m, max(chunk))
        l_i = l_i * math.exp(m - m_new) + sum(math.exp(s - m_new) for s in chunk)
        m = m_new
        out.append({"block": b // page, "max": m, "sum": l_i, "chunk_max": max(chunk)})
    return out


def draw_walk(case: dict, seq: int, fig=None, upto: int | None = None):
    """The picture of the lab: one sequence's block table, where its blocks sit in the pool, and the
    running max of one query's walk over them.  ``upto`` = how many blocks the walk has folded in so far
    (all when None); the block folded last is outlined in red.  Draws on a Figure it owns (no pyplot)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, Rectangle

    from minivllm.labs.widgets import request_colour

    fig = fig or Figure(figsize=(11, 3.6))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.1, 1]})
    k_cache, tables, lens = case["k_cache"], case["block_tables"], [int(n) for n in case["seq_lens"]]
    num_blocks, page = k_cache.shape[0], k_cache.shape[1]
    n = lens[seq]
    used = math.ceil(n / page)
    upto = used if upto is None else max(0, min(upto, used))
    current = int(tables[seq, upto - 1]) if upto else None
    owner = {}
    for i, length in enumerate(lens):
        for j in range(max(1, math.ceil(length / page))):
            owner.setdefault(int(tables[i, j]), i)
    cols = 8
    for blk in range(num_blocks):
        x, y = blk % cols, -(blk // cols)
        who = owner.get(blk)
        face = request_colour(f"seq{who}") if who is not None else "#eeeeee"
        alpha = 1.0 if who == seq else 0.35
        edge, width = ("#d62728", 2.5) if blk == current else ("#555555", 1.0)
        ax.add_patch(Rectangle((x * 1.2 + 6, y), 1, 0.8, facecolor=face, alpha=alpha, edgecolor=edge, lw=width))
        ax.text(x * 1.2 + 6.5, y + 0.4, str(blk), ha="center", va="center", fontsize=7)
    ax.text(0, 1.2, f"block table of seq {seq} ({n} tokens)", fontsize=8)
    for j in range(tables.shape[1]):
        blk = int(tables[seq, j])
        live = j < used
        edge, width = ("#d62728", 2.5) if j == upto - 1 else ("#555555", 1.0)
        ax.add_patch(Rectangle((0, -j), 1.6, 0.8, facecolor=request_colour(f"seq{seq}") if live else "white",
                               edgecolor=edge, lw=width))
        ax.text(0.8, -j + 0.4, f"{j} -> {blk}" if live else f"{j}: pad", ha="center", va="center", fontsize=7)
        if live:
            ax.add_patch(FancyArrowPatch((1.6, -j + 0.4), ((blk % cols) * 1.2 + 6, -(blk // cols) + 0.4),
                                         arrowstyle="-|>", mutation_scale=8, lw=1.6 if j == upto - 1 else 0.8,
                                         color="#d62728" if j == upto - 1 else "#333333",
                                         connectionstyle="arc3,rad=0.15"))
    tail = used * page - n
    ax.text(0, -tables.shape[1] - 0.2, f"last block: {page - tail} of {page} slots used; the other {tail} hold NaN",
            fontsize=7)
    ax.text(6, 1.2, "the pool: physical blocks (colour = owner, grey = free)", fontsize=8)
    ax.set_xlim(-0.3, 6 + cols * 1.2)
    ax.set_ylim(-max(tables.shape[1], math.ceil(num_blocks / cols)) - 0.6, 1.6)
    ax.axis("off")
    q = case["q"][seq, 0].float()
    keys = gather_kv(torch.nan_to_num(k_cache.float()), tables[seq], n)[:, 0]
    scores = (keys @ q * case["scale"]).tolist()
    trace = online_softmax_trace(scores, page)
    seen = min(n, upto * page)
    ax2.plot(range(n), scores, ".", color="#dddddd", label="scores not read yet")
    ax2.plot(range(seen), scores[:seen], ".", color="#555555", label="scores read")
    if upto:
        done = trace[:upto]
        ax2.step([t["block"] * page for t in done] + [seen], [t["max"] for t in done] + [done[-1]["max"]],
                 where="post", color="#d62728", label="running max m")
        ax2.set_title(f"after block {upto} of {used}: m = {done[-1]['max']:.2f}, l = {done[-1]['sum']:.2f}",
                      fontsize=9)
    else:
        ax2.set_title(f"before the first block: m = -inf, l = 0 ({used} blocks to go)", fontsize=9)
    for t in trace:
        ax2.axvline(t["block"] * page, color="#dddddd", lw=0.8)
    ax2.set_xlabel("token position (logical)")
    ax2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


class WalkStepper(PictureWidget):
    """A "next block" button over :func:`draw_walk`: one decode query folds in one KV block per click.

    One Figure it owns, one image updated in place (see :class:`~minivllm.labs.widgets.PictureWidget`);
    its state -- how many blocks are folded in -- belongs to this widget alone, so the cells after it
    cannot consume the steps.  After the last block the next click starts the walk over.
    """

    caption = "[block-by-block walk: run this notebook in Jupyter to step through the blocks]"

    def __init__(self, case: dict, seq: int = 0) -> None:
        super().__init__(figsize=(11, 3.6))
        self.case, self.seq, self.upto = case, seq, 0
        page, n = case["k_cache"].shape[1], int(case["seq_lens"][seq])
        self.num_blocks = math.ceil(n / page)
        keys = gather_kv(torch.nan_to_num(case["k_cache"].float()), case["block_tables"][seq], n)[:, 0]
        self.trace = online_softmax_trace((keys @ case["q"][seq, 0].float() * case["scale"]).tolist(), page)

    def paint(self, fig) -> None:
        draw_walk(self.case, self.seq, fig=fig, upto=self.upto)

    def next_block(self) -> str:
        if self.upto >= self.num_blocks:
            return self.restart()
        self.upto += 1
        t = self.trace[self.upto - 1]
        block = int(self.case["block_tables"][self.seq, self.upto - 1])
        return (f"block {self.upto}: table[{self.upto - 1}] = physical block {block}; its max score "
                f"{t['chunk_max']:.2f} -> m = {t['max']:.2f}, l = {t['sum']:.2f}")

    def restart(self) -> str:
        self.upto = 0
        return "back to the start: m = -inf, l = 0, acc = 0"

    def actions(self):
        return [("next block", self.next_block), ("restart", self.restart)]


# -- exercise 1: the gather ------------------------------------------------------------------


def _brute_gather(cache, table, kv_len):
    """Token by token, the definition: position p is in block table[p // B] at offset p % B."""
    page = cache.shape[1]
    rows = [cache[int(table[p // page]), p % page] for p in range(kv_len)]
    return torch.stack(rows) if rows else cache.new_empty((0, *cache.shape[2:]))


# the advice for a block count one too high, wherever a checker finds one (a row count, or a raise)
_ROUND_UP = "round the number of blocks UP, ceil(kv_len / block_size), not up-plus-one"


def _raise_past_its_blocks(fn, exc: Exception, cache, table, kv_len: int) -> tuple[str, bool] | None:
    """What shows that ``fn``'s raise on ``(cache, table, kv_len)`` came from the table entries after the
    ceil(kv_len / B) that the tokens need -- the raise of an up-plus-one count that writes its extra block into a
    kv_len-row output -- and whether a block was taken from them, or ``None`` when nothing shows it.

    A raise has no rows to count, so this asks by experiment: ``fn`` again on the same cache and length, with the
    table cut to the entries the tokens need, so that only those entries differ.  Blamed when it then returns
    (it took a slice of the table, which now ends where the tokens do), or when it then raises exactly what
    reading the cut table one entry past its end raises, having raised something else before (it read the table
    entry by entry).  Not blamed when it raises as it did: its bug is in the blocks it needs.  Nor when its first
    raise was already a read past the end of the whole table row: an up-plus-one count asks for entry
    ceil(kv_len / B), which the row holds, so such a raise comes from another walk (a token's position used as
    a block index, a loop that runs until the table ends) -- and that walk, given the cut table, also asks for the
    entry one past it.

    The table read as a Python list (``block_table.tolist()[k]``) says only "list index out of range", with no
    index or length, and so does any list of the answer's own: such a raise is read as the table's only when it
    is raised in ``fn``'s own code (:func:`_own_list_read_past`) and a third run pins the index: given one entry
    more than the tokens need, ``fn`` raises exactly as with the whole row, so it asked for entry ceil(kv_len / B)
    and no further.

    Asking for that entry is not yet a count one too high: an answer with the right count that reads the table one
    entry ahead of the block it gathers (``ids[k + 1]``, a prefetch) asks for it too, and its raise comes from the
    blocks it needs.  So an ask is also put to the whole row with that entry naming a block past the pool
    (:func:`_takes_a_block_from`): the second item says whether the answer took a block from it (False: it took
    none, or raised on the extra block before reading the cache).  A run that
    returns given the cut table took a slice of the table, a count, and needs no such run.
    """
    if type(exc) is IndexError and str(exc) == _read_past(table):
        return None
    # A first raise that is a list read past its end in the answer's own code may be a read past the whole row
    # (the table as a list, walked by token) or a list of the answer's own (a row count per block, sized right,
    # that the extra block overruns): only the cut table's run returning tells them apart, so only that blames.
    own_list = _own_list_read_past(fn, exc)
    needed = -(-kv_len // cache.shape[1])
    cut = table[:needed].clone()
    try:
        fn(cache.clone(), cut, kv_len)
    except Exception as again:  # noqa: BLE001 - a learner's bug, whatever it raises
        if own_list:
            return None
        if (type(again) is IndexError and str(again) == _read_past(cut) != str(exc)
                or _own_list_read_past(fn, again) and _raises_as(fn, exc, cache, table[:needed + 1].clone(), kv_len)):
            return f"asks for entry {needed}, one past them", _takes_a_block_from(fn, exc, cache, table, kv_len)
        return None
    return "raises nothing", True


def _takes_a_block_from(fn, exc: Exception, cache, table, kv_len: int) -> bool:
    """Whether ``fn``, which raised ``exc`` on ``(cache, table, kv_len)``, takes a block from the table entry just
    after the ceil(kv_len / B) that the tokens need before it raises: with that entry naming a block past the pool
    (no cache holds it), an answer that gathers it raises otherwise, or returns.  One that raises as before either
    only reads the entry (a right count reading ``ids[k + 1]`` ahead) or raises on its extra block before touching
    the cache (an up-plus-one count that asserts or clamps first): this experiment cannot tell those two apart, so
    the hint then names both.  (A right count that *loads* the next block ahead is taken for up-plus-one.)"""
    entry, poisoned = -(-kv_len // cache.shape[1]), table.clone()
    if entry >= len(table):  # (a row with no such entry: nothing to take a block from)
        return False
    poisoned[entry] = cache.shape[0]
    return not _raises_as(fn, exc, cache, poisoned, kv_len)


def _read_past(table) -> str:
    """The message of the IndexError that reading ``table`` one entry past its end raises."""
    try:
        table[len(table)]
    except IndexError as past:
        return str(past)
    raise AssertionError("a table read past its end raised nothing")


def _own_list_read_past(fn, exc: Exception) -> bool:
    """Whether ``exc`` is a Python list read past its end (``IndexError: list index out of range``) raised in
    ``fn``'s own code: its body, or a comprehension, generator or lambda written inside it.

    Why the frame: the message is the same for every list and every index, so it tells a read of the table as a
    list from nothing; raised in the answer's own lines, by a run that differs from another only in the table, it
    is the answer's read of the table (or of a list it made from it).  One raised in a library, or in a helper
    of the learner's outside ``fn``, is not read as one (the case's hint then).  A decorated answer
    (``@torch.no_grad()``) is read through its wrapper to the learner's function.
    """
    if type(exc) is not IndexError or str(exc) != "list index out of range" or exc.__traceback__ is None:
        return False
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    codes, todo = set(), [getattr(inspect.unwrap(fn), "__code__", None)]  # (a decorated answer: its own code)
    while todo:  # (nested code objects sit among their parent's constants)
        code = todo.pop()
        if hasattr(code, "co_consts") and code not in codes:
            codes.add(code)
            todo += [c for c in code.co_consts if hasattr(c, "co_consts")]
    return tb.tb_frame.f_code in codes


def _raises_as(fn, exc: Exception, cache, table, kv_len: int) -> bool:
    """Whether ``fn`` on ``(cache, table, kv_len)`` raises what it raised before (``exc``: its type and message)."""
    try:
        fn(cache.clone(), table, kv_len)
    except Exception as again:  # noqa: BLE001 - a learner's bug, whatever it raises
        return type(again) is type(exc) and str(again) == str(exc)
    return False


def check_gather_kv(fn) -> CheckResult:
    """Check ``fn(cache, block_table, kv_len) -> [kv_len, kv_heads, head_dim]``."""
    def layout():  # the cases' pool and tables; ``untouched`` gets a fresh copy of its own
        return make_paged([1, 15, 16, 17, 40], kv_heads=2, head_dim=8, seed=1)

    c = layout()
    cache, tables = c["k_cache"], c["block_tables"]
    page = cache.shape[1]

    def same(i):
        def run(f):
            n = int(c["seq_lens"][i])
            got = f(cache, tables[i], n)
            return tuple(got.shape), bool(torch.isnan(got).any()), torch.equal(got, _brute_gather(cache, tables[i], n))
        return run

    def expect(i):
        n = int(c["seq_lens"][i])
        return (n, 2, 8), False, True

    def symptom(got, want_len: int) -> str | None:
        """The usual mistake behind what came back: the length, NaN, or the order of the rows."""
        if not (isinstance(got, tuple) and len(got) == 3):
            return None
        shape, has_nan, _ = got
        if len(shape) != 3:
            return (f"a tensor of shape {tuple(shape)}: the answer is [kv_len, kv_heads, head_dim], the cache's "
                    "rows for the sequence's tokens, block after block")
        if tuple(shape[1:]) != (2, 8):
            return (f"rows of shape {tuple(shape[1:])}, not (2, 8): keep each slot's [kv_heads, head_dim] as it is in "
                    "the cache -- flatten only blocks x slots, and don't transpose")
        if shape[0] < want_len:
            return (f"{shape[0]} rows for {want_len} tokens: use ceil(kv_len / block_size) blocks (flooring drops "
                    "the partial last block)")
        # more rows than the blocks the tokens need can hold: rows of a block after them were kept, so the count
        # of blocks is too high, whatever cuts the rows (a cut to kv_len rows alone would hide it: that answer passes)
        needed = -(-want_len // page)
        if needed * page < shape[0] <= (needed + 1) * page:
            return (f"{shape[0]} rows for {want_len} tokens, more than the {needed} block(s) of {page} they need "
                    f"hold: rows of one block too many were kept -- {_ROUND_UP} (kv_len // block_size + 1 is one "
                    "too many when kv_len fills its last block)")
        if shape[0] > needed * page:
            return (f"{shape[0]} rows for {want_len} tokens, more than the {needed} block(s) of {page} they need "
                    "hold: gather only the table's first ceil(kv_len / block_size) entries, not the whole row")
        if shape[0] > want_len:
            return f"{shape[0]} rows for {want_len} tokens: cut the gathered blocks to the first kv_len rows"
        if has_nan:
            return "NaN in the output: a row after kv_len, or a block the table does not list, was read"
        return ("right shape, wrong values: take the blocks in the table's order (logical 0, 1, 2...) and each "
                "block's rows in slot order, then flatten blocks x slots -- don't sort the ids or transpose")

    def hint_for(i):
        return lambda got: symptom(got, int(c["seq_lens"][i]))

    def raise_hint_for(i):
        def explain(f, exc):
            n = int(c["seq_lens"][i])
            past = _raise_past_its_blocks(f, exc, cache, tables[i], n)
            if past is None:
                return None
            (shown, took), needed = past, -(-n // page)
            given = f"given only the table's first {needed} entr{'y' if needed == 1 else 'ies'}, this answer {shown}"
            if took:
                return (f"{n} token(s) fill {needed} block(s), and the raise comes from a block after them: {given} "
                        f"-- {_ROUND_UP} (and don't walk the whole table row)")
            return (f"{n} token(s) fill {needed} block(s): {given}, yet naming a block past the pool there leaves "
                    f"its raise as it was, so either its count is one too high and it raises on that extra block "
                    f"before reading the cache -- {_ROUND_UP} -- or it reads the table one entry ahead (ids[k + 1] at "
                    "the last block is one past the entries the tokens need) and the raise is in the blocks they "
                    "fill: is the last one cut to the kv_len - k * block_size rows it holds?")
        return explain

    def untouched(f):
        # a pool of its own: the cases before this one already ran f on ``cache``, so a write that makes the same
        # change each time (the NaN padding cleaned in place) would find nothing left to change there
        d = layout()
        pool, table = d["k_cache"], d["block_tables"]
        cache_copy, table_copy = pool.clone(), table.clone()
        f(pool, table[3], 17)
        same_cache = torch.equal(torch.nan_to_num(pool, 7.0), torch.nan_to_num(cache_copy, 7.0))
        return same_cache, torch.equal(table, table_copy)

    def agrees_with_engine(f):
        d = make_paged([3, 16, 31, 32, 33, 50], kv_heads=3, head_dim=4, page=8, share_first=True, seed=2)
        return all(torch.equal(f(d["v_cache"], d["block_tables"][i], int(n)),
                               engine_gather_kv(d["v_cache"], d["block_tables"][i], int(n)))
                   for i, n in enumerate(d["seq_lens"]))

    def keeps_dtype(f):
        # torch.equal compares values across dtypes (a float32 copy of a half-precision row is "equal"), so the
        # cases above pass an answer that allocates its output with torch.empty's defaults (float32, on the CPU);
        # the engine gathers bf16 caches on a GPU, where that answer is a copy of another dtype on another device
        d = make_paged([5, 20], kv_heads=2, head_dim=8, dtype=torch.float16, seed=3)
        got = f(d["k_cache"], d["block_tables"][1], 20)
        return str(got.dtype), torch.equal(got, _brute_gather(d["k_cache"], d["block_tables"][1], 20))

    cases = [
        Case("one token: slot 0 of the first block in the table", same(0), expect(0),
             "token 0 lives in block block_table[0] at offset 0 -- the table's first entry, not physical block 0",
             show_expected="shape (1, 2, 8), no NaN, equal to the token-by-token gather", diagnose=hint_for(0),
             diagnose_raise=raise_hint_for(0)),
        Case("15 tokens: a partial block, NaN tail left out", same(1), expect(1),
             "cut the gathered blocks to kv_len tokens: the slots after the last token hold NaN",
             show_expected="shape (15, 2, 8), no NaN, equal to the token-by-token gather", diagnose=hint_for(1),
             diagnose_raise=raise_hint_for(1)),
        Case("16 tokens: exactly one block", same(2), expect(2),
             f"a full block needs no block after it: {_ROUND_UP}",
             show_expected="shape (16, 2, 8), no NaN, equal to the token-by-token gather", diagnose=hint_for(2),
             diagnose_raise=raise_hint_for(2)),
        Case("17 tokens: one token spills into a second block", same(3), expect(3),
             "17 tokens need ceil(17 / 16) = 2 blocks; flooring loses the 17th",
             show_expected="shape (17, 2, 8), no NaN, equal to the token-by-token gather", diagnose=hint_for(3),
             diagnose_raise=raise_hint_for(3)),
        Case("40 tokens over three blocks in random pool order", same(4), expect(4),
             "follow the table's order (logical block 0, 1, 2), whatever the physical ids; blocks, then slots",
             show_expected="shape (40, 2, 8), no NaN, equal to the token-by-token gather", diagnose=hint_for(4),
             diagnose_raise=raise_hint_for(4)),
        Case("reads only: the cache and the table are unchanged", untouched, (True, True),
             "gather into a new tensor; don't write into the cache or sort the table"),
        Case("agrees with the engine's gather (page 8, 3 KV heads, a shared block)", agrees_with_engine, True,
             "use cache.shape[1] for the block size, not a hard-coded 16"),
        Case("a float16 pool: the rows keep the cache's dtype", keeps_dtype, ("torch.float16", True),
             "a gather copies the cache's rows as they are: index the cache (that keeps its dtype and device), or "
             "give torch.empty / torch.zeros dtype=cache.dtype and device=cache.device -- their defaults are "
             "float32 on the CPU"),
    ]
    return run_checks("gather_kv", fn, cases)


# -- exercise 2: the Triton decode kernel ----------------------------------------------------


def _kernel_source(kernel) -> str:
    """The kernel's Python source (empty when unreadable), for :func:`launch_decode` to spot the stub's
    ``raise NotImplementedError`` before launching: Triton's compiler has no ``raise`` (on a GPU the stub fails to
    compile, "unsupported AST node type: Raise"), and the interpreter wraps it in its own error type."""
    import inspect

    fn = getattr(kernel, "fn", kernel)
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return getattr(kernel, "src", "") or ""


def launch_decode(kernel, q, k_cache, v_cache, block_tables, seq_lens, scale, out=None) -> torch.Tensor:
    """Run ``kernel`` on a grid of (sequence, query head): the bookkeeping the learner does not write.

    Layouts: ``q`` ``[batch, q_heads, D]``; caches ``[num_blocks, page, kv_heads, D]`` (the
    engine's), K and V with the same strides and ``D`` contiguous; ``block_tables`` int32
    ``[batch, max_blocks]``; ``seq_lens`` int32 ``[batch]``.  Returns ``out`` (fp32).
    """
    if "raise NotImplementedError" in _kernel_source(kernel):
        raise NotImplementedError("write the kernel's GQA mapping and its loop over the KV blocks")
    batch, q_heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if q_heads % kv_heads:
        raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
    for name, n in (("head_dim", head_dim), ("block size", page)):
        if n & (n - 1):
            raise ValueError(f"{name} {n} must be a power of two (tl.arange needs one)")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches need identical strides with head_dim contiguous")
    q = q.contiguous()
    if out is None:
        out = torch.full((batch, q_heads, head_dim), float("nan"), dtype=torch.float32, device=q.device)
    try:
        kernel[(batch, q_heads)](
            q, k_cache, v_cache, block_tables, seq_lens, out, scale,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=q_heads // kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page,
        )
    except Exception as exc:  # the interpreter wraps a stub's NotImplementedError in its own error type
        if "NotImplementedError" in repr(exc):
            raise NotImplementedError("write the kernel's GQA mapping and its loop over the KV blocks") from None
        raise
    return out


def engine_decode(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """The engine's split-KV Triton kernel (:func:`minivllm.model.kernels.paged_decode`), same call shape."""
    from minivllm.model.kernels import paged_decode

    return paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale,
                        max_seq_len=int(seq_lens.max())).float()


def _big_pool_case(device: str = "cpu") -> dict:
    """Three blocks whose element offset is 2^32 and a little more: int32 offsets wrap to blocks 0..2.

    The pool spans 8 GiB of addresses.  On a CPU it is a sparse file mapped
    shared (no memory is reserved, only the touched pages exist); on a GPU, real
    memory.  Blocks 0..2, where a wrapped offset lands, hold NaN.
    """
    page, head_dim = PAGE, 16
    block_elems = 2 * page * head_dim  # K and V of one block interleaved: stride 512 = 2^9
    first = 2 ** 32 // block_elems  # block id whose offset is exactly 2^32 elements
    num_blocks = first + 4
    if device == "cpu":
        with tempfile.NamedTemporaryFile(prefix="lab07_pool_") as f:
            flat = torch.from_file(f.name, shared=True, size=num_blocks * block_elems, dtype=torch.float16)
    else:
        flat = torch.empty(num_blocks * block_elems, dtype=torch.float16, device=device)
    pool = flat.view(num_blocks, 2, page, 1, head_dim)
    small = make_paged([40], head_dim=head_dim, dtype=torch.float16, shuffle=False, seed=5)
    pool[:4] = float("nan")
    pool[first:first + 3, 0] = small["k_cache"][:3].to(device)
    pool[first:first + 3, 1] = small["v_cache"][:3].to(device)
    table = torch.tensor([[first, first + 1, first + 2, first + 3]], dtype=torch.int32, device=device)
    # the oracle reads the small copy: converting the 8 GiB pool to fp32 would touch every page
    want = reference_decode(small["q"], small["k_cache"], small["v_cache"], small["block_tables"],
                            small["seq_lens"], small["scale"]).to(device)
    return {"q": small["q"].to(device), "k_cache": pool[:, 0], "v_cache": pool[:, 1], "block_tables": table,
            "seq_lens": small["seq_lens"].to(device), "scale": small["scale"], "want": want}


def _decode_error(run: Callable, case: dict) -> tuple[bool, float]:
    """(every output finite, max |error| vs the engine's torch reference)."""
    out = _decode_outcome(run, case, tol=float("inf"))
    return out.finite, out.err


@dataclass(frozen=True)
class DecodeOutcome:
    """What a kernel's output looked like on one case: enough to tell the learner *which* rows went wrong."""

    ok: bool
    finite: bool
    err: float  # max |error| over every row (NaN when any row is not finite)
    nan_lens: tuple[int, ...]  # lengths of the sequences with a non-finite output
    wrong_lens: tuple[int, ...]  # lengths of the finite sequences outside the tolerance

    def __repr__(self) -> str:
        parts = [f"max |error| {self.err:.3g}"]
        if self.nan_lens:
            parts.append(f"NaN for sequences of length {list(self.nan_lens)}")
        if self.wrong_lens:
            parts.append(f"finite but wrong for length {list(self.wrong_lens)}")
        return "; ".join(parts)


def _decode_outcome(run: Callable, case: dict, tol: float) -> DecodeOutcome:
    got = run(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], case["seq_lens"], case["scale"])
    want = case.get("want")
    if want is None:
        want = reference_decode(case["q"], case["k_cache"], case["v_cache"], case["block_tables"],
                                case["seq_lens"], case["scale"])
    lens = [int(n) for n in case["seq_lens"]]
    rows_finite = torch.isfinite(got).flatten(1).all(1).tolist()
    errs = (got.float() - want).abs().flatten(1).amax(1).tolist()
    nan_lens = tuple(n for n, f in zip(lens, rows_finite) if not f)
    wrong_lens = tuple(n for n, f, e in zip(lens, rows_finite, errs) if f and not e < tol)
    finite = not nan_lens
    err = max(errs) if finite else float("nan")
    return DecodeOutcome(finite and not wrong_lens, finite, err, nan_lens, wrong_lens)


def _diagnose_decode(page: int):
    """A hint from the symptom: which rows are NaN, which finite but wrong, and how many blocks they span."""
    def diagnose(out) -> str | None:
        if not isinstance(out, DecodeOutcome):
            return None
        if out.nan_lens and all(n < page for n in out.nan_lens):
            return (f"NaN for length {list(out.nan_lens)}, shorter than one block: did the loop run at all? It must "
                    "run ceil(seq_len / PAGE_SIZE) times (0 / 0 is NaN); else a slot at or after seq_len was read")
        if out.nan_lens:
            return (f"NaN for length {list(out.nan_lens)}: a slot at or after seq_len was read (mask the K/V loads AND "
                    "the scores with token < seq_len), the partial last block was skipped (ceil, not floor), or exp "
                    "overflowed (subtract the running max)")
        if out.wrong_lens and all(n > page for n in out.wrong_lens):
            return (f"finite but wrong only where a sequence spans several blocks ({list(out.wrong_lens)}): the fold "
                    "of a new block into (m_i, l_i, acc) -- m_new = max(m_i, the block's max); rescale BOTH l_i and "
                    "acc by exp(m_i - m_new); then m_i = m_new -- or the table lookup for blocks after the first")
        if out.wrong_lens:
            return (f"finite but wrong even within one block ({list(out.wrong_lens)}): are the scores multiplied by "
                    "scale, are masked scores -inf (a 0 still weighs exp(0 - m) in the sum), is q the right head's "
                    "row, is V read from the same slots as K, and is acc / l_i stored?")
        return None
    return diagnose


def check_decode_kernel(kernel, *, big_pool: bool = True) -> CheckResult:
    """Check a ``@triton.jit`` decode kernel with :func:`launch_decode`'s signature in the interpreter (or on a GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def run(q, k, v, tables, lens, scale):
        return launch_decode(kernel, q, k, v, tables, lens, scale)

    def close(case_kwargs, tol=1e-4):
        def go(_):
            return _decode_outcome(run, make_paged(**case_kwargs, device=device), tol)
        return go

    def ok(got):
        return got.ok

    def shown(tol=1e-4):
        return f"every output finite, max |error| < {tol:g} vs the engine's torch reference"

    by_symptom = _diagnose_decode(PAGE)  # for the cases whose failures have several usual causes

    cases = [
        Case("one sequence of one token", close({"lens": [1]}), accept=ok, show_expected=shown(), diagnose=by_symptom,
             hint="with one key, softmax weight 1: the output is that token's V row. Is the last block's mask "
                  "`token < seq_len` and does the loop run ceil(seq_len / PAGE_SIZE) times?"),
        Case("lengths 15, 16, 17, 32 at the block edges (NaN after the last token)",
             close({"lens": [15, 16, 17, 32], "shuffle": False}), accept=ok, show_expected=shown(), diagnose=by_symptom,
             hint="a NaN means a slot at or after seq_len was read: mask the K/V loads AND the scores with "
                  "token < seq_len; a wrong value at 17 or 15 means the partial last block was skipped"),
        Case("blocks out of order in the pool, one block shared by two sequences",
             close({"lens": [40, 33, 5], "share_first": True, "seed": 3}), accept=ok, show_expected=shown(),
             hint="the physical block is block_table[seq, b] -- read this sequence's row of the table "
                  "(seq * stride_table_seq), not logical block b of the pool"),
        Case("several blocks: the running max grows from block to block",
             close({"lens": [64, 50], "q_scale": 2.0, "seed": 4}), accept=ok, show_expected=shown(), diagnose=by_symptom,
             hint="when a block raises the max, the old sum AND the old accumulator were weighted by exp(-old max): "
                  "rescale both by exp(old max - new max), then remember the new max"),
        Case("the largest score is in the first block: the running max must not fall",
             close({"lens": [40, 19], "spike_first": 150.0, "seed": 5}), accept=ok, show_expected=shown(),
             hint="m_new is the larger of the old max and this block's max: taking the block's own max lets the "
                  "reference fall by ~150, and exp(m_i - m_new) = exp(150) overflows to inf"),
        Case("large scores (q scaled by 40): softmax needs the running max",
             close({"lens": [48, 20], "q_scale": 40.0, "seed": 6}), accept=ok, show_expected=shown(),
             hint="exp(score) overflows float32 above ~88: subtract the running max before exp, never after"),
        Case("GQA: 6 query heads share 2 KV heads", close({"lens": [17, 30], "kv_heads": 2, "group": 3, "seed": 7}),
             accept=ok, show_expected=shown(),
             hint="query heads 0..GROUP-1 read KV head 0, the next GROUP read KV head 1: integer-divide by GROUP"),
        Case("GQA 4:1 with head_dim 32 and a page of 8", close({"lens": [9, 24, 8], "kv_heads": 1, "group": 4,
                                                                "head_dim": 32, "page": 8, "seed": 8}),
             accept=ok, show_expected=shown(),
             hint="use the PAGE_SIZE and HEAD_DIM constants and the strides you are given, not 16"),
        Case("K and V interleaved in one pool: a block's stride is its own",
             close({"lens": [20, 7], "interleaved": True, "seed": 9}), accept=ok, show_expected=shown(),
             hint="address a block as block_id * stride_kv_block, not block_id * PAGE_SIZE * stride_kv_token: "
                  "a pool may hold more than this cache's rows between two of its blocks"),
        Case("K and V side by side per KV head: a head's stride is its own",
             close({"lens": [17, 6], "kv_heads": 2, "group": 2, "heads_apart": True, "seed": 11}), accept=ok,
             show_expected=shown(),
             hint="address a KV head as kv_head * stride_kv_head, not kv_head * HEAD_DIM: here each head's K is "
                  "followed by its V, so the next head starts 2 x HEAD_DIM further on"),
        Case("a softmax scale other than 1/sqrt(head_dim)", close({"lens": [17, 5], "scale": 0.1, "seed": 10}),
             accept=ok, show_expected=shown(), diagnose=by_symptom,
             hint="multiply the scores by the kernel's scale argument, not by 1/sqrt(HEAD_DIM): a model may pick "
                  "its own (Gemma 2's query_pre_attn_scalar, Granite's attention multiplier)"),
    ]
    if big_pool and device == "cuda" and torch.cuda.mem_get_info()[0] < 10 * 2 ** 30:
        print("(the 2^32-element pool case needs 10 GiB of free GPU memory and is left out on this GPU; "
              "the interpreter runs it on any CPU)")
        big_pool = False
    if big_pool:
        def big(_):
            return _decode_outcome(run, _big_pool_case(device), 1e-2)

        cases.append(Case("a pool of 2^32+ elements: block offsets in int64", big, accept=ok,
                          show_expected="every output finite, max |error| < 0.01 (fp16 cache)",
                          hint="block_id * stride_kv_block overflows int32 here (2^23 x 512 = 2^32 wraps to 0, a "
                               "NaN block): widen the block id with .to(tl.int64) before multiplying"))
    return run_checks("decode kernel", kernel, cases)


# -- hidden cases for the grader: the same rules on seeded shapes the notebook never shows --------


def _edge_lengths(rng, page: int, n: int) -> list[int]:
    """``n`` lengths, most of them at a block edge (k*page - 1, k*page, k*page + 1) or 1."""
    out = []
    for _ in range(n):
        k = rng.randint(1, 4)
        out.append(max(1, rng.choice([1, k * page - 1, k * page, k * page + 1, rng.randint(1, 4 * page)])))
    return out


def hidden_gather_kv(fn, seed: int) -> CheckResult:
    """Grader-only: random pages, heads and edge lengths, against the token-by-token definition."""
    import random

    rng = random.Random(seed)
    cases = []
    for trial in range(3):
        page = rng.choice([4, 8, 16, 32])
        kv_heads, head_dim = rng.randint(1, 3), rng.choice([2, 4, 8])
        lens = _edge_lengths(rng, page, 4)
        c = make_paged(lens, kv_heads=kv_heads, head_dim=head_dim, page=page, share_first=bool(trial % 2),
                       seed=seed * 10 + trial)

        def run(f, c=c):
            return all(torch.equal(f(c["k_cache"], c["block_tables"][i], int(n)),
                                   _brute_gather(c["k_cache"], c["block_tables"][i], int(n)))
                       for i, n in enumerate(c["seq_lens"]))

        cases.append(Case(f"hidden gather: page {page}, lengths {lens}", run, True,
                          "compare with the definition: token p is in block table[p // B] at slot p % B"))
    return run_checks("gather_kv (hidden)", fn, cases, verbose=False)


def hidden_decode_kernel(kernel, seed: int) -> CheckResult:
    """Grader-only: seeded GQA shapes, pages and edge lengths, large and small scores, in the interpreter."""
    import random

    rng = random.Random(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def run(q, k, v, tables, lens, scale):
        return launch_decode(kernel, q, k, v, tables, lens, scale)

    cases = []
    for trial in range(2):
        page = rng.choice([8, 16])
        shape = dict(kv_heads=rng.choice([1, 2]), group=rng.choice([1, 2, 3, 4]), head_dim=rng.choice([16, 32]),
                     page=page, q_scale=rng.choice([1.0, 3.0, 30.0]), share_first=True, seed=seed * 10 + trial,
                     interleaved=trial == 1,  # one trial with K and V interleaved: blocks found by their stride
                     heads_apart=trial == 0)  # the other with K and V side by side per head: heads by theirs
        if trial == 0:
            shape["kv_heads"] = 2  # a head 1, so that its stride is read
        lens = _edge_lengths(rng, page, 3)

        def go(_, lens=lens, shape=shape):
            finite, err = _decode_error(run, make_paged(lens, device=device, **shape))
            return finite and err < 1e-4

        cases.append(Case(f"hidden decode: lengths {lens}, {shape}", go, True,
                          "every output finite and within 1e-4 of the engine's torch reference"))
    return run_checks("decode kernel (hidden)", kernel, cases, verbose=False)


# -- planted bugs (text patches on the solution regions of solutions/lab07_*.ipynb) ----------

GATHER_MUTANTS = (
    ("floor instead of ceiling: the partial last block is lost", "-(-kv_len // block_size)", "(kv_len // block_size)"),
    ("the table read backwards", "block_table[:num_blocks]", "block_table[:num_blocks].flip(0)"),
    ("the tail of the last block is not cut", "[:kv_len]", ""),
    ("the table is ignored: blocks 0, 1, 2 of the pool", "cache[block_table[:num_blocks].long()]",
     "cache[:num_blocks]"),
    ("slots before blocks: the wrong flattening order", "blocks.flatten(0, 1)",
     "blocks.transpose(0, 1).flatten(0, 1)"),
    ("block size hard-coded to 16", "-(-kv_len // block_size)", "-(-kv_len // 16)"),
    ("off by one: starts at the second token", "[:kv_len]", "[1:kv_len + 1]"),
    # the right rows, but the shared pool is written: kills an "untouched" case that no longer compares the cache
    ("cleans the pool's NaN padding in place", "cache[block_table[:num_blocks].long()]",
     "cache.nan_to_num_()[block_table[:num_blocks].long()]"),
    # torch.equal reads a float32 copy of float16 rows as equal: kills a checker that compares values only
    ("the rows copied into torch.zeros' defaults (float32), not the cache's dtype",
     "    return blocks.flatten(0, 1)[:kv_len]\n",
     "    out = torch.zeros(kv_len, *cache.shape[2:])\n    out[:] = blocks.flatten(0, 1)[:kv_len]\n    return out\n"),
)

KERNEL_MUTANTS = (
    ("off-by-one at the block edge: token == seq_len is read", "valid = tokens < seq_len", "valid = tokens <= seq_len"),
    ("floor: the partial last block is skipped", "tl.cdiv(seq_len, PAGE_SIZE)", "seq_len // PAGE_SIZE"),
    ("missing mask on the V load", "v = tl.load(v_ptr + slots, mask=valid[:, None], other=0.0)",
     "v = tl.load(v_ptr + slots)"),
    ("missing mask on the scores", 'tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))',
     "tl.sum(k * q[None, :], 1) * scale"),
    ("softmax without the running max", "alpha = tl.exp(m_i - m_new)\n        p = tl.exp(scores - m_new)",
     "alpha = 1.0\n        p = tl.exp(scores)"),
    ("accumulator not rescaled when the max grows", "acc = acc * alpha +", "acc = acc +"),
    ("running sum not rescaled when the max grows", "l_i = l_i * alpha +", "l_i = l_i +"),
    ("running max never updated", "        m_i = m_new\n", ""),
    ("the new max is the block's own max", "m_new = tl.maximum(m_i, tl.max(scores, 0))",
     "m_new = tl.max(scores, 0)"),
    ("wrong GQA head mapping (modulo)", "kv_head = head // GROUP", "kv_head = head % GROUP"),
    ("GQA ignored: query head h reads KV head h", "kv_head = head // GROUP", "kv_head = head"),
    ("table index not widened to int64", "block = tl.load(table_ptr + seq * stride_table_seq + b).to(tl.int64)",
     "block = tl.load(table_ptr + seq * stride_table_seq + b)"),
    ("every sequence reads sequence 0's table row", "table_ptr + seq * stride_table_seq + b", "table_ptr + b"),
    ("blocks assumed contiguous: block * PAGE_SIZE * stride_kv_token", "slots = block * stride_kv_block +",
     "slots = block * PAGE_SIZE * stride_kv_token +"),
    ("scale hard-coded to 1/sqrt(HEAD_DIM), the scale argument ignored", '* scale, float("-inf"))',
     '/ tl.sqrt(HEAD_DIM * 1.0), float("-inf"))'),
)


LAB = Lab(
    number=7,
    stem="lab07_triton_paged_attention",
    title="Triton paged attention",
    exercises=(
        Exercise("gather_kv", "gather_kv", check_gather_kv, points=1, mutants=GATHER_MUTANTS,
                 hidden=hidden_gather_kv),
        Exercise("decode_kernel", "decode_kernel", check_decode_kernel, points=2, mutants=KERNEL_MUTANTS,
                 hidden=hidden_decode_kernel),
    ),
    widgets=("next block",),
)


# -- section 4: what the kernel cannot fix -------------------------------------------------

# Measured on an NVIDIA H200 with a random-weight Llama-3.2-1B in bf16 (``python -m minivllm.bench eager_step``,
# benchmarks/results/2026-11-30_nvidia-h200_eager_step_{64,512}.json): one eager step carrying a 64- or
# 512-token prompt, and a decode step replayed as a CUDA graph (scheduling and sampling included), p50.
H200_LLAMA1B = {"launches_per_eager_step": 706, "eager_64_ms": 10.93, "eager_512_ms": 10.49, "graph_decode_ms": 2.50,
                "launch_api_us_per_step": 3235}


def step_operations(engine, prompt_len: int = 64) -> dict:
    """Count the tensor operations of one prompt step and one decode step of a real engine.

    Each is about one kernel launch on a GPU, so the counts say how many times
    an *eager* step asks the host to launch something, on any device.  Returns
    ``{"prompt": OpCounter, "decode": OpCounter}`` (``.n`` the total, ``.names`` by operator).
    """
    from minivllm.bench.eager_step import forward_ops
    from minivllm.sampling_params import SamplingParams

    engine.add_request({"prompt_token_ids": [100 + i % 500 for i in range(prompt_len)]},
                       SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="count-ops")
    (prompt,) = forward_ops(engine, engine.step)
    (decode,) = forward_ops(engine, engine.step)
    while engine.has_unfinished_requests():
        engine.step()
    return {"prompt": prompt, "decode": decode}


def op_floor_us(sizes, repeats: int = 200, rounds: int = 5) -> list[float]:
    """Median microseconds of one elementwise add of ``n`` float32 numbers, for each ``n`` in ``sizes``.

    Why an add: it does almost no arithmetic per byte, so its time is the fixed
    cost of issuing one operation (Python, the dispatcher, the kernel's start)
    plus the bytes it moves; on a small tensor only the fixed cost is left.  One
    thread: a large add would otherwise fan out over the cores, and on a busy
    machine wait for them, which is another curve than the one this draws.
    """
    out, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for n in sizes:
            out.append(_median_add_us(int(n), repeats, rounds))
    finally:
        torch.set_num_threads(threads)
    return out


def _median_add_us(n: int, repeats: int, rounds: int) -> float:
    import statistics
    import time

    x, y = torch.randn(n), torch.randn(n)
    z = torch.empty_like(x)
    for _ in range(20):
        torch.add(x, y, out=z)
    per_round = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(repeats):
            torch.add(x, y, out=z)
        per_round.append((time.perf_counter() - t0) / repeats)
    return 1e6 * statistics.median(per_round)


# -- quiz answers computed from the lab's own functions -------------------------------------


def quiz_kv_kib_per_sequence() -> int:
    """KiB of K+V one decode step reads per layer for a 4,096-token SmolLM2 sequence (3 KV heads, D 64, bf16)."""
    case = {"k_cache": torch.empty(0, 16, 3, 64, dtype=torch.bfloat16), "seq_lens": torch.tensor([4096])}
    return kv_bytes(case) // 1024
