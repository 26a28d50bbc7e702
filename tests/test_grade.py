"""The autograder (``minivllm grade``): full marks for the solutions, 0 for the untouched student
notebooks, partial marks for one planted bug, and a 0 with a reason -- never a grader traceback --
for notebooks that crash, hang or are not notebooks.

Two layers.  Every registered lab is graded in-process (:func:`grade_in_process`, no kernel: a few
seconds for all labs), which proves the scoring for each lab's solutions, stubs and planted bugs.
The real path -- a Jupyter kernel per notebook, timeouts, a dying kernel, CSV/JSON -- is proven
once, on lab 1 (the smallest), through the command line.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from minivllm.labs import grade
from minivllm.labs.registry import Lab, apply_mutant, get_lab, labs

ROOT = Path(__file__).resolve().parents[1]
REGISTERED = [lab for lab in labs() if (ROOT / "solutions" / f"{lab.stem}.ipynb").exists()]


def _with_cell(src: Path, dest: Path, exercise: str, edit) -> Path:
    """A copy of notebook ``src`` whose ``exercise:<exercise>`` cell is ``edit(source)``."""
    nb = nbformat.read(src, as_version=4)
    cell = next(c for c in nb.cells if f"exercise:{exercise}" in c.metadata.get("tags", []))
    cell.source = edit(cell.source)
    dest.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, dest)
    return dest


def _points(rows) -> dict[str, int]:
    return {r.exercise: r.points for r in rows}


# -- every lab, in-process -----------------------------------------------------------------------


@pytest.mark.parametrize("lab", REGISTERED, ids=lambda lab: lab.stem)
def test_full_marks_zero_and_partial_for_every_lab(lab: Lab, tmp_path):
    full = grade.grade_in_process(ROOT / "solutions" / f"{lab.stem}.ipynb", seed=11)
    assert _points(full) == {ex.name: ex.points for ex in lab.exercises}, [r.reason for r in full]
    assert all(r.checker == "passed" and r.hidden in ("passed", "checker re-run") for r in full)

    zero = grade.grade_in_process(ROOT / "labs" / f"{lab.stem}.ipynb", seed=11)
    assert _points(zero) == {ex.name: 0 for ex in lab.exercises}
    assert all(r.reason == "not implemented yet" for r in zero), [r.reason for r in zero]

    bugged = lab.exercises[0]
    path = _with_cell(ROOT / "solutions" / f"{lab.stem}.ipynb", tmp_path / "bob" / f"{lab.stem}.ipynb",
                      bugged.name, lambda s: apply_mutant(s, bugged.mutants[0]))
    partial = grade.grade_in_process(path, seed=11)
    assert _points(partial) == {ex.name: (0 if ex is bugged else ex.points) for ex in lab.exercises}
    assert 0 < sum(r.points for r in partial) < lab.total_points
    assert {r.student for r in partial} == {"bob"}
    assert next(r for r in partial if r.exercise == bugged.name).reason


def test_a_bug_only_the_hidden_cases_see_costs_the_points(tmp_path):
    """A paged_slots that special-cases the visible inputs passes the checker, not the grader."""
    lab = get_lab(2)
    visible = ("{(): 0, (1,): 16, (16,): 16, (17,): 32, (1, 16, 17, 40): 112, (3, 5, 7): 15, (0, 5): 16, "
               "(16, 16, 5, 5): 64}")
    path = _with_cell(ROOT / "solutions" / f"{lab.stem}.ipynb", tmp_path / f"{lab.stem}.ipynb", "paged_slots",
                      lambda s: s.replace("### BEGIN SOLUTION",
                                          f"### BEGIN SOLUTION\n    return {visible}.get(tuple(seq_lens), 0)", 1))
    row = next(r for r in grade.grade_in_process(path, seed=5) if r.exercise == "paged_slots")
    assert (row.points, row.checker, row.hidden) == (0, "passed", "failed"), row


def test_a_lost_tag_is_found_by_the_definition(tmp_path):
    lab = get_lab(1)
    nb = nbformat.read(ROOT / "solutions" / f"{lab.stem}.ipynb", as_version=4)
    for c in nb.cells:
        c.metadata["tags"] = [t for t in c.metadata.get("tags", []) if t != "exercise:split_step"]
    nbformat.write(nb, tmp_path / f"{lab.stem}.ipynb")
    assert _points(grade.grade_in_process(tmp_path / f"{lab.stem}.ipynb", seed=1)) == {
        ex.name: ex.points for ex in lab.exercises}


# -- hand-built notebooks, in-process: what a messy submission scores ------------------------------

# A right paged_slots (lab 2, 1 point): each sequence reserves whole blocks, ceil(n / block_size) of them.
_PAGED_RIGHT = "def paged_slots(seq_lens, block_size):\n    return sum(-(-n // block_size) * block_size for n in seq_lens)\n"
_PAGED_WRONG = "def paged_slots(seq_lens, block_size):\n    return sum(seq_lens)\n"  # no rounding up to a block


def _notebook(path: Path, cells: list[tuple[str, list[str]]]) -> Path:
    """Write a notebook of code cells ``(source, tags)`` to ``path``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src, id=f"c{i}", metadata={"tags": tags}) for i, (src, tags) in enumerate(cells)]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def _scores(rows) -> dict[str, tuple[int, int]]:
    return {r.exercise: (r.points, r.max_points) for r in rows}


def test_a_renamed_notebook_is_found_by_its_exercise_tags(tmp_path):
    """Kills: ``identify_lab`` going straight to the file name (a tagged notebook saved as ``alice.ipynb`` is no lab).

    By hand: the tag names lab 2's paged_slots, whose right answer earns its 1 point; lab 2's two other exercises
    (block_pool 2 points, slot_mapping 1) are absent, so 0 -- total 1/4, not "not a registered lab notebook"."""
    path = _notebook(tmp_path / "submissions" / "alice.ipynb", [(_PAGED_RIGHT, ["exercise:paged_slots"])])
    rows = grade.grade_in_process(path, seed=3)
    assert {r.lab for r in rows} == {2} and {r.student for r in rows} == {"alice"}
    assert _scores(rows) == {"block_pool": (0, 2), "slot_mapping": (0, 1), "paged_slots": (1, 1)}


def test_a_lost_tag_grades_the_last_binding_of_the_name_def_or_assignment(tmp_path):
    """Kills: the untagged fallback taking the *first* cell that defines the object, and ``_defines`` ignoring
    assignments (its docstring promises "a def, a class or an assignment").

    By hand: run top to bottom, the notebook leaves ``paged_slots`` bound to the right lambda of the last cell,
    so the learner earns the exercise's 1 point; grading the first (wrong) def, or finding no definition, gives 0."""
    right = "paged_slots = lambda seq_lens, block_size: sum(-(-n // block_size) * block_size for n in seq_lens)\n"
    path = _notebook(tmp_path / "ann" / "lab02_paged_kv_cache.ipynb", [(_PAGED_WRONG, []), (right, [])])
    assert _scores(grade.grade_in_process(path, seed=3))["paged_slots"] == (1, 1)
    path = _notebook(tmp_path / "ben" / "lab02_paged_kv_cache.ipynb", [(_PAGED_WRONG, []), (_PAGED_RIGHT, [])])
    assert _scores(grade.grade_in_process(path, seed=3))["paged_slots"] == (1, 1)


def test_a_missing_object_names_the_cell_that_failed(tmp_path):
    """Kills: the "(its cell: ...)" and "(setup: ...)" attributions swapped.

    By hand: the setup cell raises NameError and the paged_slots cell ZeroDivisionError before its def; neither
    object exists.  paged_slots' own cell is the cause; slot_mapping has no cell at all, so setup's error is the
    only lead.  All of lab 2 scores 0."""
    path = _notebook(tmp_path / "cy" / "lab02_paged_kv_cache.ipynb",
                     [("import math\nundefined_helper()\n", ["setup"]), ("1 / 0\n" + _PAGED_RIGHT, ["exercise:paged_slots"])])
    rows = {r.exercise: r for r in grade.grade_in_process(path, seed=3)}
    assert rows["paged_slots"].reason == "`paged_slots` is not defined (its cell: ZeroDivisionError: division by zero)"
    assert rows["slot_mapping"].reason == ("`slot_mapping` is not defined "
                                           "(setup: NameError: name 'undefined_helper' is not defined)")
    assert sum(r.points for r in rows.values()) == 0


def test_run_all_runs_every_code_cell_in_order():
    """Kills: ``--run-all`` running only the tagged cells (a learner's untagged helper never runs).

    By hand: the four code cells, in notebook order, named by their tag or their index; the markdown cell is
    skipped but still counts in the index."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# lab 2", id="m"),
                nbformat.v4.new_code_cell("import math", id="a", metadata={"tags": ["setup"]}),
                nbformat.v4.new_code_cell("def ceil_div(a, b):\n    return -(-a // b)", id="b"),
                nbformat.v4.new_code_cell("paged_slots = 1", id="c", metadata={"tags": ["exercise:paged_slots"]}),
                nbformat.v4.new_code_cell("print(paged_slots)", id="d")]
    assert grade.graded_cells(nb, get_lab(2), run_all=True) == [
        ("setup", "import math"), ("cell 2", "def ceil_div(a, b):\n    return -(-a // b)"),
        ("exercise:paged_slots", "paged_slots = 1"), ("cell 4", "print(paged_slots)")]

def test_each_table_row_shows_the_points_that_exercise_earned():
    """Kills: the per-exercise score column printing ``max_points/max_points`` (every row reads as full marks
    while only the total line tells the truth).  By hand: ann earned 1 of split_step's 1 point and 0 of
    static_batching's 2, so the rows read 1/1 and 0/2 and the total 1/3."""
    rows = [grade.ExerciseGrade("ann", "ann/lab01.ipynb", 1, "split_step", 1, 1, "passed", "passed", "", 0),
            grade.ExerciseGrade("ann", "ann/lab01.ipynb", 1, "static_batching", 0, 2, "failed", "-", "why", 0)]
    scores = {line.split()[0]: line.split()[1] for line in grade.format_table(rows).splitlines()
              if line.startswith("  ") and not line.strip().startswith("exercise")}
    assert scores == {"split_step": "1/1", "static_batching": "0/2", "total": "1/3"}


def test_seed_zero_is_a_seed(monkeypatch):
    """Kills: ``choose_seed`` testing the seed's truth instead of ``is not None``: ``--seed 0`` would be ignored for
    the environment's seed or a random one, and the printed "repeat this run with --seed N" would name another
    seed than the one the instructor gave.  By hand: 0 was asked for, so 0 is used."""
    monkeypatch.setenv(grade.SEED_ENV, "77")
    assert grade.choose_seed(0) == 0
    monkeypatch.delenv(grade.SEED_ENV)
    assert grade.choose_seed(0) == 0
    monkeypatch.setenv(grade.SEED_ENV, "0")
    assert grade.choose_seed(None) == 0



# -- the real path: kernels, timeouts, crashes, CSV/JSON (lab 1) -----------------------------------


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One ``minivllm grade`` run over six notebooks; returns (rows by student, stdout, stderr, tmp).

    The planted hang waits the per-cell timeout out in full, so it costs CI that long once.  Every cell of lab 1
    grades in under 2 s on a quiet 2-core machine (checked with ``--timeout 2``), but at a load of about 10 (CI
    beside other jobs) cells twice ran past the old 7.5 s and failed correct notebooks; 20 s leaves tenfold room."""
    tmp = tmp_path_factory.mktemp("grade")
    lab = get_lab(1)
    sol = ROOT / "solutions" / f"{lab.stem}.ipynb"
    first, second = lab.exercises[0], lab.exercises[1]
    notebooks = [
        sol,
        ROOT / "labs" / f"{lab.stem}.ipynb",
        _with_cell(sol, tmp / "bob" / f"{lab.stem}.ipynb", first.name, lambda s: apply_mutant(s, first.mutants[0])),
        # a hang in one exercise: that exercise times out, the next one is still graded
        _with_cell(sol, tmp / "hang" / f"{lab.stem}.ipynb", first.name,
                   lambda s: s.replace("### BEGIN SOLUTION", "### BEGIN SOLUTION\n    while True:\n        pass", 1)),
        # a syntax error in one cell, a process exit in the other
        _with_cell(_with_cell(sol, tmp / "crash" / f"{lab.stem}.ipynb", first.name, lambda s: s + "\n)"),
                   tmp / "crash" / f"{lab.stem}.ipynb", second.name, lambda s: "import os\nos._exit(3)\n" + s),
    ]
    junk = tmp / "junk" / f"{lab.stem}.ipynb"
    junk.parent.mkdir()
    junk.write_text("{ not json")
    notebooks.append(junk)
    proc = subprocess.run([sys.executable, "-m", "minivllm", "grade", *map(str, notebooks), "--seed", "42",
                           "--timeout", "20", "--csv", str(tmp / "grades.csv"), "--json", "-"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    by: dict[str, dict[str, dict]] = {}
    for r in rows:
        by.setdefault(r["student"], {})[r["exercise"]] = r
    return by, proc.stdout, proc.stderr, tmp


def test_kernel_grading_full_zero_partial(graded):
    by, _, _, _ = graded
    lab = get_lab(1)
    full = {ex.name: ex.points for ex in lab.exercises}
    assert {k: r["points"] for k, r in by["solutions"].items()} == full
    assert {k: r["points"] for k, r in by["labs"].items()} == {k: 0 for k in full}
    first = lab.exercises[0].name
    assert {k: r["points"] for k, r in by["bob"].items()} == {**full, first: 0}
    assert all(r["seed"] == 42 for s in by.values() for r in s.values())


def test_a_hang_or_a_crash_is_a_zero_with_a_reason(graded):
    by, out, err, _ = graded
    lab = get_lab(1)
    first, second = lab.exercises[0], lab.exercises[1]
    assert by["hang"][first.name]["points"] == 0 and "timed out" in by["hang"][first.name]["reason"]
    assert by["hang"][second.name]["points"] == second.points, "the kernel survives the interrupted cell"
    assert by["crash"][first.name]["points"] == 0 and "SyntaxError" in by["crash"][first.name]["reason"]
    assert by["crash"][second.name]["points"] == 0 and "kernel died" in by["crash"][second.name]["reason"]
    assert by["junk"]["-"]["points"] == 0 and "cannot read" in by["junk"]["-"]["reason"]
    assert "Traceback" not in out + err


def test_csv_and_table(graded):
    by, _, err, tmp = graded
    rows = list(csv.DictReader((tmp / "grades.csv").open()))
    assert len(rows) == sum(len(v) for v in by.values()) and set(rows[0]) == set(grade.FIELDS)
    assert "total" in err and "hidden-case seed: 42" in err  # with --json -, the table goes to stderr

def test_run_all_in_a_kernel_runs_the_untagged_helper_and_reports_the_first_setup_error(tmp_path):
    """Through the command line and a real kernel (the in-process grader has no ``--run-all``).

    Kills: ``--run-all`` dropped on its way from the command line to :func:`graded_cells` (the learner's untagged
    helper never runs, so a right paged_slots that calls it raises NameError in the checker); the grading cell
    reading the object before checking it is defined (a KeyError instead of "is not defined"); and the kernel
    keeping the *last* error of two setup cells, where the first is the cause (as the in-process grader keeps).

    By hand: the helper rounds each length up to whole 16-slot blocks, so paged_slots earns its 1 point; lab 2's
    block_pool (2 points) and slot_mapping (1) are never defined: 0, and the reason is the first setup cell's
    ModuleNotFoundError, not the second cell's NameError that follows from it."""
    path = _notebook(tmp_path / "dee" / "lab02_paged_kv_cache.ipynb", [
        ("import no_such_module_for_grading\n", ["setup"]),
        ("no_such_module_for_grading.BLOCK = 16\n", ["setup"]),
        ("def ceil_div(a, b):\n    return -(-a // b)\n", []),
        ("def paged_slots(seq_lens, block_size):\n    return sum(ceil_div(n, block_size) * block_size for n in seq_lens)\n",
         ["exercise:paged_slots"])])
    out = tmp_path / "grades.json"
    assert grade.main([str(path), "--run-all", "--seed", "3", "--timeout", "60", "--json", str(out), "--quiet"]) == 0
    rows = {r["exercise"]: r for r in json.loads(out.read_text())}
    assert {k: (r["points"], r["max_points"]) for k, r in rows.items()} == {
        "block_pool": (0, 2), "slot_mapping": (0, 1), "paged_slots": (1, 1)}, [r["reason"] for r in rows.values()]
    assert rows["slot_mapping"]["reason"] == ("`slot_mapping` is not defined "
                                              "(setup: ModuleNotFoundError: No module named 'no_such_module_for_grading')")



def test_the_kernel_imports_the_graders_own_minivllm_first(tmp_path, monkeypatch):
    """The grading kernel starts in a temporary folder, so without a path of its own it imports whichever
    ``minivllm`` its interpreter finds first: from a second checkout beside an editable install, the notebook's
    cells and the grading cells ran the other checkout's engine.  Kills: the kernel spec without the grader's
    root on ``PYTHONPATH``.  Made visible with a decoy package on ``PYTHONPATH`` (which a kernel searches before
    the installed one): the setup cell compares the kernel's ``minivllm`` with the file this test imported."""
    import site

    import minivllm

    here = Path(minivllm.__file__).resolve().parent.parent
    if here in {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}:
        pytest.skip("minivllm is installed in site-packages: the grader adds no path there, and PYTHONPATH wins")
    decoy = tmp_path / "decoy" / "minivllm"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("DECOY = True\n")
    monkeypatch.setenv("PYTHONPATH", str(decoy.parent))
    ours = os.path.realpath(minivllm.__file__)
    path = _notebook(tmp_path / "dee" / "lab02_paged_kv_cache.ipynb", [
        (f"import os, minivllm\nassert os.path.realpath(minivllm.__file__) == {ours!r}, minivllm.__file__\n",
         ["setup"]),
        ("def paged_slots(seq_lens, block_size):\n    return sum(-(-n // block_size) * block_size for n in seq_lens)\n",
         ["exercise:paged_slots"])])
    out = tmp_path / "grades.json"
    assert grade.main([str(path), "--seed", "3", "--timeout", "60", "--json", str(out), "--quiet"]) == 0
    rows = {r["exercise"]: r for r in json.loads(out.read_text())}
    assert rows["paged_slots"]["points"] == 1, rows["paged_slots"]["reason"]
    assert "setup" not in rows["slot_mapping"]["reason"], rows["slot_mapping"]["reason"]


def test_an_installed_minivllm_adds_nothing_to_the_kernels_path(tmp_path, monkeypatch):
    """Where the grader's minivllm sits in site-packages the kernel finds it anyway, and site-packages on
    ``PYTHONPATH`` would come before the standard library (a package there named like a stdlib module would shadow
    it): the kernel spec then sets no path.  From a checkout it sets the checkout's root first.  Oracle: the
    kernel.json written, against the grader's own package location."""
    import site
    from string import Template

    import minivllm

    root = Path(minivllm.__file__).resolve().parent.parent
    monkeypatch.setenv("PYTHONPATH", "/else$HOME")  # jupyter_client expands $NAME in a spec's env: written $$

    def spec(where):
        grade.kernel_manager(where)
        return json.loads((where / "kernels" / "minivllm-grade" / "kernel.json").read_text())

    monkeypatch.setattr(site, "getsitepackages", lambda: [str(tmp_path / "site-packages")])  # a checkout
    monkeypatch.setattr(site, "getusersitepackages", lambda: str(tmp_path / "user-site"))
    env = spec(tmp_path / "a")["env"]
    assert env["PYTHONPATH"] == os.pathsep.join([str(root).replace("$", "$$"), "/else$$HOME"])
    assert Template(env["PYTHONPATH"]).safe_substitute(HOME="/home/x") == os.pathsep.join([str(root), "/else$HOME"])
    monkeypatch.setattr(site, "getsitepackages", lambda: [str(root)])  # installed
    assert "env" not in spec(tmp_path / "b")


def test_seed_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(grade.SEED_ENV, "77")
    assert grade.choose_seed(None) == 77 and grade.choose_seed(5) == 5
    monkeypatch.delenv(grade.SEED_ENV)
    seeds = {grade.choose_seed(None) for _ in range(5)}
    assert len(seeds) > 1 and all(0 <= x < 2**31 for x in seeds), "without a seed, each run draws its own"


def test_the_student_is_the_folder_only_when_the_file_keeps_its_lab_name():
    """A class that hands in ``lab02_<name>.ipynb`` files into one folder must not be graded as one student named
    after the folder.  Hand-written expectations, one per way notebooks arrive."""
    from pathlib import Path

    from minivllm.labs.grade import student_name

    assert student_name(Path("submissions/alice/lab02_paged_kv_cache.ipynb")) == "alice"
    assert student_name(Path("submissions/bob/lab02_paged_kv_cache-Copy1.ipynb")) == "bob"  # Jupyter's copy
    assert student_name(Path("submissions/carol/lab02.ipynb")) == "carol"
    assert student_name(Path("submissions/lab02_dave.ipynb")) == "lab02_dave"
    assert student_name(Path("submissions/erin.ipynb")) == "erin"


@pytest.mark.parametrize("cell", [
    {"cell_type": "code", "metadata": {"tags": ["exercise:split_step"]}, "outputs": [], "execution_count": None},
    {"cell_type": "code", "metadata": {"tags": None}, "source": "x = 1", "outputs": [], "execution_count": None},
    {"cell_type": "code", "metadata": {"tags": [1]}, "source": "x = 1", "outputs": [], "execution_count": None},
    {"metadata": {}, "source": "x = 1"},
], ids=["cell without source", "tags null", "a tag not a string", "cell without cell_type"])
def test_a_notebook_that_is_json_but_not_a_valid_notebook_is_a_zero_with_a_reason(cell, tmp_path):
    """A hand-edited or tool-mangled submission parses as JSON, and nbformat only logs that it is invalid; the grader
    must still give it a row with a reason, never a traceback (which ends the class's run: no table, no CSV for
    anyone graded before or after it).  Oracle: the README's promise for a notebook that "is not a notebook"."""
    path = tmp_path / "mallory" / f"{get_lab(1).stem}.ipynb"
    path.parent.mkdir()
    cell = {"id": "c0", **cell}  # (the one defect each case plants is the point: ids are not missing)
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [cell]}))
    rows = grade.grade_notebook(path, seed=1, timeout=30)
    assert [(r.student, r.points) for r in rows] == [("mallory", 0)]
    assert "cannot read" in rows[0].reason, rows[0].reason


def test_a_result_file_the_notebook_wrote_itself_scores_nothing(tmp_path):
    """A notebook that forges its result files and then kills its kernel (so no grading cell overwrites them)
    must get 0: the module docstring promises a notebook "cannot forge a result file ahead of time".  Kills: the
    token check accepting any token.  By hand: no grading cell ran, so both lab 1 exercises score 0 with the
    dead kernel as the reason (a forged file would have read 1/1 and 1/1)."""
    lab = get_lab(1)
    forge = ("import json, os, pathlib\n"
             "ok = {'passed': True, 'not_implemented': False, 'failed_case': None, 'num_passed': 1, 'num_cases': 1}\n"
             f"for name in {[ex.name for ex in lab.exercises]!r}:\n"
             "    pathlib.Path('..', f'result-{name}.json').write_text(json.dumps(\n"
             "        {'checker': ok, 'hidden': {**ok, 'rerun': False}, 'error': None, 'token': 'forged'}))\n"
             "os._exit(0)\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(forge, id="f", metadata={"tags": ["setup"]})]
    path = tmp_path / "eve" / f"{lab.stem}.ipynb"
    path.parent.mkdir()
    nbformat.write(nb, path)
    rows = grade.grade_notebook(path, seed=1, timeout=30)
    assert {r.exercise: r.points for r in rows} == {ex.name: 0 for ex in lab.exercises}
    assert all("kernel died" in r.reason for r in rows), [r.reason for r in rows]


def test_a_kernel_stuck_past_the_interrupt_is_blamed_on_its_cell_not_on_the_next_exercise(tmp_path):
    """A cell stuck in C code (a builtin ``sum`` over a huge range never checks for the interrupt) keeps the kernel
    busy; every later cell then waits its timeout without ever starting.  Kills: those later cells reported as
    having timed out themselves -- "checking `StaticBatching` timed out after 1 s" for a right class
    whose cell never ran, which sends the instructor to the wrong cell.

    By hand: static_batching's right class is defined first; split_step's cell is the one that ran over (1 s), and
    both grading cells after it never started, so both exercises score 0, and static_batching's only reason is the
    stuck split_step cell.  (nbclient waits a further 4 s for output after each timeout: about 18 s in all.)"""
    lab = get_lab(1)
    sol = nbformat.read(ROOT / "solutions" / f"{lab.stem}.ipynb", as_version=4)
    src = {t: c.source for c in sol.cells for t in c.metadata.get("tags", []) if t.startswith("exercise:")}
    path = _notebook(tmp_path / "stu" / f"{lab.stem}.ipynb", [
        (src["exercise:static_batching"], ["exercise:static_batching"]),
        ("sum(range(10**15))\n" + src["exercise:split_step"], ["exercise:split_step"])])
    rows = {r.exercise: r for r in grade.grade_notebook(path, seed=1, timeout=1)}
    assert {k: r.points for k, r in rows.items()} == {"split_step": 0, "static_batching": 0}
    assert rows["split_step"].reason.endswith("; its cell: timed out after 1 s"), rows["split_step"].reason
    assert rows["static_batching"].reason == (
        "not run: the kernel was still busy with exercise:split_step, which ignored the interrupt"), rows["static_batching"].reason


def test_hidden_cases_that_time_out_keep_the_checkers_pass_in_the_table(tmp_path):
    """A right ``split_step`` that hangs only inside the hidden cases: the checker passed, so the table must say so
    and blame the hidden cases, not show "-" (never ran) beside "checking `split_step` timed out", which sends the
    instructor to a checker that was fine.  Kills: the grading kernel writing its result only at the end.

    By hand: the checker's cases call ``split_step`` directly and pass; the hidden cases reach it through
    ``hidden_split_step`` and sleep past the timeout, so the row reads 0 points, checker "passed", hidden "-".

    The checker's cases run in the same cell, under the same per-cell timeout, so they must stay far inside it on a
    loaded host.  The hang looks for ``hidden_split_step`` once per call by walking the frames: it once called
    ``inspect.stack()`` (which reads every frame's source line) on each of the checker's ~190 calls: about 1.5 s
    on an idle core, more in the kernel's deeper stack, and on a loaded host the test failed for want of CPU (at a
    10 s timeout, later once at 20 s), not for a grading bug.  The frame walk costs the checker ~0.03 s.  The
    hidden cases loop until the interrupt, so they wait out any timeout; 20 s leaves the cells that must finish
    (imports and the checker, about a second idle) many times their need."""
    lab = get_lab(1)
    sol = nbformat.read(ROOT / "solutions" / f"{lab.stem}.ipynb", as_version=4)
    src = {t: c.source for c in sol.cells for t in c.metadata.get("tags", []) if t.startswith("exercise:")}
    slow_in_hidden = ("\n_right_split_step = split_step\n"
                      "def split_step(*a, **k):\n"
                      "    import sys, time\n"
                      "    f = sys._getframe()\n"
                      "    while f is not None and f.f_code.co_name != 'hidden_split_step':\n"
                      "        f = f.f_back\n"
                      "    while f is not None:  # called by the hidden cases: wait for the interrupt\n"
                      "        time.sleep(0.1)\n"
                      "    return _right_split_step(*a, **k)\n")
    path = _notebook(tmp_path / "stu" / f"{lab.stem}.ipynb",
                     [(src["exercise:split_step"] + slow_in_hidden, ["exercise:split_step"])])
    rows = {r.exercise: r for r in grade.grade_notebook(path, seed=1, timeout=20)}
    got = rows["split_step"]
    assert (got.points, got.checker, got.hidden) == (0, "passed", "-"), got
    assert got.reason == "the hidden cases of `split_step`: timed out after 20 s", got.reason
