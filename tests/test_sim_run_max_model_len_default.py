"""``minivllm sim run --max-model-len``: the default its ``--help`` states is the one the engine gets.

The oracle is the help text itself (the floor it names, read with a regex) and the workload's own longest
request, computed here by hand: a short workload must still get the stated floor, not its own length.
"""

import io
import re

import pytest

import minivllm.sim.run as sim_run


def test_default_max_model_len_is_the_workloads_longest_but_at_least_the_stated_floor(monkeypatch):
    help_text = next(a.help for a in sim_run._parser()._actions if "--max-model-len" in a.option_strings)
    stated = re.search(r"default: the workload's longest, at least (\d+)", help_text)
    assert stated, f"--max-model-len help does not state its floor: {help_text!r}"
    seen = {}
    drive = sim_run.drive

    def spy(engine, reqs, **kw):
        seen["max_model_len"] = engine.config.max_model_len
        return drive(engine, reqs, **kw)

    monkeypatch.setattr(sim_run, "drive", spy)
    args = sim_run._parser().parse_args(["--model", "smollm2-135m", "--num-requests", "5",
                                         "--input-len", "fixed:32", "--output-len", "fixed:8"])
    sim_run.run_sim(args, out=io.StringIO())
    longest = 32 + 8  # every request: 32 prompt words (one token each) + 8 outputs
    assert seen["max_model_len"] == max(longest, int(stated.group(1)))


def test_a_request_past_the_models_positions_is_refused_on_its_own():
    """``sim run --model qwen3-0.6b``: Qwen3-0.6B's config.json says ``max_position_embeddings`` 40960, so a real
    engine serving it refuses a 41,000-token request, and so must the simulated one (before the shapes recorded
    positions every preset took 131,072 tokens and such a request finished "ok").  Oracle: the config's number,
    and the run's own record of each request: the short one finishes, the long one is an error naming the
    limit; asking for a longer ``--max-model-len`` is the real engine's error, naming the model's positions."""
    args = sim_run._parser().parse_args(["--model", "qwen3-0.6b", "--hardware", "h100",
                                         "--num-requests", "8", "--seed", "0",
                                         "--tenant", "name=short,input=fixed:100,output=fixed:8",
                                         "--tenant", "name=long,input=fixed:41000,output=fixed:8"])
    doc = sim_run.run_sim(args, out=io.StringIO())
    outcomes = {(r["tenant"], r["outcome"]) for r in doc["requests"]}
    assert outcomes == {("short", "ok"), ("long", "error")}, outcomes
    assert all("40960" in r["error"] for r in doc["requests"] if r["tenant"] == "long")
    with pytest.raises(ValueError, match="40960 positions"):
        sim_run.run_sim(sim_run._parser().parse_args(["--model", "qwen3-0.6b", "--max-model-len", "50000"]),
                        out=io.StringIO())
