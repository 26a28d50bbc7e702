"""Paged-attention test cases shared by the interpreter tests and the GPU tests.

Kept apart from ``test_triton_attention.py`` because that module sets
``TRITON_INTERPRET=1`` before importing the kernels, and the GPU tests
(``test_gpu.py``) must import them compiled.  Nothing here imports Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import pytest
import torch

from minivllm.bench.attention import max_error
from minivllm.model.attention import AttentionMetadata, paged_attention_reference, write_kv

TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1.5e-2}


# --------------------------------------------------------------------------- case builder
@dataclass
class PagedCase:
    """A filled paged cache, the step's queries and the metadata the engine would build."""

    q: torch.Tensor
    k_new: torch.Tensor
    v_new: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def reference(self) -> torch.Tensor:
        """The fp32 torch oracle; NaN poison is zeroed in its copy (it gathers padding blocks)."""
        return paged_attention_reference(
            self.q, torch.nan_to_num(self.k_cache), torch.nan_to_num(self.v_cache), self.meta, self.scale
        )

    def to(self, device: str | torch.device) -> "PagedCase":
        """The same case on ``device`` (the metadata's tensors too)."""
        moved = {f.name: getattr(self.meta, f.name) for f in fields(self.meta) if f.name != "scratch"}
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in moved.items()}
        tensors = [t.to(device) for t in (self.q, self.k_new, self.v_new, self.k_cache, self.v_cache)]
        return PagedCase(*tensors, AttentionMetadata(**moved), self.scale)


def make_case(
    seqs: list[tuple[int, int]],
    *,
    num_decodes: int,
    kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 64,
    page: int = 16,
    dtype: torch.dtype = torch.float32,
    share_blocks: bool = True,
    seed: int = 0,
) -> PagedCase:
    """Build a case from ``(context_len, query_len)`` per sequence, decode-first.

    Physical blocks are handed out in a random order from a pool with spare
    (never used, NaN) blocks; block-table padding points at a spare block.  With
    ``share_blocks``, all sequences whose cached context fills their first block
    share one physical first block -- like a cached system prompt.
    The new tokens' K/V are written with the torch ``write_kv``.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in seqs]
    blocks_per_seq = [math.ceil(n / page) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    order = torch.randperm(num_blocks, generator=gen).tolist()
    spare = order[-1]
    max_blocks = max(blocks_per_seq) + 1  # at least one padding column per row
    tables = torch.full((len(seqs), max_blocks), spare, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor(order[cursor : cursor + n], dtype=torch.int32)
        cursor += n
    if share_blocks:  # later sequences with a full cached first block reuse the first such block
        donors = [i for i, (ctx, _) in enumerate(seqs) if ctx >= page]
        for i in donors[1:]:
            tables[i, 0] = tables[donors[0], 0]

    k_cache = torch.full((num_blocks, page, kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots_new: list[int] = []
    for i, (ctx, q_len) in enumerate(seqs):
        for pos in range(ctx + q_len):
            block, offset = int(tables[i, pos // page]), pos % page
            if pos < ctx:  # cached context: random values (a shared block is simply rewritten)
                k_cache[block, offset] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
                v_cache[block, offset] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            else:
                slots_new.append(block * page + offset)

    num_tokens = sum(q for _, q in seqs)
    q = torch.randn(num_tokens, kv_heads * group, head_dim, generator=gen).to(dtype)
    k_new = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    v_new = torch.randn(num_tokens, kv_heads, head_dim, generator=gen).to(dtype)
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots_new, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        num_decodes=num_decodes,
        query_lens=[q for _, q in seqs],
        context_lens=[c for c, _ in seqs],
    )
    write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)
    return PagedCase(q, k_new, v_new, k_cache, v_cache, meta, head_dim**-0.5)


def nan_like(x: torch.Tensor) -> torch.Tensor:
    return torch.full_like(x, float("nan"))


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), f"{(~torch.isfinite(got)).sum()} non-finite output elements"
    err = max_error(got, want)  # absolute up to magnitude 1, relative above
    assert err <= TOLERANCE[dtype], f"max error {err:.3g} (absolute, relative above 1) > {TOLERANCE[dtype]}"


def make_tiny_llama(path, head_dim: int = 32, seed: int = 0, tie: bool = False) -> str:
    """Save a random-weight 2-layer Llama (4 query / 2 KV heads) as an HF model directory.
    ``tie``: the vocabulary projection shares the embedding (as SmolLM2's does)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        intermediate_size=256, vocab_size=512, num_hidden_layers=2, max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)
