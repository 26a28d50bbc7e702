"""The labs' pictures draw the numbers they are given: refcounts, owners and free blocks; prefill and decode cells.

The text fallbacks were pinned, the pictures themselves were not: a cell labelled with the wrong refcount, a
timeline with its two colours swapped or its token counts written on the decodes, passed every test.  Oracles:
a pool and a step log built by hand, counted by hand.
"""

from __future__ import annotations

from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from minivllm.kv.block_pool import BlockPool
from minivllm.labs import widgets


def test_each_cell_shows_its_block_its_refcount_and_its_first_owners_colour():
    """8 blocks: ``a`` holds 3, ``b`` shares ``a``'s first two and holds 2 more, ``c`` shares ``a``'s second
    (refcounts 2 and 3): 3 blocks free; lab 2 and lab 3 teach sharing from the "x2" on a cell."""
    pool = BlockPool(8)
    a = pool.allocate_many(3)
    b = pool.allocate_many(2)
    pool.incref(a[0])
    pool.incref(a[1])
    pool.incref(a[1])
    tables = {"a": a, "b": [a[0], a[1]] + b, "c": [a[1]]}
    ax = Figure().subplots()
    widgets.draw_block_pool(pool, tables, cols=4, ax=ax)

    refs = {blk: sum(blk in t for t in tables.values()) for blk in range(8)}  # the hand count of references
    assert refs[a[0]] == 2 and refs[a[1]] == 3
    labels = [t.get_text() for t in ax.texts]
    assert labels == [f"{blk}\n×{refs[blk]}" if refs[blk] > 1 else str(blk) for blk in range(8)]
    assert ax.get_title() == "block pool: 3 of 8 free  (×k = refcount)"
    cells = ax.patches[:8]  # one cell per block, in block order
    first_owner = {blk: next(name for name, t in tables.items() if blk in t) for blk in range(8) if refs[blk]}
    for blk, cell in enumerate(cells):
        want = widgets.request_colour(first_owner[blk]) if blk in first_owner else "white"
        assert cell.get_facecolor() == to_rgba(want), blk


PREFILL, DECODE = to_rgba("#f28e2b"), to_rgba("#4e79a7")


def test_the_timeline_places_prefill_and_decode_cells_and_writes_each_chunks_tokens():
    """A log that starts at step 5 (a wrapped ring buffer): r0's 4-token prompt in one chunk, then its decodes;
    r1's 5-token prompt in two chunks (3, then 2) beside r0's decodes, then one decode; r0 decodes last.  Rows go
    in order of each request's first step."""
    log = [{"step": 5, "seqs": [("r0", 0, 4)]},
           {"step": 6, "seqs": [("r0", 4, 1), ("r1", 0, 3)]},
           {"step": 7, "seqs": [("r0", 5, 1), ("r1", 3, 2)]},
           {"step": 8, "seqs": [("r0", 6, 1), ("r1", 5, 1)]},
           {"step": 9, "seqs": [("r0", 7, 1)]}]
    ax = Figure().subplots()
    widgets.draw_timeline(log, {"r0": 4, "r1": 5}, ax=ax)
    want = {(5, 0): (PREFILL, "4"), (6, 0): (DECODE, None), (7, 0): (DECODE, None),  # (step, row): colour, label
            (8, 0): (DECODE, None), (9, 0): (DECODE, None),
            (6, 1): (PREFILL, "3"), (7, 1): (PREFILL, "2"), (8, 1): (DECODE, None)}
    cells = {(round(p.get_x()), round(-p.get_y() - 0.4)): p.get_facecolor() for p in ax.patches}
    assert cells == {k: colour for k, (colour, _) in want.items()}
    labels = {(round(t.get_position()[0] - 0.47), round(-t.get_position()[1])): t.get_text() for t in ax.texts}
    assert labels == {k: label for k, (_, label) in want.items() if label is not None}
    assert ax.get_xlim() == (5, 10)  # the steps the log holds, not from 0
    assert [t.get_text() for t in ax.get_yticklabels()] == ["r0", "r1"]


def test_the_two_tiers_colour_each_request_where_its_blocks_are_and_count_what_moved():
    """Lab 5's picture of a swap: at the steps of a run that swaps out and back in, each device cell in the
    colour of the running request holding it, each host cell in the colour of the swapped request parked there,
    the free counts of both pools, the legend marking exactly the swapped requests, and the title quoting the
    step's record.  Oracle: the requests' own block tables and statuses, the pools' own counts, the step log."""
    import random

    from minivllm import SamplingParams
    from minivllm.request import RequestStatus
    from tests.invariants import steps, tiny_engine

    eng = tiny_engine(preemption_mode="swap", num_cpu_blocks_override=64, num_blocks=40, max_len=128, budget=64)
    rng = random.Random(0)
    for i in range(10):
        eng.add_request({"prompt_token_ids": [rng.randrange(10, 900) for _ in range(rng.randrange(5, 30))]},
                        SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
    fig, seen_swapped = Figure(), 0
    for k, _ in enumerate(steps(eng)):
        last = eng.step_log[-1]
        if not (last["swapped_out"] or last["swapped_in"]) and k % 8:
            continue  # drawn at every step that moved blocks, and every 8th (a drawing costs ~0.1 s)
        widgets.draw_kv_tiers(eng, fig)
        ax_gpu, ax_cpu = fig.axes[:2]
        sched = eng.scheduler
        live = list(sched.running) + list(sched.waiting)
        swapped = {r.request_id for r in sched.waiting if r.status is RequestStatus.SWAPPED}
        seen_swapped += bool(swapped)
        for ax, pool, blocks_of in ((ax_gpu, eng.kv.pool, lambda r: r.block_ids),
                                    (ax_cpu, eng.kv.cpu_pool, lambda r: r.cpu_block_ids)):
            owner = {b: r.request_id for r in live for b in blocks_of(r)}
            cells = ax.patches[:pool.num_blocks]
            assert [c.get_facecolor() for c in cells] == [
                to_rgba(widgets.request_colour(owner[b]) if b in owner else "white") for b in range(pool.num_blocks)]
            assert ax.get_title().endswith(f": {pool.num_free}/{pool.num_blocks} free")
        legend = [t.get_text() for t in ax_cpu.get_legend().get_texts()]
        assert {t.removesuffix(" (swapped)") for t in legend if t.endswith(" (swapped)")} == swapped
        assert fig._suptitle.get_text().endswith(
            f"{last['swapped_out']} blocks out, {last['swapped_in']} blocks in")
    assert seen_swapped


def test_the_time_timeline_draws_each_prefill_over_its_step_and_each_decode_when_its_token_comes_out():
    """Lab 4's stall picture, by hand: steps ending at 0.1, 0.3 and 0.35 s, each starting where the one before
    ended.  A prefill bar spans 85% of its step from the step's start; a decode is a tick 0.5% of the run long
    ending at its step's end; rows in order of first appearance."""
    import pytest

    log = [{"step": 0, "time": 0.1, "seqs": [("a", 0, 4)]},
           {"step": 1, "time": 0.3, "seqs": [("a", 4, 1), ("b", 0, 6)]},
           {"step": 2, "time": 0.35, "seqs": [("a", 5, 1), ("b", 6, 1)]}]
    ax = Figure().subplots()
    widgets.draw_time_timeline(log, {"a": 4, "b": 6}, ax=ax)
    decode, prefill = ax.collections[:2]

    def bars(collection):
        out = []
        for path in collection.get_paths():
            (x0, y0), (x1, _) = path.vertices[0], path.vertices[1]
            out.append((round(-(y0 + 0.4)), x0, x1))
        return [v for bar in sorted(out) for v in bar]  # flat: (row, start, end) after one another

    tick = 0.005 * 0.35
    assert bars(prefill) == pytest.approx([0, 0.0, 0.085, 1, 0.1, 0.1 + 0.85 * 0.2])
    assert bars(decode) == pytest.approx([0, 0.3 - tick, 0.3, 0, 0.35 - tick, 0.35, 1, 0.35 - tick, 0.35])
    assert ax.get_xlim() == pytest.approx((0.0, 0.35))
    capped = Figure().subplots()
    widgets.draw_time_timeline(log, {"a": 4, "b": 6}, ax=capped, max_rows=2)
    assert [t.get_text() for t in capped.get_yticklabels()] == ["a", "b"]  # max_rows rows, not one fewer
