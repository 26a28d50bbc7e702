"""``python -m minivllm.bench lab_times``: the measurement behind the README's CPU-time column.

Oracles by construction: a notebook that sleeps 0.3 s cannot take less, and one whose second cell raises must be
reported with that cell's error and a failing exit status (a lab that stops half way has no run time to quote)."""

from __future__ import annotations

import json

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")


def _notebook(path, sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    nbformat.write(nb, path)
    return path


def test_times_each_notebook_and_names_the_one_that_stopped(tmp_path, capsys):
    from minivllm.bench.lab_times import main

    good = _notebook(tmp_path / "good.ipynb", ["import time; time.sleep(0.3)", "print('ok')"])
    bad = _notebook(tmp_path / "bad.ipynb", ["x = 1", "raise ValueError('planted')", "print('never')"])
    out = tmp_path / "times.json"
    assert main([str(good), str(bad), "--out", str(out)]) == 1  # one notebook did not run to the end
    rows = {r["notebook"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["good.ipynb"]["ran_every_cell"] and rows["good.ipynb"]["seconds"] >= 0.3
    assert not rows["bad.ipynb"]["ran_every_cell"]
    assert rows["bad.ipynb"]["error"] == "CellExecutionError: ValueError: planted"
    assert "every cell ran" in capsys.readouterr().out


def test_a_missing_notebook_is_refused_before_anything_runs(tmp_path):
    from minivllm.bench.lab_times import main

    with pytest.raises(ValueError, match="no such notebook"):
        main([str(tmp_path / "nope.ipynb")])
