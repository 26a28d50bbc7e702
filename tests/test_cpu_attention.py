"""The C decode kernel (attention_backend="cpu") against the torch reference, the oracle.

Every case poisons the cache slots a sequence does not own with NaN for the
kernel (the reference, which multiplies masked padding by zero, sees zeros there), scatters
each sequence's blocks in random order, and puts lengths at block boundaries, so
a kernel that reads one slot too many, follows the table wrongly or maps query
heads to the wrong KV head produces NaN or a visible difference.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.model.attention import AttentionMetadata, paged_attention_reference
from minivllm.model.backends import get_attention_backend
from minivllm.model.cpu_attention import CpuAttentionBackend, load_kernel, paged_decode
from tests.fuzz import examples

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the CPU kernel cannot be built")


def _paged(lens, block_size, kv_heads, head_dim, seed, extra_blocks=3):
    """Random K/V for sequences of ``lens``, blocks scattered, every unowned slot NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    k = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lens), max(need) + 2, dtype=torch.int32)  # wider than needed: padding is never read
    used = 0
    for i, (n, nb) in enumerate(zip(lens, need)):
        blocks = perm[used: used + nb]
        used += nb
        table[i, :nb] = blocks.to(torch.int32)
        for j, blk in enumerate(blocks.tolist()):
            rows = min(block_size, n - j * block_size)
            k[blk, :rows] = torch.randn(rows, kv_heads, head_dim, generator=g)
            v[blk, :rows] = torch.randn(rows, kv_heads, head_dim, generator=g)
    return k, v, table


def _meta(lens, table, query_lens=None):
    query_lens = query_lens or [1] * len(lens)
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
    loc = torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0).tolist()), dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long), query_start_loc=loc,
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=table, num_decodes=num_decodes,
        query_lens=list(query_lens), context_lens=[n - q for n, q in zip(lens, query_lens)])


@settings(max_examples=examples(60), deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 2, 4, 16, 32]),
    group=st.sampled_from([1, 3, 4]),
    kv_heads=st.integers(1, 3),
    head_dim=st.sampled_from([8, 64, 128]),  # 64 and 128 take the kernel's fixed-size paths
    seed=st.integers(0, 10_000),
)
def test_decode_kernel_matches_reference(lens, block_size, group, kv_heads, head_dim, seed):
    k, v, table = _paged(lens, block_size, kv_heads, head_dim, seed)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    meta = _meta(lens, table)
    expected = paged_attention_reference(q, k.nan_to_num(0), v.nan_to_num(0), meta, 0.3)
    got = paged_decode(q, k, v, table, meta.seq_lens, 0.3)
    assert not got.isnan().any(), "read a slot the sequence does not own"
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lens", [[15, 16, 17, 32, 33], [1], [200, 3]])
def test_block_boundaries_and_long_rows(lens):
    k, v, table = _paged(lens, 16, 3, 64, seed=len(lens))
    q = torch.randn(len(lens), 9, 64)
    meta = _meta(lens, table)
    torch.testing.assert_close(paged_decode(q, k, v, table, meta.seq_lens, 0.125),
                               paged_attention_reference(q, k.nan_to_num(0), v.nan_to_num(0), meta, 0.125), rtol=1e-5, atol=1e-5)


def test_mixed_batch_through_the_backend():
    """Decodes by the kernel, a prefill chunk by torch: the whole batch equals the reference."""
    lens = [17, 40, 9 + 12]  # two decodes, then a 12-token chunk on a 9-token context
    query_lens = [1, 1, 12]
    k, v, table = _paged(lens, 4, 2, 16, seed=7)
    q = torch.randn(sum(query_lens), 6, 16)
    meta = _meta(lens, table, query_lens)
    k, v = k.nan_to_num(0), v.nan_to_num(0)  # the prefill rows run through torch, which reads padding
    got = CpuAttentionBackend().attend(q, k, v, meta, 0.25)
    torch.testing.assert_close(got, paged_attention_reference(q, k.nan_to_num(0), v.nan_to_num(0), meta, 0.25), rtol=1e-5, atol=1e-5)



def test_a_bfloat16_batch_through_the_backend_matches_the_float32_reference():
    """The C kernel reads float32 only, so the backend must send a bf16 model's step down the torch path rather
    than into the kernel, which refuses it: a CPU engine in ``dtype="bfloat16"`` then decodes instead of raising
    on its first decode step.  Oracle: the torch reference in float32 on the same (bf16-rounded) values, to bf16's
    rounding."""
    lens = [17, 40, 9 + 12]  # two decodes, then a 12-token chunk on a 9-token context
    query_lens = [1, 1, 12]
    k, v, table = _paged(lens, 4, 2, 16, seed=11)
    k, v = k.nan_to_num(0).bfloat16(), v.nan_to_num(0).bfloat16()
    q = torch.randn(sum(query_lens), 6, 16, generator=torch.Generator().manual_seed(12)).bfloat16()
    meta = _meta(lens, table, query_lens)
    got = CpuAttentionBackend().attend(q, k, v, meta, 0.25)
    want = paged_attention_reference(q.float(), k.float(), v.float(), meta, 0.25)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)

def test_auto_picks_cpu_kernel_and_bad_inputs_are_refused():
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("torch", "cpu").name == "torch"
    k, v, table = _paged([5], 4, 1, 8, seed=0)
    with pytest.raises(ValueError, match="float32"):
        paged_decode(torch.randn(1, 1, 8).double(), k, v, table, torch.tensor([5]), 1.0)
    with pytest.raises(ValueError, match="int32"):
        paged_decode(torch.randn(1, 1, 8), k, v, table.long(), torch.tensor([5]), 1.0)
    with pytest.raises(ValueError, match="unsupported shape"):  # 5 query heads cannot share 2 KV heads
        k2, v2, t2 = _paged([5], 4, 2, 8, seed=0)
        paged_decode(torch.randn(1, 5, 8), k2, v2, t2, torch.tensor([5]), 1.0)


@settings(max_examples=examples(40), deadline=None)
@given(
    q_len=st.integers(1, 40),
    context=st.sampled_from([0, 0, 1, 15, 33]),
    block_size=st.sampled_from([1, 4, 16]),
    group=st.sampled_from([1, 3]),
    kv_heads=st.integers(1, 2),
    seed=st.integers(0, 10_000),
)
def test_prefill_chunk_matches_reference(q_len, context, block_size, group, kv_heads, seed):
    """The fused-SDPA prefill call equals the reference's, with and without cached context."""
    from minivllm.model.attention import _prefill_attention
    from minivllm.model.cpu_attention import prefill_chunk

    k, v, table = _paged([context + q_len], block_size, kv_heads, 16, seed)
    k, v = k.nan_to_num(0), v.nan_to_num(0)
    q = torch.randn(q_len, kv_heads * group, 16, generator=torch.Generator().manual_seed(seed + 2))
    # 0.3, not 16 ** -0.5 (= 0.25, SDPA's default): a call that dropped ``scale`` would pass unnoticed
    torch.testing.assert_close(prefill_chunk(q, k, v, table[0], context, 0.3),
                               _prefill_attention(q, k, v, table[0], context, 0.3), rtol=1e-5, atol=1e-5)


def test_loading_the_kernel_keeps_subnormals():
    """The kernel is compiled with -ffast-math; linked with it, gcc adds a constructor that flushes subnormal
    floats to zero in the whole process, silently changing every torch op. It must be linked without."""
    assert load_kernel() is not None
    tiny = torch.tensor([1e-40, -3e-42])  # subnormal float32 values
    assert bool(((tiny * 1.0) != 0).all()) and bool(((tiny + 0.0) == tiny).all())


def test_kernel_cache_keeps_one_library_per_cpu_kind():
    """The library is built with ``-march=native``: a cache directory shared by two kinds of CPU (an NFS
    home) must hand each its own build, so the file name changes with the CPU's model and flags, and with
    the source and the compile flags, and with nothing else."""
    from minivllm.model import cpu_attention as ca

    flags = ["-O3", "-march=native"]
    name = ca._library_name(b"src", flags, b"flags : avx2")
    assert name == ca._library_name(b"src", flags, b"flags : avx2")  # stable: the cache is reused
    assert name != ca._library_name(b"src", flags, b"flags : avx2 avx512f")
    assert name != ca._library_name(b"src", flags, b"model name : another CPU\nflags : avx2")
    assert name != ca._library_name(b"src2", flags, b"flags : avx2")
    assert name != ca._library_name(b"src", ["-O2", "-march=native"], b"flags : avx2")
    identity = ca._cpu_identity()
    assert identity  # never empty: an empty identity would let every CPU share one build
    try:
        with open("/proc/cpuinfo", "rb") as fh:
            flag_lines = {ln for ln in fh.read().splitlines() if ln.startswith(b"flags")}
    except OSError:
        return
    assert all(line in identity for line in flag_lines)  # this machine's flags are part of the key


def test_switching_the_kernel_off_takes_effect_after_it_was_loaded(monkeypatch):
    """MINIVLLM_CPU_KERNEL=0 is the documented way to force the torch path; it used to be read once, inside the
    process-wide memo, so whichever engine came first decided for every later one."""
    first = load_kernel()
    if first is None:
        pytest.skip("no C compiler: the kernel cannot be loaded, so switching it off cannot be observed")
    monkeypatch.setenv("MINIVLLM_CPU_KERNEL", "0")
    assert load_kernel() is None
    monkeypatch.delenv("MINIVLLM_CPU_KERNEL")
    assert load_kernel() is first



def test_the_build_keys_its_cached_library_by_the_cpu(tmp_path, monkeypatch):
    """Not just the name function: the build itself writes one library per kind of CPU into the cache
    directory, so a second kind of CPU builds its own instead of loading the first one's."""
    from minivllm.model import cpu_attention as ca

    if load_kernel() is None:
        pytest.skip("no C compiler")
    monkeypatch.setattr(ca, "_cache_dir", lambda: tmp_path)
    for cpu in (b"flags : avx2", b"flags : avx2 avx512f"):
        monkeypatch.setattr(ca, "_cpu_identity", lambda cpu=cpu: cpu)
        assert ca._build() is not None
    assert len(list(tmp_path.glob("paged_decode_*.so"))) == 2


def _fresh_kernel_memo(monkeypatch, tmp_path):
    """A process whose kernel was never built: an empty memo and a cache directory of the test's own."""
    from minivllm.model import cpu_attention as ca

    monkeypatch.setattr(ca, "_kernel", {})
    monkeypatch.delenv("MINIVLLM_CPU_KERNEL", raising=False)
    return ca


def test_a_cache_directory_that_cannot_be_made_means_no_kernel_not_a_crash(tmp_path, monkeypatch):
    """load_kernel promises ``None`` when building is impossible, and ``auto`` then picks the torch path. A home
    directory that cannot be written (the user ``nobody``, HOME=/nonexistent; a read-only container) made the
    cache's ``mkdir`` raise, and every ``LLM()`` on that machine died with PermissionError before serving."""
    ca = _fresh_kernel_memo(monkeypatch, tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MINIVLLM_CACHE", str(blocker / "cache"))  # mkdir fails here even for root
    assert ca.load_kernel() is None
    assert get_attention_backend("auto", "cpu").name == "torch"


def test_a_compiler_named_by_cc_that_does_not_exist_means_no_kernel(tmp_path, monkeypatch):
    """``CC`` naming a compiler that is not installed is the same as no compiler: the torch path, no traceback."""
    ca = _fresh_kernel_memo(monkeypatch, tmp_path)
    monkeypatch.setattr(ca, "_cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert ca.load_kernel() is None
    assert get_attention_backend("auto", "cpu").name == "torch"


def test_cc_may_carry_a_wrapper_and_flags_as_make_allows(tmp_path, monkeypatch):
    """``CC="ccache gcc"`` is how build tools spell a compiler behind a wrapper; it is a command line, not one
    file name. ``env`` stands in for the wrapper here (it runs its arguments and is always installed)."""
    import shutil

    gcc = shutil.which("gcc")
    if gcc is None or shutil.which("env") is None:
        pytest.skip("needs gcc and env")
    ca = _fresh_kernel_memo(monkeypatch, tmp_path)
    monkeypatch.setattr(ca, "_cache_dir", lambda: tmp_path)
    monkeypatch.setenv("CC", f"env {gcc}")
    assert ca.load_kernel() is not None


@pytest.mark.parametrize("threads", [1, 2, 8])
def test_every_way_the_kernel_shares_work_matches_the_reference(threads):
    """The kernel splits a step's attention three ways by how many sequences there are for its threads: whole
    sequences per task, one K/V group per task, or single query heads (fewer (sequence, K/V head) pairs than twice
    the threads).  Which one runs depends on the thread count, so the random cases above reach a path only as
    their shapes and the machine's threads happen to fall.  Here each count is set (torch's setting is the OpenMP
    runtime's the kernel shares) on SmolLM2's shape: 1, 2 and 5 sequences, contexts across block boundaries."""
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for lens in ([1], [700], [33, 200], [15, 16, 17, 300, 64]):
            k, v, table = _paged(lens, 16, 3, 64, seed=sum(lens))
            q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(len(lens)))
            meta = _meta(lens, table)
            got = paged_decode(q, k, v, table, meta.seq_lens, 0.125)
            assert not got.isnan().any()
            torch.testing.assert_close(got, paged_attention_reference(q, k.nan_to_num(0), v.nan_to_num(0), meta,
                                                                      0.125), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(saved)
