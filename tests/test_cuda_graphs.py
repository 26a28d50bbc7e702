"""The CUDA-graph decode path's bookkeeping, on any machine (capture=False runs the same path eagerly).

What is checked here: which sizes are captured, which size a batch runs in, and
that staging copies the step's inputs into the static buffers and pads the
extra rows with copies of row 0 (never another request's slot or table).  The
end-to-end check, greedy outputs equal to HF with padded decode batches, is in
``tests/test_hf_parity.py``; replay on a real GPU is listed in the README as
needing one.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.model.attention import AttentionMetadata
from minivllm.model.cuda_graphs import DecodeGraphRunner, bucket_for, capture_sizes


@pytest.mark.parametrize("max_batch, expected", [
    (1, (1,)), (3, (1, 2, 3)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)), (32, (1, 2, 4, 8, 16, 24, 32)),
])
def test_capture_sizes(max_batch, expected):
    assert capture_sizes(max_batch) == expected


def test_bucket_is_the_smallest_size_that_fits():
    sizes = capture_sizes(32)
    for batch in range(1, 33):
        size = bucket_for(batch, sizes)
        assert size >= batch and not any(batch <= s < size for s in sizes)  # brute force: nothing smaller fits
    assert bucket_for(33, sizes) is None
    with pytest.raises(ValueError):
        capture_sizes(0)


def _meta(batch, width):
    tables = torch.arange(batch * width, dtype=torch.int32).view(batch, width) + 100
    return AttentionMetadata(
        slot_mapping=torch.arange(batch, dtype=torch.int64) * 7 + 3, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.arange(batch, dtype=torch.int32) + 5, block_tables=tables, num_decodes=batch,
        query_lens=[1] * batch, context_lens=list(range(4, 4 + batch)))


def test_staging_pads_with_row_zero_and_returns_only_real_rows():
    seen = {}

    def forward(ids, pos, meta):  # records what the "model" saw, returns one row per input row
        seen.update(ids=ids.clone(), pos=pos.clone(), slots=meta.slot_mapping.clone(), lens=meta.seq_lens.clone(),
                    tables=meta.block_tables.clone(), context=list(meta.context_lens))
        return ids.float()[:, None].repeat(1, 4)

    runner = DecodeGraphRunner(forward, max_batch=8, max_blocks=6, max_seq_len=96, device="cpu", capture=False)
    meta = _meta(5, 3)
    ids, pos = torch.tensor([11, 12, 13, 14, 15]), torch.tensor([4, 5, 6, 7, 8])
    assert runner.can_run(meta)
    out = runner.run(ids, pos, meta)
    assert out.shape == (5, 4) and out[:, 0].tolist() == [11, 12, 13, 14, 15]
    assert seen["ids"].tolist() == [11, 12, 13, 14, 15, 11, 11, 11]  # padded to 8 with row 0
    assert seen["pos"].tolist() == [4, 5, 6, 7, 8, 4, 4, 4]
    assert seen["slots"].tolist() == [3, 10, 17, 24, 31, 3, 3, 3]  # padding writes only row 0's own slot
    assert seen["lens"].tolist() == [5, 6, 7, 8, 9, 5, 5, 5]
    assert seen["tables"].shape == (8, 6)
    assert seen["tables"][:5, :3].tolist() == meta.block_tables.tolist()
    assert (seen["tables"][:5, 3:] == 0).all() and (seen["tables"][5:] == seen["tables"][0]).all()
    assert seen["context"] == [4, 5, 6, 7, 8, 4, 4, 4]


def test_a_narrower_step_after_a_wider_one_sees_no_stale_table_entries():
    """The static buffers live across steps: a step whose tables are 2 wide, after one 5 wide, must find zeros
    past its width, not the block ids the earlier step left there (another request's blocks).  A fresh runner
    starts zeroed, so only a second step can see whether staging clears what it does not overwrite.  Oracle:
    the tables the test passes, padded with zeros by hand."""
    seen = {}

    def forward(ids, pos, meta):
        seen["tables"] = meta.block_tables.clone()
        return ids.float()[:, None]

    runner = DecodeGraphRunner(forward, max_batch=8, max_blocks=6, max_seq_len=96, device="cpu", capture=False)
    wide = _meta(4, 5)
    runner.run(torch.arange(4), torch.arange(4) + 4, wide)
    narrow = _meta(4, 2)
    narrow.block_tables = narrow.block_tables + 1000  # ids no earlier step used
    runner.run(torch.arange(4), torch.arange(4) + 4, narrow)
    expected = [row + [0] * 4 for row in narrow.block_tables.tolist()]
    assert seen["tables"].tolist() == expected


def test_only_decode_batches_that_fit_use_the_graphs():
    runner = DecodeGraphRunner(lambda *a: None, max_batch=4, max_blocks=2, max_seq_len=32, device="cpu", capture=False)
    assert not runner.can_run(_meta(5, 2))  # more rows than the largest graph
    assert not runner.can_run(_meta(2, 3))  # a table wider than the static buffer
    mixed = _meta(3, 2)
    mixed.num_decodes = 2  # one prefill row: eager
    assert not runner.can_run(mixed)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraphRunner(lambda *a: None, max_batch=4, max_blocks=2, max_seq_len=32, device="cpu", capture=True)


def test_a_full_batch_and_a_full_width_table_still_fit():
    """The fit rule at its edges: ``max_batch`` decodes (the engine's ``max_num_seqs``, a busy server's usual step)
    and a request whose block table is ``max_blocks`` wide (one at ``max_model_len``) run in the graphs.  A strict
    ``<`` on either bound sends exactly the steps the graphs were captured for back to eager launches.  Oracle:
    the captured sizes (1, 2, 4 here) and the static table width, read by hand."""
    runner = DecodeGraphRunner(lambda *a: None, max_batch=4, max_blocks=3, max_seq_len=32, device="cpu", capture=False)
    assert runner.sizes[-1] == 4
    assert runner.can_run(_meta(4, 2))  # as many rows as the largest graph
    assert runner.can_run(_meta(2, 3))  # a table exactly as wide as the static buffer
    assert runner.can_run(_meta(4, 3))


def test_the_model_sees_a_well_formed_decode_batch_of_the_padded_size_step_after_step():
    """What the forward pass receives is a decode batch of ``size`` rows in the shape :class:`AttentionMetadata`
    documents: ``query_start_loc`` the ``size + 1`` cumulative query lengths ``0, 1, ..., size``, every row a
    decode, one query token each.  And every pad row is row 0 again, also when exactly one row is padded after a
    step that filled the buffers (4 rows, then 3 in the 4-row graph): a pad row left as the previous step's row
    would write that request's K/V slot and read its table.  Oracle: the metadata written out by hand from the
    contract, and the rows the test passes."""
    seen = []

    def forward(ids, pos, meta):
        seen.append(dict(ids=ids.tolist(), slots=meta.slot_mapping.tolist(), lens=meta.seq_lens.tolist(),
                         tables=meta.block_tables.tolist(), qsl=meta.query_start_loc.tolist(),
                         num_decodes=meta.num_decodes, query_lens=list(meta.query_lens), num_seqs=meta.num_seqs))
        return ids.float()[:, None]

    runner = DecodeGraphRunner(forward, max_batch=4, max_blocks=2, max_seq_len=32, device="cpu", capture=False)
    full = _meta(4, 2)
    runner.run(torch.tensor([21, 22, 23, 24]), torch.tensor([4, 5, 6, 7]), full)
    three = _meta(3, 2)
    three.slot_mapping = three.slot_mapping + 500  # slots and tables no earlier row used
    three.block_tables = three.block_tables + 500
    out = runner.run(torch.tensor([31, 32, 33]), torch.tensor([8, 9, 10]), three)
    assert out[:, 0].tolist() == [31, 32, 33]
    for step, size in zip(seen, (4, 4)):
        assert step["qsl"] == list(range(size + 1))
        assert step["num_decodes"] == step["num_seqs"] == size and step["query_lens"] == [1] * size
    last = seen[1]
    tables = three.block_tables.tolist()
    assert last["ids"] == [31, 32, 33, 31]
    assert last["slots"] == [503, 510, 517, 503]  # row 0's slot, not the 4-row step's row 3 (24)
    assert last["lens"] == [5, 6, 7, 5]
    assert last["tables"] == tables + [tables[0]]
