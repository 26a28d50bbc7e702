"""The CPU attention backend: decode rows through a small C kernel, everything else through torch.

Why a C kernel, and why this one?  Measured on a 2-core machine, about half of a
decode step of the bundled model was decode attention, and most of that was not
arithmetic: the torch path (:func:`~minivllm.model.attention.paged_attention_reference`,
which stays the oracle) copies every decoding sequence's blocks into a padded
tensor for K and for V, in every layer, then multiplies.  The kernel in
``csrc/paged_decode.c`` reads K and V in place through the block table with an
online softmax (the Triton decode kernel's algorithm), so the cache is read once
and nothing the size of the context is written.

Why plain C with ctypes rather than a torch C++ extension?  It compiles in about
a second (a torch extension takes a minute of compiling torch headers), needs
only ``gcc``, and is a single function a reader can follow.  When no compiler is
available (a learner's laptop), :func:`load_kernel` returns ``None`` and the
backend is the torch path: same results, slower.  ``MINIVLLM_CPU_KERNEL=0``
forces that fallback.

Prefill and chunked-prefill rows use torch's SDPA: their attention is a real
matmul (many queries per key), where it is the right tool.  They call it with a
batch dimension and ``enable_gqa`` (:func:`prefill_chunk`), which on a CPU selects
its fused flash-attention kernel; the reference's 3-D call falls back to the
unfused "math" kernel, measured 1.8-5x slower on 300-2000-token chunks.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from minivllm.model.attention import AttentionMetadata, gather_kv, paged_attention_reference, prefill_rows, write_kv

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
KERNEL_MAX_BLOCK, KERNEL_MAX_DIM = 256, 512  # MAX_BLOCK and MAX_DIM of csrc/paged_decode.c
_lock = threading.Lock()
_kernel: dict[str, object] = {}  # memo: built once per process (the .so is cached on disk)


def _cache_dir() -> Path:
    """Where built kernels are kept: per user, outside the package (an installed package's directory may be
    read-only), so a machine compiles once, not once per process; ``MINIVLLM_CACHE`` moves it."""
    root = os.environ.get("MINIVLLM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "minivllm")
    return Path(root) / "kernels"


def load_kernel():
    """Compile (once, cached by source hash) and load the C decode kernel; ``None`` if that is impossible or
    switched off.  The switch is read on every call, before the memo: the memo holds what compiling gave, so
    ``MINIVLLM_CPU_KERNEL=0`` set after a first engine still takes effect for the next one."""
    if os.environ.get("MINIVLLM_CPU_KERNEL", "1") == "0":
        return None
    with _lock:
        if "fn" in _kernel:
            return _kernel["fn"]
        _kernel["fn"] = fn = _build()
        return fn


def _cpu_identity() -> bytes:
    """What ``-march=native`` compiles for: the CPU's model names and feature flags (Linux's /proc/cpuinfo,
    every distinct line: a hybrid CPU's cores may differ), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo", "rb") as fh:
            lines = {line for line in fh.read().splitlines() if line.startswith((b"model name", b"flags"))}
    except OSError:
        lines = set()
    return b"\n".join(sorted(lines)) or platform.processor().encode()


def _library_name(source: bytes, flags: list[str], cpu: bytes) -> str:
    """The cached library's file name: a hash of everything the built code depends on."""
    digest = hashlib.sha256(source + " ".join(flags).encode() + os.uname().machine.encode() + cpu).hexdigest()
    return f"paged_decode_{digest[:16]}.so"


def _build():
    """The loaded kernel, or ``None`` where it cannot be had: no compiler (``CC`` naming one that is not
    installed included), a failed compile, or a cache directory that cannot be made or written (a read-only
    or missing home, ``HOME=/nonexistent``) -- the caller then serves with the torch path."""
    try:
        return _build_or_raise()
    except OSError:
        return None


def _build_or_raise():
    # CC is a command line, as make reads it ("ccache gcc", "gcc -m64"), not one file name
    compiler = shlex.split(os.environ.get("CC", "")) or [shutil.which("gcc") or shutil.which("cc")]
    if compiler[0] is None or not SOURCE.exists():
        return None
    source = SOURCE.read_bytes()
    # -march=native: the .so is built for the CPU that runs it; the hash keeps one per CPU model, feature
    # flags and compile flags (a cache directory shared by two kinds of CPU, an NFS home, say, must not
    # hand an AVX-512 build to an AVX2-only machine).
    # -ffast-math only to compile: linking with it adds crtfastmath.o, whose constructor switches the
    # whole process to flush-subnormals-to-zero when the library loads -- every torch op included.
    compile_flags = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11"]
    link_flags = ["-shared", "-fopenmp"]
    target = _cache_dir() / _library_name(source, compile_flags + link_flags, _cpu_identity())
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".{os.getpid()}.tmp")
        obj = target.with_suffix(f".{os.getpid()}.o")
        steps = ([*compiler, *compile_flags, "-c", str(SOURCE), "-o", str(obj)],
                 [*compiler, *link_flags, str(obj), "-o", str(tmp), "-lm"])
        try:
            for cmd in steps:
                if subprocess.run(cmd, capture_output=True, text=True).returncode != 0:
                    return None
        finally:
            obj.unlink(missing_ok=True)
        os.replace(tmp, target)  # atomic: concurrent processes never load a half-written file
    try:
        lib = ctypes.CDLL(str(target))  # torch is imported, so its libgomp is the one this binds to
    except OSError:
        return None
    fn = lib.paged_decode_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, p, p, p, i64, p, p, i64, i64, i64, i64, i64, ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, kernel=None) -> torch.Tensor:
    """Decode attention ``q: [B, H, D]`` through the paged cache with the C kernel.

    ``block_tables`` ``[B, >=max_blocks]`` int32 (rows may be a view with a larger
    stride), ``seq_lens`` ``[B]`` int32 keys per sequence (new token included).
    """
    kernel = kernel or load_kernel()
    if kernel is None:
        raise RuntimeError("the CPU decode kernel is not available (no C compiler?)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor")
    if block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 with contiguous rows")
    seq_lens = seq_lens.to(torch.int32).contiguous()
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    rc = kernel(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(),
                batch, heads, kv_heads, dim, block_size, float(scale))
    if rc != 0:
        raise ValueError(f"unsupported shape for the CPU decode kernel: heads={heads} kv_heads={kv_heads} "
                         f"head_dim={dim} block_size={block_size}")
    return out


def prefill_chunk(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  context_len: int, scale: float) -> torch.Tensor:
    """One prefill chunk ``q: [q_len, heads, D]`` after ``context_len`` cached tokens, by fused SDPA.

    The same attention as the reference's ``_prefill_attention`` (the oracle),
    shaped so torch picks its flash kernel: ``[1, heads, len, D]`` tensors, K/V
    heads shared by ``enable_gqa`` rather than copied, and no mask at all when
    the chunk starts the sequence (plain causal).
    """
    q_len = q.shape[0]
    kv_len = context_len + q_len
    k = gather_kv(k_cache, block_table, kv_len).transpose(0, 1)[None]
    v = gather_kv(v_cache, block_table, kv_len).transpose(0, 1)[None]
    mask = None
    if context_len:  # query i sits at position context_len + i and sees keys <= that
        mask = torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + context_len
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k, v, attn_mask=mask, is_causal=not context_len, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


class CpuAttentionBackend:
    """Decode rows by the C kernel, prefill rows by fused SDPA (:func:`prefill_chunk`); K/V writes as torch does."""

    name = "cpu"

    def __init__(self, kernel=None) -> None:
        self.kernel = kernel or load_kernel()
        if self.kernel is None:
            raise RuntimeError("the CPU decode kernel could not be built (no C compiler?)")

    def write_kv(self, k, v, k_cache, v_cache, meta: AttentionMetadata) -> None:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        # beyond the C kernel's MAX_BLOCK / MAX_DIM (csrc/paged_decode.c) the torch path serves the step instead
        if (q.dtype != torch.float32 or not k_cache.is_contiguous()
                or k_cache.shape[1] > KERNEL_MAX_BLOCK or q.shape[-1] > KERNEL_MAX_DIM):
            return paged_attention_reference(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = paged_decode(q[:nd].contiguous(), k_cache, v_cache, meta.block_tables[:nd],
                                    meta.seq_lens[:nd], scale, self.kernel)
        prefill_rows(q, k_cache, v_cache, meta, scale, out, prefill_chunk)
        return out
