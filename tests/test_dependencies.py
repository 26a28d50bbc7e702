"""Every third-party module the package imports is installed by the extra that its code needs.

Why: the lazy imports (inside functions) only fail when that path runs, e.g. ``minivllm grade`` on an
instructor's machine set up with ``pip install minivllm[labs]``; the dev environment has everything, so no
other test notices a module that only ``[dev]`` brings in.  The oracle is the distributions' own metadata:
the requirement closure of base + the extra, at the installed versions, must hold the distribution
of every module imported by the code under that extra's directories.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# code -> the extras that must cover its imports ("base": [project] dependencies)
# (a folder's own scope wins over its parent's: minivllm/labs is checked against base + labs only)
SCOPES = {"minivllm/labs": ("base", "labs"), "minivllm": ("base",)}
# what the base install may lack: each import sits behind its extra or tool, on a path only that needs
OPTIONAL = {
    ("minivllm", "triton"): "the triton extra (Linux): Triton kernels, attention_backend='triton', bench attention",
    ("minivllm", "matplotlib"): "the labs extra: bench serve --figures (refused up front without it)",
    ("minivllm", "vllm"): "bench/vllm_runner.py runs inside a separate vLLM virtual environment",
    ("minivllm", "nbformat"): "the labs extra: bench lab_times runs the notebooks (refused up front without it)",
    ("minivllm", "nbclient"): "the labs extra: bench lab_times runs the notebooks (refused up front without it)",
}


def _imports(folder: Path) -> dict[str, str]:
    """Top-level third-party module -> one ``file:line`` importing it (module level or lazy), leaving out
    the files of a sub-folder that has a scope of its own."""
    out: dict[str, str] = {}
    others = [ROOT / s for s in SCOPES if ROOT / s != folder and (ROOT / s).is_relative_to(folder)]
    for f in sorted(folder.rglob("*.py")):
        if any(f.is_relative_to(o) for o in others):
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in (n.split(".")[0] for n in names):
                if top not in sys.stdlib_module_names and top not in ("minivllm", "__future__"):
                    out.setdefault(top, f"{f.relative_to(ROOT)}:{node.lineno}")
    return out


def _closure(reqs: list[Requirement]) -> set[str]:
    """Names of the distributions ``reqs`` pull in, following the installed distributions' requirements."""
    seen: set[str] = set()
    todo = [(r, frozenset()) for r in reqs]
    while todo:
        req, extras = todo.pop()
        if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            continue
        name = req.name.lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        todo += [(Requirement(r), frozenset(req.extras)) for r in dist.requires or []]
    return seen


def test_each_scope_installs_what_its_code_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"base": project["dependencies"], **project["optional-dependencies"]}
    owners = md.packages_distributions()
    problems = []
    for folder, extras in SCOPES.items():
        reqs = [Requirement(r.split(";")[0]) for g in extras for r in groups[g]]
        installed = _closure(reqs)
        for module, where in sorted(_imports(ROOT / folder).items()):
            if (folder, module) in OPTIONAL:
                continue
            dists = {d.lower().replace("_", "-") for d in owners.get(module, [])}
            assert dists, f"{module} ({where}) is not installed here: the test cannot map it to a distribution"
            if not dists & installed:
                problems.append(f"{module} ({where}): {sorted(dists)} is not pulled in by {' + '.join(extras)}")
    assert not problems, "\n".join(problems)
