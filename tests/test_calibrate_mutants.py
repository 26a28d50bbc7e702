"""Mutation hunt on ``minivllm.sim.calibrate`` and ``minivllm.sim.presets``: behaviour a user sees that no test
pinned.  Each test names the mutant it kills and its oracle (a hand computation or a published config value)."""

from dataclasses import asdict
from types import SimpleNamespace

import pytest

import minivllm.sim.calibrate as cal
from minivllm.sim.presets import hardware_preset, model_preset
from minivllm.sim.roofline import HardwareSpec, ModelShape, roofline_time, step_cost


def test_read_bandwidth_is_the_tensors_bytes_over_its_fastest_pass(monkeypatch):
    """The measured bandwidth pins the calibration's memory roof, so a factor in it is a factor in every fitted
    memory-bound step.  Hand case: a 1 MiB fp32 tensor, three timed passes of 0.3, 0.1 and 0.2 s (a fake clock)
    -> 2**20 bytes / 0.1 s.  Kills: counting elements instead of bytes (4x too slow) and keeping the last pass
    instead of the fastest (2**20 / 0.2)."""
    ticks = iter([0.0, 0.3, 1.0, 1.1, 2.0, 2.2])
    monkeypatch.setattr(cal, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    got = cal.measure_read_bandwidth("cpu", megabytes=1, repeats=3)
    assert got == pytest.approx(2**20 / 0.1, rel=1e-9)


def test_recorded_step_counts_the_blocks_moved_in_both_directions():
    """A step's ``swapped_blocks`` is what the fit takes off as copy time (``swap_bytes / swap_bandwidth``), and a
    swap-out costs the link as much as a swap-in.  Hand case: 2 blocks in, 3 out -> 5; and per sequence
    ``(start, tokens, completes its prompt)``: 3 + 2 of a 5-token request completes it, 0 + 2 does not.  Kills:
    counting only the swap-ins (2)."""
    inner = SimpleNamespace(execute=lambda batch: "out")
    rec = cal.RecordingExecutor(inner)
    req = SimpleNamespace(num_tokens=5)
    batch = SimpleNamespace(seqs=[SimpleNamespace(start=3, num_tokens=2, request=req),
                                  SimpleNamespace(start=0, num_tokens=2, request=req)],
                            moves=SimpleNamespace(swap_in=[1, 2], swap_out=[3, 4, 5]))
    assert rec.execute(batch) == "out"
    assert rec.batches == [([(3, 2, True), (0, 2, False)], 5)]


def test_measured_steps_record_when_they_began():
    """``StepSample.start_s`` is the step log's ``began_s`` (``sim_accuracy --explain`` reads the gaps between
    steps from it).  Oracle: on a virtual clock a step begins no earlier than the previous one began plus its
    duration, and every step after the first begins after the run's start.  Kills: recording 0 for every step."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.roofline import RooflineExecutor
    from minivllm.sim.run import SimRequest

    shape = model_preset("smollm2-135m").with_dtype(4)
    cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks_override=32, max_model_len=64,
                       device="cpu", block_size=4)
    engine = LLMEngine(cfg, executor=cal.RecordingExecutor(RooflineExecutor(shape, hardware_preset("h100"))),
                       model_max_len=64, eos_token_ids=set())
    samples, _ = cal.measure(engine, [SimRequest(0, 0.0, "t", [11] * 8, 4)])
    assert len(samples) == 4  # one prefill, three decodes
    for prev, nxt in zip(samples, samples[1:]):
        assert nxt.start_s >= prev.start_s + prev.time_s - 1e-12 and nxt.start_s > 0


def test_median_of_repeats_falls_back_to_the_first_run_when_the_runs_were_scheduled_differently(monkeypatch):
    """Per-step medians only mean something when every run scheduled the same steps; otherwise the first run's
    times stand (the docstring's promise).  Hand case: run 1 [A 1.0 s, B 2.0 s], run 2 [A 3.0 s, C 4.0 s],
    run 3 [A 5.0 s, B 6.0 s] -> run 1's times [1.0, 2.0].  Kills: taking medians when *any* run lines up (run 1
    always lines up with itself), which gives [3.0, 4.0] -- step B timed partly by step C."""
    a, b, c = [(0, 8, True)], [(8, 1, True)], [(0, 4, True)]
    runs = iter([[cal.StepSample(a, 0, 1.0), cal.StepSample(b, 0, 2.0)],
                 [cal.StepSample(a, 0, 3.0), cal.StepSample(c, 0, 4.0)],
                 [cal.StepSample(a, 0, 5.0), cal.StepSample(b, 0, 6.0)]])
    monkeypatch.setattr(cal, "measure", lambda engine, requests: (next(runs), None))
    got = cal.measure_median(None, [], 3)
    assert [s.time_s for s in got] == [1.0, 2.0]
    assert [s.seqs for s in got] == [a, b]


def test_fit_refuses_fewer_steps_than_it_has_parameters():
    """Eight parameters cannot be identified from seven steps: the fit must say so, not return one of infinitely
    many exact fits as a profile.  Kills: the bound off by one."""
    shape = ModelShape("tiny", num_layers=1, hidden_size=8, intermediate_size=16, num_heads=2, num_kv_heads=1,
                       head_dim=4, vocab_size=32, dtype_bytes=4)
    costs = [step_cost(shape, [(0, n, True)], 0, 16) for n in (1, 2, 3, 4, 5, 6, 7, 8)]
    assert len(cal.PARAMS) == 8
    with pytest.raises(ValueError, match="at least 8"):
        cal.fit(costs[:7], [1e-3 * (k + 1) for k in range(7)])
    cal.fit(costs, [1e-3 * (k + 1) for k in range(8)])  # eight is enough to run




def test_the_profile_line_prints_each_fitted_number_in_its_unit():
    """The one line ``minivllm sim calibrate`` prints is how a user reads a profile.  Hand case: every field set,
    the attention compute roof left at ``spec_from_theta``'s 1e30 ("infinite": the grid never reached it).
    Kills: the "not binding" test moved past 1e30 (printing 1e21 GFLOP/s), the per-sequence overhead in the
    wrong unit, the corner always shown as ``max``, rms and max error swapped, the prompt-step cost dropped."""
    doc = {"hardware": {"name": "toy", "step_overhead_s": 4e-3, "eager_step_overhead_s": 6e-3,
                        "seq_overhead_s": 0.3e-3, "peak_flops": 60e9, "attention_flops": 1e30,
                        "mem_bandwidth": 12e9, "attention_bandwidth": 3e9, "roof_p": 4.0},
           "fit": {"steps": 20, "rms_rel_error": 0.031, "max_abs_rel_error": 0.087, "seconds": 12.0}}
    assert cal.format_profile(doc) == (
        "toy: step overhead 4.00 ms (+6.00 ms for a step with prompt tokens) + 0.300 ms/seq | "
        "GEMM 60.0 GFLOP/s | attention not binding | memory 12.0 GB/s (attention 3.0 GB/s) | "
        "roof corner p=4 | fit on 20 steps: rms rel error 3.1%, max 8.7% (12 s)")
    doc["hardware"]["attention_span_bandwidth"] = 2.5e9  # the span term (roofline docstring) is shown beside it
    assert "(attention 3.0 GB/s, longest sequence 2.5 GB/s) | " in cal.format_profile(doc)


def test_a_refit_keeps_the_device_memory_the_calibration_recorded():
    """A GPU profile's ``memory_bytes`` sizes its KV pool in ``sim run``; re-fitting its samples
    (``--refit``) changes the cost model, not the device.  Hand case: a toy grid timed by a known spec, the
    profile's hardware recording 80 GiB -> still 80 GiB after the refit.  Kills: the refit dropping it to 0."""
    doc = toy_profile(device="cuda:0", memory_bytes=80 * 2**30)
    cal.refit(doc)
    assert doc["hardware"]["memory_bytes"] == 80 * 2**30


def toy_profile(device: str = "cpu", memory_bytes: float = 0.0) -> dict:
    """A profile with stored samples: ten steps timed exactly by a known spec (GEMM 60 GFLOP/s; quick to fit).
    Also used by tests/test_calibrate_cli_mutants.py."""
    shape = model_preset("smollm2-135m").with_dtype(4)
    truth = HardwareSpec("truth", peak_flops=60e9, mem_bandwidth=12e9, attention_flops=25e9,
                         attention_bandwidth=3e9, step_overhead_s=4e-3, seq_overhead_s=0.3e-3)
    batches = [[(0, n, True)] for n in (16, 64, 160, 320, 512)] + [[(ctx, 1, True)] * b for b, ctx in
                                                                   ((1, 40), (4, 40), (16, 40), (4, 400), (12, 400))]
    times = [roofline_time(step_cost(shape, b, 0, 16), shape, truth).total for b in batches]
    return {"device": device, "model": asdict(shape), "engine": {"block_size": 16}, "fit": {},
            "hardware": {"name": "toy", "memory_bytes": memory_bytes},
            "samples": [{"seqs": [list(x) for x in b], "swapped_blocks": 0, "time_s": t} for b, t in zip(batches, times)]}
