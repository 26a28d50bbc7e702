"""Two gaps in the lab checkers that a closing note named open, and one more found looking for others.

* Lab 8 ``first_alarm``: an answer that reads ``samples[0]`` before its loop agrees with the rule on every list
  that holds a scrape and raises on the empty one.  The visible checker never passed it an empty list, and the
  hidden cases drew one only when a random length came out 0 (about four seeds in five), so the grader let it
  through one time in five.  The same held, less often, for a value equal to the threshold, a NaN and a dip: each
  was in the hidden cases only when a draw put it there.
* Lab 7 ``gather_kv``: the hint of case 3 ("round the number of blocks UP, not up-plus-one") was printed only when
  an answer raised there.  An up-plus-one count whose extra block reaches the output came back as "N rows for
  16 tokens" and got the hint to cut the rows, which the answer already does.  An up-plus-one count cut to
  ``kv_len`` rows is a right answer and must still pass.  And an up-plus-one count that writes its extra block
  into a ``kv_len``-row output raises; a raise printed only the case's fixed hint (at 15 tokens: "cut the
  gathered blocks to kv_len tokens"), so the checker now re-runs such an answer with the table cut to the
  blocks the tokens need, and names the count when the raise goes away there.  An answer that reads the table
  as a list (``block_table.tolist()[k]``) raised a bare "list index out of range" there, matched to no table:
  the checker now reads it as the table's when it is raised in the answer's own code and one entry more than
  the tokens need makes the answer raise as with the whole row (stop 73).  Asking for that entry is blamed on the
  count only when the answer takes a block from it: a right count that reads the table one entry ahead asks for it
  too, and is told of the read ahead and the blocks it needs, not to round up (stop 74).
* Lab 6 ``tenant_cap``: the grader's hidden cases draw running sets in which a tenant holds more seats than its
  cap; no visible case did, so an answer that counts the seats left and admits while that count is truthy (-1 is)
  passed the notebook's checker and lost its point at grading, at about one seed in seven.

Oracles: hand counts of rows and blocks; alarms worked out by hand, and a brute-force alarm over every pair of
scrapes (the rule as its definition states it, unlike the reference's walk back from each scrape), held to those
hand answers and, by hypothesis, to the reference on any series; and the cap rule by hand.
"""

from __future__ import annotations

import functools
import io
import itertools
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minivllm.labs import check_lab07, check_lab08
from minivllm.labs.registry import apply_mutant, exercise

from tests.fuzz import examples
from tests.lab08_alarms import one_pass_alarm

SEEDS = range(200)


def _verdict(check, answer, *args):
    with redirect_stdout(io.StringIO()) as buf:
        result = check(answer, *args)
    return result, buf.getvalue()


def _hint(text: str) -> str:
    return next((line for line in text.splitlines() if line.lstrip().startswith("hint:")), "")


# -- lab 8: first_alarm --------------------------------------------------------------------------------------------


def _alarm_by_pairs(samples, signal, threshold, for_s):
    """The rule read as its definition, over every pair of scrapes i <= j: the earliest t_j such that every
    scrape from i to j is above the threshold (NaN > x is False: no data is not above) and t_j - t_i >= for_s.
    Unlike the checker's reference, which walks back from each scrape over the run that ends there, this looks
    at all pairs and takes the least time."""
    above = [getattr(s, signal) > threshold for s in samples]
    return min((samples[j].time for j in range(len(samples)) for i in range(j + 1)
                if all(above[i:j + 1]) and samples[j].time - samples[i].time >= for_s), default=None)


nan = float("nan")
# (values, scrape times, threshold, for_s, the alarm worked out by hand) -- each row says why
HAND_ALARMS = [
    ([], [], 5, 0, None),  # no scrape yet: nothing to fire on
    ([1, 8, 8], [1, 2, 3], 5, 0, 2.0),  # for_s 0: the first scrape above fires, at t=2
    ([7, 7], [3, 4], 5, 1, 4.0),  # held from the streak's first scrape (t=3), not from t=0: 1 s at t=4
    ([6, 6, 6], [0.5, 1.25, 2.0], 5, 1.5, 2.0),  # held exactly for_s at t=2 (2.0 - 0.5 = 1.5): >= fires
    ([5, 6, 6], [0, 1, 2], 5, 1, 2.0),  # 5 is not above 5: the streak starts at t=1, 1 s old at t=2
    ([3, 7, 7, 2, 7, 7, 7], [1, 2, 3, 4, 5, 6, 7], 5, 2, 7.0),  # 1 s by t=3, the dip at t=4 resets: 2 s at t=7
    ([9, 9, nan, 9, 9], [0, 1, 2, 3, 4], 5, 1.5, None),  # no data at t=2 splits 4 s above into two 1 s streaks
    ([9, 9, nan, 9], [0, 1, 2, 3], 5, 2, None),  # the scrape that would have held 2 s has no data
    ([8, 8, 8], [0, 0.5, 1.0], 5, 1.25, None),  # above at every scrape, but the series spans 1 s < 1.25 s
    ([8, 8, 8, 8], [0, 0.25, 2.0, 2.25], 5, 1.5, 2.0),  # uneven gaps: 0.25 s at the 2nd scrape, 2 s at the 3rd
    ([0, 9], [0, 2.5], 5, 0, 2.5),  # one scrape above, for_s 0: fires at that scrape's own time
]


def test_the_alarm_reference_and_the_pairs_oracle_agree_with_alarms_worked_out_by_hand():
    """The grader's hidden cases take their expected answers from the reference: it is checked here against
    answers worked out by hand, and so is the pairs oracle the other tests use as a right answer."""
    for values, times, threshold, for_s, want in HAND_ALARMS:
        series = check_lab08._series(values, times=times)
        assert check_lab08.reference_first_alarm(series, "waiting", threshold, for_s) == want, (values, times)
        assert _alarm_by_pairs(series, "waiting", threshold, for_s) == want, (values, times)


@settings(max_examples=examples(300), deadline=None)
@given(points=st.lists(st.tuples(st.sampled_from([0, 4, 5, 6, 9, nan]), st.sampled_from([0.25, 0.5, 1.0, 1.5])),
                       max_size=10),
       threshold=st.sampled_from([4, 5]), for_s=st.sampled_from([0, 0.5, 1, 1.25, 2, 3]))
def test_the_alarm_reference_is_the_rule_on_any_series(points, threshold, for_s):
    """Scrapes at uneven gaps, values equal to the threshold, NaN: the reference agrees with the pairs oracle."""
    series = check_lab08._series([v for v, _ in points], times=list(itertools.accumulate(g for _, g in points)))
    assert (check_lab08.reference_first_alarm(series, "waiting", threshold, for_s)
            == _alarm_by_pairs(series, "waiting", threshold, for_s))


def _first_sample_first(samples, signal, threshold, for_s):
    """Right on every list with a scrape: the streak is opened from samples[0] before the loop, as the loop would."""
    first = samples[0]
    return one_pass_alarm(samples, signal, threshold, for_s,
                          since=first.time if getattr(first, signal) > threshold else None)


def _wrong_at(compare, *, dip_resets: bool = True):
    """The one-pass alarm with another comparison, or with a dip that does not reset the streak."""
    return functools.partial(one_pass_alarm, above=compare, dip_resets=dip_resets)


def test_an_answer_that_reads_samples_0_first_is_refused_by_the_checker_the_learner_sees():
    assert _first_sample_first(check_lab08._series([0, 5, 5, 5]), "waiting", 4, 1) == 3.0  # right with a scrape
    with pytest.raises(IndexError):
        _first_sample_first([], "waiting", 4, 0)
    result, text = _verdict(check_lab08.check_first_alarm, _first_sample_first)
    assert not result and result.failed_case == "no samples yet: no alarm", text
    assert "raised IndexError" in text and "samples[0]" in _hint(text)
    assert _verdict(check_lab08.check_first_alarm, _alarm_by_pairs)[0]


@pytest.mark.parametrize("wrong, what", [
    (_first_sample_first, "an empty list raises"),
    (_wrong_at(lambda v, th: v >= th), "fires on a value equal to the threshold"),
    (_wrong_at(lambda v, th: not v <= th), "reads NaN (no data) as above"),
    (_wrong_at(lambda v, th: v > th, dip_resets=False), "a dip does not reset the streak"),
], ids=["empty", "equal", "nan", "dip"])
def test_the_hidden_cases_catch_each_edge_bug_at_every_seed(wrong, what):
    """Each of these failed the hidden cases only at the seeds whose draws held its edge (empty: about 78 in 100)."""
    passed = [seed for seed in SEEDS if _verdict(check_lab08.hidden_first_alarm, wrong, seed)[0]]
    assert not passed, f"{what}: the hidden cases pass it at seeds {passed}"


def test_the_hidden_cases_still_pass_a_right_answer():
    assert all(_verdict(check_lab08.hidden_first_alarm, _alarm_by_pairs, seed)[0] for seed in SEEDS)


def test_the_empty_list_crash_is_a_planted_bug_of_first_alarm():
    """The planted bug is the empty-list crash alone: the solution's verdicts on lists with a scrape, IndexError
    on the empty one (so what catches it is the empty case, not another rule)."""
    import nbformat

    from minivllm.labs.grade import exercise_cells

    lab, ex = exercise("first_alarm")
    notebook = Path(__file__).resolve().parents[1] / "solutions" / f"{lab.stem}.ipynb"
    source = exercise_cells(nbformat.read(notebook, as_version=4))[ex.name]
    planted = [m for m in ex.mutants if "empty list" in m[0]]
    assert len(planted) == 1
    ns: dict = {}
    exec(apply_mutant(source, planted[0]), ns)
    alarm = ns["first_alarm"]
    with pytest.raises(IndexError):
        alarm([], "waiting", 4, 0)
    nan = float("nan")
    for values, for_s in (([5, 5, 0, 5, 5, 5], 2), ([0, 9, 0], 0), ([nan, 5, 5], 1), ([4, 4, 5], 0), ([9], 0)):
        series = check_lab08._series(values)
        assert alarm(series, "waiting", 4, for_s) == _alarm_by_pairs(series, "waiting", 4, for_s), values


# -- lab 7: gather_kv's up-plus-one hint ---------------------------------------------------------------------------


def _gather(count, cut):
    """A gather whose block count is ``count(kv_len, block_size)`` and whose rows are cut by ``cut``."""
    def gather_kv(cache, block_table, kv_len):
        block_size = cache.shape[1]
        blocks = cache[block_table[:count(kv_len, block_size)].long()]
        return cut(blocks, kv_len, block_size)
    return gather_kv


def _floor_plus_one(n, b):
    return n // b + 1


def _ceil_plus_one(n, b):
    return -(-n // b) + 1


def _cut_to_kv_len(blocks, n, b):
    return blocks.flatten(0, 1)[:n]


def _cut_last_block(blocks, n, b):
    """Every block but the last whole, the last cut to the tokens it holds (n % b, or b when n fills it)."""
    return torch.cat([blocks[:-1].flatten(0, 1), blocks[-1, :n % b or b]])


def test_floor_plus_one_with_the_last_block_cut_gets_the_up_plus_one_hint_at_16_tokens():
    """16 tokens: 16 // 16 + 1 = 2 blocks, the first whole (16 rows) and the second, a block the sequence does not
    use, cut to 16 % 16 or 16 = 16 rows: 32 rows, where one block holds the 16 tokens.  1, 15 tokens: 1 block,
    right."""
    wrong = _gather(_floor_plus_one, _cut_last_block)
    result, text = _verdict(check_lab07.check_gather_kv, wrong)
    assert not result and result.failed_case == "16 tokens: exactly one block", text
    assert "got:      ((32, 2, 8)" in text
    hint = _hint(text)
    assert "up-plus-one" in hint and "32 rows for 16 tokens" in hint, hint


def test_ceil_plus_one_with_the_last_block_cut_gets_the_up_plus_one_hint_at_one_token():
    """1 token: ceil(1 / 16) + 1 = 2 blocks: 16 rows of the first and 1 % 16 = 1 row of the next: 17 rows."""
    wrong = _gather(_ceil_plus_one, _cut_last_block)
    result, text = _verdict(check_lab07.check_gather_kv, wrong)
    assert not result and result.failed_case == "one token: slot 0 of the first block in the table", text
    assert "up-plus-one" in _hint(text) and "17 rows for 1 tokens" in _hint(text), text


def test_a_gather_of_the_whole_table_row_is_not_blamed_on_up_plus_one():
    """Every entry of the row (4 here: 1 token's block and 3 more) is 64 rows: not one block too many."""
    def whole_row(cache, block_table, kv_len):
        return cache[block_table.long()].flatten(0, 1)

    result, text = _verdict(check_lab07.check_gather_kv, whole_row)
    assert not result and "64 rows for 1 tokens" in _hint(text) and "up-plus-one" not in _hint(text), text


def test_a_short_answer_and_a_missing_cut_keep_their_hints():
    """Within the blocks the tokens need, too many rows is a missing cut, too few a floored count."""
    no_cut = _gather(lambda n, b: -(-n // b), lambda blocks, n, b: blocks.flatten(0, 1))
    result, text = _verdict(check_lab07.check_gather_kv, no_cut)  # 1 token -> 16 rows, one block's worth
    assert not result and "cut the gathered blocks" in _hint(text), text
    floored = _gather(lambda n, b: n // b, _cut_to_kv_len)
    result, text = _verdict(check_lab07.check_gather_kv, floored)  # 1 token -> 0 blocks, 0 rows
    assert not result and "flooring drops" in _hint(text), text


@pytest.mark.parametrize("count", [_floor_plus_one, _ceil_plus_one], ids=["floor+1", "ceil+1"])
def test_an_up_plus_one_count_cut_to_kv_len_still_passes(count):
    """The extra block is read and dropped: the rows are the sequence's, so the visible and hidden cases pass."""
    right = _gather(count, _cut_to_kv_len)
    cache = torch.arange(5 * 4 * 1 * 1, dtype=torch.float32).view(5, 4, 1, 1)
    assert right(cache, torch.tensor([3, 1, 4]), 8).flatten().tolist() == [12, 13, 14, 15, 4, 5, 6, 7]
    assert math.ceil(8 / 4) + 1 == 3  # ceil+1 reads the third entry (block 4) and cuts it away
    result, text = _verdict(check_lab07.check_gather_kv, right)
    assert result, text
    assert all(_verdict(check_lab07.hidden_gather_kv, right, seed)[0] for seed in range(5))


def _write_blocks(count, *, by_entry: bool, take=lambda n, b, start, last: min(b, n - start)):
    """A gather that allocates its ``kv_len`` rows and writes ``count(kv_len, block_size)`` blocks into them, block
    after block, ``take(...)`` rows of each; the table read as a slice (``by_entry=False``) or entry by entry.  The
    default ``take`` is a block's rows up to ``kv_len``: negative past the last token, which slices the block
    from its end, so an extra block's rows land on none of the output's (past its end) and the write raises."""
    def gather_kv(cache, block_table, kv_len):
        b = cache.shape[1]
        n = count(kv_len, b)
        ids = [int(block_table[k]) for k in range(n)] if by_entry else block_table[:n].tolist()
        out = torch.empty(kv_len, *cache.shape[2:], dtype=cache.dtype)
        for k, block in enumerate(ids):
            start = k * b
            rows = take(kv_len, b, start, k == len(ids) - 1)
            out[start:start + rows] = cache[block, :rows]
        return out
    return gather_kv


def _ceil(n, b):
    return -(-n // b)


def _last_block_cut(n, b, start, last):
    """Whole blocks, the last cut to the tokens it holds (n % b, or b when n fills it): ignores ``start``."""
    return (n % b or b) if last else b


def test_block_by_block_writers_differ_from_a_right_gather_only_in_their_count():
    """The writers below with ceil(kv_len / block_size) blocks pass, visible and hidden cases: what they get wrong
    there is the count alone."""
    for by_entry in (False, True):
        right = _write_blocks(_ceil, by_entry=by_entry)
        assert _verdict(check_lab07.check_gather_kv, right)[0]
        assert all(_verdict(check_lab07.hidden_gather_kv, right, seed)[0] for seed in range(3))
    assert _verdict(check_lab07.check_gather_kv, _write_blocks(_ceil, by_entry=False, take=_last_block_cut))[0]


@pytest.mark.parametrize("count, by_entry, take, case, shown", [
    # 1 token: ceil + 1 = 2 blocks; block 1 starts at row 16 of a 1-row output and takes 1 - 16 = -15 rows, the
    # block's first 1: one row broadcast onto none, no raise.  15 tokens: -1 rows, the first 15: 15 rows onto
    # none raises, and given one table entry the slice reads one block, the entry-by-entry read asks for entry 1
    (_ceil_plus_one, False, None, "15 tokens: a partial block, NaN tail left out", "raises nothing"),
    (_ceil_plus_one, True, None, "15 tokens: a partial block, NaN tail left out", "asks for entry 1, one past them"),
    # 1 and 15 tokens: floor + 1 = 1 block, right.  16 tokens: 2 blocks, the last cut to 16 % 16 or 16 = 16 rows,
    # written at row 16 of a 16-row output
    (_floor_plus_one, False, _last_block_cut, "16 tokens: exactly one block", "raises nothing"),
], ids=["ceil+1 slice", "ceil+1 by entry", "floor+1 whole last block"])
def test_an_up_plus_one_writer_that_raises_is_told_to_round_up(count, by_entry, take, case, shown):
    """An up-plus-one count whose extra block is written past the end of a kv_len-row output raises; the hint names
    the count, with what the answer did given only the entries the tokens need."""
    wrong = _write_blocks(count, by_entry=by_entry, **({"take": take} if take else {}))
    result, text = _verdict(check_lab07.check_gather_kv, wrong)
    assert not result and result.failed_case == case and "raised " in text, text
    hint = _hint(text)
    assert "not up-plus-one" in hint and "ceil(kv_len / block_size)" in hint and shown in hint, hint


@pytest.mark.parametrize("count, case", [(_ceil, "one token"), (_ceil_plus_one, "one token")],
                         ids=["ceil", "ceil+1"])
def test_a_raise_that_a_cut_table_does_not_end_keeps_the_cases_hint(count, case):
    """Every slot of every block written row by row, none cut at kv_len: 1 token, row 1 of a 1-row output raises
    IndexError ("index 1 is out of bounds for dimension 0 with size 1") in block 0 -- the message that reading a
    1-entry table at entry 1 gives too, but it raised so with the whole table, whatever the count: the hint stays
    the case's own, not up-plus-one's."""
    def every_slot(cache, block_table, kv_len):
        b = cache.shape[1]
        out = torch.empty(kv_len, *cache.shape[2:], dtype=cache.dtype)
        for p in range(count(kv_len, b) * b):
            out[p] = cache[int(block_table[p // b]), p % b]
        return out

    result, text = _verdict(check_lab07.check_gather_kv, every_slot)
    assert not result and result.failed_case.startswith(case) and "raised IndexError" in text, text
    assert "up-plus-one" not in _hint(text) and "block_table[0]" in _hint(text), text


def test_a_writer_that_fills_whole_blocks_keeps_the_cases_hint():
    """ceil(kv_len / block_size) blocks, each written whole: 1 token, 16 rows onto the 1-row output raise in block 0,
    with one table entry as with four."""
    wrong = _write_blocks(_ceil, by_entry=True, take=lambda n, b, start, last: b)
    result, text = _verdict(check_lab07.check_gather_kv, wrong)
    assert not result and result.failed_case.startswith("one token") and "raised RuntimeError" in text, text
    assert "up-plus-one" not in _hint(text), text


def _list_reader(count, *, style: str):
    """A block-by-block writer (as :func:`_write_blocks`) that reads the table as a Python list: ``inline``
    (``block_table.tolist()[k]`` in the loop), ``once`` (the list made before the loop), ``ids first`` (every id
    read by a comprehension before the first write), or ``helper`` (the read in a function outside the answer)."""
    def entry(ids, k):
        return ids[k]

    def gather_kv(cache, block_table, kv_len):
        b = cache.shape[1]
        n = count(kv_len, b)
        ids = block_table.tolist()
        first = [ids[k] for k in range(n)] if style == "ids first" else None
        out = torch.empty(kv_len, *cache.shape[2:], dtype=cache.dtype)
        for k in range(n):
            block = (block_table.tolist()[k] if style == "inline" else ids[k] if style == "once"
                     else first[k] if style == "ids first" else entry(ids, k))
            start = k * b
            rows = min(b, kv_len - start)
            out[start:start + rows] = cache[block, :rows]
        return out
    return gather_kv


@pytest.mark.parametrize("style", ["inline", "once", "ids first"])
def test_an_up_plus_one_reader_of_the_table_as_a_list_is_told_to_round_up(style):
    """15 tokens: ceil + 1 = 2 blocks; block 1 takes min(16, 15 - 16) = -1 rows at row 16 of a 15-row output and
    the write raises RuntimeError with the whole row.  Given the table's first entry only, the read of entry 1
    raises ``IndexError: list index out of range`` -- a message with no index, which the checker matched to no
    table and so printed the case's fixed hint ("cut the gathered blocks to kv_len tokens", which the answer
    does).  Given two entries, it raises as with the whole row: it asked for entry 1, one past the one it needs."""
    wrong = _list_reader(_ceil_plus_one, style=style)
    result, text = _verdict(check_lab07.check_gather_kv, wrong)
    assert not result and result.failed_case == "15 tokens: a partial block, NaN tail left out", text
    assert "raised RuntimeError" in text, text
    hint = _hint(text)
    assert "not up-plus-one" in hint and "asks for entry 1, one past them" in hint, hint


@pytest.mark.parametrize("style", ["inline", "once", "ids first", "helper"])
def test_a_right_reader_of_the_table_as_a_list_still_passes(style):
    right = _list_reader(_ceil, style=style)
    assert _verdict(check_lab07.check_gather_kv, right)[0]
    assert all(_verdict(check_lab07.hidden_gather_kv, right, seed)[0] for seed in range(3))


@pytest.mark.parametrize("count, style, why", [
    (_ceil_plus_one, "helper", "the list read is in a function outside the answer"),
    (lambda n, b: -(-n // b) + 2, "ids first", "given one entry more it still reads past the end (entry 2)"),
], ids=["helper", "ceil+2"])
def test_a_list_raise_not_shown_to_be_entry_ceil_keeps_the_cases_hint(count, style, why):
    """"list index out of range" names no list and no index: the checker blames up-plus-one only for a raise in the
    answer's own code that one more table entry takes away; otherwise the case's hint, as before."""
    result, text = _verdict(check_lab07.check_gather_kv, _list_reader(count, style=style))
    assert not result and result.failed_case.startswith("15 tokens") and "raised " in text, (why, text)
    assert "up-plus-one" not in _hint(text) and "cut the gathered blocks" in _hint(text), (why, text)


def test_an_up_plus_one_count_that_overruns_its_own_list_is_still_told_to_round_up():
    """A review of the list reading above (stop 73): an up-plus-one count whose rows per block come from a list of
    its own, sized right, raises "list index out of range" in its own code when the extra block looks its rows up.
    The first version returned at once for such a raise (as for a read past the whole row) and printed the case's
    hint; with the table cut to the blocks the tokens need the answer returns, which is the up-plus-one proof."""
    def own_rows(cache, block_table, kv_len):
        b = cache.shape[1]
        n = -(-kv_len // b) + 1
        rows = [min(b, kv_len - s) for s in range(0, kv_len, b)]
        return torch.cat([cache[blk, :rows[k]] for k, blk in enumerate(block_table[:n].tolist())])

    result, text = _verdict(check_lab07.check_gather_kv, own_rows)
    assert not result and "raised IndexError" in text, text
    hint = _hint(text)
    assert "not up-plus-one" in hint and "raises nothing" in hint, hint


def test_a_decorated_list_reader_is_read_through_its_decorator():
    """``@torch.no_grad()`` wraps the answer: the raise's frame is the learner's function, not the wrapper's."""
    wrong = torch.no_grad()(_list_reader(_ceil_plus_one, style="inline"))
    result, text = _verdict(check_lab07.check_gather_kv, wrong)
    assert not result, text
    hint = _hint(text)
    assert "not up-plus-one" in hint and "asks for entry 1, one past them" in hint, hint


def test_a_walk_by_token_over_the_table_as_a_list_is_not_blamed_on_up_plus_one():
    """``block_table.tolist()[t]`` with a token's position: 15 tokens read entry 4 of a 4-entry row, a list read
    past the whole row in the answer's own code (an up-plus-one count never makes one): the case's own hint."""
    def by_token(cache, block_table, kv_len):
        b = cache.shape[1]
        out = torch.empty(kv_len, *cache.shape[2:], dtype=cache.dtype)
        for t in range(kv_len):
            out[t] = cache[block_table.tolist()[t], t % b]
        return out

    result, text = _verdict(check_lab07.check_gather_kv, by_token)
    assert not result and result.failed_case.startswith("15 tokens") and "raised IndexError" in text, text
    assert "up-plus-one" not in _hint(text), text


# -- lab 6: a tenant already over its cap --------------------------------------------------------------------------


class _SeatsLeft:
    """Counts the seats each capped tenant has left and admits while that count is truthy: right while no tenant
    holds more seats than its cap, and a tenant over it has a negative count, which admits its whole queue."""

    def __init__(self, max_running):
        self.max_running = dict(max_running)

    def order(self, waiting, running):
        left = dict(self.max_running)
        for r in running:
            if r.tenant in left:
                left[r.tenant] -= 1
        out = []
        for r in waiting:
            if r.tenant not in left or left[r.tenant]:
                out.append(r)
                if r.tenant in left:
                    left[r.tenant] -= 1
        return out


def test_a_tenant_cap_that_admits_over_the_cap_is_refused_by_the_checker_the_learner_sees():
    """The grader's hidden cases draw running sets where a tenant holds more seats than its cap (27 of seeds 0-199)
    and refuse this answer there; the visible checker never held one, so the learner saw a pass."""
    from minivllm.labs import check_lab06

    a = [check_lab06._R(f"a{i}", "a", i) for i in range(2)]
    over = [check_lab06._R(f"x{i}", "a") for i in range(3)]  # 3 running, cap 2: a may start nothing
    assert [r.request_id for r in _SeatsLeft({"a": 2}).order(a, over)] == ["a0", "a1"]
    assert any(not _verdict(check_lab06.hidden_tenant_cap, _SeatsLeft, seed)[0] for seed in range(20))
    result, text = _verdict(check_lab06.check_tenant_cap, _SeatsLeft)
    assert not result and result.failed_case == "a tenant over its cap waits too", text
    assert "seats < cap" in _hint(text)


def test_a_walk_past_the_whole_table_row_is_not_blamed_on_up_plus_one():
    """The table indexed by a token's position, not its block (``block_table[t]``): 15 tokens read entry 4 of a
    4-entry row and raise; given the 1-entry cut table it reads entry 1 and raises the "one past them" message, as
    an up-plus-one reader would -- but its count of blocks is no count at all (the review's case).  Its first raise
    was already a read past the whole row, which an up-plus-one count (entry ceil(kv_len / B), inside the row) never
    makes: the case keeps its own hint."""
    def by_token(cache, block_table, kv_len):
        b = cache.shape[1]
        out = torch.empty(kv_len, *cache.shape[2:], dtype=cache.dtype)
        for t in range(kv_len):
            out[t] = cache[int(block_table[t]), t % b]
        return out

    result, text = _verdict(check_lab07.check_gather_kv, by_token)
    assert not result and result.failed_case.startswith("15 tokens") and "raised IndexError" in text, text
    assert "up-plus-one" not in _hint(text), text


def _reads_ahead(count, *, ahead: bool, cut: bool, as_list: bool):
    """A block-by-block writer of ``count(kv_len, block_size)`` blocks that, with ``ahead``, reads the table entry
    after the block it writes (``ids[k + 1]``, a prefetch it never uses) first; with ``cut`` the last block is cut
    to the rows up to kv_len, else written whole.  The table read as a list or as the tensor."""
    def gather_kv(cache, block_table, kv_len):
        b = cache.shape[1]
        ids = block_table.tolist() if as_list else block_table
        out = torch.empty(kv_len, *cache.shape[2:], dtype=cache.dtype)
        for k in range(count(kv_len, b)):
            if ahead:
                ids[k + 1]
            rows = min(b, kv_len - k * b) if cut else b
            out[k * b:k * b + rows] = cache[int(ids[k]), :rows]
        return out
    return gather_kv


def _blocks_taken(gather, kv_len, block_size=4):
    """The brute-force count of the blocks ``gather`` takes for ``kv_len`` tokens: a pool of one-slot-per-row
    blocks numbered by value, a table long enough for any count, and every block id the cache is indexed with
    recorded, whatever the output."""
    taken = set()

    class Pool(torch.Tensor):
        def __getitem__(self, index):
            block = index[0] if isinstance(index, tuple) else index
            taken.update(torch.as_tensor(block).flatten().tolist())
            return torch.Tensor.__getitem__(self.as_subclass(torch.Tensor), index)

    cache = torch.arange(8 * block_size, dtype=torch.float32).view(8, block_size, 1, 1).as_subclass(Pool)
    try:
        gather(cache, torch.arange(8), kv_len)
    except Exception:  # noqa: BLE001 - the blocks taken before a raise are what counts
        pass
    return len(taken)


@pytest.mark.parametrize("as_list", [True, False], ids=["list", "tensor"])
def test_a_right_count_that_reads_ahead_is_not_told_to_round_up(as_list):
    """A review (stop 74): a right count that reads ``ids[k + 1]`` before writing block k and writes its last block
    whole raises at 1 token (16 rows onto 1), and given the table's first entry only it asks for entry 1 -- as an
    up-plus-one count would, so it was told to round up, a count it has right.  It takes no block from entry 1:
    the hint now names the read ahead and the blocks the tokens fill beside the round-up (the experiment cannot tell
    it from an up-plus-one count that raises on its extra block before reading the cache: the review of cd7b295).
    The classic up-plus-one count, which takes a block from entry 1 (the oracle: the blocks it indexes the cache
    with, counted), keeps its hint."""
    ahead = _reads_ahead(_ceil, ahead=True, cut=False, as_list=as_list)
    classic = _reads_ahead(_ceil_plus_one, ahead=False, cut=True, as_list=as_list)
    assert [_blocks_taken(ahead, n) for n in (1, 4, 5, 8)] == [1, 1, 2, 2]  # ceil(n / 4): the right count
    assert [_blocks_taken(classic, n) for n in (3, 5)] == [2, 3]  # ceil(n / 4) + 1
    result, text = _verdict(check_lab07.check_gather_kv, ahead)
    assert not result and result.failed_case.startswith("one token") and "raised RuntimeError" in text, text
    hint = _hint(text)
    assert "asks for entry 1, one past them" in hint and "one entry ahead (ids[k + 1]" in hint and "cut" in hint, hint
    assert "either its count is one too high" in hint, hint
    result, text = _verdict(check_lab07.check_gather_kv, classic)
    assert not result and result.failed_case.startswith("15 tokens") and "raised RuntimeError" in text, text
    hint = _hint(text)
    assert "not up-plus-one" in hint and "asks for entry 1, one past them" in hint and "ahead" not in hint, hint
