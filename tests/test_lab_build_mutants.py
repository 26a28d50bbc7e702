"""Pins for mutants of the notebook generators that the structural tests in ``test_labs.py`` let through.

``tools/build_solutions.py`` writes ``solutions/`` from ``tools/lab_texts/``; ``tools/make_labs.py`` derives the
student notebooks ``labs/`` from ``solutions/``.  These tests are fast (no kernel: execution is faked) and never
rewrite the repository's ``labs/`` or ``solutions/``: everything generated goes to ``tmp_path``.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import build_solutions  # noqa: E402
import make_labs  # noqa: E402

from minivllm.labs.registry import solution_regions  # noqa: E402

SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))
LAB01 = "lab01_serving_loop"


def _shape(nb) -> list[tuple]:
    """What build_solutions decides for each cell: id, kind, source and tags (outputs come from a kernel run)."""
    return [(c.id, c.cell_type, c.source, c.metadata.get("tags")) for c in nb.cells]


# -- build_solutions.py ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_committed_solutions_are_what_build_solutions_writes_from_the_lab_texts(path):
    """The lab texts are the single source: every cell id, kind, source and tag of a committed solution notebook
    must be what ``build()`` makes of its text (a stripped newline, a lost ``nbval-ignore-output`` tag, shifted
    ids or an empty ``tags`` list would otherwise reach solutions/ and labs/ on the next rebuild unnoticed)."""
    built = build_solutions.build(path.stem)
    committed = nbformat.read(path, as_version=4)
    assert _shape(built) == _shape(committed)
    assert built.metadata["kernelspec"] == committed.metadata["kernelspec"]


def test_an_nbval_ignore_output_first_line_becomes_a_tag_and_keeps_its_reason_on_its_own_line():
    """nbval honours the marker only as a whole line, so the reason moves to the next comment line and the cell
    also gets the tag (the robust form)."""
    cells = [c for p in SOLUTIONS for c in nbformat.read(p, as_version=4).cells
             if c.cell_type == "code" and c.source.startswith("# NBVAL_IGNORE_OUTPUT")]
    assert cells
    for c in cells:
        assert c.source.split("\n", 1)[0] == "# NBVAL_IGNORE_OUTPUT"
        assert "nbval-ignore-output" in c.metadata.get("tags", [])


def _reuse(tmp_path, monkeypatch, edit) -> tuple[nbformat.NotebookNode, nbformat.NotebookNode, str]:
    """Run ``build_solutions.py LAB01 --reuse`` against a copy of the committed notebook whose stored copy was
    changed by ``edit``; return (committed, rebuilt, id of the edited cell)."""
    committed = nbformat.read(ROOT / "solutions" / f"{LAB01}.ipynb", as_version=4)
    stored = nbformat.read(ROOT / "solutions" / f"{LAB01}.ipynb", as_version=4)
    edited = edit(stored)
    (tmp_path / "solutions").mkdir()
    nbformat.write(stored, tmp_path / "solutions" / f"{LAB01}.ipynb")
    monkeypatch.setattr(build_solutions, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["build_solutions.py", LAB01, "--reuse"])
    assert build_solutions.main() == 0
    return committed, nbformat.read(tmp_path / "solutions" / f"{LAB01}.ipynb", as_version=4), edited


def test_reuse_keeps_outputs_of_unchanged_code_cells_and_drops_those_of_changed_ones(tmp_path, monkeypatch):
    """``--reuse`` is for prose-only edits: a code cell keeps its stored outputs only if its source is the same;
    a cell whose code changed must come back without outputs (stale outputs would be shown as the new code's)."""
    def edit(nb):
        cell = next(c for c in nb.cells if c.cell_type == "code" and c.outputs)
        cell.source += "\n# an older version of this cell"
        return cell.id

    committed, rebuilt, edited = _reuse(tmp_path, monkeypatch, edit)
    for old, new in zip(committed.cells, rebuilt.cells):
        if new.cell_type != "code":
            continue
        if new.id == edited:
            assert new.outputs == [] and new.execution_count is None
        else:
            assert new.outputs == old.outputs and new.execution_count == old.execution_count, new.id
    assert rebuilt.metadata["language_info"] == committed.metadata["language_info"]


class _FakeClient:
    """Stands in for nbclient's NotebookClient: 'runs' the notebook by adding what a kernel run leaves behind."""

    fail = False

    def __init__(self, nb, **kwargs):
        self.nb = nb

    def execute(self):
        if self.fail:
            raise RuntimeError("a cell failed")
        self.nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
        for i, c in enumerate(self.nb.cells):
            c.metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
            if c.cell_type == "code":
                c.execution_count = i
        return self.nb


def test_execute_drops_widget_state_and_timing_metadata(tmp_path, monkeypatch):
    """The committed solutions must diff only where outputs change: widget state and per-cell execution timings
    change on every run, so execute() drops them before writing."""
    import nbclient

    monkeypatch.setattr(nbclient, "NotebookClient", _FakeClient)
    path = tmp_path / f"{LAB01}.ipynb"
    build_solutions.execute(build_solutions.build(LAB01), path)
    written = nbformat.read(path, as_version=4)
    assert "widgets" not in written.metadata
    assert all("execution" not in c.metadata for c in written.cells)
    assert any(c.get("execution_count") for c in written.cells)


def test_a_failing_run_leaves_the_committed_notebook_as_it_was(tmp_path, monkeypatch):
    """execute() writes only once every cell has run: a failing cell must not replace the stored outputs."""
    import nbclient

    monkeypatch.setattr(nbclient, "NotebookClient", type("Failing", (_FakeClient,), {"fail": True}))
    path = tmp_path / f"{LAB01}.ipynb"
    shutil.copy(ROOT / "solutions" / f"{LAB01}.ipynb", path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError):
        build_solutions.execute(build_solutions.build(LAB01), path)
    assert path.read_bytes() == before


# -- make_labs.py ---------------------------------------------------------------------------------


def test_a_student_notebook_keeps_no_widget_state_outputs_or_run_metadata():
    """Whatever an instructor run left in the solution (widget state, outputs, counts, timings), the student copy
    starts clean; today's solutions carry no widget state or timings, so a synthetic notebook checks it."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {"k": {}}}}
    cell = nbformat.v4.new_code_cell("print(1)")
    cell.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    cell.execution_count = 3
    cell.metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    nb.cells = [nbformat.v4.new_markdown_cell("# Lab"), cell]
    lab = make_labs.make_lab(nb)
    assert "widgets" not in lab.metadata
    assert lab.cells[1].outputs == [] and lab.cells[1].execution_count is None
    assert "execution" not in lab.cells[1].metadata
    assert "widgets" in nb.metadata and nb.cells[1].outputs, "the solution notebook itself is left as it was"


def test_a_stub_message_comes_only_from_the_todo_block_right_above_the_region():
    """A ``# TODO:`` further up, separated from the region by code, belongs to other code: the stub then says
    the default; an empty TODO also falls back to the default rather than raising with an empty message."""
    src = "# TODO: an older task\ny = 2\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION"
    assert f"raise NotImplementedError({make_labs.DEFAULT_TODO!r})" in make_labs.stub_source(src)
    src = "# TODO:\n### BEGIN SOLUTION\nx = 1\n### END SOLUTION"
    assert f"raise NotImplementedError({make_labs.DEFAULT_TODO!r})" in make_labs.stub_source(src)


def test_check_reports_a_student_notebook_whose_solution_is_gone(tmp_path):
    """A solution renamed or removed leaves an orphan in labs/: --check must fail on it and a plain run must
    remove it (else a learner keeps an exercise no solution, checker or CI run backs)."""
    labs = tmp_path / "labs"
    assert make_labs.main(["--labs", str(labs)]) == 0
    orphan = labs / "lab99_removed.ipynb"
    shutil.copy(sorted(labs.glob("lab*.ipynb"))[0], orphan)
    assert make_labs.main(["--check", "--labs", str(labs)]) == 1
    assert make_labs.main(["--labs", str(labs)]) == 0
    assert not orphan.exists()
    assert make_labs.main(["--check", "--labs", str(labs)]) == 0


def test_a_plain_run_rewrites_a_stale_student_notebook(tmp_path):
    """The fix --check prints is "run: python tools/make_labs.py": that run must rewrite a lab that exists but
    differs (a hand-edited stub, or one written before the solution changed), not only write missing ones."""
    labs = tmp_path / "labs"
    assert make_labs.main(["--labs", str(labs)]) == 0
    first = sorted(labs.glob("lab*.ipynb"))[0]
    first.write_text(first.read_text().replace("NotImplementedError", "NotImplementedErr", 1))
    assert make_labs.main(["--check", "--labs", str(labs)]) == 1
    assert make_labs.main(["--labs", str(labs)]) == 0
    assert make_labs.main(["--check", "--labs", str(labs)]) == 0


def _region_lines(nb) -> set[str]:
    """Stripped code lines (over 25 characters, so not a bare ``return x``) inside the solution regions."""
    out = set()
    for c in nb.cells:
        if c.cell_type == "code":
            for start, end in solution_regions(c.source):  # the registry's one reading of the markers
                out.update(s for line in c.source[start:end].splitlines() if len(s := line.strip()) > 25)
    return out


def test_every_code_cell_of_a_regenerated_lab_is_cleared_and_every_exercise_is_a_stub(tmp_path):
    """Re-derive labs/ into tmp_path with the tool as it is and check the promise on the result (the committed
    labs/ alone would not show a tool that broke after they were written)."""
    labs = tmp_path / "labs"
    assert make_labs.main(["--labs", str(labs)]) == 0
    for sol in SOLUTIONS:
        solution = nbformat.read(sol, as_version=4)
        lab = nbformat.read(labs / sol.name, as_version=4)
        assert [c.id for c in lab.cells] == [c.id for c in solution.cells], sol.name
        regions = sum(c.source.count(make_labs.BEGIN) for c in solution.cells if c.cell_type == "code")
        def raises(nb):
            return sum(c.source.count("raise NotImplementedError(") for c in nb.cells if c.cell_type == "code")

        assert raises(lab) - raises(solution) == regions > 0, sol.name
        student = "\n".join(c.source for c in lab.cells)
        leaks = [x for x in _region_lines(solution) if x in student]
        assert not leaks, f"{sol.name}: solution code in the regenerated student notebook: {leaks}"
        for c in lab.cells:
            if c.cell_type == "code":
                assert c.outputs == [] and c.execution_count is None, (sol.name, c.id)
                assert "SOLUTION" not in c.source, (sol.name, c.id)
                code = "\n".join("" if x.lstrip().startswith(("%", "!")) else x for x in c.source.split("\n"))
                ast.parse(code, f"{sol.name} {c.id}")  # a stub keeps the region's indentation


def test_check_reports_a_student_notebook_that_differs_only_in_whitespace(tmp_path):
    """Indentation is Python syntax: a stub re-indented by hand (or by an editor) is a different notebook, so
    --check must compare the exact text it would write, not a whitespace-blind form of it."""
    labs = tmp_path / "labs"
    assert make_labs.main(["--labs", str(labs)]) == 0
    first = sorted(labs.glob("lab*.ipynb"))[0]
    text = first.read_text()
    assert "    raise NotImplementedError(" in text
    first.write_text(text.replace("    raise NotImplementedError(", "  raise NotImplementedError(", 1))
    assert make_labs.main(["--check", "--labs", str(labs)]) == 1
    first.write_text(text.rstrip("\n") + "\n\n")  # one blank line more at the end is a difference too
    assert make_labs.main(["--check", "--labs", str(labs)]) == 1


def test_a_cell_keeps_every_tag_its_lab_text_gives_it(tmp_path, monkeypatch):
    """A cell may carry several tags (an exercise tag beside nbval's): build() must keep all of them, in order,
    and add nbval's ignore tag after them when the first line asks for it."""
    (tmp_path / "lab99_tags.py").write_text(
        'CELLS = [("code", "x = 1", ["exercise:x", "nbval-skip", "setup"]),\n'
        '         ("code", "# NBVAL_IGNORE_OUTPUT timing\\nprint(1)", ("a", "b"))]\n')
    monkeypatch.setattr(build_solutions, "TEXTS", tmp_path)
    nb = build_solutions.build("lab99_tags")
    assert [c.metadata.get("tags") for c in nb.cells] == [
        ["exercise:x", "nbval-skip", "setup"], ["a", "b", "nbval-ignore-output"]]
