"""``python -m minivllm.bench calibration_drift`` on a "device" that is a roofline of known parameters.

The real engine's scheduler drives a :class:`~minivllm.sim.roofline.RooflineExecutor` whose hardware the test
changes between the passes, so what each pass measured is known exactly: the fit recovers each pass's device
(rms error ~0, ``test_calibrate_end_to_end_on_a_simulated_device``), the ratios between passes follow from the
speeds the test set, and a fit's error on the other pass's steps is the two passes' step times compared one by one.
"""

import io
import json
import math
import statistics
from dataclasses import replace

import pytest

from minivllm.bench import calibration_drift
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.sim import calibrate as cal
from minivllm.sim.presets import model_preset
from minivllm.sim.roofline import HardwareSpec, RooflineExecutor

SHAPE = model_preset("smollm2-135m").with_dtype(4)
TRUTH = HardwareSpec("truth", peak_flops=80e9, mem_bandwidth=15e9, attention_flops=20e9, attention_bandwidth=2e9,
                     step_overhead_s=3e-3, seq_overhead_s=0.2e-3, eager_step_overhead_s=4e-3)


def _device_engine():
    """sim calibrate's engine configuration on a roofline "device"; the device is returned to change its speed."""
    device = RooflineExecutor(SHAPE, TRUTH)
    cfg = EngineConfig(max_num_batched_tokens=512, max_num_seqs=32, num_gpu_blocks_override=512, max_model_len=4096,
                       device="cpu")
    engine = LLMEngine(cfg, executor=cal.RecordingExecutor(device), model_max_len=4096, eos_token_ids=set())
    return device, engine


def _passes_on(monkeypatch, device, speeds):
    """Each calibration pass runs on the next of ``speeds`` (a HardwareSpec per pass)."""
    speeds = iter(speeds)
    real = cal.calibrate

    def calibrate_at_next_speed(engine, **kwargs):
        device.hardware = next(speeds)
        return real(engine, **kwargs)

    monkeypatch.setattr(cal, "calibrate", calibrate_at_next_speed)


def test_a_uniformly_slower_second_pass_reads_its_factor_everywhere(monkeypatch):
    """Pass 2 runs every step 1.25x longer (``HardwareSpec.slowed``).  Oracle, from the factor alone: the total
    and every group take 1.25x; pass 1's fit (the device at full speed) predicts pass 2's steps 1/1.25 = 0.8 of
    their time, an error of 20% on every step, and pass 2's fit predicts pass 1's 25% long.  Kills: the ratio
    inverted, a group's ratio taken from the wrong group, a fit judged on its own steps instead of the other's."""
    device, engine = _device_engine()
    _passes_on(monkeypatch, device, [TRUTH, TRUTH.slowed(1.25)])
    res = calibration_drift.run(engine, passes=2, scale=0.4, repeats=1, pin_bandwidth=False, shape=SHAPE,
                                out=io.StringIO())
    first, second = res["passes"]
    assert first["rms_rel_error"] < 1e-6 and second["rms_rel_error"] < 1e-6  # each fit is its device
    assert second["grid_s"] / first["grid_s"] == pytest.approx(1.25, rel=1e-9)
    (pair,) = res["pairs"]
    assert (pair["earlier"], pair["later"], pair["same_steps"]) == (0, 1, True)
    assert pair["total_ratio"] == pytest.approx(1.25, rel=1e-9)
    assert len(pair["group_ratios"]) == len(cal.calibration_grid(SHAPE.vocab_size, scale=0.4))
    assert all(r == pytest.approx(1.25, rel=1e-9) for r in pair["group_ratios"].values())
    for key in ("group_ratio_min", "group_ratio_median", "group_ratio_max"):
        assert pair[key] == pytest.approx(1.25, rel=1e-9), key
    for key, err in (("earlier_fit_on_later", 0.2), ("later_fit_on_earlier", 0.25)):
        assert pair[key]["rms"] == pytest.approx(err, rel=1e-5), key
        assert pair[key]["max_abs"] == pytest.approx(err, rel=1e-5), key
    assert first["hardware"]["step_overhead_s"] == pytest.approx(3e-3, rel=1e-4)  # the fitted rates, reported
    assert second["hardware"]["step_overhead_s"] == pytest.approx(3.75e-3, rel=1e-4)
    text = calibration_drift.format_table(res)
    assert "1.250x" in text and "20.0%" in text and "25.0%" in text


def _brute_force(passes, i, j):
    """From the JSON's recorded steps alone: pass j over pass i in total and per group, and -- the fits being
    exact, so a pass's fit predicts its own step times -- pass i's times as predictions of pass j's, and back."""
    a, b = passes[i]["samples"], passes[j]["samples"]
    assert [s["seqs"] for s in a] == [s["seqs"] for s in b]
    total = sum(s["time_s"] for s in b) / sum(s["time_s"] for s in a)
    groups = sorted({s["group"] for s in a})
    ratios = [sum(s["time_s"] for s in b if s["group"] == g) / sum(s["time_s"] for s in a if s["group"] == g)
              for g in groups]

    def err(pred, meas):
        rel = [(p["time_s"] - m["time_s"]) / m["time_s"] for p, m in zip(pred, meas)]
        return math.sqrt(sum(e * e for e in rel) / len(rel)), max(map(abs, rel))

    return total, ratios, err(a, b), err(b, a)


def test_the_json_records_steps_that_reproduce_every_comparison(monkeypatch, tmp_path, capsys):
    """Three passes through the command line, on devices that differ unevenly: pass 2 pays twice the fixed cost
    per step (short decode steps slow most, long prompts hardly), pass 3 reads K/V at half the rate (long
    contexts slow most).  Every pair's ratios and cross errors are recomputed from the per-step times the JSON
    recorded.  Kills: the per-group min/median/max taken over steps instead of groups, a pair compared the wrong
    way round, the pairs (1,3) or (2,3) left out, cross errors mixing up which pass predicts which."""
    device, engine = _device_engine()
    monkeypatch.setattr(cal, "real_engine", lambda **kwargs: engine)
    monkeypatch.setattr(cal, "measure_read_bandwidth", lambda *a, **k: pytest.fail("--fit-bandwidth measures none"))
    _passes_on(monkeypatch, device, [TRUTH, replace(TRUTH, step_overhead_s=6e-3), replace(TRUTH, attention_bandwidth=1e9)])
    out = tmp_path / "drift.json"
    argv = ["--passes", "3", "--quick", "--repeats", "1", "--fit-bandwidth", "--out", str(out)]
    assert calibration_drift.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == "python -m minivllm.bench calibration_drift " + " ".join(argv)
    assert {"cpus", "cpu", "python", "torch"} <= set(doc["machine"]) and doc["seconds"] > 0 and doc["date_utc"]
    passes = doc["passes"]
    assert len(passes) == 3 and all(p["rms_rel_error"] < 1e-6 for p in passes)
    assert [(p["earlier"], p["later"]) for p in doc["pairs"]] == [(0, 1), (0, 2), (1, 2)]
    for pair in doc["pairs"]:
        total, ratios, fwd, back = _brute_force(passes, pair["earlier"], pair["later"])
        assert pair["total_ratio"] == pytest.approx(total, rel=1e-9)
        assert sorted(pair["group_ratios"].values()) == pytest.approx(sorted(ratios), rel=1e-9)
        assert pair["group_ratio_min"] == pytest.approx(min(ratios), rel=1e-9)
        assert pair["group_ratio_median"] == pytest.approx(statistics.median(ratios), rel=1e-9)
        assert pair["group_ratio_max"] == pytest.approx(max(ratios), rel=1e-9)
        assert (pair["earlier_fit_on_later"]["rms"], pair["earlier_fit_on_later"]["max_abs"]) == pytest.approx(fwd, rel=1e-4)
        assert (pair["later_fit_on_earlier"]["rms"], pair["later_fit_on_earlier"]["max_abs"]) == pytest.approx(back, rel=1e-4)
    # the uneven changes are really uneven: the groups spread apart, unlike the uniform test's
    assert doc["pairs"][0]["group_ratio_max"] > doc["pairs"][0]["group_ratio_min"] + 0.05
    assert doc["pairs"][1]["group_ratio_max"] > doc["pairs"][1]["group_ratio_min"] + 0.05
    assert "pair" in capsys.readouterr().out


def test_one_pass_is_refused_before_anything_loads(monkeypatch, capsys):
    monkeypatch.setattr(cal, "real_engine", lambda **kwargs: pytest.fail("nothing may load for one pass"))
    with pytest.raises(SystemExit) as exc:
        calibration_drift.main(["--passes", "1"])
    assert exc.value.code == 2 and "at least 2" in capsys.readouterr().err
