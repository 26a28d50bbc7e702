"""Keep the C allocator's freed memory for the next step, instead of handing it back to the kernel.

Why this matters on a CPU.  A forward pass allocates its activations fresh: a
2,048-token prefill step of the bundled model makes tensors of 5-25 MB in every
layer (the gate/up projection's output alone is 2,048 x 3,072 floats) and frees
them a moment later.  glibc's ``malloc`` serves blocks above its *mmap
threshold* (at most 32 MB, adjusted as it goes) with a fresh ``mmap`` and gives
them back with ``munmap`` on ``free``; below it, memory freed at the top of the
heap beyond the *trim threshold* is returned too.  Either way the next step's
tensor lands on pages the kernel has to fault in again, one 4 KiB page at a
time -- on the 2-core course machine a 25 MB tensor costs ~6,000 page faults,
and a prefill step spent about a seventh of its time in them.  The matmul and
element-wise kernels themselves are not slower; they wait for zeroed pages.

The fix the field uses is an allocator that keeps freed memory (vLLM's CPU
guide preloads tcmalloc; PyTorch's performance guide suggests jemalloc with
decay switched off).  minivllm needs no extra library for it: glibc's own
``mallopt`` moves both thresholds up, so blocks up to :data:`THRESHOLD` come
from the heap and freed ones stay there for reuse.  Measured with
``python -m minivllm.bench offline --skip-hf [--no-keep-freed-memory]``, two
runs each way, alternating, on the 2-core machine: page faults during the
timed run 761,036 / 516,492 without, 14,953 / 18,739 with; throughput 127.1 /
131.8 without, 136.0 / 139.1 output tok/s with (+6%); peak RSS 1,299-1,315 MB
either way.  A 2,048-token prefill step alone: 3.06 -> 2.6 s.  (Those runs used a
1 GiB threshold; with the 256 MiB below: 15,549 faults, 140.4 tok/s.)

Why 256 MiB, not "everything": the mmap threshold is also the size above
which a freed block goes straight back to the system.  Activations of a
CPU-sized model stay below it (25 MB here; ~130 MB for a 1B model's gate/up
output at 2,048 tokens), so a step's working set is kept for the next step;
the trim threshold caps what the heap keeps at the same 256 MiB.  An engine's
KV pool is one allocation above it (:class:`~minivllm.kv.kv_cache.KVCache`), so
``del llm`` hands the pool back.  Measured (``tests/test_host_malloc.py``):
with a 768 MiB pool, ``del llm`` lowers the resident set by more than 700 MB;
when the pool was 60 per-layer tensors, each small enough for the heap, it
stayed resident (1,593 -> 1,474 MB).

It is process-wide (like ``torch.set_num_threads``) and idempotent;
:func:`minivllm.model.runner.load_for_serving` calls it for a CPU engine after
the weights are loaded, unless ``EngineConfig.cpu_keep_freed_memory`` is False.
On a C library other than glibc (macOS, musl) it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt's parameter numbers, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
INT_MAX = 2**31 - 1  # mallopt(int param, int value)

THRESHOLD = 256 << 20  # bytes: above a step's activations, below an engine's KV pool (see above)


def keep_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds to ``threshold`` bytes; True if the C library took both.

    Returns False (and changes nothing) where the C library is not glibc.  ``threshold`` must fit
    mallopt's C ``int`` (0 to 2 GiB - 1): ctypes would otherwise keep only its low 32 bits, and
    4 GiB would become 0 -- every allocation mapped afresh, the opposite of the request.
    """
    if not 0 <= threshold <= INT_MAX:
        raise ValueError(f"threshold must be 0..{INT_MAX} bytes (mallopt takes a C int), got {threshold}")
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success, 0 when it refuses a value
    value = ctypes.c_int(threshold)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, value)) & bool(libc.mallopt(M_TRIM_THRESHOLD, value))


__all__ = ["keep_freed_memory", "THRESHOLD"]
