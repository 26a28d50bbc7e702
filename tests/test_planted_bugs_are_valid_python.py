"""Every planted bug must be valid Python, or it never reaches the checker it is meant to test.

``test_labs.test_checker_rejects_planted_bugs`` counts a mutant whose cell cannot even define its object as
caught (a mutant that raises while defining is a real, if trivial, catch).  A text patch that leaves the cell
unparsable -- an ``old`` that starts after the indentation of the lines it cuts -- is "caught" the same way, so
the case written for that bug is never run against it, and would pass unnoticed if it accepted the bug.
Oracle: Python's own parser.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from minivllm.labs.grade import exercise_cells
from minivllm.labs.registry import apply_mutant, labs

ROOT = Path(__file__).resolve().parents[1]
EXERCISES = [(lab, ex) for lab in labs() for ex in lab.exercises]


@pytest.mark.parametrize("lab,ex", EXERCISES, ids=[ex.name for _, ex in EXERCISES])
def test_every_planted_bug_parses(lab, ex):
    source = exercise_cells(nbformat.read(ROOT / "solutions" / f"{lab.stem}.ipynb", as_version=4))[ex.name]
    broken = []
    for mutant in ex.mutants:
        try:
            compile(apply_mutant(source, mutant), f"<{ex.name}: {mutant[0]}>", "exec")
        except SyntaxError as exc:
            broken.append(f"{mutant[0]!r}: {type(exc).__name__}: {exc.msg} (line {exc.lineno})")
    assert not broken, f"{ex.name}: planted bugs that are not valid Python: {broken}"
