"""Tests written in a mutation pass over ``minivllm/sim`` and the load generator's report helpers.

Each test pins one behaviour that a small, realistic bug (a planted "mutant") changed without any other
test noticing.  Every expectation is computed independently of the code under test: by hand from the
roofline formula and the model shape, or by brute force.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minivllm.kv.kv_cache_manager import BlockMoves
from minivllm.sim.roofline import HardwareSpec, ModelShape, RooflineExecutor, roofline_time, step_cost

# 2 layers, hidden 8, MLP 16, 2 query heads sharing 1 KV head of 4, vocab 32, bf16.
TINY = ModelShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                  head_dim=4, vocab_size=32, dtype_bytes=2)
KV_PER_TOKEN = 2 * 2 * 1 * 4 * 2  # K and V x 2 layers x 1 KV head x head_dim 4 x 2 bytes = 32


def _batch(seqs, swap_in=0, swap_out=0):
    """A scheduled batch as the executor reads it: ``seqs`` are (start, num_tokens, request length)."""
    items = [SimpleNamespace(start=s, num_tokens=n, samples=s + n == total, request=SimpleNamespace(request_id=f"q{i}", num_tokens=total))
             for i, (s, n, total) in enumerate(seqs)]
    moves = BlockMoves(swap_in=[(i, i) for i in range(swap_in)], swap_out=[(i, i) for i in range(swap_out)])
    return SimpleNamespace(seqs=items, moves=moves, num_tokens=sum(n for _, n, _ in seqs))


# -- roofline.py -----------------------------------------------------------------------------------


def test_a_step_that_only_swaps_costs_the_step_overhead_plus_the_transfer():
    """A step with no sequences but block moves (swap-out of a preempted victim) still runs the host loop once
    and moves the blocks over PCIe; a step with neither costs nothing.  Catches dropping the step overhead
    of a swap-only step (the virtual clock would then run fast exactly when the server thrashes)."""
    hw = HardwareSpec("toy", peak_flops=1000, mem_bandwidth=100, step_overhead_s=0.5, layer_overhead_s=0.25,
                      seq_overhead_s=0.125, swap_bandwidth=64)
    t = roofline_time(step_cost(TINY, [], swap_blocks=3, block_size=4), TINY, hw)
    assert t.overhead == 0.5  # no layers run, no sequences
    assert t.swap == pytest.approx(3 * 4 * KV_PER_TOKEN / 64)
    assert t.total == pytest.approx(0.5 + 3 * 4 * 32 / 64)
    assert roofline_time(step_cost(TINY, []), TINY, hw).total == 0.0


def test_attention_roofs_use_their_own_utilisation():
    """``attn_bandwidth`` is a *bandwidth* roof, so it scales with ``bw_util``, and ``attn_flops`` with
    ``flops_util``; with no separate attention roofs both fall back to the GEMM peaks.  Catches mixing the two
    utilisations up, which the datasheet presets (0.7 vs 0.85) would turn into 18% slower long-context decode."""
    hw = HardwareSpec("toy", peak_flops=1000.0, mem_bandwidth=400.0, flops_util=0.5, bw_util=0.25,
                      attention_flops=3000.0, attention_bandwidth=800.0)
    assert hw.attn_flops == 1500.0 and hw.attn_bandwidth == 200.0
    assert hw.flops == 500.0 and hw.bandwidth == 100.0
    plain = HardwareSpec("toy", peak_flops=1000.0, mem_bandwidth=400.0, flops_util=0.5, bw_util=0.25)
    assert plain.attn_flops == 500.0 and plain.attn_bandwidth == 100.0
    # by hand: a decode at position 99 reads 100 tokens of K/V, writes 1, plus Q in and O out (2 x 2 layers x
    # 8 x 2 bytes): attention is memory bound at bandwidth 800 x 0.25
    c = step_cost(TINY, [(99, 1, True)])
    attn_bytes = KV_PER_TOKEN * (100 + 1) + 2 * 2 * 8 * 2 * 1
    assert c.attn_bytes == attn_bytes
    t = roofline_time(c, TINY, hw)
    assert t.attention_bound == "memory" and t.attention == pytest.approx(attn_bytes / 200.0)


def test_slowed_device_takes_exactly_factor_longer_for_every_term():
    """``HardwareSpec.slowed(f)`` models a shared machine: every phase of every step, the per-layer launches and
    the host-link swaps included, takes ``f`` times longer.  Catches a term ``slowed`` forgets to scale."""
    hw = HardwareSpec("toy", peak_flops=1000, mem_bandwidth=100, step_overhead_s=1, layer_overhead_s=0.25,
                      seq_overhead_s=0.5, eager_step_overhead_s=0.75, swap_bandwidth=64, attention_flops=500,
                      attention_bandwidth=50)
    slow = hw.slowed(2.5)
    for seqs, swaps in (([(0, 3, True), (5, 1, True)], 2), ([(7, 1, True)], 0), ([], 3)):
        c = step_cost(TINY, seqs, swap_blocks=swaps, block_size=4)
        a, b = roofline_time(c, TINY, hw), roofline_time(c, TINY, slow)
        for phase in ("overhead", "dense", "attention", "swap"):
            assert getattr(b, phase) == pytest.approx(2.5 * getattr(a, phase)), (seqs, phase)
    # one layer's launches alone: a 1-layer model with only a layer overhead
    one = HardwareSpec("launch", peak_flops=1e30, mem_bandwidth=1e30, layer_overhead_s=0.25)
    c = step_cost(TINY, [(4, 1, True)])
    assert roofline_time(c, TINY, one.slowed(3)).overhead == pytest.approx(3 * 2 * 0.25)


def test_roofline_executor_charges_swap_in_and_swap_out_and_counts_busy_time():
    """The executor's clock advances by the full roofline time of each step -- both swap directions count --
    and ``busy_s`` is the sum of those times (idle jumps excluded).  Catches ignoring swap-outs (preemption by
    swapping would look free) and accumulating only one phase into ``busy_s`` (the busy fraction in the
    ``sim run`` report would be wrong)."""
    hw = HardwareSpec("toy", peak_flops=1000, mem_bandwidth=100, step_overhead_s=1, layer_overhead_s=0.25,
                      seq_overhead_s=0.5, swap_bandwidth=64)
    ex = RooflineExecutor(TINY, hw, block_size=4)
    # a 3-token prefill of a 3-token prompt (sampled) and a decode at position 5 of a 6-token request
    batch = _batch([(0, 3, 3), (5, 1, 6)], swap_in=1, swap_out=2)
    expected = roofline_time(step_cost(TINY, [(0, 3, True), (5, 1, True)], swap_blocks=3, block_size=4), TINY, hw)
    # by hand (see test_sim_roofline.test_roofline_time_by_hand): 2.5 s overhead, 47.36 s dense, 6.72 s
    # attention, 3 blocks x 4 tokens x 32 bytes / 64 B/s = 6 s of swapping
    assert expected.total == pytest.approx(2.5 + 47.36 + 6.72 + 6.0)
    out = ex.execute(batch)
    assert set(out) == {"q0", "q1"}
    assert ex.clock == pytest.approx(expected.total) and ex.busy_s == pytest.approx(expected.total)
    ex.advance_to(100.0)  # idle: the clock moves, busy time does not
    assert ex.clock == 100.0 and ex.busy_s == pytest.approx(expected.total)
    ex.execute(_batch([], swap_out=1))
    assert ex.clock == pytest.approx(100.0 + 1 + 4 * 32 / 64)
    assert ex.num_steps == 2


def test_linear_executor_step_time_by_hand():
    """The linear cost model's step: fixed + per token + per context token (the whole context after the step,
    new tokens included, as attention reads it) + swapped blocks over the link.  Catches counting only the
    context *before* the step and dropping the swap term; a step that only swaps (a victim's blocks leave, no row
    runs) charged nothing, as if the link were free exactly when the server thrashes; and ``advance_to`` with a
    time already passed moving the clock back (every later timestamp would then precede the step before it)."""
    from minivllm.sim.executor import SimulatedExecutor

    ex = SimulatedExecutor(fixed_overhead_s=0.5, per_token_s=0.25, per_context_token_s=0.125, vocab_size=50,
                           kv_bytes_per_block=64, swap_bytes_per_s=32.0)
    batch = _batch([(0, 3, 3), (5, 1, 9)], swap_in=1, swap_out=2)
    # 4 tokens; contexts 3 and 6; 3 blocks x 64 B / 32 B/s
    assert ex.step_time(batch) == pytest.approx(0.5 + 0.25 * 4 + 0.125 * 9 + 3 * 64 / 32)
    ex.execute(batch)
    assert ex.now() == pytest.approx(0.5 + 1.0 + 1.125 + 6.0)
    ex.advance_to(20.0)
    assert ex.now() == 20.0
    ex.advance_to(7.5)  # an arrival the clock has already passed: idling until then takes no time
    assert ex.now() == 20.0
    ex.execute(_batch([], swap_out=1))  # no row runs; one block goes over the link: overhead + 64 B / 32 B/s
    assert ex.now() == pytest.approx(20.0 + 0.5 + 64 / 32)
    ex.execute(_batch([]))  # nothing to run, nothing to move: no step, no time
    assert ex.now() == pytest.approx(22.5)


def test_head_dim_defaults_to_hidden_over_query_heads():
    """A ``config.json`` without ``head_dim`` (Llama-3, Mistral) has ``head_dim = hidden_size /
    num_attention_heads`` -- the *query* heads, also under grouped-query attention.  Catches dividing by the KV
    heads, which would make Llama-3-8B's KV 4x too big."""
    cfg = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256}
    shape = ModelShape.from_hf_config(cfg, name="llama")
    assert shape.head_dim == 128 and shape.num_kv_heads == 8
    assert shape.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    mha = ModelShape.from_hf_config({**cfg, "num_key_value_heads": None}, name="mha")
    assert mha.num_kv_heads == 32 and mha.head_dim == 128


def test_fake_tokens_stay_clear_of_the_special_ids():
    """Fake "sampled" tokens must lie in ``[10, vocab)``: ids 0-9 are where tokenizers keep EOS/BOS/pad, and a
    simulated engine that configures an EOS id would otherwise stop requests early at random.  Brute force
    over many requests and positions; catches dropping the offset of 10."""
    from minivllm.sim.roofline import fake_token

    for vocab in (11, 12, 50, 49152):
        toks = [fake_token(f"req{i}", pos, vocab) for i in range(200) for pos in range(20)]
        assert min(toks) >= 10 and max(toks) < vocab, vocab
    toks = [fake_token(f"r{i}", p, 20) for i in range(100) for p in range(10)]
    assert set(toks) == set(range(10, 20))  # and every legal id is reachable


# -- bench/loadgen.py: the SLO report --------------------------------------------------------------


def _ok(index, ttft, itl, tenant="a", arrival=0.0, start=None):
    from minivllm.bench.loadgen import RequestResult

    r = RequestResult(index, tenant, arrival, 10, 8, outcome="ok", start=arrival if start is None else start,
                      ttft=ttft, itl=list(itl), e2e=ttft + sum(itl), chunks=len(itl) + 1,
                      output_tokens=len(itl) + 1)
    return r


def test_a_request_exactly_at_the_slo_is_good():
    """An SLO is "TTFT <= x", "ITL <= y": a request exactly at the limit meets it.  Values are powers of two so
    the comparison is exact.  Catches a strict ``>=`` in the goodput check (goodput would drop at the SLO)."""
    from minivllm.bench.loadgen import is_good, summarize_group

    at = _ok(0, 0.5, [0.25, 0.25])
    over = _ok(1, 0.5000001, [0.25])
    gap_over = _ok(2, 0.125, [0.25, 0.2500001])
    assert is_good(at, 0.5, 0.25, "max") and is_good(at, 0.5, 0.25, "p99")
    assert not is_good(over, 0.5, 0.25) and not is_good(gap_over, 0.5, 0.25, "max")
    s = summarize_group([at, over, gap_over], 2.0, 0.5, 0.25, "max")
    assert (s["good"], s["goodput_fraction"], s["goodput_rps"]) == (1, pytest.approx(1 / 3), 0.5)


def test_means_are_reported_in_the_same_units_as_the_percentiles():
    """``ttft_ms``/``itl_ms`` hold milliseconds, the mean included; ``e2e_s`` seconds.  Catches a mean left in
    seconds beside percentiles in ms (a 1000x error in the report's JSON)."""
    from minivllm.bench.loadgen import summarize_group

    rs = [_ok(0, 0.25, [0.125, 0.375]), _ok(1, 0.75, [0.25])]
    s = summarize_group(rs, 1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(500.0) and s["ttft_ms"]["n"] == 2
    assert s["itl_ms"]["mean"] == pytest.approx(250.0) and s["itl_ms"]["n"] == 3
    assert s["e2e_s"]["mean"] == pytest.approx((0.75 + 1.0) / 2)
    assert s["ttft_ms"]["p50"] == pytest.approx(500.0)  # midway between 250 and 750 ms


def test_client_wait_is_measured_from_the_scheduled_arrival():
    """``client_wait_ms_p99`` is how late requests were *sent* against their schedule (start - arrival), every
    sent request counted whatever its outcome: a check on the load generator itself.  Catches reporting the
    send time since the run's start instead, and counting only the requests that were served."""
    from minivllm.bench.loadgen import RequestResult, summarize_group

    rs = [_ok(i, 0.1, [], arrival=10.0 + i, start=10.0 + i + 0.002 * i) for i in range(5)]
    s = summarize_group(rs, 20.0)
    # waits 0, 2, 4, 6, 8 ms; p99 by linear interpolation: 6 + 0.96 * 2 = 7.92 ms
    assert s["client_wait_ms_p99"] == pytest.approx(7.92)
    rs.append(RequestResult(5, "a", 1.0, 10, 8, outcome="rejected", start=1.1))  # sent 100 ms late, then a 429
    rs.append(RequestResult(6, "a", 2.0, 10, 8, outcome="unsent"))  # never sent: no wait to count
    # waits 0, 2, 4, 6, 8, 100 ms: p99 at rank 4.95 = 8 + 0.95 * 92
    assert summarize_group(rs, 20.0)["client_wait_ms_p99"] == pytest.approx(95.4)


def test_table_counts_timeouts_in_the_error_column():
    """The table's ``err`` column is errors plus timeouts (both are failures the client saw; the footer breaks
    them out).  Catches dropping timeouts from the column, which would hide a server that hangs."""
    from minivllm.bench.loadgen import RequestResult, RunResult, format_table, summarize

    rs = [_ok(0, 0.1, [0.1])]
    for i, outcome in enumerate(("timeout", "timeout", "error", "rejected"), start=1):
        rs.append(RequestResult(i, "a", 0.0, 10, 8, outcome=outcome, start=0.0))
    table = format_table(summarize(RunResult(1.0, 2.0, rs)))
    row = next(line for line in table.splitlines() if line.startswith("a "))
    name, sent, ok, rejected, err = row.split("|")[0].split()
    assert (sent, ok, rejected, err) == ("5", "1", "1", "3")
    assert "timeouts 2" in table and "errors 1" in table


def test_sweep_criterion_passes_at_the_slo_and_clamps_the_crossing():
    """A rate whose p99 ITL equals the SLO meets it; and the interpolated crossing stays between the last
    passing and the first failing rate even when the failing rate failed on TTFT with its ITL still under the
    SLO (ITL's straight line would cross far beyond it; TTFT's crosses at 1.5).  Catches a strict ``<`` and a
    crossing read off the ITL line alone."""
    from minivllm.bench.loadgen import sweep_verdict

    def row(rate, itl, ttft=100.0):
        return {"rate": rate, "overall": {"ok": 10, "itl_ms": {"p99": itl}, "ttft_ms": {"p99": ttft},
                                          "goodput_fraction": 1.0}}

    v = sweep_verdict([row(1, 300.0), row(2, 500.0), row(4, 700.0)], "itl", None, 0.5, 0.9)
    assert v["max_rate_meeting_slo"] == 2 and v["first_failing_rate"] == 4
    assert v["crossing_rate"] == pytest.approx(2.0)  # 500 is the target itself
    v = sweep_verdict([row(1, 100.0), row(2, 200.0, ttft=900.0)], "itl", 0.5, 0.5, 0.9)
    assert v["max_rate_meeting_slo"] == 1 and v["first_failing_rate"] == 2
    # on ITL alone: 1 + (500 - 100) / (200 - 100) = 5, past the failing rate; TTFT: 1 + (500 - 100) / 800 = 1.5
    assert v["crossing_rate"] == pytest.approx(1.5)


# -- router.py ----------------------------------------------------------------------------------------


def test_prefix_affinity_counts_its_spills_and_spills_to_the_lowest_index_on_ties():
    """Each request that leaves its overloaded ring owner increments ``num_spilled`` (the fleet reports it),
    and goes to the least-loaded replica, the lowest index among equals -- brute force over random loads with
    many ties.  Catches an uncounted spill and a tie-break that prefers the highest index."""
    import random

    from minivllm.sim.router import PrefixAffinityRouter

    rng = random.Random(7)
    router = PrefixAffinityRouter(4, block_size=4, key_blocks=1, spill_factor=1.0, min_spill_tokens=0)
    spills = 0
    for _ in range(400):
        prompt = [rng.randrange(10, 900) for _ in range(6)]
        owner = router.owner(prompt)
        loads = [rng.choice([0, 100, 200]) for _ in range(4)]
        bound = max(0, 1.0 * sum(loads) / 4)
        if loads[owner] <= bound:
            expected = owner
        else:
            spills += 1
            expected = loads.index(min(loads))  # first index holding the minimum
        assert router.route(prompt, loads) == expected
    assert spills > 50 and router.num_spilled == spills


# -- calibrate.py --------------------------------------------------------------------------------------


def _fitted_prediction(costs, times, groups=None):
    from minivllm.sim.calibrate import fit, spec_from_theta

    theta, _ = fit(costs, times, groups=groups)
    spec = spec_from_theta(theta, "fit")
    return [roofline_time(c, TINY, spec).total for c in costs]


def test_fit_minimises_relative_error_with_equal_weight_per_group():
    """Eight measurements of the *same* batch shape, with different times: every parameter set predicts one
    value ``c`` for all of them, so the fit's objective alone decides ``c``.  Relative least squares,
    ``sum(((c - t_i) / t_i)**2)``, gives ``c = sum(1/t) / sum(1/t**2)`` (not the mean); with ``groups`` each
    group's squared weights sum to the same total (``w_i = 1 / (t_i * sqrt(n_g))``).  Catches fitting
    absolute error (the 2 s prefills would decide the roofs and 30 ms decodes be off by 50%) and a group
    weight of ``1/n`` instead of ``1/sqrt(n)`` on the residual."""
    import numpy as np

    costs = [step_cost(TINY, [(40, 1, True)] * 4)] * 8
    t = np.array([0.010, 0.011, 0.012, 0.015, 0.020, 0.030, 0.050, 0.080])
    c = sum(1 / t) / sum(1 / t**2)
    pred = _fitted_prediction(costs, list(t))
    assert pred == pytest.approx([c] * 8, rel=1e-6)
    assert abs(c - t.mean()) / c > 0.3  # the absolute-error answer is far away
    groups = [0] * 6 + [1] * 2
    w2 = 1 / (t**2 * np.array([6] * 6 + [2] * 2))
    cg = float(np.sum(w2 * t) / np.sum(w2))
    assert _fitted_prediction(costs, list(t), groups) == pytest.approx([cg] * 8, rel=1e-6)
    w2_wrong = 1 / (t**2 * np.array([36] * 6 + [4] * 2))
    assert abs(float(np.sum(w2_wrong * t) / np.sum(w2_wrong)) - cg) / cg > 0.05


# -- fleet.py --------------------------------------------------------------------------------------------

_SMALL = dict(num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, model_max_len=4096)


class _Scripted:
    """A router that returns the given replicas in turn and records the loads it was shown."""

    def __init__(self, picks):
        self.picks, self.seen = list(picks), []

    def route(self, prompt, loads):
        self.seen.append(list(loads))
        return self.picks.pop(0)


def _one_second_steps():
    from minivllm.sim.executor import SimulatedExecutor

    return SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)


def test_fleet_timeline_loads_busy_time_and_duration_by_hand():
    """Every step takes exactly 1 s, so the whole run can be worked out by hand.

    A (20-token prompt, 10 tokens) and A2 (40, 5) arrive at t=2 on idle replicas 0 and 1, whose clocks jump
    to 2; each step emits one token.  B arrives at 6.0, exactly when both replicas finish their fourth step,
    and is dispatched then (before either steps again): the router sees A's 10 - 4 = 6 and A2's 5 - 4 = 1
    outstanding tokens (the prompt left the count with the first token).  B rides with A2's last step
    (6 -> 7: its first token) and finishes at 9.  Replica 0 is busy 10 steps, replica 1 seven; the run
    lasts from the first arrival (2) to the last finish (12).  Catches: idle replicas not jumping to the
    arrival, an arrival at a step boundary dispatched one step late, prompt tokens never leaving the
    router's count, ``busy_s`` overwritten instead of accumulated, the busy fraction not divided by the
    duration, the duration measured from t=0."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import Fleet, sim_replica

    arrivals = [Arrival(2.0, "A", "default", tuple(range(10, 30)), 10),
                Arrival(2.0, "A2", "default", tuple(range(10, 50)), 5),
                Arrival(6.0, "B", "default", tuple(range(100, 112)), 3)]
    router = _Scripted([0, 1, 1])
    fleet = Fleet(2, router, executor_factory=_one_second_steps, engine_factory=lambda ex: sim_replica(ex, **_SMALL))
    res = fleet.run(arrivals)
    assert router.seen == [[0, 0], [20 + 10, 0], [6, 1]]
    assert fleet.loads == [0, 0]
    assert [(r.ttft, r.e2e) for r in res.results] == [(1.0, 10.0), (1.0, 5.0), (1.0, 3.0)]
    assert [(s.steps, s.busy_s) for s in res.replicas] == [(10, 10.0), (7, 7.0)]
    assert res.duration == 10.0
    s = res.summary()
    assert s["replica_busy_fraction"] == [1.0, 0.7] and s["replica_requests"] == [1, 2]
    assert s["request_throughput"] == pytest.approx(3 / 10.0)


def test_peak_outstanding_is_the_highest_load_not_the_last():
    """``ReplicaStats.peak_outstanding`` is the most tokens a replica ever had outstanding.  The timeline of the
    test above, worked by hand: replica 1 takes A2 at t=2 (40 prompt + 5 output = 45 outstanding), and at t=6,
    when A2 has streamed its prompt and 4 tokens, B (12 + 3) joins a load of 1: 16.  Its peak is 45, not 16;
    replica 0 held only A (20 + 10 = 30).  Catches the peak overwritten by each new arrival's load."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import Fleet, sim_replica

    arrivals = [Arrival(2.0, "A", "default", tuple(range(10, 30)), 10),
                Arrival(2.0, "A2", "default", tuple(range(10, 50)), 5),
                Arrival(6.0, "B", "default", tuple(range(100, 112)), 3)]
    fleet = Fleet(2, _Scripted([0, 1, 1]), executor_factory=_one_second_steps,
                  engine_factory=lambda ex: sim_replica(ex, **_SMALL))
    res = fleet.run(arrivals)
    assert [s.peak_outstanding for s in res.replicas] == [20 + 10, 40 + 5]


def test_no_follow_up_turn_after_a_refused_request():
    """A chat's next turn is sent only after an answer; a request the engine rejected (reject preemption mode
    under KV pressure) ends its conversation.  Catches asking ``follow_up`` for failed requests too (a
    closed-loop client would then build the next turn on an empty answer)."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import Fleet, sim_replica
    from minivllm.sim.router import RoundRobinRouter

    arrivals = [Arrival(0.0, f"r{i}", "default", tuple(range(10 + i, 50 + i)), 40) for i in range(6)]
    asked = []

    def follow_up(arrival, output_token_ids, finished_at):
        asked.append(arrival.request_id)
        return None

    fleet = Fleet(1, RoundRobinRouter(), engine_factory=lambda ex: sim_replica(
        ex, num_blocks=12, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, model_max_len=512,
        preemption_mode="reject"))
    res = fleet.run(arrivals, follow_up=follow_up)
    outcomes = {f"r{r.index}": r.outcome for r in res.results}
    assert "rejected" in outcomes.values() and "ok" in outcomes.values()
    assert sorted(asked) == sorted(rid for rid, o in outcomes.items() if o == "ok")
    assert fleet.loads == [0]


def test_windowed_busy_fraction_clips_steps_to_the_window():
    """The windowed ``replica_busy_fraction`` counts step time inside ``[t0, t1)`` only, a step that straddles an
    edge by its part inside.  The 1-second-step timeline above, by hand: replica 0 steps without a break from 2
    to 12, replica 1 from 2 to 9.  In (2.5, 5.0) replica 0 is busy all 2.5 s (half of the step 2-3 counts);
    in (8.5, 10.0) replica 0 is busy 1.5 of 1.5 s and replica 1 only 0.5 s (the second half of its step 8-9).
    Catches whole steps counted by where they start."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import Fleet, sim_replica

    arrivals = [Arrival(2.0, "A", "default", tuple(range(10, 30)), 10),
                Arrival(2.0, "A2", "default", tuple(range(10, 50)), 5),
                Arrival(6.0, "B", "default", tuple(range(100, 112)), 3)]
    fleet = Fleet(2, _Scripted([0, 1, 1]), executor_factory=_one_second_steps,
                  engine_factory=lambda ex: sim_replica(ex, **_SMALL))
    res = fleet.run(arrivals)
    assert res.replicas[0].step_spans[0] == (2.0, 3.0) and res.replicas[1].step_spans[-1] == (8.0, 9.0)
    assert res.summary(window=(2.5, 5.0))["replica_busy_fraction"] == pytest.approx([1.0, 1.0])
    assert res.summary(window=(8.5, 10.0))["replica_busy_fraction"] == pytest.approx([1.0, 0.5 / 1.5])


def test_windowed_replica_requests_count_rejected_requests_as_the_whole_run_does():
    """A request the engine rejected (reject preemption mode) was admitted to its replica: the unwindowed
    ``replica_requests`` (the replica's own count) has it, and a window that covers the whole run must give the
    same count.  Catches the windowed recount keeping only requests that looked the cache up."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import Fleet, sim_replica
    from minivllm.sim.router import RoundRobinRouter

    arrivals = [Arrival(0.0, f"r{i}", "default", tuple(range(10 + i, 50 + i)), 40) for i in range(6)]
    fleet = Fleet(1, RoundRobinRouter(), engine_factory=lambda ex: sim_replica(
        ex, num_blocks=12, block_size=16, max_num_seqs=8, max_num_batched_tokens=256, model_max_len=512,
        preemption_mode="reject"))
    res = fleet.run(arrivals)
    assert any(r.outcome == "rejected" for r in res.results)
    assert res.summary()["replica_requests"] == [6]
    assert res.summary(window=(0.0, 1e9))["replica_requests"] == [6]


def test_chat_mix_warmup_is_the_closed_loop_ramp_of_one_session():
    """The warm-up is about one chat's span after its first turn: ``turns - 1`` rounds of think time and answer.
    Hand values: 3 turns, think 1-3 s (mean 2), answers counted as 2 s: 2 * (2 + 2) = 8 s, so the window is
    (8, 8 + duration).  Single-question traffic has no closed loop and needs no warm-up: window (0, duration).
    Catches counting a round per turn (a 1-turn mix warming up for nothing)."""
    from minivllm.sim.fleet import ChatMix

    mix = ChatMix(5.0, 10.0, seed=1, turns=3, think_s=(1.0, 3.0), answer_s=2.0)
    assert mix.warmup == pytest.approx(8.0) and mix.window == pytest.approx((8.0, 18.0))
    single = ChatMix(5.0, 10.0, seed=1, turns=1, think_s=(1.0, 3.0), answer_s=2.0)
    assert single.warmup == 0.0 and single.window == (0.0, 10.0)


def test_named_prefix_affinity_keys_on_key_blocks_blocks():
    """``run_fleet(..., "prefix_affinity")`` keys on :data:`KEY_BLOCKS` (20) blocks of 16 tokens, so prompts
    that share a 16-block system prompt but differ in block 17 are told apart.  Oracle: a brute-force ring --
    every replica's 64 points scanned for the first at or after the key's hash (wrapping to the smallest) --
    on the hash of each prompt's first 320 tokens.  8 prompts of 340 tokens stay under the 4,096-token spill
    floor, so every request goes to its owner.  Catches the router's own default (16 blocks: one key, one
    replica for all of them)."""
    from minivllm.arrival import Arrival
    from minivllm.sim.fleet import KEY_BLOCKS, run_fleet, sim_replica
    from minivllm.sim.router import stable_hash

    assert KEY_BLOCKS == 20
    system = list(range(10, 10 + 16 * 16))
    arrivals = [Arrival(0.0, f"q{i}", "default", tuple(system + [500 + 7 * i + j for j in range(80)]), 4)
                for i in range(8)]
    n = 3
    points = [(stable_hash(f"replica-{r}#{v}"), r) for r in range(n) for v in range(64)]

    def brute_owner(prompt):
        key = stable_hash(list(prompt[:20 * 16]))
        after = [p for p in points if p[0] >= key]
        return min(after or points)[1]

    res = run_fleet(arrivals, n, "prefix_affinity", engine_factory=lambda ex: sim_replica(ex, **_SMALL))
    assert res.spilled == 0
    assert res.placement == {a.request_id: brute_owner(a.prompt) for a in arrivals}
    assert len(set(res.placement.values())) > 1


def test_chat_mix_offers_the_requested_rate():
    """``ChatMix(rate)`` sends about ``rate`` requests per second in total, counting every turn: sessions start
    at ``rate / (mean turns per session)``.  Catches starting sessions at ``rate`` itself (3.1x the load)."""
    from minivllm.sim.fleet import ChatMix

    for rate, turns, share in ((20.0, 4, 0.3), (5.0, 2, 0.5)):
        mix = ChatMix(rate, 300.0, seed=3, turns=turns, single_shot_share=share)
        span = mix.window[1]  # sessions start during [0, warmup + duration)
        assert mix.num_requests() / span == pytest.approx(rate, rel=0.1), (rate, turns)


def test_windowed_summary_is_half_open():
    """``summary(window=(t0, t1))`` counts arrivals in ``[t0, t1)``, so back-to-back windows never count a
    request twice.  Catches a closed interval."""
    from minivllm.bench.loadgen import RequestResult
    from minivllm.sim.fleet import FleetResult

    results = [RequestResult(i, "a", t, 5, 2, outcome="ok", start=t, ttft=0.5, itl=[0.5], e2e=1.0, chunks=2,
                             output_tokens=2, prompt_tokens=5) for i, t in enumerate((0.5, 1.0, 2.0, 3.0))]
    res = FleetResult(results, [], {}, {}, 3.5, cached_tokens={f"r{i}": 2 for i in range(4)},
                      _index={f"r{i}": i for i in range(4)})
    a, b = res.summary(window=(1.0, 3.0)), res.summary(window=(3.0, 4.0))
    assert (a["requests"], b["requests"]) == (2, 1)
    assert a["offered_rps"] == 1.0 and a["prefix_hit_rate"] == pytest.approx(4 / 10)  # 2 cached of 5 looked up each


def test_hash_ring_wraps_past_the_top_to_the_smallest_point():
    """A key above the ring's largest point belongs to the *smallest* point (the ring closes), so it has the
    same owner as key 0.  Brute force over ring sizes, including ones whose first and last points belong to
    different replicas (where a ring that clamps to the last point instead of wrapping gives a wrong owner)."""
    from minivllm.sim.router import HashRing

    differing = 0
    for n in range(2, 7):
        for vnodes in (1, 3, 16, 64):
            ring = HashRing(n, vnodes)
            first = min(ring.hashes)
            first_owner = ring.owners[ring.hashes.index(first)]
            top = max(ring.hashes)
            for key in (top + 1, 2**64 - 1, (top + 2**64) // 2):
                if key < 2**64:
                    assert ring.owner(key) == first_owner, (n, vnodes, key)
            assert ring.owner(0) == first_owner
            assert ring.owner(top) == ring.owners[ring.hashes.index(top)]
            differing += first_owner != ring.owners[ring.hashes.index(top)]
    assert differing >= 5  # the case that tells wrapping from clamping is well represented


# -- run.py: drive and the SLO report ---------------------------------------------------------------------


def test_drive_timeline_by_hand():
    """A roofline whose every step costs exactly 1 s (a step overhead, infinitely fast roofs), so the run
    can be worked out by hand.  r0 (3 tokens) arrives at 0; r1 (2 tokens) at 1.5 joins at the step boundary
    t=2 and gets its first token with r0's last at t=3 (TTFT 1.5, measured from its arrival, not from when
    it joined); nothing runs from 4 until r2 arrives at 10 (the clock jumps there: virtual idling), r2's
    single token comes at 11.  Busy 5 of the run's 11 s.  Catches TTFT/e2e measured from the wrong origin,
    ITLs taken between the wrong tokens, the step-boundary log shifted, the idle jump overshooting the next
    arrival, and a busy fraction not divided by the duration."""
    from minivllm.sim.run import SimRequest, drive, make_engine, report_extras

    hw = HardwareSpec("one-second-steps", peak_flops=1e30, mem_bandwidth=1e30, step_overhead_s=1.0)
    engine = make_engine(TINY, hw, num_gpu_blocks_override=64, max_num_seqs=8, max_num_batched_tokens=256)
    reqs = [SimRequest(0, 0.0, "t", list(range(10, 30)), 3), SimRequest(1, 1.5, "t", list(range(11, 31)), 2),
            SimRequest(2, 10.0, "u", list(range(12, 32)), 1)]
    rec = drive(engine, reqs)
    got = [(r.outcome, r.start, r.ttft, r.itl, r.e2e, r.output_tokens, r.prompt_tokens) for r in rec.results]
    assert got == [("ok", 0.0, pytest.approx(1.0), pytest.approx([1.0, 1.0]), pytest.approx(3.0), 3, 20),
                   ("ok", 1.5, pytest.approx(1.5), pytest.approx([1.0]), pytest.approx(2.5), 2, 20),
                   ("ok", 10.0, pytest.approx(1.0), [], pytest.approx(1.0), 1, 20)]
    assert rec.step_starts == pytest.approx([0.0, 1.0, 2.0, 3.0, 10.0])
    assert rec.step_ends == pytest.approx([1.0, 2.0, 3.0, 4.0, 11.0])
    assert rec.check_after_step == pytest.approx([1.0, 2.0, 3.0, 4.0, 11.0])
    assert rec.injected_before_step == [1, 1, 2, 2, 3]
    assert rec.duration == pytest.approx(11.0)
    extras = report_extras(engine, rec)
    assert extras["steps"] == 5 and extras["busy_fraction"] == pytest.approx(5 / 11)


def test_sim_run_slo_flags_are_milliseconds():
    """``--slo-ttft-ms X`` is X milliseconds.  With the SLO set to the run's own median TTFT (41 requests,
    so the median is one of them), at least 21 and fewer than all requests are good; an ITL SLO at the 90th
    percentile gap leaves some requests bad.  Catches passing the milliseconds on as seconds (every request
    "good")."""
    import io

    from minivllm.sim.run import _parser, run_sim

    base = ["--workload", "chat", "--num-requests", "41", "--hardware", "a100", "--model", "llama-3.2-1b",
            "--request-rate", "400"]
    plain = run_sim(_parser().parse_args(base), out=io.StringIO())["summary"]["overall"]
    assert plain["ok"] == plain["good"] == 41
    ttft = run_sim(_parser().parse_args(base + ["--slo-ttft-ms", repr(plain["ttft_ms"]["p50"])]),
                   out=io.StringIO())["summary"]["overall"]
    assert 21 <= ttft["good"] < 41
    itl = run_sim(_parser().parse_args(base + ["--slo-itl-ms", repr(plain["itl_ms"]["p90"])]),
                  out=io.StringIO())["summary"]["overall"]
    assert 0 < itl["good"] < 41


# -- presets.py ----------------------------------------------------------------------------------------


def test_presets_carry_the_datasheet_numbers_and_honour_dtype():
    """The datasheet presets, number by number (dense BF16 TFLOPS, HBM bandwidth, memory, one-way PCIe:
    Gen5 x16 = 64 GB/s for H100/H200, Gen4 x16 = 32 GB/s for A100/L4), with the documented utilisations
    (~70% of peak for GEMMs, 80-90% of HBM bandwidth for streaming).  ``model_preset(name, dtype_bytes)``
    changes the element size (fp8 KV halves the bytes per token), and the bundled SmolLM2 is fp32, the
    engine's CPU default.  Catches a wrong utilisation or host-link figure and a dropped dtype override --
    neither moves the ridge-point sanity check."""
    import json

    from minivllm.model.loader import resolve_model_dir
    from minivllm.sim.presets import hardware_preset, model_preset

    mib = 2**20  # memory as each card reports it (nvidia-smi memory.total), not its datasheet label
    sheet = {"h100": (989.5e12, 3.35e12, 81_559 * mib, 64e9), "h200": (989.5e12, 4.8e12, 143_771 * mib, 64e9),
             "a100": (312e12, 2039e9, 81_920 * mib, 32e9), "l4": (121e12, 300e9, 23_034 * mib, 32e9)}
    for name, (flops, bw, mem, link) in sheet.items():
        hw = hardware_preset(name)
        assert (hw.peak_flops, hw.mem_bandwidth, hw.memory_bytes, hw.swap_bandwidth) == pytest.approx(
            (flops, bw, mem, link), rel=1e-9), name
        assert 0.6 <= hw.flops_util <= 0.8 and 0.8 <= hw.bw_util <= 0.9, name
        assert hw.bandwidth == pytest.approx(bw * hw.bw_util)
    llama = model_preset("llama-3-8b")
    assert llama.dtype_bytes == 2 and llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    fp8 = model_preset("llama-3-8b", 1)
    assert fp8.dtype_bytes == 1 and fp8.kv_bytes_per_token == 2 * 32 * 8 * 128
    assert fp8.weight_bytes_per_step * 2 == llama.weight_bytes_per_step
    with open(f"{resolve_model_dir(None)}/config.json", encoding="utf-8") as fh:
        cfg = json.load(fh)
    smol = model_preset("smollm2-135m")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert smol.dtype_bytes == 4
    assert smol.kv_bytes_per_token == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    assert model_preset("smollm2-135m", 2).kv_bytes_per_token * 2 == smol.kv_bytes_per_token


def test_kv_pool_is_device_memory_less_the_weights_in_bytes():
    """``sim run`` sizes the KV pool as ``utilization x memory - weight bytes``.  By hand for Llama-3-8B on an
    H100 (81,559 MiB as it reports) at 90%: per layer 4096*4096*2 (q, o) + 2*4096*1024 (k, v) + 3*4096*14336 (MLP) weights, 32
    layers, plus the untied embedding and lm_head (128256 x 4096 each), 2 bytes each in bf16, half that in
    fp8.  Catches counting weights as parameters instead of bytes (a pool 16 GB too large: no preemption
    where a real H100 would preempt)."""
    from minivllm.sim.presets import hardware_preset, model_preset
    from minivllm.sim.run import kv_pool_bytes

    params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 2 * 128256 * 4096
    h100 = hardware_preset("h100")
    device = 81_559 * 2**20  # what an H100 reports
    assert kv_pool_bytes(model_preset("llama-3-8b"), h100, 0.9) == int(0.9 * device - 2 * params)
    assert kv_pool_bytes(model_preset("llama-3-8b", 1), h100, 0.9) == int(0.9 * device - params)
    with pytest.raises(ValueError, match="does not fit"):
        kv_pool_bytes(model_preset("llama-3-8b"), hardware_preset("l4"), 0.5)  # 16 GB of weights in 12 GB


def test_drive_skips_to_the_next_arrival_when_the_policy_holds_everything_back():
    """An admission policy may hold every waiting request back (here: start only in pairs), so a step runs
    nothing although requests are unfinished.  ``drive`` must then move the virtual clock to the next
    arrival instead of spinning on empty steps (which never advance a virtual clock) until it gives up and
    times every request out.  By hand with 1 s steps: r0 (arrival 0) waits for r1 (arrival 5); both get
    their first token at 6 and their second at 7."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor
    from minivllm.sim.run import SimRequest, drive

    class Pairs:
        def order(self, waiting, running):
            return list(waiting) if len(waiting) >= 2 else []

    engine = sim_engine(executor=SimulatedExecutor(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0),
                        admission_policy=Pairs(), num_blocks=64, max_num_seqs=8)
    rec = drive(engine, [SimRequest(0, 0.0, "t", list(range(10, 30)), 2),
                         SimRequest(1, 5.0, "t", list(range(11, 31)), 2)])
    assert [(r.outcome, r.ttft, r.e2e) for r in rec.results] == [("ok", 6.0, 7.0), ("ok", 1.0, 2.0)]
    assert rec.step_ends == [0.0, 6.0, 7.0] and rec.duration == 7.0  # one empty step at t=0, then the pair
