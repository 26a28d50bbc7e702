"""Command-line flags that were taken and then dropped, and result paths checked only after the run.

Why these: an operator reads a run that exits 0 as a run that did what its flags said.  Dropped in silence:
``--burstiness`` beside a trace (which keeps its own timestamps) or an infinite rate (which has no gaps), in
``bench serve`` and ``sim run``; ``bench serve --request-rate`` beside ``--rates``; ``sim run``'s ``priority`` and
``deadline`` policies (no simulated request carries either: FCFS's schedule); ``sim calibrate --refit`` with
``--fit-bandwidth``, ``--name``, ``--quick``...; ``bench sim_accuracy --explain`` / ``--resimulate`` with the flags
of a real run (``--explain --out`` wrote nothing) and ``--save-profile`` beside ``--profile``.  Checked too late:
``sim run --out ''`` wrote nothing, and ``sim run``, ``bench fleet`` and ``grade --csv/--json`` given a directory
failed only after the whole run (``results/`` wrote a *file* named ``results``); ``--refit`` rewrote its profile in
place, so a write cut short lost the stored steps.  The oracles: the gamma process's own moments (mean gap
1/rate, coefficient of variation 1/sqrt(shape)) for the flag that must still act, a file's bytes before the run,
and a refusal (exit 2, naming the flag) before anything runs -- each job's costly part is monkeypatched to fail.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from minivllm.bench import loadgen as lg
from tests.test_cli_errors import _argparse_refuses


def _trace(tmp_path) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps({"timestamp": s, "prompt_len": 8, "max_tokens": 4}) for s in range(3)))
    return str(path)


# -- bench serve --burstiness --------------------------------------------------------------------


@pytest.fixture
def planned(monkeypatch):
    """Every plan ``bench serve`` would send, kept instead of sent (no server needed)."""
    plans = []

    async def keep(base_url, plan, tenants, model, *args, **kwargs):
        plans.append([p.arrival for p in plan])
        return lg.RunResult(float("nan"), 1.0, [lg.RequestResult(p.index, p.tenant, p.arrival, p.prompt_len,
                                                                 p.max_tokens) for p in plan])

    monkeypatch.setattr(lg, "run_load", keep)
    return plans


@pytest.mark.parametrize("extra", [["--trace", "TRACE"], [], ["--request-rate", "inf"], ["--rates", "inf"]],
                         ids=["trace", "default-rate", "request-rate-inf", "rates-inf"])
def test_bench_serve_refuses_a_burstiness_nothing_would_shape(planned, tmp_path, capsys, extra):
    """Before: exit 0, the trace's (or all-at-once) arrivals sent as if the flag were absent."""
    argv = ["--model", "m", "--no-progress", "--burstiness", "0.25", *(_trace(tmp_path) if a == "TRACE" else a
                                                                         for a in extra)]
    assert lg.main(argv) == 2
    err = capsys.readouterr().err
    assert "--burstiness" in err and "Traceback" not in err, err
    assert planned == []  # refused before any plan was sent


def test_bench_serve_burstiness_still_shapes_the_finite_rates_of_a_sweep(planned, tmp_path):
    """The refusal is only for a flag that does nothing: in ``--rates 4,inf`` it shapes the finite rate's gaps.
    Gamma gaps of shape k and mean 1/rate have a coefficient of variation 1/sqrt(k): 2 for k = 0.25, and 1
    (Poisson) when the flag is left out, which the result file records as 1."""
    out = tmp_path / "r.json"
    common = ["--model", "m", "--no-progress", "--num-requests", "3000", "--input-len", "1", "--out", str(out)]
    assert lg.main([*common, "--rates", "4,inf", "--burstiness", "0.25"]) == 0
    gaps = np.diff(planned[0])
    assert gaps.mean() == pytest.approx(1 / 4, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)
    assert planned[1] == [0.0] * 3000
    assert json.loads(out.read_text())["config"]["burstiness"] == 0.25
    assert lg.main([*common, "--request-rate", "4"]) == 0
    gaps = np.diff(planned[2])
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.15)
    assert json.loads(out.read_text())["config"]["burstiness"] == 1.0


# -- sim run --------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [["--workload", "TRACE"], ["--request-rate", "inf"]], ids=["trace", "inf"])
def test_sim_run_refuses_a_burstiness_nothing_would_shape(tmp_path, capsys, extra):
    """Before: exit 0, the same simulation as without the flag."""
    from minivllm.sim.run import main

    argv = ["--num-requests", "3", "--burstiness", "0.25", *(_trace(tmp_path) if a == "TRACE" else a for a in extra)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--burstiness" in err and "Traceback" not in err, err


@pytest.mark.parametrize("kind", ["empty", "directory", "new directory"])
def test_sim_run_out_is_checked_before_the_simulation(monkeypatch, tmp_path, capsys, kind):
    """Before: ``--out ''`` ran, wrote nothing and exited 0; a directory (made or not) failed once the whole
    simulation had run."""
    from minivllm.sim import run

    monkeypatch.setattr(run, "run_sim", lambda *a, **k: pytest.fail("the simulation ran before --out was checked"))
    out = {"empty": "", "directory": str(tmp_path), "new directory": str(tmp_path / "results") + "/"}[kind]
    _argparse_refuses(run.main, ["--num-requests", "3", "--out", out], "--out", capsys)
    assert not (tmp_path / "results").exists()


# -- bench fleet ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "new directory"])
def test_fleet_out_is_checked_before_the_sweep(monkeypatch, tmp_path, capsys, kind):
    """Before: ``--out results/`` wrote a file named ``results``; ``--out DIR`` failed after every fleet ran.
    ``--out ''`` stays the default's "print only" (the tests of test_cli_errors run it so)."""
    from minivllm.bench import fleet

    monkeypatch.setattr(fleet, "sweep", lambda *a, **k: pytest.fail("the sweep ran before --out was checked"))
    out = {"directory": str(tmp_path), "new directory": str(tmp_path / "results") + "/"}[kind]
    _argparse_refuses(fleet.main, ["--replicas", "1", "--routers", "round_robin", "--out", out], "--out", capsys)
    assert not (tmp_path / "results").exists()


# -- sim calibrate --refit --------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [["--fit-bandwidth"], ["--name", "renamed"], ["--quick"], ["--repeats", "5"],
                                   ["--force"], ["--clock", "cpu"], ["--device", "cpu"]], ids=lambda f: f[0])
def test_refit_refuses_the_flags_it_would_drop(tmp_path, capsys, flags):
    """Before: exit 0 and a profile byte for byte the one a plain ``--refit`` writes (the bandwidth still pinned
    to the measured one, the name kept), as ``--residuals`` and ``--check`` already refuse them."""
    from minivllm.sim import calibrate
    from minivllm.sim.presets import profile_path

    out = tmp_path / "refit.json"
    assert calibrate.main(["--refit", profile_path("cpu-2core"), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert flags[0] in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("policy", ["priority", "deadline", "caps"])
def test_sim_run_does_not_offer_policies_its_requests_cannot_steer(capsys, policy):
    """No simulated request (a named workload's, a ``--tenant`` spec's or a trace line's) carries a priority or a
    deadline, so ``priority`` and ``deadline`` ran FCFS's schedule step for step and exited 0 (``bursty`` on an L4,
    300 requests: the same 418 steps and TTFT percentiles as ``fcfs``); ``caps`` needs a tenant cap, which no
    flag of ``sim run`` gives, so it could only fail once the workload was built.  As ``serve`` does, argparse
    refuses them and the help says why."""
    from minivllm.sim.run import _parser, main

    err = _argparse_refuses(main, ["--num-requests", "3", "--scheduling-policy", policy], "--scheduling-policy",
                               capsys)
    assert "fcfs" in err
    help_text = next(a.help for a in _parser()._actions if "--scheduling-policy" in a.option_strings)
    assert policy in help_text


@pytest.mark.parametrize("rate", ["5", "inf"])
def test_bench_serve_takes_one_rate_flag_not_both(planned, capsys, rate):
    """``--request-rate 5 --rates 1,2`` swept 1 and 2 req/s and exited 0: the 5 was dropped in silence (its default
    is a number, so the code could not tell it was given).  argparse refuses the pair before anything is planned."""
    with pytest.raises(SystemExit) as exc:
        lg.main(["--model", "m", "--no-progress", "--request-rate", rate, "--rates", "1,2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--request-rate" in err and "--rates" in err and "not allowed" in err, err
    assert planned == []


# -- grade --csv / --json ---------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--csv", "--json"])
@pytest.mark.parametrize("kind", ["directory", "new directory"])
def test_grade_refuses_a_directory_to_write_before_grading(monkeypatch, tmp_path, capsys, flag, kind):
    """Before: every notebook was graded (a kernel per lab, minutes), then ``open(DIR)`` raised IsADirectoryError;
    ``results/`` wrote a file named ``results``."""
    from minivllm.labs import grade

    monkeypatch.setattr(grade, "grade_notebook", lambda *a, **k: pytest.fail("graded before the target was checked"))
    nb = tmp_path / "nb.ipynb"
    nb.write_text("{}")
    target = {"directory": str(tmp_path), "new directory": str(tmp_path / "results") + "/"}[kind]
    assert grade.main([str(nb), "--quiet", "--seed", "1", flag, target]) == 2
    err = capsys.readouterr().err
    assert flag in err and "is a directory" in err and "Traceback" not in err, err
    assert not (tmp_path / "results").exists()


def test_a_refit_cut_short_leaves_the_profile_it_replaces_whole(monkeypatch, tmp_path, capsys):
    """``--refit PROFILE`` without ``--out`` writes back onto PROFILE, whose stored steps are what a re-measure
    would cost (15 minutes of a lent GPU).  It wrote in place: a write cut short by a full disk left half a JSON
    file and the steps were gone.  Oracle: the bytes of the file before the run (a refused write must not touch
    them)."""
    import shutil

    from minivllm.sim import calibrate
    from minivllm.sim.presets import profile_path

    src = tmp_path / "mine.json"
    shutil.copy(profile_path("cpu-2core"), src)
    before = src.read_bytes()
    real_dump = json.dump

    def full_disk(obj, fh, **kwargs):
        real_dump({"half": "written"}, fh)  # some bytes reach the file, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full_disk)
    assert calibrate.main(["--refit", str(src)]) == 2
    assert "No space left" in capsys.readouterr().err
    assert src.read_bytes() == before


# -- bench sim_accuracy --explain / --resimulate / --save-profile ----------------------------------------


_H200 = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
_H200_RESULT = str(_H200 / "2026-11-30_nvidia-h200_sim_accuracy_llama1b_run2.json")
_H200_PROFILE = str(_H200 / "2026-11-30_nvidia-h200_llama1b_profile_run2.json")


@pytest.mark.parametrize("job,flags", [
    ("--explain", ["--out", "OUT"]),  # printed the table, wrote nothing, exit 0
    ("--explain", ["--scale", "0.3"]),
    ("--resimulate", ["--scale", "0.25"]),  # the stored result's own scale and workloads were re-simulated
    ("--resimulate", ["--workload", "decode_heavy"]),
    ("--resimulate", ["--save-profile", "OUT"]),  # no calibration is made to save
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_sim_accuracy_jobs_that_run_no_engine_refuse_the_flags_of_one(monkeypatch, tmp_path, capsys, job, flags):
    """Before: exit 0 and the same result as without the flag (``--resimulate ... --scale 0.25 --workload
    decode_heavy --save-profile P`` wrote a result equal, but for its time stamps, to a plain ``--resimulate``;
    P was never written).  Oracle: the job's own contract, "run nothing" / "re-simulate this stored result"."""
    from minivllm.bench import sim_accuracy

    monkeypatch.setattr(sim_accuracy, "explain", lambda *a, **k: pytest.fail("explained despite a dropped flag"))
    monkeypatch.setattr(sim_accuracy, "resimulate", lambda *a, **k: pytest.fail("re-simulated despite a dropped flag"))
    out = tmp_path / "out.json"
    argv = [job, _H200_RESULT, "--profile", _H200_PROFILE, *(str(out) if f == "OUT" else f for f in flags)]
    with pytest.raises(SystemExit) as exc:
        sim_accuracy.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"drop {flags[0]}" in err and "Traceback" not in err, err
    assert not out.exists()


def test_sim_accuracy_save_profile_beside_a_profile_is_refused(monkeypatch, tmp_path, capsys):
    """``--save-profile`` writes the calibration this run makes; with ``--profile`` none is made, and the run went
    on (minutes of the real engine) to write no profile, exit 0."""
    from minivllm.bench import sim_accuracy

    monkeypatch.setattr(sim_accuracy, "run", lambda *a, **k: pytest.fail("the benchmark ran"))
    with pytest.raises(SystemExit) as exc:
        sim_accuracy.main(["--profile", "cpu-2core", "--save-profile", str(tmp_path / "p.json")])
    assert exc.value.code == 2
    assert "--save-profile" in capsys.readouterr().err


def test_sim_run_refuses_a_request_count_a_trace_would_ignore(tmp_path, capsys):
    """Before: ``--num-requests 5`` beside a trace ran the trace's every line, exit 0 (the flag's default was a
    number, so a count given could not be told from none).  Now a count given with a trace is refused where the
    requests are built, a trace alone still runs all its lines, and a generated workload still defaults to 1000."""
    from minivllm.sim import run

    trace = ["--workload", _trace(tmp_path)]
    assert run.main(["--num-requests", "5", *trace]) == 2
    err = capsys.readouterr().err
    assert "--num-requests" in err and "Traceback" not in err, err
    lines = sum(1 for line in open(trace[1], encoding="utf-8") if line.strip())
    reqs, _, _ = run.build_requests(run._parser().parse_args(trace), vocab_size=1000)
    assert len(reqs) == lines
    reqs, _, _ = run.build_requests(run._parser().parse_args(["--request-rate", "5"]), vocab_size=1000)
    assert len(reqs) == 1000
