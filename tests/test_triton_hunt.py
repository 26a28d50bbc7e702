"""Inputs the Triton attention kernels cannot serve must be refused, not answered wrongly (a kernel hunt).

A hunt over block sizes 1-64 (and 3, 12), head_dim 8-256 (80, 96 included), GQA groups 1-8, lengths
around page boundaries and up to 2,000, shuffled and shared block tables with 0 / -1 padding, fp32 /
fp16 / bf16, scales 0 to 3 (and negative), split counts 1-16, views of a fused projection and engine
runs with prefix caching and chunked prefill found the kernels right everywhere.  What it did find is
at the boundary of ``paged_decode`` / ``paged_prefill``: they take ``head_dim`` from ``q`` and read only
that much of each cached row, so a cache with another head size gave a finite, wrong answer where the
torch reference raises; a launch for more sequences than ``seq_lens`` / ``block_tables`` hold read past
them (a segmentation fault, the first try of these tests found); ``num_splits=0`` returned the output buffer unwritten; and a tile of 8 passed in
the interpreter though it cannot compile on a GPU (``tl.dot`` needs dimensions >= 16).

Shapes are tiny: every launch that does run, runs in Triton's CPU interpreter.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede any triton / minivllm.model.kernels import

import pytest
import torch

pytest.importorskip("triton")

from paged_cases import assert_close, make_case, nan_like  # noqa: E402  (tests/ is on sys.path)

from minivllm.model.kernels import paged_decode, paged_prefill  # noqa: E402


def _case():
    return make_case([(5, 1), (17, 1), (3, 6)], num_decodes=2, kv_heads=1, group=2, head_dim=32, page=8, seed=9)


def _decode(case, q=None, **kwargs):
    q = case.q if q is None else q
    q = q[:2]  # the two decode rows
    return paged_decode(q, case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens, case.scale,
                        max_seq_len=18, out=nan_like(q), **kwargs)


def _prefill(case, q=None, **kwargs):
    meta = case.meta
    q = case.q if q is None else q
    return paged_prefill(q, case.k_cache, case.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                         case.scale, first_seq=2, num_seqs=1, max_query_len=6, out=nan_like(q), **kwargs)


@pytest.mark.parametrize("run", [_decode, _prefill], ids=["decode", "prefill"])
def test_a_query_whose_head_dim_differs_from_the_cache_is_refused(run) -> None:
    """A 16-wide query against a 32-wide cache attended over the first 16 dims and returned finite numbers."""
    case = _case()
    with pytest.raises(ValueError, match="head_dim"):
        run(case, q=case.q[..., :16].contiguous())


@pytest.mark.parametrize("run", [_decode, _prefill], ids=["decode", "prefill"])
def test_a_v_cache_unlike_the_k_cache_is_refused(run) -> None:
    """The V strides are passed separately, so a V cache of another head size was read as if it matched:
    the first 32 of each 64-wide V row here (a narrower V cache reads past its end)."""
    case = _case()
    case.v_cache = torch.cat([case.v_cache, case.v_cache], dim=-1)
    with pytest.raises(ValueError, match="v_cache"):
        run(case)


def test_a_decode_for_more_rows_than_the_metadata_describes_is_refused() -> None:
    """Two query rows against one length and one table row: program 1 read a length and page ids past them.

    Here the metadata are views of longer tensors, so the old code read the next row's data and returned
    a plausible answer; past the end of an allocation the same launch gathered from garbage page ids (a
    segmentation fault in the interpreter, the first try of this test).
    """
    case = _case()
    meta = case.meta
    with pytest.raises(ValueError, match="sequences"):
        paged_decode(case.q[:2], case.k_cache, case.v_cache, meta.block_tables[:1], meta.seq_lens[:1], case.scale,
                     max_seq_len=18, out=nan_like(case.q[:2]))


@pytest.mark.parametrize("cut", ["query_start_loc", "seq_lens", "block_tables"])
def test_a_prefill_for_sequences_past_the_metadata_is_refused(cut: str) -> None:
    """Sequence 2 needs ``query_start_loc[2:4]``, ``seq_lens[2]`` and table row 2; a view one short was read past
    its end (the old code answered from the memory behind it)."""
    case = _case()
    meta = {"query_start_loc": case.meta.query_start_loc, "seq_lens": case.meta.seq_lens,
            "block_tables": case.meta.block_tables}
    meta[cut] = meta[cut][: meta[cut].shape[0] - 1]
    with pytest.raises(ValueError, match="query_start_loc|sequences"):
        paged_prefill(case.q, case.k_cache, case.v_cache, meta["block_tables"], meta["query_start_loc"],
                      meta["seq_lens"], case.scale, first_seq=2, num_seqs=1, max_query_len=6, out=nan_like(case.q))


def test_a_decode_with_no_splits_is_refused_not_left_unwritten() -> None:
    """``num_splits=0`` launched an empty grid: the caller got its output buffer back untouched (NaN here)."""
    with pytest.raises(ValueError, match="num_splits"):
        _decode(_case(), num_splits=0)


@pytest.mark.parametrize("run,tile", [(_decode, {"block_n": 8}), (_decode, {"block_n": 24}),
                                      (_prefill, {"block_m": 8}), (_prefill, {"block_n": 8})],
                         ids=["decode-n8", "decode-n24", "prefill-m8", "prefill-n8"])
def test_a_tile_a_gpu_cannot_compile_is_refused_on_the_cpu_too(run, tile: dict) -> None:
    """Tiles feed ``tl.dot``, which needs powers of two >= 16 on a GPU; the interpreter ran 8 happily."""
    with pytest.raises(ValueError, match="power of two >= 16"):
        run(_case(), **tile)


def test_the_checks_let_legal_calls_through() -> None:
    """The same case with matching shapes and legal tiles still matches the reference."""
    case = _case()
    want = case.reference()
    assert_close(_decode(case, num_splits=2, block_n=16), want[:2], torch.float32)
    assert_close(_prefill(case, block_m=16, block_n=32)[2:], want[2:], torch.float32)
