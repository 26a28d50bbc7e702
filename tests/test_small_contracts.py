"""Small contracts an audit found broken, each pinned by a hand-written expectation."""

from __future__ import annotations

import pytest

from minivllm.bench.results import write_result
from minivllm.labs.widgets import colour_index, request_colour


def test_write_result_refuses_a_doc_that_would_replace_its_own_keys(tmp_path):
    """``write_result`` adds ``command`` (how to rerun) and ``machine`` (where it ran); a benchmark that put its
    own ``machine`` (``platform.machine()``, say) in the doc used to replace the machine facts silently."""
    with pytest.raises(ValueError, match="machine"):
        write_result(tmp_path / "r.json", {"machine": "x86_64", "value": 1}, "python -m minivllm.bench x", [])
    write_result(tmp_path / "ok.json", {"arch": "x86_64"}, "python -m minivllm.bench x", ["--flag"])
    import json

    doc = json.loads((tmp_path / "ok.json").read_text())
    assert doc["command"] == "python -m minivllm.bench x --flag" and "cpus" in doc["machine"] and doc["arch"] == "x86_64"


def test_a_request_keeps_its_letter_colour_whatever_its_prefix():
    """The README figure names requests "req A", "req B", "req C": a trailing lone letter is the request's letter,
    so B and C get the colours B and C get everywhere else (before, both hashed to the same colour)."""
    assert [colour_index(n) for n in ("A", "req A", "req B", "req C", "x_b", "r7")] == [0, 0, 1, 2, 1, 7]
    assert len({request_colour(n) for n in ("req A", "req B", "req C")}) == 3
