"""A quiz must be answered from what the learner knows, not from the shape of its options.

Two cues give a multiple-choice answer away without reading it. A writer tends to qualify the right option until it
is the longest one, so a learner who always picks the longest wins; and a key that puts the right option at the
same letter three times running teaches the learner to look for a streak. The banks are data
(``minivllm/labs/quizzes/labNN.json``), so both cues are counted here, per bank:

* among its multiple-choice questions, the right option is the strictly longest in at most half;
* in the order the learner sees (the quiz module's own deterministic shuffle, the order every rendering prints),
  no three consecutive multiple-choice questions have their right option at the same letter.

Numeric questions have no options to compare and are skipped; they do not break a streak either, since the
multiple-choice letters are what a learner scans for a pattern.
"""

from __future__ import annotations

import json

import pytest

from minivllm.labs import quiz

BANKS = sorted(quiz.BANK_DIR.glob("lab*.json"))


def _multiple_choice(questions: list[dict]) -> list[dict]:
    return [q for q in questions if q["type"] == "multiple_choice"]


def longest_right(questions: list[dict], extreme=max) -> list[str]:
    """Ids of the questions whose right option is longer than every wrong one (``extreme=min``: shorter than every
    wrong one); a tie is no cue."""
    out = []
    for q in _multiple_choice(questions):
        right = [len(a["answer"]) for a in q["answers"] if a["correct"]]
        assert len(right) == 1, q["id"]
        wrong = extreme(len(a["answer"]) for a in q["answers"] if not a["correct"])
        if right[0] != wrong and extreme(right[0], wrong) == right[0]:
            out.append(q["id"])
    return out


def shown_letters(questions: list[dict]) -> list[str]:
    """The letter the right option is printed at, per multiple-choice question, after the quiz's shuffle."""
    return [quiz.LETTERS[next(i for i, a in enumerate(quiz.shuffled_answers(q)) if a["correct"])]
            for q in _multiple_choice(questions)]


def first_streak(letters: list[str]) -> int | None:
    """Index of the first of three consecutive equal letters, or None."""
    return next((i for i in range(len(letters) - 2) if len(set(letters[i:i + 3])) == 1), None)


@pytest.mark.parametrize("extreme", [max, min], ids=["longest", "shortest"])
@pytest.mark.parametrize("bank", BANKS, ids=lambda p: p.stem)
def test_the_right_option_is_the_longest_or_the_shortest_in_at_most_half_of_a_banks_questions(bank, extreme):
    """"Pick the longest" and "pick the shortest" must each be no better than a coin for half the questions."""
    questions = json.loads(bank.read_text())
    cued, total = longest_right(questions, extreme), len(_multiple_choice(questions))
    assert 2 * len(cued) <= total, f"{bank.stem}: the right option is the {extreme.__name__} in {len(cued)} of {total}: {cued}"


@pytest.mark.parametrize("bank", BANKS, ids=lambda p: p.stem)
def test_no_three_questions_in_a_row_have_the_right_option_at_one_letter(bank):
    questions = json.loads(bank.read_text())
    letters = shown_letters(questions)
    i = first_streak(letters)
    assert i is None, (f"{bank.stem}: {[q['id'] for q in _multiple_choice(questions)[i:i + 3]]} are all {letters[i]}"
                       f" (shown: {''.join(letters)})")


def _question(text: str, right: str, *wrong: str) -> dict:
    return {"id": text, "question": text, "type": "multiple_choice", "why": "-",
            "answers": [{"answer": right, "correct": True, "feedback": "-"}]
            + [{"answer": w, "correct": False, "feedback": "-"} for w in wrong]}


def test_the_counts_read_hand_made_banks_right():
    """Oracle: banks built here, whose longest options are known by construction, and questions picked because the
    shuffle puts their right option first (the letter is its place in the list every rendering prints)."""
    bank = [_question("a", "a long right answer", "short", "brief"),
            _question("b", "twelve chars", "twelve chars"),  # a tie
            {"id": "n", "question": "n", "type": "numeric", "answers": [], "why": "-"},
            _question("c", "ok", "a longer wrong option")]
    assert longest_right(bank) == ["a"] and longest_right(bank, min) == ["c"]
    assert first_streak(list("ABAB")) is None and first_streak(list("ABBBA")) == 1 and first_streak(list("AB")) is None
    # three questions whose shuffle prints the right option first: their letters must be A, A, A
    first = [q for q in (_question(f"q{n}", "right", "wrong 1", "wrong 2") for n in range(100))
             if quiz.shuffled_answers(q)[0]["answer"] == "right"][:3]
    assert len(first) == 3 and shown_letters(first) == ["A"] * 3 and first_streak(shown_letters(first)) == 0
