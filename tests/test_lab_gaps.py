"""Two gaps in the lab checkers that a closing note named open, and one more found looking for others.

* Lab 8 ``first_alarm``: an answer that reads ``samples[0]`` before its loop agrees with the rule on every list
  that holds a scrape and raises on the empty one.  The visible checker never passed it an empty list, and the
  hidden cases drew one only when a random length came out 0 (about four seeds in five), so the grader let it
  through one time in five.  The same held, less often, for a value equal to the threshold, a NaN and a dip: each
  was in the hidden cases only when a draw put it there.
* Lab 7 ``gather_kv``: the hint of case 3 ("round the number of blocks UP, not up-plus-one") was printed only when
  an answer raised there.  An up-plus-one count whose extra block reaches the output came back as "N rows for
  16 tokens" and got the hint to cut the rows, which the answer already does.  An up-plus-one count cut to
  ``kv_len`` rows is a right answer and must still pass.
* Lab 6 ``tenant_cap``: the grader's hidden cases draw running sets in which a tenant holds more seats than its
  cap; no visible case did, so an answer that counts the seats left and admits while that count is truthy (-1 is)
  passed the notebook's checker and lost its point at grading, at about one seed in seven.

Oracles: hand counts of rows and blocks, and a brute-force alarm written here (every prefix of the series, its
last unbroken run above the threshold measured from its first scrape), and the cap rule by hand.
"""

from __future__ import annotations

import io
import math
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

from minivllm.labs import check_lab07, check_lab08
from minivllm.labs.registry import apply_mutant, exercise

SEEDS = range(200)


def _verdict(check, answer, *args):
    with redirect_stdout(io.StringIO()) as buf:
        result = check(answer, *args)
    return result, buf.getvalue()


def _hint(text: str) -> str:
    return next((line for line in text.splitlines() if line.lstrip().startswith("hint:")), "")


# -- lab 8: first_alarm --------------------------------------------------------------------------------------------


def _brute_alarm(samples, signal, threshold, for_s):
    """For each prefix, walk back over the scrapes above the threshold that end it; fire once they span for_s."""
    for end in range(len(samples)):
        start = end
        while start >= 0 and getattr(samples[start], signal) > threshold:  # NaN > x is False: no data breaks it
            start -= 1
        if start < end and samples[end].time - samples[start + 1].time >= for_s:
            return samples[end].time
    return None


def _first_sample_first(samples, signal, threshold, for_s):
    """Right on every list with a scrape: the streak is opened from samples[0] before the loop, as the loop would."""
    since = samples[0].time if getattr(samples[0], signal) > threshold else None
    for s in samples:
        if getattr(s, signal) > threshold:
            since = s.time if since is None else since
            if s.time - since >= for_s:
                return s.time
        else:
            since = None
    return None


def _wrong_at(compare, *, dip_resets: bool = True):
    """The one-pass alarm with another comparison, or with a dip that does not reset the streak."""
    def first_alarm(samples, signal, threshold, for_s):
        since = None
        for s in samples:
            if compare(getattr(s, signal), threshold):
                since = s.time if since is None else since
                if s.time - since >= for_s:
                    return s.time
            elif dip_resets:
                since = None
        return None
    return first_alarm


def test_an_answer_that_reads_samples_0_first_is_refused_by_the_checker_the_learner_sees():
    assert _first_sample_first(check_lab08._series([0, 5, 5, 5]), "waiting", 4, 1) == 3.0  # right with a scrape
    with pytest.raises(IndexError):
        _first_sample_first([], "waiting", 4, 0)
    result, text = _verdict(check_lab08.check_first_alarm, _first_sample_first)
    assert not result and result.failed_case == "no samples yet: no alarm", text
    assert "raised IndexError" in text and "samples[0]" in _hint(text)
    assert _verdict(check_lab08.check_first_alarm, _brute_alarm)[0]


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
    assert all(_verdict(check_lab08.hidden_first_alarm, _brute_alarm, seed)[0] for seed in SEEDS)


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
        assert alarm(series, "waiting", 4, for_s) == _brute_alarm(series, "waiting", 4, for_s), values


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
