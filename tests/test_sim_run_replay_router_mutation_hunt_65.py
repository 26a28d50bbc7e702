"""Tests from a mutation hunt over ``sim/run.py``, ``sim/replay.py``, ``sim/router.py`` and ``sim/executor.py``.

Each test kills one or more planted mutants that every earlier test let through; its docstring names them and
the oracle.  The engine runs are worked out by hand on cost models with round step times (a linear
:class:`SimulatedExecutor`, or a roofline whose every step is its 1 s overhead), so every expected number is
arithmetic on the request lengths, not a reading of the code under test.
"""

from __future__ import annotations

import pytest

from minivllm.labs.workloads import sim_engine
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor
from minivllm.sim.roofline import HardwareSpec, ModelShape, RooflineExecutor
from minivllm.sim.run import SimRequest, drive, report_extras


def _linear(fixed: float = 1.0, per_token: float = 0.0, **kw) -> SimulatedExecutor:
    """A cost model whose step is ``fixed + per_token x tokens`` seconds (no context term)."""
    return SimulatedExecutor(fixed_overhead_s=fixed, per_token_s=per_token, per_context_token_s=0.0, **kw)


def _prompt(first: int, length: int) -> list[int]:
    return list(range(first, first + length))


# 2 layers, hidden 8, 2 query heads sharing 1 KV head of 4, vocab 32, bf16: a roofline model small enough to cost nothing
TINY = ModelShape("tiny", num_layers=2, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                  head_dim=4, vocab_size=32, dtype_bytes=2)


class _Pairs:
    """Admission that starts requests only two at a time, so a lone late request is never admitted."""

    def order(self, waiting, running):
        return list(waiting) if len(waiting) >= 2 else []


# ----------------------------------------------------------------------------------------------------------------------


def test_the_kv_mean_holds_each_steps_level_from_that_steps_end():
    """Kills ``drive`` starting a step's KV level at the step's *start* (``level_changes(now - t0, ...)``).  The
    report plots ``kv_usage`` as (step end, level after it), and its mean must be that curve's time average.
    With equal 1 s steps the two conventions integrate alike, so the steps here differ: ``1 + 0.1 x tokens``
    seconds.  A 20-token prompt with 2 outputs: the prefill step ends at 3.0 holding 2 of 64 blocks, the decode
    step ends at 4.1 and frees them.  Mean = (2/64 x 1.1) / 4.1; the mutant holds the level over the prefill
    step (3.0 s) instead."""
    engine = sim_engine(executor=_linear(1.0, 0.1), num_blocks=64, max_num_seqs=8)
    rec = drive(engine, [SimRequest(0, 0.0, "t", _prompt(10, 20), 2)])
    assert rec.step_ends == pytest.approx([3.0, 4.1]) and rec.duration == pytest.approx(4.1)
    assert [t for t, _ in rec.kv_usage] == pytest.approx([3.0, 4.1])
    assert [u for _, u in rec.kv_usage] == [2 / 64, 0.0]
    assert report_extras(engine, rec)["kv_usage_mean"] == pytest.approx(2 / 64 * 1.1 / 4.1)


def test_a_run_that_ends_on_a_timed_out_request_averages_kv_over_its_whole_curve():
    """Written against ``drive`` setting ``kv_span`` to the duration alone (dropping ``max(duration, level_t)``),
    and ``report_extras`` dividing the busy time by that span instead of the duration, while the duration ended at
    the latest finish.  It now lasts until the run stopped (tests/test_sim_run_hunt.py), which no KV level comes
    after, so both read alike; the numbers stay pinned.  Hand case, a roofline whose every step costs exactly 1 s,
    admission in pairs: r0 and r1 (arrive 0, 20-token prompts, 2 tokens) hold 2 blocks each over [1, 2] and
    finish at 2; r2 arrives at 5, is never admitted and times out, and the run stops at 5 (the duration).  Mean
    = 4 block-seconds / 64 blocks / 5 s = 1/80 (over 2 s it would read 1/32).  Busy: 2 s of steps over the 5 s
    the table's throughput is measured on, 40%."""
    hw = HardwareSpec("one-second-steps", peak_flops=1e30, mem_bandwidth=1e30, step_overhead_s=1.0)
    engine = sim_engine(executor=RooflineExecutor(TINY, hw), admission_policy=_Pairs(), num_blocks=64, max_num_seqs=8)
    rec = drive(engine, [SimRequest(0, 0.0, "t", _prompt(10, 20), 2), SimRequest(1, 0.0, "t", _prompt(40, 20), 2),
                         SimRequest(2, 5.0, "t", _prompt(70, 20), 2)], max_idle_steps=3)
    assert [r.outcome for r in rec.results] == ["ok", "ok", "timeout"] and rec.duration == 5.0
    assert rec.kv_usage == [(1.0, 4 / 64), (2.0, 0.0), (5.0, 0.0)]
    extras = report_extras(engine, rec)
    assert extras["kv_usage_mean"] == pytest.approx(1 / 80)
    assert extras["busy_fraction"] == pytest.approx(0.4)


def test_kv_samples_are_spaced_from_the_last_sample_and_steps_count_every_step():
    """Kills ``drive`` advancing its next sample time from the previous *target* (``next_sample +
    sample_every``) instead of from the sample just taken: after a long step it then samples several short
    steps in a row, bunching the curve the sparkline draws as evenly spaced.  And kills ``report_extras``
    counting ``steps`` as the number of KV samples.  Hand case: steps of ``0.1 + 0.1 x tokens`` s; r0 (20-token
    prompt, 20 tokens) prefills in 2.1 s, then decodes in 0.2 s steps; r1 (2-token prompt, 2 tokens) arrives at
    4.0 and joins the step 4.1-4.5 (3 tokens), decodes with r0 to 4.8, and r0's decodes run on to 6.2: 20
    steps.  Arrivals span 4 s and ``kv_samples=4``, so a sample at most every 1 s: at 2.1, then the first step
    end >= 3.1 (3.1), >= 4.1 (4.1), >= 5.1 (5.2), >= 6.2 (6.2)."""
    engine = sim_engine(executor=_linear(0.1, 0.1), num_blocks=64, max_num_seqs=8)
    rec = drive(engine, [SimRequest(0, 0.0, "t", _prompt(10, 20), 20), SimRequest(1, 4.0, "t", [5, 6], 2)],
                kv_samples=4)
    ends = [2.1 + 0.2 * k for k in range(11)] + [4.5, 4.8] + [4.8 + 0.2 * k for k in range(1, 8)]
    assert rec.step_ends == pytest.approx(ends)
    assert [t for t, _ in rec.kv_usage] == pytest.approx([2.1, 3.1, 4.1, 5.2, 6.2])
    assert report_extras(engine, rec)["steps"] == 20


def test_a_run_shorter_than_a_second_still_gets_its_kv_samples():
    """Kills ``drive`` flooring its sampling span at 1 s (``max(span_hint, 1.0)``) where the floor is only there
    to avoid a zero span: a burst whose arrivals span 10 ms with ``kv_samples=5`` must be sampled about every
    2 ms, not once per 200 ms (one sample for the whole 20 ms run).  Hand case: 1 ms steps, r0 (20 tokens)
    from 0 to 20 ms, r1 arriving at 10 ms: a sample every other step, ten in all."""
    engine = sim_engine(executor=_linear(0.001), num_blocks=64, max_num_seqs=8)
    rec = drive(engine, [SimRequest(0, 0.0, "t", _prompt(10, 20), 20), SimRequest(1, 0.01, "t", [5, 6], 2)],
                kv_samples=5)
    assert rec.duration == pytest.approx(0.02)
    assert len(rec.kv_usage) >= 5
    assert all(b - a < 0.0025 for (a, _), (b, _) in zip(rec.kv_usage, rec.kv_usage[1:]))


# ----------------------------------------------------------------------------------------------------------------------


def test_a_groups_chunks_are_the_steps_that_gave_it_tokens():
    """Kills ``_finish`` counting a request's chunks as its tokens.  A request with ``n = 3`` samples streams one
    chunk per step in which any of its samples got a token (the docstring of ``_finish``), not one per token.
    Oracle: the same request stepped by hand on a twin engine, counting the steps whose output carries any new
    token (5 steps for 12 tokens: the samples fork after the prompt's step)."""
    def engine():
        return sim_engine(executor=_linear(), num_blocks=64, max_num_seqs=8)

    twin = engine()
    twin.add_request({"prompt_token_ids": [11] * 8},
                     SamplingParams(max_tokens=4, n=3, ignore_eos=True, temperature=1.0, output_kind="delta"),
                     request_id="r0")
    steps_with_tokens = tokens = 0
    while twin.has_unfinished_requests():
        new = [len(c.delta_token_ids) for out in twin.step() for c in out.outputs]
        steps_with_tokens += any(new)
        tokens += sum(new)
    rec = drive(engine(), [SimRequest(0, 0.0, "t", [11] * 8, 4, n=3)], temperature=1.0)
    (res,) = rec.results
    assert tokens == 12 and steps_with_tokens < tokens
    assert (res.output_tokens, res.chunks, len(res.itl)) == (12, steps_with_tokens, steps_with_tokens - 1)


@pytest.mark.parametrize("origin", [0.0, 1000.0])
def test_deadlines_are_on_the_runs_clock_wherever_that_clock_starts(origin):
    """Kills ``drive`` passing ``SimRequest.deadline`` (seconds after the run's start) to the engine without
    adding the clock's origin ``t0``.  A real engine's clock, or a replay of its record, does not start at 0;
    deadlines left near 0 there all lie in the past, the aged key ``max(arrival, deadline)`` is every request's
    arrival, and earliest-deadline-first silently becomes first come first served.  Hand case: one sequence at
    a time, 1 s steps, three 1-token requests arriving together with deadlines 9, 5 and 1 s: served in reverse,
    TTFTs 3, 2, 1 -- on a clock starting at 0 and on one starting at 1000."""
    engine = sim_engine(executor=_linear(clock=origin), num_blocks=64, max_num_seqs=1, scheduling_policy="deadline",
                        deadline_aging_s=100.0)
    reqs = [SimRequest(k, 0.0, "t", _prompt(10 + k, 20), 1, deadline=d) for k, d in enumerate([9.0, 5.0, 1.0])]
    rec = drive(engine, reqs)
    assert [r.ttft for r in rec.results] == [3.0, 2.0, 1.0]


# ----------------------------------------------------------------------------------------------------------------------


def test_burstiness_reshapes_a_named_workloads_arrivals():
    """Kills ``build_requests`` keeping a named workload's own burstiness when ``--burstiness`` is given.
    Oracle: the load generator's documented arrival process, gamma gaps of shape ``burstiness``, whose
    coefficient of variation is 1/sqrt(burstiness): 2 for 0.25, against chat's Poisson 1.  Over 2,000 seeded
    gaps the estimate lands well inside the bands below."""
    import statistics

    from minivllm.sim.run import _parser, build_requests

    def cv(argv):
        reqs, _, _ = build_requests(_parser().parse_args(["--workload", "chat", "--num-requests", "2001", *argv]), 49152)
        gaps = [b.arrival - a.arrival for a, b in zip(reqs, reqs[1:])]
        return statistics.pstdev(gaps) / statistics.fmean(gaps)

    assert 0.85 < cv([]) < 1.15
    assert 1.6 < cv(["--burstiness", "0.25"]) < 2.4


# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("utilization", [0.5, 0.9])
def test_a_simulated_pool_follows_the_gpu_memory_utilization_asked_for(utilization):
    """Kills ``make_engine`` sizing the pool at the default 90% whatever ``gpu_memory_utilization`` says (``sim
    run --gpu-memory-utilization`` would change nothing).  By hand for Llama-3-8B in bf16 on an H100 (81,559 MiB
    as it reports): weights 2 bytes x (32 layers x (2 x 4096^2 + 2 x 4096 x 1024 + 3 x 4096 x 14336) + 2 x
    128256 x 4096), a block 16 tokens x 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes; the pool is
    ``(utilization x memory - weights) // block`` blocks."""
    from minivllm.sim.presets import hardware_preset, model_preset
    from minivllm.sim.run import make_engine

    params = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336) + 2 * 128256 * 4096
    block = 16 * 2 * 32 * 8 * 128 * 2
    engine = make_engine(model_preset("llama-3-8b"), hardware_preset("h100"), gpu_memory_utilization=utilization,
                         max_model_len=2048)
    assert engine.stats()["num_blocks"] == int(utilization * 81_559 * 2**20 - 2 * params) // block


def test_a_fitted_max_model_len_stays_within_the_models_positions():
    """Kills ``make_engine``'s ``fit_max_model_len`` clamping only to the pool and forgetting ``model_max_len``
    (its docstring: "clamp it to what the model's positions and the pool allow").  Hand case: a model of 1,024
    positions, a wish of 4,096 tokens and a pool of 1,000 blocks of 16 (16,000 tokens): 1,024; and a pool of 10
    blocks clamps the same wish to 160."""
    from minivllm.sim.presets import hardware_preset
    from minivllm.sim.run import make_engine

    def fitted(blocks):
        return make_engine(TINY, hardware_preset("h100"), num_gpu_blocks_override=blocks, model_max_len=1024,
                           max_model_len=4096, fit_max_model_len=True).config.max_model_len

    assert (fitted(1000), fitted(10)) == (1024, 160)


# ----------------------------------------------------------------------------------------------------------------------


def test_a_replay_built_from_a_record_takes_the_callers_overrides():
    """Kills ``ReplayExecutor.from_record`` letting the record's numbers win over the keywords its caller passes
    (``{**kwargs, **known}``): a what-if replay at another start-up prefill rate, or without the recorded tokens,
    would silently replay the recorded ones.  Hand case: a record of two step readings on a clock from 50, 4 KiB
    blocks, start-up costs (1e9 B/s, 2e4 tok/s) and one request's tokens."""
    from minivllm.sim.replay import ReplayExecutor
    from minivllm.sim.run import DriveRecord

    rec = DriveRecord([], output_token_ids={"r0": [11, 12]}, kv_bytes_per_block=4096, start_costs=(1e9, 2e4),
                      clock_origin=50.0, step_end_readings=[51.0, 52.5])
    plain = ReplayExecutor.from_record(rec)
    assert (plain.times, plain.clock, plain.tokens, plain.kv_bytes_per_block, plain.swap_bytes_per_s,
            plain.prefill_tokens_per_s) == ([51.0, 52.5], 50.0, {"r0": [11, 12]}, 4096, 1e9, 2e4)
    what_if = ReplayExecutor.from_record(rec, prefill_tokens_per_s=5e3, tokens=None, clock=0.0)
    assert (what_if.prefill_tokens_per_s, what_if.tokens, what_if.clock, what_if.swap_bytes_per_s) == (5e3, None, 0.0, 1e9)


def test_a_replays_clock_never_moves_back():
    """Kills ``ReplayExecutor.advance_to`` setting the clock unconditionally.  The VirtualClock protocol says
    "move the clock forward to t (never back)": a driver asking to idle until a time already passed must find
    the clock where it was, or the next step's end (``max(clock, times[k])``) lands before the previous one.
    Hand case: readings 2 and 3; after the first step the clock reads 2, idling until 1 leaves it at 2, until
    2.5 moves it there, and the second step ends at its reading, 3."""
    from types import SimpleNamespace

    from minivllm.sim.replay import ReplayExecutor

    ex = ReplayExecutor([2.0, 3.0])
    empty = SimpleNamespace(seqs=[])
    ex.execute(empty)
    ex.advance_to(1.0)
    assert ex.now() == 2.0
    ex.advance_to(2.5)
    assert ex.now() == 2.5
    ex.execute(empty)
    assert ex.now() == 3.0
