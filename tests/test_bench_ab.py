"""``python -m minivllm.bench ab``: two git versions of one benchmark, interleaved, compared by path.

The oracle is a stand-in repository whose "benchmark" reports a number written in its own tree: each version's
number is known, so the tool must report exactly those medians, in the ABBA order, and leave no worktree behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm.bench import ab

FAKE_MAIN = '''
import importlib, sys
importlib.import_module("minivllm.bench." + sys.argv[1]).main(sys.argv[2:])
'''

# a stand-in "offline" benchmark: reports the tree's value.txt, and SCRIPT, the version of this file itself
FAKE_BENCH = '''
import json, os, sys
from pathlib import Path
SCRIPT = {script}

def main(argv):
    here = Path(__file__).resolve().parents[2]
    value = float((here / "value.txt").read_text())
    with open(os.environ["AB_TEST_LOG"], "a") as fh:
        fh.write(f"{{value}}\\n")
    if value < 0:
        print("planted failure: negative value", file=sys.stderr)
        sys.exit(3)
    out = argv[argv.index("--out") + 1]
    Path(out).write_text(json.dumps({{"machine": {{"cpus": 99}}, "value": value, "flag": True, "script": SCRIPT,
                                     "rows": [{{"p50": value * 10}}, {{"p50": 0.0}}]}}))
'''


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A repository with two commits (value 1, then 2) and a stand-in ``minivllm.bench`` package."""
    root = tmp_path / "repo"
    (root / "minivllm" / "bench").mkdir(parents=True)
    (root / "minivllm" / "__init__.py").write_text("")
    (root / "minivllm" / "bench" / "__init__.py").write_text("")
    (root / "minivllm" / "bench" / "__main__.py").write_text(FAKE_MAIN)
    _git(tmp_path, "init", "-q", str(root))
    for value in ("1", "2"):
        (root / "value.txt").write_text(value)
        (root / "minivllm" / "bench" / "offline.py").write_text(FAKE_BENCH.format(script=value))
        _git(root, "add", "-A")
        _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", f"value {value}")
    log = tmp_path / "runs.log"
    monkeypatch.setenv("AB_TEST_LOG", str(log))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    return root, log


def _worktrees(root: Path) -> int:
    return _git(root, "worktree", "list").count("\n")


def test_working_tree_against_a_revision_reports_each_versions_numbers_in_abba_order(repo):
    root, log = repo
    (root / "value.txt").write_text("3")  # an uncommitted edit: the head side is the checkout as it is
    doc = ab.run(["offline", "--out", "{out}"], base="HEAD~1", repeats=2, repo=root, log=open("/dev/null", "w"))
    assert log.read_text().split() == ["1.0", "3.0", "3.0", "1.0"]  # base head head base
    rows = {r["path"]: r for r in doc["rows"]}
    assert rows["value"]["base"] == 1.0 and rows["value"]["head"] == 3.0 and rows["value"]["head_over_base"] == 3.0
    assert rows["rows.0.p50"]["head_over_base"] == 3.0
    assert rows["rows.1.p50"]["head_over_base"] is None  # base 0: no ratio
    assert "machine.cpus" not in rows and "flag" not in rows  # machine facts and booleans are not measurements
    assert doc["head"]["uncommitted_changes"] is True
    assert doc["base"]["sha"] == _git(root, "rev-parse", "HEAD~1").strip()
    assert [r["side"] for r in doc["order"]] == ["base", "head", "head", "base"]
    assert _worktrees(root) == 1  # the base's worktree is gone


def test_two_revisions_each_get_their_own_worktree(repo):
    root, log = repo
    (root / "value.txt").write_text("7")  # not measured: --head names a revision
    doc = ab.run(["offline", "--out", "{out}"], base="HEAD~1", head="HEAD", repeats=1, repo=root,
                 log=open("/dev/null", "w"), patterns=["value"])
    assert [(r["path"], r["base"], r["head"]) for r in doc["rows"]] == [("value", 1.0, 2.0)]
    assert log.read_text().split() == ["1.0", "2.0"]
    assert doc["head"]["uncommitted_changes"] is False
    assert _worktrees(root) == 1


def test_same_bench_runs_the_checkouts_script_on_both_versions(repo):
    root, _ = repo
    doc = ab.run(["offline", "--out", "{out}"], base="HEAD~1", repeats=1, repo=root, log=open("/dev/null", "w"),
                 same_bench=True)
    rows = {r["path"]: (r["base"], r["head"]) for r in doc["rows"]}
    assert rows["script"] == (2.0, 2.0)  # the base ran the checkout's benchmark module ...
    assert rows["value"] == (1.0, 2.0)  # ... on its own tree
    assert doc["same_bench"] == "minivllm/bench/offline.py"
    plain = ab.run(["offline", "--out", "{out}"], base="HEAD~1", repeats=1, repo=root, log=open("/dev/null", "w"))
    assert {r["path"]: (r["base"], r["head"]) for r in plain["rows"]}["script"] == (1.0, 2.0)
    # two older revisions, both measured by the checkout's script (an uncommitted version 3 of it)
    (root / "minivllm" / "bench" / "offline.py").write_text(FAKE_BENCH.format(script=3))
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "script 3")
    both = ab.run(["offline", "--out", "{out}"], base="HEAD~2", head="HEAD~1", repeats=1, repo=root,
                  log=open("/dev/null", "w"), same_bench=True)
    rows = {r["path"]: (r["base"], r["head"]) for r in both["rows"]}
    assert rows["script"] == (3.0, 3.0) and rows["value"] == (1.0, 2.0)
    assert _worktrees(root) == 1


def test_a_failing_run_is_reported_with_its_stderr_and_cleans_up(repo):
    root, _ = repo
    (root / "value.txt").write_text("-1")
    with pytest.raises(RuntimeError, match="planted failure: negative value"):
        ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"))
    assert _worktrees(root) == 1


def test_a_command_without_the_out_placeholder_is_refused_before_any_checkout(repo):
    root, _ = repo
    with pytest.raises(ValueError, match=r"\{out\}"):
        ab.run(["offline", "--out", "x.json"], base="HEAD", repo=root)
    with pytest.raises(ValueError, match="repeats"):
        ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=0, repo=root)
    with pytest.raises(ValueError, match="unknown revision|bad revision|Needed a single revision"):
        ab.run(["offline", "--out", "{out}"], base="no-such-rev", repo=root)
    assert _worktrees(root) == 1


def test_outside_a_git_checkout_the_error_says_why(tmp_path):
    with pytest.raises(ValueError, match="not in a git checkout"):
        ab.repo_root(tmp_path)


def test_compare_medians_over_runs_and_drops_paths_a_run_lacks():
    base = [{"t": 1.0, "steps": [5]}, {"t": 3.0}, {"t": 2.0, "steps": [5]}]
    head = [{"t": 10.0}, {"t": 30.0}]
    rows = ab.compare(base, head)
    assert [(r.key, r.base, r.head) for r in rows] == [("t", 2.0, 20.0)]  # medians 2 and 20; steps.0 not in every run
    assert rows[0].ratio == 10.0


def test_order_is_abba():
    assert ab.order(3) == ["base", "head", "head", "base", "base", "head"]


def test_numeric_leaves_sorts_paths_naturally():
    doc = {"s": list(range(11)), "b": False}
    rows = ab.compare([doc], [doc])
    assert [r.key for r in rows] == [f"s.{i}" for i in range(11)]


def test_cli_prints_the_table_and_writes_the_document(repo, tmp_path, capsys, monkeypatch):
    root, _ = repo
    monkeypatch.setattr(ab, "repo_root", lambda start=None: root)
    out = tmp_path / "ab.json"
    assert ab.main(["--base", "HEAD~1", "--repeats", "1", "--out", str(out), "--", "offline", "--out", "{out}"]) == 0
    printed = capsys.readouterr().out
    assert "value" in printed and "2.000" in printed
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m minivllm.bench ab --base HEAD~1")
    assert doc["rows"][0]["path"] == "rows.0.p50"


def test_bench_entry_point_lists_ab():
    done = subprocess.run([sys.executable, "-m", "minivllm.bench", "--help"], capture_output=True, text=True)
    assert "ab --base REV" in done.stdout
