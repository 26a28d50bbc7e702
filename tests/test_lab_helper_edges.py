"""Edge values a lab invites, passed to the helpers the notebooks call (workloads, at_scale, live).

A learner who tries a window of 0 s, an empty tenant list, more documents per RAG prompt than there are
documents, a recompute chunk of 0 or a run where nothing finished must get a ValueError that names the
argument, at once.  Before these checks some of those calls never returned (a notebook cell spinning
forever), and the rest failed deep inside with ``ZeroDivisionError``/``IndexError``/"min() arg is an empty
sequence", or returned a number bigger than the device (a memory share above 1).  Each case runs with an
alarm so a hang fails the test instead of stalling the suite; no numbers are timed.
"""

from __future__ import annotations

import signal

import pytest

from minivllm.labs import at_scale, live, workloads


@pytest.fixture(autouse=True)
def _no_hang():
    """A call that loops forever is the bug: turn it into a failure after a generous 20 s."""
    def _hung(*_):
        raise TimeoutError("the helper did not return: an edge value sent it into an endless loop")

    old = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_a_zero_or_negative_scrape_window_is_refused_not_looped_on_forever():
    """Kills: no check on ``every_s`` (``next_scrape += 0`` never passes the next arrival)."""
    arrivals = live.ramp_arrivals([5], 1.0, seed=0)
    for every_s in (0, -1.0):
        with pytest.raises(ValueError, match="every_s"):
            live.run_sim_load(workloads.sim_engine(), arrivals, every_s=every_s)


def test_an_empty_tenant_list_is_refused_by_name():
    """Kills: ``tenants[i % len(tenants)]`` reached with no tenants (ZeroDivisionError)."""
    with pytest.raises(ValueError, match="tenant"):
        live.ramp_arrivals([5], 1.0, tenants=())


def test_a_reversed_length_range_is_refused_by_name():
    """Kills: ``rng.randint(512, 64)`` failing with "empty range for randrange()"."""
    with pytest.raises(ValueError, match="prompt"):
        live.ramp_arrivals([5], 1.0, prompt=(512, 64))
    with pytest.raises(ValueError, match="output"):
        live.ramp_arrivals([5], 1.0, output=(0, 8))


def test_more_documents_per_rag_prompt_than_documents_is_refused_not_drawn_forever():
    """Kills: the distinct-document draw looping forever when ``docs_per_request > num_docs``."""
    with pytest.raises(ValueError, match="docs_per_request"):
        workloads.rag_workload(2, num_docs=2, docs_per_request=3)
    prompts = workloads.rag_workload(3, num_docs=3, docs_per_request=3, instr_len=4, doc_len=5)
    assert all(len(p) >= 4 + 3 * 5 + 8 for p in prompts)  # every document once, plus the question


def test_a_zero_recompute_chunk_is_refused_not_looped_on_forever():
    """Kills: ``recompute_s`` advancing its start by ``min(0, ...)`` = 0 tokens per chunk, forever."""
    with pytest.raises(ValueError, match="chunk"):
        at_scale.recompute_s(1024, chunk=0)
    with pytest.raises(ValueError, match="chunk"):
        at_scale.crossover_tokens(lengths=[16, 4096], chunk=0)


def test_an_empty_or_inverted_context_grid_is_refused_by_name():
    """Kills: ``swap_wins[-1]`` on an empty grid (IndexError), ``log2(hi / 0)`` (ZeroDivisionError), and
    ``context_grid(hi < lo)`` silently returning ``[]``."""
    with pytest.raises(ValueError, match="lengths"):
        at_scale.crossover_tokens(lengths=[])
    with pytest.raises(ValueError, match="lo"):
        at_scale.context_grid(0, 1024)
    with pytest.raises(ValueError, match="hi"):
        at_scale.context_grid(1024, 16)


@pytest.mark.parametrize("lo, hi, per_octave", [(20, 100, 4), (16, 120, 4), (100, 1000, 2), (100, 900, 2),
                                                 (20, 40, 4), (16, 16, 4)])
def test_context_grid_stays_within_its_range_in_whole_blocks(lo, hi, per_octave):
    """Kills: each point rounded to the nearest block with no regard for the ends, so ``context_grid(20, 100)``
    began at 16 and ``context_grid(16, 120)`` ended at 128; and a range holding exactly one whole block (20..40
    holds 32 alone) refused as if it held none (``first >= last``).  Oracle: brute force over the multiples of the
    block size -- the grid's first point is the smallest one >= lo, its last the largest one <= hi."""
    grid = at_scale.context_grid(lo, hi, per_octave)
    blocks = [n for n in range(at_scale.BLOCK_SIZE, 2 * hi, at_scale.BLOCK_SIZE) if lo <= n <= hi]
    assert grid[0] == blocks[0] and grid[-1] == blocks[-1]
    assert set(grid) <= set(blocks) and grid == sorted(set(grid))
    with pytest.raises(ValueError, match="no whole block"):
        at_scale.context_grid(1, at_scale.BLOCK_SIZE - 1)


def test_context_grid_of_float_ends_is_still_whole_blocks_as_ints():
    """Kills: the ends computed from ``lo`` / ``hi`` as given, so ``context_grid(16, 100.0)`` ended at ``96.0`` and
    ``context_grid(16.5, 100)`` began at ``32.0`` -- floats among the ints, where the grid is lengths in whole
    blocks (the points in between were ints all along).  Oracle: each point's type, and the same range given as
    ints where the ends are whole numbers."""
    for lo, hi in [(16, 100.0), (16.5, 100), (20.0, 1000.0)]:
        grid = at_scale.context_grid(lo, hi, 2)
        assert all(type(n) is int for n in grid), grid
        if lo == int(lo):
            assert grid == at_scale.context_grid(int(lo), int(hi), 2)


def test_a_memory_share_above_one_is_refused_not_sized_bigger_than_the_device():
    """Kills: no upper bound on ``memory_share`` (2.0 gave more KV blocks than the whole device holds)."""
    with pytest.raises(ValueError, match="memory_share"):
        at_scale.pool_blocks(memory_share=2.0)
    assert at_scale.pool_blocks(memory_share=1.0) > at_scale.pool_blocks(memory_share=0.5) > 0


def test_throughput_of_a_run_where_nothing_finished_says_so():
    """Kills: ``min()`` of no arrival times ("min() arg is an empty sequence") when a lab-1 policy never admits."""
    with pytest.raises(ValueError, match="finals"):
        workloads.throughput({}, None)


def test_ratios_over_nothing_are_refused_by_name():
    """Kills: ZeroDivisionError from ``hit_rate([])`` and ``utilization([], 0)``."""
    with pytest.raises(ValueError, match="hit_rate"):
        workloads.hit_rate([])
    with pytest.raises(ValueError, match="reserved"):
        workloads.utilization([], 0)


def test_the_crossover_of_lengths_given_out_of_order_is_that_of_the_same_lengths_sorted():
    """"From which swapping is cheaper at every longer length" orders the lengths by size, whatever order a
    learner lists them in.  Oracle: the definition scanned by brute force over the sorted lengths and the
    helper's own two cost curves (Qwen3-0.6B with no decoders, where swap wins short, loses mid, wins long)."""
    opts = dict(decodes=0)
    for lengths in ([4096, 16], [16384, 1024, 4096], [4096, 1024, 16384]):
        grid = sorted(lengths)
        wins = [at_scale.swap_s(n, "qwen3-0.6b") < at_scale.recompute_s(n, "qwen3-0.6b", **opts) for n in grid]
        want = next((n for k, n in enumerate(grid) if all(wins[k:])), None)
        assert at_scale.crossover_tokens("qwen3-0.6b", lengths=lengths, **opts) == want, (lengths, grid, wins)
