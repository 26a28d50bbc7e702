"""``bench linear`` and ``bench prefix_structures``: what their tables and result files report.

Written in a mutation pass: each test pins a planted change no other test noticed (a unit, a formula, a ratio
inverted, a documented default, a check dropped).  Timers are replaced by fixed numbers where the test is about
the arithmetic.  Oracles: the HF model's own ``nn.Linear`` weights (for the projections' shapes), hand
arithmetic, and the modules' docstrings.
"""

from __future__ import annotations

import json
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from minivllm.bench import linear as lin
from minivllm.bench import prefix_structures as ps


# -- bench linear --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.paged_cases import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_linear"))


def _hf_linear_params(model_dir) -> int:
    """Parameters of every projection of the HF model (q, k, v, o, gate, up, down per layer, and the LM head)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def _run_linear(monkeypatch, argv, seconds):
    """``bench linear`` with ``time_pass`` replaced by a fixed time per backend; returns the printed table rows."""
    monkeypatch.setattr(lin, "time_pass",
                        lambda weights, rows, fn, repeats: seconds["torch" if fn is torch.nn.functional.linear else "onednn"])
    monkeypatch.setattr(sys, "argv", ["linear", *argv])
    assert lin.main() == 0


def test_linear_table_and_json_by_hand(monkeypatch, capsys, tmp_path, tiny_llama):
    """Oracles: the weights streamed are the HF model's projections (4 bytes each in fp32); a pass of 0.4 ms
    (F.linear) and 0.1 ms (oneDNN) over P parameters with R rows is 2 P R / ms / 1e6 GFLOP/s, 4 P / ms / 1e6 GB/s,
    and oneDNN is 4.00x as fast; the default --rows sweep is the docstring's usage line."""
    from minivllm.model.backends import onednn_linear_works

    if not onednn_linear_works():
        pytest.skip("no oneDNN on this torch: the table has one backend")
    params = _hf_linear_params(tiny_llama)
    out = tmp_path / "lin.json"
    _run_linear(monkeypatch, ["--model", tiny_llama, "--rows", "1", "2048", "--json", str(out)],
                {"torch": 0.0004, "onednn": 0.0001})
    lines = [x.split() for x in capsys.readouterr().out.splitlines() if re.match(r"\s*(1|2048) ", x)]
    for cells in lines:
        rows = int(cells[0])
        got = [float(c) for c in cells[1:7]] + [float(cells[7].rstrip("x"))]
        want = [0.4, 2 * params * rows / 0.4 / 1e6, 4 * params / 0.4 / 1e6,
                0.1, 2 * params * rows / 0.1 / 1e6, 4 * params / 0.1 / 1e6, 4.0]
        assert got == pytest.approx(want, abs=0.051), cells
    assert len(lines) == 2
    doc = json.loads(out.read_text())
    assert doc["weight_mb"] == pytest.approx(4 * params / 1e6)
    assert [r["rows"] for r in doc["rows"]] == [1, 2048] and doc["rows"][0]["torch_ms"] == pytest.approx(0.4)

    documented = [int(x) for x in re.search(r"\[--rows ([\d ]+)\]", lin.__doc__).group(1).split()]
    _run_linear(monkeypatch, ["--model", tiny_llama, "--json", str(out)], {"torch": 0.0004, "onednn": 0.0001})
    assert [r["rows"] for r in json.loads(out.read_text())["rows"]] == documented


def test_linear_time_pass_is_the_best_of_its_repeats(monkeypatch):
    """Oracle: the docstring's "best-of-repeats": passes of 5, 2 and 7 s give 2 s."""
    clock = iter([0.0, 5.0, 10.0, 12.0, 20.0, 27.0])
    monkeypatch.setattr(lin, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    weights = [(4, 3, torch.zeros(3, 4))]
    assert lin.time_pass(weights, 2, lambda x, w: None, repeats=3) == 2.0


# -- bench prefix_structures ---------------------------------------------------------------------------------------


def _rows(size, structures, hit_rates=None):
    """Rows as ``measure_size`` returns them: radix 2 + 1 us, the hash indexes 6 + 3 us (3x slower)."""
    us = {"radix": (2.0, 1.0), "hash": (6.0, 3.0), "hash+sha256": (8.0, 4.0)}
    return [ps.Row(size, s, size, *us[s], 0.5, (hit_rates or {}).get(s, 0.25), 1.0) for s in structures]


def test_prefix_structures_quick_run_json_by_hand(monkeypatch, tmp_path, capsys):
    """Oracles: the docstring's ``--quick`` (sizes 200 and 1000, 200 measured requests); the JSON's
    ``hash_over_radix_match_insert`` is hash's (6 + 3) over radix's (2 + 1) = 3.0, and each row's ``lookup_us``
    is its match + insert."""
    seen = []

    def measure_size(size, structures, warmup, measured, rounds):
        seen.append((size, len(measured), rounds))
        return _rows(size, structures)

    monkeypatch.setattr(ps, "measure_size", measure_size)
    out = tmp_path / "ps.json"
    ps.main(["--quick", "--json", str(out)])
    assert seen == [(200, 200, 8), (1000, 200, 8)]
    doc = json.loads(out.read_text())
    assert doc["hash_over_radix_match_insert"] == {"200": pytest.approx(3.0), "1000": pytest.approx(3.0)}
    assert [r["lookup_us"] for r in doc["rows"]] == [r["match_us"] + r["insert_us"] for r in doc["rows"]]
    assert [r["lookup_us"] for r in doc["rows"][:3]] == [3.0, 9.0, 12.0]


def test_prefix_structures_refuses_structures_that_disagree_on_hits(monkeypatch, tmp_path):
    """The docstring: both structures see the identical request stream, "so their hit rates must agree; the
    script checks that".  A disagreement (one of three) must end the run before a result file is written."""
    monkeypatch.setattr(ps, "measure_size", lambda size, structures, *a: _rows(size, structures, {"hash": 0.3}))
    out = tmp_path / "ps.json"
    with pytest.raises(SystemExit, match="disagree on hits"):
        ps.main(["--quick", "--json", str(out)])
    assert not out.exists()
    with pytest.raises(SystemExit, match="disagree"):
        ps.check_same_hits(_rows(5, ["radix", "hash", "hash+sha256"], {"hash": 0.3}))


def test_prefix_structures_warm_up_fills_the_cache_to_its_size():
    """The docstring: "after a warm-up the cache sits at that size".  Oracle: serve the warm-up requests into a
    1000-block pool and count the cached blocks."""
    w = ps.Workload()
    pool = ps.BlockPool(1000)
    cache = ps.build_cache("hash", pool)
    t = ps.Timings()
    for tokens in ps.make_requests(w, ps.warmup_requests(1000, w), 0):
        ps.serve(cache, pool, tokens, t)
    assert cache.num_cached_blocks == 1000


def test_prefix_structures_size_floor_and_request_shape_by_hand():
    """Oracles by hand: the longest prompt has 64 system + 16 user full blocks, so the pool is never under 2 x 80 =
    160 blocks and ``--sizes`` refuses 159; every request's user part "ends in a partial block" (docstring)."""
    import argparse

    assert ps.min_cache_size(ps.Workload()) == 160
    assert ps.cache_size("160") == 160
    with pytest.raises(argparse.ArgumentTypeError):
        ps.cache_size("159")
    assert all(len(t) % ps.BLOCK_SIZE for t in ps.make_requests(ps.Workload(), 300, 1))
