#!/usr/bin/env python
"""Generate the student notebooks ``labs/`` from the instructor notebooks ``solutions/``.

One source: ``solutions/labNN_*.ipynb`` hold the solutions between
``### BEGIN SOLUTION`` and ``### END SOLUTION`` lines.  Each region becomes a
stub that raises ``NotImplementedError`` with what to do, taken from the
``# TODO:`` comment lines right above the region (those comments stay, as
hints).  Outputs, execution counts and the cells' execution timings are
cleared, the widget state is dropped, and a cell tagged ``covered-by-solution``
gets nbval's skip tag (see :data:`COVERED`).  Everything else is copied
unchanged, so the labs cannot drift from the solutions.

    python tools/make_labs.py            # (re)write labs/
    python tools/make_labs.py --check    # exit 1 if labs/ differs from what would be written
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the markers are the registry's
from minivllm.labs.registry import BEGIN, END, solution_marker  # noqa: E402  (one definition: the grader patches the same regions)

DEFAULT_TODO = "replace this line with your code"


class MarkerError(ValueError):
    """Unbalanced or nested solution markers."""


def stub_source(source: str, where: str = "") -> str:
    """Replace every solution region of one cell's ``source`` by a ``NotImplementedError`` stub."""
    out: list[str] = []
    lines = source.split("\n")
    inside = False
    for n, line in enumerate(lines, 1):
        marker = solution_marker(line)
        if marker == BEGIN:
            if inside:
                raise MarkerError(f"{where} line {n}: nested {BEGIN}")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            todo = _todo_above(out)
            out.append(f"{indent}raise NotImplementedError({todo!r})")
        elif marker == END:
            if not inside:
                raise MarkerError(f"{where} line {n}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise MarkerError(f"{where}: {BEGIN} without {END}")
    return "\n".join(out)


def _todo_above(out: list[str]) -> str:
    """Text of the ``# TODO:`` comment block right above the region (continuation lines start with '#')."""
    parts: list[str] = []
    for line in reversed(out):
        s = line.strip()
        if not s.startswith("#"):
            break
        parts.append(s.lstrip("#").strip())
        if s.lstrip("#").strip().startswith("TODO:"):
            text = " ".join(reversed(parts))
            return text[len("TODO:"):].strip() or DEFAULT_TODO
    return DEFAULT_TODO


# A code cell tagged COVERED holds no exercise and reads nothing an exercise defines (lab 6's at-scale
# simulations; lab 8's bill at scale, fleet scrape, at-scale knee sweep and tuning table; lab 9's capacity sweep,
# held-out re-simulation and profile check): its student copy is the same code on the same inputs, which CI's
# strict run of the solution notebook already executed.  The student copy gets nbval's skip tag, so CI's lax run
# of labs/ does not pay for it twice; a learner's Run All runs it as usual (the tag means nothing to Jupyter).  It
# must bind nothing a later cell reads: the lax run would stop at a NameError (tests/test_labs.py recounts the
# names).
COVERED = "covered-by-solution"


def make_lab(nb: nbformat.NotebookNode, name: str = "") -> nbformat.NotebookNode:
    """The student version of one instructor notebook."""
    lab = copy.deepcopy(nb)
    lab.metadata.pop("widgets", None)
    for i, cell in enumerate(lab.cells):
        # only a code cell's regions become stubs: a region in a markdown (or raw) cell would be copied to the
        # learner word for word, so it is refused like an unbalanced marker
        if cell.cell_type != "code" and any(solution_marker(line) for line in cell.source.split("\n")):
            raise MarkerError(f"{name} cell {i}: a solution marker in a {cell.cell_type} cell")
        if cell.cell_type == "code":
            if COVERED in cell.metadata.get("tags", []):
                if any(solution_marker(line) == BEGIN for line in cell.source.split("\n")):
                    raise MarkerError(f"{name} cell {i}: tagged {COVERED!r} but holds an exercise")
                cell.metadata["tags"] = [*cell.metadata["tags"], "nbval-skip"]
            cell.source = stub_source(cell.source, f"{name} cell {i}")
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)
    return lab


def render(nb: nbformat.NotebookNode) -> str:
    """Canonical text of a notebook (what is written and what --check compares).

    The newline is the one ``nbformat.write`` (``tools/build_solutions.py``) adds and ``nbformat.writes`` leaves
    off, so a lab ends like every other text file and compares equal to a notebook nbformat wrote."""
    return nbformat.writes(nb) + "\n"


def expected_labs(solutions: Path) -> dict[str, str]:
    out = {}
    for path in sorted(solutions.glob("lab*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        out[path.name] = render(make_lab(nb, path.name))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if labs/ is not what would be generated")
    parser.add_argument("--solutions", type=Path, default=ROOT / "solutions")
    parser.add_argument("--labs", type=Path, default=ROOT / "labs")
    args = parser.parse_args(argv)
    want = expected_labs(args.solutions)
    if not want:  # a typo in --solutions: every notebook in labs/ would be removed as having no source
        parser.error(f"--solutions {str(args.solutions)!r}: no lab*.ipynb there")
    have = {p.name: p.read_text() for p in sorted(args.labs.glob("lab*.ipynb"))} if args.labs.exists() else {}
    if args.check:
        stale = sorted(n for n in want if have.get(n) != want[n])
        extra = sorted(set(have) - set(want))
        for n in stale:
            print(f"labs/{n} differs from what tools/make_labs.py generates", file=sys.stderr)
        for n in extra:
            print(f"labs/{n} has no source in solutions/", file=sys.stderr)
        if stale or extra:
            print("run: python tools/make_labs.py", file=sys.stderr)
            return 1
        print(f"labs/ is up to date ({len(want)} notebooks)")
        return 0
    args.labs.mkdir(exist_ok=True)
    for n, text in want.items():
        if have.get(n) != text:
            (args.labs / n).write_text(text)
            print(f"wrote labs/{n}")
    for n in sorted(set(have) - set(want)):  # a solution renamed or removed: --check reports these too
        (args.labs / n).unlink()
        print(f"removed labs/{n} (no source in solutions/)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
