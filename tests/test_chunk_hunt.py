"""The batch rules as documented (module docstring of ``minivllm.sched.scheduler``, lab 4's exercise text and
quiz), replayed by a brute-force oracle and compared step by step with the engine's step log.

Why a second model of the rules: the invariant tests check that no step passes its budget or leaks a block, not
*which* tokens each request gets.  The oracle below reads the rules literally -- FCFS admission while a seat is
free and the running requests' next chunks leave budget (with chunking off, the whole prefill must fit), decodes
first in running order, then prefill chunks of at most ``long_prefill_token_threshold`` tokens, a prefix-cache hit
(whole blocks of ``prompt[:-1]``) shortening the prefill -- and simulates small workloads with enough KV that
nothing is preempted.
"""

from __future__ import annotations

import random

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.sim.executor import SimulatedExecutor


class OracleRequest:
    """The oracle's own view of a request: how many of its tokens are computed and how many it has sampled."""

    def __init__(self, rid, prompt, max_tokens):
        self.rid = rid
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.num_computed = 0
        self.num_output = 0
        # Full prompt blocks this request has put into the prefix cache; -1 once it met a block another
        # request had already cached, after which it inserts no more.
        self.inserted_blocks = 0

    @property
    def num_tokens(self):
        return len(self.prompt) + self.num_output

    @property
    def num_uncomputed(self):
        return self.num_tokens - self.num_computed

    @property
    def is_decode(self):
        return self.num_computed >= len(self.prompt) and self.num_uncomputed == 1


def oracle(script, budget, max_seqs, threshold, chunked, *, max_steps=500, block_size=4, prefix=False):
    """Replay ``script`` under the documented rules and return the batch of every step.

    ``script`` maps a step number to the ``(rid, prompt, max_tokens)`` requests added before that step.  Each
    step's batch is a tuple of ``(rid, first position, number of tokens)`` rows in batch order -- the shape of the
    engine's ``StepRecord.seqs`` -- so the two logs compare with ``==``.  Trailing empty steps are dropped, so the
    comparison does not depend on how many idle steps either side runs before it notices it is done.
    """
    # With chunking on, every seated request takes at least one token, so more seats than budget tokens
    # could never all be served.
    seats = min(max_seqs, budget) if chunked else max_seqs

    def chunk_cap(request):
        """Most tokens ``request`` may take in one step: the rest of it, cut to ``threshold`` if one is set."""
        if threshold:
            return min(request.num_uncomputed, threshold)
        return request.num_uncomputed

    waiting = []
    running = []
    log = []
    cache = set()  # prefix-cache keys: the tuple of prompt tokens up to the end of each cached block
    for step in range(max_steps):
        for rid, prompt, max_tokens in script.get(step, []):
            waiting.append(OracleRequest(rid, prompt, max_tokens))
        if not waiting and not running and step > max(script):
            break

        # 1. Admit first come, first served: the head of the queue blocks everyone behind it.
        while waiting:
            request = waiting[0]
            if len(running) >= seats:
                break
            budget_left = budget - sum(chunk_cap(other) for other in running)
            if budget_left <= 0:
                break
            if prefix:
                # A hit is whole cached blocks of prompt[:-1]: the last prompt token is always computed.
                hit = 0
                while tuple(request.prompt[:hit + block_size]) in cache and hit + block_size <= len(request.prompt) - 1:
                    hit += block_size
                request.num_computed = hit
                request.inserted_blocks = hit // block_size
            if not chunked and chunk_cap(request) > budget_left:
                request.num_computed = 0
                break
            waiting.pop(0)
            running.append(request)

        # 2. Build the batch: decodes first in running order, then prefill chunks, while the budget lasts.
        budget_left = budget
        decodes = [request for request in running if request.is_decode]
        prefills = [request for request in running if not request.is_decode]
        rows = []
        for request in decodes + prefills:
            if budget_left <= 0:
                break
            num_tokens = min(chunk_cap(request), budget_left)
            if not chunked and num_tokens < request.num_uncomputed:
                continue  # without chunking a prefill runs whole or not at all
            rows.append((request, num_tokens))
            budget_left -= num_tokens

        # 3. Order the rows as the attention backends expect one-token rows first.  The decode rows lead
        # already and keep their running order; among the prefill rows that follow, those of a single token
        # move to the front, each part keeping its scheduling order (a stable sort).
        num_decode_rows = sum(1 for request, _ in rows if request.is_decode)
        decode_rows = rows[:num_decode_rows]
        prefill_rows = rows[num_decode_rows:]
        rows = decode_rows + sorted(prefill_rows, key=lambda row: row[1] != 1)
        log.append(tuple((request.rid, request.num_computed, num_tokens) for request, num_tokens in rows))

        # 4. Run the step: advance each request, cache its newly full prompt blocks, sample where it is caught up.
        for request, num_tokens in rows:
            request.num_computed += num_tokens
            full_blocks = min(request.num_computed, len(request.prompt)) // block_size
            if prefix and request.inserted_blocks >= 0 and full_blocks > request.inserted_blocks:
                keys = [tuple(request.prompt[:(block + 1) * block_size])
                        for block in range(request.inserted_blocks, full_blocks)]
                if any(key in cache for key in keys):
                    request.inserted_blocks = -1
                else:
                    cache.update(keys)
                    request.inserted_blocks = full_blocks
            if request.num_computed == request.num_tokens:
                request.num_output += 1
                if request.num_output == request.max_tokens:
                    running.remove(request)

    while log and not log[-1]:
        log.pop()
    return log


def engine_log(script, budget, max_seqs, threshold, chunked, *, block_size=4, num_blocks=4096, prefix=False,
               max_len=256):
    """Run ``script`` through a real engine on the simulated executor and return the batch of every step.

    The rows are read from the engine's step log, ``(rid, first position, number of tokens)`` in batch order, the
    shape :func:`oracle` returns.  ``num_blocks`` is large enough that nothing is preempted (the oracle models
    no preemption), and ``ignore_eos`` makes every request run to exactly ``max_tokens``.  Trailing empty steps
    are dropped, as the oracle drops them.
    """
    config = EngineConfig(enable_prefix_caching=prefix, num_gpu_blocks_override=num_blocks, block_size=block_size,
                          max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=max_len,
                          enable_chunked_prefill=chunked, long_prefill_token_threshold=threshold, device="cpu")
    engine = LLMEngine(config, executor=SimulatedExecutor(), model_max_len=max_len, eos_token_ids=set())
    for step in range(2000):
        for rid, prompt, max_tokens in script.get(step, []):
            engine.add_request({"prompt_token_ids": list(prompt)},
                               SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid)
        if not engine.has_unfinished_requests() and step > max(script):
            break
        engine.step()
    log = [tuple(record.seqs) for record in engine.step_log]
    while log and not log[-1]:
        log.pop()
    return log


@pytest.mark.parametrize("seed", range(120))
def test_every_step_gives_each_request_the_tokens_the_documented_rules_give(seed):
    """A random small workload per seed: chunking on or off, tiny budgets and thresholds, few seats, and (with the
    prefix cache) prompts of one repeated token, so that later requests hit blocks earlier ones cached."""
    rng = random.Random(seed)
    chunked = rng.random() < 0.7
    budget = rng.choice([1, 2, 3, 4, 5, 8, 16, 32, 64]) if chunked else 8
    max_len = 64 if chunked else 8
    threshold = rng.choice([0, 0, 1, 2, 3, 7, 100]) if chunked else 0
    max_seqs = rng.choice([1, 2, 3, 4, 8])
    prefix = rng.random() < 0.3
    script = {}
    for i in range(rng.randint(1, 7)):
        prompt_len = rng.randint(1, max_len - 4)
        if prefix and rng.random() < 0.5:
            prompt = [5] * prompt_len
        else:
            prompt = [rng.randint(1, 900) for _ in range(prompt_len)]
        arrival = rng.randint(0, 10)
        max_tokens = rng.randint(1, min(4, max_len - prompt_len))
        script.setdefault(arrival, []).append((f"r{i}", prompt, max_tokens))
    rules = dict(budget=budget, max_seqs=max_seqs, threshold=threshold, chunked=chunked, prefix=prefix)
    assert engine_log(script, **rules, max_len=max_len) == oracle(script, **rules)


def test_the_quiz_long_prompt_beside_three_decodes_samples_in_its_fourth_step():
    """Lab 4's quiz: budget 256, three decodes, a 1,000-token prompt: 253 + 253 + 253 + 241."""
    script = {0: [(f"c{i}", [20 + i] * 8, 50) for i in range(3)], 1: [("L", [11] * 1000, 1)]}
    rules = dict(budget=256, max_seqs=8, threshold=0, chunked=True, block_size=16)
    log = engine_log(script, **rules, max_len=1024)
    assert [num_tokens for batch in log for rid, _, num_tokens in batch if rid == "L"] == [253, 253, 253, 241]
    assert log == oracle(script, **rules)


def test_a_short_prompt_starts_beside_a_long_prefill_only_with_a_threshold():
    """Lab 4's quiz: without a per-request cap the long prefill takes every step's budget until its last chunk."""
    script = {0: [("L", [1] * 2048, 1), ("d", [5] * 4, 30)], 2: [("c", [2] * 20, 1)]}
    first_step_of_c = {}
    for threshold in (0, 256):
        rules = dict(budget=512, max_seqs=8, threshold=threshold, chunked=True, block_size=16)
        log = engine_log(script, **rules, max_len=2100)
        assert log == oracle(script, **rules)
        first_step_of_c[threshold] = next(step for step, batch in enumerate(log)
                                          if any(rid == "c" for rid, _, _ in batch))
    assert first_step_of_c[256] == 2
    assert first_step_of_c[0] > 2
