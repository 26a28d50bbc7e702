"""Pins on the checker framework and the grader found by planting bugs in them (not in the learners' code).

``tests/test_labs.py`` proves each checker rejects wrong learner solutions, and ``tests/test_grade.py`` that
the grader scores the solutions, the stubs and one planted bug per lab.  A bug in the machinery itself -- a
comparison that gives up in the learner's favour, a seed that never reaches the hidden cases, a total that
adds the wrong column -- slipped past both; each test below names the planted bug it kills.  Fast: no kernel,
no notebook, no model.
"""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import nbformat

from minivllm.labs import grade, workloads
from minivllm.labs.checkers import Case, run_checks
from minivllm.labs.registry import Exercise, Lab, exercise


def test_an_answer_that_cannot_be_compared_fails_its_case():
    """Kills: ``ok = case.passes(got)`` without its ``bool()``, whose truth value is then taken outside the guard.

    A numpy array's ``==`` has no single truth value: a learner who returns an array instead of a list must get
    the "return plain Python values" line, not a checker crash (or a green tick)."""
    import numpy as np

    result = run_checks("t", lambda: np.array([1, 2]), [Case("c", lambda f: f(), [1, 2])], verbose=False)
    assert not result and result.num_passed == 0
    assert "could not be compared" in result.lines[-1]


def test_a_nested_list_where_a_tuple_belongs_gets_the_container_hint():
    """Kills: the container hint that looks only at the outer level.

    ``[(0, 0), [1, 2]]`` against ``[(0, 0), (1, 2)]`` has the right values in the wrong inner container; the
    hint must say where (item 1), not fall back to the case's hint for a wrong value."""
    case = Case("c", lambda f: f(), [(0, 0), (1, 2)], hint="the hint for a wrong value")
    result = run_checks("t", lambda: [(0, 0), [1, 2]], [case], verbose=False)
    assert not result
    assert "  hint: right values, but item 1 must be a tuple, not a list" in result.lines


def test_wrong_values_in_the_wrong_container_get_the_hint_for_a_wrong_value():
    """Kills: the container hint given without comparing the values, or without comparing the lengths.

    ``[9, 9]`` against ``(1, 2)`` and ``[1, 2]`` against ``(1, 2, 3)`` are wrong answers that also use the wrong
    container; telling the learner "right values" sends them to fix the container and leaves the bug (a
    missing item is no right value: ``zip`` alone would compare only the first two)."""
    case = Case("c", lambda f: f(), (1, 2, 3), hint="the hint for a wrong value")
    for wrong, expected in (([9, 9, 9], (1, 2, 3)), ([1, 2], (1, 2, 3)), ((1, 2, 3, 4), [1, 2, 3])):
        case.expected = expected
        result = run_checks("t", lambda w=wrong: w, [case], verbose=False)
        assert not result
        assert "  hint: the hint for a wrong value" in result.lines, (wrong, result.lines)
        assert not any("right values" in line for line in result.lines), (wrong, result.lines)


def test_a_wrong_value_beside_a_wrong_inner_container_gets_the_hint_for_a_wrong_value():
    """Kills: the container hint read off the first inner item whose container differs, before the values
    after it are compared.

    ``[(1, 2), 5]`` against ``[[1, 2], 6]``: item 0 is the right values in a tuple, but item 1 is a wrong value;
    "right values, but item 0 must be a list" would send the learner to fix the container and leave the bug."""
    case = Case("c", lambda f: f(), [[1, 2], 6], hint="the hint for a wrong value")
    result = run_checks("t", lambda: [(1, 2), 5], [case], verbose=False)
    assert not result
    assert "  hint: the hint for a wrong value" in result.lines, result.lines
    assert not any("right values" in line for line in result.lines), result.lines


def test_an_answer_that_raises_still_gets_the_cases_hint():
    """Kills: the hint printed only for a wrong value, not for an exception.

    The usual first bug in ``itl_stats`` is no empty case: ``gaps[...]`` on no gaps raises IndexError.  The
    learner must see the case, the exception, and the hint written for exactly that ("no gaps at all")."""
    import math

    from minivllm.labs.check_lab04 import check_itl_stats

    def no_empty_case(token_times, q=99):
        gaps = sorted(b - a for times in token_times.values() for a, b in zip(times, times[1:]))
        return gaps[max(math.ceil(q / 100 * len(gaps)), 1) - 1], gaps[-1]

    with redirect_stdout(io.StringIO()):
        result = check_itl_stats(no_empty_case)
    assert not result and result.failed_case == "no requests"
    assert any("'no requests': raised IndexError" in line and "in no_empty_case)" in line  # where it raised
               for line in result.lines), result.lines
    assert "  hint: no gaps at all: return (0.0, 0.0)" in result.lines, result.lines


def test_a_stub_reached_through_expect_raises_reads_not_implemented():
    """Kills: ``expect_raises`` without its ``except NotImplementedError: raise``.

    A learner who wrote every method but one gets "not implemented yet" for the stub, not a failed case that
    reports ``NotImplementedError`` as the wrong kind of error (which reads as a bug in code they never wrote)."""
    from minivllm.labs.checkers import expect_raises

    def stub():
        raise NotImplementedError("decref")

    case = Case("double free raises ValueError", lambda f: expect_raises(ValueError, f), "ValueError")
    result = run_checks("pool", stub, [case], verbose=False)
    assert not result and result.not_implemented
    assert result.lines == ["pool: not implemented yet -- decref"]


def test_a_case_that_hides_its_expected_value_prints_its_own_text_and_long_values_are_marked_cut():
    """Kills: ``show_expected`` ignored (a learner reads ``expected: True`` for "every step matches"), and a
    long value cut without the ``...`` that says it was cut."""
    case = Case("c", lambda f: f(), True, show_expected="all 5 finish; first scheduled in steps [0, 0, 11, 11, 20]")
    result = run_checks("t", lambda: False, [case], verbose=False)
    assert "  expected: all 5 finish; first scheduled in steps [0, 0, 11, 11, 20]" in result.lines
    long = run_checks("t", lambda: list(range(200)), [Case("c", lambda f: f(), [])], verbose=False)
    got = next(line for line in long.lines if line.startswith("  got:"))
    assert got.endswith("...") and len(got) == len("  got:      ") + 300


def test_the_grading_seed_reaches_the_hidden_cases():
    """Kills: ``run_exercise`` calling the hidden cases with a fixed seed instead of the grading seed.

    Oracle: the inputs a recording ``paged_slots`` sees when the checker and the hidden cases are called
    directly with that seed; the grader must show it exactly those, and two seeds must draw different ones
    (else every class is graded on the same "hidden" instances, which one leaked answer key defeats)."""
    _, ex = exercise("paged_slots")
    calls: list = []

    def recording(seq_lens, block_size):
        calls.append((tuple(seq_lens), block_size))
        return workloads.reserved_slots_paged(seq_lens, block_size)

    def seen(run) -> list:
        calls.clear()
        with redirect_stdout(io.StringIO()):
            run()
        return list(calls)

    graded = {s: seen(lambda s=s: grade.run_exercise(ex, recording, s)) for s in (1, 2)}
    direct = {s: seen(lambda s=s: (ex.check(recording), ex.hidden(recording, s))) for s in (1, 2)}
    assert graded == direct
    assert graded[1] != graded[2]


def _one_exercise_lab(hidden_cases: list[Case]) -> tuple[Lab, Exercise]:
    """A lab of one 2-point exercise ``f(x) == x``: a visible case, and ``hidden_cases`` as the hidden ones."""
    def check(f):
        return run_checks("t", f, [Case("visible", lambda f: f(1), 1)], verbose=False)

    def hidden(f, seed):
        return run_checks("t (hidden)", f, hidden_cases, verbose=False)

    ex = Exercise("t", "t", check, points=2, mutants=(), hidden=hidden)
    return Lab(99, "lab99_test", "test", exercises=(ex,)), ex


def test_a_hidden_case_failing_after_others_passed_still_costs_the_points():
    """Kills: a grader that scores 0 only when *no* hidden case passed.

    The one grader test of hidden failures has a single hidden case, so it fails at case 1 of 1 either way.
    Here the second of two hidden cases fails: the exercise gets 0 and the reason names that case."""
    lab, ex = _one_exercise_lab([Case("h1", lambda f: f(1), 1), Case("h2", lambda f: f(2), 2)])
    row = grade._row("s", "s.ipynb", lab, ex, 0, grade.run_exercise(ex, lambda x: 1, 0), {}, None)
    assert (row.points, row.checker, row.hidden) == (0, "passed", "failed")
    assert "'h2'" in row.reason
    right = grade._row("s", "s.ipynb", lab, ex, 0, grade.run_exercise(ex, lambda x: x, 0), {}, None)
    assert (right.points, right.hidden) == (2, "passed")


def test_the_reason_names_the_case_number_the_checker_printed():
    """Kills: the grader's reason counting cases from 0 (``num_passed`` instead of ``num_passed + 1``).

    Oracle: the checker's own first "✘ case k/n 'name'" line for the same wrong answer; the learner who
    reads the grade and then the notebook must find the same case number in both."""
    lab, ex = exercise("paged_slots")

    def floored(seq_lens, block_size):
        return sum(n // block_size * block_size for n in seq_lens)

    with redirect_stdout(io.StringIO()) as buf:
        ex.check(floored)
    shown = next(line for line in buf.getvalue().splitlines() if line.startswith("✘ case"))
    number, name = shown.split()[2], shown.split("'")[1]
    row = grade._row("s", "s.ipynb", lab, ex, 0, grade.run_exercise(ex, floored, 0), {}, None)
    assert row.points == 0 and row.reason == f"checker: case {number} '{name}' failed"


def test_the_table_total_adds_the_points_earned_not_the_points_possible():
    """Kills: a total line that sums ``max_points`` twice (every student reads as full marks)."""
    rows = [grade.ExerciseGrade("ann", "ann/lab01.ipynb", 1, "split_step", 1, 1, "passed", "passed", "", 0),
            grade.ExerciseGrade("ann", "ann/lab01.ipynb", 1, "static_batching", 0, 2, "failed", "-", "why", 0)]
    total = [line.split() for line in grade.format_table(rows).splitlines() if line.strip().startswith("total")]
    assert total == [["total", "1/3"]]


def test_a_notebook_without_exercise_tags_is_found_by_its_file_name():
    """Kills: ``identify_lab`` taking the best tag match even when no tag matched (every such notebook is lab 1).

    A learner's notebook can lose every tag (cells copied into a fresh notebook); its file name still names
    the lab, and a file that names none is not a lab notebook at all."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1")]
    assert grade.identify_lab(nb, Path("alice/lab03_prefix_caching.ipynb")).number == 3
    assert grade.identify_lab(nb, Path("alice/lab05.ipynb")).number == 5
    assert grade.identify_lab(nb, Path("alice/notes.ipynb")) is None


def test_the_answer_key_letter_is_the_letter_the_quiz_printed():
    """Kills: ``correct_answer`` lettering the options in the bank's order (correct answer first) instead of the
    shuffled order the questions were printed in -- the key would say "A)" for an option shown as "C)".

    Oracle: the printed quiz itself; the option text carrying each letter is read back from ``format_quiz``."""
    from minivllm.labs import quiz

    for bank in sorted(quiz.BANK_DIR.glob("lab*.json")):
        printed = quiz.format_quiz(bank.stem).splitlines()
        for n, q in enumerate(quiz.load_bank(bank.stem), 1):
            if q["type"] != "multiple_choice":
                continue
            right = next(a["answer"] for a in q["answers"] if a["correct"])
            start = printed.index(f"Q{n}. {q['question']}")
            shown = next(line.strip() for line in printed[start + 1:] if line.strip().endswith(f") {right}"))
            assert quiz.correct_answer(q) == shown, (bank.stem, n)


def test_the_option_order_depends_on_the_question_text_only():
    """Kills: the shuffle seeded by another field (the why): rewording an explanation would reorder the
    options of a printed quiz, and the strict notebook run compares printed quizzes."""
    from minivllm.labs import quiz

    for q in quiz.load_bank(2):
        reworded = dict(q, why=q["why"] + " (reworded)")
        assert quiz.shuffled_answers(reworded) == quiz.shuffled_answers(q), q["id"]


def test_the_answer_key_explains_each_wrong_option_under_the_letter_it_was_printed_with():
    """Kills: the "not X:" lines of the key lettered in the bank's order, not the printed (shuffled) one -- a
    learner who picked "B" would read the explanation of another option under "not B".

    Oracle: the printed quiz (which letter shows which option) and the bank (which feedback belongs to which
    option); ``correct_positions`` must name the letters the key gives as right."""
    from minivllm.labs import quiz

    for bank in sorted(quiz.BANK_DIR.glob("lab*.json")):
        printed = quiz.format_quiz(bank.stem).splitlines()
        key = quiz.format_answers(bank.stem).splitlines()
        right_letters = []
        for n, q in enumerate(quiz.load_bank(bank.stem), 1):
            if q["type"] != "multiple_choice":
                continue
            start = printed.index(f"Q{n}. {q['question']}")
            shown = {}
            for line in printed[start + 1:start + 1 + len(q["answers"])]:
                letter, text = line.strip().split(") ", 1)
                shown[letter] = text
            feedback = {a["answer"]: a["feedback"] for a in q["answers"]}
            right = next(a["answer"] for a in q["answers"] if a["correct"])
            right_letters.append(next(letter for letter, text in shown.items() if text == right))
            at = next(i for i, line in enumerate(key) if line.startswith(f"Q{n}: "))
            nots = [line.strip() for line in key[at + 1:at + len(q["answers"])]]
            assert len(nots) == len(q["answers"]) - 1 and all(line.startswith("not ") for line in nots), nots
            for line in nots:
                letter, text = line[len("not "):].split(": ", 1)
                assert shown[letter] != right and text == feedback[shown[letter]], (bank.stem, n, line)
        assert [quiz.LETTERS[i] for i in quiz.correct_positions(bank.stem)] == right_letters, bank.stem


def test_the_interactive_quiz_gives_the_why_with_the_right_answer_only():
    """Kills: the question's *why* appended to every option's feedback: a learner who clicks a wrong option
    would read the explanation of the right one.  Oracle: the bank's own feedback per option."""
    from minivllm.labs import quiz

    for bank in sorted(quiz.BANK_DIR.glob("lab*.json")):
        for item, q in zip(quiz.jupyterquiz_questions(bank.stem), quiz.load_bank(bank.stem), strict=True):
            for a, own in zip(item["answers"], quiz.shuffled_answers(q), strict=True):  # (the order shown)
                if not own["correct"]:
                    assert a["feedback"] == own["feedback"] and q["why"] not in a["feedback"], (bank.stem, q["id"])


def test_numeric_questions_keep_their_answers_in_the_banks_order():
    """Kills: numeric answers shuffled like options.  They are not options but the right value and feedback
    ranges, which ``shuffled_answers`` promises to keep as the bank orders them (its docstring)."""
    from minivllm.labs import quiz

    numeric = [q for lab in range(1, 10) for q in quiz.load_bank(lab) if q["type"] == "numeric"]
    assert numeric
    for q in numeric:
        assert quiz.shuffled_answers(q) == q["answers"], q["id"]


# -- the grader's rows for one hand-made exercise --------------------------------------------------


def _lab_of(ex: Exercise) -> Lab:
    return Lab(99, "lab99_test", "test", exercises=(ex,))


def _visible(f):
    return run_checks("t", f, [Case("visible", lambda f: f(1), 1)], verbose=False)


def test_a_lab_without_hidden_cases_gives_the_points_for_a_passing_checker():
    """Kills: the "checker re-run" row (an exercise registered without hidden cases) scoring 0.

    By hand: ``f(x) = x`` passes the one visible case, so it earns the exercise's 2 points."""
    ex = Exercise("t", "t", _visible, points=2, mutants=(), hidden=None)
    row = grade._row("s", "s.ipynb", _lab_of(ex), ex, 0, grade.run_exercise(ex, lambda x: x, 0), {}, None)
    assert (row.points, row.max_points, row.checker, row.hidden) == (2, 2, "passed", "checker re-run")


def test_hidden_cases_that_crash_are_reported_as_the_hidden_cases_not_the_checker():
    """Kills: every crashed exercise reported as ``checker: error`` (the learner saw that checker pass)."""
    def hidden(f, seed):
        raise KeyError("generator")

    ex = Exercise("t", "t", _visible, points=2, mutants=(), hidden=hidden)
    row = grade._row("s", "s.ipynb", _lab_of(ex), ex, 0, grade.run_exercise(ex, lambda x: x, 0), {}, None)
    assert (row.points, row.checker, row.hidden) == (0, "passed", "error")
    assert row.reason == "the hidden cases could not run it: KeyError: 'generator'"


def test_a_failing_checker_is_the_reason_even_when_the_hidden_cases_would_crash():
    """Kills: the hidden cases run after a failed checker (the docstring: "only if it passed").

    A wrong answer the hidden cases cannot even run (here they raise) must still be reported by the visible case it
    failed -- the line the learner can find in their notebook -- not as a crash of the hidden cases."""
    def hidden(f, seed):
        raise RuntimeError("the hidden cases ran")

    ex = Exercise("t", "t", _visible, points=2, mutants=(), hidden=hidden)
    row = grade._row("s", "s.ipynb", _lab_of(ex), ex, 0, grade.run_exercise(ex, lambda x: 0, 0), {}, None)
    assert (row.points, row.checker, row.hidden, row.reason) == (0, "failed", "-", "checker: case 1/1 'visible' failed")


def test_a_timed_out_grading_cell_says_what_it_was_checking():
    """Kills: the "checking `<object>`" prefix dropped from a timeout (which step ran over is then unsaid)."""
    ex = Exercise("t", "my_fn", _visible, points=2, mutants=(), hidden=None)
    row = grade._row("s", "s.ipynb", _lab_of(ex), ex, 0, None, {"grade:t": "timed out after 8 s"}, None)
    assert (row.points, row.reason) == (0, "checking `my_fn` timed out after 8 s")


def _jupyterquiz_verdict(item: dict, typed: float):
    """jupyterquiz's numeric check (``js/numeric.js``) written out: the typed number and each listed value are
    rounded to ``precision`` significant digits (``toPrecision``), and the first listed value equal to the typed
    one decides.  Returns that answer (None: none matched, the catch-all range decides)."""
    def sig(x: float) -> float:
        return float(f"{x:.{item['precision']}g}") if item.get("precision", 0) > 0 else x

    return next((a for a in item["answers"] if "value" in a and sig(a["value"]) == sig(typed)), None)


def test_every_listed_numeric_answer_gets_its_own_verdict_in_the_interactive_quiz():
    """Kills: the interactive quiz's default precision cut to one significant digit.  jupyterquiz rounds both the
    typed number and each listed answer to ``precision`` significant digits before comparing, so at one digit
    lab 3's 96 (right) and 100 (wrong) both read 100 and typing the wrong 100 is marked correct; lab 6's 310 and
    309 merge likewise.  A question without its own ``precision`` must keep every listed value apart, and the
    right value typed exactly must be marked right.  Oracle: jupyterquiz's comparison, written out above."""
    from minivllm.labs import quiz

    checked = 0
    for bank in sorted(quiz.BANK_DIR.glob("lab*.json")):
        for item in quiz.jupyterquiz_questions(bank.stem):
            if item["type"] != "numeric":
                continue
            for answer in item["answers"]:
                if "value" in answer:
                    assert _jupyterquiz_verdict(item, answer["value"]) is answer, (bank.stem, item["question"][:60])
                    checked += 1
    assert checked >= 30


def test_a_bank_precision_lets_a_value_typed_past_its_digits_count_as_right():
    """Kills: the bank's own ``precision`` replaced by the default 4.  A question that sets fewer digits (lab 6's
    Jain index at 2, lab 9's ring moves at 1) promises that a learner who types more digits than it asks for -- 0.904
    for 0.9 -- is marked right; at 4 digits that answer falls through to the catch-all range and reads as wrong.
    Oracle: jupyterquiz's comparison (above) on a number 0.4 units past the last digit the question keeps."""
    import math

    from minivllm.labs import quiz

    checked = 0
    for bank in sorted(quiz.BANK_DIR.glob("lab*.json")):
        for q, item in zip(quiz.load_bank(bank.stem), quiz.jupyterquiz_questions(bank.stem)):
            if q["type"] != "numeric" or "precision" not in q:
                continue
            right = next(a for a in item["answers"] if a.get("correct"))
            p = q["precision"]
            typed = right["value"] + 0.4 * 10 ** (math.floor(math.log10(abs(right["value"]))) - p + 1)
            assert _jupyterquiz_verdict(item, typed) is right, (bank.stem, q["id"], typed)
            checked += 1
    assert checked >= 3


def test_the_answer_key_gives_each_question_its_own_why_and_the_right_value():
    """Kills: the key's explanation taken from an option's feedback instead of the question's ``why`` (the key
    still has a "why:" per question, so counting them cannot tell), and a numeric key reading the first listed
    value whatever its ``correct`` flag.  Oracles: the bank's ``why`` field, line by line; and a question written
    here with a wrong value listed first, whose right value (12) is known by hand."""
    from minivllm.labs import quiz

    for bank in sorted(quiz.BANK_DIR.glob("lab*.json")):
        key = quiz.format_answers(bank.stem).splitlines()
        for n, q in enumerate(quiz.load_bank(bank.stem), 1):
            line = next(x for x in key if x.startswith(f"Q{n}: "))
            assert line.endswith(f" -- why: {q['why']}"), (bank.stem, n)
    wrong_first = {"question": "How many?", "type": "numeric", "why": "by hand", "answers": [
        {"type": "value", "value": 8, "correct": False, "feedback": "one block short"},
        {"type": "value", "value": 12, "correct": True, "feedback": "right"},
        {"type": "range", "range": [-1e9, 1e9], "correct": False, "feedback": "count the blocks"}]}
    assert quiz.correct_answer(wrong_first) == "12"


def test_the_printed_quiz_asks_a_numeric_question_for_a_number():
    """Kills: the "(a number)" line dropped: a numeric question would print with nothing under it, and the learner
    could not tell it from a multiple-choice question whose options went missing.  Oracle: the bank's type of
    each question; a multiple-choice one is followed by its lettered options instead."""
    from minivllm.labs import quiz

    for bank in sorted(quiz.BANK_DIR.glob("lab*.json")):
        printed = quiz.format_quiz(bank.stem).splitlines()
        for n, q in enumerate(quiz.load_bank(bank.stem), 1):
            after = printed[printed.index(f"Q{n}. {q['question']}") + 1]
            assert after == ("    (a number)" if q["type"] == "numeric" else "    A) " + after[len("    A) "):]), (bank.stem, n)
