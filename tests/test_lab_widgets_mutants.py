"""Pins from a mutation pass over the labs' pictures: the numbers and text lines a learner reads off them.

Every widget here draws a picture *and* prints a text line (the static fallback nbval compares), and both
are computed from the engine's state by the helpers in :mod:`minivllm.labs.widgets` and
:mod:`minivllm.labs.live`.  The pass planted small bugs in those helpers (an off-by-one in a token span,
the host tier's owners read from the device tables, a stepper that ignores its stop rule, a p99 title that
shows p90, ...); each test below failed on at least one planted bug that nothing else caught.  The oracles
are independent of the code under test: a hand-built block pool or radix tree with a known answer, a
recount from the engine's own step log and pools, or the nearest-rank definition written out.
"""

from __future__ import annotations

import math
import random
import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minivllm import SamplingParams  # noqa: E402
from minivllm.kv.block_pool import BlockPool  # noqa: E402
from minivllm.kv.prefix.radix import RadixCache  # noqa: E402
from minivllm.labs import widgets, workloads  # noqa: E402
from minivllm.request import RequestStatus  # noqa: E402

from tests.invariants import steps, tiny_engine  # noqa: E402
from tests.test_labs import recompute_run  # noqa: E402


def _rank(values, q):
    """Nearest rank written out: the smallest sample with at least ``q`` percent of the samples at or below it."""
    ordered = sorted(values)
    return next(v for i, v in enumerate(ordered, 1) if i * 100 >= q * len(ordered))


# -- step log: timeline rows and the one-line step description ------------------------------------------------


def test_timeline_rows_are_placed_at_the_step_numbers_the_log_gives():
    """A timeline column is the engine's step number, so a row lines up with ``describe_step``'s ``step N``.
    Oracle: a hand-built two-request log whose answer is written out."""
    log = [{"step": 0, "seqs": [("a", 0, 4)]},
           {"step": 1, "seqs": [("a", 4, 2), ("b", 0, 3)]},
           {"step": 2, "seqs": [("a", 6, 1), ("b", 3, 1)]}]
    rows = widgets.timeline_rows(log, {"a": 6, "b": 3})
    assert rows == {"a": [(0, "prefill", 4), (1, "prefill", 2), (2, "decode", 1)],
                    "b": [(1, "prefill", 3), (2, "decode", 1)]}


def test_describe_step_counts_tokens_names_slices_and_victims_as_the_log_says():
    """The line a stepper prints per step: the token count, each prefill chunk as a ``[start:end]`` slice of the
    prompt, and who was preempted.  Oracle: a recount of every entry of a real run with preemptions -- the
    count is the sum of the chunks, a slice is as long as its chunk, and every victim is named."""
    eng, lens = recompute_run()
    assert any(e["preempted"] for e in eng.step_log)
    for e in eng.step_log:
        line = widgets.describe_step(e, lens)
        head = re.match(r"step +(\d+): +(\d+) tokens \| ", line)
        assert head and int(head.group(1)) == e["step"]
        assert int(head.group(2)) == sum(n for _, _, n in e["seqs"]), line
        for rid, start, num in e["seqs"]:
            m = re.search(rf"\b{rid} prefill\[(\d+):(\d+)\]", line)
            if m:
                assert (int(m.group(1)), int(m.group(2)) - int(m.group(1))) == (start, num), line
        for victim in e["preempted"]:
            assert "preempted" in line and victim in line.split("preempted", 1)[1], line


# -- block pool -------------------------------------------------------------------------------------------------


def test_describe_block_pool_counts_free_blocks_and_marks_only_shared_ones():
    """"shared" is the lab-3 point of the picture: a block with more than one reference.  Oracle: a pool of 8
    where ``a`` holds 3 blocks, ``b`` holds 2 and shares ``a``'s first (two references): 3 blocks free."""
    pool = BlockPool(8)
    a = pool.allocate_many(3)
    b = pool.allocate_many(2)
    pool.incref(a[0])
    text = widgets.describe_block_pool(pool, {"a": a, "b": [a[0]] + b})
    assert text.splitlines() == ["3/8 blocks free",
                                 f"  a: {a}  shared: [{a[0]}]",
                                 f"  b: {[a[0]] + b}  shared: [{a[0]}]"]


def test_block_owners_lists_each_table_in_token_order():
    """A block table is ordered: its k-th block holds the request's tokens ``k*bs .. k*bs+bs-1``, which is what
    the picture's cells and the text line show.  Once blocks are recycled a table is no longer ascending, so
    sorting it would scramble that.  Oracle: :class:`invariants.KVContents`, which records the token written
    into every KV slot -- each listed block must hold the request's tokens in order."""
    eng = tiny_engine(num_blocks=16, budget=16, max_len=64)
    rng = random.Random(1)
    for i in range(8):
        eng.add_request({"prompt_token_ids": [rng.randrange(10, 900) for _ in range(rng.randrange(5, 20))]},
                        SamplingParams(max_tokens=rng.randrange(4, 16), ignore_eos=True), f"r{i}")
    bs, unsorted = 4, 0
    for _ in steps(eng):
        running = {r.request_id: r for r in eng.scheduler.running}
        for rid, table in widgets.block_owners(eng).items():
            req = running[rid]
            unsorted += table != sorted(table)
            for p in range(req.num_computed_tokens):
                assert eng.executor.device.get((table[p // bs], p % bs)) == req.all_token_ids[p], (rid, p, table)
    assert unsorted, "the run should recycle blocks out of order"


# -- radix tree --------------------------------------------------------------------------------------------------


def _two_branch_tree():
    """Two prompts sharing their first two 4-token blocks, then one block each; the second is still running.

    Known answer: root -> shared node (positions 0-7, 2 blocks) -> two leaves (positions 8-11), the second leaf
    locked (its request holds it), the first not (only the cache refers to it)."""
    pool = BlockPool(32)
    cache = RadixCache(pool, 4)
    shared = list(range(100, 108))
    prompts = [shared + [1, 2, 3, 4, 9], shared + [5, 6, 7, 8, 9]]
    replay = workloads.PrefixReplay(cache, pool, prompts, block_size=4)
    replay.step()
    replay.step()
    return cache, shared


def test_radix_nodes_give_each_edge_its_parent_depth_and_token_positions():
    cache, shared = _two_branch_tree()
    nodes = widgets.radix_nodes(cache)
    assert [n["parent"] for n in nodes] == [None, 0, 1, 1]
    assert [n["depth"] for n in nodes] == [0, 1, 2, 2]
    assert [(n["start"], n["tokens"]) for n in nodes] == [(0, []), (0, shared), (8, [1, 2, 3, 4]),
                                                          (8, [5, 6, 7, 8])]
    assert [bool(n["locked"]) for n in nodes] == [False, True, False, True]


def test_describe_radix_tree_indents_by_depth_and_spans_positions_inclusively():
    """The text tree: two spaces per level below the root, and ``start-end`` positions inclusive (8 tokens from
    position 0 are ``0-7``), like the docstring's ``48-63`` for a 16-token block."""
    cache, _ = _two_branch_tree()
    lines = widgets.describe_radix_tree(cache).splitlines()
    assert lines[0].startswith("root[")
    assert [len(ln) - len(ln.lstrip(" ")) for ln in lines[1:]] == [2, 4, 4]
    assert [re.search(r"tokens (\d+-\d+):", ln).group(1) for ln in lines[1:]] == ["0-7", "8-11", "8-11"]
    assert "locked" not in lines[2] and "locked" in lines[3]


def test_token_span_shows_the_first_ids_and_the_last_one_only_when_some_are_hidden():
    """Oracle: the docstring's format, ``"48-63: 812 33 901 … 14"``: positions inclusive, the first ``width``
    ids, and ``… last`` only when ids were left out."""
    assert widgets.token_span({"start": 48, "tokens": [812, 33, 901, 7, 14]}) == "48-52: 812 33 901 … 14"
    assert widgets.token_span({"start": 4, "tokens": [5, 6, 7]}) == "4-6: 5 6 7"
    assert widgets.token_span({"start": 0, "tokens": [5, 6, 7, 8]}, width=2) == "0-3: 5 6 … 8"


def test_namespace_label_names_the_tenant_and_only_a_salt_that_is_set():
    assert widgets.namespace_label(("acme", None)) == "tenant=acme"
    assert widgets.namespace_label((None, "")) == "shared"
    assert widgets.namespace_label(("acme", "s1")) == "tenant=acme, salt=s1"


# -- two tiers and the tier stepper ------------------------------------------------------------------------------


def _swap_engine():
    """test_preemption's overload in swap mode: 40 device blocks, a 64-block host tier, ten 30-token answers."""
    eng = tiny_engine(preemption_mode="swap", num_cpu_blocks_override=64, num_blocks=40, max_len=128, budget=64)
    rng = random.Random(0)
    for i in range(10):
        eng.add_request({"prompt_token_ids": [rng.randrange(10, 900) for _ in range(rng.randrange(5, 30))]},
                        SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
    return eng


def _check_tiers(eng):
    """Recount both tiers from the requests and the pools, and read ``describe_kv_tiers`` against the log."""
    device, host = widgets.tier_owners(eng)
    sched = eng.scheduler
    swapped = sorted(r.request_id for r in sched.waiting if r.status is RequestStatus.SWAPPED)
    cpu = eng.kv.cpu_pool
    assert sorted(host) == swapped
    assert sum(map(len, host.values())) == cpu.num_blocks - cpu.num_free
    held = {b for t in host.values() for b in t}
    assert all(cpu.refcount(b) >= 1 for b in held)
    assert sum(map(len, device.values())) <= eng.pool.num_blocks - eng.pool.num_free
    text = widgets.describe_kv_tiers(eng)
    last = eng.step_log[-1]
    assert f"{last['swapped_out']} out, {last['swapped_in']} in" in text, text
    assert f"host {cpu.num_free}/{cpu.num_blocks} free" in text, text
    assert f"device {eng.pool.num_free}/{eng.pool.num_blocks} free" in text, text
    assert text.endswith(f"swapped: {swapped or '-'}"), text


def test_tier_owners_and_the_tier_line_match_a_recount_of_both_pools():
    """A request parked in the host tier is in the waiting queue with status SWAPPED and holds host blocks only;
    the picture's right half and the text line must show exactly those.  Oracle: the pools' own free counts
    and the requests' statuses, at every step of a run that swaps out and back in."""
    eng = _swap_engine()
    moved = 0
    for _ in steps(eng):
        _check_tiers(eng)
        moved += bool(eng.step_log[-1]["swapped_out"]) + bool(eng.step_log[-1]["swapped_in"])
    assert moved >= 2


def test_next_swap_stops_at_the_first_step_that_moves_blocks_either_way():
    """"next swap" must stop at a swap-in too (the picture where the victim comes back).  Oracle: the step log
    -- of the steps one click ran, only the last moved blocks."""
    eng = _swap_engine()
    ts = widgets.TierStepper(eng)
    saw_in = False
    while eng.has_unfinished_requests():
        before = len(eng.step_log)
        ts.until_swap()
        ran = eng.step_log[before:]
        moving = [bool(e["swapped_out"] or e["swapped_in"]) for e in ran]
        assert not any(moving[:-1]), [e["step"] for e in ran]
        saw_in |= bool(ran[-1]["swapped_in"])
    assert saw_in


def test_next_swap_honours_the_stop_rule_as_run_to_end_does():
    """``stop`` ends every multi-step control; "next swap" stepped on past it to the first swap.  Oracle: the
    step log -- this workload's first swap is many steps in, and a stop at the second step ends both "run to
    end" and "next swap" there, before any block has moved."""
    first_swap = next(e["step"] for e in _finished_log(_swap_engine()) if e["swapped_out"] or e["swapped_in"])
    assert first_swap > 2
    for label in ("run to end", "next swap"):
        eng = _swap_engine()
        widgets.TierStepper(eng, stop=lambda e: len(e.step_log) == 2).press(label)
        assert len(eng.step_log) == 2, label


def _finished_log(eng) -> list[dict]:
    while eng.has_unfinished_requests():
        eng.step()
    return list(eng.step_log)


# -- Stepper ------------------------------------------------------------------------------------------------------


def test_a_stepper_click_runs_one_engine_step_and_honours_its_stop_rule():
    """"next step" is one engine step (a learner counts them against the log), and ``stop`` ends a multi-step
    run at the first step it holds.  Oracle: the engine's step log length."""
    eng = tiny_engine()
    for i in range(3):
        eng.add_request({"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=8, ignore_eos=True),
                        f"r{i}")
    st = widgets.Stepper(eng, draw=lambda e, ax: None, describe=lambda e: f"step {e.step_log[-1]['step']}",
                         stop=lambda e: len(e.step_log) == 4)
    st.step(1)
    assert len(eng.step_log) == 1 and st.position() == "steps run: 1"
    assert st.step(100).splitlines() == ["step 1", "step 2", "step 3"]
    assert len(eng.step_log) == 4 and st.position() == "steps run: 4"



def test_run_to_end_reports_the_last_step_it_ran_and_that_the_work_is_done():
    """"run to end" answers in two lines: the last step's log line, then "no work left".  With only the second a
    click that ran a hundred steps reads as if it ran none (the learner cannot tell what the last step did, which
    is what the redrawn picture shows).  Oracle: the engine's step log -- the last step's number is its length
    less one."""
    eng = tiny_engine()
    eng.add_request({"prompt_token_ids": list(range(10, 30))}, SamplingParams(max_tokens=8, ignore_eos=True), "r")
    st = widgets.Stepper(eng, draw=lambda e, ax: None, describe=lambda e: f"step {e.step_log[-1]['step']}")
    run_to_end = dict(st.actions())["run to end"]
    assert run_to_end().splitlines() == [f"step {len(eng.step_log) - 1}", "no work left"]
    assert len(eng.step_log) > 2 and not eng.has_unfinished_requests()

# -- BudgetExplorer and the ITL histogram ------------------------------------------------------------------------


def test_budget_explorer_first_draws_the_default_values_of_its_slider_tuples():
    """``budget`` and ``threshold`` are ``(min, max, step, default)``; the first picture is the defaults."""
    calls = []

    def simulate(budget, threshold):
        calls.append((budget, threshold))
        return {"step_log": [], "prompt_lens": {}, "itls": [], "title": "", "summary": ""}

    ex = widgets.BudgetExplorer(simulate, budget=(64, 4096, 64, 512), threshold=(0, 2048, 64, 256))
    ex.png()
    assert calls == [(512, 256)]


def test_itl_histogram_marks_and_titles_the_nearest_rank_p50_p99_and_worst_in_ms():
    """The histogram's title and marker lines are what lab 4's learners quote.  Oracle: nearest rank written
    out on 200 gaps whose p50, p99 and maximum differ (seconds in, milliseconds out)."""
    gaps = [0.010 + 0.001 * (i % 50) for i in range(196)] + [0.200, 0.300, 0.400, 0.900]
    ms = [1000 * g for g in gaps]
    p50, p99, worst = _rank(ms, 50), _rank(ms, 99), max(ms)
    assert len({round(p50), round(p99), round(worst)}) == 3
    ax = Figure().subplots()
    widgets.draw_itl_histogram(gaps, ax=ax)
    assert ax.get_title() == f"decoders' ITL: p50 {p50:.0f} ms, p99 {p99:.0f} ms, worst {worst:.0f} ms"
    marks = {t.get_text().strip(): t.get_position()[0] for t in ax.texts}
    assert marks["p50"] == pytest.approx(p50) and marks["p99"] == pytest.approx(p99)
    assert marks["worst"] == pytest.approx(worst)
    lines = sorted(ln.get_xdata()[0] for ln in ax.lines)
    assert lines == pytest.approx(sorted([p50, p99, worst]))


def test_time_timeline_draws_a_one_token_prefill_chunk_as_prefill_not_a_decode_tick():
    """A prompt's last chunk can hold one token; it is a prefill (orange bar), not a decode (blue tick).
    Oracle: a hand-built log -- ``a``'s 5-token prompt in chunks of 4 and 1, then two decodes."""
    log = [{"step": 0, "time": 1.0, "seqs": [("a", 0, 4)]},
           {"step": 1, "time": 2.0, "seqs": [("a", 4, 1)]},
           {"step": 2, "time": 3.0, "seqs": [("a", 5, 1)]},
           {"step": 3, "time": 4.0, "seqs": [("a", 6, 1)]}]
    ax = Figure().subplots()
    widgets.draw_time_timeline(log, {"a": 5}, ax=ax)
    decode, prefill = ax.collections  # drawn decode first, then prefill
    assert (len(decode.get_paths()), len(prefill.get_paths())) == (2, 2)
    assert math.isclose(prefill.get_paths()[1].vertices[:, 0].min(), 1.0)


# -- the live load widget's numbers (lab 8) -----------------------------------------------------------------------


def _recorded_load(every_s: float = 0.5):
    """Lab 8's small pool (it preempts) under a 6-then-12 req/s ramp, with every engine step recorded from the
    outside: its start and end on the virtual clock, its token count, and each output's token times.  The
    recording is the oracle the harness's windows and summary are recounted from."""
    from minivllm.labs import check_lab08
    from minivllm.labs.live import ramp_arrivals, run_sim_load

    eng = check_lab08.lab_engine(num_blocks=128)
    ex, inner = eng.executor, eng.step
    steps = []

    def step():
        start = ex.clock
        outs = inner()
        steps.append((start, ex.clock, eng.step_log[-1].num_tokens,
                      [(o.request_id, list(o.metrics.token_times)) for o in outs]))
        return outs

    eng.step = step
    arrivals = ramp_arrivals([6, 12], 3.0, seed=2)
    run = run_sim_load(eng, arrivals, every_s=every_s, on_sample=lambda r: None)
    assert run.stats["num_preemptions"] > 0
    return eng, arrivals, run, steps


def test_live_summary_equals_a_recount_of_the_recorded_outputs():
    """``SimRun.summary`` is the line under lab 8's widget and the rows of its knee sweep: served requests,
    TTFT/ITL percentiles in ms, e2e in s, output tokens per second.  Oracle: the outputs recorded step by
    step (every request asks for ``max_tokens`` with EOS ignored), and nearest rank written out."""
    eng, arrivals, run, steps = _recorded_load()
    arrival = {a.request_id: a.time for a in arrivals}
    times: dict[str, list[float]] = {}
    for _, _, _, outs in steps:
        for rid, tt in outs:
            times.setdefault(rid, []).extend(tt)
    assert {r: len(t) for r, t in times.items()} == {a.request_id: a.max_tokens for a in arrivals}
    ttft = [t[0] - arrival[r] for r, t in times.items()]
    itl = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    e2e = [t[-1] - arrival[r] for r, t in times.items()]
    s = run.summary()
    assert s["served"] == len(arrivals) and s["rejected"] == 0
    for q in (50, 90, 99):
        assert s[f"ttft_p{q}_ms"] == pytest.approx(1000 * _rank(ttft, q))
        assert s[f"itl_p{q}_ms"] == pytest.approx(1000 * _rank(itl, q))
    for q in (50, 99):
        assert s[f"e2e_p{q}_s"] == pytest.approx(_rank(e2e, q))
    assert run.duration == pytest.approx(steps[-1][1] - arrivals[0].time)
    assert s["tokens_per_s"] == pytest.approx(sum(a.max_tokens for a in arrivals) / run.duration)
    assert s["preemptions"] == eng.stats()["num_preemptions"]


@pytest.mark.parametrize("every_s", [0.5, 4.0])
def test_live_samples_equal_a_window_by_window_recount_of_the_recorded_steps(every_s):
    """Each scrape reports its window ``(previous scrape, this one]``: busy and utilisation from the steps'
    overlap with it (a step's share of the budget), TTFT p90 of first tokens and ITL p99 of gaps that came out
    in it, output tokens per second of its own length, and arrivals by arrival time.  Oracle: the recorded
    steps, recounted per window (4 s windows hold enough first tokens for p90 to differ from the maximum)."""
    eng, arrivals, run, steps = _recorded_load(every_s=every_s)
    budget = eng.config.max_num_batched_tokens
    t0 = arrivals[0].time
    arrival = {a.request_id: a.time for a in arrivals}
    last: dict[str, float] = {}
    firsts, gaps, tokens = [], [], []  # (absolute time, value)
    for _, _, _, outs in steps:
        for rid, tt in outs:
            for t in tt:
                if rid in last:
                    gaps.append((t, t - last[rid]))
                else:
                    firsts.append((t, t - arrival[rid]))
                tokens.append(t)
                last[rid] = t
    edges = [t0] + [t0 + s.time for s in run.samples]
    assert edges == sorted(edges) and edges[-1] == pytest.approx(steps[-1][1])
    nan = float("nan")
    most_firsts = 0
    for s, lo, hi in zip(run.samples, edges, edges[1:]):
        length = hi - lo

        def inside(t, lo=lo, hi=hi):
            # a token within rounding of a scrape would make the recount ambiguous; this load has none
            assert t == hi or not (math.isclose(t, lo, abs_tol=1e-12) or math.isclose(t, hi, abs_tol=1e-12))
            return lo < t <= hi

        busy = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b, _, _ in steps)
        comp = sum(max(0.0, min(b, hi) - max(a, lo)) * min(1.0, n / budget) for a, b, n, _ in steps)
        w_first = [v for t, v in firsts if inside(t)]
        w_gaps = [v for t, v in gaps if inside(t)]
        most_firsts = max(most_firsts, len(w_first))
        assert s.busy == pytest.approx(min(1.0, busy / length), abs=1e-9)
        assert s.utilisation == pytest.approx(comp / length, abs=1e-9)
        assert s.tokens_per_s == pytest.approx(sum(inside(t) for t in tokens) / length)
        assert s.arrived == sum(lo < a.time <= hi or a.time == lo == t0 for a in arrivals)  # the first window holds t0
        got = (s.ttft_p90, s.itl_p99)
        want = (_rank(w_first, 90) if w_first else nan, _rank(w_gaps, 99) if w_gaps else nan)
        assert all((math.isnan(g) and math.isnan(w)) or g == pytest.approx(w) for g, w in zip(got, want)), (s, want)
    assert most_firsts >= (10 if every_s > 1 else 1)


def test_the_live_itl_panel_titles_the_nearest_rank_p99_in_ms():
    from minivllm.labs.live import SimArrival, SimRun, draw_live

    run = SimRun([SimArrival(0.0, "r0", "default", 8, 8)])
    run.itls = {"r0": [0.010 * (i + 1) for i in range(100)]}  # 10 ms .. 1000 ms: p99 = 990 ms, p90 = 900 ms
    fig = Figure()
    draw_live(run, fig)
    assert fig.axes[0].get_title() == "ITL histogram (p99 990 ms)"



def _fixed_step_engine(seconds: float):
    """A simulated engine whose every step takes ``seconds`` (test_lab08's): windows can be counted by hand."""
    from minivllm.sim.executor import SimulatedExecutor

    return workloads.sim_engine(executor=SimulatedExecutor(fixed_overhead_s=seconds, per_token_s=0.0,
                                                           per_context_token_s=0.0),
                                max_num_batched_tokens=16, max_num_seqs=4)


def test_an_arrival_on_a_scrape_boundary_counts_in_the_window_that_ends_there():
    """Windows are ``(previous scrape, this scrape]``, for tokens and arrivals alike (the first one also holds
    the run's start).  By hand: arrivals at 0, 0.5 and 1.0 s scraped every 0.5 s fall in the windows ending at
    0.5 (two), 1.0 (one), and none after."""
    from minivllm.labs.live import SimArrival, run_sim_load

    run = run_sim_load(_fixed_step_engine(0.2), [SimArrival(t, f"r{i}", "default", 8, 4)
                                                  for i, t in enumerate((0.0, 0.5, 1.0))], every_s=0.5)
    assert [s.arrived for s in run.samples][:3] == [2, 1, 0]


def test_served_counts_finished_requests_when_the_run_is_cut_short():
    """``max_steps`` can stop the loop with requests still decoding: they had a first token but were not
    served.  Oracle: the outputs the engine returned, counted by their ``finished`` flag."""
    from minivllm.labs.live import SimArrival, run_sim_load

    eng = _fixed_step_engine(0.1)
    inner, finished = eng.step, set()

    def step():
        outs = inner()
        finished.update(o.request_id for o in outs if o.finished)
        return outs

    eng.step = step
    run = run_sim_load(eng, [SimArrival(0.0, "short", "default", 8, 2), SimArrival(0.0, "long", "default", 8, 50)],
                       max_steps=6)
    assert finished == {"short"} and eng.has_unfinished_requests()
    assert run.summary()["served"] == 1 and set(run.ttft) == {"short", "long"}


def test_ramp_arrivals_deal_the_tenants_in_turn():
    """A multi-tenant ramp (lab 8's per-tenant panels) gives arrival ``i`` tenant ``i mod n``: each tenant gets
    its share of every rate step.  Oracle: the arrivals' order."""
    from minivllm.labs.live import ramp_arrivals

    arr = ramp_arrivals([5, 10], 4.0, tenants=("a", "b", "c"), seed=3)
    assert len(arr) > 20
    assert [a.tenant for a in arr] == [("a", "b", "c")[i % 3] for i in range(len(arr))]


def test_the_live_widget_redraws_once_every_redraw_every_scrapes():
    """``redraw_every`` thins the redraws (each one is a PNG render); a click's run redraws on every
    ``redraw_every``-th scrape and once more at the end.  Oracle: the number of scrapes the run took."""
    from types import SimpleNamespace

    from minivllm.labs import check_lab08
    from minivllm.labs.live import LiveLoad, ramp_arrivals

    live = LiveLoad(check_lab08.lab_engine, ramp_arrivals([4], 2.0, seed=0), every_s=0.25, redraw_every=3,
                    figsize=(4, 1))
    live._image, live._label = SimpleNamespace(value=b""), SimpleNamespace(value="")
    run = live.run()
    assert len(run.samples) >= 6
    assert live.num_redraws == len(run.samples) // 3
    assert live._image.value.startswith(b"\x89PNG") and live._label.value == live.line()


def test_a_run_ending_on_a_scrape_gets_no_extra_empty_window():
    """The closing partial scrape is for a run that ends between scrapes; one that ends exactly on one must not
    add a second sample of zero length (a flat zero at the end of every panel).  By hand: four 0.25 s steps
    (a prefill and three decodes) end at 1.0 s, scraped every 0.5 s."""
    from minivllm.labs.live import SimArrival, run_sim_load

    run = run_sim_load(_fixed_step_engine(0.25), [SimArrival(0.0, "r0", "default", 8, 4)], every_s=0.5,
                       on_sample=lambda r: None)
    assert run.duration == 1.0
    assert [s.time for s in run.samples] == [0.5, 1.0]


def test_batch_cost_rows_bill_the_rented_time_not_the_busy_time_on_a_sparse_load():
    """The batch class's cost argument rests on renting a GPU from the first arrival to the last token, busy
    or idle.  Lab 6's own load keeps the GPU busy almost all the time, so it cannot tell the two apart; a
    sparse one (one chat a second, two batch prompts) can.  Oracle: the chats' arrival times (the same seeded
    draw) bound the rented time from below; lab 8's price per GPU-hour turns it into the bill."""
    from minivllm.labs import at_scale
    from minivllm.labs.check_lab08 import GPU_HOUR_USD
    from minivllm.labs.live import ramp_arrivals

    rows = at_scale.batch_cost_runs(seconds=4.0, chat_rate=1.0, num_batch=2)
    chats = ramp_arrivals([1.0], 4.0, prompt=(64, 512), output=(64, 256), tenants=("chat",), seed=1)
    alone = rows["chats alone"]
    assert len(chats) >= 2 and alone["requests"] == len(chats)
    assert alone["gpu_s"] >= chats[-1].time - chats[0].time
    for name, r in rows.items():
        assert r["busy_s"] < r["gpu_s"] or name == "batch alone", name
        assert r["usd_per_m"] == pytest.approx(GPU_HOUR_USD * r["gpu_s"] / 3600 / (r["tokens"] / 1e6)), name


# -- at-scale helpers -----------------------------------------------------------------------------------------


def test_device_time_is_the_step_time_less_the_hosts_per_step_layer_and_sequence_costs():
    """Lab 7 sets ``device_s`` beside measured steps: what is left over is the host.  Oracle: the preset's own
    host constants (per step, per layer, per sequence), subtracted from the roofline step time."""
    from minivllm.labs import at_scale

    shape, hw = at_scale.presets()
    for seqs in ([(100, 1, True)] * 8, [(0, 2048, True)], [(0, 512, True), (300, 1, True)]):
        host = hw.step_overhead_s + shape.num_layers * hw.layer_overhead_s + len(seqs) * hw.seq_overhead_s
        assert at_scale.device_s(seqs) == pytest.approx(at_scale.step_s(seqs) - host)
        assert 0 < at_scale.device_s(seqs) < at_scale.step_s(seqs)


def test_chunk_sweep_reports_the_longest_single_request_chunk_and_tokens_over_virtual_time():
    """``max_chunk`` is the most tokens *one request* computed in one step (lab 6's 8K clause caps exactly that),
    not a whole step's tokens; ``tokens_per_s`` is prompt plus output tokens over the run's virtual time.
    Oracle: two prompts of 300 and 700 tokens arriving together under a 4,096-token budget -- both prefill
    whole in the first step (1,000 tokens), so the longest chunk is 700 -- and the last token's time from a
    second run of the same engine."""
    from minivllm.labs import at_scale
    from minivllm.arrival import Arrival
    from minivllm.labs.check_lab04 import run_arrivals

    arrivals = [Arrival(0.0, "c0", "default", tuple(range(10, 310)), 5),
                Arrival(0.0, "c1", "default", tuple(range(10, 710)), 7)]
    row = at_scale.chunk_sweep([4096], arrivals, num_blocks=256, max_len=2048)[4096]
    assert row["max_chunk"] == 700
    finals = run_arrivals(at_scale.chunk_engine(4096, num_blocks=256, max_len=2048), arrivals)
    end = max(o.metrics.token_times[-1] for o in finals.values())
    served = sum(len(a.prompt) + len(finals[a.request_id].outputs[0].token_ids) for a in arrivals)
    assert served == 300 + 5 + 700 + 7
    assert row["tokens_per_s"] == pytest.approx(served / end)


def test_a_request_that_failed_before_its_first_token_is_neither_served_nor_a_token():
    """A request the engine fails with no token (here a scheduling deadlock: the admission policy never admits
    ``b``, so the stall watchdog ends it as ``"error"``) produced nothing: it must not add an output token to
    tokens/s nor count as served, nor a token to any scrape window's ``tokens_per_s`` (mutant: a window counting one
    token per output instead of the output's token times, the same number for every output that carries a token).
    Oracle: the token times the engine's outputs carried, counted step by step, against the summary and against the
    windows' rates times their lengths (with ``on_sample`` every window is scraped, the last partial one too)."""
    from minivllm.labs.live import SimArrival, run_sim_load
    from minivllm.sim.executor import SimulatedExecutor

    class OnlyA:
        def order(self, waiting, running):
            return [r for r in waiting if r.request_id == "a"]

    eng = workloads.sim_engine(executor=SimulatedExecutor(fixed_overhead_s=0.1, per_token_s=0.0,
                                                          per_context_token_s=0.0),
                               max_num_batched_tokens=16, max_num_seqs=4, admission_policy=OnlyA())
    inner, tokens, reasons = eng.step, {}, {}

    def step():
        outs = inner()
        for o in outs:
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.metrics.token_times)
            if o.finished:
                reasons[o.request_id] = o.outputs[0].finish_reason
        return outs

    eng.step = step
    run = run_sim_load(eng, [SimArrival(0.0, "a", "default", 8, 3), SimArrival(0.0, "b", "default", 8, 3)],
                       every_s=0.25, on_sample=lambda _run: None)
    assert reasons == {"a": "length", "b": "error"} and tokens == {"a": 3, "b": 0}
    s = run.summary()
    assert s["tokens_per_s"] == pytest.approx(sum(tokens.values()) / run.duration)
    assert s["served"] == 1
    edges = [0.0] + [x.time for x in run.samples]
    assert edges[-1] == pytest.approx(run.duration)
    counted = sum(x.tokens_per_s * (hi - lo) for x, lo, hi in zip(run.samples, edges, edges[1:]))
    assert counted == pytest.approx(sum(tokens.values()))


def test_a_stepper_counts_and_a_timeline_shows_the_steps_a_wrapped_step_log_still_holds():
    """The step log is a ring buffer (``step_log_max_entries``): once it drops old records, its length is no
    longer the number of steps run, and its records carry step numbers past its length.  The stepper's
    "steps run" must still count every step, and the timeline's x range must cover the steps it draws.
    Oracle: the steps the stepper itself ran, and the step numbers of the records kept."""
    eng = workloads.sim_engine(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=16,
                               model_max_len=64, step_log_max_entries=40)
    lens = {f"r{i}": 8 for i in range(3)}
    for rid in lens:
        eng.add_request({"prompt_token_ids": list(range(10, 18))}, SamplingParams(max_tokens=20, ignore_eos=True),
                        rid)
    stepper = widgets.Stepper(eng, draw=lambda e, ax: widgets.draw_timeline(e.step_log, lens, ax=ax),
                              describe=lambda e: "")
    stepper.step(10_000)
    assert eng.step_log[0]["step"] > 0, "the log did not wrap: the test needs a smaller step_log_max_entries"
    assert stepper.position() == f"steps run: {stepper.steps_taken} -- no work left"
    ax = Figure().add_subplot()
    widgets.draw_timeline(eng.step_log, lens, ax=ax)
    lo, hi = ax.get_xlim()
    xs = [p.get_x() for p in ax.patches]
    assert xs and lo <= min(xs) and max(xs) + 0.95 <= hi
    assert min(xs) == eng.step_log[0]["step"] and max(xs) == eng.step_log[-1]["step"]
