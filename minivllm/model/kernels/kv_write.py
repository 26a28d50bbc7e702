"""Writing the step's new keys and values into the paged cache.

Each new token has a *slot*, ``physical_block * PAGE_SIZE + offset``, computed
by the engine (``AttentionMetadata.slot_mapping``).  One program copies one
token's ``[kv_heads, head_dim]`` K and V rows to that slot.

Why a kernel, when ``index_copy_`` does the same?  On a GPU the torch version
is two launches plus a view per layer per step; this is one launch, and it also
handles what ``index_copy_`` cannot: a slot of ``-1`` (a padding token) is
skipped instead of raising -- today's CUDA-graph padding reuses row 0's slot
instead, so this is a guard, not a path the engine takes.  Slots beyond the
pool are skipped too, because an out-of-bounds store corrupts memory (or
crashes the interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minivllm.model.kernels.launch import is_gpu, next_power_of_2


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kct,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vct,
    stride_vch,
    stride_vcd,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    """Copy token ``program_id(0)``'s K and V (all KV heads) into its cache slot."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (heads[:, None] < KV_HEADS) & (dims[None, :] < HEAD_DIM)
    # The slot is broadcast to the tile before comparing: the 3.9 interpreter
    # mis-types a scalar boolean combined with a tensor mask.
    slot = tl.load(slot_ptr + token).to(tl.int64) + tl.zeros([BLOCK_H, BLOCK_D], tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    safe_slot = tl.where(valid, slot, 0)
    block = safe_slot // PAGE_SIZE
    offset = safe_slot % PAGE_SIZE
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd,
                mask=mask, other=0.0)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd,
                mask=mask, other=0.0)
    store_mask = mask & valid
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct
             + heads[:, None] * stride_kch + dims[None, :] * stride_kcd, k, mask=store_mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct
             + heads[:, None] * stride_vch + dims[None, :] * stride_vcd, v, mask=store_mask)


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter ``k, v: [num_tokens, kv_heads, head_dim]`` into the cache at ``slot_mapping``.

    Data is copied bit for bit (no arithmetic), so bf16 needs no upcast even in
    the interpreter.
    """
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    num_blocks, page_size, kv_heads, head_dim = k_cache.shape
    _kv_write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, num_blocks * page_size,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(kv_heads),
        BLOCK_D=next_power_of_2(head_dim), PAGE_SIZE=page_size,
        **({"num_warps": 4} if is_gpu(k) else {}),
    )
