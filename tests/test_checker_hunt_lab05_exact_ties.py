"""Lab 5's ``swap_or_recompute`` hidden cases against a right answer that groups the same arithmetic another way.

The grader's exact ties (both costs 1 s) were built as ``link = 2 * blocks * bytes_per_block, rate = tokens``:
a tie for the reference's ``2 * num_blocks * bytes_per_block / link``, but for "seconds per block"
``num_blocks * (bytes_per_block / link) * 2`` often one ulp under 1.0 -- so a learner whose formula is the same
rule lost the exercise's points for the tie rule they had right.  Oracle: exact rational arithmetic."""

from __future__ import annotations

from fractions import Fraction

from minivllm.labs import check_lab05
from tests.checker_verdicts import accepts


def _per_block_seconds(num_tokens, num_blocks, *, bytes_per_block, link_bytes_per_s, prefill_tokens_per_s):
    """The exercise's rule (swap only when strictly cheaper, the KV crossing twice), priced per block."""
    swap_s = num_blocks * (bytes_per_block / link_bytes_per_s) * 2
    return "swap" if swap_s < num_tokens / prefill_tokens_per_s else "recompute"


def _exact(num_tokens, num_blocks, *, bytes_per_block, link_bytes_per_s, prefill_tokens_per_s):
    swap = Fraction(2 * num_blocks * bytes_per_block) / Fraction(link_bytes_per_s)
    return "swap" if swap < Fraction(num_tokens) / Fraction(prefill_tokens_per_s) else "recompute"


def test_the_per_block_formula_is_the_rule_on_a_tie():
    kw = dict(bytes_per_block=262144, link_bytes_per_s=2 * 392 * 262144, prefill_tokens_per_s=3131)
    assert _exact(3131, 392, **kw) == "recompute"  # 1 s either way: a tie recomputes
    assert check_lab05.reference_swap_or_recompute(3131, 392, **kw) == "recompute"
    assert 392 * (262144 / (2 * 392 * 262144)) * 2 < 1.0  # the per-block grouping rounds a hair under
    accepts(check_lab05.check_swap_or_recompute, _per_block_seconds)


def test_the_hidden_ties_do_not_depend_on_how_the_arithmetic_is_grouped():
    for seed in (0, 1, 2, 3, 7, 12345):
        assert check_lab05.hidden_swap_or_recompute(_per_block_seconds, seed), seed
        assert check_lab05.hidden_swap_or_recompute(_exact, seed), seed


def test_the_hidden_cases_still_hold_exact_ties():
    def tie_swaps(num_tokens, num_blocks, *, bytes_per_block, link_bytes_per_s, prefill_tokens_per_s):
        swap_s = 2 * num_blocks * bytes_per_block / link_bytes_per_s
        return "swap" if swap_s <= num_tokens / prefill_tokens_per_s else "recompute"

    assert not any(check_lab05.hidden_swap_or_recompute(tie_swaps, seed) for seed in (0, 1, 2, 7, 12345))
