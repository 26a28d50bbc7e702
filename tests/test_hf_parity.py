"""The engine must compute exactly what HF transformers computes, on the real default model."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.kv_cache import KVCache
from minivllm.kv.kv_cache_manager import KVCacheManager
from minivllm.model.runner import ModelRunner
from minivllm.request import Request
from minivllm.sched.scheduler import ScheduledBatch, ScheduledSeq

from conftest import hf_greedy  # noqa: E402  (tests/ is on sys.path)

pytestmark = pytest.mark.slow
GREEDY_32 = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_32, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_batch_matches_hf(default_llm, parity_prompts, hf_reference_tokens):
    assert _generate(default_llm, parity_prompts) == hf_reference_tokens
    assert default_llm.engine.pool.num_free == default_llm.engine.pool.num_blocks


def test_greedy_chunked_prefill_matches_hf(parity_prompts, hf_reference_tokens):
    llm = LLM(dtype="float32", max_num_batched_tokens=64, max_num_seqs=8, max_model_len=512)
    assert _generate(llm, parity_prompts) == hf_reference_tokens
    steps = llm.engine.step_log
    assert max(s["num_tokens"] for s in steps) <= 64
    # the 400-token prompt really was split over several steps
    assert sum(1 for s in steps for (_, start, n) in s["seqs"] if n > 1 and start > 0) > 0


def test_greedy_under_preemption_matches_hf(parity_prompts, hf_reference_tokens):
    # 40 blocks of 16 = 640 tokens, against ~1,700 prompt + 256 output tokens in flight; the
    # simulated executor shows this exact workload preempts twice (scheduling ignores token values)
    llm = LLM(dtype="float32", num_gpu_blocks_override=40, max_model_len=512, max_num_batched_tokens=512)
    assert _generate(llm, parity_prompts) == hf_reference_tokens
    assert llm.engine.scheduler.stats.num_preemptions > 0
    assert llm.engine.pool.num_free == 40


def test_greedy_under_swap_preemption_matches_hf(parity_prompts, hf_reference_tokens):
    # the same tight pool as above, but victims' KV goes to a host tier and comes back by copy
    llm = LLM(dtype="float32", num_gpu_blocks_override=40, max_model_len=512, max_num_batched_tokens=512,
              preemption_mode="swap", num_cpu_blocks_override=64)
    assert _generate(llm, parity_prompts) == hf_reference_tokens
    st = llm.engine.stats()
    assert st["num_swap_preemptions"] > 0, "the pool should force a swap"
    assert st["swapped_out_blocks"] == st["swapped_in_blocks"] > 0 and st["recomputed_tokens"] == 0
    assert llm.engine.pool.num_free == 40 and st["cpu_blocks_used"] == 0


def test_reject_mode_rejects_some_and_serves_the_rest_exactly(parity_prompts, hf_reference_tokens):
    llm = LLM(dtype="float32", num_gpu_blocks_override=40, max_model_len=512, max_num_batched_tokens=512,
              preemption_mode="reject")
    outs = llm.generate([{"prompt_token_ids": p} for p in parity_prompts], GREEDY_32, use_tqdm=False)
    served = 0
    for out, ref in zip(outs, hf_reference_tokens):
        done = out.outputs[0]
        if done.finish_reason == "rejected":
            assert done.token_ids == [] and out.retry_after_s > 0
        else:
            served += 1
            assert done.token_ids == ref
    assert 0 < served < len(parity_prompts)
    assert llm.engine.stats()["num_preemptions"] == 0
    assert llm.engine.pool.num_free == 40


def test_teacher_forced_logits_match_hf(default_llm, hf_model, parity_prompts):
    """Logits of every position, computed in two chunks through the paged cache, vs one HF forward."""
    prompt = parity_prompts[5]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([prompt])).logits[0].float()
    runner: ModelRunner = default_llm.engine.model_runner
    args = runner.model.args
    cache = KVCache(args.num_layers, 40, 16, args.num_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    saved, runner.kv_cache = runner.kv_cache, cache
    try:
        kv = KVCacheManager(BlockPool(40), 16)
        req = Request("tf", list(prompt), GREEDY_32, arrival_time=0.0)
        got = []
        for chunk in (101, len(prompt) - 101):  # a chunk boundary in the middle of a block
            assert kv.allocate_slots(req, chunk)
            batch = ScheduledBatch([ScheduledSeq(req, chunk, req.num_computed_tokens)])
            got.append(runner.logits_for(batch)["tf"])
            req.num_computed_tokens += chunk
    finally:
        runner.kv_cache = saved
    got = torch.cat(got)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"


def test_torch_reference_backend_matches_hf(parity_prompts, hf_reference_tokens):
    """On a CPU, "auto" runs decode through the C kernel; the torch oracle path must still match HF too."""
    llm = LLM(dtype="float32", attention_backend="torch", max_model_len=512)
    assert llm.engine.model_runner.model.backend.name == "torch"
    assert _generate(llm, parity_prompts) == hf_reference_tokens


def test_padded_decode_graph_path_matches_hf(parity_prompts, hf_reference_tokens):
    """The CUDA-graph decode path, run eagerly on the CPU: static buffers, batches padded up to 1/2/4/8 rows.

    Requests stop after 8..32 tokens, so the decode batch shrinks 8 -> 1 and most steps
    run padded (7, 6, 5 and 3 rows in a size-8 or size-4 slot).  Padding rows copy row 0,
    so the outputs must still be HF's, token for token.
    """
    llm = LLM(dtype="float32", max_num_seqs=8, max_model_len=512)
    runner = llm.engine.model_runner
    runner.graphs = runner.decode_graphs(8, 512, capture=False)
    assert runner.graphs.sizes == (1, 2, 4, 8)
    calls = []
    run = runner.graphs.run
    runner.graphs.run = lambda ids, pos, meta: calls.append(meta.num_seqs) or run(ids, pos, meta)
    lengths = [8 + 3 * i for i in range(len(parity_prompts))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in parity_prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref[:n] for ref, n in zip(hf_reference_tokens, lengths)]
    assert {7, 6, 5, 3} <= set(calls), f"padded sizes were not exercised: {sorted(set(calls))}"
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_greedy_matches_hf_when_a_step_fails_before_its_swap_in_ran_for_a_request_without_a_row(
        parity_prompts, hf_model):
    """A step fails before it performs its block moves -- among them the copy in of request b, which a batch
    builder (a supported seam) gave no row that step.  b must not go on attending device blocks that never
    received its KV: recomputed, it still decodes exactly HF's greedy tokens, and every block comes back."""
    from minivllm import EngineConfig, LLMEngine
    from minivllm.request import RequestStatus

    held: set[str] = set()

    def holds_back(running, budget, threshold):  # the scheduler's order, whole chunks, never a request in ``held``
        rows = []
        for r in running:
            n = min(r.num_uncomputed_tokens, budget, threshold or budget)
            if r.request_id not in held and n > 0:
                rows.append((r, n))
                budget -= n
        return rows

    class FailsAtTheStepThatSwapsBIn:
        """The model runner, except that the step carrying b's copy in fails before it runs any copy."""

        def __init__(self, inner):
            self.inner, self.failed_rows = inner, None

        def execute(self, batch):
            swapped_in = {gpu for _, gpu in batch.moves.swap_in}
            if self.failed_rows is None and swapped_in and swapped_in <= set(b.block_ids):
                self.failed_rows = [s.request.request_id for s in batch.seqs]
                raise RuntimeError("device copy failed")
            return self.inner.execute(batch)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    # 6 blocks of 16: a (20 + 32 tokens) and b (45 + 32) outgrow it as they decode, and the newer, b, is swapped out
    cfg = EngineConfig(dtype="float32", num_gpu_blocks_override=6, num_cpu_blocks_override=16, max_model_len=96,
                       max_num_batched_tokens=96, preemption_mode="swap", device="cpu")
    engine = LLMEngine(cfg, batch_builder=holds_back, executor_wrapper=FailsAtTheStepThatSwapsBIn)
    a, b_prompt, c = parity_prompts[0], parity_prompts[1], parity_prompts[0][:10]
    engine.add_request({"prompt_token_ids": a}, GREEDY_32, "a")
    engine.add_request({"prompt_token_ids": b_prompt}, GREEDY_32, "b")
    b = engine.requests["b"]
    finals = {}
    while b.status is not RequestStatus.SWAPPED:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert len(engine.step_log) < 100, "the workload must swap b out"
    held.add("b")
    engine.add_request({"prompt_token_ids": c}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "c")
    while engine.executor.failed_rows is None:
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert len(engine.step_log) < 100, "b must be swapped back in"
    assert engine.executor.failed_rows and "b" not in engine.executor.failed_rows
    held.clear()
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
        assert len(engine.step_log) < 300
    assert finals["b"].outputs[0].token_ids == hf_greedy(hf_model, b_prompt, 32)
    for rid, prompt, n in (("a", a, 32), ("c", c, 4)):  # the failed rows end "error"; the others match HF too
        done = finals[rid].outputs[0]
        want = ("error",) if rid in engine.executor.failed_rows else ("length", hf_greedy(hf_model, prompt, n))
        assert (done.finish_reason, done.token_ids)[:len(want)] == want
    assert engine.pool.num_free == 6 and engine.kv.cpu_pool.num_free == 16
