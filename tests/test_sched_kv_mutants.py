"""Tests from a second hand mutation pass over the scheduler and the KV cache manager (``scheduler.py``,
``kv_cache_manager.py``, ``block_pool.py``, ``sched/output.py``): each pins a behaviour that a planted bug
changed while every existing test still passed.

Everything runs on the simulated executor.  The oracles are independent of the counters under test: a
recount of what each step's rows really (re)computed, made from the batches the executor receives, and a
hand-built batch.
"""

from __future__ import annotations

import pytest

from minivllm.sampling_params import SamplingParams

from tests.invariants import KVContents, assert_no_leak, drain, tiny_engine


class RecountsRecompute(KVContents):
    """Counts, from the rows it runs, the tokens computed a second time: a row's positions below the furthest
    position its request had already computed.  And, on the step a request starts over after a recompute
    preemption, checks that the request knows how far it had got (``num_tokens_computed_once``, which WFQ reads
    so that a re-prefill is not charged as service twice)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.reached: dict[str, int] = {}
        self.recomputed = 0
        self.restarts = 0
        self.forgot: list[str] = []

    def execute(self, batch):
        for s in batch.seqs:
            rid, end = s.request.request_id, s.start + s.num_tokens
            reached = self.reached.get(rid, 0)
            self.recomputed += max(0, min(end, reached) - s.start)
            if s.start == 0 and reached:
                self.restarts += 1
                if s.request.num_tokens_computed_once != reached:
                    self.forgot.append(f"{rid}: knows {s.request.num_tokens_computed_once}, reached {reached}")
            self.reached[rid] = max(reached, end)
        return super().execute(batch)


def test_recomputed_tokens_and_the_furthest_point_reached_match_a_recount_of_the_rows_run():
    """Kills: a recompute preemption that does not add the victim's computed tokens to ``recomputed_tokens``
    (the ``vllm:num_recomputed_tokens`` counter; the labs' cost of recompute reads it).  It also fails when a
    preemption does not keep ``num_tokens_computed_once`` (WFQ then charges each re-prefill as new service; a
    WFQ test in test_fairness.py catches that one only through its effect on fairness).  Oracle: the rows the
    executor ran -- every position a request computes again is below the furthest it reached before."""
    ex = RecountsRecompute(4)
    engine = tiny_engine(num_blocks=6, max_seqs=3, max_len=20)
    engine.executor = ex
    for i in range(3):
        engine.add_request({"prompt_token_ids": [10 + i] * 7}, SamplingParams(max_tokens=10, ignore_eos=True))
    drain(engine)
    stats = engine.stats()
    assert stats["num_recompute_preemptions"] > 0 and ex.restarts > 0, "the workload must preempt by recompute"
    assert stats["recomputed_tokens"] == ex.recomputed
    assert not ex.forgot, ex.forgot
    assert_no_leak(engine)


def test_a_one_token_prefill_row_is_not_counted_as_a_decode_token():
    """Kills: ``ScheduledBatch.num_decode_tokens`` counting one-token rows instead of decode rows.  A forked
    ``n > 1`` sample's first row (its last prompt token) and the last one-token chunk of a prompt are prefill
    work; the step log and the prefill/decode split of a step's cost read this count.  Hand-built batch: one
    decode row, one one-token prefill row, one 3-token prefill row."""
    from minivllm.request import Request
    from minivllm.sched.output import ScheduledBatch, ScheduledSeq

    reqs = [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=4), 0.0) for i in range(3)]
    batch = ScheduledBatch([ScheduledSeq(reqs[0], 1, 4, True), ScheduledSeq(reqs[1], 1, 3, False),
                            ScheduledSeq(reqs[2], 3, 0, False)])
    assert batch.num_decode_tokens == 1
    assert batch.num_prefill_tokens == 4
    assert batch.num_tokens == 5


class RecountsCacheHits(KVContents):
    """Reads the prefix cache's work off the rows it runs: a request's first row starts at the tokens its first
    lookup found (``prefix_cache_hits``), and the first row after each recompute preemption (the step's
    ``batch.preempted`` names the victims) starts at the tokens it found again (``recompute_hit_tokens``)."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.seen: set[str] = set()
        self.restarting: set[str] = set()
        self.first_hits = 0
        self.restart_hits = 0
        self.restarts = 0

    def execute(self, batch):
        for s in batch.seqs:
            rid = s.request.request_id
            if rid not in self.seen:
                self.seen.add(rid)
                self.first_hits += s.start
            elif rid in self.restarting:
                self.restarting.discard(rid)
                self.restarts += 1
                self.restart_hits += s.start
        self.restarting.update(r.request_id for r in batch.preempted)
        return super().execute(batch)


@pytest.mark.parametrize("kind", ["radix", "hash"])
def test_tokens_a_preempted_request_finds_again_are_counted_exactly_as_recompute_hits(kind):
    """Kills: ``record_admission`` crediting a re-admitted request with anything but the tokens its lookup
    found again (its prompt length, one block, nothing); the other tests only asked for "more than zero".
    Lab 4 weighs recompute against swap with this count.  Oracle: where each restarted request's first row
    begins, as the executor sees it; and the same for a first admission's hits.  Two requests share a 12-token
    prefix so that both kinds of hit occur."""
    ex = RecountsCacheHits(4)
    engine = tiny_engine(num_blocks=14, max_seqs=3, max_len=40, prefix=kind)
    engine.executor = ex
    shared = list(range(50, 62))
    for i in range(3):
        engine.add_request({"prompt_token_ids": shared + [10 + i] * 5}, SamplingParams(max_tokens=14, ignore_eos=True))
    drain(engine)
    stats = engine.stats()
    assert ex.restarts > 0 and stats["num_recompute_preemptions"] >= ex.restarts, "the workload must restart requests"
    assert ex.restart_hits > 0 and ex.first_hits > 0, "both kinds of hit must occur for the test to mean anything"
    assert stats["recompute_hit_tokens"] == ex.restart_hits
    assert stats["prefix_cache_hits"] == ex.first_hits
    assert_no_leak(engine)
