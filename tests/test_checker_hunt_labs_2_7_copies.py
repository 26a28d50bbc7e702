"""Labs 2 and 7: two answers that return the right numbers and still hand the caller something wrong.

Before this file both passed the visible checker and the grader's hidden cases (each hands the answer a copy, or
a float32 pool only):

* lab 2 ``paged_slots`` that rounds the caller's lengths up in place (``seq_lens[i] = ...``) and sums them: the
  total is right, but the lab passes one list of lengths to every block size in turn (and draws its histogram
  from it), so every later call reads reservations instead of lengths;
* lab 7 ``gather_kv`` that copies the rows into ``torch.empty`` / ``torch.zeros`` with their defaults: the values
  are right, but in float32 on the CPU whatever the cache is.  ``torch.equal`` compares values across dtypes, so
  every case read the float32 copy of a float32 pool as the right answer.

Oracles: hand counts of blocks for the lengths, and the cache's own rows picked out by hand for the gather.
"""

from __future__ import annotations

import torch
from checker_verdicts import accepts, refuses

from minivllm.labs import check_lab02, check_lab07, workloads

# -- lab 2: paged_slots must only read its lengths -----------------------------------------------------------


def _rounds_in_place(seq_lens, block_size):
    for i, n in enumerate(seq_lens):
        seq_lens[i] = -(-n // block_size) * block_size
    return sum(seq_lens)


def test_paged_slots_that_rounds_the_callers_lengths_fails_the_checker():
    lens = [40, 1, 17, 16]
    # by hand, blocks of 16: 3 + 1 + 2 + 1 = 7 blocks = 112 slots; blocks of 4: 10 + 1 + 5 + 4 = 20 blocks = 80
    assert _rounds_in_place(lens, 16) == 112  # the first call is right ...
    assert lens == [48, 16, 32, 16]  # ... and leaves reservations behind in the caller's list
    assert _rounds_in_place(lens, 4) == 112 != 80  # so the lab's next block size reads them
    refuses(check_lab02.check_paged_slots, _rounds_in_place, "the lengths are only read", "seq_lens")
    accepts(check_lab02.check_paged_slots, workloads.reserved_slots_paged)


def test_paged_slots_that_sorts_the_callers_lengths_fails_the_checker():
    def sorts_first(seq_lens, block_size):
        seq_lens.sort()
        return sum(-(-n // block_size) * block_size for n in seq_lens)

    refuses(check_lab02.check_paged_slots, sorts_first, "the lengths are only read", "no sort")


# -- lab 7: gather_kv keeps the cache's dtype -------------------------------------------------------------


def _into_float32(cache, block_table, kv_len):
    block_size = cache.shape[1]
    out = torch.empty(kv_len, cache.shape[2], cache.shape[3])  # torch.empty's defaults: float32, CPU
    for p in range(kv_len):
        out[p] = cache[int(block_table[p // block_size]), p % block_size]
    return out


def test_a_gather_into_float32_fails_the_checker():
    # a 2-block pool of 2-token blocks, 1 head of 1 dim, in float16; the table reads block 1, then block 0
    cache = torch.tensor([[[[1.0]], [[2.0]]], [[[3.0]], [[4.0]]]], dtype=torch.float16)
    got = _into_float32(cache, torch.tensor([1, 0], dtype=torch.int32), 3)
    want = torch.tensor([[[3.0]], [[4.0]], [[1.0]]], dtype=torch.float16)  # positions 0, 1 of block 1, 0 of block 0
    assert torch.equal(got, want)  # equal as values: what every case compared before
    assert got.dtype == torch.float32 != want.dtype
    refuses(check_lab07.check_gather_kv, _into_float32, "a float16 pool: the rows keep the cache's dtype",
            "dtype=cache.dtype")
    accepts(check_lab07.check_gather_kv, check_lab07.engine_gather_kv)
