"""Defects of the grader and the notebook generator found by a hunt over hand-ins a class really produces.

* A notebook whose cell tags are gone (a tool or a collaborative editor that drops cell metadata drops every
  tag) is still found by its file name and its exercises by their definitions, but no cell was tagged ``setup``,
  so the grader ran the exercises without the lab's imports: a correct solution lost points.
* The same file named twice on the command line (overlapping globs) was graded twice, so the CSV held each of
  its exercises twice.
* ``tools/make_labs.py`` turns solution regions into stubs in code cells only; a region in a markdown cell was
  copied to the student notebook as it stood.

Every test is fast: grading runs in-process (:func:`grade.grade_in_process`) or against a stand-in for the
kernel run; nothing under ``labs/`` or ``solutions/`` is rewritten.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest

from minivllm.labs import grade
from minivllm.labs.registry import Exercise, Lab, get_lab

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_labs  # noqa: E402


def _untagged_copy(lab: Lab, dest: Path) -> Path:
    """The lab's solution notebook with every cell's tags removed, under the lab's own file name."""
    nb = nbformat.read(ROOT / "solutions" / f"{lab.stem}.ipynb", as_version=4)
    for cell in nb.cells:
        cell.metadata.pop("tags", None)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"{lab.stem}.ipynb"
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize("number", [2, 9])
def test_a_correct_notebook_stripped_of_its_tags_earns_full_marks(number, tmp_path):
    """Oracle: the solution's code is correct, so every exercise earns the points its registration gives it.
    Before the fix, lab 2's ``block_pool`` (its ``OutOfBlocksError`` comes from the setup cell) and lab 9's
    ``prefix_affinity`` scored 0: the setup cell was never run."""
    lab = get_lab(number)
    rows = grade.grade_in_process(_untagged_copy(lab, tmp_path / "alice"), seed=4)
    assert {r.exercise: r.points for r in rows} == {ex.name: ex.points for ex in lab.exercises}, \
        [(r.exercise, r.reason) for r in rows]


def test_without_a_setup_tag_the_first_code_cell_runs_as_the_setup():
    """Hand-built notebook: a markdown cell, the imports, a lesson cell, the exercise (tag lost).  Expected by
    hand: the imports as setup, then the exercise; the lesson cell is not run."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# lab"), nbformat.v4.new_code_cell("import math"),
                nbformat.v4.new_code_cell("print('a slow lesson')"),
                nbformat.v4.new_code_cell("def area(r):\n    return math.pi * r * r")]
    lab = Lab(99, "lab99_x", "x", (Exercise("area", "area", lambda obj: None),))
    assert grade.graded_cells(nb, lab) == [("setup", "import math"),
                                           ("exercise:area", "def area(r):\n    return math.pi * r * r")]
    # a notebook that keeps its setup tag runs exactly that cell, and nothing else is taken for the setup
    nb.cells[2].metadata["tags"] = ["setup"]
    assert [w for w, _ in grade.graded_cells(nb, lab)] == ["setup", "exercise:area"]
    assert grade.graded_cells(nb, lab)[0][1] == "print('a slow lesson')"


def test_one_notebook_named_twice_is_graded_once(tmp_path, monkeypatch):
    """Two files named four times (relative, ``./``, absolute): the oracle is the hand count, two gradings and
    one row per file in the JSON."""
    calls: list[str] = []

    def fake_grade(path, *, seed, timeout, run_all):
        calls.append(str(path))
        return [grade.ExerciseGrade(Path(path).stem, str(path), 1, "split_step", 1, 1, "passed", "passed", "", seed)]

    monkeypatch.setattr(grade, "grade_notebook", fake_grade)
    monkeypatch.chdir(tmp_path)
    for name in ("alice.ipynb", "bob.ipynb"):
        (tmp_path / name).write_text("{}")
    out = tmp_path / "rows.json"
    assert grade.main(["alice.ipynb", "./alice.ipynb", str(tmp_path / "alice.ipynb"), "bob.ipynb",
                       "--seed", "1", "--quiet", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(calls) == 2 and sorted(r["student"] for r in rows) == ["alice", "bob"]


def test_a_solution_region_in_a_markdown_cell_never_reaches_the_student_notebook():
    """Oracle: the answer's text must not be in the student notebook; refusing to build it is fine too."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("Why does paging help?\n\n### BEGIN SOLUTION\n"
                                              "Blocks are reserved as tokens arrive, not for the longest request.\n"
                                              "### END SOLUTION"),
                nbformat.v4.new_code_cell("x = 1")]
    try:
        text = make_labs.render(make_labs.make_lab(nb, "lab99.ipynb"))
    except make_labs.MarkerError:
        return
    assert "reserved as tokens arrive" not in text
