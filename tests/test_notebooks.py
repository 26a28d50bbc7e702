"""Execute the lab notebooks: ``solutions/`` under strict nbval, ``labs/`` end to end (lax).

Each notebook runs in its own ``pytest --nbval`` subprocess, so a kernel crash
or a hung cell fails one test with nbval's own report instead of taking the
suite down.  Strict mode compares every stored output except cells tagged
``nbval-ignore-output`` / ``# NBVAL_IGNORE_OUTPUT`` (wall-clock timings, real
model text, the HTML quiz); ``tests/nbval_sanitize.cfg`` normalises memory
addresses and widget ids.  Lax mode only requires that every cell runs: the
student notebooks' stubs print "not implemented yet" and fall back to the
engine, so they run top to bottom too.

A student notebook that ``tests/test_browser.py`` opens in JupyterLab is not
run here as well when that browser test runs in the same session: its *Run
All* already runs every cell of the same file and fails on any traceback.
Without Chromium (a laptop) the browser test skips and the lax run is here.
Every notebook's time is held to the course's budget in both modes.

Marked ``slow``: the notebooks load the bundled model (lab 1 and 2).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SANITIZE = ROOT / "tests" / "nbval_sanitize.cfg"
CELL_TIMEOUT_S = 600
BUDGET_S = 180  # the course promise: every notebook in under 3 minutes on a CPU laptop

pytest.importorskip("nbval")


def _run_nbval(path: Path, strict: bool) -> tuple[subprocess.CompletedProcess, float]:
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval-current-env",
            f"--nbval-cell-timeout={CELL_TIMEOUT_S}", "--rootdir", str(ROOT), "--durations=4"]
    args += ["--nbval", "--nbval-sanitize-with", str(SANITIZE)] if strict else ["--nbval-lax"]
    env = dict(os.environ, PYTHONHASHSEED="0")
    t0 = time.time()
    proc = subprocess.run(args + [str(path)], cwd=ROOT, env=env, capture_output=True, text=True)
    return proc, time.time() - t0


def _report(proc: subprocess.CompletedProcess) -> str:
    return (proc.stdout[-6000:] + "\n" + proc.stderr[-2000:]).strip()


def _slowest_cells(stdout: str) -> str:
    """nbval's ``--durations`` lines ("12.3s call  lab.ipynb::Cell 5") as "Cell 5 12.3 s, ..."."""
    found = re.findall(r"^([0-9.]+)s call\s+\S+::(Cell \d+)$", stdout, re.MULTILINE)
    return ", ".join(f"{cell} {float(sec):.0f} s" for sec, cell in found)


def _assert_ran_in_budget(path: Path, proc: subprocess.CompletedProcess, elapsed: float) -> None:
    """nbval passed, and within the course's budget (with room for a shared CI machine).

    Between the budget and three times it the test passes with a warning that names the slowest cells, so a
    CI log says which cell a loaded machine slowed down instead of only that the notebook was slow."""
    print(f"{path.name}: {elapsed:.0f} s")
    assert proc.returncode == 0, _report(proc)
    if elapsed <= BUDGET_S:
        return
    slowest = _slowest_cells(proc.stdout)
    assert elapsed < 3 * BUDGET_S, (f"{path.name} took {elapsed:.0f} s (budget {BUDGET_S} s on an idle CPU); "
                                    f"slowest cells: {slowest}")
    warnings.warn(f"{path.name} took {elapsed:.0f} s, over the course's {BUDGET_S} s (a loaded machine?); "
                  f"slowest cells: {slowest}", stacklevel=2)


def _run_by_the_browser_test(session: pytest.Session, path: Path) -> bool:
    """Whether this session will also *Run All* ``path`` in JupyterLab (collected, selected, not skipped)."""
    for item in session.items:
        if item.originalname != "test_widgets_and_quiz_work_in_jupyterlab":
            continue
        if item.callspec.params["path"].resolve() != path.resolve():
            continue
        return not any(mark.args and mark.args[0] for mark in item.iter_markers("skipif"))
    return False


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted((ROOT / "solutions").glob("lab*.ipynb")), ids=lambda p: p.stem)
def test_solution_notebook_strict(path):
    _assert_ran_in_budget(path, *_run_nbval(path, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("path", sorted((ROOT / "labs").glob("lab*.ipynb")), ids=lambda p: p.stem)
def test_student_notebook_runs(path, request):
    if _run_by_the_browser_test(request.session, path):
        pytest.skip("tests/test_browser.py runs this student notebook top to bottom in JupyterLab this session")
    _assert_ran_in_budget(path, *_run_nbval(path, strict=False))
