"""``python -m minivllm.bench lab_times``: how long each lab notebook takes to run top to bottom, here.

Why: the README gives a CPU time per lab and promises each runs in a few minutes; the tests hold every notebook
to three minutes but keep no times, so this is the measurement behind that column.  It runs what a learner runs
-- ``labs/``, stubs and all (an unwritten exercise falls back to the engine's own code, so every cell runs) --
in a fresh kernel of this interpreter, one notebook after another, and records each one's wall time and whether
every cell ran.  ``--solutions`` runs the instructor's copies instead.

    python -m minivllm.bench lab_times --out benchmarks/results/DATE_cpu-2core_lab_times.json
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

from minivllm.argtypes import output_file, positive_int, refuse_unread
from minivllm.bench.results import write_result

ROOT = Path(__file__).resolve().parents[2]


def run_notebook(path: Path, timeout_s: int) -> dict:
    """Execute ``path`` in a fresh kernel (in its own folder, as Jupyter would); its wall time and first error.

    The time includes the kernel's start (a second or two), as a learner's *Run All* on a fresh kernel does."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from nbclient.util import run_sync

    from minivllm.labs.grade import cell_error, kernel_manager

    nb = nbformat.read(path, as_version=4)
    error = None
    with tempfile.TemporaryDirectory(prefix="minivllm-lab-times-") as tmp:
        km = kernel_manager(Path(tmp))  # ours, so nbclient leaves it running: the finally below shuts it down
        client = NotebookClient(nb, km=km, timeout=timeout_s, resources={"metadata": {"path": str(path.parent)}})
        start = time.perf_counter()
        try:
            client.execute()
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:  # the rest of the cells did not run
            cell = next((e for c in nb.cells if (e := cell_error(c))), None)  # ename: evalue, as the grader reads it
            error = f"{type(exc).__name__}: {cell or ''}"[:300]
        finally:
            seconds = time.perf_counter() - start
            if km.has_kernel:
                run_sync(km.shutdown_kernel)(now=True)
    return {"notebook": path.name, "seconds": seconds, "ran_every_cell": error is None, "error": error}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench lab_times", description=__doc__.split("\n\n")[0])
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="notebooks to run (default: every labs/lab*.ipynb of this checkout)")
    ap.add_argument("--solutions", action="store_true",
                    help="run solutions/lab*.ipynb instead of labs/ (the default set: not with notebooks named)")
    ap.add_argument("--timeout", type=positive_int, default=600, help="seconds a cell may run (default 600)")
    ap.add_argument("--out", type=output_file, default=None, help="result JSON")
    args = ap.parse_args(argv)
    if args.notebooks:
        refuse_unread(ap, args, ("solutions",), "with notebooks named (it picks the default set, which they replace)")
    if importlib.util.find_spec("nbclient") is None or importlib.util.find_spec("ipykernel") is None:
        raise ValueError("bench lab_times runs notebooks, which needs the labs extra: pip install 'minivllm[labs]'")
    paths = args.notebooks or sorted((ROOT / ("solutions" if args.solutions else "labs")).glob("lab*.ipynb"))
    missing = [str(p) for p in paths if not p.is_file()]
    if not paths or missing:
        raise ValueError(f"no such notebook: {', '.join(missing)}" if missing else
                         "no lab notebooks here (an installed package has none): pass their paths")
    rows = []
    for path in paths:
        rows.append(run_notebook(path, args.timeout))
        r = rows[-1]
        print(f"{r['notebook']:40s} {r['seconds']:6.1f} s  {'every cell ran' if r['ran_every_cell'] else r['error']}",
              flush=True)
    print(f"{len(rows)} notebooks, {sum(r['seconds'] for r in rows):.0f} s in all")
    if args.out:
        write_result(args.out, {"benchmark": "lab_times", "rows": rows}, "python -m minivllm.bench lab_times",
                     sys.argv[1:] if argv is None else argv)
        print(f"wrote {args.out}")
    return 0 if all(r["ran_every_cell"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
