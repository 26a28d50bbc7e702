"""What a user reads about a default is what the code uses, and every option documented as taking ``off`` takes it.

Why: a default lives twice, in the code and in the text a user reads (``--help``, ``EngineConfig``'s docstring).
A mutation pass changed ``generate``'s ``--max-tokens`` and ``--temperature``, ``serve``'s ``--host`` and
``--port`` and ``EngineConfig.gpu_memory_utilization``, and no test failed; tests that now pin the numbers do it
against constants of their own, so a default moved in the code *and* that test leaves ``--help`` wrong.  Here the
oracle is the documented value, read from the text: change the code or the text alone and a test fails.  The help
texts state the number itself, not argparse's ``%(default)s``, which would make the check one that cannot fail.
"""

import argparse
import ast
import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest

from minivllm.argtypes import seconds_or_off
from minivllm.cli import _parser, serve_options
from minivllm.config import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
# "(default 64)", "(default 0.0: greedy ...)", "; default fcfs)", "(default: the engine's 10)"
_STATED = re.compile(r"(?:\(|; )default:? (?:the engine's )?([^\s:;,()]+)(?=[:;,)])")
# the defaults the mutation pass found stated nowhere; each must now be read and checked below
NAMED = {("generate", "--max-tokens"), ("generate", "--temperature"), ("serve", "--host"), ("serve", "--port")}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _stated_defaults() -> list[tuple[str, argparse.Action, str]]:
    found = []
    for command in ("generate", "serve"):
        parser = _subparsers()[command]
        help_text = parser.format_help()  # what `minivllm COMMAND --help` prints
        for action in parser._actions:
            m = _STATED.search(" ".join((action.help or "").split()))
            if action.option_strings and m:
                assert "".join(action.help.split()) in "".join(help_text.split()), "not in --help"  # (wrapped)
                found.append((command, action, m.group(1)))
    return found


def test_the_named_defaults_are_stated_in_help():
    """The extraction itself: each of the five once-undocumented defaults (four flags here) is read from --help."""
    read = {(command, action.option_strings[-1]) for command, action, _ in _stated_defaults()}
    assert NAMED <= read, NAMED - read


@pytest.mark.parametrize("command,action,stated", _stated_defaults(),
                         ids=lambda v: v.option_strings[-1] if isinstance(v, argparse.Action) else str(v))
def test_each_default_stated_in_help_is_the_one_used(command, action, stated):
    """An option left unset gets the value its help states: the parser's own default, or, where ``serve`` passes
    nothing on (``None``), the engine's (``EngineConfig``'s field of the same name)."""
    assert "%(default)" not in action.help, "state the value itself: a text generated from the code checks nothing"
    used = action.default
    if used is None and command == "serve":
        used = ENGINE_DEFAULTS[action.dest]
    value = action.type(stated) if callable(action.type) else stated
    if isinstance(used, float) and not isinstance(value, float):
        value = float(value)
    assert value == used, f"{command} {action.option_strings[-1]}: --help says {stated}, the code uses {used!r}"


def test_engine_config_docstring_states_the_defaults_its_fields_have():
    """``EngineConfig``'s docstring is what ``help(LLM)`` readers see; each "``name`` (default X)" there is the
    field's default (``gpu_memory_utilization``'s 0.4 was stated nowhere)."""
    doc = " ".join(EngineConfig.__doc__.split())
    stated = dict(re.findall(r"``(\w+)`` \(default ([^)\s:;,]+)", doc))
    assert "gpu_memory_utilization" in stated
    for name, text in stated.items():
        assert ast.literal_eval(text) == ENGINE_DEFAULTS[name], f"{name}: docstring {text}, field {ENGINE_DEFAULTS[name]}"


class _Parsed(Exception):
    pass


def _module_parsers(monkeypatch, module: str) -> list[argparse.ArgumentParser]:
    """The parser(s) ``module.main`` builds, taken at its parse_args: nothing runs."""
    seen = []

    def grab(self, args=None, namespace=None):
        seen.append(self)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", grab)
    monkeypatch.setattr(sys, "argv", [module])
    main = importlib.import_module(module).main
    with pytest.raises(_Parsed):
        main([]) if "argv" in main.__code__.co_varnames else main()
    monkeypatch.undo()
    return seen


def _offers_off(action: argparse.Action) -> bool:
    return "off" in (action.choices or ()) or "'off'" in (action.help or "") or "`off`" in (action.help or "")


def _modules_naming_off() -> list[str]:
    """Command-line modules whose source names an ``off`` value (a cheap filter: the check reads their parsers)."""
    names = []
    for path in sorted((ROOT / "minivllm").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "add_argument(" in text and "def main(" in text and re.search(r"""["'`]off["'`]""", text):
            names.append(".".join(path.relative_to(ROOT).with_suffix("").parts))
    return names


def test_every_option_documented_as_taking_off_accepts_it(monkeypatch):
    """Each option whose help (or choices) offers ``off`` parses ``--option off``; ``serve --stall-timeout-s off``
    reaches the engine as its own "no watchdog", ``None``."""
    offered = []
    for module in _modules_naming_off():
        parsers = _module_parsers(monkeypatch, module)
        stack = list(parsers)
        while stack:
            parser = stack.pop()
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction):
                    stack.extend(action.choices.values())
                elif action.option_strings and _offers_off(action):
                    offered.append((module, action.option_strings[-1]))
                    value = action.type("off") if callable(action.type) else "off"
                    assert action.choices is None or value in action.choices, (module, action.option_strings)
    assert ("minivllm.cli", "--stall-timeout-s") in offered, offered
    options, _ = serve_options(_parser().parse_args(["serve", "--stall-timeout-s", "off"]))
    assert options["stall_timeout_s"] is None and EngineConfig(device="cpu", **options).stall_timeout_s is None


@pytest.mark.parametrize("word", ["none", "None", "never", "disabled"])
def test_a_word_other_than_off_is_refused_with_a_message_naming_off(word):
    """``--stall-timeout-s none`` (the README puts "``None`` in Python" beside ``off``) used to get "expected a
    number, got 'none'", which never told the user the word that is taken; one word, ``off``, stays the spelling."""
    with pytest.raises(argparse.ArgumentTypeError, match="'off'"):
        seconds_or_off(word)
