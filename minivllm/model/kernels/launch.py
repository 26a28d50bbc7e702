"""Small launch-time decisions shared by the attention kernels.

Every kernel in this package is compiled once per combination of its
``tl.constexpr`` arguments.  The helpers here turn tensors and devices into
those constants in one place, so the decode, prefill and KV-write launchers
agree on them:

* **tile sizes** must be powers of two (``tl.arange`` requires it) and at least
  16 wherever they feed ``tl.dot`` (an NVIDIA tensor-core MMA needs K >= 16;
  the CPU interpreter accepts anything, which hides the bug until a GPU run);
* **dot precision**: an fp32 ``tl.dot`` on a GPU defaults to TF32, which keeps
  only 10 mantissa bits.  That is far outside the 1e-4 tolerance an fp32 test
  (or an fp32 end-to-end comparison with the torch backend) expects, so fp32
  inputs ask for ``"ieee"``;
* **upcast**: the Triton 3.9 interpreter holds bf16 values as raw bit patterns
  and computes garbage with them.  Loading and immediately casting to fp32
  sidesteps that.  On a GPU, bf16 is native and the cast would waste
  registers, so it is only done where the kernels are interpreted -- which is
  decided when they are decorated, at import, by ``TRITON_INTERPRET``: with it on,
  a CUDA tensor is interpreted too (Triton copies it to the host and computes
  there), so the device alone does not say "compiled".

**Step-varying arguments are not specialised.**  Besides the constexprs, Triton
compiles a separate binary for each *specialisation* of the plain arguments: an
integer equal to 1, an integer divisible by 16, a pointer aligned to 16 bytes.
That is worth it for what is fixed for the life of the engine (the cache's
strides, the head dimension), and harmful for what changes every step: a
block table one page wide, then sixteen pages wide, or a split count that
becomes 16, would each compile a new binary while serving -- a second or more
of stall on a GPU, for a step that takes milliseconds.  Each kernel module
therefore lists its step-varying arguments (``*_STEP_VARYING``) and passes them
to ``@triton.jit(do_not_specialize=...)``; ``tests/test_triton_attention.py``
checks the list against the arguments a served workload actually varies, and
``tests/test_gpu.py`` counts the binaries on a GPU.
"""

from __future__ import annotations

import torch

from minivllm.model.backends import triton_interpreting

# Read once, as Triton reads it when ``@triton.jit`` decorates the kernels (this module is imported with them):
# switching the variable later changes nothing about how they run.
INTERPRETED = triton_interpreting()


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def dot_tile(n: int) -> int:
    """A power-of-two tile size >= ``n`` that is legal as a ``tl.dot`` dimension (>= 16)."""
    return max(16, next_power_of_2(n))


def check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Refuse a query and caches that do not describe the same heads (the kernels would not notice).

    The kernels take ``head_dim`` from ``q`` and read only that many elements of each cached row, so a
    cache with another head size (or a V cache unlike the K cache) gives a wrong answer, not an error.
    """
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ in shape")
    if q.shape[-1] != k_cache.shape[-1]:
        raise ValueError(f"q head_dim={q.shape[-1]} does not match the cache's head_dim={k_cache.shape[-1]}")
    if q.shape[-2] % k_cache.shape[-2]:
        raise ValueError(f"q_heads={q.shape[-2]} is not a multiple of kv_heads={k_cache.shape[-2]}")


def check_rows(num_seqs: int, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Refuse a launch for more sequences than the metadata describes.

    A program past the end of ``seq_lens`` / ``block_tables`` reads a length and page ids from beyond
    them and gathers from wherever those point: garbage, or (in the interpreter) a segmentation fault.
    """
    if num_seqs > min(block_tables.shape[0], seq_lens.shape[0]):
        raise ValueError(f"{num_seqs} sequences, but block_tables has {block_tables.shape[0]} rows "
                         f"and seq_lens {seq_lens.shape[0]} entries")


def check_tile(name: str, n: int) -> int:
    """``n`` if it is a legal ``tl.dot`` tile (a power of two >= 16), else ValueError.

    The interpreter accepts a tile of 8, so without this a test can pass on a CPU with a size that
    does not compile on a GPU (and a tile that is not a power of two fails deep inside ``tl.arange``).
    """
    if n < 16 or n & (n - 1):
        raise ValueError(f"{name}={n} must be a power of two >= 16 (a tl.dot dimension)")
    return n


def dot_precision(dtype: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: exact fp32 for fp32 inputs, the fast default otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def needs_upcast(tensor: torch.Tensor) -> bool:
    """True when loads must be cast to fp32 right away (bf16 in the interpreter, whatever the tensor's device)."""
    return tensor.dtype == torch.bfloat16 and not is_gpu(tensor)


def is_gpu(tensor: torch.Tensor) -> bool:
    """True when the kernels run compiled on a GPU rather than in the interpreter: a CUDA tensor and the
    interpreter off (on, it computes a CUDA tensor's copy on the host, where bf16 needs the upcast)."""
    return tensor.device.type == "cuda" and not INTERPRETED


def num_compute_units(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 for the (sequential) interpreter.

    The decode split heuristic sizes its grid to this number.  The interpreter
    runs programs one after another, so more programs only cost time there.
    """
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
