"""Pins for Triton kernel bugs that ``test_triton_attention.py`` let through (a mutation pass).

Each test below fails with one small, realistic edit of ``minivllm/model/kernels`` that the main
kernel tests did not notice, and passes on the real code.  The edit each one was checked against is
named in its docstring.  Shapes are tiny: every launch runs in Triton's CPU interpreter.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede any triton / minivllm.model.kernels import

import tempfile

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import assert_close, make_case, nan_like  # noqa: E402  (tests/ is on sys.path)
from test_triton_attention import run_decode as decode  # noqa: E402  (all rows of a decode-only case)

from minivllm.model.attention import write_kv  # noqa: E402
from minivllm.model.kernels import (  # noqa: E402
    TritonAttentionBackend,
    choose_num_splits,
    paged_decode,
    triton_attention,
    write_kv_triton,
)


def test_split_merge_stays_finite_when_logits_are_large() -> None:
    """The merge must subtract the largest split lse before ``exp2``.

    With logits of a few hundred (a sharply peaked head), ``2^lse`` overflows fp32 and the merged output
    becomes inf/inf = NaN; the single-pass softmax of the oracle is fine.  Mutant: ``m = 0.0 * m`` in
    ``_decode_merge_kernel`` (merge without the max shift) -- the main tests only use logits near 1.
    """
    case = make_case([(16, 1), (32, 1)], num_decodes=2, kv_heads=1, group=2, head_dim=16, seed=4)
    case.q *= 60.0  # scores * log2(e) reach several hundred: 2^score overflows fp32
    assert_close(decode(case, num_splits=2, block_n=16), case.reference(), torch.float32)


def test_an_explicit_split_count_above_the_cap_still_merges_every_split() -> None:
    """``paged_decode(num_splits=...)`` accepts counts above ``_MAX_SPLITS``; the merge tile must grow to them.

    80 splits of 16 tokens each are all non-empty, so a merge that reads only the first 64 drops a fifth
    of the keys.  Mutant: ``BLOCK_S=_MERGE_BLOCK_S`` (the cap's tile, whatever the split count).
    """
    case = make_case([(80 * 16 - 1, 1)], num_decodes=1, kv_heads=1, group=1, head_dim=16, seed=6)
    assert_close(decode(case, num_splits=80, block_n=16), case.reference(), torch.float32)


def test_the_split_count_never_exceeds_the_cap_however_long_the_context() -> None:
    """A million-token context on 132 SMs wants 528 programs and could use 4096 splits: the cap (64) wins.

    Above the cap the merge kernel's ``BLOCK_S`` changes, i.e. a new binary compiles mid-serving.
    Mutant: ``choose_num_splits`` without ``_MAX_SPLITS`` in its ``min`` (the existing case hits the cap
    and the length limit at the same value, 64, so it cannot tell).
    """
    assert choose_num_splits(batch=1, kv_heads=1, max_seq_len=1 << 20, num_units=132) == 64


def test_block_offsets_do_not_wrap_in_a_pool_beyond_two_to_the_32_elements() -> None:
    """``block_id * stride_block`` must be computed in int64.

    K and V share one pool (a block's stride is 512 elements); the sequence's blocks start at block 2^23,
    element offset 2^32, which an int32 product wraps to 0 -- a NaN block.  The pool is a sparse file
    mapping: 8 GiB of addresses, only the touched pages exist.  Mutant: ``(pages * stride_block).to(tl.int64)``
    in ``load_paged_tile`` (multiply first, widen after).
    """
    small = make_case([(39, 1)], num_decodes=1, kv_heads=1, group=2, head_dim=16, dtype=torch.float16,
                      share_blocks=False, seed=5)
    page, head_dim = 16, 16
    first = 2**32 // (2 * page * head_dim)
    num_blocks = first + 4
    with tempfile.NamedTemporaryFile(prefix="kernel_mutants_pool_") as f:
        flat = torch.from_file(f.name, shared=True, size=num_blocks * 2 * page * head_dim, dtype=torch.float16)
    pool = flat.view(num_blocks, 2, page, 1, head_dim)
    pool[:4] = float("nan")  # where a wrapped offset lands
    used = small.meta.block_tables[0, :3].long()
    pool[first:first + 3, 0] = small.k_cache[used]
    pool[first:first + 3, 1] = small.v_cache[used]
    table = torch.tensor([[first, first + 1, first + 2, first + 3]], dtype=torch.int32)
    out = nan_like(small.q)
    paged_decode(small.q, pool[:, 0], pool[:, 1], table, small.meta.seq_lens, small.scale,
                 max_seq_len=40, out=out, num_splits=1)
    assert_close(out, small.reference(), torch.float16)


def test_kv_write_kernel_skips_slots_past_the_end_of_the_pool() -> None:
    """A slot >= num_blocks * page_size is skipped, not written past the cache.

    The caches are views of a larger buffer, so a store past their end lands in memory the test can read
    (rather than crashing the interpreter).  Mutant: ``valid = slot >= 0`` in ``_kv_write_kernel``.
    """
    gen = torch.Generator().manual_seed(2)
    k_buf = torch.randn(7, 4, 3, 64, generator=gen)
    v_buf = torch.randn(7, 4, 3, 64, generator=gen)
    k_cache, v_cache = k_buf[:6], v_buf[:6]  # 24 slots; block 6 is beyond the pool
    k = torch.randn(3, 3, 64, generator=gen)
    v = torch.randn(3, 3, 64, generator=gen)
    slots = torch.tensor([5, 24, 27])
    want_k, want_v = k_buf.clone(), v_buf.clone()
    write_kv(k[:1], v[:1], want_k[:6], want_v[:6], slots[:1])
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_buf, want_k) and torch.equal(v_buf, want_v)


def test_backend_gives_the_decode_split_heuristic_an_upper_bound_on_lengths(monkeypatch) -> None:
    """``max_seq_len`` must bound ``seq_lens`` (the new token included), not the cached context alone.

    It sizes the split count, so an off-by-one changes no output here but picks too few splits at a
    256-token boundary on a GPU.  Mutant: ``max_seq_len=max(meta.context_lens[:num_decodes])`` in ``attend``.
    """
    seen = []

    def recording_decode(*args, max_seq_len, **kwargs):
        seen.append(max_seq_len)
        return paged_decode(*args, max_seq_len=max_seq_len, **kwargs)

    monkeypatch.setattr(triton_attention, "paged_decode", recording_decode)
    case = make_case([(15, 1), (16, 1)], num_decodes=2, kv_heads=1, group=2, head_dim=16, seed=8)
    out = TritonAttentionBackend().attend(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, case.reference(), torch.float32)
    assert seen and seen[0] >= int(case.meta.seq_lens.max())


@pytest.mark.parametrize("num_splits", [1, 2], ids=["direct-store", "split-merge"])
def test_decode_writes_through_out_strides_when_q_is_a_view_of_the_fused_projection(num_splits: int) -> None:
    """The model hands ``attend`` a non-contiguous ``q`` (``qk[:, :hq]`` of the rotated q/k projection),
    while ``out`` is a fresh contiguous tensor: the stores must use ``out``'s strides, not ``q``'s.

    The main tests always pass a contiguous ``q``, where the two agree.  Mutants: ``*q.stride()`` in place
    of ``*out.stride()`` in the merge launch (split-merge case) or the split launch (direct-store case;
    the engine test also catches that one, by a segfault).
    """
    case = make_case([(15, 1), (16, 1), (17, 1)], num_decodes=3, kv_heads=1, group=2, head_dim=16, seed=9)
    wide = torch.randn(3, 3, 16)  # q heads then one k head, as in the fused projection
    wide[:, :2] = case.q
    q = wide[:, :2]
    assert not q.is_contiguous()
    out = torch.full((5, 2, 16), float("nan"))[:3]  # slack behind `out`: a wrong stride fails, not crashes
    paged_decode(q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens, case.scale,
                 max_seq_len=17, out=out, num_splits=num_splits, block_n=16)
    assert_close(out, case.reference(), torch.float32)


def test_a_zero_length_decode_row_merges_to_zeros_as_the_direct_store_does() -> None:
    """A row whose every split is empty (``seq_len == 0``) gets 0 from the merge, as from the one-split path.

    The merge guards both ``-inf - -inf`` (the max of all-empty lse) and ``0 / 0`` (their total weight);
    the engine never sends such a row today, but a CUDA-graph padding row that carried length 0 would
    otherwise turn NaN.  Mutant: ``/ total`` without the ``total > 0`` guard in ``_decode_merge_kernel``.
    """
    case = make_case([(16, 1), (4, 1)], num_decodes=2, kv_heads=1, group=2, head_dim=16, seed=10)
    seq_lens = torch.tensor([17, 0], dtype=torch.int32)
    outs = []
    for num_splits in (1, 2):
        out = nan_like(case.q)
        paged_decode(case.q, case.k_cache, case.v_cache, case.meta.block_tables, seq_lens, case.scale,
                     max_seq_len=17, out=out, num_splits=num_splits, block_n=16)
        outs.append(out)
    assert torch.equal(outs[0][1], torch.zeros_like(outs[0][1]))
    assert torch.equal(outs[1][1], outs[0][1])
    assert_close(outs[1][:1], case.reference()[:1], torch.float32)


@pytest.mark.parametrize("head_dim", [80, 8])
def test_a_head_dim_below_its_tile_reads_no_column_of_the_neighbouring_slot(head_dim: int) -> None:
    """With ``head_dim`` not a power of two >= 16 (80: OpenLLaMA-3B's 100 is the same case), the K/V tile is
    ``BLOCK_D`` wide and its load must mask the columns past ``head_dim``.

    Unmasked, the last KV head's row runs on into the *next* cache slot -- the tail of a partly filled
    block, or another request's block -- and a NaN or inf there turns the output NaN (``0 * NaN`` in the
    ``q @ k^T`` of q's zero padding columns), even though that slot belongs to nobody in this batch.  The
    case poisons every slot no sequence owns with NaN.  Mutant: ``mask=token_ok[:, None]`` (``dim_ok``
    dropped) in ``load_paged_tile``.  Oracle: the fp32 torch reference.
    """
    seqs = [(5, 1), (20, 1), (3, 6), (0, 9)]  # two decodes, a chunk after cached tokens, a fresh prompt
    case = make_case(seqs, num_decodes=2, kv_heads=2, group=2, head_dim=head_dim, seed=12)
    out = TritonAttentionBackend().attend(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, case.reference(), torch.float32)


def test_the_split_count_gives_every_compute_unit_its_waves_of_programs() -> None:
    """Below the caps, ``choose_num_splits`` takes the *smallest* split count whose ``batch * kv_heads * S``
    programs reach ``_WAVES_PER_UNIT`` per SM (its docstring's promise), i.e. it rounds up.

    Oracle: a brute-force search for that smallest count.  Mutant: ``wanted`` by floor division (one split
    short, a partly idle GPU) -- the existing cases divide evenly or are capped, so they cannot tell.
    """
    from minivllm.model.kernels.decode import _MAX_SPLITS, _WAVES_PER_UNIT

    for units in (1, 7, 132):
        for programs in (1, 3, 25 * 4, 97, 600):
            want = next(s for s in range(1, 10_000) if programs * s >= _WAVES_PER_UNIT * units)
            want = min(want, _MAX_SPLITS)
            assert choose_num_splits(batch=programs, kv_heads=1, max_seq_len=1 << 24, num_units=units) == want
