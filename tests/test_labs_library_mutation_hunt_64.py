"""Pins from a mutation hunt over the labs' library code (``labs/widgets.py``, ``labs/at_scale.py``,
``labs/live.py``, ``labs/workloads.py``, ``labs/grade.py``).

Each test below failed on a planted slip that every other test let through (its docstring names the slip) and
compares the helper with an oracle that does not go through it: a tree built by hand with a known answer, the
roofline applied to a named preset directly, the workload generator the helper is documented to scale, or a
grid worked out by hand.
"""

from __future__ import annotations

import re


from minivllm.kv.block_pool import BlockPool
from minivllm.kv.prefix.radix import RadixCache
from minivllm.labs import at_scale, widgets, workloads
from minivllm.sim.presets import hardware_preset, model_preset
from minivllm.sim.roofline import roofline_time, step_cost

# -- widgets: the radix tree's token positions -------------------------------------------------------------------


def test_a_node_three_levels_down_starts_where_all_its_ancestors_edges_end():
    """A radix node's ``start`` is the prompt position of its first token: the sum of every ancestor's edge, not
    just its parent's.  Kills: the child's start taken as its parent's edge length alone, which a two-level tree
    cannot tell apart (the first level starts at 0).  Oracle: a tree built by hand with 4-token blocks -- prompts
    ``A B C``, ``A B D`` and ``A E`` (8 tokens of ``A``, 4 each of the rest) give root -> A (0-7) -> B (8-11)
    -> C, D (12-15) and A -> E (8-11)."""
    pool = BlockPool(32)
    cache = RadixCache(pool, 4)
    a, b, c, d, e = list(range(100, 108)), [200, 201, 202, 203], [300, 301, 302, 303], [400, 401, 402, 403], \
        [500, 501, 502, 503]
    replay = workloads.PrefixReplay(cache, pool, [a + b + c + [9], a + b + d + [9], a + e + [9]], block_size=4)
    while replay.has_unfinished_requests():
        replay.step()
    spans = {tuple(n["tokens"][:1]): (n["depth"], n["start"]) for n in widgets.radix_nodes(cache) if n["tokens"]}
    assert spans == {(100,): (1, 0), (200,): (2, 8), (300,): (3, 12), (400,): (3, 12), (500,): (2, 8)}
    text = widgets.describe_radix_tree(cache)
    assert sorted(re.findall(r"tokens (\d+-\d+):", text)) == ["0-7", "12-15", "12-15", "8-11", "8-11"]



# -- workloads: a replay keeps each tenant's prefixes apart -----------------------------------------------------------


def test_a_replay_under_two_tenants_shares_nothing_and_under_one_shares_the_whole_prefix():
    """Lab 3 replays prompts under ``namespaces`` to show tenant isolation (bob cannot time a hit on alice's
    prompt).  Kills: every replayed request filed under one tenant, which turns the isolation demo into a hit.
    Oracle: a hand count with 4-token blocks: a 33-token prompt looks up its first 32 tokens, 8 full blocks, all
    cached by an identical earlier prompt of the same tenant and none by another tenant's; and the tree view
    shows one root per tenant."""
    prompt = list(range(100, 133))
    hits = {}
    for tenants in (("alice", "bob"), ("alice", "alice")):
        pool = BlockPool(32)
        cache = RadixCache(pool, 4)
        hits[tenants] = [r["hit_tokens"] for r in workloads.replay_prefix_cache(
            cache, pool, [prompt, prompt], namespaces=list(tenants), block_size=4)]
        roots = [ln for ln in widgets.describe_radix_tree(cache).splitlines() if ln.startswith("root[")]
        assert len(roots) == len(set(tenants)), roots
    assert hits == {("alice", "bob"): [0, 0], ("alice", "alice"): [0, 32]}


# -- at_scale: the hardware and the scale a caller names -----------------------------------------------------------


def test_step_and_device_time_are_those_of_the_hardware_named():
    """``step_s`` and ``device_s`` take a hardware preset by name (lab 7 asks for ``h200``); every lab cell so far
    uses the default, so a helper that dropped the argument would still print the H100's numbers for any card.
    Kills: ``presets(model)`` in place of ``presets(model, hardware)`` in either.  Oracle: the roofline applied
    to the named presets directly, and an A100 that is slower than an H100 on the same step (so the check can
    tell the two apart)."""
    seqs = [(0, 512, True), (300, 1, True)]
    shape = model_preset("llama-3-8b", 2)
    for hw in ("a100", "h200"):
        t = roofline_time(step_cost(shape, seqs, block_size=16), shape, hardware_preset(hw))
        assert at_scale.step_s(seqs, "llama-3-8b", hw) == t.total
        assert at_scale.device_s(seqs, "llama-3-8b", hw) == t.dense + t.attention
    assert at_scale.step_s(seqs, hardware="a100") > 2 * at_scale.step_s(seqs, hardware="h100")


def test_the_class_mix_serves_lab_6s_mix_at_the_scale_it_is_given(monkeypatch):
    """``class_mix(scale=...)`` multiplies lab 6's rates and backlog; the lab's own cells use 300, the tests a
    smaller one for speed.  Kills: the scale dropped (the mix always drawn at 300), which the existing sizes test
    cannot see.  Oracle: :func:`~minivllm.labs.check_lab06.mixed_classes` at that scale, the generator the
    docstring names, compared with the arrivals ``serve`` is handed (captured; nothing is served)."""
    from minivllm.labs import check_lab06

    handed = {}
    monkeypatch.setattr(check_lab06, "serve", lambda engine, arrivals, window: handed.update(a=list(arrivals)))
    at_scale.class_mix("fcfs", {}, scale=7.0, duration=3.0)
    assert handed["a"] == check_lab06.mixed_classes(3.0, scale=7.0)


def test_the_context_grid_rounds_each_geometric_point_to_the_nearest_block():
    """The grid lab 5's crossover is drawn on: ``per_octave`` points per doubling, each rounded to the nearest
    whole block.  Kills: points floored to a block (``int()``), which drops 112 from 16..128 and moves the
    crossover a learner reads.  Oracle: by hand, 16 * 2**(i/4) for i = 0..12 is 16, 19.0, 22.6, 26.9, 32, 38.1,
    45.3, 53.8, 64, 76.1, 90.5, 107.6, 128, whose nearest multiples of 16 are the eight below."""
    assert at_scale.context_grid(16, 128, 4) == [16, 32, 48, 64, 80, 96, 112, 128]


# -- live: the panels' series ----------------------------------------------------------------------------------


def test_the_live_panels_plot_each_scraped_series_under_its_own_label():
    """Lab 8's live picture: queue depth (waiting and running), KV usage and utilisation in percent, and the
    windowed TTFT p90, one point per scrape.  A learner reads "the queue exploded" off the waiting line, so each
    line must carry the series its legend names.  Kills: the "waiting" line drawn from the running counts.
    Oracle: three scrapes written by hand, every series different, read back from the lines by their labels."""
    from matplotlib.figure import Figure

    from minivllm.labs.live import Sample, SimArrival, SimRun, draw_live

    run = SimRun([SimArrival(0.0, "r0", "default", 8, 8)])
    run.samples = [Sample(time=t, running=r, waiting=w, kv_usage=k, utilisation=u, busy=1.0, ttft_p90=f,
                          itl_p99=0.05, tokens_per_s=10.0, arrived=1)
                   for t, r, w, k, u, f in ((1.0, 4, 0, 0.25, 0.5, 0.2), (2.0, 8, 3, 0.5, 0.75, 0.4),
                                            (3.0, 8, 9, 0.75, 1.0, 0.9))]
    fig = Figure()
    draw_live(run, fig)
    _, ax_t, ax_q, ax_k = fig.axes
    lines = {(ax, ln.get_label()): list(ln.get_ydata()) for ax in (ax_t, ax_q, ax_k) for ln in ax.get_lines()}
    assert lines[(ax_q, "waiting")] == [0, 3, 9]
    assert lines[(ax_q, "running")] == [4, 8, 8]
    assert lines[(ax_k, "KV usage")] == [25.0, 50.0, 75.0]
    assert lines[(ax_k, "utilisation")] == [50.0, 75.0, 100.0]
    assert lines[(ax_t, "p90 (window)")] == [0.2, 0.4, 0.9]


# -- grade: the per-cell timeout the instructor asked for ------------------------------------------------------------


def test_a_fractional_timeout_gives_each_cell_the_next_whole_second_never_less(monkeypatch):
    """nbclient counts its timeout in whole seconds, so ``--timeout 2.5`` must become 3 s: rounding down to 2 s
    would cut off a cell the instructor allowed 2.5 s and zero a learner's exercise.  Kills: ``int(timeout)`` for
    the ceiling (every test of the real kernel passes whole seconds).  Oracle: the ceiling by hand (2.5 -> 3,
    0.2 -> 1, at least one second) read from the client the grader builds, here a stand-in that records its
    arguments and refuses to start a kernel, so no kernel runs."""
    import nbclient

    from minivllm.labs import grade
    from minivllm.labs.registry import get_lab

    seen: list[dict] = []

    class RecordingClient:
        def __init__(self, nb, **options):
            seen.append(options)

        def setup_kernel(self):
            raise RuntimeError("no kernel in this test")

    monkeypatch.setattr(nbclient, "NotebookClient", RecordingClient)
    for asked, whole in ((2.5, 3), (0.2, 1), (4, 4)):
        results, errors, fatal = grade._run_in_kernel([], get_lab(1), 1, asked)
        assert (results, errors) == ({}, {}) and "no kernel in this test" in fatal
        assert seen[-1]["timeout"] == whole
        assert seen[-1]["error_on_timeout"]["evalue"] == f"cell ran over {whole} s"
