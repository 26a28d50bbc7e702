"""``python -m minivllm.bench cpu_decode``: the CPU decode kernel timed alone, on the bundled model's shape.

Oracles: the rows cover the grid asked for, the K/V rate is the bytes a step's 30 calls must read over the time
reported (hand arithmetic), and each layer's call reads its own pool (a pool read 30 times would sit in cache).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

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


def test_a_pass_is_timed_whole_and_the_warm_up_pass_is_left_out(monkeypatch):
    """The time reported is the median over the ``repeats`` passes after the warm-up, each pass timed around all
    its layers' calls.  Oracle: a stand-in clock that moves only inside the kernel, by a duration chosen by hand
    for each pass (100 for the cold warm-up, then 1, 9 and 2 per pass): the median of 1, 9 and 2 is 2 -- not 5.5
    (the warm-up counted), not 1 (the fastest pass) and not 3 (a mean)."""
    per_pass = iter([100.0, 1.0, 9.0, 2.0])
    now, calls, step = [0.0], [0], [0.0]

    def kernel_call(*args):
        if calls[0] % cpu_decode.LAYERS == 0:
            step[0] = next(per_pass) / cpu_decode.LAYERS
        calls[0] += 1
        now[0] += step[0]

    monkeypatch.setattr("minivllm.model.cpu_attention.paged_decode", kernel_call)
    monkeypatch.setattr(cpu_decode, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    assert cpu_decode.time_pass(1, 20, repeats=3) == pytest.approx(2.0)
    assert calls[0] == 4 * cpu_decode.LAYERS


def test_the_kernel_is_asked_to_read_the_context_the_rate_counts(monkeypatch):
    """The K/V rate counts ``batch x context`` tokens per call, so each call must be given exactly that: every
    sequence's length ``context`` and a table of its own whole blocks, ceil(context / 16) each, all different
    (a shorter length or a smaller table would read less than the rate claims).  Oracle: hand arithmetic for
    3 sequences of 40 tokens -- 3 blocks each, 9 distinct blocks."""
    seen = []
    monkeypatch.setattr("minivllm.model.cpu_attention.paged_decode",
                        lambda q, k, v, table, lens, *rest: seen.append((table.clone(), lens.clone(), k.shape)))
    cpu_decode.time_pass(3, 40, repeats=1)
    for table, lens, k_shape in seen:
        assert lens.tolist() == [40, 40, 40]
        assert tuple(table.shape) == (3, 3) and len(set(table.flatten().tolist())) == 9
        assert k_shape[0] == 9 and max(table.flatten().tolist()) < k_shape[0]
