"""Three gaps the command lines had left open, each closed where a user meets it.

1. ``minivllm serve --served-model-name a ./model``: ``--served-model-name`` takes one or more words, so argparse
   gave it the model's path as a second name and served the bundled model under both names.  Such a command is
   now refused with a one-line error that spells the command the operator meant; vLLM's order (the model first)
   and several names with the bundled model (``--served-model-name a b``, lab 8's example) still work.
2. A flag read by one mode only, given beside modes that never read it, was dropped in silence: ``bench preemption
   --cpu-blocks`` (the host tier) beside ``--modes`` that never swap, ``bench gpu_e2e --model`` / ``--json`` beside
   ``--save-model`` (which writes a model and runs nothing), ``bench serve --num-requests`` beside ``--trace``
   (which sends all its lines).  Each is refused by argparse, naming the flag.
3. A configuration refusal that quotes the bad value quotes at most :data:`minivllm.sampling_params.QUOTE_CHARS`
   characters of it: a 100,000-character string was pasted whole into the message, and an int of more than
   4,300 digits has no decimal form at all, so Python's own "Exceeds the limit" error replaced the refusal and
   the field it named.

The oracle is the command line typed (what the operator asked for) and, for the messages, their length and the
field they must name.  No model is loaded: the commands stop at the refusal, or at a stand-in where they run.
"""

from __future__ import annotations

import sys

import pytest

import minivllm.cli as cli

HUGE = 10**5000 + 1  # an odd int with no decimal form under Python's default 4,300-digit limit
LONG = "x" * 100_000
MANY = [1] * 100_000


def _serve(monkeypatch, argv):
    """``minivllm serve ARGV``, stopped where the server would load its model: the model and names it got."""
    seen = {}

    def serve(args):
        seen.update(model=args.model, names=args.served_model_name)
        return 0

    monkeypatch.setattr(cli, "serve", serve)
    assert cli.main(["serve", *argv]) == 0
    return seen


def _refused(call, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        call()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {flag}:" in err, err
    return err


# -- 1. --served-model-name before the model ------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    ["--served-model-name", "a", "{dir}"],                                   # an existing model directory
    ["--port", "8001", "--served-model-name", "a", "b", "{dir}"],
    ["--served-model-name", "a", "HuggingFaceTB/SmolLM2-135M-Instruct"],    # a hub id
    ["--served-model-name", "a", "weights/model.gguf"],                       # a GGUF file
])
def test_serve_refuses_a_model_swallowed_by_served_model_name(monkeypatch, tmp_path, capsys, argv):
    """Before: the path became a name and the bundled model was served under it (exit 0).  Now: a one-line
    argparse error whose suggested command puts the model first, with the names that were meant."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    argv = [str(model_dir) if a == "{dir}" else a for a in argv]
    model, names = argv[-1], argv[argv.index("--served-model-name") + 1:-1]
    err = _refused(lambda: _serve(monkeypatch, argv), "--served-model-name", capsys)
    assert len(err.strip().splitlines()) == 2  # usage + the error line
    assert f"minivllm serve {model} --served-model-name {' '.join(names)}" in err, err


@pytest.mark.parametrize("argv,model,names", [
    (["{dir}", "--served-model-name", "a", "b"], "{dir}", ["a", "b"]),  # vLLM's order, several names
    (["--served-model-name", "a", "b"], None, ["a", "b"]),              # the bundled model under two names (lab 8)
    (["--served-model-name", "org/a"], None, ["org/a"]),                # one name: nothing was swallowed
    (["--served-model-name", "a", "--port", "8001", "{dir}"], "{dir}", ["a"]),
])
def test_serve_still_takes_the_names_and_model_it_was_given(monkeypatch, tmp_path, argv, model, names):
    model_dir = str(tmp_path)
    argv = [model_dir if a == "{dir}" else a for a in argv]
    seen = _serve(monkeypatch, argv)
    assert seen == {"model": model_dir if model == "{dir}" else model, "names": names}


def test_a_bare_name_that_matches_a_folder_is_a_name_unless_the_folder_holds_a_model(monkeypatch, tmp_path, capsys):
    """The review's case: ``--served-model-name a smol`` started beside a folder called ``smol`` (the repository
    root holds ``minivllm/``) was refused as a swallowed path.  A bare word is the model only if it holds one (a
    file, or a folder with a ``config.json``)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smol").mkdir()
    assert _serve(monkeypatch, ["--served-model-name", "a", "smol"]) == {"model": None, "names": ["a", "smol"]}
    (tmp_path / "smol" / "config.json").write_text("{}")
    err = _refused(lambda: _serve(monkeypatch, ["--served-model-name", "a", "smol"]), "--served-model-name", capsys)
    assert "minivllm serve smol --served-model-name a" in err, err


def test_serve_help_says_how_to_order_the_model_and_the_names(monkeypatch):
    """--help now says what the parser does: every word after the flag is a name (so the model goes first)."""
    action = next(a for a in cli._parser()._subparsers._group_actions[0].choices["serve"]._actions
                  if "--served-model-name" in a.option_strings)
    text = " ".join(action.help.split())
    assert "every word after it is a name" in text and "MODEL before it" in text
    assert _serve(monkeypatch, ["--served-model-name", "a", "b", "c"])["names"] == ["a", "b", "c"]


# -- 2. flags of one mode, given beside modes that never read them --------------------------------------------


class _Ran(Exception):
    pass


def _preemption(monkeypatch, argv):
    """``bench preemption ARGV`` on the simulated executor, stopped at its first mode: the args that mode got."""
    from minivllm.bench import preemption

    def run_mode(mode, workload, args, blocks):
        raise _Ran(args)

    monkeypatch.setattr(preemption, "run_mode", run_mode)
    monkeypatch.setattr(sys, "argv", ["minivllm.bench preemption", "--executor", "sim", "--requests", "4", *argv])
    return preemption.main


@pytest.mark.parametrize("modes", [["recompute"], ["reject"], ["recompute", "reject"]])
def test_preemption_refuses_cpu_blocks_beside_modes_that_never_swap(monkeypatch, capsys, modes):
    main = _preemption(monkeypatch, ["--modes", *modes, "--cpu-blocks", "8"])
    err = _refused(main, "--cpu-blocks", capsys)
    assert "swap" in err and "auto" in err


@pytest.mark.parametrize("argv,cpu_blocks", [
    (["--modes", "recompute", "swap", "--cpu-blocks", "8"], 8),
    (["--modes", "auto", "--cpu-blocks", "0"], 0),
    ([], 256),                      # not given: the default its help states, as before
    (["--modes", "reject"], 256),
])
def test_preemption_hands_the_host_tier_it_was_given_to_the_modes(monkeypatch, argv, cpu_blocks):
    main = _preemption(monkeypatch, argv)
    with pytest.raises(_Ran) as ran:
        main()
    assert ran.value.args[0].cpu_blocks == cpu_blocks


@pytest.mark.parametrize("extra", [["--model", "some/dir"], ["--json", "r.json"], ["--model", "d", "--json", "r.json"]])
def test_gpu_e2e_refuses_run_flags_beside_save_model(monkeypatch, tmp_path, capsys, extra):
    """``--save-model`` writes the model and returns: a --model to serve or a --json to write did nothing."""
    from minivllm.bench import gpu_e2e

    written = []
    monkeypatch.setattr(gpu_e2e, "make_model_dir", lambda path, arch: written.append(path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["gpu_e2e", "--save-model", "out", *extra])
    err = _refused(gpu_e2e.main, "--save-model", capsys)
    assert written == [] and all(f in err for f in extra if f.startswith("--"))
    monkeypatch.setattr(sys, "argv", ["gpu_e2e", "--save-model", "out", "--arch", "tiny"])
    assert gpu_e2e.main() == 0 and written == ["out"]  # alone (tools/gpu_checks.sh's use), as before


def test_bench_serve_refuses_num_requests_beside_a_trace(monkeypatch, tmp_path, capsys):
    """A trace sends all its lines (as ``sim run``'s, refused there since adef16b): a count given counted nothing."""
    from minivllm.bench import loadgen

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "prompt_len": 8, "max_tokens": 4}\n')

    def run_benchmark(args, out=None):
        raise _Ran(args)

    monkeypatch.setattr(loadgen, "run_benchmark", run_benchmark)
    _refused(lambda: loadgen.main(["--trace", str(trace), "--model", "m", "--num-requests", "5"]), "--num-requests",
             capsys)
    with pytest.raises(_Ran):  # the trace alone, and a count alone, still run
        loadgen.main(["--trace", str(trace), "--model", "m"])
    with pytest.raises(_Ran):
        loadgen.main(["--model", "m", "--num-requests", "5"])


@pytest.mark.parametrize("argv,n", [([], 64), (["--num-requests", "5"], 5)])
def test_bench_serve_generates_the_requests_it_was_asked_for(monkeypatch, argv, n):
    """Not given, --num-requests is the 64 its help states; given, that count."""
    from minivllm.bench import loadgen

    def plan_requests(tenants, num_requests, *a):
        raise _Ran(num_requests)

    monkeypatch.setattr(loadgen, "plan_requests", plan_requests)
    with pytest.raises(_Ran) as ran:
        loadgen.run_benchmark(loadgen._parser().parse_args(["--model", "m", "--no-progress", *argv]))
    assert ran.value.args[0] == n
    if not argv:
        assert "default 64" in loadgen._parser()._option_string_actions["--num-requests"].help


# -- 3. configuration refusals quote a value briefly ----------------------------------------------------------


def _cases():
    import dataclasses

    from minivllm.config import EngineConfig, TenantConfig, ThreeClassConfig
    from minivllm.sim import presets, router
    from minivllm.sim.roofline import HardwareSpec, ModelShape

    shape = dataclasses.asdict(presets.MODELS["llama-3.2-1b"])
    hw = dataclasses.asdict(presets.HARDWARE["h100"])

    def engine(**kw):
        return lambda: EngineConfig(device=kw.pop("device", "cpu"), **kw)

    return [
        ("block_size", engine(block_size=HUGE)),
        ("seed", engine(seed=HUGE)),
        ("max_num_seqs", engine(max_num_seqs=-HUGE)),
        ("num_cpu_blocks_override", engine(num_cpu_blocks_override=-HUGE)),
        ("gpu_memory_utilization", engine(gpu_memory_utilization=HUGE)),
        ("swap_space", engine(swap_space=-HUGE)),
        ("prefix_cache", engine(prefix_cache=LONG)),
        ("preemption_mode", engine(preemption_mode=LONG)),
        ("attention_backend", engine(attention_backend=LONG)),
        ("linear_backend", engine(linear_backend=LONG)),
        ("scheduling_policy", engine(scheduling_policy=LONG)),
        ("dtype", engine(dtype=LONG)),
        ("dtype", engine(dtype=MANY)),
        ("device", engine(device=LONG)),
        ("device", engine(device=HUGE)),
        ("tenants", engine(tenants={LONG: 1})),
        ("tenant names", engine(tenants=((LONG, TenantConfig()), (LONG, TenantConfig())))),
        ("max_model_len", lambda: EngineConfig(device="cpu", max_model_len=HUGE).resolve(2048)),
        ("TenantConfig.max_running", lambda: TenantConfig(max_running=-HUGE)),
        ("TenantConfig.max_kv_share", lambda: TenantConfig(max_kv_share=HUGE)),
        ("TenantConfig.over_cap", lambda: TenantConfig(over_cap=LONG)),
        ("TenantConfig.priority_class", lambda: TenantConfig(priority_class=MANY)),
        ("ThreeClassConfig.interactive_kv_reserve", lambda: ThreeClassConfig(interactive_kv_reserve=HUGE)),
        ("ThreeClassConfig.long_prefill_tokens", lambda: ThreeClassConfig(long_prefill_tokens=-HUGE)),
        ("ModelShape.num_layers", lambda: ModelShape(**{**shape, "num_layers": LONG})),
        ("ModelShape.hidden_size", lambda: ModelShape(**{**shape, "hidden_size": -HUGE})),
        ("num_heads", lambda: ModelShape(**{**shape, "num_heads": HUGE})),
        ("HardwareSpec.peak_flops", lambda: HardwareSpec(**{**hw, "peak_flops": HUGE})),
        ("HardwareSpec.memory_bytes", lambda: HardwareSpec(**{**hw, "memory_bytes": MANY})),
        ("HardwareSpec.attention_flops", lambda: HardwareSpec(**{**hw, "attention_flops": LONG})),
        ("HardwareSpec.roof_p", lambda: HardwareSpec(**{**hw, "roof_p": -HUGE})),
        ("HardwareSpec.flops_dtype_bytes", lambda: HardwareSpec(**{**hw, "flops_dtype_bytes": HUGE})),
        ("factor", lambda: presets.HARDWARE["h100"].slowed(-HUGE)),
        ("unknown router", lambda: router.make_router(LONG, 2)),
        ("num_replicas", lambda: router.HashRing(-HUGE)),
        ("key_blocks", lambda: router.PrefixAffinityRouter(2, key_blocks=LONG)),
        ("spill_factor", lambda: router.PrefixAffinityRouter(2, spill_factor=HUGE)),
        ("unknown model preset", lambda: presets.model_preset(LONG)),
    ]


@pytest.mark.parametrize("i", range(len(_cases())), ids=[name for name, _ in _cases()])
def test_a_refusal_names_its_field_and_quotes_a_huge_value_briefly(i):
    """Oracle: a message that names the field (so Python's own int-conversion error did not replace it) and that
    is a few hundred characters long whatever the size of the value (60 characters of it are quoted)."""
    name, build = _cases()[i]
    with pytest.raises(ValueError) as exc:
        build()
    message = str(exc.value)
    assert name in message and len(message) < 400, (len(message), message[:200])
