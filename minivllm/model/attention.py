"""Paged attention in plain torch: the CPU path and the oracle for the Triton kernels.

One forward pass of minivllm carries a *flattened, ragged* batch: the new tokens
of many requests laid end to end, ``[num_tokens, ...]``.  A request contributes
either one token (decode) or a chunk of its prompt (prefill / chunked prefill).
:class:`AttentionMetadata` says where each request's tokens sit in the flat
batch and where its keys and values live in the paged cache.

KV cache layout, per layer, for K and for V::

    [num_blocks, block_size, num_kv_heads, head_dim]

A token at position ``p`` of a request lives in physical block
``block_table[p // block_size]`` at offset ``p % block_size``; its flat *slot*
is ``block * block_size + offset``.  Attention for the request gathers its
blocks through the block table and lets query ``i`` of a chunk that starts at
context length ``c`` see keys ``0 .. c + i`` (causal within the chunk, full over
the cached context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence of a flat batch lives, in tokens and in KV blocks.

    Sequences are ordered decode-first: the first ``num_decodes`` sequences have
    exactly one query token.  That lets the torch path batch all decodes into a
    single gather, and the Triton path launch a decode kernel over a prefix.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, the cache slot each new token's K/V goes to.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths.
        seq_lens: ``[num_seqs]`` int32, KV length of each sequence *after* this step's
            tokens are written (context + new tokens).
        block_tables: ``[num_seqs, max_blocks]`` int32, padded with 0 beyond each
            sequence's blocks.  0 is a real block id on purpose: the torch decode path
            gathers the padding blocks too and masks them by length, so the pad must be
            a valid index (the kernels never read past a sequence's length).
        num_decodes: how many leading sequences are single-token decodes.
        query_lens / context_lens: host copies (Python ints) so the torch path can
            slice without device syncs.
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_decodes: int
    query_lens: list[int]
    context_lens: list[int]
    scratch: dict = field(default_factory=dict)  # per-step values a backend computes once, reuses per layer

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new keys/values ``[num_tokens, kv_heads, head_dim]`` into their slots."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first ``kv_len`` tokens of one sequence, ``[kv_len, kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (kv_len + block_size - 1) // block_size
    blocks = cache[block_table[:num_blocks].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:kv_len]


def _expand_kv_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """GQA: repeat each KV head for the ``group`` query heads that share it."""
    return x if group == 1 else x.repeat_interleave(group, dim=-3)


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the reference computes in: fp32 for the half types, and fp64 for an fp64 model.

    fp32 makes fp16/bf16 attention a trustworthy oracle; casting fp64 *down* to it
    would round every attention output of a model served in fp64 (which the config
    offers as the exact dtype, for checks) to fp32's ~1e-7.
    """
    return torch.promote_types(dtype, torch.float32)


def _decode_layout(meta: AttentionMetadata, block_size: int, device: torch.device):
    """Block table slice and padding mask for the decode rows: the same for every layer."""
    if "decode" not in meta.scratch:
        nd = meta.num_decodes
        lens = [c + 1 for c in meta.context_lens[:nd]]
        max_blocks = (max(lens) + block_size - 1) // block_size
        table = meta.block_tables[:nd, :max_blocks].long()
        pad = torch.arange(max_blocks * block_size, device=device)[None, :] >= torch.tensor(lens, device=device)[:, None]
        meta.scratch["decode"] = (table, pad[:, None, None, :])
    return meta.scratch["decode"]


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """All single-token queries at once: pad every sequence to the longest one.

    ``q`` is ``[B, heads, D]``.  Padding keys are masked to -inf, so the result is
    the same as attending to each sequence alone, but costs one batched gather
    per cache (K and V) and two batched matmuls instead of a Python loop.
    """
    batch, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    table, pad = _decode_layout(meta, block_size, q.device)
    # index_select on the flattened table is a plain gather of whole blocks (much faster
    # on CPU than advanced indexing); [B*max_blocks, block_size, kv_heads, D] -> [B, kv_heads, L, D]
    flat = table.reshape(-1)
    k = k_cache.index_select(0, flat).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    group = num_heads // kv_heads
    # [B, kv_heads, group, D] @ [B, kv_heads, D, L] -> [B, kv_heads, group, L]
    qg = q.view(batch, kv_heads, group, head_dim)
    acc = _accumulate_dtype(q.dtype)
    scores = torch.matmul(qg.to(acc), k.to(acc).transpose(-1, -2)) * scale
    scores.masked_fill_(pad, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # padding keys have probability 0, but 0 * inf/NaN is NaN: their V (another request's block 0, or a
    # previous owner's stale slots) must not enter the product at all
    out = torch.matmul(probs, v.to(acc).masked_fill(pad.view(batch, 1, -1, 1), 0.0))
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def _prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """One chunk ``[q_len, heads, D]`` starting at ``context_len``: causal, offset by the context."""
    q_len, num_heads, _ = q.shape
    kv_len = context_len + q_len
    k = gather_kv(k_cache, block_table, kv_len)
    v = gather_kv(v_cache, block_table, kv_len)
    group = num_heads // k.shape[1]
    k = _expand_kv_heads(k.transpose(0, 1), group)  # [heads, kv_len, D]
    v = _expand_kv_heads(v.transpose(0, 1), group)
    # query i sits at absolute position context_len + i and sees keys <= that.
    rows = torch.arange(q_len, device=q.device)[:, None] + context_len
    cols = torch.arange(kv_len, device=q.device)[None, :]
    mask = cols <= rows
    acc = _accumulate_dtype(q.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).to(acc), k.to(acc), v.to(acc), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1).to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention for a flat ragged batch ``q: [num_tokens, heads, D]`` through the paged cache.

    The new tokens' K/V must already be in the cache (see :func:`write_kv`).
    Returns ``[num_tokens, heads, D]``.  Computation is in fp32 for every input
    dtype but fp64 (kept in fp64), which makes this a trustworthy oracle.
    """
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode_attention(q[:nd], k_cache, v_cache, meta, scale)
    prefill_rows(q, k_cache, v_cache, meta, scale, out)
    return out


def prefill_rows(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                 chunk_attention=None) -> None:
    """Attention for the non-decode sequences of the batch (one SDPA per chunk), written into ``out``.

    ``chunk_attention`` (same signature as the reference ``_prefill_attention``)
    lets a backend bring a faster version of the per-chunk call.
    """
    attend_chunk = chunk_attention or _prefill_attention
    start = meta.num_decodes
    for i in range(meta.num_decodes, meta.num_seqs):
        q_len = meta.query_lens[i]
        out[start : start + q_len] = attend_chunk(
            q[start : start + q_len], k_cache, v_cache, meta.block_tables[i], meta.context_lens[i], scale
        )
        start += q_len


class TorchAttentionBackend:
    """The attention backend interface, implemented with the reference above.

    A backend writes the new K/V into the cache and attends.  The Triton backend
    (``minivllm.model.kernels``) implements the same two methods.
    """

    name = "torch"

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_reference(q, k_cache, v_cache, meta, scale)
