"""The real executor: turn a scheduled batch into tensors, run the model, sample.

This is step 4 of the loop.  For each scheduled sequence it lays its new tokens
end to end (``input_ids``, ``positions``), maps every token to the cache slot
its K/V goes to (``slot_mapping`` = block id * block size + offset, read off the
block table), and records which rows need logits: only a sequence's last token,
and only when the step reaches the end of what it has to compute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from minivllm.config import EngineConfig
from minivllm.kv.kv_cache import KVCache, bytes_per_block, num_host_blocks, num_kv_blocks
from minivllm.kv.kv_cache_manager import blocks_for
from minivllm.model.attention import AttentionMetadata
from minivllm.model.llama import LlamaForServing
from minivllm.model.loader import LoadedModel, load_model
from minivllm.model.sampler import sample
from minivllm.request import Request
from minivllm.sched.output import ScheduledBatch, ScheduledSeq


def load_for_serving(config: EngineConfig) -> LoadedModel:
    """Load the model with the attention and linear backends the config asks for (weights fused, eval mode).

    On a CPU, once the weights are in place, the C allocator is told to keep
    freed memory (:mod:`minivllm.model.host_malloc`): every step's activations
    then reuse pages already mapped instead of faulting in fresh ones.
    """
    from minivllm.model.backends import get_attention_backend, resolve_linear_backend

    backend = get_attention_backend(config.attention_backend, config.device)
    linear = resolve_linear_backend(config.linear_backend, config.device, config.dtype)
    loaded = load_model(config.model, dtype=config.dtype, device=config.device, backend=backend,
                        linear_backend=linear)
    if config.device.type == "cpu" and config.cpu_keep_freed_memory:
        from minivllm.model.host_malloc import keep_freed_memory

        keep_freed_memory()
    return loaded


@dataclass(frozen=True)
class KVLayout:
    """How KV memory is cut for one model: blocks on the device, blocks in the host tier."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    num_cpu_blocks: int
    bytes_per_block: int
    config: EngineConfig

    def make_cache(self) -> KVCache:
        cfg = self.config
        return KVCache(self.num_layers, self.num_blocks, cfg.block_size, self.num_kv_heads, self.head_dim,
                       cfg.dtype, cfg.device, self.num_cpu_blocks)


def kv_layout(model: LlamaForServing, config: EngineConfig) -> KVLayout:
    """Size the KV cache for ``model``: the blocks a byte budget buys, and the host tier for swapping."""
    args = model.args
    per_block = bytes_per_block(args.num_layers, config.block_size, args.num_kv_heads, args.head_dim, config.dtype)
    blocks = config.num_gpu_blocks_override or num_kv_blocks(
        config.kv_cache_memory_bytes, per_block, config.device, config.gpu_memory_utilization
    )
    return KVLayout(args.num_layers, args.num_kv_heads, args.head_dim, blocks,
                    num_host_blocks(config, per_block), per_block, config)


def build_attention_metadata(
    seqs: list[ScheduledSeq], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """``input_ids``, ``positions`` and the attention metadata for a batch (single-token rows first).

    The reference: built from scratch every call, in the plainest form.  The
    executor uses :class:`BatchPreparer`, which must return the same tensors
    (a test compares the two) without rebuilding every block table each step.
    """
    ids: list[int] = []
    pos: list[int] = []
    for s in seqs:  # slices of the prompt or the outputs: a decode costs one token, whatever its length
        ids += s.request.token_ids_slice(s.start, s.start + s.num_tokens)
        pos += range(s.start, s.start + s.num_tokens)
    max_blocks = max(len(s.request.block_ids) for s in seqs)
    # one padded nested list -> one tensor (one row at a time would be one small tensor per sequence)
    tables = torch.tensor([s.request.block_ids + [0] * (max_blocks - len(s.request.block_ids)) for s in seqs],
                          dtype=torch.int32)
    positions = torch.tensor(pos, dtype=torch.int64)
    query_lens = [s.num_tokens for s in seqs]
    context_lens = [s.start for s in seqs]
    owner = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(query_lens))
    slots = tables[owner, positions // block_size].long() * block_size + positions % block_size
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    num_decodes = 0
    while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
        num_decodes += 1
    meta = AttentionMetadata(
        slot_mapping=slots.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_decodes=num_decodes,
        query_lens=query_lens,
        context_lens=context_lens,
    )
    return torch.tensor(ids, dtype=torch.int64, device=device), positions.to(device), meta


class BatchPreparer:
    """A step's ``input_ids``, ``positions`` and attention metadata, from persistent buffers.

    Same result as :func:`build_attention_metadata`, at a Python cost that does
    not grow with output length (what does is one numpy gather of the batch's
    table rows, ``B x`` the longest table, which the attention reads anyway:
    about 20 us more per step for 32 decodes at 128K tokens than at 100 on a
    CPU).  The reference copies every sequence's whole block table
    into a fresh nested list each step -- a 1,000-token sequence has 63 blocks at
    block size 16 -- although between two steps a decode's table changes only
    when it crosses a block boundary (1 step in 16).  Here every scheduled
    request keeps a row of one preallocated ``int32`` array, a step rewrites only
    the rows whose tables changed, and positions, slots and lengths are numpy
    expressions over the whole batch.  What is left per sequence in Python is
    reading a few integers.

    A row is trusted while its request's table is the same list object with the
    same length and the same last block.  That check is enough because tables are
    append-only while a request runs (:mod:`minivllm.kv.kv_cache_manager`); the
    one in-place change, copy-on-write, replaces the *last* block.  Preemption and
    swapping give the request a new list.  Rows of requests that left are reused
    once the array is full (and it grows when every row is in use).
    """

    def __init__(self, block_size: int, device: torch.device | str = "cpu", rows: int = 64, width: int = 16,
                 stage: bool | None = None) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        # Staging (default: on a CUDA device): the step's integer arrays are gathered into one host buffer per
        # dtype -- page-locked ("pinned") on CUDA -- and each buffer crosses to the device in one asynchronous
        # copy, instead of six small synchronous ones from pageable memory.  A CUDA event guards the buffer:
        # it is not rewritten before the previous step's copy has left it.
        self.stage = self.device.type == "cuda" if stage is None else stage
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._copied = None  # torch.cuda.Event of the last staged copy
        self._table = np.zeros((rows, width), dtype=np.int32)
        self._row: dict[Request, int] = {}  # requests hash by identity
        self._seen: list[tuple | None] = [None] * rows  # per row: (table list, its length, its last block)
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def prepare(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        row_of, seen = self._row, self._seen
        rows: list[int] = []
        ids: list[int] = []
        width = 0
        # Python's per-sequence work is this loop (a few integer reads, a row write 1 step in 16), the two list
        # comprehensions after it and the count of leading decodes; the rest is numpy over the whole batch.
        for s in seqs:
            req = s.request
            blocks = req.block_ids
            row = row_of.get(req)
            if row is None:
                row = self._assign(req, seqs)
            n = len(blocks)
            mark = seen[row]
            if mark is None or mark[0] is not blocks or mark[1] != n or (n and mark[2] != blocks[-1]):
                self._write(row, blocks)
            rows.append(row)
            if n > width:
                width = n
            if s.is_decode:  # its one token is the newest sampled one
                ids.append(req.output_token_ids[-1])
            else:
                ids += req.token_ids_slice(s.start, s.start + s.num_tokens)
        query_lens = [s.num_tokens for s in seqs]
        context_lens = [s.start for s in seqs]
        num_decodes = 0
        while num_decodes < len(seqs) and query_lens[num_decodes] == 1:
            num_decodes += 1
        bs = self.block_size
        rows_np = np.array(rows, dtype=np.int64)
        starts = np.array(context_lens, dtype=np.int64)
        qlens = np.array(query_lens, dtype=np.int64)
        loc = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(qlens, out=loc[1:])
        if num_decodes == len(seqs):  # all one-token rows: each position is its sequence's start
            owner, positions = np.arange(len(seqs)), starts
        else:
            owner = np.repeat(np.arange(len(seqs)), qlens)
            positions = starts[owner] + np.arange(int(loc[-1])) - loc[owner]
        slots = self._table[rows_np[owner], positions // bs].astype(np.int64) * bs + positions % bs
        input_ids, positions_t, slot_mapping = self._upload(
            [np.array(ids, dtype=np.int64), positions.astype(np.int64, copy=True), slots], torch.int64)
        query_start_loc, seq_lens, block_tables = self._upload(
            [loc.astype(np.int32), (starts + qlens).astype(np.int32), self._table[rows_np, :width]], torch.int32)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            num_decodes=num_decodes,
            query_lens=query_lens,
            context_lens=context_lens,
        )
        return input_ids, positions_t, meta

    def _upload(self, arrays: list[np.ndarray], dtype: torch.dtype) -> list[torch.Tensor]:
        """``arrays`` (all of ``dtype``) as tensors on the device: one copy each, or one staged copy for all."""
        if not self.stage:
            return [torch.from_numpy(np.ascontiguousarray(a)).to(self.device) for a in arrays]
        # Every array starts on a 16-byte boundary of the buffer.  Triton specialises a kernel on whether
        # each pointer argument is 16-byte aligned; packed end to end, ``seq_lens`` (after n + 1 int32
        # offsets) would be aligned for some batch sizes and not others, and a batch size never seen
        # before would compile a new binary in the middle of serving (prompt steps of 0.41-1.0 s on an H200
        # before this layout: benchmarks/results/2026-11-30_nvidia-h200_gc_probe.json's first runs).
        align = 16 // dtype.itemsize
        starts, total = [], 0
        for a in arrays:
            starts.append(total)
            total += -(-a.size // align) * align
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < total:
            size = max(total, 2 * buf.numel() if buf is not None else 4096)
            buf = torch.empty(size, dtype=dtype, pin_memory=self.device.type == "cuda")
            self._staging[dtype] = buf
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy out of this buffer has finished
        host = buf.numpy()
        for a, at in zip(arrays, starts):
            host[at : at + a.size] = a.ravel()
        if self.device.type == "cuda":
            on_device = buf[:total].to(self.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        else:  # staging on a CPU only exercises this path in tests: copy, or the next step would overwrite
            on_device = buf[:total].clone()
        return [on_device[at : at + a.size].view(a.shape) for a, at in zip(arrays, starts)]

    def _write(self, row: int, blocks: list[int]) -> None:
        """Copy one request's table into its row (zeroing what a longer old table left behind)."""
        n = len(blocks)
        if n > self._table.shape[1]:
            grown = np.zeros((self._table.shape[0], max(n, 2 * self._table.shape[1])), dtype=np.int32)
            grown[:, : self._table.shape[1]] = self._table
            self._table = grown
        mark = self._seen[row]
        old = mark[1] if mark is not None else 0
        self._table[row, :n] = blocks
        if old > n:
            self._table[row, n:old] = 0
        self._seen[row] = (blocks, n, blocks[-1] if n else None)

    def _assign(self, req: Request, seqs: list[ScheduledSeq]) -> int:
        """A row for ``req``: a free one, else one of a request not in this batch, else a new one.

        The preparer is never told that a request finished (it sees only each step's batch), so the rows of
        requests that left are reclaimed lazily, all at once, when no row is free: one pass over the rows per
        refill of the free list, none in an ordinary step."""
        if not self._free:
            keep = {s.request for s in seqs}
            for other, row in list(self._row.items()):
                if other not in keep:
                    del self._row[other]
                    mark = self._seen[row]
                    self._table[row, : mark[1] if mark is not None else 0] = 0
                    self._seen[row] = None
                    self._free.append(row)
        if not self._free:
            old = self._table.shape[0]
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            self._seen += [None] * old
            self._free = list(range(2 * old - 1, old - 1, -1))
        row = self._row[req] = self._free.pop()
        return row


class ModelRunner:
    """Implements :class:`~minivllm.interfaces.Executor` with a real model and KV cache."""

    def __init__(self, model: LlamaForServing, kv_cache: KVCache, seed: int = 0, *,
                 cuda_graph_max_batch: int = 0, max_model_len: int | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.default_generator = torch.Generator(device=self.device).manual_seed(seed)  # unseeded rows' noise
        self.prep = BatchPreparer(kv_cache.block_size, self.device)
        self.graphs = None  # a DecodeGraphRunner: CUDA graphs for decode-only steps (GPU, graph-safe backend)
        if (cuda_graph_max_batch and self.device.type == "cuda" and max_model_len
                and getattr(model.backend, "cuda_graph_safe", False)):
            self.graphs = self.decode_graphs(cuda_graph_max_batch, max_model_len)
            self.graphs.capture_all()

    def decode_graphs(self, max_batch: int, max_model_len: int, capture: bool | None = None):
        """A :class:`~minivllm.model.cuda_graphs.DecodeGraphRunner` over this model and cache.

        Capped at 512 rows: every captured size (1, 2, 4, then steps of 8) is one more graph to capture at
        startup and hold in memory (67 up to 512), and a larger decode batch simply runs eagerly."""
        from minivllm.model.cuda_graphs import DecodeGraphRunner

        model, layers = self.model, self.kv_cache.layers
        return DecodeGraphRunner(lambda ids, pos, meta: model(ids, pos, layers, meta),
                                 max_batch=min(max_batch, 512), max_seq_len=max_model_len,
                                 max_blocks=blocks_for(max_model_len, self.kv_cache.block_size),
                                 device=self.device, capture=capture)

    def now(self) -> float:
        return time.perf_counter()

    @torch.inference_mode()
    def measure_prefill_rate(self, num_tokens: int) -> float:
        """Prompt tokens per second of one ``num_tokens``-token prefill (what auto mode prices a recompute by).

        Auto mode learns the rate from steps that carry prefill tokens, but needs a first estimate, and a run in
        which every victim is swapped runs no such step: a guess (1,000 tokens/s, a CPU's order) would then stand
        for ever, 10-50x too slow on a GPU, and swap would win every choice.  Like
        :meth:`~minivllm.kv.kv_cache.KVCache.measure_swap_bandwidth` it writes K/V into the first blocks, which
        hold nothing yet: call it before any request runs.  The first run warms up; the faster of the next two
        counts, so a moment of contention (another process on a 2-core machine can make one pass 10x slower)
        does not set the engine's estimate.
        """
        probe = self.kv_cache.scratch_request(num_tokens)  # the first blocks, written, not allocated
        input_ids, positions, meta = build_attention_metadata([ScheduledSeq(probe, probe.num_prompt_tokens, 0)],
                                                              self.kv_cache.block_size, self.device)
        num_tokens = probe.num_prompt_tokens
        times = []
        for _ in range(3):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self.model(input_ids, positions, self.kv_cache.layers, meta)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(time.perf_counter() - start)
        return num_tokens / max(min(times[1:]), 1e-9)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[str, int]:
        self.kv_cache.apply(batch.moves)
        if not batch.seqs:
            return {}
        seqs = batch.seqs  # one-token rows first, as the scheduler built it
        input_ids, positions, meta = self.prep.prepare(seqs)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta)  # one replay, not hundreds of launches (cuda_graphs.py)
        else:
            hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        rows = [i for i, s in enumerate(seqs) if s.samples]
        if not rows:
            return {}
        ends = meta.query_start_loc[1:].long() - 1
        logits = self.model.logits(hidden[ends[rows]])
        reqs = [seqs[i].request for i in rows]
        params, gens = [r.sampling_params for r in reqs], [r.generator for r in reqs]
        sampled = {}
        for r, t in zip(reqs, sample(logits, params, gens, self.default_generator)):
            if t is None:  # one bad row must not sink the batch: only that request fails
                batch.errors[r.request_id] = "sampling failed: the row's probabilities are not finite (NaN/inf logits)"
            else:
                sampled[r.request_id] = t
        return sampled

    @torch.inference_mode()
    def logits_for(self, batch: ScheduledBatch) -> dict[str, torch.Tensor]:
        """Teacher-forcing helper for tests: logits of *every* scheduled token.

        Built with :func:`build_attention_metadata`, the reference, not :attr:`prep`: a test checking the model
        does not lean on the fast path it may be checking too, and leaves that path's rows as it found them."""
        self.kv_cache.apply(batch.moves)
        seqs = batch.seqs
        input_ids, positions, meta = build_attention_metadata(seqs, self.kv_cache.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        out = {}
        for i, s in enumerate(seqs):
            a, b = meta.query_start_loc[i].item(), meta.query_start_loc[i + 1].item()
            out[s.request.request_id] = self.model.logits(hidden[a:b])
        return out
