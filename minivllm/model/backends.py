"""Choosing an attention backend by name.

Two implementations of the same interface (``write_kv`` + ``attend``) exist:

* ``"torch"`` -- :class:`minivllm.model.attention.TorchAttentionBackend`, plain torch,
  runs anywhere and is the reference;
* ``"cpu"`` -- :class:`minivllm.model.cpu_attention.CpuAttentionBackend`, decode
  rows through a small C kernel built on first use with gcc (reads K/V in place
  through the block table), prefill rows as torch;
* ``"triton"`` -- :class:`minivllm.model.kernels.TritonAttentionBackend`, paged
  kernels compiled for a CUDA GPU, or run by Triton's CPU interpreter.

``"auto"`` picks Triton exactly when it can run compiled: a CUDA device and an
importable ``triton``.  On a CPU the interpreter is correct but orders of
magnitude slower than torch, so ``auto`` never picks it there: it picks ``"cpu"``
when the C kernel builds (a compiler is present) and ``"torch"`` otherwise.

Triton is imported lazily, inside :func:`get_attention_backend`, so
``import minivllm`` works on machines without Triton.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from minivllm.interfaces import AttentionBackend
from minivllm.model.attention import TorchAttentionBackend

BACKEND_NAMES = ("torch", "cpu", "triton", "auto")


def triton_available() -> bool:
    """True when the ``triton`` package can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when Triton's CPU interpreter is switched on in this process's environment."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _make_triton_backend(device: torch.device) -> AttentionBackend:
    """Import the kernels (only now) and build the Triton backend, or explain why not."""
    if not triton_available():
        raise ValueError("attention backend 'triton' needs the `triton` package, which is not installed")
    if device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"attention backend 'triton' on device {device.type!r} needs Triton's CPU interpreter: "
            "set the environment variable TRITON_INTERPRET=1 before minivllm.model.kernels is imported "
            "(Triton reads it when the kernels are defined), or use attention_backend='torch'"
        )
    from minivllm.model.kernels import TritonAttentionBackend

    return TritonAttentionBackend()


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """The backend called ``name`` (``"torch"``, ``"cpu"``, ``"triton"`` or ``"auto"``) for ``device``.

    Raises ``ValueError`` for an unknown name, or for ``"triton"`` / ``"cpu"`` where it cannot run.
    """
    device = torch.device(device)
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if triton_available() else "torch"
        else:
            from minivllm.model.cpu_attention import load_kernel

            name = "cpu" if device.type == "cpu" and load_kernel() is not None else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU, not on {device.type!r}")
        from minivllm.model.cpu_attention import CpuAttentionBackend, load_kernel

        if load_kernel() is None:
            raise ValueError("attention backend 'cpu' needs a C compiler (gcc) to build its decode kernel; "
                             "use attention_backend='torch'")
        return CpuAttentionBackend()
    return _make_triton_backend(device)
