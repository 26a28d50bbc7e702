"""``tools/gpu_checks.sh --dry-run``: the script a lent GPU runs, run here on the CPU with a tiny model.

A GPU lease is 15 minutes, the machine's start included, and it comes by chance; a renamed flag or a
broken step found *there* costs the lease.  So CI runs the script's own CPU path (Triton interpreted,
a random-weight tiny Llama) over the steps that fit in under a minute, and checks what a lease would
bring back: every step exited 0, the packed results hold each step's JSON, and the parity step's
oracle held -- the torch and Triton backends produced the same greedy tokens for every prompt.
(``tests`` and ``attention`` run on a GPU only; ``sim_accuracy`` takes minutes on this CPU and its
code is exercised by ``tests/test_sim_roofline.py``.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = "save_model e2e_nano e2e_parity eager_step"


def test_gpu_checks_dry_run_brings_back_every_steps_result(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), STEPS=STEPS, PYTHON=sys.executable, BUDGET="300")
    proc = subprocess.run(["bash", str(ROOT / "tools" / "gpu_checks.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    ran = [line.split()[1] for line in summary.splitlines() if line.startswith("== ") and "(" in line]
    assert ran == STEPS.split(), summary
    exits = [line.split()[1] for line in summary.splitlines() if line.strip().startswith("exit ")]
    assert exits == ["0"] * len(ran), summary
    unpacked = tmp_path / "unpacked"
    with tarfile.open(tmp_path / "out" / "results.tgz") as tar:
        tar.extractall(unpacked, filter="data")
    for name in ("e2e_nano_tiny.json", "e2e_parity_fp32.json", "eager_step_64.json"):
        assert (unpacked / name).is_file(), sorted(p.name for p in unpacked.iterdir())
    parity = json.loads((unpacked / "e2e_parity_fp32.json").read_text())
    assert parity["prompts"] == 8 and parity["identical_prompts"] == 8, parity
    eager = json.loads((unpacked / "eager_step_64.json").read_text())
    assert eager["profile"]["tensor_ops_per_step"] > 0 and eager["back_to_back"]["n"] == 20
    full = eager["full_collection"]  # a full collection walks the model's objects until they are frozen
    assert full["frozen_objects"] > 0 and full["frozen"]["n"] == full["unfrozen"]["n"] == 5
