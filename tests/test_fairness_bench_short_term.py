"""The fairness benchmark's short-term reading (section 4, shared prefix): per-second Jain and the widest lead.

Oracles: a hand-computed service series for :func:`slice_fairness`; for the series :func:`run` records, the
window counters the benchmark already reports (the series' last value inside the window must be them).
"""

from __future__ import annotations

import pytest

from minivllm.bench.fairness import FAIR_STEP, run, shared_prefix_workload, slice_fairness
from minivllm.config import TenantConfig


def test_slice_fairness_by_hand():
    # cumulative service per step end; slices [0,1), [1,2), [2,3)
    series = [(0.5, {"A": 10, "B": 0}), (1.0, {"A": 10, "B": 10}), (1.5, {"A": 20, "B": 10}),
              (2.0, {"A": 30, "B": 10}), (3.0, {"A": 30, "B": 30}), (9.0, {"A": 1000, "B": 0})]
    got = slice_fairness(series, {"A": 1, "B": 1}, window=3.0)
    # slice 1 closes at t=1.0: A 10, B 10 -> 1.0; slice 2 at t=2.0: A 20, B 0 -> 0.5; slice 3 at 3.0: A 0, B 20 -> 0.5
    assert got["slices"] == 3
    assert got["slice_jain_mean"] == pytest.approx(2 / 3)
    assert got["slice_jain_min"] == pytest.approx(0.5)
    assert got["max_gap_tokens"] == 20  # at t=2.0: A 30 vs B 10; the step past the window is not read


def test_slice_fairness_weights_divide_service_and_idle_slices_are_skipped():
    series = [(1.0, {"A": 20, "B": 10}), (3.0, {"A": 20, "B": 10}), (4.0, {"A": 40, "B": 20})]
    got = slice_fairness(series, {"A": 2, "B": 1}, window=4.0)
    assert got["slices"] == 2  # [1,2) and [2,3) closed at t=3.0 with nothing served: the first skipped only once
    assert got["slice_jain_mean"] == pytest.approx(1.0) and got["max_gap_tokens"] == 0


def test_shared_prefix_workload_shares_only_a_system_prompt():
    arrivals = shared_prefix_workload(0, {"A": 3, "B": 2, "C": 2})
    a = [x.prompt for x in arrivals if x.tenant == "A"]
    b = [x.prompt for x in arrivals if x.tenant == "B"]
    assert all(p[:1024] == a[0][:1024] and len(p) == 1100 for p in a)
    assert len({tuple(p[1024:]) for p in a}) == 3
    assert all(len(p) == 1100 and p[:16] != a[0][:16] for p in b)
    assert [len(x.prompt) for x in arrivals if x.tenant == "C"] == [100, 100]


def test_the_recorded_series_ends_at_the_windows_counters():
    arrivals = shared_prefix_workload(1, {"A": 40, "B": 15})
    series: list = []
    window = 2.0
    res = run("wfq", arrivals, step=FAIR_STEP, window=window, blocks=1024, budget=2048,
              tenants={"A": TenantConfig(weight=1), "B": TenantConfig(weight=1)}, enable_prefix_caching=True,
              service_series=series)
    inside = [s for at, s in series if at <= window]
    last = inside[-1]
    for tenant in ("A", "B"):
        w = res.window_stats[tenant]
        assert last[tenant] == w["prompt_tokens"] + 2 * w["output_tokens"]
        values = [s.get(tenant, 0) for _, s in series]
        assert values == sorted(values)  # cumulative
    # A's cached system prompt is not service: A's prompt service (all requests done, outputs exactly max_tokens
    # under ignore_eos) is its tails plus the system prompt computed a few times (by the requests admitted
    # before the first one cached it), far below 40 whole prompts
    n_a = sum(1 for a in arrivals if a.tenant == "A")
    prompt_a = series[-1][1]["A"] - 2 * sum(a.max_tokens for a in arrivals if a.tenant == "A")
    assert 1024 + 76 * n_a <= prompt_a <= 4 * 1024 + 76 * n_a < 1100 * n_a


def test_the_windows_last_slice_is_read_when_no_step_ends_exactly_on_it():
    """A simulated clock almost never ends a step exactly on the window's end; the last slice then closes at the
    first step past it, as every other slice closes at the first step at or after its end.  By hand, steps every
    0.3 s, window 2 s: slice 1 closes at t=1.2 (A 4, B 4 -> Jain 1.0), slice 2 at t=2.1 (A 3, B 0 -> Jain 0.5).
    The lead is read inside the window only: 2 at t=1.8 (A 6, B 4), not 3 at t=2.1."""
    series = [(0.3 * i, {"A": i, "B": min(i, 4)}) for i in range(1, 9)]  # t = 0.3 .. 2.4
    got = slice_fairness(series, {"A": 1, "B": 1}, window=2.0)
    assert got["slices"] == 2
    assert got["slice_jain_mean"] == pytest.approx(0.75) and got["slice_jain_min"] == pytest.approx(0.5)
    assert got["max_gap_tokens"] == 2


def test_module_docstring_counts_and_names_every_section():
    """``python -m minivllm.bench fairness --help`` opens with this module's docstring: a section it runs but the
    docstring leaves out (shared_prefix, section 4, once was) is a part of the result a reader is not told about."""
    import re

    from minivllm.bench import fairness

    doc = fairness.__doc__
    numbered = re.findall(r"^(\d)\. \*\*([^*]+)\*\*", doc, flags=re.M)
    assert [int(n) for n, _ in numbered] == list(range(1, len(fairness.SECTIONS) + 1)), numbered
    words = {2: "Two", 3: "Three", 4: "Four", 5: "Five"}
    assert doc.split("\n\n")[1].startswith(words[len(fairness.SECTIONS)] + " workloads"), doc
