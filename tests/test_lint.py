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



def test_the_mutation_pass_puts_the_file_back_when_terminated(tmp_path):
    """``tools/mutation_pass.py`` promises the planted file is restored whatever happens; a SIGTERM (``timeout``,
    a cancelled CI job) used to end it without running the restore, leaving the bug in the tree.  A child runs
    the pass on a scratch copy (its ROOT, one row, the test run replaced by a sleep), is terminated while the
    bug is planted, and the file must read as it did before."""
    import signal

    child = f"""
import importlib.util, pathlib, subprocess, sys, time
spec = importlib.util.spec_from_file_location("mutation_pass", {str(ROOT / "tools" / "mutation_pass.py")!r})
mp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mp)
mp.ROOT = pathlib.Path({str(tmp_path)!r})
mp.MUTANTS = [("planted", "f.py", "good", "bad", "")]
def tests_that_hang(*args, **kwargs):
    print("planted", flush=True)
    time.sleep(60)
subprocess.run = tests_that_hang
sys.argv = ["mutation_pass", "0"]
mp.main()
"""
    target = tmp_path / "f.py"
    target.write_text("x = 'good'\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "planted"
        assert target.read_text() == "x = 'bad'\n"  # the bug is in the tree while the tests run
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert target.read_text() == "x = 'good'\n"

def test_only_kv_changes_block_refcounts():
    """One owner per resource: block refcounts, the free list and the pool itself change only in ``minivllm/kv/``
    (the KV cache manager and the prefix caches it drives).  Everyone else asks the manager, so a leaked or
    double-freed block has one module to look in.  The lab 2 checker is the exception: it grades the learner's
    own pool by calling its methods.  Read from the source (AST): a call of a pool mutator outside those places."""
    import ast

    mutators = {"incref", "decref", "free_all", "allocate_many", "copy_on_write", "replace_pool"}
    allowed = (ROOT / "minivllm" / "kv", ROOT / "minivllm" / "labs" / "check_lab02.py")
    found = []
    for path in sorted((ROOT / "minivllm").rglob("*.py")):
        if any(path == a or path.is_relative_to(a) for a in allowed):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                # ``allocate()`` with no argument is the pool's; the scheduler's ``allocate(batch)`` is another layer
                if name in mutators or (name == "allocate" and not node.args and not node.keywords):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{name}()")
    assert not found, found
