"""Lab 2's time cost of the block size: the layout must change the time, never the result.

``paged_decode_step`` lays the same logical K/V out in blocks of each size and times one decode step's
attention, through the engine's C kernel or, without a C compiler, through a torch gather.  Both readers are
checked against an oracle that has no block table at all: dense SDPA over the same K/V.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.labs.check_lab02 import paged_decode_step
from minivllm.model.cpu_attention import load_kernel

BATCH, CONTEXT, HEADS, KV_HEADS, DIM = 3, 64, 6, 2, 16


@pytest.mark.parametrize("kernel", ["1", "0"], ids=["c-kernel", "torch-gather"])
def test_every_block_size_and_layout_reads_the_dense_attention(kernel, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", kernel)
    if kernel == "1" and load_kernel() is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    gen = torch.Generator().manual_seed(0)  # paged_decode_step draws q, k, v in this order from its seed
    q = torch.randn(BATCH, HEADS, DIM, generator=gen)
    k, v = (torch.randn(BATCH, CONTEXT, KV_HEADS, DIM, generator=gen) for _ in range(2))
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), scale=DIM ** -0.5, enable_gqa=True).squeeze(2)
    expected_reader = "C decode kernel" if kernel == "1" else "torch: gather"
    for block_size in (1, 4, 16, 64):
        for shuffled in (False, True):
            ms, out, reader = paged_decode_step(block_size, batch=BATCH, context=CONTEXT, heads=HEADS,
                                                kv_heads=KV_HEADS, head_dim=DIM, shuffled=shuffled, repeats=1)
            assert ms > 0 and expected_reader in reader
            torch.testing.assert_close(out, dense, rtol=1e-5, atol=1e-5)


def test_a_context_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of block_size"):
        paged_decode_step(48, context=64)
