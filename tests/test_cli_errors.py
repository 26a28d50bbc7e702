"""Bad command-line input gets a one-line error and exit status 2 -- never a traceback, never a silent run.

One row per case found in an audit of the command lines (``minivllm``, ``python -m minivllm.bench NAME``,
``minivllm sim run / calibrate``) and the library functions behind them (profile loading, tenant specs).
A bad number is refused by argparse (``SystemExit(2)``, ``error: argument --flag: ...``) before anything
runs; a bad file or a bad spec is a ``ValueError`` the command prints as ``error: ...`` and returns 2.
Every case here used to print a traceback, exit 0, or name the wrong thing.  No model is loaded.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

import pytest

from minivllm.cli import main as cli_main

CLOSED = "http://127.0.0.1:9"  # nothing listens there: a request fails at once


def _argparse_refuses(call, argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        call(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {flag}:" in err, err
    return err


def _returns_error(rc, capsys, *needles):
    assert rc == 2
    err = capsys.readouterr().err
    assert "error:" in err and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


def _argv_main(monkeypatch, module_main, argv):
    """Benchmarks whose ``main()`` reads ``sys.argv`` (as ``python -m minivllm.bench`` sets it)."""
    monkeypatch.setattr(sys, "argv", ["minivllm.bench"] + argv)
    return module_main()


# -- minivllm (cli.py) --------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [["sim", "--help"], ["bench", "--help"]])
def test_group_help_is_help(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_tool_help_still_reaches_the_tool(capsys):
    with pytest.raises(SystemExit) as exc:
        cli_main(["sim", "run", "--help"])
    assert exc.value.code == 0
    assert "--workload" in capsys.readouterr().out


@pytest.mark.parametrize("argv,flag", [
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--max-waiting-requests", "0"], "--max-waiting-requests"),
    (["serve", "--min-free-blocks", "-1"], "--min-free-blocks"),
    (["serve", "--stall-timeout-s", "-1"], "--stall-timeout-s"),
    (["serve", "--stall-timeout-s", "nan"], "--stall-timeout-s"),
    (["serve", "--stall-timeout-s", "never"], "--stall-timeout-s"),
    (["serve", "--max-request-bytes", "0"], "--max-request-bytes"),
    (["serve", "--max-request-bytes", "1.5"], "--max-request-bytes"),
    (["serve", "--max-request-bytes", "none"], "--max-request-bytes"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "hi", "--block-size", "0"], "--block-size"),
])
def test_cli_numbers_refused_before_the_model_loads(argv, flag, capsys, monkeypatch):
    import minivllm.cli as cli

    def reached(args):  # the value got past argparse: a model would load, a server would start
        raise AssertionError(f"{argv} reached {argv[0]}()")

    monkeypatch.setattr(cli, "serve", reached)
    monkeypatch.setattr(cli, "generate", reached)
    _argparse_refuses(cli_main, argv, flag, capsys)


def test_max_request_bytes_reaches_build_app_as_auto_off_or_a_count():
    """Not given: the limit derived from the engine ("auto"); 'off' (any case): no limit (None); a number: itself."""
    from minivllm.cli import _parser, body_limit

    def limit(*argv):
        return body_limit(_parser().parse_args(["serve", *argv]))

    assert limit() == "auto"
    assert limit("--max-request-bytes", "OFF") is None
    assert limit("--max-request-bytes", "4096") == 4096


def test_api_keys_file_errors_name_the_file(tmp_path, capsys, monkeypatch):
    """The keys file is read before the model loads: an operator's typo costs no model load.  ``LLM`` is replaced
    by a stand-in that fails, so a keys file left unread fails this test at once instead of serving for ever."""
    import minivllm

    bad = tmp_path / "keys.json"
    bad.write_text("{not json")
    from minivllm.server import load_api_keys

    with pytest.raises(ValueError, match="keys.json.*not valid JSON"):
        load_api_keys(str(bad))

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the API-keys file was read")

    monkeypatch.setattr(minivllm, "LLM", no_model)
    _returns_error(cli_main(["serve", "--api-keys-file", str(tmp_path / "missing.json")]), capsys, "missing.json")


def _serve_options(monkeypatch, argv):
    """The keyword arguments ``minivllm serve ARGV`` builds its ``LLM`` with (the model is never loaded)."""
    import minivllm

    seen = {}

    class Loaded(Exception):
        pass

    def capture(model, **options):
        seen.update(options)
        raise Loaded

    monkeypatch.setattr(minivllm, "LLM", capture)
    with pytest.raises(Loaded):
        cli_main(["serve", *argv])
    return seen


def test_serve_hands_the_tenants_file_and_policy_to_the_engine(tmp_path, monkeypatch):
    """``--tenants-file`` and ``--scheduling-policy`` reach ``LLM`` as ``TenantConfig`` objects and the policy name;
    a server had no way to set a tenant's weight, caps or class before, so every HTTP tenant ran as ``TenantConfig()``
    under FCFS whatever the operator meant."""
    from minivllm.config import TenantConfig

    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"k1": "chat", "k2": "batch"}))
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"chat": {"weight": 3, "max_running": 4},
                                   "*": {"max_kv_share": 0.5, "over_cap": "reject", "priority_class": "batch"}}))
    seen = _serve_options(monkeypatch, ["--api-keys-file", str(keys), "--tenants-file", str(tenants),
                                        "--scheduling-policy", "wfq"])
    assert seen["scheduling_policy"] == "wfq"
    assert seen["tenants"] == {"chat": TenantConfig(weight=3, max_running=4),
                               "*": TenantConfig(max_kv_share=0.5, over_cap="reject", priority_class="batch")}
    assert "tenants" not in _serve_options(monkeypatch, [])  # no file: the engine's default tenants


@pytest.mark.parametrize("keys,body,needles", [
    ({"k1": "chat"}, {"chta": {"weight": 2}}, ["'chta'", "no API key maps to", "chat"]),  # a typo binds nobody
    (None, {"alice": {"weight": 2}}, ["'alice'", "default"]),  # keyless: everyone is tenant "default"
    ({"k1": "chat"}, {"chat": {"max_runing": 2}}, ["max_runing", "max_running"]),  # names the valid fields
    ({"k1": "chat"}, {"chat": {"max_running": 0}}, ["'chat'", "max_running must be >= 1"]),
    ({"k1": "chat"}, {"chat": 2}, ["'chat'", "object of TenantConfig fields"]),
    ({"k1": "chat"}, [], ["non-empty JSON object"]),
    ({"k1": "chat"}, "{not json", ["not valid JSON"]),
])
def test_a_bad_tenants_file_is_an_error_naming_the_problem_before_the_model_loads(tmp_path, monkeypatch, capsys,
                                                                                  keys, body, needles):
    import minivllm

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the tenants file was checked")

    monkeypatch.setattr(minivllm, "LLM", no_model)
    argv = ["serve"]
    if keys is not None:
        (tmp_path / "keys.json").write_text(json.dumps(keys))
        argv += ["--api-keys-file", str(tmp_path / "keys.json")]
    path = tmp_path / "tenants.json"
    path.write_text(body if isinstance(body, str) else json.dumps(body))
    _returns_error(cli_main([*argv, "--tenants-file", str(path)]), capsys, "tenants.json", *needles)


def test_serve_does_not_offer_policies_no_http_request_can_steer(capsys):
    """Over HTTP no request carries a priority (a client's is refused) or a deadline, so ``priority`` and ``deadline``
    would serve FCFS while the operator believed otherwise: argparse refuses them and the help says why."""
    for policy in ("priority", "deadline"):
        _argparse_refuses(cli_main, ["serve", "--scheduling-policy", policy], "--scheduling-policy", capsys)


# -- minivllm sim run ---------------------------------------------------------------------------


@pytest.mark.parametrize("extra,flag", [
    (["--num-requests", "0"], "--num-requests"),
    (["--num-requests", "-3"], "--num-requests"),
    (["--block-size", "0"], "--block-size"),
    (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
    (["--dtype-bytes", "0"], "--dtype-bytes"),
    (["--dtype-bytes", "3"], "--dtype-bytes"),  # no element is 3 bytes wide
    (["--slo-ttft-ms", "-1"], "--slo-ttft-ms"),
    (["--slo-itl-ms", "0"], "--slo-itl-ms"),
    (["--seed", "-1"], "--seed"),  # was numpy's "expected non-negative integer", naming no flag
])
def test_sim_run_numbers(extra, flag, capsys):
    from minivllm.sim.run import main

    _argparse_refuses(main, ["--num-requests", "3", *extra], flag, capsys)


def test_sim_run_files_and_tenants(tmp_path, capsys):
    from minivllm.sim.run import main

    not_profile = tmp_path / "notprof.json"
    not_profile.write_text('{"a": 1}')
    _returns_error(main(["--num-requests", "3", "--hardware", str(not_profile)]), capsys, "not a calibration profile")
    _returns_error(main(["--num-requests", "3", "--workload", str(tmp_path)]), capsys, str(tmp_path))
    _argparse_refuses(main, ["--num-requests", "3", "--out", str(tmp_path)], "--out", capsys)  # before the run
    _returns_error(main(["--num-requests", "3", "--tenant", "name=a", "--tenant", "name=a"]), capsys, "distinct")


# -- profiles (minivllm.sim.presets) ------------------------------------------------------------


@pytest.mark.parametrize("text,match", [
    ("{not json", "not readable JSON"),
    ("[1, 2]", "not a calibration profile"),
    ('{"a": 1}', "not a calibration profile"),
    ('{"hardware": {"name": "x"}}', "needs peak_flops, mem_bandwidth"),
    ('{"hardware": {"name": "x", "peak_flops": -1, "mem_bandwidth": 1}}', "peak_flops must be a finite number > 0"),
    ('{"hardware": {"name": "x", "peak_flops": "a", "mem_bandwidth": 1}}', "peak_flops must be a finite number > 0, got 'a'"),
])
def test_a_broken_profile_says_what_is_wrong(tmp_path, text, match):
    from minivllm.sim.presets import hardware_preset

    path = tmp_path / "p.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        hardware_preset(str(path))


def test_unknown_hardware_is_still_unknown():
    from minivllm.sim.presets import hardware_preset

    with pytest.raises(ValueError, match="unknown hardware 'nope'"):
        hardware_preset("nope")


# -- minivllm sim calibrate ---------------------------------------------------------------------


def test_calibrate_refit_bad_files(tmp_path, capsys):
    from minivllm.sim.calibrate import main

    _returns_error(main(["--refit", str(tmp_path / "missing.json")]), capsys, "no such file")
    hw_only = tmp_path / "hw.json"
    hw_only.write_text(json.dumps({"hardware": {"name": "x", "peak_flops": 1, "mem_bandwidth": 1}}))
    _returns_error(main(["--refit", str(hw_only)]), capsys, "needs model, samples, engine, fit")
    _argparse_refuses(main, ["--repeats", "0"], "--repeats", capsys)


def test_calibrate_never_writes_into_an_installed_package(tmp_path, monkeypatch, capsys):
    """In a source checkout a new profile lands beside the committed ones; in an installed copy (no
    pyproject.toml above the package) it lands in the current directory, not in site-packages, and an
    existing one there is refused before minutes of measuring, as in the checkout."""
    from minivllm.sim import calibrate, presets

    assert calibrate.default_out("My GPU") == os.path.join(presets.PROFILE_DIR, "my_gpu.json")  # this checkout
    installed = tmp_path / "site-packages" / "minivllm" / "sim" / "profiles"
    installed.mkdir(parents=True)
    monkeypatch.setattr(presets, "PROFILE_DIR", str(installed))
    monkeypatch.chdir(tmp_path)
    assert calibrate.default_out("My GPU") == str(tmp_path / "my_gpu.json")
    (tmp_path / "mine.json").write_text("{}")
    _returns_error(calibrate.main(["--name", "mine"]), capsys, f"{tmp_path / 'mine.json'} exists: pass --out PATH")


# -- minivllm bench serve (loadgen) -------------------------------------------------------------


@pytest.mark.parametrize("spec,match", [
    ("name=x,share=abc", "tenant 'x': share must be a number > 0, got 'abc'"),
    ("name=x,name=y", "'name' given twice"),
    ("name=x,input=lognormal:nan:1", "bad length distribution"),
    ("name=x,input=lognormal:inf:1", "bad length distribution"),
    ("name=x,output=lognormal:10:inf", "bad length distribution"),
])
def test_parse_tenant_refuses(spec, match):
    from minivllm.bench.loadgen import parse_tenant

    with pytest.raises(ValueError, match=match):
        parse_tenant(spec)


BENCH = ["--base-url", CLOSED, "--model", "m", "--no-progress", "--request-timeout", "1", "--timeout", "2"]


@pytest.mark.parametrize("extra,flag", [
    (["--num-requests", "0"], "--num-requests"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--timeout", "-1"], "--timeout"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--min-goodput", "2"], "--min-goodput"),
    (["--slo-itl-ms", "0"], "--slo-itl-ms"),
    (["--temperature", "nan"], "--temperature"),  # was sent on: every request an error, exit 0
    (["--temperature", "-1"], "--temperature"),
    (["--seed", "-1"], "--seed"),  # was numpy's "expected non-negative integer", naming no flag
])
def test_bench_serve_numbers(extra, flag, capsys):
    from minivllm.bench.loadgen import main

    _argparse_refuses(main, [*BENCH, *extra], flag, capsys)


def test_bench_serve_figures_without_matplotlib_is_refused_before_the_run(monkeypatch, capsys):
    """A base install (no labs extra) has no matplotlib: ``--figures`` says so at once, not with an
    ImportError after the whole load test has run."""
    import importlib.util

    from minivllm.bench.loadgen import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(SystemExit) as exc:
        main(["--base-url", CLOSED, "--num-requests", "1", "--figures", "figs"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--figures needs matplotlib" in err and "could not ask" not in err, err


def test_bench_serve_files_and_server(tmp_path, capsys):
    from minivllm.bench.loadgen import main

    _returns_error(main([*BENCH, "--trace", str(tmp_path / "missing.jsonl")]), capsys, "missing.jsonl")
    _returns_error(main([*BENCH, "--rates", "1,abc"]), capsys, "--rates", "'1,abc'")
    _returns_error(main(["--base-url", CLOSED, "--no-progress", "--num-requests", "1"]), capsys,
                   "could not ask", "--model")


# -- python -m minivllm.bench ------------------------------------------------------------------


@pytest.mark.parametrize("argv,code,needle", [(["--help"], 0, ""), (["nope"], 2, "unknown benchmark 'nope'")])
def test_bench_launcher(monkeypatch, capsys, argv, code, needle):
    monkeypatch.setattr(sys, "argv", ["minivllm.bench", *argv])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("minivllm.bench", run_name="__main__")
    assert exc.value.code == code
    assert needle in capsys.readouterr().err


def test_fleet_inf_rate_and_an_empty_window(tmp_path, capsys):
    from minivllm.bench import fleet

    _argparse_refuses(fleet.main, ["--rate", "inf", "--out", ""], "--rate", capsys)
    _argparse_refuses(fleet.main, ["--slo-ttft-ms", "-5", "--out", ""], "--slo-ttft-ms", capsys)
    # so few arrivals that none is measured: the table shows "-", it does not crash on None
    assert fleet.main(["--rate", "0.05", "--duration", "0.5", "--replicas", "1", "--routers", "round_robin",
                       "--out", ""]) == 0
    assert "-/-" in capsys.readouterr().out


@pytest.mark.parametrize("module,argv,flag", [
    ("host_overhead", ["--kinds", "bogus", "--seqs", "2", "--samples", "1", "--warmup", "1", "--later", "1"], "--kinds"),
    ("host_overhead", ["--sweep", "1,abc", "--seqs", "2", "--samples", "1"], "--sweep"),
    ("host_overhead", ["--backlog", "0,16"], "--backlog"),
    ("host_overhead", ["--sweep", "16", "--backlog", "16"], "--backlog"),  # was: only the backlog ran, in silence
    ("preemption", ["--executor", "sim", "--requests", "4", "--budget", "0"], "--budget"),
    ("preemption", ["--executor", "sim", "--requests", "4", "--kv-share", "0", "--modes", "reject"], "--kv-share"),
    ("fairness", ["--duration", "0", "--policies", "fcfs"], "--duration"),
    ("prefix_structures", ["--quick", "--rounds", "0", "--structures", "radix"], "--rounds"),
    # below the pool's floor the cache held 154 blocks while the comparison line and the JSON said 50
    ("prefix_structures", ["--sizes", "50", "--requests", "8", "--structures", "radix", "hash"], "--sizes"),
    ("prefill_rate", ["--output-range", "9,3"], "--output-range"),
    # a directory failed with "Is a directory" only after the model had loaded and the whole stream had run
    ("prefill_rate", ["--requests", "1", "--json", "."], "--json"),
])
def test_bench_numbers(monkeypatch, capsys, module, argv, flag):
    import importlib

    mod = importlib.import_module(f"minivllm.bench.{module}")
    _argparse_refuses(lambda a: _argv_main(monkeypatch, mod.main, a), argv, flag, capsys)


def test_activations_tokens(capsys):
    from minivllm.bench.activations import main

    _argparse_refuses(main, ["--tokens", "0"], "--tokens", capsys)


def test_prefix_requests_needs_a_second_request(monkeypatch, capsys):
    """``--requests 1``: one request shares its system prompt with nobody, so the shareable prefix is 0 tokens
    and the skipped share divided by zero -- a ZeroDivisionError traceback after all six runs.  Refused where
    it is typed."""
    from minivllm.bench import prefix

    _argparse_refuses(lambda a: _argv_main(monkeypatch, prefix.main, a), ["--requests", "1"], "--requests", capsys)


def test_sim_accuracy_resimulate_bad_files(tmp_path, capsys):
    from minivllm.bench.sim_accuracy import main

    junk = tmp_path / "junk.json"
    junk.write_text('{"a": 1}')
    _returns_error(main(["--resimulate", str(junk), "--profile", str(junk)]), capsys, "not a calibration profile")
    _returns_error(main(["--resimulate", str(junk), "--profile", "cpu-2core"]), capsys, "not a sim_accuracy result")


_STORED_RESULT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                              "2026-12-04_cpu-2core_sim_accuracy_stop44.json")


def _edited_result(tmp_path, change) -> str:
    """A copy of a stored sim_accuracy result, edited by ``change`` as a person (or a cut-short run) might."""
    result = json.loads(open(_STORED_RESULT, encoding="utf-8").read())
    change(result)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result))
    return str(path)


@pytest.mark.parametrize("change, needle", [
    (lambda r: r.update(calibration={}), "ModelShape needs"),
    (lambda r: r["calibration"].pop("hardware"), "HardwareSpec needs"),
    (lambda r: r["calibration"]["model"].update(num_layers="12"), "num_layers must be a positive integer"),
    (lambda r: r["workloads"].update(w=5), "workload 'w' is not an object"),
    (lambda r: r["workloads"].update(w={"real_step_logs": [[[0, 0.1]]]}), "step [0, 0.1] is not"),
    (lambda r: r["workloads"].update(w={"real_step_logs": [[[0, 0.1, [[0, 5]]]]]}), "is not [began_s"),
    (lambda r: r.update(workloads=[1, 2]), "must be JSON objects"),
    (lambda r: r.update(calibration=[1]), "must be JSON objects"),
    (lambda r: r["calibration"].update(engine={"block_size": "16"}), "block_size must be a positive integer"),
    (lambda r: r["workloads"].update(w={"real_step_logs": 5}), "real_step_logs is not a list"),
    (lambda r: r["workloads"].update(w={"real_step_logs": [5]}), "real_step_logs is not a list"),
    (lambda r: r["workloads"].update(w={"real_step_logs": [[[0, 0.1, [["a", "b", "c"]]]]]}), "is not [began_s"),
    (lambda r: r["workloads"].update(w={"real_step_logs": [[[0, 0.1, []]]]}), "is not [began_s"),
])
def test_sim_accuracy_explain_hand_made_results(tmp_path, capsys, change, needle):
    """A result edited by hand (or cut short) is a one-line error naming what is wrong.  These were a bare
    ``KeyError: 'model'``, a ``TypeError`` from ``ModelShape(**...)``, an ``AttributeError`` for a list where an
    object belongs, an ``IndexError`` or ``TypeError`` from a step, a ``ZeroDivisionError`` for a step with no
    sequence (its prediction is 0 s)."""
    from minivllm.bench.sim_accuracy import main

    with pytest.raises(SystemExit) as exc:
        main(["--explain", _edited_result(tmp_path, change)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and "Traceback" not in err, err


def test_sim_accuracy_explain_reads_a_well_formed_hand_made_step(tmp_path, capsys):
    """The checks above refuse only what is malformed: one hand-written prompt step is explained."""
    from minivllm.bench.sim_accuracy import main

    path = _edited_result(tmp_path, lambda r: r.update(workloads={"w": {"real_step_logs": [[[0, 0.1, [[0, 5, 1]]]]]}}))
    assert main(["--explain", path]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:3] == ["w", "prompt", "1"] and row[5] == "100.0ms", row


@pytest.mark.parametrize("change, needle", [
    (lambda r: r.pop("scale"), "lacks scale"),
    (lambda r: r["workloads"]["decode_heavy"].pop("real_runs"), "lacks workloads.decode_heavy"),
    (lambda r: r.update(engine=None), "lacks engine"),
    (lambda r: r.update(workloads=[1, 2]), "lacks workloads"),  # the check itself called .items() on the list
    (lambda r: r["engine"].pop("num_blocks"), "lacks engine.num_blocks"),  # was sim_engine()'s TypeError
    (lambda r: r["engine"].update(block_size=16), "engine has unknown fields block_size"),
])
def test_sim_accuracy_resimulate_hand_made_results(tmp_path, capsys, change, needle):
    """``--resimulate`` reads the same files: what is missing or unknown is named (they were tracebacks)."""
    from minivllm.bench.sim_accuracy import main

    _returns_error(main(["--resimulate", _edited_result(tmp_path, change), "--profile", "cpu-2core"]), capsys, needle)


def test_sim_accuracy_explain_and_profile_bad_files(tmp_path, capsys):
    """``--explain`` and ``--profile`` name files: missing, not JSON, or the wrong kind is argparse's one-line
    error naming the file (they were tracebacks, one a bare ``KeyError: 'calibration'``)."""
    from minivllm.bench.sim_accuracy import main

    junk = tmp_path / "junk.json"
    junk.write_text('{"a": 1}')
    for argv, needle in ((["--explain", str(tmp_path / "nope.json")], "nope.json"),
                         (["--explain", str(junk)], "not a sim_accuracy result"),
                         (["--profile", str(tmp_path / "nope.json")], "nope.json")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err and "Traceback" not in err, err



def test_sim_accuracy_refuses_a_profile_timed_on_another_clock(monkeypatch, capsys):
    """A profile fitted on the CPU-time clock predicts CPU seconds; the default ``--clock wall`` times the real
    engine in wall seconds, so every error in the table would mix two clocks (the module docstring: calibration
    and validation "both use that clock").  It ran in silence, and the result keeps no trace of the profile's
    clock.  Oracle: the profile's own ``clock`` field.  Refused before the model loads (``run`` never called)."""
    from minivllm.bench import sim_accuracy

    def measured(*args, **kwargs):
        raise AssertionError("the real engine was measured against a profile of another clock")

    monkeypatch.setattr(sim_accuracy, "run", measured)
    for argv, needle in ((["--profile", "cpu-1thread-cputime"], "--clock cpu"),
                         (["--profile", "cpu-2core", "--clock", "cpu"], "--clock wall")):
        with pytest.raises(SystemExit) as exc:
            sim_accuracy.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err and "Traceback" not in err, err

@pytest.mark.parametrize("value", ["-1", "nan", "0"])
def test_grade_timeout(value, capsys):
    _argparse_refuses(cli_main, ["grade", "--timeout", value, "x.ipynb"], "--timeout", capsys)


# -- a second audit (stop 35) ------------------------------------------------------------------


def test_sim_run_lengths_are_checked_and_replace_a_named_workloads(tmp_path, capsys):
    """``--input-len`` / ``--output-len`` were dropped in silence with a named workload (the default, chat),
    unchecked too.  Now a bad one is an error, and a good one replaces the workload's lengths: 20 requests of
    exactly 4,096 + 200 tokens are 85,920 tokens (chat's own lengths make ~1,850)."""
    from minivllm.sim.run import main

    _returns_error(main(["--num-requests", "3", "--input-len", "bogus"]), capsys, "'bogus'")
    _returns_error(main(["--num-requests", "3", "--output-len", "0"]), capsys, "'0'")
    out = tmp_path / "run.json"
    assert main(["--num-requests", "20", "--input-len", "4096", "--output-len", "200", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "20 requests, 85920 tokens" in capsys.readouterr().out
    assert [(t["input_len"], t["output_len"]) for t in doc["tenants"]] == [("fixed:4096", "fixed:200")]


def test_a_lognormal_length_is_capped_before_it_can_overflow():
    """``lognormal:64:800:256`` overflowed a float before the cap applied (OverflowError); an unbounded one could
    ask the planner for a prompt of 10^300 words.  Samples stay in [1, MAX] (and under MAX_LENGTH); the same
    seed gives the same lengths as before wherever no cap is reached (oracle: the plain formula)."""
    import math

    import numpy as np

    from minivllm.bench.loadgen import MAX_LENGTH, LengthDist

    capped = LengthDist.parse("lognormal:64:800:256")
    rng = np.random.default_rng(0)
    assert all(1 <= capped.sample(rng) <= 256 for _ in range(200))
    wild = LengthDist.parse("lognormal:64:800")
    assert all(1 <= wild.sample(rng) <= MAX_LENGTH for _ in range(200))
    mild, a, b = LengthDist.parse("lognormal:100:0.5"), np.random.default_rng(3), np.random.default_rng(3)
    assert [mild.sample(a) for _ in range(50)] == [max(1, round(100 * math.exp(0.5 * b.standard_normal())))
                                                  for _ in range(50)]
    for spec in ("fixed:2000000", "lognormal:1e308:5", "uniform:1:1000001"):
        with pytest.raises(ValueError, match="lengths from 1 to 1,000,000"):
            LengthDist.parse(spec)


@pytest.mark.parametrize("argv,needle", [
    (["eager_step", "--device", "tpu"], "unknown device 'tpu'"),
    (["fleet", "--replicas", "1", "--routers", "round_robin", "--duration", "1", "--out", "FILE/x.json"], "File exists"),
])
def test_bench_launcher_turns_a_bad_value_into_one_line(monkeypatch, capsys, tmp_path, argv, needle):
    """A ValueError or OSError from any benchmark (a bad device, an output path under a file) is one line and
    exit 2, not a traceback and exit 1."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [a.replace("FILE", str(blocker)) for a in argv]
    monkeypatch.setattr(sys, "argv", ["minivllm.bench", *argv])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("minivllm.bench", run_name="__main__")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"python -m minivllm.bench {argv[0]}: error:" in err and needle in err, err


def test_fleet_summary_line_with_nothing_measured(capsys):
    """At a rate so low that no request finishes in the window, the (b) line prints "-" like the table (it
    formatted None and crashed)."""
    from minivllm.bench import fleet

    assert fleet.main(["--rate", "0.01", "--duration", "1", "--replicas", "1,2", "--routers",
                       "round_robin,prefix_affinity", "--out", ""]) == 0
    assert "p99 TTFT - -> - ms" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["", "  \n", "{}"])
def test_an_api_keys_file_with_no_keys_is_refused(tmp_path, text):
    """Asking for key authentication with a file that holds none served everyone as one tenant, keyless."""
    from minivllm.server import load_api_keys

    f = tmp_path / "keys.json"
    f.write_text(text)
    with pytest.raises(ValueError, match="keys.json.*holds no keys"):
        load_api_keys(str(f))


def test_a_repeated_tenant_name_is_a_value_error():
    """The tuple form of ``tenants`` can repeat a name; sorting the pairs then compared two TenantConfigs."""
    from minivllm.config import EngineConfig, TenantConfig

    with pytest.raises(ValueError, match="distinct"):
        EngineConfig(tenants=(("a", TenantConfig()), ("a", TenantConfig(weight=2))), device="cpu")


def test_grade_refuses_a_missing_notebook(tmp_path, capsys):
    from minivllm.labs.grade import main

    _returns_error(main([str(tmp_path / "nope.ipynb"), "--csv", str(tmp_path / "g.csv")]), capsys, "nope.ipynb")
    assert not (tmp_path / "g.csv").exists()


def test_gpu_e2e_refuses_a_prompt_length_it_cannot_draw(monkeypatch, capsys):
    """Prompt lengths are drawn from [16, --max-prompt-len): 16 or less crashed in randint after the model was
    built.  Refused before anything runs."""
    from minivllm.bench import gpu_e2e

    with pytest.raises(SystemExit) as exc:
        _argv_main(monkeypatch, gpu_e2e.main, ["--max-prompt-len", "16", "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--max-prompt-len must be more than 16" in err and "Traceback" not in err


def test_gpu_e2e_parity_leaves_room_for_every_asked_token(monkeypatch):
    """``--max-prompt-len 4090``: the engine was built with max_model_len 4096, so a 4089-token prompt could get
    only 7 of the 64 tokens asked (``InputProcessor`` caps max_tokens at what fits), and the summary claimed 64.
    The engines are stand-ins following that capping rule; oracle: every output is as long as asked."""
    from minivllm.bench import gpu_e2e

    lengths = []

    def run(model_dir, backend, prompts, params, *a, max_model_len=4096, **k):
        toks = [[1] * min(params.max_tokens, max_model_len - len(p["prompt_token_ids"])) for p in prompts]
        lengths.extend(len(t) for t in toks)
        return toks, 1.0

    monkeypatch.setattr(gpu_e2e, "make_model_dir", lambda path, arch: None)
    monkeypatch.setattr(gpu_e2e, "run", run)
    argv = ["--device", "cpu", "--prompts", "64", "--max-prompt-len", "4090", "--max-tokens", "64"]
    assert _argv_main(monkeypatch, gpu_e2e.main, argv) == 0
    assert len(lengths) == 128 and set(lengths) == {64}


def test_prefix_structures_with_fewer_requests_than_rounds(capsys):
    """3 measured requests cut into 8 rounds: the empty rounds' 0 us entered the medians (match and insert read
    0.0) and the radix/hash ratio divided by zero.  Oracle: serving a real request takes time."""
    from minivllm.bench import prefix_structures as ps

    w = ps.Workload()
    stream = ps.make_requests(w, ps.warmup_requests(50, w) + 3, 0)
    rows = ps.measure_size(50, ["radix", "hash"], stream[:-3], stream[-3:], rounds=8)
    assert all(r.match_us > 0 and r.insert_us > 0 for r in rows)


def test_eager_step_p90_interpolates_like_its_median():
    """p90 of 1..6 ms by numpy's rule is 5.5 ms; the floor index gave 5 (and with 3 samples, the median)."""
    from minivllm.bench.eager_step import _stats

    s = _stats([0.001 * k for k in (3, 1, 6, 2, 5, 4)])
    assert s["p90_ms"] == pytest.approx(5.5) and s["p50_ms"] == pytest.approx(3.5)


# -- a third audit (huntK: the benchmarks' and tools' own command lines) ------------------------


def _no_model(*args, **kwargs):
    raise AssertionError("a bad gpu_e2e flag got past argparse: the random-weight model was being written")


@pytest.mark.parametrize("argv,flag", [
    (["--workload", "nano", "--backends", "bogus"], "--backends"),  # ran no minivllm engine: "0 tok/s", exit 0
    (["--workload", "nano", "--backends", ""], "--backends"),  # the same, silently
    (["--workload", "nano", "--backends", "torch,,triton"], "--backends"),
    (["--dtype", "bogus"], "--dtype"),  # failed only after the model of random weights was written
])
def test_gpu_e2e_backends_and_dtype_are_refused_before_the_model_is_written(monkeypatch, capsys, argv, flag):
    from minivllm.bench import gpu_e2e

    monkeypatch.setattr(gpu_e2e, "make_model_dir", _no_model)
    _argparse_refuses(lambda a: _argv_main(monkeypatch, gpu_e2e.main, a), ["--device", "cpu", *argv], flag, capsys)


@pytest.mark.parametrize("workload", ["parity", "nano"])
def test_gpu_e2e_json_carries_the_command_it_was_run_with(monkeypatch, tmp_path, workload):
    """Every other benchmark's result file says how to rerun it (``write_result``); gpu_e2e's held only the
    numbers.  The engines are stand-ins: this pins the file, not the measurement."""
    from minivllm.bench import gpu_e2e

    monkeypatch.setattr(gpu_e2e, "make_model_dir", lambda path, arch: None)
    monkeypatch.setattr(gpu_e2e, "run", lambda model_dir, backend, prompts, *a, **k: ([[1, 2]] * len(prompts), 10.0))
    monkeypatch.setattr(gpu_e2e, "run_nano_minivllm", lambda *a, **k: 10.0)
    monkeypatch.setattr(gpu_e2e, "run_nano_hf", lambda *a, **k: 1.0)
    out = tmp_path / "e2e.json"
    sized = ["--prompts", "2"] if workload == "parity" else ["--scale", "0.01"]  # (each workload's own flag)
    argv = ["--device", "cpu", "--workload", workload, *sized, "--json", str(out)]
    assert _argv_main(monkeypatch, gpu_e2e.main, argv) == 0
    doc = json.loads(out.read_text())
    assert doc["command"] == " ".join(["python -m minivllm.bench gpu_e2e", *argv]) and "machine" in doc, doc


@pytest.mark.parametrize("backends,best", [("triton-eager", 30.0), ("torch,triton-eager", 30.0), ("torch", 20.0),
                                           ("triton,triton-eager,torch", 40.0)])
def test_gpu_e2e_vs_hf_counts_every_minivllm_run(monkeypatch, tmp_path, backends, best):
    """``--backends triton-eager`` served minivllm at 30 tok/s, and the summary read "minivllm 0 tok/s = 0.0x HF":
    the best was taken over the torch and triton runs only.  Oracle: by hand, the largest of the runs' rates."""
    from minivllm.bench import gpu_e2e

    rates = {("torch", False): 20.0, ("triton", False): 40.0, ("triton", True): 30.0}
    monkeypatch.setattr(gpu_e2e, "make_model_dir", lambda path, arch: None)
    monkeypatch.setattr(gpu_e2e, "run_nano_minivllm", lambda _dir, backend, *a, eager=False: rates[backend, eager])
    monkeypatch.setattr(gpu_e2e, "run_nano_hf", lambda *a, **k: 10.0)
    out = tmp_path / "e2e.json"
    argv = ["--device", "cpu", "--workload", "nano", "--scale", "0.01", "--backends", backends, "--json", str(out)]
    assert _argv_main(monkeypatch, gpu_e2e.main, argv) == 0
    assert json.loads(out.read_text())["vs_hf"] == pytest.approx(best / 10.0)


@pytest.mark.parametrize("dtype,want", [("fp32", "float32"), ("bf16", "bfloat16"), ("auto", "float32"),
                                        ("float16", "float16")])
def test_gpu_e2e_hf_run_reads_dtype_as_the_engine_does(monkeypatch, dtype, want):
    """``--workload nano --dtype fp32`` served minivllm, then died in ``getattr(torch, 'fp32')`` (AttributeError)
    when HF's turn came.  HF gets the dtype the engine's spelling names (``auto`` on a CPU: float32)."""
    import torch
    import transformers

    from minivllm.bench import gpu_e2e

    got = []

    def from_pretrained(path, dtype=None, **kwargs):
        got.append(dtype)
        raise KeyboardInterrupt  # stop here: only the dtype is under test

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    with pytest.raises(KeyboardInterrupt):
        gpu_e2e.run_nano_hf("unused", [([1, 2], 1)], "cpu", dtype, 1)
    assert got == [getattr(torch, want)]


def test_gpu_e2e_reads_cuda_n_as_a_gpu(monkeypatch, tmp_path):
    """``--device cuda:0`` compared unequal to ``"cuda"``: on a GPU the result was labelled "cpu", the engine got the
    CPU's 256 MiB KV pool instead of 16 GiB, and the timing ran without a sync.  The GPU and the engine are
    stand-ins: oracle, ``cuda:0`` and ``cuda`` name the same kind of device, so the run must be the same."""
    from types import SimpleNamespace

    import torch

    import minivllm
    from minivllm.bench import gpu_e2e

    seen = []

    class Engine:  # records how it was built; every request gets exactly the tokens it asked for
        def __init__(self, model_dir, **kwargs):
            seen.append(kwargs["kv_cache_memory_bytes"])

        def generate(self, prompts, params, use_tqdm=False):
            params = params if isinstance(params, list) else [params] * len(prompts)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * p.max_tokens)]) for p in params]

    monkeypatch.setattr(minivllm, "LLM", Engine)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "StandInGPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: seen.append("sync"))
    monkeypatch.setattr(gpu_e2e, "make_model_dir", lambda path, arch: None)
    monkeypatch.setattr(gpu_e2e, "run_nano_hf", lambda *a, **k: 1.0)
    runs = {}
    for device in ("cuda", "cuda:0"):
        seen.clear()
        out = tmp_path / f"{device.replace(':', '_')}.json"
        argv = ["--device", device, "--workload", "nano", "--scale", "0.01", "--backends", "torch", "--json", str(out)]
        assert _argv_main(monkeypatch, gpu_e2e.main, argv) == 0
        runs[device] = (json.loads(out.read_text())["device"], list(seen))
    assert runs["cuda:0"] == runs["cuda"] == ("StandInGPU", [16 << 30, "sync", "sync"])


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "meta"])
def test_gpu_e2e_refuses_a_bad_device_before_the_model_is_written(monkeypatch, capsys, device):
    from minivllm.bench import gpu_e2e

    monkeypatch.setattr(gpu_e2e, "make_model_dir", _no_model)
    _argparse_refuses(lambda a: _argv_main(monkeypatch, gpu_e2e.main, a), ["--device", device], "--device", capsys)


def test_make_labs_refuses_a_solutions_folder_without_notebooks(tmp_path, capsys):
    """``--solutions`` with a typo found no solutions, so every student notebook in ``--labs`` was "stale":
    all were deleted, exit 0."""
    import shutil
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import make_labs

    labs = tmp_path / "labs"
    labs.mkdir()
    one = sorted(Path(make_labs.ROOT, "labs").glob("lab*.ipynb"))[0]
    shutil.copy(one, labs / one.name)
    with pytest.raises(SystemExit) as exc:
        make_labs.main(["--solutions", str(tmp_path / "no_such_dir"), "--labs", str(labs)])
    assert exc.value.code == 2 and "no_such_dir" in capsys.readouterr().err
    assert (labs / one.name).read_bytes() == one.read_bytes()


def test_build_solutions_refuses_an_unknown_lab_name(tmp_path, monkeypatch, capsys):
    """An unknown name was a FileNotFoundError traceback from importlib (after creating ``solutions/``)."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import build_solutions

    monkeypatch.setattr(build_solutions, "ROOT", tmp_path)
    monkeypatch.setattr(sys, "argv", ["build_solutions.py", "lab01_nope"])
    with pytest.raises(SystemExit) as exc:
        build_solutions.main()
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "'lab01_nope'" in err and "Traceback" not in err, err
    assert not (tmp_path / "solutions" / "lab01_nope.ipynb").exists()


def test_sim_accuracy_resimulate_never_overwrites_the_result_it_reads(tmp_path, capsys):
    """``--help`` promises RESULT is never overwritten; ``--out RESULT`` replaced the recorded real runs with a
    re-simulation of them."""
    import shutil
    from pathlib import Path

    from minivllm.bench.sim_accuracy import main

    src = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*cpu-2core_sim_accuracy*.json"))[-1]
    result = tmp_path / "r.json"
    shutil.copy(src, result)
    with pytest.raises(SystemExit) as exc:
        main(["--resimulate", str(result), "--profile", "cpu-2core", "--out", str(tmp_path / "." / "r.json")])
    assert exc.value.code == 2 and "never overwritten" in capsys.readouterr().err
    assert result.read_bytes() == src.read_bytes()


@pytest.mark.parametrize("extra,needle", [
    (["--csv", "-", "--json", "-"], "both write to '-'"),  # CSV then JSON on stdout, exit 0: neither parses
    (["--csv", "g.out", "--json", "g.out"], "both write to 'g.out'"),  # the JSON replaced the CSV
    (["--csv", ""], "--csv needs a file name"),  # nothing written, exit 0
    (["--json", " "], "--json needs a file name"),
])
def test_grade_output_targets(tmp_path, monkeypatch, capsys, extra, needle):
    import nbformat

    from minivllm.labs.grade import main

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1", id="a")]
    nbformat.write(nb, tmp_path / "nb.ipynb")
    monkeypatch.chdir(tmp_path)
    _returns_error(main(["nb.ipynb", "--quiet", "--seed", "1", *extra]), capsys, needle)


@pytest.mark.parametrize("device", ["tpu", pytest.param("cuda", marks=pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="a real GPU: 'cuda' is a good device here"))])
def test_calibrate_bad_device_is_one_line(monkeypatch, capsys, device):
    """Naming the default profile asked ``torch.cuda.get_device_name()`` for any device but 'cpu': torch's
    ``AssertionError: Torch not compiled with CUDA enabled`` traceback, exit 1."""
    from minivllm.sim import calibrate

    monkeypatch.setattr(calibrate, "real_engine", _no_model)
    _returns_error(calibrate.main(["--device", device]), capsys, repr(device))


@pytest.mark.parametrize("kind", ["empty", "directory", "new directory"])
def test_calibrate_refuses_a_profile_path_it_cannot_write_before_measuring(monkeypatch, capsys, tmp_path, kind):
    """``minivllm sim calibrate --out DIR`` failed only when the profile was written, after minutes of measuring
    the grid.  ``--out profiles/``, a directory not made yet, was taken: the run wrote a file named ``profiles``.
    Oracle: argparse's one-line error naming the flag, and no engine ever built."""
    from minivllm.sim import calibrate

    monkeypatch.setattr(calibrate, "real_engine", _no_model)
    out = {"empty": "", "directory": str(tmp_path), "new directory": str(tmp_path / "profiles") + os.sep}[kind]
    _argparse_refuses(calibrate.main, ["--out", out], "--out", capsys)
    assert not (tmp_path / "profiles").exists()


def test_prefix_structures_quick_keeps_explicit_sizes_and_requests(capsys):
    """``--quick`` replaced ``--sizes 300 --requests 20`` with its own 200, 1000 and 200, in silence."""
    from minivllm.bench import prefix_structures

    prefix_structures.main(["--quick", "--sizes", "300", "--requests", "20", "--rounds", "1", "--structures", "radix"])
    out = capsys.readouterr().out
    sizes = [line.split()[0] for line in out.splitlines() if line.split()[1:2] == ["radix"]]
    assert "20 measured requests per row" in out and sizes == ["300"], out


@pytest.mark.parametrize("flag,value", [("--limit", "-3"), ("--timeout", "-1"), ("--timeout", "0"), ("--timeout", "nan")])
def test_ab_refuses_a_nonsensical_number_before_any_checkout(flag, value, capsys, monkeypatch):
    """``ab --limit -3`` printed no row and then "... 5 more paths" for a table of 2 (``rows[:-3]``, and
    ``len - limit``); ``--timeout -1`` checked the base out, then called the first run "timed out after -1.0
    seconds".  Each is refused where it is typed, before ``git worktree add``."""
    from minivllm.bench import ab

    def accepted(*args, **kwargs):
        raise AssertionError(f"{flag} {value} was accepted: both versions would be checked out and run")

    monkeypatch.setattr(ab, "run", accepted)
    _argparse_refuses(ab.main, ["--base", "HEAD", flag, value, "--", "offline", "--json", "{out}"], flag, capsys)


RESULT_FLAGS = [("offline", "--json"), ("attention", "--json"), ("prefix", "--json"), ("prefix_structures", "--json"),
                ("preemption", "--out"), ("host_overhead", "--out"), ("gpu_e2e", "--json"), ("fairness", "--out"),
                ("sim_accuracy", "--out"), ("sim_accuracy", "--save-profile"), ("linear", "--json"),
                ("eager_step", "--json"), ("activations", "--json"), ("loadgen", "--out"), ("ab", "--out")]


@pytest.mark.parametrize("module,flag", RESULT_FLAGS)
@pytest.mark.parametrize("kind", ["empty", "directory"])
def test_a_result_file_that_cannot_be_written_is_refused_before_the_run(monkeypatch, capsys, tmp_path, module, flag,
                                                                        kind):
    """The result file is written last: ``--json ''`` wrote nothing and exited 0, and ``--out ''`` or a directory
    failed with ``Is a directory: '.'`` only after the whole benchmark had run.  ``parse_args`` is stopped on
    return, so a value it accepts fails here without running anything."""
    import argparse
    import importlib

    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, *a, **k):
        real(self, *a, **k)
        raise AssertionError(f"{flag} {value!r} was accepted: the benchmark would run")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    value = "" if kind == "empty" else str(tmp_path)
    mod = importlib.import_module(f"minivllm.bench.{module}")
    _argparse_refuses(lambda a: _argv_main(monkeypatch, mod.main, a), [flag, value], flag, capsys)


def test_prefix_structures_serves_every_measured_request(monkeypatch):
    """20 measured requests in 8 rounds: chunks of 20 // 8 = 2 served 16 and dropped 4, while the header says
    "20 measured requests per row" and the hit rate claims to cover them.  Oracle: a spy on ``serve`` counts
    the calls after the warm-up, which must be every measured request, once per structure."""
    from minivllm.bench import prefix_structures as ps

    w = ps.Workload()
    stream = ps.make_requests(w, ps.warmup_requests(300, w) + 20, 0)
    warmup, measured = stream[:-20], stream[-20:]
    served = []
    real = ps.serve
    monkeypatch.setattr(ps, "serve", lambda cache, pool, tokens, t: (served.append(tokens), real(cache, pool, tokens, t)))
    for rounds in (8, 3, 20):
        served.clear()
        ps.measure_size(300, ["radix", "hash"], warmup, measured, rounds)
        assert sorted(map(tuple, served[2 * len(warmup):])) == sorted(map(tuple, 2 * measured)), rounds
