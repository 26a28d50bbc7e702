"""The two building blocks every paged-attention kernel here is made of.

1. :func:`load_paged_tile` gathers ``BLOCK_N`` consecutive *logical* token
   positions of one sequence from the paged cache.  Position ``t`` lives in
   physical block ``block_table[t // PAGE_SIZE]`` at offset ``t % PAGE_SIZE``,
   so a tile may straddle several physical blocks that sit anywhere in the pool.
   Gathering per token (rather than per page) lets the tile size and the page
   size be chosen independently: a 64-token tile over 16-token pages reads four
   pages, a 16-token tile over 64-token pages reads a quarter of one.

2. :func:`online_softmax_step` folds one tile of keys/values into a running
   softmax (the "online softmax" of FlashAttention).  Per query row it keeps the
   running maximum ``m`` (in log2 units), the running denominator ``l`` and the
   unnormalised output ``acc``; a new tile rescales the old state by
   ``2^(m_old - m_new)``.  All three live in fp32 whatever the input dtype.

Both are ``@triton.jit`` helpers, inlined into the kernels that call them.

Safety rules they follow (see ``/work/shared/notes/triton.md``): every load is
masked, including the block-table load; physical offsets are int64, because
``block_id * stride`` overflows int32 in a large pool; masked scores are -inf,
and callers guarantee that each query row sees at least one key in its *first*
tile, so ``m`` is finite before any ``-inf - -inf`` could arise.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_tile(
    cache_ptr,
    table_row_ptr,
    tokens,
    token_ok,
    kv_head,
    dims,
    dim_ok,
    stride_block,
    stride_token,
    stride_head,
    stride_dim,
    stride_table,
    PAGE_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Gather ``[BLOCK_N, BLOCK_D]`` cache entries for logical ``tokens`` of one KV head.

    ``table_row_ptr`` points at the sequence's row of the block table.  Rows
    where ``token_ok`` is false and columns where ``dim_ok`` is false read 0.
    """
    pages = tl.load(table_row_ptr + (tokens // PAGE_SIZE) * stride_table, mask=token_ok, other=0)
    rows = (
        pages.to(tl.int64) * stride_block
        + (tokens % PAGE_SIZE).to(tl.int64) * stride_token
        + kv_head.to(tl.int64) * stride_head
    )
    tile = tl.load(
        cache_ptr + rows[:, None] + dims[None, :].to(tl.int64) * stride_dim,
        mask=token_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def online_softmax_step(
    acc,
    m_i,
    l_i,
    q,
    k,
    v,
    visible,
    qk_scale,
    DOT_PRECISION: tl.constexpr,
):
    """Fold one tile into the running softmax state; returns the new ``(acc, m_i, l_i)``.

    ``q`` is ``[M, D]``, ``k`` and ``v`` are ``[N, D]``, ``visible`` broadcasts to
    ``[M, N]`` (False = masked key).  ``qk_scale`` is ``softmax_scale * log2(e)``
    so that ``exp2`` replaces ``exp`` (one instruction on a GPU).
    """
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION, out_dtype=tl.float32)
    acc = acc * alpha[:, None] + pv
    return acc, m_new, l_i
