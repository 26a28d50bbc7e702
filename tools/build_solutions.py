#!/usr/bin/env python
"""Write the instructor notebooks ``solutions/lab0*.ipynb`` from the lab texts in ``tools/lab_texts/``.

Why a script?  Notebook JSON is hard to review and to edit by hand; a lab's
text kept as a Python list of cells diffs cleanly.  Each lab module defines
``CELLS``: a list of ``("md", text)`` or ``("code", source[, tags])``.

    python tools/build_solutions.py            # write solutions/ (no outputs)
    python tools/build_solutions.py --execute  # ... and run them, storing outputs
    python tools/build_solutions.py --reuse    # prose-only edit: keep the stored outputs of unchanged code cells
    python tools/make_labs.py                  # then regenerate labs/
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
TEXTS = Path(__file__).resolve().parent / "lab_texts"
KERNEL = {"display_name": "Python 3", "language": "python", "name": "python3"}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook of lab text ``name``, without outputs.

    Each cell's id comes from the lab's name and the cell's place: nbformat gives a new cell a random id, so
    every rebuild would rewrite every id and bury a one-line edit in the notebook's diff."""
    spec = importlib.util.spec_from_file_location(name, TEXTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    nb = nbformat.v4.new_notebook()
    nb.metadata = {"kernelspec": KERNEL, "language_info": {"name": "python"}}
    for i, cell in enumerate(mod.CELLS):
        kind, text, *rest = cell
        text = text.strip("\n")
        tags = list(rest[0]) if rest else []
        first, _, body = text.partition("\n")
        if first.startswith("# NBVAL_IGNORE_OUTPUT"):
            # nbval recognises the marker only as a whole line; the tag is the robust form of it
            reason = first[len("# NBVAL_IGNORE_OUTPUT"):].strip()
            text = "# NBVAL_IGNORE_OUTPUT" + (f"\n# {reason}" if reason else "") + "\n" + body
            tags.append("nbval-ignore-output")
        c = nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text)
        c.id = f"{name[:5]}-{i:02d}"
        if tags:
            c.metadata["tags"] = list(tags)
        nb.cells.append(c)
    return nb


def execute(nb: nbformat.NotebookNode, path: Path, timeout: int = 600) -> float:
    """Run ``nb`` as if it lay at ``path`` and write it there only once every cell has run: a failing cell
    leaves the committed notebook (and its stored outputs) as it was."""
    from nbclient import NotebookClient

    t0 = time.time()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.time() - t0
    nb.metadata.pop("widgets", None)
    for c in nb.cells:
        c.metadata.pop("execution", None)
    nbformat.write(nb, path)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("labs", nargs="*", help="lab text names (default: all)")
    ap.add_argument("--execute", action="store_true")
    ap.add_argument("--reuse", action="store_true", help="copy outputs of unchanged code cells from the current file")
    args = ap.parse_args()
    known = sorted(p.stem for p in TEXTS.glob("lab*.py"))
    unknown = [n for n in args.labs if n not in known]
    if unknown:  # was a FileNotFoundError traceback from the import machinery
        ap.error(f"unknown lab text(s) {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    names = args.labs or known
    for name in names:
        path = ROOT / "solutions" / f"{name}.ipynb"
        path.parent.mkdir(exist_ok=True)
        nb = build(name)
        if args.reuse and path.exists():
            stored = nbformat.read(path, as_version=4)
            # the kernel's language_info from the last run, which build() cannot know without executing
            nb.metadata["language_info"] = stored.metadata.get("language_info", nb.metadata["language_info"])
            old = {c.source: c for c in stored.cells if c.cell_type == "code"}
            for c in nb.cells:
                if c.cell_type == "code" and c.source in old:
                    c.outputs, c.execution_count = old[c.source].outputs, old[c.source].execution_count
        if args.execute:
            print(f"  executed in {execute(nb, path):.1f} s")
        else:
            nbformat.write(nb, path)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
