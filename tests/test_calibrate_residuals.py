"""``minivllm sim calibrate --residuals``: where a profile's cost model misses its own calibration steps.

Oracle: a profile whose measured times are written from the model's own predictions times a factor chosen by hand
per kind of step, sequence count and context -- the table must give back exactly those factors, band by band.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from minivllm.sim import calibrate
from minivllm.sim.presets import load_profile, profile_spec
from minivllm.sim.roofline import ModelShape, roofline_time, step_cost


def _factor(seqs) -> float:
    """The hand rule the synthetic profile is written with."""
    if any(n > 1 for _, n, _ in seqs):
        return 1.25 if max(s for s, _, _ in seqs) > 512 else 0.8
    return 1.1 if len(seqs) == 1 else 0.95


# A GPU profile too: its grid identified no compute roof, which profile_spec replaces with the datasheet's (what
# sim run predicts with), moving its prompt steps' predictions by up to 3% from the fitted spec's.
GPU_PROFILE = str(Path(__file__).resolve().parents[1] / "benchmarks" / "results"
                  / "2026-11-30_nvidia-h200_llama1b_profile_run2.json")


@pytest.fixture(scope="module", params=["cpu-2core", GPU_PROFILE])
def planted(request) -> dict:
    doc = copy.deepcopy(load_profile(request.param))
    shape, spec, block = ModelShape.from_dict(doc["model"]), profile_spec(doc), doc["engine"]["block_size"]
    for i, s in enumerate(doc["samples"]):
        seqs = [tuple(x) for x in s["seqs"]]
        s["swapped_blocks"] = 8 if i % 5 == 0 else 0  # the committed grids swap nothing: their copy time counts too
        s["time_s"] = _factor(seqs) * roofline_time(step_cost(shape, seqs, s["swapped_blocks"], block), shape, spec).total
    return doc


def test_the_table_gives_back_the_planted_factors_band_by_band(planted):
    rows = calibrate.residuals(planted)
    assert sum(r["steps"] for r in rows) == len(planted["samples"])
    for r in rows:
        if r["kind"] == "prompt":
            want = 1.25 if r["context"] in ("513-2048", "2049+") else 0.8
        else:
            want = 1.1 if r["seqs"] == "1" else 0.95
        assert r["real_over_pred_p50"] == pytest.approx(want, rel=1e-9), r
        assert r["real_over_pred_min"] == pytest.approx(want, rel=1e-9)
        assert r["real_over_pred_max"] == pytest.approx(want, rel=1e-9)
    keys = [(r["kind"], r["seqs"], r["context"]) for r in rows]
    assert len(keys) == len(set(keys))  # one row per band
    order = [("decode", "prompt").index(k) * 100 + ["1", "2-4", "5-16", "17+"].index(s) * 10
             + ["0-64", "65-512", "513-2048", "2049+"].index(c) for k, s, c in keys]
    assert order == sorted(order)  # bands in their order, not their labels' (a "5-16" row before "17+")


def test_bands_by_hand():
    assert [calibrate._band(n, calibrate.SEQ_BANDS, 1)[1] for n in (1, 2, 4, 5, 16, 17, 300)] == \
        ["1", "2-4", "2-4", "5-16", "5-16", "17+", "17+"]
    assert [calibrate._band(c, calibrate.CONTEXT_BANDS, 0)[1] for c in (0, 64, 65, 512, 513, 2048, 2049)] == \
        ["0-64", "0-64", "65-512", "65-512", "513-2048", "513-2048", "2049+"]


def test_cli_prints_the_table_and_refuses_what_it_would_ignore(planted, tmp_path, capsys):
    path = tmp_path / "planted.json"
    path.write_text(json.dumps(planted))
    assert calibrate.main(["--residuals", str(path)]) == 0
    out = capsys.readouterr().out
    assert "decode      1" in out and "1.100" in out and "off by more than 5%" in out
    assert calibrate.main(["--residuals", str(path), "--out", str(tmp_path / "x.json")]) == 2
    assert "drop --out" in capsys.readouterr().err and not (tmp_path / "x.json").exists()
    assert calibrate.main(["--residuals", str(path), "--repeats", "5"]) == 2  # it repeats nothing: not dropped
    assert "drop --repeats" in capsys.readouterr().err
    assert calibrate.main(["--residuals", str(path), "--refit", str(path)]) == 2
    assert "different jobs" in capsys.readouterr().err
    no_samples = dict(planted, samples=[])
    path.write_text(json.dumps(no_samples))
    assert calibrate.main(["--residuals", str(path)]) == 2
    assert "stored samples" in capsys.readouterr().err


def test_a_band_of_unequal_steps_gives_its_median_and_its_range(tmp_path, capsys):
    """The planted profile above gives each band one factor, so a median, a mean, a min and a max all read the same
    there (a table printing the mean, or min and max swapped, passed it).  Here one band's steps differ: one-sequence
    decodes from at most 64 tokens of context (picked by hand, not by ``_band``) run 0.7x, then 1.0x ..., then 2.0x
    the prediction; every other step exactly 1.0x.  By hand: median 1.0 (one low, one high, the rest 1.0), min 0.7,
    max 2.0 -- and the printed row shows them in its p50, min, max columns."""
    doc = copy.deepcopy(load_profile("cpu-2core"))
    shape, spec, block = ModelShape.from_dict(doc["model"]), profile_spec(doc), doc["engine"]["block_size"]
    band = [s for s in doc["samples"] if len(s["seqs"]) == 1 and s["seqs"][0][1] == 1 and s["seqs"][0][0] <= 64]
    assert len(band) >= 3  # one low, one high, and a 1.0 between them at least
    for s in doc["samples"]:
        seqs = [tuple(x) for x in s["seqs"]]
        factor = 0.7 if s is band[0] else 2.0 if s is band[-1] else 1.0
        s["time_s"] = factor * roofline_time(step_cost(shape, seqs, 0, block), shape, spec).total
    rows = {(r["kind"], r["seqs"], r["context"]): r for r in calibrate.residuals(doc)}
    row = rows.pop(("decode", "1", "0-64"))
    assert row["steps"] == len(band)
    assert (row["real_over_pred_p50"], row["real_over_pred_min"], row["real_over_pred_max"]) == \
        pytest.approx((1.0, 0.7, 2.0), rel=1e-9)
    assert all(r["real_over_pred_min"] == pytest.approx(1.0) == r["real_over_pred_max"] for r in rows.values())
    path = tmp_path / "unequal.json"
    path.write_text(json.dumps(doc))
    assert calibrate.main(["--residuals", str(path)]) == 0
    printed = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[:3] == ["decode", "1", "0-64"]]
    assert printed == [["decode", "1", "0-64", str(len(band)), "1.000", "0.700", "2.000"]]


@pytest.mark.parametrize("flags", [["--name", "x"], ["--force"], ["--quick"], ["--fit-bandwidth"], ["--clock", "cpu"],
                                   ["--device", "cpu"]])
def test_residuals_refuses_every_measuring_flag_it_would_ignore(flags, capsys):
    """``--residuals`` measures and writes nothing, so each flag that shapes a measurement or its file is refused by
    name, not silently dropped (the CLI test above tries --out and --repeats; dropping --clock or --device from the
    refused list went unnoticed)."""
    assert calibrate.main(["--residuals", "cpu-2core", *flags]) == 2
    assert f"drop {flags[0]}" in capsys.readouterr().err
