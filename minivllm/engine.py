"""The serving loop.  :meth:`LLMEngine.step` is the whole lesson, seven steps in order.

::

    1. admit       waiting -> running, while seats, token budget and KV blocks allow
    2. build batch decode tokens first, then prefill chunks, under the token budget
    3. allocate    KV blocks for every scheduled token; preempt when the pool is dry
    4. execute     one forward pass over the flat ragged batch; sample
    5. append KV   the step's K/V now count as computed; sampled tokens join the request
    6. emit        incremental detokenization, stop checks, streamed deltas
    7. finish      finished requests leave and give their blocks back

Everything that can vary is a seam (see :mod:`minivllm.interfaces`): the
admission and preemption policies, the prefix cache and the executor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from minivllm.block_pool import BlockPool
from minivllm.config import EngineConfig
from minivllm.detokenizer import IncrementalDetokenizer
from minivllm.interfaces import AdmissionPolicy, Executor, PreemptionPolicy
from minivllm.kv_cache import KVCache, bytes_per_block
from minivllm.kv_cache_manager import KVCacheManager
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.scheduler import ScheduledBatch, Scheduler

DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class _Stream:
    """Per-request output state the engine keeps beside the request."""

    detok: IncrementalDetokenizer
    emitted_chars: int = 0


class LLMEngine:
    """The incremental engine: ``add_request`` / ``step`` / ``abort_request``."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        executor: Executor | None = None,
        tokenizer: Any = None,
        num_layers: int | None = None,
        admission_policy: AdmissionPolicy | None = None,
        preemption_policy: PreemptionPolicy | None = None,
        prefix_cache: Any = None,
        eos_token_ids: set[int] | None = None,
        model_max_len: int = 8192,
    ) -> None:
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.model_runner = None
        if executor is None:
            executor, tokenizer, model_max_len = self._load_model_runner()
            self.tokenizer = tokenizer
        self.config.finalize(model_max_len)
        num_blocks = self._num_blocks
        self.config.check_kv_capacity(num_blocks)
        self.executor = executor
        self.pool = BlockPool(num_blocks)
        if self.model_runner is not None:
            self.model_runner.kv_cache = self._make_kv_cache(num_blocks)
        self.prefix_cache = prefix_cache if prefix_cache is not None else self._make_prefix_cache()
        self.kv = KVCacheManager(self.pool, self.config.block_size, self.prefix_cache)
        self.scheduler = Scheduler(self.config, self.kv, admission_policy, preemption_policy)
        self.scheduler.on_admit = self._on_admit
        self._groups: dict[str, list[Request]] = {}  # n > 1: parent id -> its samples
        self._group_outputs: dict[str, list[CompletionOutput]] = {}
        self.recompute_hit_tokens = 0  # tokens a preempted request got back from the cache (not hits)
        self.eos_token_ids = eos_token_ids if eos_token_ids is not None else self._eos_ids()
        self.requests: dict[str, Request] = {}
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self.step_log: list[dict] = []  # one small record per step, read by widgets and labs

    # -- construction helpers ---------------------------------------------
    def _load_model_runner(self):
        from minivllm.model_loader import load_model
        from minivllm.model_runner import ModelRunner

        cfg = self.config
        loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, max_model_len=cfg.max_model_len)
        self.loaded = loaded
        args = loaded.model.args
        self._kv_shape = (args.num_layers, args.num_kv_heads, args.head_dim)
        backend = self._attention_backend()
        loaded.model.backend = backend
        self.model_runner = ModelRunner(loaded.model, kv_cache=None, seed=cfg.seed)  # cache made after sizing
        return self.model_runner, loaded.tokenizer, args.max_position_embeddings

    def _attention_backend(self):
        try:
            from minivllm.attention_backends import get_attention_backend
        except ImportError:
            if self.config.attention_backend == "triton":
                raise ValueError("the triton attention backend is not available in this build")
            from minivllm.attention import TorchAttentionBackend

            return TorchAttentionBackend()
        return get_attention_backend(self.config.attention_backend, self.config.device)

    @property
    def _num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            return cfg.num_gpu_blocks_override
        if self.model_runner is None:
            return 4096 if cfg.kv_cache_memory_bytes is None else cfg.kv_cache_memory_bytes // (cfg.block_size * 1024)
        layers, kv_heads, head_dim = self._kv_shape
        per_block = bytes_per_block(layers, cfg.block_size, kv_heads, head_dim, cfg.dtype)
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            if cfg.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(cfg.device)
                budget = int(free * cfg.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_KV_BYTES
        return max(1, budget // per_block)

    def _make_kv_cache(self, num_blocks: int) -> KVCache:
        layers, kv_heads, head_dim = self._kv_shape
        cfg = self.config
        return KVCache(layers, num_blocks, cfg.block_size, kv_heads, head_dim, cfg.dtype, cfg.device)

    def _make_prefix_cache(self):
        if not self.config.enable_prefix_caching:
            return None
        from minivllm.prefix_cache import make_prefix_cache

        return make_prefix_cache(
            self.config.prefix_cache, self.pool, self.config.block_size, self.config.prefix_cache_quota_blocks
        )

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        tok = self.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            ids.add(int(tok.eos_token_id))
        hf_config = getattr(getattr(self, "loaded", None), "hf_config", None)
        eos = getattr(hf_config, "eos_token_id", None)
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, (list, tuple)):
            ids.update(int(e) for e in eos)
        return ids

    # -- public API ---------------------------------------------------------
    def add_request(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        tenant: str = "default",
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; returns its id.  Bad input raises ``ValueError``."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.requests or request_id in self._groups:
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is still in the engine")
        text, token_ids, cache_salt = self._prompt_to_tokens(prompt)
        if isinstance(prompt, dict) and "tenant" in prompt:
            tenant = prompt["tenant"]
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant must be a non-empty string, got {tenant!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {cache_salt!r}")
        max_len = self.config.max_model_len
        if len(token_ids) >= max_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {max_len}: "
                f"no room for even one output token"
            )
        max_tokens = min(params.max_tokens or max_len, max_len - len(token_ids))
        arrival = self.executor.now() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                sampling_params=params,
                arrival_time=arrival,
                prompt=text,
                tenant=tenant,
                cache_salt=cache_salt,
                priority=priority,
                max_tokens=max_tokens,
                parent_id=None if params.n == 1 else request_id,
                sample_index=i,
                leader=samples[0] if samples else None,
            )
            if params.seed is not None:
                req.generator = torch.Generator().manual_seed(params.seed + i)
            samples.append(req)
        if not self.scheduler.could_ever_fit(samples[0]):
            raise ValueError(
                f"request {request_id!r} needs up to {samples[0].max_total_tokens} tokens of KV but the whole "
                f"pool holds {self.pool.num_blocks * self.config.block_size}; it could never run"
            )
        if params.n > 1:
            self._groups[request_id] = samples
            self._group_outputs[request_id] = [
                CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)
            ]
        for req in samples:
            self.requests[req.request_id] = req
            self._streams[req.request_id] = _Stream(
                IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            )
            self.scheduler.add(req)
        return request_id

    def _prompt_to_tokens(self, prompt) -> tuple[str | None, list[int], str | None]:
        cache_salt = None
        if isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
            if not ids:
                raise ValueError("prompt encodes to zero tokens")
            return prompt, ids, cache_salt
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("empty prompt: prompt_token_ids is empty")
            vocab = self._vocab_size()
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab and t >= vocab):
                    raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {t!r}")
            return None, list(prompt), cache_salt
        raise ValueError(
            f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def _vocab_size(self) -> int | None:
        loaded = getattr(self, "loaded", None)
        return loaded.model.args.vocab_size if loaded is not None else None

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back at once.  False if unknown."""
        group = self._groups.pop(request_id, None)
        self._group_outputs.pop(request_id, None)
        targets = group if group is not None else [self.requests.get(request_id)]
        found = False
        for req in targets:
            if req is None or req.request_id not in self.requests:
                continue
            self.scheduler.remove(req)
            req.status = RequestStatus.FINISHED_ABORTED
            req.finished_time = self.executor.now()
            self._forget(req)
            found = True
        return found

    # -- prefix caching -------------------------------------------------------
    def namespace(self, req: Request) -> str:
        """The prefix-cache namespace of a request: its tenant (unless sharing is on) and its salt.

        Tenants do not share cached blocks by default, because a shared cache
        leaks across users by timing: a fast first token tells an attacker that
        somebody else recently sent the same prefix (vLLM CVE-2025-46570).
        """
        space = "" if self.config.share_prefix_cache_across_tenants else f"tenant={req.tenant}"
        return space + (f"|salt={req.cache_salt}" if req.cache_salt else "")

    def _on_admit(self, req: Request) -> None:
        """Give an admitted request the KV it can reuse: its leader's prompt, or a cached prefix."""
        leader = req.leader
        if leader is not None and leader.num_computed_tokens >= req.num_prompt_tokens and leader.block_ids:
            self._fork_from(leader, req)
        elif self.prefix_cache is not None:
            self._match_prefix(req)

    def _fork_from(self, leader: Request, req: Request) -> None:
        """``n > 1``: share the leader's prompt blocks, recompute only the last prompt token.

        The sample writes that token's K/V into the last shared block, so the
        block manager copies it first (copy-on-write) unless it starts a new one.
        """
        shared = -(-(req.num_prompt_tokens - 1) // self.config.block_size)
        req.block_ids = list(leader.block_ids[:shared])
        for b in req.block_ids:
            self.pool.incref(b)
        req.num_computed_tokens = req.num_prompt_tokens - 1
        req.num_inserted_blocks = 0

    def _match_prefix(self, req: Request) -> None:
        """At admission: share the longest cached prefix and skip computing it.

        The last token is never matched: the model must run on it to produce
        the logits the next token is sampled from.
        """
        cache = self.prefix_cache
        blocks = cache.match(req.all_token_ids[:-1], self.namespace(req))
        for b in blocks:
            self.pool.incref(b)
        req.block_ids = list(blocks)
        req.num_computed_tokens = len(blocks) * self.config.block_size
        req.num_inserted_blocks = len(blocks)

    def _count_prefix_hits(self, admitted: list[Request]) -> None:
        """Hit statistics, counted once a request is really admitted.

        Only a request's first admission counts as a lookup.  A preempted request
        that finds its own blocks again saved recompute; that is reported apart
        (``recompute_hit_tokens``) and never inflates the hit rate.
        """
        if self.prefix_cache is None:
            return
        for req in admitted:
            if req.leader is not None and not req.prefix_lookup_recorded and req.num_computed_tokens:
                req.prefix_lookup_recorded = True  # forked from its leader: the leader's lookup counted
            elif not req.prefix_lookup_recorded:
                req.prefix_lookup_recorded = True
                self.prefix_cache.record_lookup(req.num_prompt_tokens, req.num_computed_tokens)
                req.num_cached_tokens = req.num_computed_tokens
            else:
                self.recompute_hit_tokens += req.num_computed_tokens

    def _cache_full_blocks(self, batch: ScheduledBatch) -> None:
        """Offer every newly filled block to the prefix cache (prompt chunks and decode alike).

        Where the cache already holds the same tokens in another block, the
        request switches to the cached copy and its duplicate is freed.
        """
        cache = self.prefix_cache
        if cache is None:
            return
        bs = self.config.block_size
        for seq in batch.seqs:
            req = seq.request
            full = min(req.num_computed_tokens // bs, len(req.block_ids))
            if full <= req.num_inserted_blocks:
                continue
            result = cache.insert(req.all_token_ids[: full * bs], req.block_ids[:full], self.namespace(req))
            for i, canonical in enumerate(result.block_ids):
                if canonical != req.block_ids[i]:
                    self.pool.incref(canonical)
                    self.pool.decref(req.block_ids[i])
                    req.block_ids[i] = canonical
            req.num_inserted_blocks = full

    def stats(self) -> dict:
        """Counters for metrics, labs and benchmarks (a plain dict, cheap to build)."""
        pool = self.pool
        cached = self.prefix_cache.num_cached_blocks if self.prefix_cache else 0
        evictable = self.prefix_cache.num_evictable_blocks() if self.prefix_cache else 0
        out = {
            "num_blocks": pool.num_blocks,
            "free_blocks": pool.num_free,
            "cached_blocks": cached,
            "used_blocks": pool.num_blocks - pool.num_free - evictable,
            "kv_cache_usage": self.kv.usage(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.stats.num_preemptions,
            "recomputed_tokens": self.scheduler.stats.num_recomputed_tokens,
            "recompute_hit_tokens": self.recompute_hit_tokens,
        }
        if self.prefix_cache is not None:
            st = self.prefix_cache.stats
            out.update(
                prefix_cache_queries=st.queries_tokens,
                prefix_cache_hits=st.hits_tokens,
                prefix_cache_hit_rate=st.hit_rate,
                prefix_cache_evictions=st.evicted_blocks,
                prefix_cache_quota_evictions=st.quota_evictions,
            )
        return out

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration of the serving loop; returns what changed for each request."""
        admitted = self.scheduler.admit()                      # 1. admit
        self._count_prefix_hits(admitted)
        batch = self.scheduler.build_batch()                   # 2. build batch
        batch = self.scheduler.allocate(batch)                 # 3. allocate KV blocks
        batch.admitted = admitted
        sampled = self.executor.execute(batch)                 # 4. execute
        new_tokens = self._append(batch, sampled)              # 5. append KV (and tokens)
        self._cache_full_blocks(batch)                         #    ... full blocks become shareable
        outputs = self._emit(new_tokens)                       # 6. emit / stream
        outputs = self._finish(outputs)                        # 7. finish
        self._log_step(batch)
        return outputs

    def _append(self, batch: ScheduledBatch, sampled: dict[str, int]) -> list[Request]:
        """The K/V written in this step is now part of each request; sampled tokens join it."""
        now = self.executor.now()
        grew: list[Request] = []
        for seq in batch.seqs:
            req = seq.request
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.num_computed_tokens += seq.num_tokens
            if req.request_id in sampled:
                req.output_token_ids.append(sampled[req.request_id])
                if req.first_token_time is None:
                    req.first_token_time = now
                req.token_times.append(now)
                grew.append(req)
        return grew

    def _emit(self, grew: list[Request]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for req in grew:
            token = req.output_token_ids[-1]
            stream = self._streams[req.request_id]
            stream.detok.add_token(token)
            self._check_stop(req, token, stream)
            outputs.append(self._make_output(req, stream, [token]))
        return outputs

    def _group_output(self, parent_id: str, sample: RequestOutput) -> RequestOutput:
        """``n > 1``: fold one sample's output into its parent's, indexed by sample."""
        completions = self._group_outputs[parent_id]
        done = sample.outputs[0]
        completions[done.index] = done
        finished = all(c.finish_reason is not None for c in completions)
        return RequestOutput(
            request_id=parent_id,
            prompt=sample.prompt,
            prompt_token_ids=sample.prompt_token_ids,
            outputs=list(completions),
            finished=finished,
            metrics=sample.metrics,
            num_cached_tokens=sample.num_cached_tokens,
        )

    def _check_stop(self, req: Request, token: int, stream: _Stream) -> None:
        params = req.sampling_params
        if not params.ignore_eos and token in self.eos_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, None
        elif token in params.stop_token_ids:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif params.stop_strings and self._truncate_at_stop(req, stream):
            req.status = RequestStatus.FINISHED_STOPPED
        elif len(req.output_token_ids) >= req.max_tokens:
            req.status = RequestStatus.FINISHED_LENGTH

    @staticmethod
    def _truncate_at_stop(req: Request, stream: _Stream) -> bool:
        text = stream.detok.text
        params = req.sampling_params
        # only the newest characters can complete a stop string
        window = max(len(s) for s in params.stop_strings) + 16
        from_char = max(0, len(text) - window)
        for stop in params.stop_strings:
            at = text.find(stop, from_char)
            if at != -1:
                end = at + len(stop) if params.include_stop_str_in_output else at
                stream.detok.text = text[:end]
                req.stop_reason = stop
                return True
        return False

    def _make_output(self, req: Request, stream: _Stream, new_tokens: list[int]) -> RequestOutput:
        text = stream.detok.text
        finished = req.status.finished
        params = req.sampling_params
        # hold back text that might be the start of a stop string until we know
        hold = 0 if finished or not params.stop_strings else max(len(s) for s in params.stop_strings) - 1
        visible = max(stream.emitted_chars, len(text) - hold)
        delta = text[stream.emitted_chars : visible]
        stream.emitted_chars = visible
        completion = CompletionOutput(
            index=req.sample_index,
            text=text[:visible],
            token_ids=list(req.output_token_ids),
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            delta_text=delta,
            delta_token_ids=new_tokens,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            token_times=list(req.token_times),
            finished_time=req.finished_time,
            num_preemptions=req.num_preemptions,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            num_cached_tokens=req.num_cached_tokens,
        )

    def _finish(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Free finished requests; fold ``n > 1`` samples into one output per parent."""
        now = self.executor.now()
        result: dict[str, RequestOutput] = {}
        for out in outputs:
            req = self.requests[out.request_id]
            if out.finished:
                req.finished_time = now
                out.metrics.finished_time = now
                self.scheduler.remove(req)
                self._forget(req)
            if req.parent_id is None:
                result[out.request_id] = out
                continue
            grouped = self._group_output(req.parent_id, out)
            result[req.parent_id] = grouped
            if grouped.finished:
                self._groups.pop(req.parent_id, None)
                self._group_outputs.pop(req.parent_id, None)
        return list(result.values())

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self._streams.pop(req.request_id, None)

    def _log_step(self, batch: ScheduledBatch) -> None:
        self.step_log.append(
            {
                "step": len(self.step_log),
                "time": self.executor.now(),
                "seqs": [(s.request.request_id, s.start, s.num_tokens) for s in batch.seqs],
                "num_tokens": batch.num_tokens,
                "preempted": [r.request_id for r in batch.preempted],
                "free_blocks": self.pool.num_free,
                "running": len(self.scheduler.running),
                "waiting": len(self.scheduler.waiting),
            }
        )
        if len(self.step_log) > 100_000:
            del self.step_log[:50_000]
