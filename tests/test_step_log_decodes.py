"""The step log says which rows are decodes: a one-token chunk of a re-prefill past the prompt is prefill.

After a recompute preemption a request computes its prompt and its generated tokens again; under a chunk cap of
one token (or a budget with one token left) a chunk of that re-prefill is ``(id, start past the prompt, 1)`` --
in the step log's ``(id, start, tokens)`` exactly a decode.  The engine's batch counted it as prefill (the fit and
the per-tenant counts read that), while the timeline, ``describe_step``, ``step_composition`` and the prefill-rate
bench read the log by position and called it a decode.

Oracle: the rows the executor receives, each judged by the definition -- a decode feeds one token past the
prompt at a position its request has never computed (its newest sampled token) -- tracked here from the rows
alone, with no engine counter.
"""

from __future__ import annotations

import pytest

from minivllm.bench.prefill_rate import step_terms
from minivllm.labs import widgets
from minivllm.labs.workloads import run_engine, sim_engine
from minivllm.metrics.step_log import decode_flags
from minivllm.sim.executor import SimulatedExecutor

REQS = [([170, 738], 4), ([248, 107, 170, 707, 102, 556], 4), ([265, 401], 9)]
LENS = {f"r{i}": len(p) for i, (p, _) in enumerate(REQS)}


class JudgesRows(SimulatedExecutor):
    """Records, per step, each row and whether it is a decode by the definition."""

    def __init__(self) -> None:
        super().__init__()
        self.reached: dict[str, int] = {}
        self.steps: list[list[tuple[str, int, int, bool]]] = []

    def execute(self, batch):
        rows = []
        for s in batch.seqs:
            rid = s.request.request_id
            reached = self.reached.get(rid, 0)
            rows.append((rid, s.start, s.num_tokens, s.num_tokens == 1 and s.start >= LENS[rid] and s.start >= reached))
            self.reached[rid] = max(reached, s.start + s.num_tokens)
        self.steps.append(rows)
        return super().execute(batch)


def one_token_builder(running, budget, threshold):
    """One token each, newest request first: one-token prefill rows come before the decodes."""
    return [(r, 1) for r in reversed(running)][:budget]


@pytest.mark.parametrize("builder", [None, one_token_builder], ids=["scheduler", "builder"])
def test_a_one_token_reprefill_chunk_past_the_prompt_is_logged_as_prefill(builder):
    ex = JudgesRows()
    eng = sim_engine(block_size=2, num_blocks=9, max_num_seqs=8, max_num_batched_tokens=3,
                     long_prefill_token_threshold=1, executor=ex, batch_builder=builder)
    run_engine(eng, REQS)
    log = list(eng.step_log)
    assert len(log) == len(ex.steps)
    assert eng.scheduler.stats.num_recompute_preemptions > 0
    lookalikes = [(rec.step, rid, start) for rec, rows in zip(log, ex.steps)
                  for rid, start, n, decode in rows if n == 1 and start >= LENS[rid] and not decode]
    assert lookalikes, "no one-token re-prefill chunk past the prompt: the case tests nothing"
    timeline = widgets.timeline_rows(log, LENS)
    at = {rid: {step: kind for step, kind, _ in rows} for rid, rows in timeline.items()}
    for rec, rows in zip(log, ex.steps):  # the timeline's colours
        assert list(rec.seqs) == [r[:3] for r in rows]
        assert [at[rid][rec.step] for rid, *_ in rows] == ["decode" if d else "prefill" for *_, d in rows], rec.step
    step, rid, start = lookalikes[0]
    assert f"{rid} prefill[{start}:{start + 1}]" in widgets.describe_step(next(r for r in log if r.step == step), LENS)
    for rec, rows in zip(log, ex.steps):  # the record's count, and a step's split from it
        decodes = [r for r in rows if r[3]]
        assert rec.num_decodes == len(decodes) and all(r[3] for r in rows[:len(decodes)]), rows  # decodes lead
        want = (sum(n for _, _, n, d in rows if not d), len(decodes))
        assert widgets.step_composition(rec.seqs, LENS, rec.num_decodes) == want
    want_terms, last = [], None  # step_terms' own selection of steps, with the judged split
    for rec, rows in zip(log, ex.steps):
        if last is not None and rows and not (rec.swapped_in or rec.swapped_out) and rec.time > last:
            want_terms.append((sum(n for _, _, n, d in rows if not d), sum(d for *_, d in rows)))
        last = rec.time
    assert [(p, d) for p, d, _ in step_terms(log, LENS)] == want_terms  # the prefill-rate bench's split

def test_an_entry_without_the_count_is_still_read_by_position():
    entry = {"step": 0, "seqs": (("a", 7, 1), ("b", 2, 3)), "preempted": (), "num_tokens": 4}
    assert widgets.step_composition(entry["seqs"], {"a": 7, "b": 9}) == (3, 1)
    assert widgets.describe_step(entry, {"a": 7, "b": 9}).endswith("a decode, b prefill[2:5]")


def test_decode_flags_reads_the_count_then_the_position_then_the_size():
    """The one rule every step-log reader shares (hand-judged rows: "a" decodes at 7 past its 7-token prompt, "b"
    is a 3-token prompt chunk, "c" a one-token chunk inside its 5-token prompt)."""
    seqs = (("a", 7, 1), ("c", 2, 1), ("b", 2, 3))
    assert decode_flags({"seqs": seqs, "num_decodes": 1}) == [True, False, False]  # the engine's count wins
    assert decode_flags({"seqs": seqs}, {"a": 7, "b": 9, "c": 5}) == [True, False, False]  # by position
    assert decode_flags({"seqs": seqs}) == [True, True, False]  # no lengths: a one-token row reads as a decode
