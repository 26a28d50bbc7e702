"""Pins for mutants of the attention backends and the KV tensors that the other tests let through (hunt 64).

Each test names the planted change it was checked against and its oracle: the backend rule the module
docstring of ``minivllm/model/backends.py`` states, the Triton library's own reading of its environment, or a
hand trace of blocks that hold distinct constants.  No model loads; no GPU is needed.
"""

from __future__ import annotations

import types

import pytest
import torch

from minivllm.model import backends


def test_auto_on_a_cuda_device_without_triton_serves_with_the_torch_reference(monkeypatch):
    """``triton`` is an optional extra: a CUDA machine without it must still serve under the default
    ``attention_backend="auto"``, with the torch reference; with it, auto takes Triton.  Choosing Triton for every
    CUDA device made each ``LLM()`` on such a machine stop at start-up with "needs the `triton` package"
    (mutant: ``name = "triton"`` on cuda whatever ``triton_available()`` says).  Oracle: the rule stated in the
    module docstring.  Neither branch touches the GPU: the torch backend holds no tensors, and the Triton one
    is stood in for by a recorder."""
    made = []
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a GPU process compiles its kernels (conftest sets 1 on a CPU)
    monkeypatch.setattr(backends, "_make_triton_backend",
                        lambda device: made.append(device) or types.SimpleNamespace(name="triton"))
    monkeypatch.setattr(backends, "triton_available", lambda: False)
    assert backends.get_attention_backend("auto", "cuda").name == "torch"
    assert made == []
    monkeypatch.setattr(backends, "triton_available", lambda: True)
    assert backends.get_attention_backend("auto", "cuda").name == "triton"
    assert made == [torch.device("cuda")]


@pytest.mark.parametrize("value", ["1", "true", "ON", "yes", "0", "false", "off", ""])
def test_the_interpreter_switch_is_read_the_way_triton_reads_it(monkeypatch, value):
    """Whether Triton interprets its kernels on the CPU is Triton's decision, taken from ``TRITON_INTERPRET``
    by its own rule, which accepts ``true``/``on``/``yes`` as well as ``1``.  The backend check must agree with
    it both ways: reading only ``"1"`` refused ``attention_backend="triton"`` on a CPU under
    ``TRITON_INTERPRET=true`` (told to set the variable it had set), and reading anything but ``"0"`` as on
    (mutant: ``!= "0"``) let ``false``, ``off`` or an empty value through to kernels Triton then compiles for a
    GPU the CPU tensors are not on.  Oracle: ``triton.knobs.runtime.interpret``, Triton's reading of the same
    environment."""
    triton = pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert backends.triton_interpreting() is bool(triton.knobs.runtime.interpret)


def test_asking_for_the_cpu_backend_without_its_kernel_is_a_value_error_that_names_the_way_out(monkeypatch):
    """``get_attention_backend`` promises a ``ValueError`` where a named backend cannot run, and the CLI and
    ``LLM()`` report a ``ValueError`` as a configuration mistake.  With the C kernel unavailable (here switched
    off by ``MINIVLLM_CPU_KERNEL=0``, as on a machine without gcc) ``attention_backend="cpu"`` must say so and
    point at ``'torch'``; without the check the backend's constructor raised a bare ``RuntimeError`` instead
    (mutant: the ``load_kernel() is None`` refusal removed).  Oracle: the docstring's contract; ``auto`` on the
    same machine falls back to the torch reference."""
    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", "0")
    with pytest.raises(ValueError, match="attention_backend='torch'"):
        backends.get_attention_backend("cpu", "cpu")
    assert backends.get_attention_backend("auto", "cpu").name == "torch"


def test_the_swap_bandwidth_probe_moves_every_block_whose_bytes_it_counts():
    """``measure_swap_bandwidth`` divides the bytes of ``n`` blocks by the time of the timed copy, so that copy
    must move exactly those ``n`` blocks, device block ``i`` to host block ``i``; moving one block fewer while
    counting all of them overstates the link (8/7 of it for the default probe) and tilts auto mode towards
    swapping (mutant: the probe's pairs built over ``range(n - 1)``).  Oracle: a hand trace -- 3 device blocks
    holding K = 10l + b and V = -(10l + b) in layer l, a 5-block host tier filled with NaN; afterwards host
    blocks 0..2 hold the device's values and host blocks 3..4 are untouched."""
    from minivllm.kv.kv_cache import KVCache

    cache = KVCache(2, num_blocks=3, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=torch.device("cpu"), num_cpu_blocks=5)
    for layer, ((k, v), (ck, cv)) in enumerate(zip(cache.layers, cache.cpu_layers)):
        ck.fill_(float("nan"))
        cv.fill_(float("nan"))
        for b in range(3):
            k[b], v[b] = 10 * layer + b, -(10 * layer + b)
    assert cache.measure_swap_bandwidth() > 0
    for layer, (ck, cv) in enumerate(cache.cpu_layers):
        for b in range(3):
            assert bool((ck[b] == 10 * layer + b).all() and (cv[b] == -(10 * layer + b)).all()), (layer, b)
        assert bool(ck[3:].isnan().all() and cv[3:].isnan().all()), f"layer {layer}: copied past the device pool"


def _decode_by_the_definition(q, k_cache, v_cache, table_row, seq_len, scale):
    """One decode row in float64: softmax(q . k * scale) v over the row's ``seq_len`` keys, slot by slot through
    its block table, query head h reading KV head h // (heads / kv_heads)."""
    heads, block_size, kv_heads = q.shape[0], k_cache.shape[1], k_cache.shape[2]
    slots = [(int(table_row[p // block_size]), p % block_size) for p in range(seq_len)]
    keys = torch.stack([k_cache[b, o] for b, o in slots]).double()
    vals = torch.stack([v_cache[b, o] for b, o in slots]).double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        g = h // (heads // kv_heads)
        out[h] = torch.softmax(keys[:, g] @ q[h].double() * scale, dim=0) @ vals[:, g]
    return out


def test_the_c_decode_kernel_takes_lengths_as_torch_builds_them_by_default():
    """``paged_decode`` hands ``seq_lens`` to C as a raw int32 pointer, so it converts what it is given first: an
    int64 tensor (what ``torch.tensor([5, 9, 3])`` builds, as a learner's lab code or a benchmark would) read as
    int32 gives lengths 5, 0, 9 for three rows, and a strided view gives the wrong elements (mutant: the
    ``seq_lens.to(torch.int32).contiguous()`` line removed; the engine's own int32 lengths hide it).  Oracle: the
    definition in float64, slot by slot through a hand-built block table (blocks out of order, the unused
    slots NaN so a read past a length shows)."""
    from minivllm.model.cpu_attention import load_kernel, paged_decode

    if load_kernel() is None:
        pytest.skip("no C compiler: the CPU decode kernel cannot be built")
    gen = torch.Generator().manual_seed(64)
    lens, block_size, kv_heads, heads, dim = [5, 9, 3], 4, 2, 4, 8
    table = torch.tensor([[3, 0, 0], [5, 1, 4], [2, 0, 0]], dtype=torch.int32)
    k_cache = torch.full((6, block_size, kv_heads, dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    for row, n in zip(table.tolist(), lens):
        for p in range(n):
            k_cache[row[p // block_size], p % block_size] = torch.randn(kv_heads, dim, generator=gen)
            v_cache[row[p // block_size], p % block_size] = torch.randn(kv_heads, dim, generator=gen)
    q = torch.randn(len(lens), heads, dim, generator=gen)
    strided = torch.tensor([x for n in lens for x in (n, 0)], dtype=torch.int32)[::2]
    for seq_lens in (torch.tensor(lens), strided):
        got = paged_decode(q, k_cache, v_cache, table, seq_lens, 0.4)
        for i, n in enumerate(lens):
            want = _decode_by_the_definition(q[i], k_cache, v_cache, table[i], n, 0.4)
            torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-5)
