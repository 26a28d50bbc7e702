"""The host-overhead shortcuts against their plain definitions, step by step on random workloads.

* the executor's incremental batch preparation (``BatchPreparer``) against the stateless reference
  (``build_attention_metadata``), on workloads that change block tables in every way the memory
  manager can: new blocks, copy-on-write (``n > 1``), prefix-cache hits, recompute and swap
  preemption, aborts, chunked prefills;
* the scheduler's and KV manager's bulk loops (``seqs_needing_blocks``, ``num_new_blocks_all``,
  ``_demand``, ``Request.split_decodes``) against the per-request methods they inline.

No model: the simulated executor runs the real scheduler.
"""

from __future__ import annotations

import random

import pytest
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.model.runner import BatchPreparer, build_attention_metadata
from minivllm.request import Request
from minivllm.sim import SimulatedExecutor


class _CheckingExecutor(SimulatedExecutor):
    """Runs both preparations on every real batch and records any disagreement, then simulates the step.

    (Records rather than raises: the engine turns an executor exception into per-request errors.)
    """

    def __init__(self):
        super().__init__()
        # tiny initial buffers, so row reuse and both kinds of growth happen within a few steps
        self.prep = BatchPreparer(4, "cpu", rows=3, width=2)
        self.checked = 0
        self.mismatches: list = []

    def execute(self, batch):
        if batch.seqs:
            ids, pos, meta = self.prep.prepare(batch.seqs)
            ref_ids, ref_pos, ref = build_attention_metadata(batch.seqs, 4, torch.device("cpu"))
            got = {"input_ids": ids, "positions": pos, **{n: getattr(meta, n) for n in _TENSORS}}
            want = {"input_ids": ref_ids, "positions": ref_pos, **{n: getattr(ref, n) for n in _TENSORS}}
            for name in got:
                if got[name].dtype != want[name].dtype or not torch.equal(got[name], want[name]):
                    self.mismatches.append((self.checked, name, got[name], want[name]))
            if (meta.num_decodes, meta.query_lens, meta.context_lens) != (
                    ref.num_decodes, ref.query_lens, ref.context_lens):
                self.mismatches.append((self.checked, "lengths"))
            self.checked += 1
        return super().execute(batch)


_TENSORS = ("slot_mapping", "query_start_loc", "seq_lens", "block_tables")


@pytest.fixture
def one_thread():
    """The reference builds many tiny tensors; on a busy machine torch's thread pool makes each one slow."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("mode,prefix,threshold", [("recompute", True, 0), ("swap", False, 0), ("auto", True, 6),
                                                   ("recompute", False, 5)])
def test_incremental_preparation_matches_reference(mode, prefix, threshold, one_thread):
    rng = random.Random(f"{mode}-{prefix}-{threshold}")  # a str seed is hashed deterministically
    cfg = EngineConfig(enable_prefix_caching=prefix, num_gpu_blocks_override=40, num_cpu_blocks_override=24,
                       block_size=4, max_num_batched_tokens=24, max_num_seqs=7, max_model_len=96,
                       preemption_mode=mode, long_prefill_token_threshold=threshold, device="cpu")
    ex = _CheckingExecutor()
    engine = LLMEngine(cfg, executor=ex, model_max_len=96, eos_token_ids=set())
    bulk_mismatches = _check_bulk_queries(engine)
    system = [rng.randrange(10, 900) for _ in range(9)]  # a shared prefix: cache hits when enabled
    ids = []
    for step in range(260):
        if step < 200 and rng.random() < 0.35:
            own = [rng.randrange(10, 900) for _ in range(rng.randint(1, 20))]
            prompt = (system if rng.random() < 0.5 else []) + own
            params = SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True, n=rng.choice([1, 1, 2, 3]))
            ids.append(engine.add_request({"prompt_token_ids": prompt}, params))
        if ids and rng.random() < 0.04:
            engine.abort_request(ids.pop(rng.randrange(len(ids))))
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    stats = engine.stats()
    assert not ex.mismatches, ex.mismatches[:3]
    assert not bulk_mismatches, bulk_mismatches[:3]
    assert stats["num_errors"] == 0 and ex.checked > 150
    if mode != "recompute" or not prefix:
        assert stats["num_preemptions"] > 0  # the pool is small on purpose: tables were torn down and rebuilt


def _check_bulk_queries(engine) -> list:
    """Before every allocation, compare each bulk query with its per-request definition; return the misses."""
    sched, kv, misses = engine.scheduler, engine.kv, []
    allocate = sched.allocate

    def checked_allocate(batch):
        needing = {id(s) for s in kv.seqs_needing_blocks(batch.seqs)}
        for s in batch.seqs:
            slow = kv.num_new_blocks(s.request, s.num_tokens) > 0 or kv._last_block_is_shared(s.request)
            if (id(s) in needing) != slow:
                misses.append(("seqs_needing_blocks", s.request.request_id, slow))
        if sched._demand(sched.running) != sum(sched._chunk_cap(r) for r in sched.running):
            misses.append(("_demand", len(sched.running)))
        if kv.num_new_blocks_all(sched.running) != sum(
                kv.num_new_blocks(r, r.num_uncomputed_tokens) for r in sched.running):
            misses.append(("num_new_blocks_all", len(sched.running)))
        return allocate(batch)

    sched.allocate = checked_allocate
    return misses


def test_split_decodes_agrees_with_is_decode():
    rng = random.Random(0)
    reqs = []
    for i in range(300):
        r = Request(str(i), list(range(rng.randint(1, 9))), SamplingParams(), 0.0)
        r.output_token_ids = [7] * rng.randint(0, 4)
        r.num_computed_tokens = rng.randint(0, len(r.prompt_token_ids) + len(r.output_token_ids))
        reqs.append(r)
    decodes, others = Request.split_decodes(reqs)
    assert decodes == [r for r in reqs if r.is_decode] and others == [r for r in reqs if not r.is_decode]
    assert decodes and others
