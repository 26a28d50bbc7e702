"""``python -m minivllm.bench ab``: two git versions of one benchmark, interleaved, compared by path.

The oracle is a stand-in repository whose "benchmark" reports a number written in its own tree: each version's
number is known, so the tool must report exactly those medians, in the ABBA order, and leave no worktree behind.
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minivllm.bench import ab

FAKE_MAIN = '''
import importlib, sys
importlib.import_module("minivllm.bench." + sys.argv[1]).main(sys.argv[2:])
'''

# a stand-in "offline" benchmark: reports the tree's value.txt, and SCRIPT, the version of this file itself
FAKE_BENCH = '''
import json, os, sys, time
from pathlib import Path
SCRIPT = {script}

def main(argv):
    here = Path(__file__).resolve().parents[2]
    value = float((here / "value.txt").read_text())
    with open(os.environ["AB_TEST_LOG"], "a") as fh:
        fh.write(f"{{value}}\\n")
    time.sleep(float(os.environ.get("AB_TEST_SLEEP", "0")))  # a run still in flight when ab is stopped
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


def test_an_untracked_module_in_the_head_counts_as_an_uncommitted_change(repo):
    """The head runs the checkout as it is, so a new module not yet added to git is part of what it measured;
    the result still said ``uncommitted_changes: false`` and named the bare commit.  An untracked file that is
    not code (a result file) does not count."""
    root, _ = repo
    (root / "results.json").write_text("{}")
    clean = ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"))
    assert clean["head"]["uncommitted_changes"] is False
    (root / "minivllm" / "bench" / "helper.py").write_text("FACTOR = 2\n")
    both = ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"))
    assert both["head"]["uncommitted_changes"] is True


def test_a_failing_run_is_reported_with_its_stderr_and_cleans_up(repo):
    root, _ = repo
    (root / "value.txt").write_text("-1")
    with pytest.raises(RuntimeError, match="planted failure: negative value"):
        ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"))
    assert _worktrees(root) == 1


def test_options_newer_than_the_base_point_to_same_bench(repo):
    """``ab --base HEAD~3 -- fairness --sections shared_prefix ...`` failed with the old script's "unrecognized
    arguments" and no word of ``--same-bench``, the option made for it.  Oracle: the advice is followed in the
    same test and works (the base engine then reports its own value through the new script)."""
    root, _ = repo
    (root / "minivllm" / "bench" / "offline.py").write_text(
        "import argparse\ndef main(argv):\n    argparse.ArgumentParser().parse_args(argv)\n")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "a script with no options")
    (root / "minivllm" / "bench" / "offline.py").write_text(FAKE_BENCH.format(script=4))  # the option arrives
    with pytest.raises(RuntimeError, match="add --same-bench"):
        ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"))
    both = ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"),
                  same_bench=True)
    assert {r["path"]: (r["base"], r["head"]) for r in both["rows"]}["script"] == (4.0, 4.0)
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


def test_sigterm_mid_run_leaves_no_worktree_behind(repo, tmp_path):
    """``timeout 180 python -m minivllm.bench ab ...`` (or a cancelled CI job) stops ab with SIGTERM, which ended
    Python without running ``run``'s cleanup: the base worktree stayed in ``git worktree list`` and its temporary
    folder on disk.  Oracle: git's own worktree list and the temporary folder, after a SIGTERM sent while the
    base run is sleeping inside the stand-in benchmark."""
    root, log = repo
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    project = Path(ab.__file__).resolve().parents[2]  # the real minivllm, for ab itself
    code = ("import sys; from pathlib import Path; from minivllm.bench import ab; "
            f"ab.repo_root = lambda start=None: Path({str(root)!r}); "
            "sys.exit(ab.main(['--base', 'HEAD', '--repeats', '1', '--', 'offline', '--out', '{out}']))")
    env = dict(os.environ, PYTHONPATH=str(project), TMPDIR=str(scratch), AB_TEST_SLEEP="60")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text()) and time.monotonic() < deadline:  # the base run has begun
            time.sleep(0.05)
        assert log.exists() and _worktrees(root) == 2, proc.stderr.read() if proc.poll() is not None else "no run"
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _worktrees(root) == 1, _git(root, "worktree", "list")
    assert list(scratch.iterdir()) == []
    assert status == 128 + signal.SIGTERM  # the shell's status for a SIGTERM, as before


def test_outside_a_git_checkout_the_error_says_why(tmp_path):
    with pytest.raises(ValueError, match="not in a git checkout"):
        ab.repo_root(tmp_path)


def test_compare_medians_over_runs_and_drops_paths_a_run_lacks():
    # skewed on purpose: a mean (4 and 40) is not the median (2 and 20), so taking one for the other fails here
    base = [{"t": 1.0, "steps": [5]}, {"t": 9.0}, {"t": 2.0, "steps": [5]}]
    head = [{"t": 10.0}, {"t": 90.0}, {"t": 20.0}]
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


def test_a_metric_glob_that_matches_nothing_says_so_and_names_real_paths(repo, capsys, monkeypatch):
    """``--metric 'per_step_us*'`` (the help's own example) printed a bare header after every run, which reads
    as "no numbers differ".  Oracle: the stand-in benchmark's document, whose paths are known."""
    root, _ = repo
    monkeypatch.setattr(ab, "repo_root", lambda start=None: root)
    assert ab.main(["--base", "HEAD~1", "--repeats", "1", "--metric", "per_step_us*", "--", "offline", "--out",
                    "{out}"]) == 0
    err = capsys.readouterr().err
    assert "no result path matches --metric per_step_us*" in err
    assert "rows.0.p50" in err and "value" in err


def test_the_help_example_glob_names_paths_its_benchmark_writes(tmp_path, monkeypatch):
    """The help's example must show rows when run; the oracle is the example benchmark's own result file,
    written by running that command (host_overhead on the simulated executor, a few seconds)."""
    cut = ab.EXAMPLE.index("--")
    globs = [ab.EXAMPLE[i + 1] for i, a in enumerate(ab.EXAMPLE[:cut]) if a == "--metric"]
    command = [a.replace(ab.OUT_PLACEHOLDER, str(tmp_path / "r.json")) for a in ab.EXAMPLE[cut + 1:]]
    project = Path(ab.__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "minivllm.bench", *command], cwd=project, capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr
    paths = [key for key, _ in ab.numeric_leaves(json.loads((tmp_path / "r.json").read_text()))]
    assert globs and all(any(fnmatch.fnmatchcase(p, g) for p in paths) for g in globs), (globs, paths[:10])


def test_bench_entry_point_lists_ab():
    done = subprocess.run([sys.executable, "-m", "minivllm.bench", "--help"], capture_output=True, text=True)
    assert "ab --base REV" in done.stdout


def test_same_bench_measures_a_benchmark_newer_than_the_base(repo):
    """A new kernel often comes with its own new benchmark, which the base version has never heard of: its
    ``python -m minivllm.bench NAME`` refused the name ("unknown benchmark", exit 2) even with the script copied in,
    since the dispatcher looks the name up in ``minivllm/bench/__init__.py``'s table.  With ``--same-bench`` the
    table comes along when the base lacks the module.  Oracle: the stand-in dispatcher refuses names its table
    does not list, as the real one does; the base must then report its own tree's value through the new script."""
    root, log = repo
    main = root / "minivllm" / "bench" / "__main__.py"
    main.write_text('import importlib, sys\nimport minivllm.bench as b\n'
                    'if sys.argv[1] not in b.NAMES:\n    sys.exit(2)\n' + FAKE_MAIN)
    names = root / "minivllm" / "bench" / "__init__.py"
    names.write_text('NAMES = {"offline": "minivllm.bench.offline"}\n')
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "a dispatcher with a table")
    (root / "minivllm" / "bench" / "cpu_decode.py").write_text(FAKE_BENCH.format(script=5))  # new, uncommitted
    names.write_text('NAMES = {"offline": "minivllm.bench.offline", "cpu_decode": "minivllm.bench.cpu_decode"}\n')
    doc = ab.run(["cpu_decode", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"),
                 same_bench=True)
    rows = {r["path"]: (r["base"], r["head"]) for r in doc["rows"]}
    assert rows["script"] == (5.0, 5.0) and rows["value"] == (2.0, 2.0)
    assert _worktrees(root) == 1


def test_same_bench_leaves_a_versions_own_table_of_names_when_it_has_the_benchmark(repo):
    """``--same-bench`` copies the checkout's table of names into a version only where that version lacks the
    benchmark (the test above); a version that has it keeps its own ``minivllm/bench/__init__.py``, as the module
    docstring promises ("only that one file is copied").  Copying the table every time went unnoticed: the stand-in
    tables were the same on both sides.  Oracle: a table that differs between the versions, read by the benchmark
    itself -- each side must report its own."""
    root, _ = repo
    names = root / "minivllm" / "bench" / "__init__.py"
    names.write_text("TABLE = 1\n")
    (root / "minivllm" / "bench" / "offline.py").write_text(
        FAKE_BENCH.format(script='__import__("minivllm.bench", fromlist=["TABLE"]).TABLE'))
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "a table the benchmark reads")
    names.write_text("TABLE = 2\n")  # the checkout's own table, uncommitted
    doc = ab.run(["offline", "--out", "{out}"], base="HEAD", repeats=1, repo=root, log=open("/dev/null", "w"),
                 same_bench=True)
    rows = {r["path"]: (r["base"], r["head"]) for r in doc["rows"]}
    assert rows["script"] == (1.0, 2.0)
    assert _worktrees(root) == 1


def test_same_bench_brings_the_flag_helpers_the_script_imports(repo):
    """A benchmark script imports its flag helpers from ``minivllm/argtypes.py`` (refuse_unread, brief_path: added
    with the refusals of stop 72); copied alone into an older tree, the script failed to import there -- every
    touched benchmark, against every base before it.  ``--same-bench`` copies the helpers too.  Oracle: the base's
    run, whose tree has no such helper, measures its own value with the checkout's script."""
    root, _ = repo
    (root / "minivllm" / "argtypes.py").write_text("def helper():\n    return 5.0\n")  # uncommitted, as new code is
    bench = root / "minivllm" / "bench" / "offline.py"
    bench.write_text("from minivllm.argtypes import helper\n" + FAKE_BENCH.format(script="helper()"))
    doc = ab.run(["offline", "--out", "{out}"], base="HEAD~1", repeats=1, repo=root, log=open("/dev/null", "w"),
                 same_bench=True)
    rows = {r["path"]: (r["base"], r["head"]) for r in doc["rows"]}
    assert rows["script"] == (5.0, 5.0) and rows["value"] == (1.0, 2.0)
    assert _worktrees(root) == 1
