"""The lab registry's lookups and text patches, checked against hand-built cells and the names on disk.

``tests/test_labs.py`` runs every registered planted bug through its checker; that shows the bugs are caught, not
that :func:`apply_mutant` planted them where its docstring promises (once, inside a solution region), nor that the
lookups the grader and the old compatibility spellings use hand back the lab an exercise belongs to.  The oracles
here are independent of the registry's code: cells written by hand, the ``labNN`` prefix of each notebook name, and
the quiz banks' own ``"compute"`` references.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from pathlib import Path

import nbformat
import pytest

from minivllm.labs import answers, mutants, quiz
from minivllm.labs.registry import MutantError, apply_mutant, exercise, get_lab, labs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402
REGISTERED = labs()

# A hint above the region quotes the solution's line: learners are told what to write, not how.
HINTED = (
    "def f(xs):\n"
    "    # TODO: return total = sum(xs) plus one\n"
    "    ### BEGIN SOLUTION\n"
    "    total = sum(xs)\n"
    "    return total + 1\n"
    "    ### END SOLUTION\n"
)


def test_a_planted_bug_lands_in_the_solution_region_not_in_a_hint_that_quotes_it():
    """Patching the hint would leave the solution intact: the checker passes it and the planted bug reads as one the
    checker cannot see, when it was never planted."""
    got = apply_mutant(HINTED, ("off by one", "total = sum(xs)", "total = sum(xs[1:])"))
    assert got == HINTED.replace("    total = sum(xs)\n", "    total = sum(xs[1:])\n")
    assert "# TODO: return total = sum(xs) plus one" in got


def test_a_planted_bug_patches_one_occurrence_and_skips_a_region_without_it():
    """One planted bug is one mistake: the first region holding the text, first occurrence only."""
    source = (
        "### BEGIN SOLUTION\na = 1\n### END SOLUTION\n"
        "### BEGIN SOLUTION\nb = x + x\n### END SOLUTION\n"
    )
    assert apply_mutant(source, ("one x", "x", "y")) == source.replace("b = x + x", "b = y + x")


# A comment quotes the marker mid-line above the region: it marks nothing; the line after it is given code.
QUOTED_MARKER = (
    "def mean(xs):\n"
    "    n = len(xs)  # the ### BEGIN SOLUTION region below divides by n\n"
    "    total = sum(xs)\n"
    "    ### BEGIN SOLUTION\n"
    "    return sum(xs) / n\n"
    "    ### END SOLUTION\n"
)


def test_a_marker_quoted_mid_line_is_no_marker_for_the_grader_nor_for_the_student_notebook():
    """``apply_mutant`` used to take a marker anywhere in a line, ``tools/make_labs.py`` only at its start: the
    quoted marker opened a region for the grader, which then planted the bug in ``total = sum(xs)``, a line the
    student notebook gives the learner.  Oracle: the student notebook itself -- a bug planted in a solution
    region is in lines ``make_labs`` replaces, so the stub it writes is the same with or without the bug."""
    stub = make_labs.stub_source(QUOTED_MARKER)
    assert "    total = sum(xs)\n" in stub and "return sum(xs) / n" not in stub  # make_labs' reading, by hand
    got = apply_mutant(QUOTED_MARKER, ("sums one short", "sum(xs)", "sum(xs[1:])"))
    assert got == QUOTED_MARKER.replace("return sum(xs) / n", "return sum(xs[1:]) / n")
    assert make_labs.stub_source(got) == stub
    with pytest.raises(MutantError):  # text only in the given lines is no solution code to plant a bug in
        apply_mutant(QUOTED_MARKER, ("no total", "total = sum(xs)", "total = 0"))


def test_each_lab_is_registered_under_its_notebook_number_in_lab_order():
    """The grader's ``get_lab(number)`` and the notebook name must agree: stem ``labNN_...`` is lab NN."""
    numbers = [lab.number for lab in REGISTERED]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    for lab in REGISTERED:
        assert lab.stem.startswith(f"lab{lab.number:02d}_"), lab.stem
        assert (ROOT / "solutions" / f"{lab.stem}.ipynb").exists(), lab.stem


@pytest.mark.parametrize("lab", REGISTERED, ids=lambda lab: lab.stem)
def test_get_lab_finds_a_lab_by_number_and_by_name(lab):
    assert get_lab(lab.number) is lab
    assert get_lab(lab.stem) is lab and get_lab(lab.stem[:5]) is lab  # "lab06" as the docstring spells it


@pytest.mark.parametrize("lab", REGISTERED, ids=lambda lab: lab.stem)
def test_the_registered_quiz_bank_is_the_one_the_notebook_shows(lab):
    """The tests validate ``lab.quiz``; the learner sees the bank the notebook's quiz calls name.  If the two part,
    the checks run on a bank no learner of this lab is shown."""
    text = "\n".join(c.source for c in nbformat.read(ROOT / "solutions" / f"{lab.stem}.ipynb", as_version=4).cells)
    shown = set(re.findall(r"\b(?:show_quiz|print_quiz|print_answers)\(([^)]*)\)", text))
    assert shown, lab.stem
    for arg in shown:
        assert quiz.load_bank(json.loads(arg.replace("'", '"'))) == quiz.load_bank(lab.quiz), (lab.stem, arg)


def test_get_lab_and_exercise_refuse_what_is_not_registered():
    missing = max(lab.number for lab in REGISTERED) + 1
    for key in (missing, f"lab{missing:02d}"):
        with pytest.raises(KeyError):
            get_lab(key)
    with pytest.raises(KeyError):
        exercise("no_such_exercise")


def test_exercise_names_the_lab_that_holds_it():
    for lab in REGISTERED:
        for ex in lab.exercises:
            assert exercise(ex.name) == (lab, ex)


def _compute_refs() -> list[tuple[str, str, str]]:
    """(lab, answer name, module:function) of every numeric answer the quiz banks compute."""
    out = []
    for bank in sorted((ROOT / "minivllm" / "labs" / "quizzes").glob("lab*.json")):
        for q in json.loads(bank.read_text()):
            if "compute" in q:
                module, func = q["compute"].split(":")
                assert func.startswith("quiz_"), q["compute"]
                out.append((bank.stem, func[len("quiz_"):], q["compute"]))
    return out


def test_the_old_answers_spelling_reaches_the_function_the_bank_computes():
    """``minivllm.labs.answers:labNN_<name>`` (the spelling older banks and notebooks use) must be the very
    function the bank now names, not a near miss that computes something else."""
    refs = _compute_refs()
    assert refs
    for lab, name, ref in refs:
        module, func = ref.split(":")
        assert getattr(answers, f"{lab}_{name}") is getattr(importlib.import_module(module), func), ref
    for bad in ("lab01_no_such_answer", "labxx_decode", "lab01", "quiz"):
        assert not hasattr(answers, bad), bad


def test_the_old_mutants_table_lists_every_planted_bug_of_every_exercise():
    table = mutants.MUTANTS
    assert sorted(table) == sorted(ex.name for lab in REGISTERED for ex in lab.exercises)
    for lab in REGISTERED:
        for ex in lab.exercises:
            assert [tuple(m) for m in table[ex.name]] == list(ex.mutants) and len(ex.mutants) >= 5, ex.name
    assert not hasattr(mutants, "NOT_A_TABLE")
