"""End-of-lab retrieval quizzes: question banks are data (``quizzes/labNN.json``).

Why data?  A test can validate every bank (at least three questions, one
correct choice, a *why* for every answer) and recompute each numeric answer
from the engine's own functions (``"compute": "module:function"``), so an
answer cannot drift when the engine changes.

Options are shuffled per question, deterministically (seeded by the question
text), in every rendering.  Three renderings: :func:`print_quiz` (plain text,
questions only), :func:`print_answers` (the key, with every *why*; a separate
cell, run after answering) and :func:`show_quiz` (interactive, via
jupyterquiz, when a browser renders the notebook).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import random
from pathlib import Path
from typing import Any

BANK_DIR = Path(__file__).parent / "quizzes"
LETTERS = "ABCDEFGH"


def load_bank(lab: str | int) -> list[dict]:
    """The questions of ``lab`` (``1`` or ``"lab01"``)."""
    name = f"lab{int(lab):02d}" if not str(lab).startswith("lab") else str(lab)
    return json.loads((BANK_DIR / f"{name}.json").read_text())


def compute_answer(question: dict) -> Any:
    """Call the question's ``compute`` function (``"pkg.module:function"``)."""
    module, func = question["compute"].split(":")
    return getattr(importlib.import_module(module), func)()


def shuffled_answers(question: dict) -> list[dict]:
    """The options of a multiple-choice question in a fixed shuffled order.

    The banks list the correct answer first (easy to review); learners must not
    be able to rely on that.  The order is seeded by the question text
    (sha256, not Python's per-process ``hash``), so it is the same on every
    machine and every run, and strict nbval can compare the printed quiz.
    Numeric questions keep their order (their answers are feedback ranges).
    """
    answers = list(question["answers"])
    if question["type"] != "multiple_choice":
        return answers
    seed = int.from_bytes(hashlib.sha256(question["question"].encode()).digest()[:8], "big")
    random.Random(seed).shuffle(answers)
    return answers


def correct_answer(question: dict) -> str:
    if question["type"] == "numeric":
        return str(next(a["value"] for a in question["answers"] if a.get("correct")))
    return next(f"{LETTERS[i]}) {a['answer']}" for i, a in enumerate(shuffled_answers(question)) if a["correct"])


def correct_positions(lab: str | int) -> list[int]:
    """Index of the correct option of every multiple-choice question, as shown."""
    return [next(i for i, a in enumerate(shuffled_answers(q)) if a["correct"])
            for q in load_bank(lab) if q["type"] == "multiple_choice"]


def format_quiz(lab: str | int) -> str:
    """The questions only, options shuffled; the answers are in :func:`format_answers`."""
    lines = []
    for n, q in enumerate(load_bank(lab), 1):
        lines.append(f"Q{n}. {q['question']}")
        if q["type"] == "multiple_choice":
            for i, a in enumerate(shuffled_answers(q)):
                lines.append(f"    {LETTERS[i]}) {a['answer']}")
        else:
            lines.append("    (a number)")
        lines.append("")
    lines.append(f"Write your answers down, then run print_answers({lab!r}) to check them.")
    return "\n".join(lines)


def format_answers(lab: str | int) -> str:
    """The answer key: the right option, why it is right, and why each wrong option is wrong."""
    lines = ["Answer key", "-" * 10]
    for n, q in enumerate(load_bank(lab), 1):
        lines.append(f"Q{n}: {correct_answer(q)} -- why: {q['why']}")
        if q["type"] == "multiple_choice":
            for i, a in enumerate(shuffled_answers(q)):
                if not a["correct"]:
                    lines.append(f"    not {LETTERS[i]}: {a['feedback']}")
    return "\n".join(lines)


def print_quiz(lab: str | int) -> None:
    print(format_quiz(lab))


def print_answers(lab: str | int) -> None:
    print(format_answers(lab))


def jupyterquiz_questions(lab: str | int) -> list[dict]:
    """The bank in jupyterquiz's format (extra keys dropped, the why added to the right answer)."""
    out = []
    for q in load_bank(lab):
        answers = []
        for a in shuffled_answers(q):
            a = dict(a)
            if a.get("correct"):
                a["feedback"] = (a.get("feedback", "Correct.") + " Why: " + q["why"]).strip()
            answers.append(a)
        item = {"question": q["question"], "type": q["type"], "answers": answers}
        if q["type"] == "numeric":
            item["precision"] = q.get("precision", 4)
        out.append(item)
    return out


def show_quiz(lab: str | int) -> None:
    """Interactive quiz (jupyterquiz) when a browser renders it; the plain text otherwise."""
    try:
        from jupyterquiz import display_quiz
    except ImportError:
        print_quiz(lab)
        return
    display_quiz(jupyterquiz_questions(lab), shuffle_answers=False)
