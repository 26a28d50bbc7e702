"""Lab 2's ``paged_slots`` against an answer that reserves once per distinct sequence length.

Every visible case had distinct lengths, so ``sum({n: ceil(n / bs) * bs for n in seq_lens}.values())`` (a learner
"computing each length once") passed the notebook's checker and lost its points only in the grader's hidden cases.
Oracle: :func:`minivllm.labs.workloads.reserved_slots_paged`, the reservation the lab's figures draw."""

from __future__ import annotations

from minivllm.labs import check_lab02, workloads
from tests.checker_verdicts import accepts, refuses


def _per_distinct_length(seq_lens, block_size):
    return sum({n: -(-n // block_size) * block_size for n in seq_lens}.values())


def test_a_reservation_per_distinct_length_fails_the_checker():
    assert workloads.reserved_slots_paged([16, 16, 5, 5], 16) == 64
    assert _per_distinct_length([16, 16, 5, 5], 16) == 32  # two sequences' blocks never counted
    refuses(check_lab02.check_paged_slots, _per_distinct_length, "sequences of the same length each count",
            "distinct lengths")
    assert not check_lab02.hidden_paged_slots(_per_distinct_length, 7)
    accepts(check_lab02.check_paged_slots, workloads.reserved_slots_paged)
