"""The benchmark reports say what they measured: a summary row's label is recomputed from the engine's own state.

Oracle: the output lengths of the running requests, read off the scheduler at the moment each row's timing
starts, not the bench's own bookkeeping.
"""

import minivllm.bench.host_overhead as host_overhead


def test_sweep_labels_each_row_with_the_output_length_it_was_measured_at(monkeypatch):
    """Timing a point takes ``samples`` steps, so a point closer than that to the one before cannot be visited:
    the sequences are already past it.  The committed sweep asked for 250, 270 and 300 with 50 samples, and its
    rows "270" and "300" were measured at 300 and 350 output tokens.  The row must name the length it measured."""
    seen = []
    timed = host_overhead._time_steps

    def spy(engine, n):
        seen.append(sorted({len(r.output_token_ids) for r in engine.scheduler.running}))
        return timed(engine, n)

    monkeypatch.setattr(host_overhead, "_time_steps", spy)
    rows = host_overhead.sweep(4, [8, 10, 30], samples=5, prompt_len=16)
    assert all(len(s) == 1 for s in seen), seen  # (all four decode in lockstep: one length per row)
    assert [r["output_tokens"] for r in rows] == [s[0] for s in seen] == [8, 13, 30]
    assert [r["total_tokens"] for r in rows] == [24, 29, 46]


def test_sweep_measures_every_row_with_all_its_sequences_running(monkeypatch):
    """The prompts are prefilled a token budget at a time, so the first sequences are tens of tokens ahead of the
    last when the sweep starts counting; requests sized for the last sequence's count finished inside the last
    row's measurement (and 64 x 1024-token prompts lost sequences before the first row began).  A row of the sweep
    must be a step of ``seqs`` decodes from its first timed step to its last."""
    running = []
    timed = host_overhead._time_steps

    def spy(engine, n):
        before = len(engine.scheduler.running)
        got = timed(engine, n)
        running.append((before, len(engine.scheduler.running)))
        return got

    monkeypatch.setattr(host_overhead, "_time_steps", spy)
    host_overhead.sweep(64, [4, 40], samples=4, prompt_len=1024)
    assert running == [(64, 64), (64, 64)]
