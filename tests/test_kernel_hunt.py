"""Attention edges the kernel tests did not reach (kernel hunt): fp64 through the torch and CPU paths, and the
backend ``auto`` picks on a CUDA device while Triton's interpreter is switched on.

Oracles: ``torch.nn.functional.scaled_dot_product_attention`` in fp64 on K/V gathered slot by slot through a
hand-built block table (not the code under test), and the rule ``minivllm/model/backends.py`` states for
``auto``.  No model loads, no GPU and no Triton launch is needed.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from minivllm.model import backends
from minivllm.model.attention import AttentionMetadata, TorchAttentionBackend
from minivllm.model.cpu_attention import CpuAttentionBackend, load_kernel

PAGE = 4
# (context, query) per sequence, decode-first: decodes at a block boundary and one past it, then a chunk that
# starts mid-block after a cached prefix and a fresh prompt one token longer than a block.
SEQS = [(PAGE - 1, 1), (PAGE, 1), (PAGE + 2, 3), (0, PAGE + 1)]
TABLES = [[7, 0, 0], [2, 5, 0], [6, 1, 0], [3, 4, 0]]  # scattered blocks; 0 pads (and is a real block)


def _fp64_case(kv_heads: int = 2, group: int = 3, head_dim: int = 16):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(8, PAGE, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(8, PAGE, kv_heads, head_dim, generator=gen, dtype=torch.float64)
    q = torch.randn(sum(ql for _, ql in SEQS), kv_heads * group, head_dim, generator=gen, dtype=torch.float64)
    starts = [0]
    for _, ql in SEQS:
        starts.append(starts[-1] + ql)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(q.shape[0], dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + ql for c, ql in SEQS], dtype=torch.int32),
        block_tables=torch.tensor(TABLES, dtype=torch.int32), num_decodes=2,
        query_lens=[ql for _, ql in SEQS], context_lens=[c for c, _ in SEQS])
    return q, k_cache, v_cache, meta


def _sdpa_fp64(q, k_cache, v_cache, scale):
    """Each sequence's keys gathered slot by slot, then SDPA in fp64 (query i sees keys <= context + i)."""
    group = q.shape[1] // k_cache.shape[2]
    out, row = torch.empty_like(q), 0
    for (ctx, ql), table in zip(SEQS, TABLES):
        n = ctx + ql
        blocks, offsets = [table[p // PAGE] for p in range(n)], [p % PAGE for p in range(n)]
        k = k_cache[blocks, offsets].transpose(0, 1).repeat_interleave(group, 0)
        v = v_cache[blocks, offsets].transpose(0, 1).repeat_interleave(group, 0)
        mask = torch.arange(n)[None, :] <= torch.arange(ql)[:, None] + ctx
        out[row:row + ql] = F.scaled_dot_product_attention(
            q[row:row + ql].transpose(0, 1), k, v, attn_mask=mask, scale=scale).transpose(0, 1)
        row += ql
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_an_fp64_model_attends_in_fp64(backend):
    """fp64 is the dtype the config offers for exact checks, and the Triton kernels keep it (1e-15 off in a like
    case), but the torch reference -- which the CPU backend also serves every non-fp32 step with -- cast q, K
    and V to fp32 and back, so a model served in fp64 got attention rounded to fp32 (2.6e-7 off here).  The
    reference now computes in fp32 only for the half types and fp32 itself."""
    if backend == "cpu" and load_kernel() is None:
        pytest.skip("no C compiler: the CPU backend cannot be built")
    q, k_cache, v_cache, meta = _fp64_case()
    attend = (TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend()).attend
    got = attend(q, k_cache, v_cache, meta, 0.25)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _sdpa_fp64(q, k_cache, v_cache, 0.25), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interpret", ["1", "true", "0"])
def test_auto_on_a_cuda_device_takes_triton_only_when_it_runs_compiled(monkeypatch, interpret):
    """The module docstring: ``auto`` picks Triton exactly when it can run compiled.  With ``TRITON_INTERPRET``
    on (exported in a shell to debug a kernel, or set by a script's CPU dry run), a CUDA device still got the
    Triton backend, whose every launch the interpreter then runs in Python on host copies of the tensors --
    orders of magnitude slower than the torch path, which ``auto`` now takes instead.  No GPU is touched: the
    Triton backend is stood in for by a recorder."""
    made = []
    monkeypatch.setattr(backends, "_make_triton_backend",
                        lambda device: made.append(device) or types.SimpleNamespace(name="triton"))
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    compiled = interpret == "0"
    assert backends.get_attention_backend("auto", "cuda").name == ("triton" if compiled else "torch")
    assert made == ([torch.device("cuda")] if compiled else [])


def test_a_cuda_tensor_under_the_interpreter_is_not_compiled_work(monkeypatch):
    """Triton's interpreter copies a CUDA tensor to the host and computes there, where bf16 held as raw bits
    gives garbage unless loads are upcast (8e8 off on a CPU decode with the cast forced off).  ``launch`` read
    "a CUDA tensor" as "compiled": no upcast, GPU launch options.  Oracle: the module's own rule, as Triton
    applies it -- the interpreter was on when the kernels were decorated (set here: on a GPU machine the suite
    imports them compiled)."""
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from minivllm.model.kernels import launch

    monkeypatch.setattr(launch, "INTERPRETED", True)
    cuda_bf16 = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cuda"))  # no GPU needed to ask
    assert not launch.is_gpu(cuda_bf16)
    assert launch.needs_upcast(cuda_bf16)
    monkeypatch.setattr(launch, "INTERPRETED", False)  # compiled: the GPU's own bf16, no upcast, as before
    assert launch.is_gpu(cuda_bf16) and not launch.needs_upcast(cuda_bf16)
