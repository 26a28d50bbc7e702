"""CUDA graphs for decode steps: launch a whole forward pass with one call.

Why: a decode step of a 1B model on a modern GPU is under a millisecond of
kernels by the roofline, but the Python that launches them takes far longer:
Llama-3.2-1B's 16 layers make 706 launches a step, and on an H200 an eager step
(64 or 512 prompt tokens) took 10.5-10.9 ms where a graphed decode step took
2.5 ms.  A CUDA graph records the launches once and replays them with a single
call, so a decode step costs little more than the GPU time.  vLLM and nano-vllm
do the same.

What a graph demands, and how this module meets it:

* **Fixed shapes.**  A graph replays exactly the launches it recorded, so it is
  captured for a few batch sizes (:func:`capture_sizes`: 1, 2, 4, 8, then every
  8) and a batch of ``B`` decodes runs in the smallest captured size ``>= B``.
  The extra rows copy row 0 (same token, position, slot, table, length): they
  compute what row 0 computes and write the same K/V to the same slot, so
  padding can never touch another request's cache.  Their outputs are dropped.
* **Fixed addresses.**  Inputs live in static buffers allocated once; a step
  copies its inputs into them (:meth:`DecodeGraphRunner.run`) before replay.
* **No host values per step.**  Everything that varies per step (lengths, block
  tables, slots) must be read from device tensors by the kernels.  The Triton
  backend does (it sizes its split count from a host bound, fixed here at the
  model's maximum length).  The torch backend computes its padding from host
  lists, so it is only ever run eagerly: ``cuda_graph_safe`` on a backend says
  which is which.
* **Capture before serving.**  Capture runs the model on dummy inputs whose K/V
  land in block 0; it happens when the runner is built, before any block holds
  a request's data.

On a CPU there are no graphs; ``DecodeGraphRunner(capture=False)`` runs the very
same padded, static-buffer path eagerly, which is how the tests check padding
and staging on any machine.
"""

from __future__ import annotations

from typing import Callable

import torch

from minivllm.model.attention import AttentionMetadata


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, 16, 24, ... up to ``max_batch`` (always included).

    Why these: every size is one more graph to capture at startup and keep in memory, and a batch runs padded
    to the next size.  A small decode step costs about the same for 3 rows as for 4 (it is bound by reading the
    weights), so doubling is cheap there; above 8, steps of 8 cap the padding at 7 rows.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return tuple(sorted(set(sizes)))


def bucket_for(batch: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds ``batch`` rows, or ``None`` when none does."""
    for size in sizes:
        if size >= batch:
            return size
    return None


class DecodeGraphRunner:
    """Runs decode-only steps through per-size CUDA graphs (or, with ``capture=False``, eagerly the same way).

    ``forward(input_ids, positions, meta)`` is the model's forward pass with the
    KV cache bound; ``max_blocks`` is the widest block table a request can have
    (``ceil(max_model_len / block_size)``).
    """

    def __init__(self, forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor], *,
                 max_batch: int, max_blocks: int, max_seq_len: int, device: torch.device | str,
                 capture: bool | None = None) -> None:
        self.forward = forward
        self.device = torch.device(device)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.sizes = capture_sizes(max_batch)
        self.max_blocks = max_blocks
        self.max_seq_len = max_seq_len
        n, dev = self.sizes[-1], self.device
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def can_run(self, meta: AttentionMetadata) -> bool:
        """Decode-only, a captured size fits, and the tables fit the static buffer."""
        return (meta.num_decodes == meta.num_seqs > 0 and meta.num_seqs <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.max_blocks)

    def _static_meta(self, size: int, context_lens: list[int]) -> AttentionMetadata:
        """Metadata over the static buffers.  ``context_lens`` is the only host input: the eager path passes the
        real lengths (the torch backend builds its padding mask from them), capture passes the longest
        possible, which fixes the Triton split count for every later replay."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size], num_decodes=size,
            query_lens=[1] * size, context_lens=context_lens)

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy the step's inputs into the static buffers; rows ``B..size`` repeat row 0."""
        batch, width = meta.num_seqs, meta.block_tables.shape[1]
        pad = size - batch
        for dst, src in ((self.input_ids, input_ids), (self.positions, positions),
                         (self.slot_mapping, meta.slot_mapping), (self.seq_lens, meta.seq_lens)):
            dst[:batch].copy_(src, non_blocking=True)
            if pad:
                dst[batch:size].copy_(src[:1].expand(pad), non_blocking=True)
        self.block_tables[:batch, :width].copy_(meta.block_tables, non_blocking=True)
        self.block_tables[:batch, width:].zero_()
        if pad:
            self.block_tables[batch:size].copy_(self.block_tables[:1].expand(pad, -1), non_blocking=True)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of a decode-only step (see :meth:`can_run`)."""
        batch = meta.num_seqs
        size = bucket_for(batch, self.sizes)
        self._stage(input_ids, positions, meta, size)
        if not self.capture:
            context = list(meta.context_lens) + [meta.context_lens[0]] * (size - batch)
            return self.forward(self.input_ids[:size], self.positions[:size], self._static_meta(size, context))[:batch]
        if size not in self.graphs:
            self._capture(size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:batch]

    def capture_all(self) -> None:
        """Capture every size, largest first (smaller graphs then reuse its memory pool)."""
        if self.capture:
            for size in reversed(self.sizes):
                self._capture(size)

    def _capture(self, size: int) -> None:
        # The split count of the Triton decode kernel is sized from this host bound at capture
        # time and then fixed; in-kernel, each split reads the real length from seq_lens.
        meta = self._static_meta(size, [self.max_seq_len - 1] * size)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the graph: lazy inits, autotuning, allocator
            self.forward(self.input_ids[:size], self.positions[:size], meta)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = next(iter(self.graphs.values()))[0].pool() if self.graphs else None
        with torch.cuda.graph(graph, pool=pool):
            out = self.forward(self.input_ids[:size], self.positions[:size], meta)
        self.graphs[size] = (graph, out)
