"""The gaps tests/test_cli_gaps.py named and left open, each closed where a user meets it.

1. A flag that only one mode reads, given under a mode that never reads it, was dropped in silence: its default
   was a value, so a flag given could not be told from one left alone.  Its parser default is now None (the value
   its ``--help`` states is put in where it is read), and given where nothing reads it, argparse refuses it with a
   one-line error naming it and the flag that chose the mode.  Left alone, every mode runs with the value it read
   before (the second half of each pair of tests).  ``bench sim_accuracy --explain`` / ``--resimulate`` refused a
   real run's flag only when its value differed from the default (``--scale 1.0`` was dropped); they refuse each
   one given now, whatever its value (stop 73).
2. A ``HardwareSpec`` field of the wrong type (``roof_p="2"``, a list for ``flops_dtype_bytes``, a number for
   ``name``) escaped as a ``TypeError`` (a traceback, or, through a profile, a message naming no field); a bool
   passed for a number (``flops_dtype_bytes=True`` simulated an fp8 device).  Each is a one-line ValueError
   naming the field, and so are the fields :func:`~minivllm.sim.presets.profile_spec` reads beside it.
3. A profile or ``--hardware`` path was quoted whole in an error: a 3,000-character path made a 3,000-character
   message.  It is cut in the middle now, so the message still ends with the file's name; ``sim_accuracy
   --explain`` / ``--resimulate`` printed a missing result file's OSError, the path whole in it (stop 73).

The oracles are the command line typed (what the operator asked for: the mode and the flag it cannot honour),
the values the old parser defaults held (copied here by hand from the code before the change), and, for the
messages, their length, their one line and the file name they must keep.  No model is loaded and nothing is
measured: each command stops at a stand-in where it would start its work.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import sys

import pytest

from minivllm.argtypes import PATH_CHARS


class _Ran(Exception):
    """Raised by a stand-in where the command would start its work: what it was handed rides along."""


@pytest.fixture
def parsed(monkeypatch):
    """Every namespace a parser hands back during the test (the command's own ``args``, filled in after)."""
    seen = []
    real = argparse.ArgumentParser.parse_args

    def keep(self, *a, **k):
        seen.append(real(self, *a, **k))
        return seen[-1]

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    return seen


def _stop(monkeypatch, module, *names):
    """Replace each ``module.name`` with a stand-in that raises :class:`_Ran` with its arguments."""
    for name in names:
        def stand_in(*a, _name=name, **k):
            raise _Ran(_name, a, k)

        monkeypatch.setattr(module, name, stand_in)


def _bench_serve(monkeypatch, argv):
    from minivllm.bench import loadgen

    _stop(monkeypatch, loadgen, "run_benchmark")
    return lambda: loadgen.main(["--model", "m", "--no-progress", *argv])


def _fleet(monkeypatch, argv):
    from minivllm.bench import fleet

    _stop(monkeypatch, fleet, "ChatMix")
    return lambda: fleet.main(argv)


def _sim_accuracy(monkeypatch, argv):
    from minivllm.bench import sim_accuracy

    _stop(monkeypatch, sim_accuracy, "run")
    return lambda: sim_accuracy.main(argv)


def _argv(monkeypatch, prog, argv, main):
    monkeypatch.setattr(sys, "argv", [prog, *argv])
    return main


def _offline(monkeypatch, argv):
    import minivllm
    from minivllm.bench import offline

    _stop(monkeypatch, minivllm, "LLM")  # (imported inside main)
    return _argv(monkeypatch, "offline", argv, offline.main)


def _gpu_e2e(monkeypatch, argv):
    from minivllm.bench import gpu_e2e

    _stop(monkeypatch, gpu_e2e, "parity_main", "nano_main")

    def make_model_dir(path, arch):  # a run writes its model to a temporary folder first: that goes on
        if path == "out":  # (--save-model out: the whole job)
            raise _Ran("make_model_dir", (path, arch), {})

    monkeypatch.setattr(gpu_e2e, "make_model_dir", make_model_dir)
    return _argv(monkeypatch, "gpu_e2e", argv, gpu_e2e.main)


def _fairness(monkeypatch, argv):
    from minivllm.bench import fairness

    _stop(monkeypatch, fairness, "calibrate_main", "noisy_quiet_section", "backlogged_section", "three_class_section",
          "shared_prefix_section")
    return _argv(monkeypatch, "fairness", argv, fairness.main)


def _host_overhead(monkeypatch, argv):
    from minivllm.bench import host_overhead

    _stop(monkeypatch, host_overhead, "measure", "sweep", "backlog")
    monkeypatch.setattr(host_overhead.torch, "set_num_threads", lambda n: None)  # (the test process keeps its own)
    return _argv(monkeypatch, "host_overhead", argv, host_overhead.main)


def _lab_times(monkeypatch, argv):
    from minivllm.bench import lab_times

    _stop(monkeypatch, lab_times, "run_notebook")
    return lambda: lab_times.main(argv)


def _sim_run(monkeypatch, argv):
    from minivllm.sim import run

    _stop(monkeypatch, run, "run_sim")
    return lambda: run.main(["--num-requests", "3", *argv])


RUNNERS = {"bench serve": _bench_serve, "fleet": _fleet, "sim_accuracy": _sim_accuracy, "offline": _offline,
           "gpu_e2e": _gpu_e2e, "fairness": _fairness, "host_overhead": _host_overhead, "lab_times": _lab_times,
           "sim run": _sim_run}


def _notebook(tmp_path) -> str:
    path = tmp_path / "lab01.ipynb"
    path.write_text("{}")
    return str(path)


# (command, argv, the flag refused, the flag that chose the mode); "{nb}" is an existing notebook file
REFUSED = [
    ("bench serve", ["--sweep-criterion", "goodput"], "--sweep-criterion", "--rates"),
    ("bench serve", ["--sweep-criterion", "itl", "--slo-itl-ms", "50"], "--sweep-criterion", "--rates"),
    ("bench serve", ["--rates", "2", "--sweep-criterion", "goodput"], "--sweep-criterion", "--rates"),  # one rate
    ("bench serve", ["--min-goodput", "0.5"], "--min-goodput", "--rates"),
    ("bench serve", ["--rates", "1,2", "--min-goodput", "0.5", "--slo-itl-ms", "50"], "--min-goodput",
     "--sweep-criterion"),
    ("bench serve", ["--rates", "1,2", "--sweep-criterion", "itl", "--min-goodput", "0.5", "--slo-itl-ms", "50"],
     "--min-goodput", "--sweep-criterion itl"),
    ("bench serve", ["--rates", "1,2", "--sweep-criterion", "itl"], "--sweep-criterion", "--slo-itl-ms"),
    ("bench serve", ["--slo-itl-stat", "max"], "--slo-itl-stat", "--slo-itl-ms"),
    ("bench serve", ["--slo-itl-stat", "p99", "--slo-ttft-ms", "100"], "--slo-itl-stat", "--slo-itl-ms"),
    ("bench serve", ["--no-requests-in-json"], "--no-requests-in-json", "--out"),
    ("sim run", ["--no-requests-in-json"], "--no-requests-in-json", "--out"),
    ("fleet", ["--hardware", "linear", "--model", "llama-3.2-1b"], "--model", "--hardware linear"),
    ("fleet", ["--hardware", "linear", "--model", "llama-3-8b"], "--model", "--hardware linear"),  # its default
    ("sim_accuracy", ["--profile", "cpu-2core", "--calibration-repeats", "5"], "--calibration-repeats", "--profile"),
    ("sim_accuracy", ["--profile", "cpu-2core", "--calibration-repeats", "3"], "--calibration-repeats", "--profile"),
    ("sim_accuracy", ["--profile", "cpu-2core", "--save-profile", "p.json"], "--save-profile", "--profile"),
    # a run's flags beside a job that runs no engine, each typed with the value a run reads when it is left alone
    # (refused before only when the value differed: ``--scale 1.0`` was dropped in silence)
    ("sim_accuracy", ["--explain", "r.json", "--scale", "1.0"], "--scale", "--explain"),
    ("sim_accuracy", ["--explain", "r.json", "--real-repeats", "2"], "--real-repeats", "--explain"),
    ("sim_accuracy", ["--explain", "r.json", "--clock", "wall"], "--clock", "--explain"),
    ("sim_accuracy", ["--explain", "r.json", "--calibration-repeats", "3"], "--calibration-repeats", "--explain"),
    ("sim_accuracy", ["--resimulate", "r.json", "--profile", "cpu-2core", "--scale", "1"], "--scale", "--resimulate"),
    ("sim_accuracy", ["--resimulate", "r.json", "--profile", "cpu-2core", "--device", "auto"], "--device",
     "--resimulate"),
    ("sim_accuracy", ["--resimulate", "r.json", "--profile", "cpu-2core", "--dtype", "auto"], "--dtype",
     "--resimulate"),
    ("sim_accuracy", ["--resimulate", "r.json", "--profile", "cpu-2core", "--live-heap"], "--live-heap",
     "--resimulate"),
    ("offline", ["--skip-hf", "--hf-batch", "4"], "--hf-batch", "--skip-hf"),
    ("offline", ["--skip-hf", "--hf-batch", "8"], "--hf-batch", "--skip-hf"),
    ("gpu_e2e", ["--hf-batch", "64"], "--hf-batch", "--workload nano"),
    ("gpu_e2e", ["--workload", "parity", "--requests", "8", "--scale", "0.5"], "--requests", "--workload nano"),
    ("gpu_e2e", ["--workload", "nano", "--prompts", "8"], "--prompts", "--workload nano"),
    ("gpu_e2e", ["--workload", "nano", "--max-tokens", "8"], "--max-tokens", "--workload nano"),
    ("gpu_e2e", ["--save-model", "out", "--device", "cpu"], "--save-model", "--device"),
    ("gpu_e2e", ["--save-model", "out", "--workload", "nano", "--hf-batch", "8"], "--save-model", "--hf-batch"),
    ("fairness", ["--sections", "noisy_quiet", "--prefix-seeds", "5"], "--prefix-seeds", "--sections"),
    ("fairness", ["--sections", "three_class", "shared_prefix", "--policies", "wfq"], "--policies", "--sections"),
    ("fairness", ["--sections", "backlogged", "--duration", "10"], "--duration", "--sections"),
    ("fairness", ["--calibrate", "--prefix-seeds", "3"], "--prefix-seeds", "--calibrate"),
    ("fairness", ["--calibrate", "--seed", "1"], "--seed", "--calibrate"),
    ("host_overhead", ["--prompt-len", "32"], "--prompt-len", "--sweep"),
    ("host_overhead", ["--prefix-cache", "radix"], "--prefix-cache", "--sweep"),
    ("host_overhead", ["--sweep", "16", "--kinds", "delta"], "--kinds", "--sweep"),
    ("host_overhead", ["--sweep", "16", "--backlog-policy", "wfq"], "--backlog-policy", "--sweep"),
    ("host_overhead", ["--backlog", "16", "--seqs", "8"], "--seqs", "--backlog"),
    ("host_overhead", ["--backlog", "16", "--prompt-len", "64"], "--prompt-len", "--backlog"),
    ("host_overhead", ["--warmup", "0", "--backlog", "16"], "--warmup", "--backlog"),  # 0 is given too
    ("host_overhead", ["--backlog-policy", "fcfs"], "--backlog-policy", "--backlog"),
    ("lab_times", ["{nb}", "--solutions"], "--solutions", "notebooks named"),
]


@pytest.mark.parametrize("command,argv,flag,chose", REFUSED,
                         ids=[f"{c}:{' '.join(a)}" for c, a, _, _ in REFUSED])
def test_a_flag_the_chosen_mode_never_reads_is_refused(monkeypatch, tmp_path, capsys, command, argv, flag, chose):
    """Before: each ran (or stopped at the stand-in) with the flag dropped, exit 0 or the stand-in reached.  Now:
    argparse's exit 2 before anything runs, one line naming the flag and the one that chose the mode."""
    monkeypatch.chdir(tmp_path)
    argv = [_notebook(tmp_path) if a == "{nb}" else a for a in argv]
    main = RUNNERS[command](monkeypatch, argv)
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and f"argument {flag}:" in line and chose in line, err


# (command, argv, stand-in that must be reached, {name: the value the command reads}); the values left alone are
# the old parser defaults, copied from the code before the change
ACCEPTED = [
    ("bench serve", ["--rates", "1,2", "--sweep-criterion", "goodput", "--min-goodput", "0.5", "--slo-itl-ms", "50",
                     "--slo-itl-stat", "max", "--out", "r.json", "--no-requests-in-json"], "run_benchmark",
     {"sweep_criterion": "goodput", "min_goodput": 0.5, "slo_itl_stat": "max", "no_requests_in_json": True}),
    ("bench serve", ["--rates", "1,2", "--sweep-criterion", "itl", "--slo-itl-ms", "50"], "run_benchmark",
     {"sweep_criterion": "itl"}),
    ("fleet", [], "ChatMix", {"model": "llama-3-8b", "hardware": "l4"}),
    ("fleet", ["--hardware", "linear"], "ChatMix", {"hardware": "linear"}),
    ("fleet", ["--model", "llama-3.2-1b"], "ChatMix", {"model": "llama-3.2-1b"}),
    ("sim_accuracy", [], "run", {"calibration_repeats": 3}),
    ("sim_accuracy", ["--calibration-repeats", "5"], "run", {"calibration_repeats": 5}),
    ("sim_accuracy", ["--profile", "cpu-2core"], "run", {"profile": "cpu-2core"}),
    ("sim_accuracy", [], "run", {"scale": 1.0, "clock": "wall", "real_repeats": 2, "device": "auto", "dtype": "auto",
                                 "workload": None, "save_profile": None, "model": None, "live_heap": False}),
    ("sim_accuracy", ["--scale", "1.0", "--real-repeats", "2", "--clock", "cpu", "--device", "cpu", "--dtype",
                      "float32", "--workload", "decode_heavy", "--live-heap"], "run",
     {"scale": 1.0, "real_repeats": 2, "clock": "cpu", "device": "cpu", "dtype": "float32",
      "workload": ("decode_heavy",), "live_heap": True}),
    ("offline", [], "LLM", {"hf_batch": 8}),
    ("offline", ["--hf-batch", "4"], "LLM", {"hf_batch": 4}),
    ("offline", ["--skip-hf"], "LLM", {"skip_hf": True}),
    ("gpu_e2e", ["--device", "cpu"], "parity_main",
     {"workload": "parity", "prompts": 16, "max_tokens": 64, "max_prompt_len": 1500, "dtype": "bfloat16"}),
    ("gpu_e2e", ["--device", "cpu", "--workload", "nano"], "nano_main",
     {"requests": 256, "hf_batch": 32, "hf_requests": 0, "scale": 1.0, "backends": ("torch", "triton", "triton-eager")}),
    ("gpu_e2e", ["--device", "cpu", "--workload", "nano", "--hf-batch", "64", "--hf-requests", "0"], "nano_main",
     {"hf_batch": 64, "hf_requests": 0}),
    ("gpu_e2e", ["--save-model", "out", "--arch", "tiny"], "make_model_dir", {"arch": "tiny"}),  # gpu_checks.sh's
    ("fairness", [], "noisy_quiet_section",
     {"duration": 40.0, "seed": 0, "prefix_seeds": 3, "policies": ("fcfs", "priority", "caps", "wfq", "deadline"),
      "sections": ("noisy_quiet", "backlogged", "three_class", "shared_prefix")}),
    ("fairness", ["--sections", "shared_prefix", "--prefix-seeds", "5", "--seed", "2"], "shared_prefix_section",
     {"prefix_seeds": 5, "seed": 2}),
    ("fairness", ["--sections", "three_class", "--duration", "10"], "three_class_section", {"duration": 10.0}),
    ("fairness", ["--calibrate", "--out", "c.json"], "calibrate_main", {"out": "c.json"}),
    ("host_overhead", [], "measure", {"seqs": 256, "warmup": 16, "later": 400, "kinds": ("final_only", "delta", "cumulative")}),
    ("host_overhead", ["--sweep", "16"], "sweep", {"seqs": 256, "prompt_len": 64, "prefix_cache": "off"}),
    ("host_overhead", ["--backlog", "16", "--samples", "3"], "backlog", {"backlog_policy": "three_class", "samples": 3}),
    ("lab_times", ["{nb}"], "run_notebook", {"solutions": False}),
    ("sim run", ["--no-requests-in-json", "--out", "r.json"], "run_sim", {"no_requests_in_json": True}),
]


@pytest.mark.parametrize("command,argv,stop,want", ACCEPTED, ids=[f"{c}:{' '.join(a)}" for c, a, _, _ in ACCEPTED])
def test_each_mode_still_runs_with_the_values_it_read_before(monkeypatch, tmp_path, parsed, command, argv, stop,
                                                            want):
    """A flag its mode reads is taken as given, and one left alone is the old default (its help's)."""
    monkeypatch.chdir(tmp_path)
    argv = [_notebook(tmp_path) if a == "{nb}" else a for a in argv]
    main = RUNNERS[command](monkeypatch, argv)
    with pytest.raises(_Ran) as ran:
        main()
    assert ran.value.args[0] == stop
    args = parsed[-1]
    got = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(args).items() if k in want}
    assert got == want


def test_bench_serve_reads_the_sweep_flags_as_before(monkeypatch):
    """``bench serve`` puts its defaults in where the sweep reads them (``run_benchmark``): a sweep with an ITL SLO is
    judged by the itl criterion with the 90% goodput and p99 statistic it had; given, each is what was typed.
    The server is a stand-in that answers nothing (an empty run); the verdict is where the run stops."""
    from minivllm.bench import loadgen

    async def no_load(base_url, plan, tenants, model, *a, rate=float("nan"), **k):
        return loadgen.RunResult(rate, 1.0, [])

    stats = []
    real_summarize = loadgen.summarize

    def summarize(run, slo_ttft=None, slo_itl=None, itl_stat="p99"):
        stats.append(itl_stat)
        return real_summarize(run, slo_ttft, slo_itl, itl_stat)

    def verdict(summaries, criterion, slo_ttft, slo_itl, min_goodput):
        raise _Ran(criterion, min_goodput)

    monkeypatch.setattr(loadgen, "run_load", no_load)
    monkeypatch.setattr(loadgen, "summarize", summarize)
    monkeypatch.setattr(loadgen, "sweep_verdict", verdict)
    base = ["--model", "m", "--no-progress", "--num-requests", "1", "--rates", "1,2"]
    for extra, want, stat in [
        (["--slo-itl-ms", "50"], ("itl", 0.9), "p99"),
        (["--sweep-criterion", "goodput"], ("goodput", 0.9), "p99"),
        (["--sweep-criterion", "goodput", "--min-goodput", "0.5", "--slo-itl-ms", "50", "--slo-itl-stat", "max"],
         ("goodput", 0.5), "max"),
        (["--sweep-criterion", "itl", "--slo-itl-ms", "50"], ("itl", 0.9), "p99"),
    ]:
        stats.clear()
        with pytest.raises(_Ran) as ran:
            loadgen.run_benchmark(loadgen._parser().parse_args([*base, *extra]), out=io.StringIO())
        assert ran.value.args == want and set(stats) == {stat}, extra


@pytest.mark.parametrize("flag", ["--sweep-criterion", "--min-goodput", "--slo-itl-stat"])
def test_bench_serve_help_states_the_default_it_puts_in(flag):
    """The default is stated where a user reads it, and it is the one run_benchmark puts in (the old one)."""
    from minivllm.bench import loadgen

    old = {"--sweep-criterion": "itl", "--min-goodput": "0.9", "--slo-itl-stat": "p99"}[flag]
    assert f"(default {old})" in " ".join(loadgen._parser()._option_string_actions[flag].help.split())


def test_gpu_checks_script_gives_calibration_repeats_only_where_a_calibration_runs():
    """tools/gpu_checks.sh's step 7 (``sim_accuracy --live-heap --profile ...``) took the repeats of step 5's
    calibration, which it never makes; with the refusal above it would exit 2 on a GPU lease.  Oracle: the
    script's own text, step by step."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "tools" / "gpu_checks.sh").read_text()
    steps = {line.split()[1]: line for line in text.replace("\\\n", " ").splitlines() if line.startswith("step ")}
    assert "--profile" in steps["sim_accuracy_live"] and "CAL[@]" not in steps["sim_accuracy_live"]
    assert "--profile" not in steps["sim_accuracy"] and "CAL[@]" in steps["sim_accuracy"]
    sim = [line for line in text.splitlines() if line.strip().startswith("SIM=")]
    assert sim and not any("--calibration-repeats" in line.split("CAL=")[0] for line in sim), sim


# -- 2. HardwareSpec and profile fields of the wrong type ------------------------------------------------------


def _hw(**changes):
    from minivllm.sim import presets
    from minivllm.sim.roofline import HardwareSpec

    return lambda: HardwareSpec(**{**dataclasses.asdict(presets.HARDWARE["h100"]), **changes})


@pytest.mark.parametrize("field,value", [
    ("roof_p", "2"), ("roof_p", [2]), ("roof_p", True), ("roof_p", float("inf")), ("roof_p", float("nan")),
    ("flops_dtype_bytes", "2"), ("flops_dtype_bytes", [2]), ("flops_dtype_bytes", True), ("flops_dtype_bytes", 2.0),
    ("flops_dtype_bytes", None), ("name", 5), ("name", None), ("notes", 5), ("notes", ["x"]),
])
def test_a_hardware_field_of_the_wrong_type_is_a_one_line_value_error_naming_it(field, value):
    """Before: a TypeError (a str or list in a comparison or a dict lookup) or, for True, a spec of an fp8 device
    (``True == 1``) or a p-norm of 1; ``name=5`` reached ``.lower()`` in profile_spec.  A bool is no number here,
    as :func:`~minivllm.argtypes.is_real` says for every other field."""
    with pytest.raises(ValueError) as exc:
        _hw(**{field: value})()
    message = str(exc.value)
    assert f"HardwareSpec.{field}" in message and "\n" not in message and len(message) < 300, message


def test_the_well_typed_hardware_values_still_pass():
    assert _hw(roof_p=1)().roof_p == 1 and _hw(roof_p=2.5)().roof_p == 2.5
    assert _hw(flops_dtype_bytes=0)().flops_dtype_bytes == 0 and _hw(flops_dtype_bytes=1)().flops_dtype_bytes == 1
    assert _hw(notes="fitted")().notes == "fitted"


@pytest.mark.parametrize("factor", ["2", True, float("inf")])
def test_slowed_refuses_a_factor_that_is_no_number(factor):
    from minivllm.sim import presets

    with pytest.raises(ValueError, match="factor must be a finite number > 0"):
        presets.HARDWARE["h100"].slowed(factor)


def _profile(tmp_path, **changes):
    """A GPU profile of an H200 (a datasheet preset by name, so profile_spec reads its model's dtype)."""
    from minivllm.sim import presets

    hw = dataclasses.asdict(presets.HARDWARE["h200"])
    doc = {"device": "cuda", "hardware": {**hw, "name": "NVIDIA H200", "flops_dtype_bytes": 0},
           "model": {"dtype_bytes": 2}}
    for key, value in changes.items():
        if key.startswith("hardware."):
            doc["hardware"][key.split(".", 1)[1]] = value
        elif key == "dtype_bytes":
            doc["model"]["dtype_bytes"] = value
        else:
            doc[key] = value
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("changes,named", [
    ({"hardware.roof_p": "2"}, "HardwareSpec.roof_p"),             # was "bad HardwareSpec field: '>=' not ..."
    ({"hardware.flops_dtype_bytes": [2]}, "HardwareSpec.flops_dtype_bytes"),  # was "unhashable type: 'list'"
    ({"hardware.name": 7}, "HardwareSpec.name"),                   # was an AttributeError traceback
    ({"device": ["cuda"]}, "profile device"),                      # was read as a GPU profile
    ({"model": ["llama"]}, "profile model"),                       # was an AttributeError traceback
    ({"dtype_bytes": True}, "profile model.dtype_bytes"),          # was an fp8 model's roof (True == 1)
    ({"dtype_bytes": [2]}, "profile model.dtype_bytes"),           # was "unhashable type: 'list'"
])
def test_a_profile_field_of_the_wrong_type_is_a_one_line_value_error_naming_it(tmp_path, changes, named):
    from minivllm.sim.presets import hardware_preset

    with pytest.raises(ValueError) as exc:
        hardware_preset(_profile(tmp_path, **changes))
    message = str(exc.value)
    assert named in message and "\n" not in message, message


def test_a_well_typed_gpu_profile_still_reads_as_before(tmp_path):
    """The same profile with its fields well typed: the H200 datasheet fills the memory it lacks (oracle: the
    preset's own memory)."""
    from minivllm.sim.presets import HARDWARE, hardware_preset

    spec = hardware_preset(_profile(tmp_path, **{"hardware.memory_bytes": 0}))
    assert spec.memory_bytes == HARDWARE["h200"].memory_bytes


# -- 3. long paths in messages --------------------------------------------------------------------------------


def test_brief_path_keeps_the_end_of_a_long_path():
    """Hand-worked: a 310-character path cut to 200 before quoting -- its first 138 characters, "...", and its file
    name (58 characters) whole, after its separator."""
    from minivllm.argtypes import brief_path

    name = "n" * 53 + ".json"
    path = "a" * 251 + "/" + name
    assert brief_path(path) == "'" + "a" * 138 + "..." + "/" + name + "'"
    assert brief_path("cpu-2core") == "'cpu-2core'"  # a short one whole, as repr quotes it


def _deep(tmp_path, text: str | None) -> str:
    """A file named prof.json under 3,000 characters of folders (written with ``text``; None: not written)."""
    folder = tmp_path
    for i in range(15):
        folder = folder / (f"{i:02d}" + "d" * 198)
    folder.mkdir(parents=True)
    path = folder / "prof.json"
    if text is not None:
        path.write_text(text)
    return str(path)


@pytest.mark.parametrize("what,text,says", [
    ("load_profile", None, "no calibration profile"),
    ("load_profile", "{not json", "not readable JSON"),
    ("load_profile", '{"a": 1}', "not a calibration profile"),
    ("hardware_preset", None, "unknown hardware"),
    ("hardware_preset", "[1, 2]", "not a calibration profile"),
    ("refit", None, "no such file"),
])
def test_a_long_profile_path_is_quoted_briefly_and_keeps_the_file_name(tmp_path, what, text, says):
    """Before: the 3,000-character path whole in the message (twice for ``--hardware``: its own quote and
    load_profile's).  Now: one line of a few hundred characters, still ending the quote with the file name."""
    from minivllm.sim import calibrate, presets

    path = _deep(tmp_path, text)
    call = {"load_profile": presets.load_profile, "hardware_preset": presets.hardware_preset,
            "refit": calibrate._refit_doc}[what]
    with pytest.raises(ValueError) as exc:
        call(path)
    message = str(exc.value)
    assert len(path) > 3000 and says in message and "prof.json'" in message, message[:300]
    assert len(message) < 2 * PATH_CHARS + 200 and "\n" not in message, (len(message), message[:300])


def test_brief_path_keeps_a_result_files_whole_name():
    """The review's case: a committed result file's path, 78 characters, was cut to its last 36 ('...vidia-h200_...')
    and lost the date that tells the runs apart; a path of this project's own length is quoted whole, and a long
    one keeps its file name whole, cut in its folders (before quoting: no escape sequence is split)."""
    from minivllm.argtypes import brief_path

    result = "benchmarks/results/2026-11-30_nvidia-h200_llama1b_profile_run2.json"
    assert brief_path(result) == repr(result)
    deep = "d\x00/" * 2000 + "2026-11-30_nvidia-h200_llama1b_profile_run2.json"
    text = brief_path(deep)
    assert text.endswith("/2026-11-30_nvidia-h200_llama1b_profile_run2.json'") and "..." in text
    assert len(text) < 4 * PATH_CHARS and eval(text).endswith("profile_run2.json")  # quoted whole: no split escape


@pytest.mark.parametrize("job", ["--explain", "--resimulate"])
@pytest.mark.parametrize("text,says", [(None, "No such file or directory"), ("{not json", "not readable JSON")])
def test_sim_accuracy_quotes_a_long_result_path_briefly(tmp_path, capsys, job, text, says):
    """Before: ``--explain`` printed the OSError's own text, the 3,000-character path whole, and ``--resimulate``
    the same; a result that was no JSON was named by neither (the decoder's "Expecting property name...").  Now:
    one line that names the flag and ends its quote with the file name (oracle: the path typed and PATH_CHARS)."""
    from minivllm.bench import sim_accuracy

    path = _deep(tmp_path, text)
    argv = [job, path] + (["--profile", "cpu-2core"] if job == "--resimulate" else [])
    if job == "--explain":  # argparse's error, exit 2
        with pytest.raises(SystemExit) as exc:
            sim_accuracy.main(argv)
        code = exc.value.code
    else:  # its own one-line error, returned
        code = sim_accuracy.main(argv)
    line = capsys.readouterr().err.strip().splitlines()[-1]  # (argparse's usage lines come first)
    assert code == 2 and "Traceback" not in line and len(line) < PATH_CHARS + 200, (len(line), line[:300])
    assert f"{job} '" in line and "prof.json'" in line and says in line, line[:300]


def test_sim_accuracy_explain_still_reads_a_result_under_a_long_path(tmp_path, capsys):
    """The brief quote is for messages only: the file is opened by its whole path (a stored result, explained)."""
    from pathlib import Path

    from minivllm.bench import sim_accuracy

    stored = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "2026-12-04_cpu-2core_sim_accuracy_stop44.json"
    path = _deep(tmp_path, stored.read_text(encoding="utf-8"))
    assert sim_accuracy.main(["--explain", path]) == 0
    assert "decode" in capsys.readouterr().out
