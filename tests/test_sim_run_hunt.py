"""A hunt through ``minivllm sim run``'s report, ``minivllm sim calibrate``'s profile reading and lab 9's checkers.

``drive``'s duration: the rates of the report (requests/s, tokens/s, goodput/s) divide by it, so a run that ended
at its last answer while later requests were still arriving or waiting read fast.  The expected numbers are worked
out by hand on a linear cost model with round step times.

``sim calibrate --residuals`` and ``--refit`` read a profile that may have been edited by hand or cut short: a
malformed stored step is a one-line error naming it (they were ``KeyError`` / ``TypeError`` tracebacks).

Lab 9's prefix-affinity checker: wrong routers that passed the visible checker (and failed the grader's hidden
cases, so a learner lost points with no warning).  Each is the engine's router with its bound rewritten as the
mistake; the oracle is the exercise's text, "exceed max(min_spill_tokens, spill_factor x mean load)".
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
from checker_verdicts import accepts, refuses

from minivllm.bench.loadgen import RunResult, summarize
from minivllm.labs import check_lab09
from minivllm.labs.workloads import sim_engine
from minivllm.sim import calibrate
from minivllm.sim.executor import SimulatedExecutor
from minivllm.sim.presets import load_profile
from minivllm.sim.roofline import HardwareSpec, ModelShape, RooflineExecutor
from minivllm.sim.router import PrefixAffinityRouter, stable_hash
from minivllm.sim.run import SimRequest, drive, report_extras


def _one_second_steps() -> SimulatedExecutor:
    """Every step takes exactly 1 s, whatever it computes."""
    return SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)


# -- sim run: the run's duration --------------------------------------------------------------------------------


def test_a_request_refused_at_the_door_late_in_the_run_lengthens_it():
    """r0 (arrives at 0, 20-token prompt, 2 tokens) is served by two 1 s steps and finishes at 2 s; r1 arrives at
    10 s with a 2,000-token prompt, longer than the engine's 1,024-token limit (64 blocks of 16), and is refused
    at once.  The run lasted 10 s: 1 request served over 10 s is 0.1 req/s and 2 tokens over 10 s 0.2 tok/s.
    Ended at the last answer (the old code), it read 2 s, 0.5 req/s -- five times the rate -- while the same run
    with r0 refused too read the full 10 s."""
    engine = sim_engine(executor=_one_second_steps(), num_blocks=64)
    rec = drive(engine, [SimRequest(0, 0.0, "t", list(range(10, 30)), 2),
                         SimRequest(1, 10.0, "t", [7] * 2000, 2)])
    assert [r.outcome for r in rec.results] == ["ok", "error"]
    assert rec.step_ends == [1.0, 2.0]
    assert rec.duration == 10.0
    overall = summarize(RunResult(1.0, rec.duration, rec.results))["overall"]
    assert overall["request_throughput"] == pytest.approx(0.1)
    assert overall["output_throughput"] == pytest.approx(0.2)
    assert overall["goodput_rps"] == pytest.approx(0.1)


class _Pairs:
    """Admission that starts requests only two at a time, so a lone late request is never admitted."""

    def order(self, waiting, running):
        return list(waiting) if len(waiting) >= 2 else []


# 2 layers, hidden 8, 2 query heads sharing 1 KV head of 4, vocab 32, bf16: a roofline model that costs nothing
_TINY = ModelShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                   head_dim=4, vocab_size=32, dtype_bytes=2)


def test_a_request_that_times_out_lengthens_the_run_to_where_it_stopped():
    """r0 and r1 (arrive at 0) run together in two 1 s roofline steps and finish at 2 s; r2 arrives at 5 s and is
    never admitted (admission in pairs): the engine's empty steps take no time and the run gives up at 5 s with r2
    timed out.  Two answers over 5 s: 0.4 req/s and goodput 0.4/s (the old code's 2 s read 1.0), and the
    device was busy 2 s of the 5 (40%, not 100%).  The KV mean, already averaged over the whole 5 s, stays
    4 block-seconds / 64 blocks / 5 s."""
    hw = HardwareSpec("one-second-steps", peak_flops=1e30, mem_bandwidth=1e30, step_overhead_s=1.0)
    engine = sim_engine(executor=RooflineExecutor(_TINY, hw), admission_policy=_Pairs(), num_blocks=64)
    rec = drive(engine, [SimRequest(0, 0.0, "t", list(range(10, 30)), 2),
                         SimRequest(1, 0.0, "t", list(range(40, 60)), 2),
                         SimRequest(2, 5.0, "t", list(range(70, 90)), 2)], max_idle_steps=3)
    assert [r.outcome for r in rec.results] == ["ok", "ok", "timeout"]
    assert rec.duration == 5.0
    overall = summarize(RunResult(1.0, rec.duration, rec.results))["overall"]
    assert overall["request_throughput"] == pytest.approx(0.4)
    assert overall["goodput_rps"] == pytest.approx(0.4)
    extras = report_extras(engine, rec)
    assert extras["busy_fraction"] == pytest.approx(0.4)
    assert extras["kv_usage_mean"] == pytest.approx(4 / 64 / 5)


# -- lab 9: the spill bound -------------------------------------------------------------------------------------


class _RoundedMean(PrefixAffinityRouter):
    """``round()`` on the mean load: the case "the mean is not rounded" (loads 1501, 1501, 0) let it through,
    since round(1000.67) = 1001 puts the bound at 1501.5, over the owner's 1501 anyway."""

    def bound(self, loads):
        return max(self.min_spill_tokens, self.spill_factor * round(sum(loads) / len(loads)))


class _FactorOnTheFloor(PrefixAffinityRouter):
    """``spill_factor x max(min_spill_tokens, mean)``: the factor scales the floor as well, so an owner between
    min_spill_tokens and 1.5x it never spills while the fleet is light.  No visible case had such an owner."""

    def bound(self, loads):
        return self.spill_factor * max(self.min_spill_tokens, sum(loads) / len(loads))


def test_the_cases_loads_decide_as_the_text_says():
    """The two new loads, decided by hand: owner 1502 beside 1502 and 0 stays (1.5 x 3004 / 3 = 1502.0, not
    exceeded) but spills under a rounded mean (1.5 x 1001 = 1501.5); owner 1200 beside 0 and 0 spills
    (max(1000, 1.5 x 400) = 1000) but stays under a scaled floor (1.5 x 1000 = 1500)."""
    kw = dict(block_size=16, key_blocks=2, vnodes=8, spill_factor=1.5, min_spill_tokens=1000)
    head = check_lab09._prompt(random.Random(4), 32)  # the checker's prompt
    for cls, stays_at_1502, stays_at_1200 in ((PrefixAffinityRouter, True, False), (_RoundedMean, False, False),
                                              (_FactorOnTheFloor, True, True)):
        r = cls(3, **kw)
        owner = r.owner(head)
        for load, other, stays in ((1502, 1502, stays_at_1502), (1200, 0, stays_at_1200)):
            loads = [0, 0, 0]
            loads[owner], loads[min(i for i in range(3) if i != owner)] = load, other
            assert (r.route(head, loads) == owner) is stays, (cls.__name__, load)


def test_a_rounded_mean_fails_the_visible_checker():
    refuses(check_lab09.check_prefix_affinity, _RoundedMean, "the mean is not rounded", "neither floored nor rounded")


def test_a_spill_factor_on_the_floor_fails_the_visible_checker():
    refuses(check_lab09.check_prefix_affinity, _FactorOnTheFloor, "over min_spill_tokens with a light mean spills",
            "max(1000, 1.5 x 400)")


def test_the_engines_router_and_the_solution_still_pass():
    nb = json.loads((Path(__file__).resolve().parents[1] / "solutions" / "lab09_fleet.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "exercise:prefix_affinity" in c.get("metadata", {}).get("tags", []))
    ns = {"stable_hash": stable_hash}
    exec(compile("".join(cell["source"]), "<lab09 prefix_affinity>", "exec"), ns)
    accepts(check_lab09.check_prefix_affinity, PrefixAffinityRouter, ns["PrefixAffinity"])


# -- sim calibrate: a malformed profile ------------------------------------------------------------------------


def _edited_profile(tmp_path, change) -> str:
    doc = copy.deepcopy(load_profile("cpu-2core"))
    change(doc)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("change, needle", [
    (lambda d: d["samples"][3].pop("seqs"), "stored step 3"),  # was KeyError: 'seqs'
    (lambda d: d["samples"][3].update(time_s="fast"), "stored step 3"),  # was TypeError (--residuals)
    (lambda d: d["samples"][3].update(seqs=[[0, "16", True]]), "stored step 3"),  # was TypeError
    (lambda d: d["samples"].__setitem__(3, 7), "stored step 3"),  # was TypeError: 'int' object is not subscriptable
    (lambda d: d["engine"].pop("block_size"), "block_size"),  # was KeyError: 'block_size'
])
@pytest.mark.parametrize("job", ["--residuals", "--refit"])
def test_a_malformed_stored_step_is_a_one_line_error(tmp_path, capsys, change, needle, job):
    path = _edited_profile(tmp_path, change)
    argv = [job, path] + (["--out", str(tmp_path / "out.json")] if job == "--refit" else [])
    assert calibrate.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("minivllm sim calibrate: error:") and needle in err and "Traceback" not in err, err


def test_refit_reads_a_step_without_swapped_blocks_as_residuals_does(tmp_path, capsys):
    """``--residuals`` reads a stored step without ``swapped_blocks`` as swapping nothing; ``--refit`` raised
    ``KeyError: 'swapped_blocks'``.  The committed profile swaps nothing in any step, so dropping the field must
    give the very fit of the profile as it is."""
    assert all(s["swapped_blocks"] == 0 for s in load_profile("cpu-2core")["samples"])
    as_is = _edited_profile(tmp_path, lambda d: None)
    out_as_is, out_without = tmp_path / "a.json", tmp_path / "b.json"
    assert calibrate.main(["--refit", as_is, "--out", str(out_as_is)]) == 0
    without = _edited_profile(tmp_path, lambda d: [s.pop("swapped_blocks") for s in d["samples"]])
    assert calibrate.main(["--refit", without, "--out", str(out_without)]) == 0
    capsys.readouterr()
    fits = [json.loads(p.read_text())["fit"]["params"] for p in (out_as_is, out_without)]
    assert fits[0] == fits[1]
