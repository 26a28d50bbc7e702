"""End-of-lab retrieval quizzes: question banks are data (``quizzes/labNN.json``).

Why data?  A test can validate every bank (at least three questions, one
correct choice, a *why* for every answer) and recompute each numeric answer
from the engine's own functions (``"compute": "module:function"``), so an
answer cannot drift when the engine changes.

Options are shuffled per question, deterministically (seeded by the question
text), in every rendering.  Three renderings: :func:`print_quiz` (plain text,
questions only), :func:`print_answers` (the key, with every *why*; a separate
cell, run after answering) and :func:`show_quiz` (interactive, via
jupyterquiz, when a browser renders the notebook; it fetches nothing from
the network, see :func:`quiz_html_and_script`).
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

    Most bank entries list the correct answer first (easy to review); learners
    must not be able to rely on that.  The order is seeded by the question text
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
    """The key's answer as the learner saw it: the option's letter after the shuffle, since the bank's own order
    (mostly correct answer first) is never shown; a numeric question's value."""
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


def quiz_html_and_script(lab: str | int, div_id: str) -> tuple[str, str]:
    """jupyterquiz's container (HTML + CSS) and script for ``lab``, with the script made offline-safe.

    jupyterquiz typesets with MathJax when a global ``MathJax`` exists.
    JupyterLab 4 defines one without a ``version`` (its own MathJax is
    bundled), so jupyterquiz injects a ``<script>`` from a CDN -- which fails
    offline -- and every answer click then throws reading ``MathJax.version``.
    Our questions contain no TeX, so the script runs inside a function whose
    ``MathJax`` parameter is ``undefined``: jupyterquiz skips typesetting,
    fetches nothing, and the page's own MathJax is left alone.
    """
    from jupyterquiz.dynamic.loader import load_questions_script
    from jupyterquiz.dynamic.renderer import build_script, build_styles, render_div

    prefix, static, url = load_questions_script(jupyterquiz_questions(lab), div_id)
    script = build_script(prefix, static, url, div_id, True)
    div = render_div(div_id, False, False, False, 1_000_000, 600, 10, "left")
    colours = {"--jq-multiple-choice-bg": "#392061", "--jq-mc-button-bg": "#fafafa",
               "--jq-mc-button-border": "#e0e0e0e0", "--jq-mc-button-inset-shadow": "#555555",
               "--jq-many-choice-bg": "#f75c03ff", "--jq-numeric-bg": "#392061ff",
               "--jq-numeric-input-bg": "#c0c0c0", "--jq-numeric-input-label": "#101010",
               "--jq-numeric-input-shadow": "#999999", "--jq-string-bg": "#4c1a57",
               "--jq-incorrect-color": "#c80202", "--jq-correct-color": "#009113",
               "--jq-text-color": "#fafafa", "--jq-link-color": "#9abafa"}
    return div + build_styles(div_id, colours), "(function (MathJax) {\n" + script + "\n})(undefined);\n"


def show_quiz(lab: str | int) -> None:
    """Interactive quiz (jupyterquiz, offline-safe); the plain text only when jupyterquiz is not installed.

    A frontend that renders no HTML (a terminal, nbval) shows the display objects' reprs instead, so the
    labs follow this cell with :func:`print_quiz`.

    The container id comes from :mod:`secrets`, not :mod:`random` as in
    jupyterquiz's ``display_quiz``, so showing a quiz never moves the
    notebook's seeded random stream.
    """
    try:
        import jupyterquiz  # noqa: F401
    except ImportError:
        print_quiz(lab)
        return
    import secrets

    from IPython.display import HTML, Javascript, display

    markup, script = quiz_html_and_script(lab, "quiz" + secrets.token_hex(6))
    display(HTML(markup))
    display(Javascript(script))
