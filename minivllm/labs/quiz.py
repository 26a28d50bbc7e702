"""End-of-lab retrieval quizzes: question banks are data (``quizzes/labNN.json``).

Why data?  A test can validate every bank (at least three questions, one
correct choice, a *why* for every answer) and recompute each numeric answer
from the engine's own functions (``"compute": "module:function"``), so an
answer cannot drift when the engine changes.

Two renderings: :func:`print_quiz` (plain text, works everywhere, answers
with their *why* at the end) and :func:`show_quiz` (interactive, via
jupyterquiz, when a browser renders the notebook).
"""

from __future__ import annotations

import importlib
import json
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


def correct_answer(question: dict) -> str:
    if question["type"] == "numeric":
        return str(next(a["value"] for a in question["answers"] if a.get("correct")))
    return next(f"{LETTERS[i]}) {a['answer']}" for i, a in enumerate(question["answers"]) if a["correct"])


def format_quiz(lab: str | int) -> str:
    """Questions first, then the answers, each with its *why*."""
    bank = load_bank(lab)
    lines = []
    for n, q in enumerate(bank, 1):
        lines.append(f"Q{n}. {q['question']}")
        if q["type"] == "multiple_choice":
            for i, a in enumerate(q["answers"]):
                lines.append(f"    {LETTERS[i]}) {a['answer']}")
        else:
            lines.append("    (a number)")
        lines.append("")
    lines.append("Answers (try first, then read on)")
    lines.append("-" * 33)
    for n, q in enumerate(bank, 1):
        lines.append(f"Q{n}: {correct_answer(q)} -- why: {q['why']}")
    return "\n".join(lines)


def print_quiz(lab: str | int) -> None:
    print(format_quiz(lab))


def jupyterquiz_questions(lab: str | int) -> list[dict]:
    """The bank in jupyterquiz's format (extra keys dropped, the why added to the right answer)."""
    out = []
    for q in load_bank(lab):
        answers = []
        for a in q["answers"]:
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
