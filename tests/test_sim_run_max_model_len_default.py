"""``minivllm sim run --max-model-len``: the default its ``--help`` states is the one the engine gets.

The oracle is the help text itself (the floor it names, read with a regex) and the workload's own longest
request, computed here by hand: a short workload must still get the stated floor, not its own length.
"""

import io
import re

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
