"""The KV cache tensors: one K and one V tensor per layer, cut into fixed-size blocks.

Layout per layer (the one the Triton kernels read)::

    K, V: [num_blocks, block_size, num_kv_heads, head_dim]

The *memory* is allocated once, up front; which request owns which block is the
business of :class:`~minivllm.block_pool.BlockPool` and the block tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block: the unit in which KV memory is spent."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


@dataclass
class KVCache:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block ``src`` into ``dst`` in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]
