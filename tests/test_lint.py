"""The code is held to the rule set in pyproject.toml ([tool.ruff.lint]: pyflakes and pycodestyle's errors).

Run as a test so that CI fails on an unused import or an undefined name the way it fails on a wrong
token: a name that is never defined is a crash waiting in the branch no test reached.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    got = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "minivllm", "tests", "tools"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr


def test_every_row_of_the_mutation_pass_still_applies():
    """``tools/mutation_pass.py`` plants each bug by replacing a piece of text that must occur exactly once; a
    refactor that moves the text would silently turn the row into a no-op, so every row is checked here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_pass", ROOT / "tools" / "mutation_pass.py")
    mp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mp)
    for name, rel, old, new, _ in mp.MUTANTS:
        text = (ROOT / rel).read_text()
        assert text.count(old) == 1 and old != new, name
    assert all((ROOT / t).exists() for t in mp.TESTS)
