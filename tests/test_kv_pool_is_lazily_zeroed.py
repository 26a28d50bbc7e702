"""A CPU engine's KV pool is zero but costs RAM only where it is written (``minivllm.kv.kv_cache.zeroed``).

The oracle is the kernel's own count of this process's resident pages (``/proc/self/statm``): a pool filled by
``torch.zeros`` is resident in full the moment it exists, 1 GiB for the default CPU engine before any request.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc/self/statm")

SCRIPT = r"""
import os, torch
from minivllm.kv.kv_cache import KVCache

page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page

for dtype in (torch.float32, torch.bfloat16):
    before = resident()
    # the default CPU pool of the bundled model's shape: 30 layers, 3 KV heads of 64, 1,456 blocks of 16 (1 GiB)
    cache = KVCache(30, 1456 if dtype == torch.float32 else 2912, 16, 3, 64, dtype, torch.device("cpu"))
    grew = resident() - before
    k, v = cache.layers[29]
    assert k.dtype == dtype and k.shape == (cache.num_blocks, 16, 3, 64), (k.dtype, k.shape)
    assert not k[-1].any() and not v[0].any() and not cache.layers[0][0][7].any()  # zero where nothing was written
    v[5].fill_(1.5)  # and writable, in place: a view of the one pool
    assert float(cache.layers[29][1][5].sum()) == 1.5 * 16 * 3 * 64
    print(dtype, cache.total_bytes, grew)
    assert cache.total_bytes >= 1 << 29 and grew < 64 << 20, (dtype, cache.total_bytes, grew)
    del cache, k, v
"""


def test_a_cpu_pool_is_zero_and_resident_only_where_written():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
