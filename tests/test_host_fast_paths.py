"""The host-overhead shortcuts against their plain definitions, step by step on random workloads.

* the executor's incremental batch preparation (``BatchPreparer``) against the stateless reference
  (``build_attention_metadata``), on workloads that change block tables in every way the memory
  manager can: new blocks, copy-on-write (``n > 1``), prefix-cache hits, recompute and swap
  preemption, aborts, chunked prefills;
* the scheduler's and KV manager's bulk loops (``seqs_needing_blocks``, ``num_new_blocks_all``,
  ``_demand``, ``Request.split_decodes``) against the per-request methods they inline, and an engine
  growing full tables in one loop (``grow_full_tables``) against one growing every table by ``allocate_slots``;
* the output processor's ``final_only`` shortcut against the full ``cumulative`` path, the single-tenant
  counters against the per-tenant loop, and the prefix cache's kept evictable count against a walk of
  the cache (also after the pool is replaced).

No model: the simulated executor runs the real scheduler.
"""

from __future__ import annotations

import random

import pytest
import torch

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.kv.block_pool import BlockPool
from minivllm.model.runner import BatchPreparer, build_attention_metadata
from minivllm.request import Request
from minivllm.sched.output import ScheduledSeq
from minivllm.sim import SimulatedExecutor
from tests.invariants import claimed_blocks, steps


class _CheckingExecutor(SimulatedExecutor):
    """Runs both preparations on every real batch and records any disagreement, then simulates the step.

    (Records rather than raises: the engine turns an executor exception into per-request errors.)
    """

    def __init__(self, stage: bool = False):
        super().__init__()
        # tiny initial buffers, so row reuse and both kinds of growth happen within a few steps;
        # stage=True takes the GPU's path (one staging buffer per dtype, one copy), here on the CPU
        self.prep = BatchPreparer(4, "cpu", rows=3, width=2, stage=stage)
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


@pytest.mark.parametrize("mode,prefix,threshold,stage", [("recompute", True, 0, False), ("swap", False, 0, False),
                                                         ("auto", True, 6, False), ("recompute", False, 5, False),
                                                         ("recompute", True, 0, True), ("swap", False, 0, True)])
def test_incremental_preparation_matches_reference(mode, prefix, threshold, stage, one_thread):
    rng = random.Random(f"{mode}-{prefix}-{threshold}")  # a str seed is hashed deterministically
    cfg = EngineConfig(enable_prefix_caching=prefix, num_gpu_blocks_override=40, num_cpu_blocks_override=24,
                       block_size=4, max_num_batched_tokens=24, max_num_seqs=7, max_model_len=96,
                       preemption_mode=mode, long_prefill_token_threshold=threshold, device="cpu")
    ex = _CheckingExecutor(stage)
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
    for _ in steps(engine):
        pass
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
        if kv.num_new_blocks_all(sched.running) != claimed_blocks(kv, sched.running):  # (brute force, copies included)
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
    rows, others_too = Request.split_decodes(reqs, as_rows=ScheduledSeq)
    assert rows == [ScheduledSeq(r, 1, r.num_computed_tokens, True) for r in decodes] and others_too == others


@pytest.mark.parametrize("mode,prefix", [("recompute", True), ("swap", False), ("recompute", False)])
def test_grow_full_tables_hands_out_what_allocate_slots_would(mode, prefix):
    """The scheduler first gives full tables their new blocks in one loop (``grow_full_tables``); with that
    shortcut switched off every table grows through ``allocate_slots``.  The two engines must agree step by
    step: the same block tables, the same preemptions and the same step log (a small pool, so the free list
    runs dry and the shortcut hands over to the per-sequence path mid-batch)."""
    def run(shortcut: bool) -> list:
        rng = random.Random(f"grow-{mode}-{prefix}")
        cfg = EngineConfig(enable_prefix_caching=prefix, num_gpu_blocks_override=36, num_cpu_blocks_override=24,
                           block_size=4, max_num_batched_tokens=24, max_num_seqs=8, max_model_len=96,
                           preemption_mode=mode, device="cpu")
        engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=96, eos_token_ids=set())
        if not shortcut:
            engine.kv.grow_full_tables = lambda seqs: seqs
        seen = []
        for step in range(220):
            if step < 160 and rng.random() < 0.4:
                prompt = [rng.randrange(10, 900) for _ in range(rng.randint(1, 16))]
                engine.add_request({"prompt_token_ids": prompt},
                                   SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True, n=rng.choice([1, 2])))
            engine.step()
            seen.append(sorted((r.request_id, tuple(r.block_ids)) for r in engine.scheduler.running))
        return seen + [list(engine.step_log)], engine.stats()["num_preemptions"]

    (fast, preempted), (plain, _) = run(True), run(False)
    assert fast == plain
    assert preempted > 0  # the pool ran dry: the shortcut stopped and the per-sequence path took over


class _ToyTokenizer:
    """Letters for ids, a few ids that decode to nothing or to an incomplete character: enough for stops."""

    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i < 5 else "\ufffd" if i % 11 == 0 else chr(97 + i % 26) for i in ids)


def _final_outputs(kind: str, seed: int) -> dict:
    """Run one random workload with every request's ``output_kind`` set to ``kind``; the last output per id."""
    rng = random.Random(seed)
    cfg = EngineConfig(num_gpu_blocks_override=60, block_size=4, max_num_batched_tokens=32, max_num_seqs=6,
                       max_model_len=96, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(vocab_size=60), model_max_len=96, tokenizer=_ToyTokenizer(),
                       eos_token_ids={2, 3})
    last: dict = {}
    for step in range(150):
        if step < 100 and rng.random() < 0.4:
            params = SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.3, output_kind=kind,
                                    stop=rng.choice([None, None, ["ab"]]), stop_token_ids=rng.choice([None, [17]]),
                                    n=rng.choice([1, 1, 2]))
            prompt = [rng.randrange(5, 60) for _ in range(rng.randint(1, 12))]
            engine.add_request({"prompt_token_ids": prompt}, params, request_id=f"r{step}")
        for out in engine.step():
            last[out.request_id] = out
    for outs in steps(engine):
        for out in outs:
            last[out.request_id] = out
    return {rid: (out.finished, [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs])
            for rid, out in last.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_final_only_fast_path_ends_like_cumulative(seed):
    """``final_only`` skips steps that stop nothing (no output, no detokenization until the end); its one output
    must equal the last ``cumulative`` one, which took the full path every step."""
    final, cumulative = _final_outputs("final_only", seed), _final_outputs("cumulative", seed)
    assert final == cumulative
    assert len(final) > 20 and any(f[1][0][3] == "stop" for f in final.values())  # stops were exercised


def test_single_tenant_counters_match_the_per_tenant_loop():
    """With one tenant, ``Scheduler.observe`` counts by two sums over the batch; the general per-tenant loop
    (forced by naming a second tenant that never sends anything) must count the same."""
    def run(force_general: bool) -> dict:
        rng = random.Random(7)
        cfg = EngineConfig(num_gpu_blocks_override=30, block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
                           max_model_len=96, long_prefill_token_threshold=5, device="cpu")
        engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=96, eos_token_ids=set())
        if force_general:
            engine.scheduler._tenants_added.add("nobody")
        for step in range(120):
            if step < 80 and rng.random() < 0.5:
                engine.add_request({"prompt_token_ids": [rng.randrange(10, 900) for _ in range(rng.randint(1, 30))]},
                                   SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True), tenant="alice")
            engine.step()
        return {name: (ts.prompt_tokens, ts.output_tokens) for name, ts in engine.scheduler.tenant_stats.items()}

    fast, general = run(False), run(True)
    assert fast == general and fast["alice"][1] > 0


class _CountingPool(BlockPool):
    """A pool subclass with its own ``incref`` (like a learner's): it cannot promise sharing reports."""

    def incref(self, block_id: int) -> None:
        super().incref(block_id)


@pytest.mark.parametrize("cache", ["radix", "hash"])
@pytest.mark.parametrize("pool_cls", [None, BlockPool, _CountingPool])
def test_evictable_count_follows_a_replaced_pool(cache, pool_cls):
    """The prefix cache keeps its evictable count from the pool's reports; after the pool is replaced (lab 2
    installs a learner's) it follows the new pool, or recounts when the pool cannot report.  Checked every
    step against a walk of the cache's own structure (``evictable_by_walk``)."""
    from test_scheduler_invariants import evictable_by_walk  # tests/ is on sys.path

    rng = random.Random(f"{cache}-{pool_cls}")
    cfg = EngineConfig(enable_prefix_caching=True, prefix_cache=cache, num_gpu_blocks_override=30, block_size=4,
                       max_num_batched_tokens=24, max_num_seqs=5, max_model_len=96, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=96, eos_token_ids=set())
    if pool_cls is not None:
        engine.kv.replace_pool(pool_cls(30))
    system = [rng.randrange(10, 900) for _ in range(10)]
    checked = 0
    for step in range(200):
        if step < 150 and rng.random() < 0.4:
            prompt = system[: rng.randint(0, 10)] + [rng.randrange(10, 900) for _ in range(rng.randint(1, 12))]
            engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=rng.randint(1, 25), ignore_eos=True, n=rng.choice([1, 2])))
        engine.step()
        assert engine.prefix_cache.num_evictable_blocks() == evictable_by_walk(engine.prefix_cache, engine.pool)
        checked += engine.prefix_cache.num_cached_blocks > engine.prefix_cache.num_evictable_blocks()
    assert checked > 20  # locked blocks were there to count
