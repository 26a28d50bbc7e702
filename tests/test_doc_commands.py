"""Every command the READMEs show still parses: its flags and values are ones the current parsers accept.

Why: the READMEs are how a reader reproduces a benchmark or starts a server; a flag renamed or removed in
the code leaves a documented command that dies with "unrecognized arguments" on first use, and nothing else
notices. Each ``minivllm ...`` / ``python -m minivllm.bench ...`` line (fenced blocks and inline code spans) is
handed to the parser its module really builds, which is stopped right after parsing, so no model loads and no
benchmark runs (``bench serve``'s tenant specs and ``sim run``'s preset names, read after parsing, are read here
too); each ``make X`` names a Makefile target and each ``bash tools/X`` a script that is there. Placeholders
(``URL``, ``F``, ``SECONDS``) stand in for values and are replaced by one the flag's type takes.
"""

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "benchmarks/README.md")

# placeholder -> a value of the kind the docs mean by it (a flag's type sees a real value, not the word)
PLACEHOLDERS = {"URL": "http://127.0.0.1:8000", "SECONDS": "30", "F": "out.json", "FILE": "out.json",
                "F.json": "out.json", "PATH": ".venv-vllm/bin/python", "...": "out.json"}
_COMMAND = re.compile(r"^(?:\S*python\S* -m minivllm(?:\.bench)?|minivllm) ")


def _commands_in(text: str) -> list[str]:
    """Command lines in fenced blocks (``\\`` continuations joined, ``#`` comments cut) and inline code spans."""
    found = []
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    for block in fenced:
        block = re.sub(r"\\\n\s*", " ", block)
        for line in block.splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith(("make ", "bash ")) or _COMMAND.match(line + " "):
                found.append(line)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    for _, span in re.findall(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose, flags=re.S):  # ``x`` spans too
        span = " ".join(span.split())
        if span.startswith(("make ", "bash ")) or _COMMAND.match(span + " "):
            found.append(span)
    return found


def _documented() -> list[tuple[str, str]]:
    return [(doc, cmd) for doc in DOCS for cmd in _commands_in((ROOT / doc).read_text(encoding="utf-8"))]


class _Parsed(Exception):
    """Raised right after a parser accepted its argv: the command's work never starts."""

    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.namespace = args


def _check_loadgen_values(args: argparse.Namespace) -> None:
    """``bench serve`` reads its tenant specs and rate list after parsing (in ``run_benchmark``); the README's
    richest syntax is there, so it is read here the same way, without a server to send to."""
    from minivllm.bench.loadgen import parse_tenant

    for spec in args.tenant:
        parse_tenant(spec, args.input_len, args.output_len, args.api_key)
    if args.rates:
        assert all(float(x) > 0 for x in args.rates.split(",")), args.rates


def _check_sim_run_values(args: argparse.Namespace) -> None:
    """``sim run`` resolves its hardware, model and workload names in ``run_sim``, after parsing: read them here."""
    from minivllm.sim.presets import hardware_preset, simulated_shape
    from minivllm.sim.run import WORKLOADS

    simulated_shape(args.model, hardware_preset(args.hardware), args.dtype_bytes)
    assert args.workload is None or args.workload in WORKLOADS or args.workload.endswith(".jsonl"), \
        f"no workload {args.workload!r}"  # (None: chat, or the --tenant specs)


VALUE_CHECKS = {"minivllm.bench.loadgen": _check_loadgen_values, "minivllm.sim.run": _check_sim_run_values}


def _parse_only(monkeypatch, target: str, argv: list[str]) -> argparse.Namespace:
    """Run ``target``'s main() on ``argv`` up to its parse_args; a refusal is argparse's SystemExit(2)."""
    real = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [target] + argv)
    module = importlib.import_module(target)
    with pytest.raises(_Parsed) as parsed:
        module.main(argv) if "argv" in module.main.__code__.co_varnames else module.main()
    return parsed.value.namespace


def _bench_names() -> dict[str, str]:
    """The name -> module table of ``python -m minivllm.bench``."""
    from minivllm.bench import NAMES

    return dict(NAMES)


def _targets(cmd: str) -> tuple[str, list[str]]:
    """(module whose main() parses it, the argv that main() sees) for one documented command."""
    words = [PLACEHOLDERS.get(w, w) for w in shlex.split(cmd)]
    if words[0] != "minivllm":  # python -m MODULE ...
        module, rest = words[2], words[3:]
        if module == "minivllm.bench":
            names = _bench_names()
            assert rest and rest[0] in names, f"{cmd!r}: no benchmark named {rest[:1]}"
            return names[rest[0]], rest[1:]
        if module != "minivllm":
            return module, rest
        words = ["minivllm"] + rest
    sub = words[1:]
    if sub[:1] == ["bench"] and len(sub) >= 2 and sub[1] == "serve":
        return "minivllm.bench.loadgen", sub[2:]
    if sub[:1] == ["sim"] and len(sub) >= 2 and sub[1] in ("run", "calibrate"):
        return f"minivllm.sim.{sub[1]}", sub[2:]
    return "minivllm.cli", sub


# spans that name a tool in prose rather than show a command to run
NAMES_ONLY = {"minivllm ...", "python -m minivllm.bench ...", "minivllm sim", "minivllm grade"}
COMMANDS = [(doc, cmd) for doc, cmd in _documented() if cmd not in NAMES_ONLY]


def test_the_readmes_show_commands_to_check():
    """The extraction itself: an empty list would pass every check below without reading anything."""
    assert sum(1 for _, c in COMMANDS if "minivllm" in c) > 30


@pytest.mark.parametrize(
    "doc,cmd", [(d, c) for d, c in COMMANDS if not c.startswith(("make ", "bash "))], ids=lambda v: v[:80]
)
def test_each_documented_command_is_accepted_by_its_parser(doc, cmd, monkeypatch, capsys):
    """A renamed flag, a dropped choice or a value the flag's type refuses fails here, naming the README line."""
    target, argv = _targets(cmd)
    try:
        args = _parse_only(monkeypatch, target, argv)
    except SystemExit as exc:
        err = capsys.readouterr().err.strip()
        if argv and argv[-1].startswith("--") and f"argument {argv[-1]}: expected" in err:
            return  # prose naming a flag (`minivllm sim calibrate --refit`): the flag exists, its value is elsewhere
        pytest.fail(f"{doc}: `{cmd}` is refused by {target}: {err} (exit {exc.code})")
    if target in VALUE_CHECKS:
        try:
            VALUE_CHECKS[target](args)
        except (ValueError, AssertionError) as exc:
            pytest.fail(f"{doc}: `{cmd}` has a value {target} refuses after parsing: {exc}")


@pytest.mark.parametrize("doc,cmd", [(d, c) for d, c in COMMANDS if c.startswith(("make ", "bash "))])
def test_each_documented_make_target_and_script_exists(doc, cmd):
    """`make demo` and `make test` are the README's first lines: a renamed target breaks a fresh reader first."""
    words = shlex.split(cmd)
    if words[0] == "bash":
        assert (ROOT / words[1]).is_file(), f"{doc}: `{cmd}` names a script that is not there"
        return
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), flags=re.M))
    for target in (w for w in words[1:] if "=" not in w and not w.startswith("-")):
        assert target in targets, f"{doc}: `{cmd}` names no Makefile target"


def test_make_fuzz_runs_every_file_with_a_hypothesis_property():
    """The README says ``make fuzz`` runs every hypothesis property ``FUZZ_SCALE`` times as hard as CI; the target
    runs only the files its ``FUZZ_FILES`` lists.  A property file left off that list is searched at CI's size
    only, however high the scale is set: the KV hunt's tenant-quota property
    (``test_kv_hunt_tenant_quotas_extend_and_both_caches.py``, sized by ``tests.fuzz.examples``) was.  Oracle: a
    recount of the test files that import hypothesis (its ``@given`` properties and state machines)."""
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    m = re.search(r"^FUZZ_FILES\s*:=((?:[^\n]*\\\n)*[^\n]*)", makefile, flags=re.M)
    assert m, "the Makefile no longer lists FUZZ_FILES"
    listed = set(re.findall(r"tests/\S+\.py", m.group(1)))
    assert listed and all((ROOT / f).is_file() for f in listed), listed
    with_properties = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                       if re.search(r"^(?:from|import) hypothesis\b", p.read_text(encoding="utf-8"), flags=re.M)}
    assert with_properties - listed == set(), f"`make fuzz` leaves out {sorted(with_properties - listed)}"
