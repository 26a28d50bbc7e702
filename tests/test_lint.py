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
