"""The numbers quoted for the cost model's span term (``minivllm/sim/roofline.py``'s and ``calibrate.py``'s
docstrings, lab 9's reading of its held-out cell), recomputed from the committed profiles and result files.

Why a test: the term was judged by these numbers -- its fit on the stored calibration steps and, more to the point,
the re-simulated held-out runs -- and a later re-fit of a profile or a change to the cost model would leave the prose
quoting a model that no longer exists.  Oracle: ``calibrate.refit`` with and without the term on the committed
profiles' stored steps, and ``sim_accuracy.resimulate`` on the committed runs' recorded real steps.  Nothing is
measured; the whole file takes a few seconds.
"""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest

from minivllm.bench.sim_accuracy import resimulate
from minivllm.sim import calibrate
from minivllm.sim.presets import load_profile

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ONE_THREAD, TWO_CORE = "cpu-1thread-cputime", "cpu-2core"


def _flat(text: str) -> str:
    return " ".join(text.split())


def _lab09(pattern: str, what: str) -> re.Match:
    """Lab 9's text (whitespace flattened) searched for ``pattern``: the match, or a failure saying lab 9 no longer ``what``."""
    m = re.search(pattern, _flat((ROOT / "tools" / "lab_texts" / "lab09_fleet.py").read_text(encoding="utf-8")))
    assert m, f"lab 9 no longer {what}"
    return m


def _one_rate(name: str) -> dict:
    return calibrate.refit(load_profile(name), span_term=False)


def _bands(doc: dict) -> dict:
    return {(r["kind"], r["seqs"], r["context"]): r["real_over_pred_p50"] for r in calibrate.residuals(doc)}


def _rms(result: dict, doc: dict) -> float:
    rows = resimulate(result, doc, out=io.StringIO())["workloads"]
    errs = [e for r in rows.values() for e in r["rel_error"].values() if e is not None]
    return 100 * (sum(e * e for e in errs) / len(errs)) ** 0.5


def test_the_committed_profiles_carry_the_span_term():
    """Both CPU profiles were re-fitted with the term: a profile without it would silently price every K/V byte at
    one rate again (``attention_span_bandwidth`` None), and the docstrings' claims would describe another model."""
    for name in (ONE_THREAD, TWO_CORE):
        doc = load_profile(name)
        assert doc["hardware"].get("attention_span_bandwidth"), name
        assert set(doc["fit"]["params"]) == set(calibrate.PARAMS), name


def test_calibrate_docstring_fit_numbers():
    """"its rms error fell 6.2 -> 5.2% and its decode bands off by more than 5% from five to one; the one-thread
    profile's 4.0 -> 3.9%": the ablation re-fit against the committed fit, on the same stored steps."""
    text = _flat(calibrate.__doc__)
    m = re.search(r"rms error fell ([\d.]+) -> ([\d.]+)% and its decode bands off by more than 5% from (\w+) to "
                  r"(\w+); the one-thread profile's ([\d.]+) -> ([\d.]+)%", text)
    assert m, "calibrate's docstring no longer quotes the span term's fit"
    words = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7}
    for (before, after), name in (((m.group(1), m.group(2)), TWO_CORE), ((m.group(5), m.group(6)), ONE_THREAD)):
        assert before == f"{100 * _one_rate(name)['fit']['rms_rel_error']:.1f}", name
        assert after == f"{100 * load_profile(name)['fit']['rms_rel_error']:.1f}", name

    def decode_off(doc):
        return sum(1 for (kind, _, _), r in _bands(doc).items() if kind == "decode" and abs(r - 1) > 0.05)

    assert words[m.group(3)] == decode_off(_one_rate(TWO_CORE))
    assert words[m.group(4)] == decode_off(load_profile(TWO_CORE))


def test_roofline_docstring_band_numbers():
    """"one K/V rate for every byte left lone long decodes 7-8% slower than predicted and 2-16 decodes at 65-512
    tokens 7-9% faster; with the span term all decode bands ... but one (2-4 at 65-512 tokens, still 7% faster than
    predicted) are within 5%" -- each read off ``--residuals`` of the two-thread profile, fitted both ways."""
    from minivllm.sim import roofline

    text = _flat(roofline.__doc__)
    assert "left lone long decodes 7-8% slower than predicted and 2-16 decodes at 65-512 tokens 7-9% faster" in text
    assert "all decode bands of the calibration but one (2-4 at 65-512 tokens, still 7% faster than predicted)" in text
    flat, spanned = _bands(_one_rate(TWO_CORE)), _bands(load_profile(TWO_CORE))
    lone = [flat[("decode", "1", c)] for c in ("65-512", "513-2048")]
    assert [round(100 * (r - 1)) for r in lone] == [7, 8]
    many = [flat[("decode", s, "65-512")] for s in ("2-4", "5-16")]
    assert sorted(round(100 * (1 - r)) for r in many) == [7, 9]
    off = [k for k, r in spanned.items() if k[0] == "decode" and abs(r - 1) > 0.05]
    assert off == [("decode", "2-4", "65-512")] and round(100 * (1 - spanned[off[0]])) == 7



def test_lab09_reading_of_the_residual_plot_names_every_band_off():
    """Lab 9's reading of its residual plot (the span fit in blue, one thread in orange) names each band off by more
    than 5%.  It once left out the two-thread fit's band of a single prompt step (x0.94) while naming the same band
    on one thread, so a learner counting bars in the plot found one more than the text.  Oracle: ``residuals`` of
    the committed profiles, the cell's own call."""
    m = _lab09(r"every decode band but one \(2–4 sequences at 65–512 tokens, x([\d.]+)\) is within 5%\. The prompt "
              r"steps beside long decodes of 2–4 sequences, (\d+)% over, are the other miss, and no K/V term reaches "
              r"them \(a band of a single prompt step, x([\d.]+), is off too\)\. On one thread \(orange\) only that "
              r"single-step band is off by more than 5%", "reads the residual plot band by band")

    def off(name):
        return {(r["kind"], r["seqs"], r["context"]): (r["steps"], r["real_over_pred_p50"])
                for r in calibrate.residuals(load_profile(name)) if abs(r["real_over_pred_p50"] - 1) > 0.05}

    two, one = off(TWO_CORE), off(ONE_THREAD)
    single = [k for k, (steps, _) in two.items() if k[0] == "prompt" and steps == 1]
    assert len(single) == 1 and set(one) == set(single)
    assert set(two) == {("decode", "2-4", "65-512"), ("prompt", "2-4", "513-2048"), single[0]}
    assert m.group(1) == f"{two[('decode', '2-4', '65-512')][1]:.2f}"
    assert m.group(2) == f"{round(100 * (two[('prompt', '2-4', '513-2048')][1] - 1))}"
    assert m.group(3) == f"{two[single[0]][1]:.2f}"

SIX = ("stop56", "stop59", "stop59_run2", "stop60", "stop61", "stop62")


def _run(stem: str) -> dict:
    path = next(RESULTS.glob(f"2026-12-0[56]_cpu-2core_sim_accuracy_{stem}.json"))
    return json.loads(path.read_text(encoding="utf-8"))


def test_calibrate_docstring_held_out_numbers():
    """"the simulator's error fell in five (rms over the 15 metrics 6.5 -> 5.5, 9.1 -> 8.7, 6.4 -> 5.3, 3.5 -> 2.7,
    3.1 -> 2.2%) and held in one (9.8%)": the six runs kept since the engine of 5 December, re-simulated with the
    committed one-thread profile fitted without and with the term."""
    text = _flat(calibrate.__doc__)
    m = re.search(r"error fell in five \(rms over the 15 metrics ((?:[\d.]+ -> [\d.]+,? )+)[\d.]+ -> [\d.]+%\) and "
                  r"held in one \(([\d.]+)%\)", text)
    assert m, "calibrate's docstring no longer quotes the held-out runs"
    quoted = re.findall(r"([\d.]+) -> ([\d.]+)", text[m.start():m.end()])
    flat, committed = _one_rate(ONE_THREAD), load_profile(ONE_THREAD)
    pairs = {stem: (f"{_rms(_run(stem), flat):.1f}", f"{_rms(_run(stem), committed):.1f}") for stem in SIX}
    held = [stem for stem, (a, b) in pairs.items() if a == b]
    assert len(held) == 1 and pairs[held[0]][0] == m.group(2)
    assert quoted == [pairs[s] for s in SIX if s not in held]


def test_lab09_held_out_reading_counts_the_runs_its_cell_plots():
    """Lab 9's cell re-simulates the runs it lists (those of the host the committed profiles were calibrated on);
    the reading below it says in how many the span term lowered the rms error.  Oracle: the same re-simulation."""
    text = _flat((ROOT / "tools" / "lab_texts" / "lab09_fleet.py").read_text(encoding="utf-8"))
    names = re.findall(r'"(2026-\S+_sim_accuracy_stop\w+\.json)"', text[text.index("HELD_OUT = ["):])[:6]
    m = re.search(r"The span term lowers the rms error in (\w+) of the (\w+) runs", text)
    assert m, "lab 9 no longer counts the held-out runs the span term helped"
    words = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
    flat, committed = _one_rate(ONE_THREAD), load_profile(ONE_THREAD)
    assert [n.rsplit("_sim_accuracy_", 1)[1][:-5] for n in names] == list(SIX)
    runs = [json.loads((RESULTS / n).read_text(encoding="utf-8")) for n in names]
    better = sum(round(_rms(r, committed), 1) < round(_rms(r, flat), 1) for r in runs)
    assert (words[m.group(1)], words[m.group(2)]) == (better, len(runs))


@pytest.mark.parametrize("name", [ONE_THREAD, TWO_CORE])
def test_the_ablation_is_the_model_before_the_term(name):
    """``span_term=False`` must be exactly one K/V rate: no span rate in the spec, and the span column's parameter 0.
    Kills an ablation that fits the term anyway (the lab's grey bars would then show the new model twice)."""
    doc = _one_rate(name)
    assert doc["hardware"]["attention_span_bandwidth"] is None
    assert doc["fit"]["params"]["s_per_attn_span_byte"] == 0.0


def test_lab09_reading_of_the_run_on_another_host():
    """"Seven runs made after the change on another host (a Zen 4 EPYC, where the committed one-thread profile
    predicts each workload's prompt and decode steps 1.7-1.9x too fast at the median in the first ...); calibrated in
    the same invocation, they met 14, 10, 6, 8, 14, 13 and 8 of 15 metrics (`FILE`, `..._quiet.json`, whose real runs went 6%
    faster than its calibration grid ..., `..._stop64.json`, whose real decodes ran 0.78-0.91 of its own fit's
    prediction, `..._stop65.json`, whose real engine differed from itself by up to 30% ..., and whose seven misses
    are all the simulator too fast where the third run's nine were all too slow, `..._stop66.json`, whose real
    engine held within 8% of itself, `..._stop67.json`, whose two misses are ITL medians: bursty, where the real
    engine's own two runs differed by 21%, and long-prompt ..., and `..._stop68.json`, ...), and that host's own fits
    gave the span no weight in the first two, 3.9 GB/s in the third, 12.9 GB/s in the fourth, none in the fifth and
    sixth and ... in the seventh. ... the fifth had neither (its fit erred 3.1% rms) ..." (the seventh run's clauses:
    the next test)
    Oracle: the run files (host, verdict, errors, real spread, fitted hardware, probe) and ``sim_accuracy.explain``
    against the committed one-thread profile (the first run) and the run's own calibration (the third).
    Medians, not "every step" as the lab once said: 46% of the first run's steps are under x1.7 (--check's decodes
    read x1.48-1.66), and the two-thread profile, on the wall clock, is no yardstick for a CPU-time run."""
    from minivllm.bench.sim_accuracy import explain

    m = _lab09(r"committed one-thread profile predicts each workload's prompt and decode steps ([\d.]+)–([\d.]+)x "
              r"too fast at the median in the first: `sim_accuracy --explain`\) cannot be judged with these profiles "
              r"at all; calibrated in the same invocation, they met (\d+), (\d+), (\d+), (\d+), (\d+), (\d+), \d+ and \d+ of 15 "
              r"metrics \(`(\S+\.json)`, `\.\.\.(_stop63_quiet\.json)`, whose real runs went (\d+)% faster than "
              r"its calibration grid minutes before, `\.\.\.(_stop64\.json)`, whose real decodes ran "
              r"([\d.]+)–([\d.]+) of its own fit's prediction, `\.\.\.(_stop65\.json)`, whose real engine "
              r"differed from itself by up to (\d+)% between two runs of one workload, and whose (\w+) misses are "
              r"all the simulator too \*fast\* where the third run's (\w+) were all too slow, "
              r"`\.\.\.(_stop66\.json)`, whose real engine held within (\d+)% of itself, `\.\.\.(_stop67\.json)`, "
              r"whose two misses are ITL medians: bursty, where the real engine's own two runs differed by (\d+)%, "
              r"and long-prompt, a median that falls between two kinds of gap \(as above\), `\.\.\._stop68\.json`, "
              r"[^()]*\), and that host's own "
              r"fits gave the span no weight in the first two, ([\d.]+) GB/s in the third, ([\d.]+) GB/s in the "
              r"fourth, none in the fifth and sixth, [\d.]+ GB/s in the seventh and none in the eighth\. On one host, one command and one code, the third run missed through its "
              r"fit and the fourth through its real engine; the fifth had neither \(its fit erred ([\d.]+)% rms\)", "reads the runs made on another host")
    first = json.loads((RESULTS / m.group(9)).read_text(encoding="utf-8"))
    second, third, fourth, fifth, sixth = (json.loads((RESULTS / m.group(9).replace("_stop63.json", m.group(k)))
                                                      .read_text(encoding="utf-8")) for k in (10, 12, 15, 19, 21))
    for run, score in ((first, 3), (second, 4), (third, 5), (fourth, 6), (fifth, 7), (sixth, 8)):
        assert run["within_10pct"] == f"{m.group(score)}/15"
        assert "family/model/stepping 25/" in run["host"]["cpu"]
    for run in (first, second, fifth, sixth):
        assert not run["calibration"]["hardware"].get("attention_span_bandwidth")
    for run, k in ((third, 23), (fourth, 24)):
        assert f"{run['calibration']['hardware']['attention_span_bandwidth'] / 1e9:.1f}" == m.group(k)
    assert "family/model/stepping 26/" in load_profile(ONE_THREAD)["host"]  # the profiles' host is another
    probe = second["probe"]  # real runs faster than the grid: the probe's time over the calibration's, both ends
    ends = (probe["seconds"][0] / probe["reference_s"], probe["seconds"][-1] / probe["reference_s"])
    assert all(round(100 * (1 - x)) == int(m.group(11)) for x in ends), (ends, probe)
    decodes = [w["decode"]["real_over_pred_p50"] for w in explain(third, third["calibration"]).values()]
    assert (f"{min(decodes):.2f}", f"{max(decodes):.2f}") == (m.group(13), m.group(14))
    for run, k, rule in ((fourth, 16, round), (fifth, 20, math.ceil)):  # "up to 30%", "within 8%"
        spread = max(v for w in run["workloads"].values() for v in w["real_spread"].values())
        assert rule(100 * spread) == int(m.group(k)), spread
    words = {"six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
    for run, k, sign in ((fourth, 17, -1), (third, 18, +1)):  # every miss on one side: too fast (-), too slow (+)
        misses = [e for w in run["workloads"].values() for e in w["rel_error"].values() if abs(e) > 0.10]
        assert len(misses) == words[m.group(k)] and all(e * sign > 0 for e in misses), (k, misses)
    missed = sorted((w, k) for w, v in sixth["workloads"].items() for k, e in v["rel_error"].items() if abs(e) > 0.10)
    assert missed == [("bursty_mixed", "itl_p50"), ("long_prompt_chunked", "itl_p50")], missed  # "two ... ITL medians"
    assert round(100 * sixth["workloads"]["bursty_mixed"]["real_spread"]["itl_p50"]) == int(m.group(22))
    assert f"{100 * fifth['calibration']['fit']['rms_rel_error']:.1f}" == m.group(25)
    ratios = [k["real_over_pred_p50"] for w in explain(first, load_profile(ONE_THREAD)).values() for k in w.values()]
    assert (f"{min(ratios):.1f}", f"{max(ratios):.1f}") == (m.group(1), m.group(2))


def test_lab09_reading_of_the_seventh_run_on_another_host():
    """Lab 9's record of the seventh Zen 4 run: "... 8 of 15 metrics (..., and `..._stop68.json`, whose real decodes in
    two workloads ran 1.23 of its fit's prediction, the same decode step moving 22% and 25% at the median between the
    real engine's own two runs), ... and 16.0 GB/s in the seventh. ... the seventh had both" (a fit far from its real
    steps, and a real engine far from itself).  Oracle: the run file and ``sim_accuracy.explain`` against its own
    calibration."""
    from minivllm.bench.sim_accuracy import explain

    m = _lab09(r"met (?:\d+, ){6}(\d+) and \d+ of 15 metrics .*?`\.\.\.(_stop68\.json)`, whose real decodes in two "
              r"workloads ran ([\d.]+) of its fit's prediction, the same decode step moving (\d+)% and (\d+)% at the "
              r"median between the real engine's own two runs, .*? ([\d.]+) GB/s in the seventh and none in the eighth\. .*?"
              r"the fifth had neither \(its fit erred [\d.]+% rms\); the seventh had both,", "reads the seventh run made on another host")
    run = json.loads((RESULTS / f"2026-12-06_cpu-2core_sim_accuracy{m.group(2)}").read_text(encoding="utf-8"))
    assert "family/model/stepping 25/" in run["host"]["cpu"] and run["within_10pct"] == f"{m.group(1)}/15"
    assert f"{run['calibration']['hardware']['attention_span_bandwidth'] / 1e9:.1f}" == m.group(6)
    decodes = {w: v["decode"] for w, v in explain(run, run["calibration"]).items()}
    off = sorted((w for w, d in decodes.items() if d["real_over_pred_p50"] > 1.1))  # "in two workloads"
    assert off == ["bursty_mixed", "decode_heavy"], decodes
    assert {f"{decodes[w]['real_over_pred_p50']:.2f}" for w in off} == {m.group(3)}
    moved = sorted(round(100 * decodes[w]["same_step_moved_p50"]) for w in off)
    assert moved == [int(m.group(4)), int(m.group(5))], moved


def test_lab09_reading_of_the_eighth_run_on_another_host():
    """Lab 9's record of the eighth Zen 4 run: "... 8 and 11 of 15 metrics (..., and `..._stop68_run2.json`, made 86
    minutes later, whose real decodes ran 0.96-1.01 of its fit's prediction but whose real engine differed from itself
    by up to 33% between two runs of one workload), ... and none in the eighth. ... the eighth its real engine only"
    (the fit close to its real steps; the real engine far from itself).  Oracle: the run file (its score, spread,
    fitted span and start time against the seventh run's end: ``date_utc`` is written as a run ends) and
    ``sim_accuracy.explain`` against its own calibration."""
    from datetime import datetime

    from minivllm.bench.sim_accuracy import explain

    m = _lab09(r"met (?:\d+, ){6}\d+ and (\d+) of 15 metrics .*?`\.\.\.(_stop68_run2\.json)`, made (\d+) minutes later, "
              r"whose real decodes ran ([\d.]+)–([\d.]+) of its fit's prediction but whose real engine differed from "
              r"itself by up to (\d+)% between two runs of one workload\), .*? and none in the eighth\. .*?"
              r"the seventh had both, the eighth its real engine only\.", "reads the eighth run made on another host")
    run = json.loads((RESULTS / f"2026-12-06_cpu-2core_sim_accuracy{m.group(2)}").read_text(encoding="utf-8"))
    seventh = json.loads((RESULTS / "2026-12-06_cpu-2core_sim_accuracy_stop68.json").read_text(encoding="utf-8"))
    assert "family/model/stepping 25/" in run["host"]["cpu"] and run["within_10pct"] == f"{m.group(1)}/15"
    assert not run["calibration"]["hardware"].get("attention_span_bandwidth")
    decodes = [w["decode"]["real_over_pred_p50"] for w in explain(run, run["calibration"]).values()]
    assert (f"{min(decodes):.2f}", f"{max(decodes):.2f}") == (m.group(4), m.group(5))
    spread = max(v for w in run["workloads"].values() for v in w["real_spread"].values())
    assert round(100 * spread) == int(m.group(6)), spread

    def ended(doc) -> float:
        return datetime.fromisoformat(doc["date_utc"].replace("Z", "+00:00")).timestamp()

    assert round((ended(run) - run["seconds"] - ended(seventh)) / 60) == int(m.group(3))


def test_lab09_range_of_the_stop_runs_weakest_metric():
    """Lab 9: "the eighteen `*_stop*` runs committed since (1–6 December, the last six on another host) range from
    +13% to −31%" -- the long-prompt TTFT p99, the metric that sentence calls the weakest.  Oracle: the committed
    run files themselves (their count, their hosts, their errors)."""
    m = _lab09(r"the (\w+) `\*_stop\*` runs committed since \(1–6 December, the last (\w+) on another host\) "
              r"range from \+(\d+)% to −(\d+)%", "gives the stop runs' range")
    runs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(RESULTS.glob("*_sim_accuracy_stop*.json"))]
    words = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "sixteen": 16, "seventeen": 17, "eighteen": 18,
             "nineteen": 19, "twenty": 20}
    assert len(runs) == words[m.group(1)]
    zen4 = [r for r in runs if "family/model/stepping 25/" in r.get("host", {}).get("cpu", "")]
    assert len(zen4) == words[m.group(2)] and runs[-len(zen4):] == zen4  # the last ones, and only those
    errors = [r["workloads"]["long_prompt_chunked"]["rel_error"]["ttft_p99"] for r in runs]
    assert (round(100 * max(errors)), round(-100 * min(errors))) == (int(m.group(3)), int(m.group(4)))


@pytest.mark.parametrize("name", ["2026-11-30_nvidia-h200_llama1b_profile.json",
                                  "2026-11-30_nvidia-h200_llama1b_profile_run2.json"])
def test_the_h200_calibrations_refit_to_no_span(name):
    """The roofline docstring: re-fitted with the term, the two stored H200 calibrations "give it no weight: their fits
    come back unchanged".  ``test_refit_and_resimulate_reproduce_the_recorded_gpu_run`` compares the seven parameters
    these files were written with; this checks the eighth, and the error.  Oracle: each file's own stored fit."""
    from minivllm.sim import roofline

    assert "two stored H200 calibrations" in _flat(roofline.__doc__)
    assert "give it no weight: their fits come back unchanged" in _flat(roofline.__doc__)
    doc = json.loads((RESULTS / name).read_text(encoding="utf-8"))
    assert "attention_span_bandwidth" not in doc["hardware"] and len(doc["fit"]["params"]) == 7  # written before it
    err = doc["fit"]["rms_rel_error"]
    new = calibrate.refit(doc)
    assert new["hardware"]["attention_span_bandwidth"] is None and new["fit"]["params"]["s_per_attn_span_byte"] == 0.0
    assert new["fit"]["rms_rel_error"] == pytest.approx(err, rel=1e-12)
