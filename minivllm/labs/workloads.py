"""Seeded workloads and small engine runs shared by the labs, the figures and the tests.

Why here?  A lab's claim ("paging wastes under 4%", "a shared system prompt
hits about 85%") is only worth teaching if the same numbers come out in the
notebook, the README figure and the quiz answer.  Putting the workload and the
measurement in one function lets all three call it, and lets a test recompute
a quiz answer so it cannot drift from the engine.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Sequence

from minivllm.kv.block_pool import BlockPool
from minivllm.arrival import made_up_ids
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.interfaces import Executor
from minivllm.kv.kv_cache_manager import KVCacheManager, blocks_for
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor


# -- simulated engine runs ---------------------------------------------------------

# The simulated GPU of labs 1, 4 and 5: 15 ms a step plus 0.02 ms a token in it, so a batch of decodes costs
# little more than one (a GPU's shape; the CPU's steps grow with the batch instead).  One definition, so that
# the three labs' numbers come from one cost.
GPU_LIKE = dict(fixed_overhead_s=0.015, per_token_s=0.00002, per_context_token_s=0.0)



def sim_engine(*, num_blocks: int = 256, block_size: int = 16, max_num_seqs: int = 8,
               max_num_batched_tokens: int = 512, model_max_len: int = 2048,
               admission_policy: Any = None, preemption_policy: Any = None,
               executor: Executor | None = None, preemption_cost_model: Any = None,
               batch_builder: Any = None, **options: Any) -> LLMEngine:
    """A real :class:`LLMEngine` whose forward pass is a virtual-clock cost model.

    ``executor`` is any :class:`~minivllm.interfaces.Executor` (the fleet passes a roofline one); the default
    is the linear :class:`SimulatedExecutor`."""
    options.setdefault("max_model_len", min(model_max_len, num_blocks * block_size))
    config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          num_gpu_blocks_override=num_blocks, device="cpu", **options)
    return LLMEngine(config, executor=executor or SimulatedExecutor(), model_max_len=model_max_len,
                     admission_policy=admission_policy, preemption_policy=preemption_policy,
                     preemption_cost_model=preemption_cost_model, batch_builder=batch_builder, eos_token_ids=set())


def random_requests(n: int, *, seed: int = 0, prompt_range=(16, 256), output_range=(8, 128),
                    vocab: int = 900) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs with uniform lengths, reproducible."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(*prompt_range)
        out.append((made_up_ids(rng, p, (10, vocab)), rng.randint(*output_range)))
    return out


def run_engine(engine: LLMEngine, requests: Sequence[tuple[list[int], int]], *, max_steps: int = 100_000):
    """Add every request, step to the end; returns ``{request_id: final RequestOutput}``.

    Stops after ``max_steps`` (a policy that never admits anything would loop
    forever); the caller sees the unfinished ones missing from the result.
    """
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           request_id=f"r{i}")
    return drain(engine, max_steps=max_steps)


def drain(engine: LLMEngine, *, max_steps: int = 100_000, each: Callable[[LLMEngine], object] | None = None) -> dict:
    """Step ``engine`` until nothing is left or ``max_steps`` have run, calling ``each(engine)`` after every
    step (the tests recount every block there); returns ``{request_id: final RequestOutput}``."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if each is not None:
            each(engine)
    return finals


def throughput(finals: dict, engine: LLMEngine) -> float:
    """Output tokens per second of engine clock over the whole run."""
    if not finals:
        raise ValueError("throughput needs at least one finished request in finals (none finished: "
                         "did the admission policy never admit anything?)")
    tokens = sum(len(o.outputs[0].token_ids) for o in finals.values())
    start = min(o.metrics.arrival_time for o in finals.values())
    end = max(o.metrics.finished_time for o in finals.values())
    return tokens / (end - start)


# -- KV memory accounting (lab 2) ----------------------------------------------------


def lengths_sample(n: int = 2000, *, seed: int = 0, max_len: int = 2048) -> list[int]:
    """Sequence lengths (prompt + output) with a long tail, like chat traffic.

    Log-normal with median ~330 tokens, clipped to ``max_len``: most requests are
    short, a few are long -- the shape that makes max-length reservation wasteful.
    """
    rng = random.Random(seed)
    return [max(1, min(max_len, int(rng.lognormvariate(5.8, 0.8)))) for _ in range(n)]


def reserved_slots_contiguous(seq_lens: Sequence[int], max_len: int) -> int:
    """Slots reserved when every request gets a contiguous max-length region up front."""
    return len(seq_lens) * max_len


def reserved_slots_paged(seq_lens: Sequence[int], block_size: int) -> int:
    """Slots reserved with paging: whole blocks, only as many as each sequence needs."""
    return sum(blocks_for(n, block_size) * block_size for n in seq_lens)


def utilization(seq_lens: Sequence[int], reserved: int) -> float:
    """Fraction of reserved KV slots that hold a real token."""
    if reserved <= 0:
        raise ValueError(f"utilization needs reserved > 0 slots, got {reserved}")
    return sum(seq_lens) / reserved


# -- prefix-cache workloads (lab 3) ----------------------------------------------------


def _tokens(rng: random.Random, n: int, vocab: int = 900) -> list[int]:
    return made_up_ids(rng, n, (10, vocab))


def system_prompt_workload(n: int = 40, *, seed: int = 0, system_len: int = 256,
                           user_range=(8, 64)) -> list[list[int]]:
    """Every request = one shared system prompt + a short user question."""
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    return [system + _tokens(rng, rng.randint(*user_range)) for _ in range(n)]


def multi_turn_workload(n_conversations: int = 8, turns: int = 5, *, seed: int = 0,
                        turn_range=(24, 80)) -> list[list[int]]:
    """Chats: turn k's prompt is the whole history so far + the new user message.

    Requests are interleaved across conversations (round robin), as a server sees them.
    """
    rng = random.Random(seed)
    histories = [_tokens(rng, rng.randint(*turn_range)) for _ in range(n_conversations)]
    requests = []
    for _ in range(turns):
        for c in range(n_conversations):
            requests.append(list(histories[c]))
            histories[c] += _tokens(rng, rng.randint(*turn_range))  # answer + next question
    return requests


def shared_system_chats(n_conversations: int = 3, turns: int = 3, *, seed: int = 2,
                        system_len: int = 48) -> list[list[int]]:
    """Multi-turn chats that all start with one system prompt: the tree branches after it."""
    rng = random.Random(seed + 1000)
    system = _tokens(rng, system_len)
    return [system + p for p in multi_turn_workload(n_conversations, turns, seed=seed)]


def rag_workload(n: int = 40, *, seed: int = 0, num_docs: int = 20, doc_len: int = 128,
                 docs_per_request: int = 3, instr_len: int = 32) -> list[list[int]]:
    """Instruction + retrieved documents (popular ones repeat, in varying order) + a question of 8-32 tokens.

    Only the instruction and a leading run of the *same documents in the same
    order* is a shared prefix: RAG hits less than a system prompt does.
    """
    if not 0 <= docs_per_request <= num_docs:  # distinct documents: more than there are would never be drawn
        raise ValueError(f"rag_workload needs 0 <= docs_per_request <= num_docs, got docs_per_request={docs_per_request}, num_docs={num_docs}")
    rng = random.Random(seed)
    instr = _tokens(rng, instr_len)
    docs = [_tokens(rng, doc_len) for _ in range(num_docs)]
    weights = [1.0 / (i + 1) for i in range(num_docs)]  # Zipf-like popularity
    requests = []
    for _ in range(n):
        chosen: list[int] = []
        while len(chosen) < docs_per_request:
            d = rng.choices(range(num_docs), weights)[0]
            if d not in chosen:
                chosen.append(d)
        prompt = list(instr)
        for d in chosen:
            prompt += docs[d]
        requests.append(prompt + _tokens(rng, rng.randint(8, 32)))
    return requests


def agent_workload(n_agents: int = 4, calls: int = 6, *, seed: int = 0, system_len: int = 384,
                   task_range=(16, 48), call_range=(8, 32), result_range=(32, 160)) -> list[list[int]]:
    """Agents: each task makes ``calls`` sequential model calls; call k's prompt is the previous call's prompt +
    the model's tool call + the tool's result.  Every agent shares one system prompt (instructions and tool
    definitions), and each starts from its own task.

    This is the seed's "many sequential calls": unlike a chat, whose user types between turns, an agent calls
    again as soon as its tool returns, so nearly the whole prompt was sent a moment ago and is still cached.
    Calls are interleaved across agents (round robin), as a server sees several agents at once.
    """
    if n_agents < 1 or calls < 1:
        raise ValueError(f"agent_workload needs n_agents >= 1 and calls >= 1, got n_agents={n_agents}, calls={calls}")
    rng = random.Random(seed)
    system = _tokens(rng, system_len)
    histories = [system + _tokens(rng, rng.randint(*task_range)) for _ in range(n_agents)]
    requests = []
    for _ in range(calls):
        for a in range(n_agents):
            requests.append(list(histories[a]))
            histories[a] += _tokens(rng, rng.randint(*call_range)) + _tokens(rng, rng.randint(*result_range))
    return requests


def replay_prefix_cache(cache: Any, pool: BlockPool, prompts: Sequence[list[int]], *,
                        namespaces: Sequence[str] | None = None, block_size: int = 16,
                        prefill_cost: Callable[[int], float] | None = None) -> list[dict]:
    """Admit each prompt the way the engine does with prefix caching, one at a time.

    For each prompt: look up ``prompt[:-1]`` (the last token is always
    recomputed, it produces the logits), take a reference on every hit block,
    allocate the rest, "prefill", insert the full blocks, then finish (drop the
    request's references; cached blocks stay with the cache).  Returns one
    record per request: hit tokens, prompt tokens and a modelled TTFT.
    """
    prefill_cost = prefill_cost or (lambda uncached: 0.010 + 0.0004 * uncached)
    replay = PrefixReplay(cache, pool, prompts, block_size, namespaces)
    records = []
    while replay.has_unfinished_requests():
        rec = replay.step()
        replay.finish()  # the request leaves at once; its full blocks stay cached
        records.append({"prompt_tokens": rec["prompt_tokens"], "hit_tokens": rec["hit_tokens"],
                        "ttft": prefill_cost(rec["prompt_tokens"] - rec["hit_tokens"])})
    return records


def hit_rate(records: Sequence[dict]) -> float:
    """Hit tokens over looked-up tokens (prompt minus its last token, the tokens a lookup can match).

    Not quite the engine's ``prefix_cache_hit_rate``, which (like vLLM's counters) divides by the whole
    prompt: on the default system-prompt workload 84.93% here against 84.65% there.
    """
    looked_up = sum(r["prompt_tokens"] - 1 for r in records)
    if looked_up <= 0:
        raise ValueError("hit_rate needs records with at least one looked-up token (prompts longer than 1 token)")
    return sum(r["hit_tokens"] for r in records) / looked_up


class PrefixReplay:
    """Feed prompts to a prefix cache one per :meth:`step`, like an engine admitting them.

    The most recent request keeps its blocks until the next step, so a radix
    tree view shows its path *locked* (a running request reads those blocks).
    Has the two methods :class:`~minivllm.labs.widgets.Stepper` needs.
    """

    def __init__(self, cache: Any, pool: BlockPool, prompts: Sequence[list[int]], block_size: int = 16,
                 namespaces: Sequence[str] | None = None) -> None:
        self.cache, self.pool, self.prompts = cache, pool, list(prompts)
        # one namespace per prompt: a short list would fail with an IndexError halfway, after it had filled the cache
        if namespaces is not None and len(namespaces) != len(self.prompts):
            raise ValueError(f"PrefixReplay needs one namespace per prompt, got {len(namespaces)} namespaces for "
                             f"{len(self.prompts)} prompts")
        self.block_size, self.namespaces = block_size, namespaces
        self.kv = KVCacheManager(pool, block_size, cache)  # the one owner of blocks, as in the engine
        self.next = 0
        self.held: Request | None = None
        self.records: list[dict] = []

    def has_unfinished_requests(self) -> bool:
        return self.next < len(self.prompts)

    def finish(self) -> None:
        """The request admitted last finishes: it drops its references (cached blocks stay cached)."""
        if self.held is not None:
            self.kv.free(self.held)
            self.held = None

    def step(self) -> dict:
        """Send the next prompt (the previous request finishes first); its record.

        A call that cannot send one raises ValueError, and a widget's click comes here again: past the last prompt
        it changes nothing (the last request keeps its path locked), and a prompt the pool cannot hold gives back
        the cached blocks it took and counts no lookup -- else every failed click would add a reference no request
        ever drops (the path drawn locked for good, never evictable) and hits to the cache's hit rate.
        """
        if not self.has_unfinished_requests():  # checked before finish(): the last request keeps its path locked
            raise ValueError(f"PrefixReplay: all {len(self.prompts)} prompts were sent, none is left to step")
        self.finish()  # the previous request finishes
        prompt = self.prompts[self.next]
        ns = self.namespaces[self.next] if self.namespaces else None
        req = Request(f"replay-{self.next}", list(prompt), SamplingParams(max_tokens=1), 0.0,
                      tenant=ns or "default")
        kv = self.kv
        kv.share_prefix(req, kv.match_prefix(req))  # the engine's admission: reuse the cached prefix
        hits = req.num_computed_tokens
        if not kv.allocate_slots(req, len(prompt) - hits):
            need = blocks_for(len(prompt), self.block_size) - len(req.block_ids)
            kv.free(req)  # drop the hit blocks' references: this request will never finish to drop them
            raise ValueError(f"PrefixReplay: prompt {self.next} ({len(prompt)} tokens, {hits} of them cached) needs "
                             f"{need} more blocks, and the pool of {self.pool.num_blocks} could not provide them, free "
                             f"or evicted (a pool too small for one prompt, or a cache that evicts nothing)")
        # counted once admitted, as the engine counts (KVCacheManager.record_admission): a refused prompt is no lookup
        self.cache.record_lookup(len(prompt) - 1, hits)
        req.num_computed_tokens = len(prompt)
        kv.cache_full_blocks(req)
        self.held = req
        rec = {"request": self.next, "prompt_tokens": len(prompt), "hit_tokens": hits}
        self.records.append(rec)
        self.next += 1
        return rec


class StaticBatchAdmission:
    """Pre-Orca static batching as an ``AdmissionPolicy``: admit a new batch only when nothing runs.

    Used by ``tools/make_figures.py`` for the static-vs-continuous timeline, and by lab 1 until the
    learner's own policy passes its checker.
    """

    def order(self, waiting, running):
        return list(waiting) if not running else []

