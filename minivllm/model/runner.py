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

import torch

from minivllm.config import EngineConfig
from minivllm.kv.kv_cache import KVCache, bytes_per_block, num_host_blocks, num_kv_blocks
from minivllm.model.attention import AttentionMetadata
from minivllm.model.llama import LlamaForServing
from minivllm.model.loader import LoadedModel, load_model
from minivllm.model.sampler import sample
from minivllm.sched.output import ScheduledBatch, ScheduledSeq


def _import_off_stack(module: str) -> None:
    """Import ``module`` on a short-lived thread, so no caller's frame is on the stack while it runs.

    Loading a model makes transformers import ``torch._dynamo`` lazily, and that
    import calls ``torch.fx.wrap``, whose frame holds a reference to itself: a
    cycle that keeps every frame below it alive -- including ``LLM.__init__``
    and its ``self`` -- until the cyclic garbage collector happens to run.
    Importing it from a clean thread first means ``del llm`` frees the engine
    at once, also for the first engine of a process.
    """
    import importlib
    import sys
    import threading

    if module not in sys.modules:
        worker = threading.Thread(target=importlib.import_module, args=(module,), daemon=True)
        worker.start()
        worker.join()


def load_for_serving(config: EngineConfig) -> LoadedModel:
    """Load the model with the attention backend the config asks for (weights fused, eval mode)."""
    from minivllm.model.backends import get_attention_backend

    _import_off_stack("torch._dynamo")

    backend = get_attention_backend(config.attention_backend, config.device)
    return load_model(config.model, dtype=config.dtype, device=config.device, backend=backend)


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
    """``input_ids``, ``positions`` and the attention metadata for a batch (single-token rows first)."""
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


class ModelRunner:
    """Implements :class:`~minivllm.interfaces.Executor` with a real model and KV cache."""

    def __init__(self, model: LlamaForServing, kv_cache: KVCache, seed: int = 0) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.default_generator = torch.Generator().manual_seed(seed)

    def now(self) -> float:
        return time.perf_counter()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> dict[str, int]:
        self.kv_cache.apply(batch.moves)
        if not batch.seqs:
            return {}
        seqs = batch.seqs  # one-token rows first, as the scheduler built it
        input_ids, positions, meta = build_attention_metadata(seqs, self.kv_cache.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        rows = [i for i, s in enumerate(seqs) if s.samples]
        if not rows:
            return {}
        ends = meta.query_start_loc[1:].long() - 1
        logits = self.model.logits(hidden[ends[rows]])
        reqs = [seqs[i].request for i in rows]
        params, gens = [r.sampling_params for r in reqs], [r.generator for r in reqs]
        try:
            tokens = sample(logits, params, gens, self.default_generator)
        except Exception:  # one bad row must not sink the batch: find it, fail only that request
            tokens = []
            for i, r in enumerate(reqs):
                try:
                    tokens.append(sample(logits[i : i + 1], params[i : i + 1], gens[i : i + 1], self.default_generator)[0])
                except Exception as exc:  # noqa: BLE001 - reported to the caller as finish_reason "error"
                    tokens.append(None)
                    batch.errors[r.request_id] = f"sampling failed: {exc}"
        return {r.request_id: t for r, t in zip(reqs, tokens) if t is not None}

    @torch.inference_mode()
    def logits_for(self, batch: ScheduledBatch) -> dict[str, torch.Tensor]:
        """Teacher-forcing helper for tests: logits of *every* scheduled token."""
        self.kv_cache.apply(batch.moves)
        seqs = batch.seqs
        input_ids, positions, meta = build_attention_metadata(seqs, self.kv_cache.block_size, self.device)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        out = {}
        for i, s in enumerate(seqs):
            a, b = meta.query_start_loc[i].item(), meta.query_start_loc[i + 1].item()
            out[s.request.request_id] = self.model.logits(hidden[a:b])
        return out
