"""``python -m minivllm.bench cpu_decode``: the CPU decode kernel timed alone, on the bundled model's shape.

Oracles: the rows cover the grid asked for, the K/V rate is the bytes a step's 30 calls must read over the time
reported (hand arithmetic), and each layer's call reads its own pool (a pool read 30 times would sit in cache).
"""

from __future__ import annotations

import json
import sys

import pytest

from minivllm.bench import cpu_decode
from minivllm.model.cpu_attention import load_kernel

pytestmark = pytest.mark.skipif(load_kernel() is None, reason="no C compiler: the CPU kernel cannot be built")


def test_rows_cover_the_grid_and_the_rate_is_bytes_over_time(tmp_path, monkeypatch, capsys):
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", ["cpu_decode", "--batches", "1,3", "--contexts", "16,40", "--repeats", "1",
                                      "--out", str(out)])
    assert cpu_decode.main() == 0
    doc = json.loads(out.read_text())
    assert [(r["batch"], r["context"]) for r in doc["rows"]] == [(1, 16), (1, 40), (3, 16), (3, 40)]
    for r in doc["rows"]:
        kv_bytes = 30 * 2 * r["batch"] * r["context"] * 3 * 64 * 4  # layers x (K, V) x tokens x heads x dim x fp32
        assert r["kv_gb_per_s"] == pytest.approx(kv_bytes / (r["ms_per_step"] / 1e3) / 1e9)
    assert "ms / step" in capsys.readouterr().out


def test_each_layer_reads_its_own_pool(monkeypatch):
    seen = []
    monkeypatch.setattr("minivllm.model.cpu_attention.paged_decode",
                        lambda q, k, v, *rest: seen.append(k.data_ptr()))
    cpu_decode.time_pass(1, 20, repeats=1)
    assert len(seen) == 2 * cpu_decode.LAYERS and len(set(seen)) == cpu_decode.LAYERS
