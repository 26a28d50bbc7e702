"""One lab = one registration: everything the tests and the grader need to know about a lab.

Why a registry?  Before it, adding a lab meant editing about seven places (the
lab text, its checker module, a planted-bug table, an answers module, the quiz
bank, a hard-coded table in the tests, the README) and forgetting one of them
failed silently.  Now each ``minivllm/labs/check_labNN.py`` defines one
module-level ``LAB = Lab(...)`` value that names its notebook, its exercises (the object
each exercise cell defines, the checker shown to the learner, the planted bugs
the checker must reject, the grading points and the hidden cases the grader
adds) and its quiz bank.  :func:`labs` discovers every such module, so the
tests, ``minivllm grade`` and the notebook runner pick a new lab up by itself.

Planted bugs are text patches on the solution, applied by :func:`apply_mutant`
(``tests/test_labs.py`` requires every one to fail its checker); numeric quiz
answers are ``quiz_*`` functions in the same module, named by the bank's
``"compute"`` field.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable

from minivllm.labs.checkers import CheckResult

# (description, old, new): a text patch on the solution region of the exercise cell
# in ``solutions/``; the checker must fail on the patched code.
Mutant = tuple[str, str, str]

# The markers around a solution region (tools/make_labs.py replaces each region with a stub).
BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"


def solution_marker(line: str) -> str | None:
    """:data:`BEGIN` or :data:`END` if ``line`` is a solution marker, else None.

    A marker is a line whose code starts with one (indentation before it and words after it are allowed); the
    same text later in a line -- a comment or a hint that quotes it, a string -- marks nothing.  One definition
    for :func:`apply_mutant` and ``tools/make_labs.py``: the grader must plant its bugs in exactly the lines the
    student notebook replaces with a stub.  Where the two read markers differently, a marker quoted mid-line
    above a region started :func:`apply_mutant`'s region early, and a planted bug could land in code the
    learner is given rather than in code they write: the checker would then be tested on a bug no learner
    can make.
    """
    code = line.lstrip()
    if code.startswith(BEGIN):
        return BEGIN
    if code.startswith(END):
        return END
    return None


def solution_regions(source: str) -> list[tuple[int, int]]:
    """``(start, end)`` offsets of each solution region of ``source``: the lines between a :data:`BEGIN` line
    and the next :data:`END` line, the marker lines left out (:func:`solution_marker` says which lines those
    are).  A BEGIN inside a region, or one never closed, opens nothing; ``tools/make_labs.py`` refuses both."""
    regions: list[tuple[int, int]] = []
    start, pos = None, 0
    for line in source.split("\n"):
        after = pos + len(line) + 1
        marker = solution_marker(line)
        if marker == BEGIN and start is None:
            start = after
        elif marker == END and start is not None:
            regions.append((start, pos))
            start = None
        pos = after
    return regions


class MutantError(ValueError):
    """A planted bug whose ``old`` text no longer occurs in any solution region (the solution moved on)."""


def apply_mutant(source: str, mutant: Mutant) -> str:
    """``source`` (an exercise cell) with ``mutant`` applied once, inside a solution region only.

    Only inside a region because the TODO hints above a region may quote the
    code; patching a hint would plant no bug at all and the mutant would
    "survive" for the wrong reason.
    """
    description, old, new = mutant
    for start, end in solution_regions(source):
        region = source[start:end]
        if old in region:
            return source[:start] + region.replace(old, new, 1) + source[end:]
    raise MutantError(f"mutant {description!r} no longer applies to the solution")


@dataclass(frozen=True)
class Exercise:
    """One exercise cell: tagged ``exercise:<name>`` in the solution notebook.

    ``defines`` is the object the cell defines (a function or a class) and the
    thing every checker receives.  ``check`` is the checker the notebook calls;
    ``hidden`` (optional) is what the grader runs in addition, with a seed
    chosen at grading time, so a learner cannot pass by matching the visible
    cases.  ``points`` is what a passing exercise is worth to the grader.
    """

    name: str
    defines: str
    check: Callable[[Any], CheckResult]
    points: int = 1
    mutants: tuple[Mutant, ...] = ()
    hidden: Callable[[Any, int], CheckResult] | None = None


@dataclass(frozen=True)
class Lab:
    """A lab: ``stem`` names ``solutions/<stem>.ipynb`` and ``labs/<stem>.ipynb``."""

    number: int
    stem: str
    title: str
    exercises: tuple[Exercise, ...] = ()
    widgets: tuple[str, ...] = field(default=())  # button labels a browser test can click

    @property
    def quiz(self) -> str:
        """The lab's quiz bank under ``minivllm/labs/quizzes/`` (``lab06``): named by the lab's number, as
        :func:`minivllm.labs.quiz.load_bank` names it, so a lab cannot be registered with another lab's bank."""
        return f"lab{self.number:02d}"

    @property
    def total_points(self) -> int:
        return sum(e.points for e in self.exercises)


def labs() -> tuple[Lab, ...]:
    """Every registered lab, in lab order (modules ``minivllm.labs.check_labNN`` exporting ``LAB``)."""
    import minivllm.labs as pkg

    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("check_lab"):
            module = importlib.import_module(f"minivllm.labs.{info.name}")
            lab = getattr(module, "LAB", None)
            if isinstance(lab, Lab):
                found.append(lab)
    return tuple(sorted(found, key=lambda lab: lab.number))


def get_lab(key: int | str) -> Lab:
    """A lab by number (6) or stem prefix ("lab06", "lab06_fairness")."""
    for lab in labs():
        if key == lab.number or (isinstance(key, str) and lab.stem.startswith(key)):
            return lab
    raise KeyError(f"no lab registered as {key!r}")


def exercise(name: str) -> tuple[Lab, Exercise]:
    """The lab and exercise registered under ``name`` (exercise names are unique course-wide)."""
    for lab in labs():
        for ex in lab.exercises:
            if ex.name == name:
                return lab, ex
    raise KeyError(f"no exercise named {name!r}")
