"""Triton kernels for paged attention.

Modules, one concept each:

* :mod:`~minivllm.model.kernels.launch` -- launch-time constants (tile sizes, dot precision, upcast);
* :mod:`~minivllm.model.kernels.tiles` -- gathering a KV tile through the block table, online softmax;
* :mod:`~minivllm.model.kernels.decode` -- split-KV decode attention (flash-decoding);
* :mod:`~minivllm.model.kernels.prefill` -- chunked-prefill attention over cached context;
* :mod:`~minivllm.model.kernels.kv_write` -- scattering new K/V into the cache;
* :mod:`~minivllm.model.kernels.triton_attention` -- the backend the engine calls.

Importing this package imports Triton and decorates the kernels, so on a CPU
``TRITON_INTERPRET=1`` must be set *before* the import (Triton reads it at
decoration time).  :func:`minivllm.model.backends.get_attention_backend`
checks that for you.
"""

from minivllm.model.kernels.decode import choose_num_splits, paged_decode
from minivllm.model.kernels.kv_write import write_kv_triton
from minivllm.model.kernels.prefill import paged_prefill
from minivllm.model.kernels.triton_attention import TritonAttentionBackend

__all__ = [
    "TritonAttentionBackend",
    "choose_num_splits",
    "paged_decode",
    "paged_prefill",
    "write_kv_triton",
]
