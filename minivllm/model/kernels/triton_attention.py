"""The Triton attention backend: same interface as ``TorchAttentionBackend``.

The engine calls, per layer and step::

    backend.write_kv(k, v, k_cache, v_cache, meta)
    out = backend.attend(q, k_cache, v_cache, meta, scale)

with a flat, ragged, decode-first batch (see :class:`~minivllm.model.attention.AttentionMetadata`).
``attend`` splits that batch at ``meta.num_decodes``:

* the leading single-token sequences go to the split-KV decode kernel
  (:mod:`minivllm.model.kernels.decode`), which reads each KV head once per GQA group;
* the remaining sequences -- whole prompts, prompt chunks after a cached prefix
  or after earlier chunks -- go to the chunked-prefill kernel
  (:mod:`minivllm.model.kernels.prefill`).

Both kernels read lengths and block tables from device tensors; the host lists
``query_lens`` / ``context_lens`` only size the grids, so no step needs a
device-to-host sync.

Writing K/V uses the Triton kernel on a GPU.  On the CPU the interpreter would
run one Python-level program per token, so the torch ``index_copy_`` is used
instead (the two are tested to agree).
"""

from __future__ import annotations

import torch

from minivllm.model.attention import AttentionMetadata, write_kv
from minivllm.model.kernels.decode import paged_decode
from minivllm.model.kernels.kv_write import write_kv_triton
from minivllm.model.kernels.prefill import paged_prefill


class TritonAttentionBackend:
    """Paged attention with Triton kernels (compiled on CUDA, interpreted on CPU)."""

    name = "triton"
    # Lengths, tables and slots are read from device tensors; the host lists only size grids
    # (fixed at capture), so a decode step can be recorded once and replayed (model/cuda_graphs.py).
    cuda_graph_safe = True

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store the step's new K/V ``[num_tokens, kv_heads, D]`` at ``meta.slot_mapping``."""
        if k_cache.device.type == "cuda":
            write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Attention for ``q: [num_tokens, q_heads, D]``; returns the same shape in ``q``'s dtype."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decodes = meta.num_decodes
        if num_decodes:
            paged_decode(
                q[:num_decodes], k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=max(meta.context_lens[:num_decodes]) + 1,
                out=out[:num_decodes],
            )
        num_prefills = meta.num_seqs - num_decodes
        if num_prefills:
            paged_prefill(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, scale,
                first_seq=num_decodes, num_seqs=num_prefills,
                max_query_len=max(meta.query_lens[num_decodes:]),
                out=out,
            )
        return out
