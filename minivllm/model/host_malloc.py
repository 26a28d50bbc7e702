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
either way.  A 2,048-token prefill step alone: 3.06 -> 2.6 s.

What it costs: memory the process freed is not returned to the system while
the heap top holds less than :data:`THRESHOLD` of free space.  Peak RSS is
the same -- the peak is the working set either way -- but RSS after a large
step stays near that peak.  For a serving process, which will run the next
large step soon, that is the right trade.

It is process-wide (like ``torch.set_num_threads``) and idempotent;
:func:`minivllm.model.runner.load_for_serving` calls it for a CPU engine after
the weights are loaded, unless ``EngineConfig.cpu_keep_freed_memory`` is False.
On a C library other than glibc (macOS, musl) it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import platform

# mallopt's parameter numbers, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

THRESHOLD = 1 << 30  # 1 GiB: above any one activation of a CPU-sized model at a few thousand tokens per step


def keep_freed_memory(threshold: int = THRESHOLD) -> bool:
    """Raise glibc's mmap and trim thresholds to ``threshold`` bytes; True if the C library took both.

    Returns False (and changes nothing) where the C library is not glibc.
    """
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success, 0 when it refuses a value
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold)) & bool(libc.mallopt(M_TRIM_THRESHOLD, threshold))


__all__ = ["keep_freed_memory", "THRESHOLD"]
