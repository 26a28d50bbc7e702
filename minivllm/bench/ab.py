"""``python -m minivllm.bench ab --base REV -- NAME ARGS... --out {out}`` — one benchmark, two versions, one run.

Why this exists: nearly every change this project measures is a before/after claim ("host cost per step
1,367 -> 446 us", "Jain 0.860 -> 0.965"), and a claim like that is only as good as the pairing of its two
numbers.  Two numbers taken an hour apart on a shared 2-core machine differ by the load between them as much
as by the change.  This tool makes the pairing mechanical:

* the *base* version is checked out with ``git worktree add`` into a temporary directory (the checkout you
  run from is not touched), and the *head* is the checkout itself, uncommitted edits included (or a second
  worktree with ``--head REV``);
* each version runs the same benchmark command in its own process, its own tree first on ``PYTHONPATH``, so
  each measures its own code and nothing is shared but the machine;
* the runs alternate base, head, head, base, base, head, ... ("ABBA"): a load that rises or falls steadily
  through the session lands on both sides equally, where "all of A, then all of B" would hand it to one side;
* every numeric value in the two sides' result JSONs is paired by its path in the document, and the table
  shows the median per side and head/base.

The command after ``--`` is any ``python -m minivllm.bench`` command; ``{out}`` in it is replaced with each
run's own result path (the benchmarks disagree on the flag's name, ``--out`` or ``--json``, so the command
says it).  The worktree is removed afterwards, whatever happened.

``--same-bench`` copies this checkout's version of the benchmark's own module into each worktree first, so
both sides are measured by one script.  Why: a measurement often arrives with or after the change it
measures (a new option, a new workload); the old engine is then measured by the new script, which is what
this project had done by hand ("run on the commit before, with this benchmark script copied in").  Only
that one file is copied, with the flag helpers every script parses its command line with
(``minivllm/argtypes.py``: argument types, the refusal of flags a mode does not read, how a path is quoted; no
engine code) -- and, for a benchmark the version does not have yet (a new kernel's own benchmark),
the table of names in ``minivllm/bench/__init__.py``, so that ``python -m minivllm.bench NAME`` finds it there; if
the script needs engine code a version lacks, that run fails and says so.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from minivllm.argtypes import nonnegative_int, output_file, positive_float, positive_int

OUT_PLACEHOLDER = "{out}"

# The example ``--help`` shows, kept as one argv so a test can run it and check that its glob names real paths
# (the help's first example, ``--metric 'per_step_us*'``, matched nothing host_overhead writes).
EXAMPLE = ["--base", "HEAD~1", "--metric", "rows.*.host_cpu_us_median_*", "--",
           "host_overhead", "--seqs", "64", "--out", OUT_PLACEHOLDER]


@dataclass(frozen=True)
class Row:
    """One value both sides reported: its path in the result document and the median per side."""

    key: str
    base: float
    head: float

    @property
    def ratio(self) -> float | None:
        """head / base; ``None`` where base is 0 (no ratio means anything there)."""
        return None if self.base == 0 else self.head / self.base


def numeric_leaves(doc: Any, prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every number in ``doc`` with its dotted path (list items by index): ``{"a": [1, {"b": 2}]}`` gives
    ``("a.0", 1.0)`` and ``("a.1.b", 2.0)``.  Booleans are not numbers here (``True`` is an ``int`` to
    Python, but "1.0x" of a flag means nothing)."""
    if isinstance(doc, bool):
        return
    if isinstance(doc, (int, float)):
        yield prefix, float(doc)
    elif isinstance(doc, dict):
        for k, v in doc.items():
            yield from numeric_leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from numeric_leaves(v, f"{prefix}.{i}" if prefix else str(i))


# What a result file always carries that is not a measurement of the code: the machine and the run's clock.
NOT_MEASURED = ("machine.*", "host.*", "date_utc", "seconds")


def compare(base_docs: list[dict], head_docs: list[dict], patterns: list[str] | None = None) -> list[Row]:
    """Pair the two sides' numbers by path; the median over each side's runs.

    A path that one run lacks (a result whose shape depends on the run: a list of steps, say) is left out,
    so every median is over the same runs.  ``patterns`` (shell globs on the dotted path) keep only the paths
    asked for; without them every path is kept but the machine facts (:data:`NOT_MEASURED`).
    """
    if not base_docs or not head_docs:
        raise ValueError("compare needs at least one result per side")
    sides = [[dict(numeric_leaves(d)) for d in docs] for docs in (base_docs, head_docs)]
    common = set(sides[0][0])
    for leaves in sides[0][1:] + sides[1]:
        common &= set(leaves)
    rows = []
    for key in common:
        if patterns and not any(fnmatch.fnmatchcase(key, p) for p in patterns):
            continue
        if not patterns and any(fnmatch.fnmatchcase(key, p) for p in NOT_MEASURED):
            continue
        base = statistics.median(leaves[key] for leaves in sides[0])
        head = statistics.median(leaves[key] for leaves in sides[1])
        rows.append(Row(key, base, head))
    rows.sort(key=lambda r: _natural(r.key))
    return rows


def _natural(key: str) -> list:
    """Sort ``steps.10`` after ``steps.9``: numeric path parts compare as numbers."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


def order(repeats: int) -> list[str]:
    """The run order: ``base head head base base head ...`` (``repeats`` runs per side).

    Why ABBA and not ABAB: under a load that grows by the same amount each run, ABAB gives head a little more
    of it in every pair; in each ABBA quartet both sides' runs sit at the same mean position.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runs: list[str] = []
    for i in range(repeats):
        runs += ["base", "head"] if i % 2 == 0 else ["head", "base"]
    return runs


def format_table(rows: list[Row], limit: int | None = 60) -> str:
    """The comparison as text: one line per path, the medians and head/base."""
    width = max([len(r.key) for r in rows] + [4])
    lines = [f"{'path':<{width}}  {'base':>14}  {'head':>14}  head/base"]
    for r in rows[:limit]:
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        lines.append(f"{r.key:<{width}}  {r.base:>14.6g}  {r.head:>14.6g}  {ratio:>9}")
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more paths (name the ones you want with --metric, or see --out)")
    return "\n".join(lines)


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"git {' '.join(args)}: {done.stderr.strip() or 'failed'}")
    return done.stdout.strip()


def repo_root(start: Path | None = None) -> Path:
    """The git checkout this package runs from: the base is checked out of its history."""
    here = start or Path(__file__).resolve().parent
    try:
        return Path(_git(here, "rev-parse", "--show-toplevel"))
    except (ValueError, OSError) as exc:
        raise ValueError(f"ab compares two versions from git history, and {here} is not in a git checkout "
                         f"(an installed wheel has no history): {exc}") from None


NAMES_FILE = Path("minivllm", "bench", "__init__.py")  # where the benchmarks' names live (NAMES)
ARGTYPES = Path("minivllm", "argtypes.py")  # the flag helpers, copied with a benchmark by --same-bench


def bench_module_path(name: str) -> Path:
    """The source file of benchmark ``name``, relative to a checkout's root."""
    from minivllm.bench import NAMES

    if name not in NAMES:
        raise ValueError(f"unknown benchmark {name!r}; choose from {', '.join(NAMES)}")
    return Path(*NAMES[name].split(".")).with_suffix(".py")


def run(command: list[str], base: str, head: str | None = None, repeats: int = 2, patterns=None,
        repo: Path | None = None, log=sys.stderr, timeout_s: float | None = None,
        same_bench: bool = False) -> dict:
    """Run ``command`` (``NAME ARGS...`` of ``python -m minivllm.bench``, with ``{out}``) on both versions.

    Returns the document :func:`main` writes: both sides' revisions, the run order with each run's seconds,
    every run's result, and the compared rows.
    """
    if not command or not any(OUT_PLACEHOLDER in arg for arg in command):
        raise ValueError(f"the benchmark command must say where its result goes with {OUT_PLACEHOLDER} "
                         f"(e.g. `-- host_overhead --seqs 8 --out {OUT_PLACEHOLDER}`), got {command!r}")
    if command[0] == "ab":
        raise ValueError("ab cannot compare itself")
    if same_bench:
        bench_module_path(command[0])  # an unknown name is refused before anything is checked out
    runs = order(repeats)  # checks repeats before anything is checked out
    repo = repo or repo_root()
    base_sha = _git(repo, "rev-parse", "--verify", f"{base}^{{commit}}")
    head_sha = _git(repo, "rev-parse", "--verify", f"{head}^{{commit}}") if head else _git(repo, "rev-parse", "HEAD")
    # Untracked Python files count: a new module the head imports is part of what it measures, while other
    # untracked files (results, notebooks' outputs) are not code.
    dirty = head is None and bool(_git(repo, "status", "--porcelain", "--untracked-files=no")
                                  or _git(repo, "ls-files", "--others", "--exclude-standard", "--", "*.py"))
    scratch = Path(tempfile.mkdtemp(prefix="minivllm-ab-"))
    trees = {"base": scratch / "base", "head": repo if head is None else scratch / "head"}
    added: list[Path] = []
    try:
        for side, sha in (("base", base_sha), ("head", head_sha if head else None)):
            if sha is not None:
                added.append(trees[side])  # first: a worktree interrupted while it is being added is removed too
                _git(repo, "worktree", "add", "--detach", str(trees[side]), sha)
        if same_bench:
            module = bench_module_path(command[0])
            for tree in added:
                if not (tree / module).exists():  # a benchmark newer than that version: register it there too
                    shutil.copyfile(repo / NAMES_FILE, tree / NAMES_FILE)
                shutil.copyfile(repo / module, tree / module)
                if (repo / ARGTYPES).exists():  # the flag helpers every script imports, as new as the script
                    shutil.copyfile(repo / ARGTYPES, tree / ARGTYPES)
        results: dict[str, list[dict]] = {"base": [], "head": []}
        timeline = []
        for i, side in enumerate(runs):
            out = scratch / f"run{i}_{side}.json"
            argv = [arg.replace(OUT_PLACEHOLDER, str(out)) for arg in command]
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(trees[side])] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
            print(f"ab: run {i + 1}/{len(runs)}: {side} ({'working tree' if side == 'head' and head is None else (base_sha if side == 'base' else head_sha)[:10]})",
                  file=log, flush=True)
            t0 = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "minivllm.bench", *argv], cwd=trees[side], env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
            seconds = time.perf_counter() - t0
            if done.returncode != 0:
                tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
                if done.returncode == 2 and not same_bench and side == "base":  # argparse's status: a usage error
                    # The usual cause: the options (a new section, a new flag) arrived after the base version.
                    tail += ("\n(the base version's benchmark refused this command line; to measure the base "
                             "engine with this checkout's benchmark script, add --same-bench)")
                raise RuntimeError(f"the {side} run ({' '.join(argv)}) exited with {done.returncode}:\n{tail}")
            try:
                results[side].append(json.loads(out.read_text(encoding="utf-8")))
            except (OSError, json.JSONDecodeError) as exc:
                raise RuntimeError(f"the {side} run wrote no readable result at {OUT_PLACEHOLDER} ({out}): {exc}") from None
            timeline.append({"side": side, "seconds": round(seconds, 3)})
        rows = compare(results["base"], results["head"], patterns)
    finally:
        for tree in added:
            subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(tree)], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    return {
        "benchmark": "ab",
        "compared": command[0],
        "bench_command": "python -m minivllm.bench " + " ".join(command),
        "base": {"rev": base, "sha": base_sha},
        "head": {"rev": head or "working tree", "sha": head_sha, "uncommitted_changes": dirty},
        "same_bench": str(bench_module_path(command[0])) if same_bench else None,  # copied from the checkout
        "order": timeline,
        "rows": [{"path": r.key, "base": r.base, "head": r.head, "head_over_base": r.ratio} for r in rows],
        "runs": results,
    }


def _terminated(signum, frame) -> None:
    """SIGTERM as ``SystemExit``, so ``finally`` blocks run (the shell's status for it: 128 + the signal)."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        cut = argv.index("--")
        own, command = argv[:cut], argv[cut + 1:]
    else:
        own, command = argv, []
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench ab",
                                 description=__doc__.split("\n\n")[0],
                                 epilog="example: python -m minivllm.bench ab "
                                        + " ".join(f"'{a}'" if "*" in a else a for a in EXAMPLE))
    ap.add_argument("--base", required=True, help="the version to compare against (any git revision)")
    ap.add_argument("--head", default=None,
                    help="the other version (default: this checkout as it is, uncommitted edits included)")
    ap.add_argument("--repeats", type=positive_int, default=2, help="runs per version, in ABBA order (default 2)")
    ap.add_argument("--metric", action="append", default=None, metavar="GLOB",
                    help="show only result paths matching this glob (repeatable), e.g. 'rows.*.host_cpu_*'")
    ap.add_argument("--limit", type=nonnegative_int, default=60, help="rows printed (all are written with --out)")
    ap.add_argument("--timeout", type=positive_float, default=None, help="seconds allowed per run")
    ap.add_argument("--same-bench", action="store_true",
                    help="run this checkout's version of the benchmark's module on both sides (a new option "
                         "measured on an old engine)")
    ap.add_argument("--out", type=output_file, default=None,
                    help="write both sides' results and the comparison here")
    args = ap.parse_args(own)
    if not command:
        ap.error("put the benchmark command after --, with {out} where its result file goes")
    # A SIGTERM (``timeout``, ``kill``, a cancelled CI job) ends Python without unwinding, so ``run``'s cleanup
    # never ran and the base worktree stayed registered in the user's repository.  As an exception it unwinds
    # like Ctrl-C: the benchmark in flight is killed and the worktrees are removed.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        doc = run(command, args.base, args.head, args.repeats, args.metric, timeout_s=args.timeout,
                  same_bench=args.same_bench)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # a run failed: its own error, not a traceback of ours
        print(f"python -m minivllm.bench ab: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    rows = [Row(r["path"], r["base"], r["head"]) for r in doc["rows"]]
    print(f"base {doc['base']['sha'][:10]} ({args.base})  vs  head {doc['head']['sha'][:10]}"
          f"{' + uncommitted changes' if doc['head']['uncommitted_changes'] else ''}"
          f" ({doc['head']['rev']}); {args.repeats} runs each, order {' '.join(r['side'] for r in doc['order'])}")
    print(format_table(rows, args.limit))
    if args.metric and not rows:
        # An empty table after minutes of runs reads like "nothing changed"; a glob that names no path is a typo.
        paths = sorted({key for docs in doc["runs"].values() for d in docs for key, _ in numeric_leaves(d)
                        if not any(fnmatch.fnmatchcase(key, p) for p in NOT_MEASURED)}, key=_natural)
        print(f"python -m minivllm.bench ab: no result path matches --metric {' '.join(args.metric)}; "
              f"the paths look like: {', '.join(paths[:8])}{', ...' if len(paths) > 8 else ''}", file=sys.stderr)
    if args.out:
        from minivllm.bench.results import write_result

        write_result(args.out, doc, "python -m minivllm.bench ab", argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
