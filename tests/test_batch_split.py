"""The batch carries its prefill/decode split, counted once by the scheduler while it builds the batch.

The engine's prefill-rate fit (auto preemption), the scheduler's per-tenant token counts and the step log read
``num_prefill_tokens`` and ``num_decode_tokens`` every step; they used to walk the batch on each read.  The oracle
here is a recount from the rows the executor receives, by the one rule for a decode row
(``ScheduledSeq.is_decode``), on every step of runs that chunk, preempt (rows dropped after the count) and build
the batch by the lab 4 builder and under tenant token caps.
"""

from __future__ import annotations

import random

import pytest

from minivllm.config import TenantConfig
from minivllm.labs.check_lab04 import engine_build_batch
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.sched.output import ScheduledBatch, ScheduledSeq

from tests.invariants import KVContents, drain, tiny_engine


class RecountsSplit(KVContents):
    """Compares the batch's split with a recount of its rows, and counts the steps whose split was carried."""

    def __init__(self, block_size: int) -> None:
        super().__init__(block_size)
        self.miscounted: list[str] = []
        self.carried = 0
        self.carried_with_prefill = 0

    def execute(self, batch):
        want = (sum(s.num_tokens for s in batch.seqs if not s.is_decode), sum(1 for s in batch.seqs if s.is_decode))
        got = (batch.num_prefill_tokens, batch.num_decode_tokens)
        if got != want or (batch.split is not None and batch.split != want):
            self.miscounted.append(f"rows {[(s.start, s.num_tokens, s.is_decode) for s in batch.seqs]}: {got}, "
                              f"split {batch.split}, recount {want}")
        if batch.split is not None:
            self.carried += 1
            self.carried_with_prefill += bool(want[0])
        return super().execute(batch)


@pytest.mark.parametrize("options", [
    {},
    {"long_prefill_token_threshold": 3, "prefix": "radix"},
    {"tenants": {"a": TenantConfig(max_tokens_per_step=7), "b": TenantConfig()}},
], ids=["plain", "threshold+prefix", "token-caps"])
@pytest.mark.parametrize("builder", [None, engine_build_batch], ids=["scheduler", "builder"])
def test_the_carried_split_matches_a_recount_of_the_rows(options, builder):
    options = dict(options)
    prefix = options.pop("prefix", None)
    engine = tiny_engine(num_blocks=12, budget=9, max_len=40, prefix=prefix, **options)
    if builder is not None:
        engine.scheduler.batch_builder = builder
    ex = engine.executor = RecountsSplit(4)
    rng = random.Random(5)
    tenants = ["a", "b"] if "tenants" in options else ["default"]
    for i in range(10):
        prompt = [rng.randrange(10, 200) for _ in range(rng.randint(2, 20))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(4, 20), ignore_eos=True), f"r{i}",
                           tenant=tenants[i % len(tenants)])
    drain(engine)
    assert not ex.miscounted, ex.miscounted[:3]
    assert engine.scheduler.stats.num_preemptions > 0  # rows were dropped after the count: the recount path ran
    assert ex.carried_with_prefill > 0 and ex.carried > ex.carried_with_prefill


def test_a_hand_built_batch_is_counted_from_its_rows_and_a_carried_split_is_read_as_given():
    reqs = [Request(f"r{i}", [1, 2, 3, 4], SamplingParams(max_tokens=4), 0.0) for i in range(3)]
    rows = [ScheduledSeq(reqs[0], 1, 4, True), ScheduledSeq(reqs[1], 1, 3, False), ScheduledSeq(reqs[2], 3, 0, False)]
    assert (ScheduledBatch(list(rows)).num_prefill_tokens, ScheduledBatch(list(rows)).num_decode_tokens) == (4, 1)
    carried = ScheduledBatch(list(rows), split=(4, 1))
    assert (carried.num_prefill_tokens, carried.num_decode_tokens) == (4, 1)
