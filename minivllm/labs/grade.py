"""The autograder: ``minivllm grade NOTEBOOK.ipynb [...]`` (or ``python -m minivllm.labs.grade``).

For each student notebook it finds the lab (by the ``exercise:<name>`` cell tags, else by the file
name), runs the code in a fresh Jupyter kernel of the current environment in a temporary folder,
and scores each registered exercise: the checker the learner saw, plus the exercise's hidden
cases (``Exercise.hidden(obj, seed)``: randomized inputs compared with the engine's own
implementation).  Points come from the lab's registration (:mod:`minivllm.labs.registry`).

Design choices, and why:

* **What runs.**  By default the notebook's ``setup`` cells and its exercise cells, in notebook
  order, and nothing else.  The exercises are what is graded; the rest of a lab is lesson and
  measurement (a minute or more per notebook) and, until an exercise passes, it runs on the
  engine's fallbacks anyway.  Running only those cells grades a class in seconds per student,
  and a student's broken experiment cell cannot cost exercise points.  ``--run-all`` executes
  every code cell first (for instructors who also want "runs top to bottom"); the objects are then
  read from the kernel as the whole notebook left them.
* **Where it runs.**  A separate kernel process (nbclient), not this process: a learner's infinite
  loop is interrupted by a per-cell ``--timeout``, a crash (``os._exit``, a segfault) kills only
  the kernel, and either way the exercise gets 0 with a reason instead of a grader traceback.
  The kernel is this interpreter (``sys.executable``), so it grades against the installed engine.
* **Hidden cases.**  Their inputs are drawn from a seed chosen when grading (``--seed``, or
  ``$MINIVLLM_GRADE_SEED``, else random and printed so the run can be repeated); it reaches the
  kernel only after the learner's code has run, and is never written into the notebook.  The
  generators are public code, the instances are not: matching the visible cases case by case
  does not pass.
* **Not a sandbox.**  The learner's code runs with the grader's permissions and could, in
  principle, patch the checkers in its own kernel.  Each result carries a random token the
  kernel learns only when it is asked to grade, so a notebook cannot forge a result file ahead of
  time; run untrusted submissions in a container as with any notebook autograder.

Output: a score table per notebook; ``--csv``/``--json`` write one row per student x exercise
(``-`` for stdout).  A student is the folder holding the notebook when the file keeps the lab's
name (``submissions/alice/lab02_paged_kv_cache.ipynb`` is ``alice``), else the file's stem.
"""

from __future__ import annotations

import argparse
import ast
import csv
import io
import json
import math
import logging
import os
import secrets
import sys
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from minivllm.argtypes import output_file, positive_float
from minivllm.labs.registry import Exercise, Lab, labs

SEED_ENV = "MINIVLLM_GRADE_SEED"
DEFAULT_TIMEOUT_S = 120


@dataclass
class ExerciseGrade:
    """One row of the result: a student's score on one exercise, and why."""

    student: str
    notebook: str
    lab: int | None
    exercise: str
    points: int
    max_points: int
    checker: str  # "passed", "failed", "not implemented", "error" or "-" (no result: it never ran, or its grading
    #               cell timed out or the kernel died before the checker finished)
    hidden: str  # "passed", "failed", "error" (the hidden cases raised), "checker re-run" (the lab gave no
    #              hidden cases), "-" (not reached, or they timed out or killed the kernel: see ``reason``)
    reason: str
    seed: int


# -- reading a notebook ------------------------------------------------------------------------


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def _defines(source: str, name: str) -> bool:
    """Whether ``source`` defines ``name`` at top level (a def, a class or an assignment).

    Why the filtering: ``%`` magics and ``!`` shell lines are IPython, not Python, and would make a
    learner's cell unparseable; a cell that still does not parse is searched as text, so that a syntax
    error elsewhere in the cell does not hide the definition the grader is looking for.
    """
    try:
        tree = ast.parse("\n".join(x for x in source.splitlines() if not x.lstrip().startswith(("%", "!"))))
    except SyntaxError:
        return f"def {name}(" in source or f"class {name}" in source
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def exercise_cells(nb) -> dict[str, str]:
    """``{exercise name: source}`` of the cells tagged ``exercise:<name>``."""
    out = {}
    for cell in nb.cells:
        for tag in _tags(cell):
            if tag.startswith("exercise:"):
                out[tag.split(":", 1)[1]] = cell.source
    return out


def identify_lab(nb, path: Path) -> Lab | None:
    """The registered lab whose exercises the notebook's tags name most; else the one its file is named after."""
    tagged = set(exercise_cells(nb))
    registered = labs()
    best = max(registered, key=lambda lab: len(tagged & {e.name for e in lab.exercises}), default=None)
    if best is not None and tagged & {e.name for e in best.exercises}:
        return best
    for lab in registered:
        if path.stem.startswith(lab.stem) or path.stem.startswith(f"lab{lab.number:02d}"):
            return lab
    return None


def graded_cells(nb, lab: Lab, run_all: bool = False) -> list[tuple[str, str]]:
    """``[(what, source)]`` to run before grading, in notebook order.

    ``what`` is ``"setup"``, ``"exercise:<name>"`` or ``"cell <i>"``.  An exercise whose tag the
    learner lost (a copied cell, say) is found as the last code cell defining its object.  A notebook with no
    cell tagged ``setup`` (a tool that strips cell metadata strips every tag) runs its first code cell as the
    setup, unless that cell is found as an exercise: every lab opens with its setup, and without its imports a
    correct exercise fails its checker.
    """
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if run_all:
        return [(next((t for t in _tags(c) if t.startswith("exercise:") or t == "setup"), f"cell {i}"), c.source)
                for i, c in code]
    chosen: dict[int, str] = {}
    for i, c in code:
        tags = _tags(c)
        if "setup" in tags:
            chosen[i] = "setup"
        for t in tags:
            if t.startswith("exercise:"):
                chosen[i] = t
    found = {w.split(":", 1)[1] for w in chosen.values() if w.startswith("exercise:")}
    for ex in lab.exercises:
        if ex.name not in found:
            hits = [i for i, c in code if _defines(c.source, ex.defines)]
            if hits:
                chosen[hits[-1]] = f"exercise:{ex.name}"
    if code and "setup" not in chosen.values():
        chosen.setdefault(code[0][0], "setup")
    return [(chosen[i], nb.cells[i].source) for i in sorted(chosen)]


def student_name(path: Path) -> str:
    """The folder's name for a notebook that keeps its lab's file name, else the file's stem.

    Kept: the registered stem (``alice/lab02_paged_kv_cache.ipynb``, also Jupyter's
    ``lab02_paged_kv_cache-Copy1``) or the bare number (``alice/lab02.ipynb``): the folder is the
    student.  Not kept (``submissions/lab02_alice.ipynb``): the stem names the student, or every
    notebook handed into one folder would be graded as the same "student".
    """
    stem = path.stem
    keeps = any(stem.startswith(lab.stem) or stem == f"lab{lab.number:02d}" for lab in labs())
    if keeps and path.parent.name:
        return path.parent.name
    return stem


# -- inside the kernel -------------------------------------------------------------------------


def _summary(result) -> dict:
    return {"passed": bool(result), "not_implemented": bool(getattr(result, "not_implemented", False)),
            "failed_case": getattr(result, "failed_case", None), "num_passed": getattr(result, "num_passed", 0),
            "num_cases": getattr(result, "num_cases", 0)}


def run_exercise(ex: Exercise, obj: Any, seed: int, on_checked: Callable[[dict], None] | None = None) -> dict:
    """The checker, then (only if it passed) the hidden cases; output silenced, exceptions caught.

    ``on_checked`` gets the result so far once the checker has passed, before the hidden cases run: the
    grading kernel writes it, so that hidden cases that time out or kill the kernel still leave the checker's
    verdict in the table instead of "-" (never ran).  Runs in the grading kernel; also usable in-process (the
    tests do).
    """
    out: dict = {"checker": None, "hidden": None, "error": None}
    phase = "the checker"
    try:
        with redirect_stdout(io.StringIO()):
            result = ex.check(obj)
        out["checker"] = _summary(result)
        if result:
            if on_checked is not None:
                on_checked(out)
            phase = "the hidden cases"
            with redirect_stdout(io.StringIO()):
                hidden = ex.hidden(obj, seed) if ex.hidden is not None else ex.check(obj)
            out["hidden"] = _summary(hidden) | {"rerun": ex.hidden is None}
    except Exception as exc:  # a checker crash on the learner's object: the exercise fails, grading goes on
        out["error"] = f"{phase} could not run it: {type(exc).__name__}: {exc}"[:300]
    finally:
        try:
            import matplotlib.pyplot as plt

            plt.close("all")
        except Exception:
            pass
    return out


def _kernel_grade(namespace: dict, lab_number: int, exercise: str, seed: int, out_path: str, token: str) -> None:
    """Called by the grading cell inside the kernel: grade ``namespace[defines]`` and write JSON."""
    from minivllm.labs.registry import get_lab

    ex = next(e for e in get_lab(lab_number).exercises if e.name == exercise)

    def write(res: dict) -> None:  # whole or not at all: a kill mid-write leaves the previous result
        partial = Path(out_path + ".partial")
        partial.write_text(json.dumps(res | {"token": token}))
        partial.replace(out_path)

    if ex.defines not in namespace:
        write({"missing": True})
    else:
        write(run_exercise(ex, namespace[ex.defines], seed, on_checked=write))


# -- driving the kernel ------------------------------------------------------------------------


def kernel_manager(tmp: Path):
    """A kernel manager for this interpreter (not whatever ``python3`` kernelspec is installed), importing this
    grader's own ``minivllm``.

    Why the path: the kernel starts in a temporary folder, so it imports whichever ``minivllm`` the interpreter
    has installed.  Run from a checkout that is not the installed one (a second clone or worktree beside an
    editable install, a source tree run with ``python -m``), the grader's checks would run one version of the
    engine and the notebook's cells another -- or fail to import it at all."""
    from jupyter_client import AsyncKernelManager  # nbclient's timeouts need the async client
    from jupyter_client.kernelspec import KernelSpecManager

    import site

    import minivllm

    here = Path(minivllm.__file__).resolve().parent.parent
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "minivllm grader", "language": "python"}
    # An installed (not editable) minivllm lives in site-packages, which the kernel searches anyway; put there on
    # PYTHONPATH, it would come before the standard library.
    if here not in {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}:
        path = os.pathsep.join([str(here), *filter(None, [os.environ.get("PYTHONPATH")])])
        # jupyter_client expands $NAME in a kernel spec's env values; a literal $ in a path is written $$
        spec["env"] = {"PYTHONPATH": path.replace("$", "$$")}
    spec_dir = tmp / "kernels" / "minivllm-grade"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp / "kernels")])
    # ipc: a local socket file in the temporary folder, no TCP port (and no unencrypted-TCP warning)
    return AsyncKernelManager(kernel_name="minivllm-grade", kernel_spec_manager=ksm, transport="ipc",
                              ip=str(tmp / "kernel-ipc"))


_QUIET = logging.getLogger("minivllm.labs.grade.nbclient")  # timeouts and dead kernels are reported in the table
_QUIET.setLevel(logging.CRITICAL)
_QUIET.propagate = False


def cell_error(cell) -> str | None:
    """The first error a cell recorded, as ``ename: evalue`` (None: it ran clean); also what ``bench lab_times``
    reports for a notebook that stopped."""
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            return f"{o.get('ename')}: {o.get('evalue')}"[:200]
    return None


def _run_in_kernel(cells: list[tuple[str, str]], lab: Lab, seed: int, timeout: float) -> tuple[dict, dict, str | None]:
    """Run ``cells`` then one grading cell per exercise; ``(results, cell errors, fatal reason)``."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError
    from nbclient.util import run_sync

    errors: dict[str, str] = {}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="minivllm-grade-") as d:
        tmp = Path(d)
        work = tmp / "work"
        work.mkdir()
        token = secrets.token_hex(16)
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(src) for _, src in cells]
        grading = []
        for ex in lab.exercises:
            out = tmp / f"result-{ex.name}.json"
            grading.append((ex.name, out))
            nb.cells.append(nbformat.v4.new_code_cell(
                "from minivllm.labs.grade import _kernel_grade as _minivllm_grade\n"
                f"_minivllm_grade(globals(), {lab.number}, {ex.name!r}, {seed}, {str(out)!r}, {token!r})"))
        km = kernel_manager(tmp)  # ours, so nbclient will not shut it down: the finally below does
        # On a timeout: interrupt the kernel and move on at once (error_on_timeout), so a kernel that ignores
        # the interrupt (stuck in C code) costs each remaining cell one timeout, never an endless wait.
        # (nbclient's timeout is whole seconds: 2.5 is a TraitError there, so it gets the next whole second)
        timeout = max(1, math.ceil(timeout))
        client = NotebookClient(nb, km=km, timeout=timeout, allow_errors=True,
                                interrupt_on_timeout=True, record_timing=True,
                                error_on_timeout={"ename": "Timeout", "evalue": f"cell ran over {timeout:g} s",
                                                  "traceback": []},
                                resources={"metadata": {"path": str(work)}}, log=_QUIET)
        whats = [w for w, _ in cells] + [f"grade:{n}" for n, _ in grading]
        fatal = None
        stuck = None  # the last cell that timed out after the kernel had started it
        try:
            with client.setup_kernel():
                for i, cell in enumerate(nb.cells):
                    t0 = time.monotonic()
                    client.execute_cell(cell, i)
                    if time.monotonic() - t0 >= timeout - 0.01:  # nbclient gave up waiting (no output marks it)
                        # The kernel announces each cell it starts (execute_input, recorded by record_timing).
                        # A cell it never started waited behind an earlier one stuck where the interrupt cannot
                        # reach (C code): blame that one, not this cell or the object it was to check.
                        if stuck is None or "iopub.execute_input" in cell.metadata.get("execution", {}):
                            errors[whats[i]] = f"timed out after {timeout:g} s"
                            stuck = whats[i]
                        else:
                            errors[whats[i]] = f"not run: the kernel was still busy with {stuck}, which ignored the interrupt"
                    elif (err := cell_error(cell)) is not None:
                        errors.setdefault(whats[i], err)
        except DeadKernelError:
            fatal = "the kernel died (the notebook crashed the Python process)"
        except Exception as exc:  # kernel failed to start, or nbclient itself failed: never a grader traceback
            fatal = f"could not run the notebook: {type(exc).__name__}: {exc}"[:300]
        finally:
            try:
                if km.has_kernel:
                    run_sync(km.shutdown_kernel)(now=True)
            except Exception:
                pass
        for name, out in grading:
            try:
                data = json.loads(out.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.pop("token", None) == token:
                results[name] = data
    return results, errors, fatal


def _row(student, path, lab, ex, seed, res, errors, fatal) -> ExerciseGrade:
    where = f"exercise:{ex.name}"

    def row(points, checker, hidden, reason):
        return ExerciseGrade(student, str(path), lab.number, ex.name, points, ex.points, checker, hidden, reason, seed)

    if res is None:
        reason = errors.get(f"grade:{ex.name}") or fatal or "no result from the grading kernel"
        if "timed out" in reason:
            reason = f"checking `{ex.defines}` {reason}"
        if where in errors and errors[where] != reason:
            reason += f"; its cell: {errors[where]}"
        return row(0, "-", "-", reason)
    if res.get("missing"):
        cause = errors.get(where) or errors.get("setup")
        if not cause:
            why = ""
        else:
            why = f" (its cell: {cause})" if where in errors else f" (setup: {cause})"
        return row(0, "-", "-", f"`{ex.defines}` is not defined{why}")
    if res.get("error"):
        checker = "passed" if res.get("checker") and res["checker"]["passed"] else "error"
        return row(0, checker, "error" if checker == "passed" else "-", res["error"])
    c = res["checker"]
    if c["not_implemented"]:
        return row(0, "not implemented", "-", "not implemented yet")
    if not c["passed"]:
        return row(0, "failed", "-", f"checker: case {c['num_passed'] + 1}/{c['num_cases']} "
                                     f"'{c['failed_case']}' failed")
    h = res["hidden"]
    if h is None:  # the checker passed, and the hidden cases never finished (see run_exercise's on_checked)
        reason = errors.get(f"grade:{ex.name}") or fatal or "no result from the hidden cases"
        return row(0, "passed", "-", f"the hidden cases of `{ex.defines}`: {reason}")
    if h.get("rerun"):
        return row(ex.points, "passed", "checker re-run", "")
    if not h["passed"]:
        return row(0, "passed", "failed", f"hidden case '{h['failed_case']}' failed")
    return row(ex.points, "passed", "passed", "")


def grade_notebook(path: str | Path, *, seed: int, timeout: float = DEFAULT_TIMEOUT_S,
                   run_all: bool = False) -> list[ExerciseGrade]:
    """One row per registered exercise of the notebook's lab (one row with the reason if it has none)."""
    import nbformat

    path = Path(path)
    try:
        nb = nbformat.read(path, as_version=4)
        # JSON that nbformat only logs as invalid (a cell without source, tags that are not strings) fails here
        lab = identify_lab(nb, path)
        cells = graded_cells(nb, lab, run_all) if lab is not None and lab.exercises else []
    except Exception as exc:
        return [ExerciseGrade(student_name(path), str(path), None, "-", 0, 0, "-", "-",
                              f"cannot read the notebook: {type(exc).__name__}: {exc}"[:300], seed)]
    if lab is None or not lab.exercises:
        return [ExerciseGrade(student_name(path), str(path), lab.number if lab else None, "-", 0, 0, "-", "-",
                              "not a registered lab notebook (no known exercise tags or lab file name)", seed)]
    student = student_name(path)
    results, errors, fatal = _run_in_kernel(cells, lab, seed, timeout)
    return [_row(student, path, lab, ex, seed, results.get(ex.name), errors, fatal) for ex in lab.exercises]


def grade_in_process(path: str | Path, *, seed: int) -> list[ExerciseGrade]:
    """:func:`grade_notebook` without a kernel: the cells run in a namespace of this process.

    For trusted notebooks only (the tests grade every registered lab's solutions, stubs and planted
    bugs this way in a few seconds, all labs together): no timeout, and a crash in a cell is this
    process's crash.
    """
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    lab = identify_lab(nb, path)
    if lab is None:
        raise ValueError(f"{path} is not a registered lab notebook")
    ns: dict = {}
    errors: dict[str, str] = {}
    for what, source in graded_cells(nb, lab):
        code = "\n".join(x for x in source.splitlines() if not x.lstrip().startswith(("%", "!")))
        try:
            with redirect_stdout(io.StringIO()):
                exec(compile(code, f"<{path.name} {what}>", "exec"), ns)
        except Exception as exc:
            errors.setdefault(what, f"{type(exc).__name__}: {exc}"[:200])
    results = {ex.name: ({"missing": True} if ex.defines not in ns else run_exercise(ex, ns[ex.defines], seed))
               for ex in lab.exercises}
    student = student_name(path)
    return [_row(student, path, lab, ex, seed, results[ex.name], errors, None) for ex in lab.exercises]


# -- reporting -----------------------------------------------------------------------------------


def format_table(rows: Sequence[ExerciseGrade]) -> str:
    """A score table per notebook, with a total line."""
    lines: list[str] = []
    by_nb: dict[str, list[ExerciseGrade]] = {}
    for r in rows:
        by_nb.setdefault(r.notebook, []).append(r)
    for nb, rs in by_nb.items():
        lab = next((lab for lab in labs() if lab.number == rs[0].lab), None)
        title = f"lab {lab.number} · {lab.title}" if lab else "no lab"
        lines.append(f"{rs[0].student} · {title} · {nb}")
        w = max(20, *(len(r.exercise) for r in rs))
        lines.append(f"  {'exercise':<{w}} {'points':>6}  {'checker':<15} {'hidden':<14} reason")
        for r in rs:
            score = f"{r.points}/{r.max_points}"
            lines.append(f"  {r.exercise:<{w}} {score:>6}  {r.checker:<15} {r.hidden:<14} {r.reason}")
        total, most = sum(r.points for r in rs), sum(r.max_points for r in rs)
        lines.append(f"  {'total':<{w}} {f'{total}/{most}':>6}")
        lines.append("")
    return "\n".join(lines)


FIELDS = [f for f in ExerciseGrade.__dataclass_fields__]


def write_csv(rows: Sequence[ExerciseGrade], stream) -> None:
    w = csv.DictWriter(stream, fieldnames=FIELDS)
    w.writeheader()
    for r in rows:
        w.writerow(asdict(r))


def write_json(rows: Sequence[ExerciseGrade], stream) -> None:
    json.dump([asdict(r) for r in rows], stream, indent=1)
    stream.write("\n")


def _open(target: str):
    return open(target, "w", newline="") if target != "-" else None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm grade", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("notebooks", nargs="+", help="student notebooks (.ipynb), any labs, any number")
    p.add_argument("--seed", type=int, default=None,
                   help=f"seed of the hidden cases (default: ${SEED_ENV}, else random; printed either way)")
    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S,
                   help="seconds per cell (default %(default)s)")
    p.add_argument("--run-all", action="store_true", help="execute every code cell, not only setup + exercises")
    p.add_argument("--csv", metavar="FILE", help="write one row per student x exercise as CSV ('-': stdout)")
    p.add_argument("--json", metavar="FILE", help="write the same rows as JSON ('-': stdout)")
    p.add_argument("--quiet", action="store_true", help="no score table")


def choose_seed(seed: int | None) -> int:
    """``--seed``, else ``$MINIVLLM_GRADE_SEED``, else a random one.

    Why random by default: the hidden cases must not be known before grading; ``run`` prints the seed
    either way, so a disputed grade can be reproduced exactly.
    """
    if seed is not None:
        return seed
    env = os.environ.get(SEED_ENV)
    if env:
        try:
            return int(env)
        except ValueError:
            raise SystemExit(f"${SEED_ENV} must be an integer, not {env!r}") from None
    return secrets.randbelow(2**31)


def run(args: argparse.Namespace) -> int:
    for flag, target in (("--csv", args.csv), ("--json", args.json)):
        if target is not None and not target.strip():  # was: nothing written, exit 0
            print(f"minivllm grade: error: {flag} needs a file name ('-': stdout), got {target!r}", file=sys.stderr)
            return 2
        try:  # a directory failed only once every notebook was graded ("results/": a file named results)
            if target not in (None, "-"):
                output_file(target)
        except argparse.ArgumentTypeError as exc:
            print(f"minivllm grade: error: {flag}: {exc}", file=sys.stderr)
            return 2
    if args.csv is not None and args.csv == args.json:  # both to one place: CSV then JSON, neither parseable
        print(f"minivllm grade: error: --csv and --json both write to {args.csv!r}; give them different files",
              file=sys.stderr)
        return 2
    missing = [nb for nb in args.notebooks if not os.path.isfile(nb)]
    if missing:  # a typo (or a glob the shell left unexpanded) is no student's zero
        print(f"minivllm grade: error: no such notebook: {', '.join(map(repr, missing))}", file=sys.stderr)
        return 2
    # One file named twice (overlapping globs, ``a.ipynb`` and ``./a.ipynb``) is one hand-in: graded twice, its
    # rows would be in the CSV twice and a per-student sum would count each exercise twice.
    first: dict[str, str] = {}  # resolved path -> the name it was first given by
    for nb in args.notebooks:
        first.setdefault(os.path.realpath(nb), nb)
    notebooks = list(first.values())
    seed = choose_seed(args.seed)
    to_stdout = "-" in (args.csv, args.json)
    log = sys.stderr if to_stdout else sys.stdout
    rows: list[ExerciseGrade] = []
    for nb in notebooks:
        graded = grade_notebook(nb, seed=seed, timeout=args.timeout, run_all=args.run_all)
        rows += graded
        if not args.quiet:
            print(format_table(graded), file=log, flush=True)
    print(f"hidden-case seed: {seed} (repeat this run with --seed {seed})", file=log)
    for target, write in ((args.csv, write_csv), (args.json, write_json)):
        if target:
            f = _open(target)
            write(rows, f or sys.stdout)
            if f:
                f.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run(parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
