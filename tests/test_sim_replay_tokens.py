"""Replay with a prefix cache: the replay writes the recorded tokens, so blocks are shared as they were."""

from __future__ import annotations

from minivllm.bench.replay import decisions
from minivllm.sim.replay import ReplayExecutor
from minivllm.sim.run import SimRequest, drive


def test_a_replay_with_a_prefix_cache_writes_the_recorded_tokens():
    """With a prefix cache, what a block holds decides what is shared: a model gives two equal prompts equal
    outputs, so the second request's first block past its cached prompt is a twin of the first one's, cached
    once and freed when the request ends.  A replay that made up a token per request id cached that block anew
    and held one block more: the step logs differed at the last step (14 free blocks against 13).  Oracle:
    the recorded run, on an executor whose tokens depend only on the sequence so far, as greedy decoding's do."""
    import zlib

    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    class Greedy(SimulatedExecutor):
        def execute(self, batch):
            ids = {s.request.request_id: s.request.all_token_ids for s in batch.seqs}
            return {rid: zlib.crc32(str(ids[rid]).encode()) % 900 + 10 for rid in super().execute(batch)}

    prompt = list(range(100, 124))  # 24 tokens and 24 outputs: the twin block holds both
    reqs = [SimRequest(0, 0.0, "t", prompt, 24), SimRequest(1, 5.0, "t", prompt, 24)]  # the second after the first
    options = dict(num_blocks=16, max_num_seqs=8, enable_prefix_caching=True)
    real = sim_engine(executor=Greedy(), **options)
    rec = drive(real, reqs)
    assert rec.output_token_ids["r0"] == rec.output_token_ids["r1"] and len(rec.output_token_ids["r1"]) == 24
    replay = sim_engine(executor=ReplayExecutor(rec.check_after_step, tokens=rec.output_token_ids), **options)
    drive(replay, reqs)
    assert decisions(replay) == decisions(real)


def test_a_replay_samples_each_request_its_own_recorded_tokens_in_order():
    """The replay's promise (``ReplayExecutor.tokens``): it writes the recorded run's sampled tokens, each
    request its own, at the position its row samples -- recomputed victims included, whose last chunk samples
    the next output, not one again.  The test above cannot tell: its two requests have equal outputs, so a
    replay that wrote a token one position ahead, or another request's token, cached the same twin block.
    Oracle: the recorded outputs themselves; each request's prompt is its own, so its outputs are too."""
    import zlib

    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.executor import SimulatedExecutor

    class Greedy(SimulatedExecutor):
        def execute(self, batch):
            ids = {s.request.request_id: s.request.all_token_ids for s in batch.seqs}
            return {rid: zlib.crc32(str(ids[rid]).encode()) % 900 + 10 for rid in super().execute(batch)}

    reqs = [SimRequest(k, 0.002 * k, "t", list(range(100 + 7 * k, 112 + 7 * k)), 12 + k) for k in range(6)]
    options = dict(num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=32, enable_prefix_caching=True)
    real = sim_engine(executor=Greedy(), **options)
    rec = drive(real, reqs)
    assert real.scheduler.stats.num_recompute_preemptions > 0  # victims recomputed: the position rule is tested
    assert len({tuple(v) for v in rec.output_token_ids.values()}) == len(reqs)  # every request's own outputs
    replay = sim_engine(executor=ReplayExecutor.from_record(rec), **options)
    assert drive(replay, reqs).output_token_ids == rec.output_token_ids
    assert decisions(replay) == decisions(real)
