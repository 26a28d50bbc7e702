"""``minivllm sim calibrate --check PROFILE``: does a stored profile still describe the engine it was fitted on?

The verdict is a ratio of measured to predicted step times, so the oracle is arithmetic: steps whose times are
made as a known multiple of the profile's own prediction must be judged at exactly that multiple.  One test runs
the real engine against a profile twenty times too fast, a margin no host closes (this course's 2-core VM has run
the same code 3.3x slower on one day than on another; a slow host only widens the margin).
"""

import json

import pytest

from minivllm.sim.calibrate import STALE_RATIO, CheckGroup, StepSample, check_groups, judge, main
from minivllm.sim.presets import load_profile
from minivllm.sim.roofline import HardwareSpec, ModelShape, roofline_time, step_cost

DECODE = [[0, 33, True], [0, 40, True]]  # two sequences, one token each
PROMPT = [[0, 160, True]]


@pytest.fixture(scope="module")
def doc():
    return load_profile("cpu-1thread-cputime")


def predicted(doc, seqs) -> float:
    shape, spec = ModelShape.from_dict(doc["model"]), HardwareSpec.from_dict(doc["hardware"])
    return roofline_time(step_cost(shape, [tuple(x) for x in seqs], 0, doc["engine"]["block_size"]), shape, spec).total


def steps(doc, seqs, factors):
    return [StepSample(seqs, 0, f * predicted(doc, seqs)) for f in factors]


def test_a_group_is_judged_by_the_median_of_its_steps_ratios(doc):
    got = judge(doc, [("decode", steps(doc, DECODE, [1.0, 1.1, 3.0])), ("prompt", steps(doc, PROMPT, [1.05]))])
    decode, prompt = got["groups"]
    assert decode["ratio"] == pytest.approx(1.1) and decode["steps"] == 3  # one slow step does not move it
    assert decode["predicted_ms_p50"] == pytest.approx(1e3 * predicted(doc, DECODE))
    assert decode["measured_ms_p50"] == pytest.approx(1.1e3 * predicted(doc, DECODE))
    assert prompt["ratio"] == pytest.approx(1.05)
    assert got["ratio"] == pytest.approx((1.1 + 1.05) / 2) and not got["stale"]


def test_each_shape_counts_once_however_many_steps_it_has(doc):
    """Twenty decode steps at x2 and one prompt each at x1 and x1.1: the verdict is the groups' median (x1.1),
    not the steps' (x2), so one kind of step with many steps cannot outvote the others."""
    got = judge(doc, [("decode", steps(doc, DECODE, [2.0] * 20)), ("prompt", steps(doc, PROMPT, [1.0])),
                      ("prompt again", steps(doc, PROMPT, [1.1]))])
    assert got["ratio"] == pytest.approx(1.1) and not got["stale"]


@pytest.mark.parametrize("factor,stale", [(1 + STALE_RATIO - 0.01, False), (1 + STALE_RATIO + 0.01, True),
                                          (1 - STALE_RATIO + 0.01, False), (1 - STALE_RATIO - 0.01, True),
                                          (0.55, True)])
def test_stale_beyond_the_threshold_on_either_side(doc, factor, stale):
    got = judge(doc, [("decode", steps(doc, DECODE, [factor])), ("prompt", steps(doc, PROMPT, [factor]))])
    assert got["ratio"] == pytest.approx(factor) and got["stale"] is stale


def test_a_group_without_steps_is_an_error_not_a_verdict(doc):
    with pytest.raises(ValueError, match="decode 1x32"):
        judge(doc, [("decode 1x32", [])])


def test_decode_groups_judge_only_their_decode_steps():
    """A decode group's first step computes the prompts; judging it would mix a prefill into a decode ratio."""
    group = CheckGroup("decode", [], decodes_only=True)
    prefill, decode = StepSample([[0, 32, True]], 0, 0.2), StepSample([[32, 1, True], [32, 1, True]], 0, 0.03)
    assert group.judged([prefill, decode]) == [decode]
    assert CheckGroup("mixed", []).judged([prefill, decode]) == [prefill, decode]


def test_check_groups_cover_each_kind_of_step_and_differ_in_their_prompts():
    groups = check_groups()
    assert [g.decodes_only for g in groups].count(True) == 6 and len(groups) == 9
    prompts = [tuple(r.prompt_token_ids) for g in groups for r in g.requests]
    assert len(set(prompts)) == len(prompts)  # no shared prefix: a cache hit would time a shorter prefill


def test_cli_calls_a_twenty_times_fast_profile_stale_on_the_real_engine(doc, tmp_path, capsys):
    """End to end: the bundled model measured on this machine, against the committed profile made twenty times
    faster.  Exit 1 is the verdict a script can read (0 would say the profile still holds)."""
    import torch

    fast = dict(doc, hardware=HardwareSpec.from_dict(doc["hardware"]).slowed(0.05).to_dict())
    path = tmp_path / "fast.json"
    path.write_text(json.dumps(fast))
    threads = torch.get_num_threads()
    try:
        assert main(["--check", str(path), "--repeats", "1", "--out", str(tmp_path / "check.json")]) == 1
    finally:
        torch.set_num_threads(threads)  # the CPU-clock engine runs one thread, as the profile was measured
    out = capsys.readouterr().out
    assert "stale" in out and "decode 8x32" in out
    assert f"minivllm sim calibrate --out {path} --name 'cpu-1thread-cputime' --clock cpu" in out  # itself, again
    printed = float(out.split("steps take x")[1].split()[0])
    assert printed > 5  # measured 20x the prediction, give or take the host
    # --out keeps the verdict as evidence: the same numbers, the command that reruns it, and this host
    kept = json.loads((tmp_path / "check.json").read_text())
    assert kept["stale"] is True and round(kept["ratio"], 3) == printed and kept["checked"] == str(path)
    assert [g["group"] for g in kept["groups"]] == [g.label for g in check_groups()]
    assert kept["command"].startswith(f"minivllm sim calibrate --check {path}") and kept["machine"]["cpu"]


@pytest.mark.parametrize("argv,needle", [
    (["--check", "cpu-2core", "--refit", "cpu-2core"], "two different jobs"),
    (["--check", "no-such-profile"], "no calibration profile"),
    (["--check", "cpu-2core", "--fit-bandwidth"], "drop --fit-bandwidth"),
    (["--check", "cpu-2core", "--clock", "cpu", "--quick"], "drop --quick, --clock"),
    (["--check", "cpu-2core", "--device", "cpu", "--force", "--name", "n"], "drop --name, --force, --device"),
])
def test_check_refuses_bad_requests_with_a_message(argv, needle, capsys):
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_check_refuses_a_profile_of_another_model(doc, tmp_path, capsys):
    other = dict(doc, model=dict(doc["model"], name="llama-3.2-1b"))
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(other))
    assert main(["--check", str(path)]) == 2
    assert "bundled model" in capsys.readouterr().err


def test_a_gpu_profile_is_judged_as_sim_run_reads_it(doc, tmp_path):
    """The verdict is about the predictions ``sim run --hardware PROFILE`` makes, so a GPU profile's roofs are read
    as sim run reads them (an unidentified compute roof becomes the datasheet's), and a profile sim run refuses
    (a GPU no datasheet names, without device memory) gets no verdict.  Oracle: sim run's own reader."""
    from minivllm.sim.presets import hardware_preset

    h200 = dict(doc, device="cuda", hardware=dict(doc["hardware"], name="NVIDIA H200", peak_flops=1e30))
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(h200))
    shape, seqs = ModelShape.from_dict(doc["model"]), [(0, 512, True)]
    as_sim_run = roofline_time(step_cost(shape, seqs, 0, 16), shape, hardware_preset(str(path))).total
    got = judge(h200, [("prompt 512", [StepSample([list(x) for x in seqs], 0, 2 * as_sim_run)])])
    assert got["groups"][0]["predicted_ms_p50"] == pytest.approx(1e3 * as_sim_run, rel=1e-9)
    assert got["ratio"] == pytest.approx(2.0)
    unknown = dict(doc, device="cuda", hardware=dict(doc["hardware"], name="Mystery GPU", memory_bytes=0))
    with pytest.raises(ValueError, match="KV pool cannot be sized"):
        judge(unknown, [("decode", steps(doc, DECODE, [1.0]))])


def test_check_refuses_a_profile_sim_run_cannot_read_before_measuring(doc, tmp_path, capsys, monkeypatch):
    """The profile's hardware is what the verdict is computed from; one that ``sim run`` would refuse must be
    refused before the engine is built and measured (on the loaded 2-core machine that is 40 s), not after."""
    import minivllm.sim.calibrate as calibrate

    def no_engine(**_kw):
        raise AssertionError("the engine was built for a profile that cannot be judged")

    monkeypatch.setattr(calibrate, "real_engine", no_engine)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(dict(doc, hardware={"name": "broken"})))
    assert main(["--check", str(path)]) == 2
    assert "peak_flops" in capsys.readouterr().err


def test_the_check_measures_with_the_profiles_threads_and_leaves_the_process_as_it_was(doc, monkeypatch):
    """The CPU-clock profile was measured on one torch thread, so its check measures on one; a notebook that runs
    the check keeps its own thread count afterwards (building the CPU-clock engine used to leave it at one)."""
    import torch

    import minivllm.sim.calibrate as calibrate
    from minivllm.sim.run import SimRequest

    seen = []
    real_measure_median = calibrate.measure_median

    def spying(engine, requests, repeats):
        seen.append(torch.get_num_threads())
        return real_measure_median(engine, requests, repeats)

    monkeypatch.setattr(calibrate, "measure_median", spying)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = calibrate.check(doc, calibrate.check_engine(doc), repeats=1,
                              groups=[CheckGroup("prompt 16", [SimRequest(0, 0.0, "cal", list(range(20, 36)), 1)])])
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert seen == [1] and after == 2
    assert got["groups"][0]["steps"] == 1


@pytest.mark.parametrize("hardware,says", [("cpu-2core", True), ("h100", False)])
def test_sim_run_on_a_profile_names_its_date_and_the_check(hardware, says, capsys):
    """A simulation on a calibration profile is a prediction for the host it was measured on; the report says
    when that was and how to ask whether it still holds here.  A datasheet preset is no snapshot of a host."""
    from minivllm.cli import main as cli_main

    assert cli_main(["sim", "run", "--hardware", hardware, "--model", "smollm2-135m", "--workload", "chat",
                     "--num-requests", "4"]) == 0
    out = capsys.readouterr().out
    date = load_profile("cpu-2core")["date_utc"]
    assert (f"--check {hardware}" in out and date in out) is says


ZEN5 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 26
model\t\t: 2
model name\t: AMD EPYC
stepping\t: 1
cpu MHz\t\t: 2596.122

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model name\t: Something Else
"""


def test_the_cpu_is_named_by_family_and_model_not_only_by_its_marketing_name():
    """Two hosts that both say "AMD EPYC" ran the same engine up to 2.6x apart; family / model tell them apart."""
    from minivllm.bench.results import cpu_from_cpuinfo

    assert cpu_from_cpuinfo(ZEN5) == "AMD EPYC (family/model/stepping 26/2/1) @ 2596 MHz"  # the first processor
    assert cpu_from_cpuinfo(ZEN5.replace("cpu family\t: 26", "cpu family\t: 25")) != cpu_from_cpuinfo(ZEN5)
    assert cpu_from_cpuinfo("Processor\t: ARMv7 rev 4 (v7l)\nBogoMIPS\t: 38.40\n") == "ARMv7 rev 4 (v7l)"
    assert cpu_from_cpuinfo("") is None and cpu_from_cpuinfo("\n\nflags : fpu\n") is None


def test_steal_is_the_share_of_the_whole_machines_ticks_between_two_readings():
    """A VM's run slowed by a neighbour shows as steal, never in its load average.  Oracle: by hand, from two
    ``/proc/stat`` texts: 1,000 ticks passed in all (user 600, system 100, idle 200, steal 100), so steal is 10%.
    Kills: steal over the busy ticks only (1/8), a missing column (an old kernel without steal) read as an error,
    and the ticks since boot read as the interval's (500 / 5,900)."""
    from minivllm.bench.results import cpu_times_from_stat, steal_share

    before = cpu_times_from_stat("cpu  1000 0 500 3000 0 0 0 400 0 0\ncpu0 9 9 9 9 9 9 9 9 0 0\nintr 5\n")
    after = cpu_times_from_stat("cpu  1600 0 600 3200 0 0 0 500 0 0\ncpu0 1 1 1 1 1 1 1 1 0 0\n")
    assert before == {"user": 1000, "nice": 0, "system": 500, "idle": 3000, "iowait": 0, "irq": 0, "softirq": 0,
                      "steal": 400}
    assert steal_share(before, after) == pytest.approx(100 / 1000)
    old = cpu_times_from_stat("cpu  10 0 5 30\n")  # a kernel that predates iowait / steal
    assert old["steal"] == 0 and steal_share(old, cpu_times_from_stat("cpu  20 0 5 40\n")) == 0.0
    assert steal_share(before, before) is None and steal_share(None, after) is None  # no interval, no reading
    assert cpu_times_from_stat("intr 5\n") is None


def test_the_check_says_which_host_the_profile_was_calibrated_on(doc):
    from minivllm.bench.results import cpu_identity
    from minivllm.sim.calibrate import format_check

    got = judge(dict(doc, host="AMD EPYC (family/model/stepping 25/1/1)"), [("decode", steps(doc, DECODE, [1.0]))])
    text = format_check(got, "p.json")
    assert "calibrated on AMD EPYC (family/model/stepping 25/1/1); this host: " + cpu_identity() in text
    older = format_check(judge({k: v for k, v in doc.items() if k != "host"}, [("d", steps(doc, DECODE, [1.0]))]), "p")
    assert "a host the profile did not record" in older


@pytest.mark.parametrize("clock,stale,warned", [("wall", True, True), ("cpu", True, False), ("wall", False, False)])
def test_a_stale_wall_clock_verdict_says_a_busy_moment_reads_slow_too(doc, clock, stale, warned):
    """Wall time counts other processes' share of the cores, so a stale wall-clock verdict may be a busy minute (two
    read x1.17 and x1.27 in the minutes after a calibration, one ten minutes later x0.96); it says so, and the
    CPU-time verdict, which other processes inflate far less, does not."""
    from minivllm.sim.calibrate import format_check

    got = judge(dict(doc, clock=clock), [("decode", steps(doc, DECODE, [1.5 if stale else 1.0]))])
    assert got["stale"] is stale
    assert ("busy moment reads slow" in format_check(got, "p.json")) is warned
