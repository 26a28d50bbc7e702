"""The package's seams stay where a reader looks for them (docs: interfaces.py's module docstring).

Why a test: the rule "every seam is a Protocol in ``minivllm/interfaces.py``" is broken quietly -- a helper
that types its ``executor`` by the one class its author had in mind still runs, until someone reads the
signature and passes only that class (the fleet passes a roofline executor where ``sim_engine`` said a
linear one).  Both checks read the source (AST); nothing is imported or run.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "minivllm"
INTERFACES = PACKAGE / "interfaces.py"
# parameter name -> the Protocol of interfaces.py that is its contract
SEAMS = {"executor": "Executor", "admission_policy": "AdmissionPolicy", "preemption_policy": "PreemptionPolicy",
         "prefix_cache": "PrefixCache", "preemption_cost_model": "PreemptionCostModel",
         "batch_builder": "BatchBuilder", "router": "Router", "tokenizer": "Tokenizer"}


def _trees():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def test_every_protocol_and_abc_is_in_interfaces():
    stray = []
    for path, tree in _trees():
        if path == INTERFACES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = {ast.unparse(b).split("[")[0].rsplit(".", 1)[-1] for b in node.bases}
                bases |= {ast.unparse(k.value) for k in node.keywords if k.arg == "metaclass"}
                if bases & {"Protocol", "ABC", "ABCMeta"}:
                    stray.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not stray, stray


def test_no_seam_parameter_is_typed_by_a_concrete_class():
    concrete = {node.name for path, tree in _trees() if path != INTERFACES
                for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    wrong = []
    for path, tree in _trees():
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
                if arg.arg in SEAMS and arg.annotation is not None:
                    text = ast.unparse(arg.annotation)
                    names = {n.id for n in ast.walk(ast.parse(text.strip("'\""), mode="eval"))
                             if isinstance(n, ast.Name)}
                    if names & concrete:
                        wrong.append(f"{path.relative_to(ROOT)}:{fn.lineno} {fn.name}({arg.arg}: {text}): "
                                     f"type it by interfaces.{SEAMS[arg.arg]}")
    assert not wrong, wrong
