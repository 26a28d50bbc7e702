"""Choosing an attention backend by name.

Three implementations of the same interface (``write_kv`` + ``attend``) exist:

* ``"torch"`` -- :class:`minivllm.model.attention.TorchAttentionBackend`, plain torch,
  runs anywhere and is the reference;
* ``"cpu"`` -- :class:`minivllm.model.cpu_attention.CpuAttentionBackend`, decode
  rows through a small C kernel built on first use with gcc (reads K/V in place
  through the block table), prefill rows as torch;
* ``"triton"`` -- :class:`minivllm.model.kernels.TritonAttentionBackend`, paged
  kernels compiled for a CUDA GPU, or run by Triton's CPU interpreter.

``"auto"`` picks Triton exactly when it can run compiled: a CUDA device, an
importable ``triton`` and ``TRITON_INTERPRET`` switched off.  On a CPU the
interpreter is correct but orders of magnitude slower than torch, so ``auto``
never picks it there: it picks ``"cpu"`` when the C kernel builds (a compiler is
present) and ``"torch"`` otherwise.

The projections (every ``nn.Linear`` of the model) have backends too:
``"torch"`` (``F.linear``, the default BLAS) or ``"onednn"`` (the weights packed
for oneDNN's matmul, see :meth:`~minivllm.model.llama.LlamaForServing.pack_for_onednn`).
``"auto"`` picks oneDNN for fp32 on a CPU where torch was built with it and
a self-check agrees with ``F.linear``; everywhere else ``"torch"``.

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
    """True when Triton's CPU interpreter is switched on in this process's environment, read by Triton's own
    rule: ``1``, ``true``, ``on``, ``yes`` or ``y`` in any case (``TRITON_INTERPRET=true`` interprets too)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes", "y")


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
            # with the interpreter switched on, Triton would run every launch in Python on host copies
            name = "triton" if triton_available() and not triton_interpreting() else "torch"
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


def onednn_linear_works() -> bool:
    """Can this torch run a packed fp32 linear through oneDNN, with ``F.linear``'s results (to 1e-4)?"""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 64, generator=gen), torch.randn(32, 64, generator=gen)
        from minivllm.model.llama import linear, onednn_weight

        got = linear(x, onednn_weight(w))
        return bool(torch.allclose(got, torch.nn.functional.linear(x, w), rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError):  # a build without the op, or a CPU oneDNN refuses
        return False


def resolve_linear_backend(name: str, device: torch.device | str, dtype: torch.dtype) -> str:
    """``"torch"`` or ``"onednn"`` for the config's ``linear_backend`` (``ValueError`` where impossible)."""
    device = torch.device(device)
    usable = device.type == "cpu" and dtype == torch.float32 and onednn_linear_works()
    if name == "auto":
        return "onednn" if usable else "torch"
    if name == "onednn" and not usable:
        raise ValueError("linear_backend 'onednn' needs float32 on a CPU and a torch built with oneDNN "
                         f"(here: device {device.type}, dtype {dtype}, "
                         f"mkldnn {'available' if torch.backends.mkldnn.is_available() else 'missing'}); "
                         "use linear_backend='torch'")
    return name
