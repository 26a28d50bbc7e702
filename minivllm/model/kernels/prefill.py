"""Prefill and chunked-prefill attention over the paged cache.

A prefill sequence contributes a *chunk* of ``q_len`` new tokens whose K/V
have already been written to the cache behind ``ctx`` cached tokens (``ctx``
is 0 for a fresh prompt, the cached prefix for a prefix-cache hit, or the
earlier chunks for chunked prefill).  Query ``i`` of the chunk sits at absolute
position ``ctx + i`` and sees keys ``0 .. ctx + i``: everything cached, plus
the chunk causally.  The kernel never needs ``ctx`` as an input: it is
``seq_len - q_len``.

Work division.  The batch is ragged (every sequence has its own ``q_len`` and
``ctx``), so the grid is sized for the longest chunk and programs beyond a
sequence's chunk exit at once::

    grid = (q_heads, cdiv(max_q_len, BLOCK_M), num_prefill_seqs)

One program computes ``BLOCK_M`` query rows of one head with a FlashAttention
loop over KV tiles fetched through the block table.  Heads are the fastest grid
axis so that the ``GROUP`` heads sharing a KV head run side by side and find its
tiles in L2.  Query tiles are visited last-first: later tiles see more keys, and
starting the longest work first shortens the tail of the launch.

The KV loop has two phases.  Keys ``< ctx + row0 + 1`` (``row0`` = the tile's
first row) are visible to every row, so whole tiles there need no causal mask;
only the remaining tiles, which cross the diagonal, build one.

Why decode rows are *not* handled here.  The backend sends the ``num_decodes``
leading single-token sequences to :mod:`minivllm.model.kernels.decode` instead.  A
decode row would occupy a ``BLOCK_M``-row tile to use one row of it and would
re-read K/V once per query head; the decode kernel packs a whole GQA group into
one tile and splits long contexts across SMs, which is what a memory-bound
single-token query needs.  The cost is a second launch per step, which is small
next to either kernel.
"""

from __future__ import annotations

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
)
from minivllm.model.kernels.tiles import load_paged_tile, online_softmax_step

LOG2E = 1.4426950408889634

# Arguments that change from step to step (see the ``launch`` module docstring).
PREFILL_STEP_VARYING = ("first_seq", "num_q_tiles", "stride_table_seq")


@triton.jit(do_not_specialize=PREFILL_STEP_VARYING)
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    qk_scale,
    first_seq,
    num_q_tiles,
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
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (query head, tile of BLOCK_M chunk rows, sequence) of a ragged prefill batch."""
    head = tl.program_id(0)
    tile = num_q_tiles - 1 - tl.program_id(1)
    seq = (first_seq + tl.program_id(2)).to(tl.int64)

    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    row0 = tile * BLOCK_M
    if row0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx = seq_len - q_len

    rows = row0 + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < q_len
    dim_ok = dims < HEAD_DIM
    tokens_q = (q_start + rows).to(tl.int64)
    q = tl.load(
        q_ptr + tokens_q[:, None] * stride_qt + head.to(tl.int64) * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    kv_head = head // GROUP
    table_row = table_ptr + seq * stride_table_seq
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Phase 1: tiles every row of this query tile sees in full (no causal mask).
    kv_end = ctx + tl.minimum(row0 + BLOCK_M, q_len)  # one past the last visible key
    full_end = ((ctx + row0 + 1) // BLOCK_N) * BLOCK_N
    for tile_start in range(0, full_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_ok = tokens < kv_end
        k = load_paged_tile(k_ptr, table_row, tokens, token_ok, kv_head, dims, dim_ok,
                            stride_kb, stride_kt, stride_kh, stride_kd, stride_table_blk,
                            PAGE_SIZE, UPCAST)
        v = load_paged_tile(v_ptr, table_row, tokens, token_ok, kv_head, dims, dim_ok,
                            stride_vb, stride_vt, stride_vh, stride_vd, stride_table_blk,
                            PAGE_SIZE, UPCAST)
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, token_ok[None, :],
                                            qk_scale, DOT_PRECISION)

    # Phase 2: tiles crossing the diagonal; row r sees keys <= ctx + r.
    positions = ctx + rows
    for tile_start in range(full_end, kv_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_ok = tokens < kv_end
        k = load_paged_tile(k_ptr, table_row, tokens, token_ok, kv_head, dims, dim_ok,
                            stride_kb, stride_kt, stride_kh, stride_kd, stride_table_blk,
                            PAGE_SIZE, UPCAST)
        v = load_paged_tile(v_ptr, table_row, tokens, token_ok, kv_head, dims, dim_ok,
                            stride_vb, stride_vt, stride_vh, stride_vd, stride_table_blk,
                            PAGE_SIZE, UPCAST)
        visible = (tokens[None, :] <= positions[:, None]) & token_ok[None, :]
        acc, m_i, l_i = online_softmax_step(acc, m_i, l_i, q, k, v, visible, qk_scale, DOT_PRECISION)

    # Every row saw key 0 in the first tile, so l_i > 0 for real rows; padding rows are not stored.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + tokens_q[:, None] * stride_ot + head.to(tl.int64) * stride_oh + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def _default_tiles(q: torch.Tensor) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)``: Hopper-sized on a GPU, small in the interpreter."""
    if not is_gpu(q):
        return 16, 16, 4
    if q.shape[-1] > 64:
        return 128, 64, 8
    return 64, 64, 4


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    first_seq: int,
    num_seqs: int,
    max_query_len: int,
    out: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Chunked-prefill attention for sequences ``first_seq .. first_seq + num_seqs - 1``.

    ``q`` and ``out`` are the whole flat batch ``[num_tokens, q_heads, D]``;
    ``query_start_loc`` locates each sequence's chunk in it and only those rows
    of ``out`` are written.  ``max_query_len`` (host int) sizes the grid.
    """
    if num_seqs == 0 or max_query_len == 0:
        return out
    _, num_heads, head_dim = q.shape
    _, page_size, kv_heads, _ = k_cache.shape
    check_shapes(q, k_cache, v_cache)
    check_rows(first_seq + num_seqs, block_tables, seq_lens)
    if query_start_loc.shape[0] < first_seq + num_seqs + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries, "
                         f"sequences {first_seq}..{first_seq + num_seqs - 1} need {first_seq + num_seqs + 1}")
    default_m, default_n, num_warps = _default_tiles(q)
    block_m = check_tile("block_m", block_m or default_m)
    block_n = check_tile("block_n", block_n or default_n)
    num_q_tiles = triton.cdiv(max_query_len, block_m)
    launch = {"num_warps": num_warps, "num_stages": 2} if is_gpu(q) else {}
    _prefill_kernel[(num_heads, num_q_tiles, num_seqs)](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens,
        scale * LOG2E, first_seq, num_q_tiles,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=dot_tile(head_dim), PAGE_SIZE=page_size, UPCAST=needs_upcast(q),
        DOT_PRECISION=dot_precision(q.dtype), **launch,
    )
    return out
