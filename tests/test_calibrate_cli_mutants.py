"""Mutation hunt on the ``minivllm sim calibrate`` command line: ``--force``, ``--refit`` with ``--out`` and
``--quick`` could each be ignored with every test still passing.  No test here measures anything: the engine
and the measuring ``calibrate`` are replaced by fakes, so each flag's effect is read from what the command
wrote, refused or asked for.  Each test names the mutant it kills and its oracle."""

import json

import pytest

import minivllm.sim.calibrate as cal
from minivllm.cli import main as cli_main
from tests.test_calibrate_mutants import toy_profile

# A profile as calibrate returns it, cut to what the command prints (format_profile, fit_warning) and writes.
FAKE_DOC = {"hardware": {"name": "mine", "step_overhead_s": 4e-3, "seq_overhead_s": 0.3e-3, "peak_flops": 60e9,
                         "attention_flops": 25e9, "mem_bandwidth": 12e9, "attention_bandwidth": 3e9, "roof_p": None},
            "fit": {"steps": 20, "rms_rel_error": 0.031, "max_abs_rel_error": 0.087, "seconds": 1.0}}


def _fake_measuring(monkeypatch, tmp_path):
    """Replace the engine and the minutes of measuring, and put the default profile path under ``tmp_path`` (a
    flag ignored must not write beside the committed profiles); return the list of ``calibrate`` calls' kwargs."""
    calls = []

    def fake_calibrate(engine, **kwargs):
        calls.append(kwargs)
        return json.loads(json.dumps(FAKE_DOC))

    monkeypatch.setattr(cal, "real_engine", lambda **kw: "engine")
    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    monkeypatch.setattr(cal, "default_out", lambda name: str(tmp_path / f"{name}.json"))
    return calls


def test_force_lets_the_default_out_replace_an_existing_profile(monkeypatch, tmp_path, capsys):
    """``--force`` is the one way to overwrite the default profile path (the help's promise).  Hand case: the
    default path holds "old"; without ``--force`` the command refuses before measuring (exit 2, no call); with
    it, it measures once and the file holds the new profile.  Kills: ``--force`` ignored (both refuse)."""
    calls = _fake_measuring(monkeypatch, tmp_path)
    target = tmp_path / "mine.json"
    target.write_text("old")
    assert cal.main(["--name", "mine"]) == 2
    assert "exists" in capsys.readouterr().err and calls == [] and target.read_text() == "old"
    assert cal.main(["--name", "mine", "--force"]) == 0
    assert len(calls) == 1 and json.loads(target.read_text()) == FAKE_DOC
    assert f"wrote {target}" in capsys.readouterr().out


def test_refit_with_out_writes_there_and_leaves_the_source_profile_alone(monkeypatch, tmp_path, capsys):
    """``--refit PROFILE`` writes back to PROFILE "unless --out" (the help): with ``--out`` the source must stay
    byte for byte, and the new file holds the same samples re-fitted: ten steps timed exactly by a spec of the
    model's own form give back its GEMM rate, 60 GFLOP/s.  Kills:
    the refit writing to PROFILE whatever ``--out`` says (the new file missing, the source overwritten)."""
    monkeypatch.setattr(cal, "real_engine", lambda **kw: (_ for _ in ()).throw(AssertionError("measured")))
    src, dst = tmp_path / "a.json", tmp_path / "b.json"
    src.write_text(json.dumps(toy_profile()))
    before = src.read_bytes()
    assert cal.main(["--refit", str(src), "--out", str(dst)]) == 0
    assert src.read_bytes() == before
    got = json.loads(dst.read_text())
    old = json.loads(before)["samples"]
    assert [(s["seqs"], s["time_s"]) for s in got["samples"]] == [(s["seqs"], s["time_s"]) for s in old]
    assert got["fit"]["steps"] == 10 and got["hardware"]["peak_flops"] == pytest.approx(60e9, rel=1e-3)
    assert f"wrote {dst}" in capsys.readouterr().out


def test_quick_asks_for_the_smaller_grid(monkeypatch, tmp_path):
    """``--quick`` is "a smaller grid" (the help).  Hand count of ``calibration_grid``: 7 lone prefills + 2
    multi-prefill groups + 2 mixed groups + 11 decode batches = 22 groups whose decodes run 8 steps; the quick
    grid drops the two decode batches over 2048 tokens (12 x 384, 4 x 1024) -> 20 groups, and its decodes run
    max(3, round(8 * scale)) = 3 steps.  Read through ``minivllm sim calibrate`` itself (cli.py passes the
    flags on).  Kills: ``--quick`` ignored (the full 22-group grid measured)."""
    calls = _fake_measuring(monkeypatch, tmp_path)
    for flags in ([], ["--quick"]):
        assert cli_main(["sim", "calibrate", "--out", str(tmp_path / "p.json"), *flags]) == 0
    full, quick = (cal.calibration_grid(scale=c["scale"]) for c in calls)
    assert (len(full), len(quick)) == (22, 20)
    assert {g[0].max_tokens for g in full[-11:]} == {8}
    assert {g[0].max_tokens for g in quick[-9:]} == {3}


def test_the_measuring_flags_reach_the_calibration_and_the_profile_lands_at_out(monkeypatch, tmp_path):
    """Each flag's help is a promise about the measurement: ``--name`` names the profile, ``--repeats N`` times
    every group N times, ``--fit-bandwidth`` fits the memory roof instead of pinning it, and ``--out PATH`` is
    where the profile goes -- so an existing profile at the default path (toy.json) neither blocks it nor is
    touched.  Hand case: ``--name toy --repeats 5 --fit-bandwidth --out p.json`` -> one calibration asked for
    name "toy", 5 repeats, an unpinned bandwidth, and p.json holding what it returned.  Kills: each of the four
    flags ignored (the default path written instead of --out, where the tests' committed profiles live), and
    the "exists" refusal applied to an explicit --out too."""
    calls = _fake_measuring(monkeypatch, tmp_path)
    out = tmp_path / "p.json"
    (tmp_path / "toy.json").write_text("committed")
    assert cal.main(["--name", "toy", "--repeats", "5", "--fit-bandwidth", "--out", str(out)]) == 0
    assert [(c["name"], c["repeats"], c["pin_bandwidth"]) for c in calls] == [("toy", 5, False)]
    assert json.loads(out.read_text()) == FAKE_DOC and not (tmp_path / "mine.json").exists()
    assert (tmp_path / "toy.json").read_text() == "committed"
