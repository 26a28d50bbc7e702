"""Running a lab checker the way a test of the checker needs it: quietly, then asserting its verdict.

A checker prints a line per case for the learner; a test wants the result and, where it failed, which case and
whether the hint names the mistake.  One definition for every checker test.
"""

from __future__ import annotations

import contextlib
import io


def refuses(check, wrong, case: str, *hint_words: str) -> None:
    """``check(wrong)`` fails, first at ``case``, and what it printed names each of ``hint_words``."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        result = check(wrong)
    text = out.getvalue()
    assert not result and result.failed_case == case, text
    for word in hint_words:
        assert word in text, text


def accepts(check, *right) -> None:
    """``check`` passes every one of ``right``."""
    for fn in right:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            result = check(fn)
        assert result, out.getvalue()
