"""The KV cache tensors: one K and one V tensor per layer, cut into fixed-size blocks.

Layout per layer (the one the Triton kernels read)::

    K, V: [num_blocks, block_size, num_kv_heads, head_dim]

The *memory* is allocated once, up front; which request owns which block is the
business of :class:`~minivllm.kv.block_pool.BlockPool` and the block tables,
kept by :class:`~minivllm.kv.kv_cache_manager.KVCacheManager`.

Swap preemption adds a second, slower tier with the same layout in host
memory (pinned on CUDA, so copies can run asynchronously on a side stream).
The manager decides which blocks move; this class only moves bytes, in the
order the executor must respect: swap-ins, then swap-outs, then copy-on-write
copies, all before the step's forward pass writes new K/V.
"""

from __future__ import annotations

import math
import mmap
import time
from dataclasses import dataclass, field

import torch

from minivllm.kv.kv_cache_manager import BlockMoves, blocks_for

DEFAULT_CPU_KV_BYTES = 1 << 30
"""KV memory on a CPU device when no size is given (1 GiB)."""

DEFAULT_SIM_KV_BLOCKS = 4096
"""Blocks of a simulated engine's pool when no size is given.  A simulated executor has no memory to measure, so
its default is a count, not bytes: large enough that a test or a lab never runs out by accident (65,536 tokens at
the default block size).  To model a device's capacity, size the pool (``num_gpu_blocks_override`` or
``kv_cache_memory_bytes``) as ``minivllm sim run`` does from the hardware preset."""


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V, every layer, one block: the unit in which KV memory is spent."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor, which on a CPU costs RAM only for the pages that are written.

    Why zeros: a kernel may read a block's unwritten slots past a sequence's end and mask them out by weight,
    and a masked weight of 0 times a NaN left in memory is still NaN.  Why not ``torch.zeros`` on a CPU: it
    writes every byte, so a default engine's 1 GiB pool cost a second of start-up and 1 GiB of RAM before its
    first request, however few blocks its requests would use.  An anonymous ``mmap`` is memory the kernel maps
    in already zero, a 4 KiB page at a time on first touch (the page size ``torch.zeros`` left the pool in; numpy's
    ``calloc`` path would ask for 2 MiB huge pages, whose first touch may stall on compaction inside a step); the
    tensor keeps the mapping alive and it is unmapped when the tensor goes.
    """
    count = math.prod(shape)
    if device.type != "cpu" or count == 0:  # a device memset is fast and touches no host page
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def num_kv_blocks(budget_bytes: int | None, per_block: int, device: torch.device, gpu_memory_utilization: float) -> int:
    """How many blocks a KV budget buys: the given bytes, else a share of free GPU memory, else 1 GiB.

    0 when one block costs more than the budget (a huge ``block_size``): the engine then refuses the config
    (``EngineConfig.check_kv_capacity``) before allocating anything.  Rounding that up to 1 block allocated past
    the budget -- and for ``block_size=2**40`` died in the allocator with a ``RuntimeError`` traceback."""
    if budget_bytes is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget_bytes = int(free * gpu_memory_utilization)
        else:
            budget_bytes = DEFAULT_CPU_KV_BYTES
    return budget_bytes // per_block


def num_host_blocks(config, bytes_per_block: int) -> int:
    """Host-tier blocks for swap preemption: 0 unless the preemption mode can swap."""
    if not config.uses_swap:
        return 0
    if config.num_cpu_blocks_override is not None:
        return config.num_cpu_blocks_override
    return int(config.swap_space * (1 << 30)) // bytes_per_block


@dataclass
class KVCache:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    num_cpu_blocks: int = 0
    layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False)
    cpu_layers: list[tuple[torch.Tensor, torch.Tensor]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        # Each tier is one allocation, cut into a K and a V view per layer (each view contiguous: it fixes the
        # two leading indices).  One allocation because a pool of many per-layer tensors comes from the C heap
        # on a CPU engine (model/host_malloc.py keeps blocks below 256 MiB there) and is not always handed back
        # when freed; one large block is mapped on its own and unmapped when the engine goes.
        shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        pool = zeroed(shape, self.dtype, self.device)
        self.layers = [(pool[i, 0], pool[i, 1]) for i in range(self.num_layers)]
        # The host tier: torch.empty, so untouched swap space costs address space, not RAM.
        pin = self.device.type == "cuda"
        self.cpu_layers = []
        if self.num_cpu_blocks:
            host = torch.empty((self.num_layers, 2, self.num_cpu_blocks, *shape[3:]), dtype=self.dtype, pin_memory=pin)
            self.cpu_layers = [(host[i, 0], host[i, 1]) for i in range(self.num_layers)]
        self._stream = torch.cuda.Stream(self.device) if pin else None

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def apply(self, moves: BlockMoves) -> None:
        """Perform a step's block moves in the one safe order (see the module docstring)."""
        if not (moves.swap_in or moves.swap_out or moves.copies):
            return
        if self._stream is None:
            self._move(moves)
            return
        # CUDA: copy on a side stream; the forward pass (default stream) waits for it.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._move(moves)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    def _move(self, moves: BlockMoves) -> None:
        for (k, v), (ck, cv) in zip(self.layers, self.cpu_layers or [(None, None)] * self.num_layers):
            for cpu, gpu in moves.swap_in:
                k[gpu].copy_(ck[cpu], non_blocking=True)
                v[gpu].copy_(cv[cpu], non_blocking=True)
            for gpu, cpu in moves.swap_out:
                ck[cpu].copy_(k[gpu], non_blocking=True)
                cv[cpu].copy_(v[gpu], non_blocking=True)
        self.copy_blocks(moves.copies)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block ``src`` into ``dst`` in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]

    def scratch_request(self, num_tokens: int):
        """A stand-in request of ``num_tokens`` tokens whose table is the first blocks, for a start-up probe
        (:meth:`~minivllm.model.runner.ModelRunner.measure_prefill_rate`): the blocks are written, not allocated,
        so no refcount moves.  Valid only before any request runs, while every block is free."""
        from minivllm.request import Request
        from minivllm.sampling_params import SamplingParams

        num_tokens = max(1, min(num_tokens, self.num_blocks * self.block_size))
        probe = Request("scratch-probe", [0] * num_tokens, SamplingParams(max_tokens=1), arrival_time=0.0)
        probe.block_ids = list(range(blocks_for(num_tokens, self.block_size)))
        return probe

    def measure_swap_bandwidth(self, num_blocks: int = 8) -> float:
        """Bytes per second of device -> host block copies (what auto mode weighs).

        Only the outward direction is timed (it reads the still-empty device
        blocks and overwrites nothing a request owns); the link is taken as
        symmetric.  Call it before any request runs.
        """
        n = min(num_blocks, self.num_blocks, self.num_cpu_blocks)
        if n == 0:
            return float("inf")
        pairs = [(i, i) for i in range(n)]
        moves = BlockMoves(swap_out=pairs)
        self.apply(moves)  # warm up
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        self.apply(moves)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = max(time.perf_counter() - start, 1e-9)
        return n * self.bytes_per_block / elapsed
