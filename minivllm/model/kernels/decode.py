"""Decode attention over the paged cache: split-KV ("flash-decoding") in two stages.

A decode step has one query token per sequence.  Attention for it is a
matrix-*vector* product against the sequence's whole KV history: it reads
``kv_len * kv_heads * head_dim * 2`` elements and does almost no arithmetic per
byte, so its speed is the speed at which K and V stream out of memory.  Two
design choices follow.

**Read K/V once per GQA group.**  With grouped-query attention, ``GROUP`` query
heads share one KV head.  One program handles all of them: the group's query
vectors form a ``[BLOCK_H, D]`` tile (padded with zero rows to ``BLOCK_H >= 16``
so ``tl.dot`` maps onto tensor cores), and each K/V tile loaded is used by every
head of the group.  A per-query-head grid would read the same K/V ``GROUP``
times.

**Split the KV range to fill the GPU.**  One program per (sequence, KV head)
gives only ``batch * kv_heads`` programs -- 3 for a single SmolLM2 sequence,
far too few for 132 SMs.  Stage 1 therefore splits each sequence's KV range
into ``S`` contiguous parts; program ``(b, h, s)`` computes a softmax-weighted
sum over its part and records its log-sum-exp.  Stage 2, one program per
(sequence, query head), merges the ``S`` partial results::

    out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m),   m = max_s lse_s

(with ``o_s`` already normalised inside split ``s``; lse in log2 units).
:func:`choose_num_splits` picks ``S``; when ``S == 1`` stage 1 writes the final
output directly and stage 2 is skipped.

Grids: stage 1 ``(batch, kv_heads, S)``, stage 2 ``(batch, q_heads)``.
Each sequence divides *its own* length among its ``S`` programs (in whole
tiles), so short and long sequences in a batch get proportionate work; splits
that end up empty write ``lse = -inf`` and weigh nothing in the merge.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from minivllm.model.kernels.launch import (
    check_rows,
    check_shapes,
    check_tile,
    dot_precision,
    dot_tile,
    is_gpu,
    needs_upcast,
    next_power_of_2,
    num_compute_units,
)
from minivllm.model.kernels.tiles import load_paged_tile, online_softmax_step

LOG2E = 1.4426950408889634

# Heuristic constants for the split count (see choose_num_splits).
_WAVES_PER_UNIT = 4  # programs per SM we aim for, so memory latency overlaps
_MIN_TOKENS_PER_SPLIT = 256  # at most one split per started stretch of this many tokens (see choose_num_splits)
_MAX_SPLITS = 64
_MERGE_BLOCK_S = next_power_of_2(_MAX_SPLITS)  # one merge binary for every split count up to the cap

# Arguments that change from step to step (see the ``launch`` module docstring): the split count, the
# block table's width (its row stride), and the partial buffers' strides, which follow the split count.
SPLIT_STEP_VARYING = ("num_splits", "stride_table_seq", "stride_po_seq", "stride_po_head",
                      "stride_pl_seq", "stride_pl_head")
MERGE_STEP_VARYING = ("num_splits", "stride_po_seq", "stride_po_head", "stride_pl_seq", "stride_pl_head")


@triton.jit(do_not_specialize=SPLIT_STEP_VARYING)
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    qk_scale,
    num_splits,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_table_seq,
    stride_table_blk,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Stage 1: one (sequence, KV head, split) -> partial output and log-sum-exp per group head."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = (kv_head * GROUP + rows).to(tl.int64)
    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = table_ptr + seq * stride_table_seq
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_ok = tokens < end
        k = load_paged_tile(k_ptr, table_row, tokens, token_ok, kv_head, dims, dim_ok,
                            stride_kb, stride_kt, stride_kh, stride_kd, stride_table_blk,
                            PAGE_SIZE, UPCAST)
        v = load_paged_tile(v_ptr, table_row, tokens, token_ok, kv_head, dims, dim_ok,
                            stride_vb, stride_vt, stride_vh, stride_vd, stride_table_blk,
                            PAGE_SIZE, UPCAST)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, token_ok[None, :],
                                            qk_scale, DOT_PRECISION)

    # An empty split has l_i == 0: its output is 0 and its weight 2^-inf == 0.
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    part = acc / safe_l[:, None]
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if DIRECT:
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od,
            part.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        lse = tl.where(has_keys, m_i + tl.log2(safe_l), float("-inf"))
        po = part_out_ptr + seq * stride_po_seq + split * stride_po_split
        tl.store(po + heads[:, None] * stride_po_head + dims[None, :], part, mask=store_mask)
        pl = part_lse_ptr + seq * stride_pl_seq + split
        tl.store(pl + heads * stride_pl_head, lse, mask=row_ok)


@triton.jit(do_not_specialize=MERGE_STEP_VARYING)
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_pl_seq,
    stride_pl_head,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Stage 2: one (sequence, query head) -> rescale and sum the partial outputs of all splits."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    dim_ok = dims < HEAD_DIM

    lse = tl.load(part_lse_ptr + seq * stride_pl_seq + head * stride_pl_head + splits,
                  mask=split_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: avoid -inf - -inf
    weights = tl.exp2(lse - m)
    total = tl.sum(weights, 0)
    parts = tl.load(
        part_out_ptr + seq * stride_po_seq + head * stride_po_head
        + splits[:, None] * stride_po_split + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    merged = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims * stride_od,
             merged.to(out_ptr.dtype.element_ty), mask=dim_ok)


def choose_num_splits(batch: int, kv_heads: int, max_seq_len: int, num_units: int) -> int:
    """How many parts to split each sequence's KV range into.

    Enough programs to give every SM ``_WAVES_PER_UNIT`` of them, but at most one
    split per started ``_MIN_TOKENS_PER_SPLIT`` tokens of ``max_seq_len`` (tiny
    splits add merge traffic and launch overhead without adding bandwidth), and
    at most ``_MAX_SPLITS``.  The count rounds up, so splits can be shorter than
    ``_MIN_TOKENS_PER_SPLIT``: 300 tokens get 2 splits (192 + 108 tokens in 64-token tiles).
    A large batch already fills the GPU and gets ``S = 1`` (no merge stage).
    """
    programs = batch * kv_heads
    wanted = math.ceil(_WAVES_PER_UNIT * num_units / max(programs, 1))
    useful = math.ceil(max_seq_len / _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, _MAX_SPLITS))


def _default_block_n(q: torch.Tensor) -> int:
    """KV tile length: 64 on a GPU; 32 in the interpreter.

    Not for speed: 64 runs 1.5-1.9x faster in the interpreter (40-1000 tokens).  The interpreter tests use
    short contexts (53 tokens at most in ``RAGGED_DECODE``), and 32-token tiles give those several tiles per
    sequence and a non-empty second split at ``num_splits=2``, which 64 would leave untested.
    """
    return 64 if is_gpu(q) else 32


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence, ``q: [batch, q_heads, D]``, through the paged cache.

    Sequence ``b`` attends to its first ``seq_lens[b]`` cached tokens (its new
    token's K/V must already be written).  ``max_seq_len`` is a host-side upper
    bound on ``seq_lens`` used only to size the split count, so no device sync
    is needed.  Returns ``out`` (allocated if not given), ``[batch, q_heads, D]``.
    """
    batch, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    check_shapes(q, k_cache, v_cache)
    check_rows(batch, block_tables, seq_lens)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(batch, kv_heads, max_seq_len, num_compute_units(q.device))
    if num_splits < 1:  # a grid with no programs would return `out` unwritten
        raise ValueError(f"num_splits={num_splits} must be >= 1")
    block_n = check_tile("block_n", block_n or _default_block_n(q))
    block_d = dot_tile(head_dim)
    direct = num_splits == 1

    if direct:  # stage 1 writes `out`; the partial buffers are never touched
        part_out = part_lse = out.new_empty((1,), dtype=torch.float32)
        po_strides, pl_strides = (0, 0, 0), (0, 0)
    else:
        part_out = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
        po_strides, pl_strides = part_out.stride()[:3], part_lse.stride()[:2]

    launch = {"num_warps": 4, "num_stages": 2} if is_gpu(q) else {}
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse, out,
        scale * LOG2E, num_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(),
        *po_strides, *pl_strides, *out.stride(),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_H=dot_tile(group), BLOCK_N=block_n, BLOCK_D=block_d,
        PAGE_SIZE=page_size, UPCAST=needs_upcast(q), DOT_PRECISION=dot_precision(q.dtype),
        DIRECT=direct, **launch,
    )
    if not direct:
        _decode_merge_kernel[(batch, num_heads)](
            part_out, part_lse, out, num_splits,
            *po_strides, *pl_strides, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_S=max(_MERGE_BLOCK_S, next_power_of_2(num_splits)), BLOCK_D=block_d,
            **({"num_warps": 4} if is_gpu(q) else {}),
        )
    return out
