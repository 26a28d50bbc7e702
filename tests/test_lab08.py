"""Lab 8 beyond what the registry-driven tests cover: its checkers, its planted bugs, and the live-load harness.

Fast (the simulated executor only).  Oracles: the engine's own Prometheus
series (``EngineMetrics``) for the load harness, and the solution notebook's
exercise cells, patched with each planted bug, for the checkers.
"""

from __future__ import annotations

import io
import math
from contextlib import redirect_stdout
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import nbformat  # noqa: E402
import pytest  # noqa: E402

from minivllm.labs import check_lab08  # noqa: E402
from minivllm.labs.live import LiveLoad, ramp_arrivals, run_sim_load  # noqa: E402
from minivllm.labs.registry import apply_mutant  # noqa: E402
from minivllm.metrics.prometheus import EngineMetrics, observe_all  # noqa: E402

from tests.lab08_alarms import one_pass_alarm, popped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab08_serving.ipynb"


def _cell(name: str) -> str:
    nb = nbformat.read(SOLUTION, as_version=4)
    return next(c.source for c in nb.cells if f"exercise:{name}" in c.metadata.get("tags", []))


def _define(source: str, name: str):
    ns: dict = {}
    exec(compile(source, f"<{name}>", "exec"), ns)  # noqa: S102 - the lab's own solution cell
    return ns[name]


def _quiet(fn, *args):
    with redirect_stdout(io.StringIO()) as out:
        result = fn(*args)
    return result, out.getvalue()


@pytest.mark.parametrize("exercise", check_lab08.LAB.exercises, ids=lambda e: e.name)
def test_solution_passes_visible_and_hidden_checks(exercise):
    obj = _define(_cell(exercise.name), exercise.defines)
    assert _quiet(exercise.check, obj)[0]
    assert _quiet(exercise.hidden, obj, 12345)[0]


@pytest.mark.parametrize("exercise", check_lab08.LAB.exercises, ids=lambda e: e.name)
def test_every_planted_bug_is_caught(exercise):
    source = _cell(exercise.name)
    assert len(exercise.mutants) >= 5
    survivors = []
    for description, old, new in exercise.mutants:
        mutated = apply_mutant(source, (description, old, new))  # MutantError: "no longer applies"
        try:
            obj = _define(mutated, exercise.defines)
        except Exception:  # noqa: BLE001 - does not even define the object: caught
            continue
        result, text = _quiet(exercise.check, obj)
        if result:
            survivors.append(description)
        else:
            assert "✘" in text
    assert not survivors, survivors


def test_run_sim_load_matches_the_engines_prometheus_series():
    """The live harness's TTFT/ITL are what /metrics would serve for the same run (count and sum)."""
    from prometheus_client.parser import text_string_to_metric_families

    engine = check_lab08.lab_engine(num_blocks=128)
    metrics = EngineMetrics("sim")
    step = engine.step

    def observed_step():
        outs = step()
        observe_all(metrics, engine, outs)
        return outs

    engine.step = observed_step
    run = run_sim_load(engine, ramp_arrivals([6, 12], 3.0, seed=2), every_s=0.5)
    totals: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    assert run.stats["num_preemptions"] > 0  # a pool this small preempts: the harness must still agree
    assert len(run.ttft) == totals["vllm:time_to_first_token_seconds_count"] == len(run.arrivals)
    assert math.isclose(sum(run.ttft.values()), totals["vllm:time_to_first_token_seconds_sum"], rel_tol=1e-9)
    itls = run.all_itls()
    assert len(itls) == totals["vllm:inter_token_latency_seconds_count"]
    assert math.isclose(sum(itls), totals["vllm:inter_token_latency_seconds_sum"], rel_tol=1e-9)
    assert len(run.e2e) == len(run.arrivals)
    # scrapes: one per 0.5 s of virtual time, in order; the queue drains at the end
    times = [s.time for s in run.samples]
    assert times == sorted(times) and len(times) >= run.duration / 0.5 - 1
    assert sum(s.arrived for s in run.samples) <= len(run.arrivals)
    assert all(0.0 <= s.kv_usage <= 1.0 and 0.0 <= s.utilisation <= 1.0 for s in run.samples)


def _counting_outputs(engine) -> list[int]:
    """Wrap ``engine.step`` to note how many outputs each step built (one list entry per step)."""
    built: list[int] = []
    step = engine.step

    def counted():
        outs = step()
        built.append(len(outs))
        return outs

    engine.step = counted
    return built


def test_a_run_without_scrapes_reports_each_request_once_and_measures_the_same_latencies():
    """``every_s=None`` (the sweeps: only the summary is read) builds one output per request, at its end, instead
    of one per running request per step -- half of a 256-seat run's time.  Oracle: the step log, recounted
    offline by ``metrics_from_step_log`` (which tokens each step sampled, when): the run's TTFTs and gaps must be
    exactly its, on a pool small enough to preempt (a recompute's tokens keep their first times)."""
    from minivllm.metrics.prometheus import metrics_from_step_log

    arrivals = ramp_arrivals([6, 12], 3.0, seed=2)
    engine = check_lab08.lab_engine(num_blocks=128)
    built = _counting_outputs(engine)
    run = run_sim_load(engine, arrivals, every_s=None)
    assert run.stats["num_preemptions"] > 0 and run.samples == []
    assert sum(built) == len(arrivals) == len(run.e2e)  # one output each: the last
    recount = metrics_from_step_log(engine.step_log, {a.request_id: a.prompt_len for a in arrivals},
                                    {a.request_id: a.time for a in arrivals}, 128)
    assert run.ttft == pytest.approx(recount["ttft"], abs=1e-12)
    assert sorted(run.all_itls()) == pytest.approx(sorted(recount["itl"]), abs=1e-12)
    assert len(run.all_itls()) + len(arrivals) == recount["generation_tokens"]
    with pytest.raises(ValueError, match="on_sample"):  # a live picture needs scrapes
        run_sim_load(check_lab08.lab_engine(), arrivals, every_s=None, on_sample=lambda r: None)


def test_lab8s_sweeps_build_one_output_per_request():
    """The knee sweeps, the bill at scale, the fleet and the tuning table read summaries and counters, never a
    scrape: each request must report once, not once per step (the at-scale sweep was the lab's slowest cell,
    half of it spent building streaming outputs).  Oracle: the number of requests each run was offered."""
    from minivllm.engine import output_processor
    from minivllm.labs import at_scale

    made = []
    real = output_processor.OutputProcessor._make_output

    def counting(self, *args):
        made.append(1)
        return real(self, *args)

    runs = {"at_scale.knee_sweep": (lambda: at_scale.knee_sweep((20,), 1.0), len(ramp_arrivals([20], 1.0, seed=1))),
            "knee_sweep": (lambda: check_lab08.knee_sweep((4,), 2.0), len(ramp_arrivals([4], 2.0, seed=1))),
            "tuning_run": (lambda: check_lab08.tuning_run(512, seconds=2.0), len(ramp_arrivals([8.0], 2.0, seed=1))),
            "cost_run": (lambda: check_lab08.cost_run(1.0), len(check_lab08.cost_arrivals(1.0))),
            "fleet_scrape": (lambda: check_lab08.fleet_scrape(seconds=1.0),
                             sum(len(ramp_arrivals([r], 1.0, seed=1)) for r in check_lab08.FLEET.values()))}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(output_processor.OutputProcessor, "_make_output", counting)
        for name, (sweep, requests) in runs.items():
            made.clear()
            sweep()
            assert len(made) == requests, (name, len(made), requests)


def test_ramp_arrivals_rates_and_errors():
    arr = ramp_arrivals([5, 20], 20.0, seed=0)
    first = sum(a.time < 20 for a in arr)
    second = len(arr) - first
    assert 60 <= first <= 140 and 300 <= second <= 500  # Poisson counts around 100 and 400
    assert arr == ramp_arrivals([5, 20], 20.0, seed=0)
    with pytest.raises(ValueError):
        ramp_arrivals([0], 1.0)


def test_ramp_arrivals_count_each_step_at_its_own_rate():
    """Each step of the ramp is a Poisson process at its own rate over its own ``seconds_each`` window, started
    at the window's start.  Oracle: Poisson counts summed over 20 fixed seeds, each within 5.5 standard
    deviations (sqrt of the mean) of rate x seconds x 20: 10 +- 18, 4,000 +- 348, 1,000 +- 174; the seeds are
    fixed, so this cannot flake.  Kills: a step's clock restarted from the last arrival instead of the step's
    start (after a quiet first step with no arrival, the 20 req/s step began at 0 s: hundreds of arrivals in
    the first 10 s), and a step rate off by 15% (the test above allows 25% and more)."""
    rates, each, seeds = (0.05, 20.0, 5.0), 10.0, range(20)
    counts = [0, 0, 0]
    for seed in seeds:
        for a in ramp_arrivals(list(rates), each, seed=seed):
            counts[int(a.time // each)] += 1
    for n, rate in zip(counts, rates):
        mean = rate * each * len(seeds)
        assert abs(n - mean) <= 5.5 * mean ** 0.5, (counts, rates)


def test_live_widget_redraws_in_place():
    pytest.importorskip("ipywidgets")
    live = LiveLoad(check_lab08.lab_engine, ramp_arrivals([4], 2.0, seed=0), every_s=0.5, redraw_every=2,
                    figsize=(6, 1.5))
    import ipywidgets as w

    live._image = w.Image(value=live.png(), format="png")
    live._label = w.Label(value=live.line())
    first = live._image.value
    run = live.run()
    assert live.num_redraws >= 3  # updated while it ran, not only at the end
    assert bytes(live._image.value) != bytes(first) and bytes(live._image.value).startswith(b"\x89PNG")
    assert "served" in live._label.value and run.summary()["served"] == len(run.arrivals)


def test_the_alarm_story_holds_on_the_ramp():
    """What section 4 claims: queue/TTFT/KV alarms fire past the knee; busy fires at healthy load; compute never."""
    ramp = check_lab08.ramp_run()
    best = check_lab08.max_rate_meeting_slo(check_lab08.knee_sweep(rates=(2, 4, 6, 7, 8, 9)))
    assert best == 7
    alarm = check_lab08.reference_first_alarm
    for signal, threshold in (("waiting", 4), ("ttft_p90", 0.5), ("kv_usage", 0.9)):
        t = alarm(ramp.samples, signal, threshold, 2.0)
        assert t is not None and check_lab08.rate_at(t) > best, (signal, t)
    assert check_lab08.rate_at(alarm(ramp.samples, "busy", 0.95, 2.0)) < best
    assert alarm(ramp.samples, "utilisation", 0.5, 2.0) is None


def _one_step_s(seconds: float):
    """A simulated engine whose every step takes ``seconds``, whatever it holds: windows can be counted by hand."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    return sim_engine(executor=SimulatedExecutor(fixed_overhead_s=seconds, per_token_s=0.0, per_context_token_s=0.0),
                      max_num_batched_tokens=16, max_num_seqs=4)


def test_a_step_longer_than_a_window_is_split_across_the_windows_it_spans():
    """One 16-token prompt and 3 outputs: three 2 s steps, scraped every 0.5 s.  By hand: every window is busy
    (a step is always running), none is over 100%, and the first token comes out at t = 2.0, so the windows
    ending at 0.5, 1.0 and 1.5 hold no token.  Before, each step was booked whole to the window it started in:
    400% busy at t = 0.5, idle windows mid-step, and a first token counted 1.5 s before it existed."""
    from minivllm.labs.live import SimArrival

    run = run_sim_load(_one_step_s(2.0), [SimArrival(0.0, "r0", "default", 16, 3)], every_s=0.5)
    assert [s.time for s in run.samples] == [0.5 * k for k in range(1, 13)]
    assert all(s.busy == pytest.approx(1.0) and s.utilisation <= 1.0 + 1e-9 for s in run.samples)
    assert [s.tokens_per_s for s in run.samples] == [0, 0, 0, 2.0] * 3  # one token per 2 s step, at its end


def test_arrivals_are_counted_in_the_window_they_arrived_in_and_the_last_window_by_its_length():
    """r1 arrives at 0.45 s, inside a 0.3 s step that ends at 0.6 s: it arrived in the window ending at 0.5 s,
    although the loop adds it after that step.  And a partial last window (LiveLoad scrapes at the end) is
    divided by its own length: a steady 10 tokens/s engine reads 10 tokens/s there too."""
    from minivllm.labs.live import SimArrival

    run = run_sim_load(_one_step_s(0.3), [SimArrival(0.0, "r0", "default", 16, 4),
                                          SimArrival(0.45, "r1", "default", 16, 2)], every_s=0.5)
    assert [s.arrived for s in run.samples][:2] == [2, 0]
    run = run_sim_load(_one_step_s(0.1), [SimArrival(0.0, "r0", "default", 8, 13)], every_s=1.0,
                       on_sample=lambda r: None)
    assert run.duration == pytest.approx(1.3)
    last = run.samples[-1]
    assert last.time == pytest.approx(1.3)
    assert last.busy == pytest.approx(1.0) and last.tokens_per_s == pytest.approx(10.0)


def test_first_alarm_check_is_the_same_whatever_ran_before_it():
    """The checker keeps the ramp for the whole process (functools.cache); a learner function that reads its list
    by popping it must not shorten that copy.  Oracle: the same check run first in a fresh state -- its expected
    answers, and the verdict on a function that is right on every list it is given, must not move."""

    def consuming(samples, signal, threshold, for_s):  # right on every series, but it empties its input
        return one_pass_alarm(popped(samples), signal, threshold, for_s)

    fresh = check_lab08.ramp_run().samples  # the ramp as a first check sees it
    seen = []

    def reference(samples, *args):  # the reference, noting how much of the ramp it is given
        seen.append(len(samples))
        return check_lab08.reference_first_alarm(samples, *args)

    with redirect_stdout(io.StringIO()):
        verdicts = [check_lab08.check_first_alarm(consuming).passed for _ in range(2)]
        assert check_lab08.check_first_alarm(reference).passed
    assert verdicts == [True, True]
    assert seen[-3:] == [len(fresh)] * 3  # the three ramp calls saw the whole ramp


def test_prompt_ids_are_randrange_drawn_one_at_a_time():
    """The bulk draw gives the ids ``randrange(10, 900)`` gives one call at a time (oracle: that loop), across
    refills of its buffer and for takes of every size, so a sweep serves the prompts it always served."""
    import random

    from minivllm.labs.live import prompt_ids

    for seed in (0, 1, 3):
        take, rng = prompt_ids(seed), random.Random(seed)
        for n in (1, 64, 0, 5000, 3, 12000, 511):
            assert take(n) == [rng.randrange(10, 900) for _ in range(n)], (seed, n)


def test_run_sim_load_adds_the_randrange_prompts_in_arrival_order():
    """What the engine is handed: each request's prompt is the next ``prompt_len`` ids of one ``Random(seed)``
    drawn with ``randrange(10, 900)``, requests taken in arrival order (a recount by the loop it replaced)."""
    import random

    engine = check_lab08.lab_engine()
    seen = {}
    add = engine.add_request

    def spy(prompt, params, request_id, **kw):
        seen[request_id] = list(prompt["prompt_token_ids"])
        return add(prompt, params, request_id, **kw)

    engine.add_request = spy
    arrivals = ramp_arrivals([6], 2.0, seed=4)
    run_sim_load(engine, arrivals, every_s=None, seed=9)
    rng = random.Random(9)
    assert list(seen) == [a.request_id for a in sorted(arrivals, key=lambda a: a.time)]
    for a in sorted(arrivals, key=lambda a: a.time):
        assert seen[a.request_id] == [rng.randrange(10, 900) for _ in range(a.prompt_len)]


def test_first_alarm_checks_on_the_ramp_it_is_given(monkeypatch):
    """The notebook passes the ramp section 3 already ran: the check must not serve the ramp again, must judge
    on the scrapes it was given (the reference's times on them), and refuses something that is no ramp."""
    from tests.lab08_alarms import one_pass_alarm  # an independent answer

    short = run_sim_load(check_lab08.lab_engine(), ramp_arrivals([4, 12], 3.0, seed=2), every_s=0.5).samples

    def no_second_run():
        raise AssertionError("the checker served the ramp again")

    monkeypatch.setattr(check_lab08, "_ramp_for_checker", no_second_run)
    with redirect_stdout(io.StringIO()):
        assert check_lab08.check_first_alarm(one_pass_alarm, ramp=short).passed
        # an answer right everywhere but on these scrapes fails the ramp case: the check read them
        late = check_lab08.check_first_alarm(lambda s, sig, th, f: None if len(s) == len(short) else
                                             check_lab08.reference_first_alarm(s, sig, th, f), ramp=short)
    assert not late.passed
    for bad in ([], [1, 2], None.__class__):
        with pytest.raises(ValueError, match="ramp"):
            check_lab08.check_first_alarm(one_pass_alarm, ramp=bad)


def test_live_show_draws_no_picture_before_the_run():
    """``show()`` runs at once: its first picture comes from the run's first redraw, so the renders are the
    redraws plus the final one (an empty picture drawn first was a sixth of the lab's ramp cell)."""
    pytest.importorskip("ipywidgets")
    live = LiveLoad(check_lab08.lab_engine, ramp_arrivals([4], 2.0, seed=0), every_s=0.5, redraw_every=2,
                    figsize=(4, 1))
    drawn = []
    png = live.png
    live.png = lambda run=None: drawn.append(run) or png(run)
    with redirect_stdout(io.StringIO()):
        live.show()
    assert live.num_redraws >= 2 and len(drawn) == live.num_redraws + 1
    assert bytes(live._image.value).startswith(b"\x89PNG")
    bundle = live.widget._repr_mimebundle_()
    bundle = bundle[0] if isinstance(bundle, tuple) else bundle
    assert bundle["image/png"]  # the saved notebook keeps the final picture
