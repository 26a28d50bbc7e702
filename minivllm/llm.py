"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, params)``.

``generate`` adds every prompt to an :class:`~minivllm.engine.llm_engine.LLMEngine` and
steps it until all are done — continuous batching does the rest — then returns
``RequestOutput`` objects in the order the prompts were given.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import replace
from typing import Any, Sequence

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.interfaces import (AdmissionPolicy, BatchBuilder, Executor, PreemptionCostModel, PreemptionPolicy,
                                 PrefixCache, Tokenizer)
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams

Prompt = str | dict | list


class LLM:
    """``LLM(model=None, **engine_options)``; ``model=None`` is the bundled SmolLM2-135M-Instruct.

    Engine options are the fields of :class:`~minivllm.config.EngineConfig`
    (``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``,
    ``enable_chunked_prefill``, ``enable_prefix_caching``, ``dtype``, ``seed``, ...).
    Policies, a prefix cache or an executor of your own go in as keyword
    arguments of the same names as :class:`~minivllm.engine.llm_engine.LLMEngine`'s
    (``prefix_cache`` is either the option ``"radix"``/``"hash"`` or your object).

    Multi-tenant scheduling: ``LLM(scheduling_policy="wfq", tenants={"alice":
    TenantConfig(weight=2, max_kv_share=0.5), "*": TenantConfig(max_running=8)})``
    (see :mod:`minivllm.sched.fairness`); a prompt dict's ``"tenant"`` names the tenant,
    its ``"priority"`` (int, lower first) and ``"deadline"`` (seconds on the engine's
    clock) feed the ``"priority"``, ``"deadline"`` and ``"three_class"`` policies:
    ``llm.generate([{"prompt": "hi", "tenant": "alice", "deadline": 2.0}])``.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        admission_policy: AdmissionPolicy | None = None,
        preemption_policy: PreemptionPolicy | None = None,
        preemption_cost_model: PreemptionCostModel | None = None,
        batch_builder: BatchBuilder | None = None,
        prefix_cache: PrefixCache | str | None = None,
        executor: Executor | None = None,
        tokenizer: Tokenizer | None = None,
        **engine_options: Any,
    ) -> None:
        if isinstance(prefix_cache, str):  # the option ("radix" | "hash"), not a cache object
            engine_options["prefix_cache"], prefix_cache = prefix_cache, None
        known = EngineConfig.option_names()
        unknown = set(engine_options) - known
        if unknown:
            raise ValueError(f"unknown engine option(s) {sorted(unknown)}; known: {sorted(known)}")
        config = EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(
            config,
            executor=executor,
            tokenizer=tokenizer,
            admission_policy=admission_policy,
            preemption_policy=preemption_policy,
            preemption_cost_model=preemption_cost_model,
            batch_builder=batch_builder,
            prefix_cache=prefix_cache,
        )
        self._router = _Router(self.engine)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- lifecycle -------------------------------------------------------------------
    def close(self) -> None:
        """Abort whatever is in flight and release the engine's requests; later calls raise."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- offline generation ----------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Safe to call from several threads at once, and while streams are open:
        all callers share one engine, and every step's outputs are routed to
        the caller that owns each request.  A request that fails comes back
        with ``finish_reason == "error"`` and its ``error`` saying why; so
        does one the scheduler can never run (a deadlock: see
        :data:`~minivllm.engine.llm_engine.STALL_STEPS`), rather than this
        call spinning for ever.
        """
        prompts = self._as_list(prompts)
        params = self._params_for(prompts, sampling_params)
        # only the final output is returned, so the engine builds no per-step outputs at all
        # (a "delta" request too: its last output would carry only the last step's text and tokens)
        params = [replace(p, output_kind="final_only") if p.output_kind != "final_only" else p for p in params]
        ids = self._add_all(prompts, params)
        finals: dict[str, RequestOutput] = {}
        bar = self._progress(len(ids), use_tqdm)
        try:
            while len(finals) < len(ids):
                if not self._router.pump(ids):
                    raise RuntimeError(self._router.lost([rid for rid in ids if rid not in finals]))
                for rid in ids:
                    for out in self._router.take(rid):
                        if out.finished:
                            finals[rid] = out
                            if bar is not None:
                                bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in finals:
                    self.engine.abort_request(rid)
            raise
        finally:
            self._router.close(ids)
            if bar is not None:
                bar.close()
        return [finals[rid] for rid in ids]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> "RequestStream":
        """Each step's ``RequestOutput`` for one prompt (its ``delta_text`` is the new text), as an iterator.

        The request is added -- and so checked -- by this call: a bad prompt or bad params raise ``ValueError``
        here, not at the first ``next``.  Several streams (and ``generate`` calls) can be consumed side by
        side: none loses another's deltas.  A stream left unfinished (``close()``d, or dropped) aborts its
        request, so its KV blocks go back.
        """
        rid = self._add_all([prompt], [sampling_params or SamplingParams()])[0]
        return RequestStream(self, rid)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.

        Validation and the template live in :meth:`~minivllm.engine.input_processor.InputProcessor.encode_chat` (the server's path too)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("chat() needs a conversation (a non-empty list of messages) or a list of them")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True) -> dict:
        """One conversation as a prompt dict (``{'prompt_token_ids': [...]}``), via the engine's one chat path."""
        return {"prompt_token_ids": self.engine.inputs.encode_chat(conversation, add_generation_prompt)}

    # -- helpers ---------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(p, int) for p in prompts):
                raise ValueError("a bare list of ints is ambiguous: pass {'prompt_token_ids': [...]}")
            return list(prompts)
        raise ValueError(f"prompts must be a string, a prompt dict or a list of them, got {type(prompts).__name__}")

    @staticmethod
    def _params_for(prompts, sampling_params) -> list[SamplingParams]:
        """One ``SamplingParams`` per prompt.  A str, bytes or dict is refused by its own type before it is
        iterated: each is iterable, and its characters or keys would be refused as if they were the elements."""
        if sampling_params is None:
            return [SamplingParams() for _ in prompts]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if isinstance(sampling_params, (str, bytes, dict)) or not hasattr(sampling_params, "__iter__"):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(sampling_params).__name__}")
        params = list(sampling_params)
        if any(not isinstance(p, SamplingParams) for p in params):
            raise ValueError("every element of sampling_params must be a SamplingParams")
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        return params

    def _add_all(self, prompts, params) -> list[str]:
        """Add the prompts one by one; if one is refused, abort those already added, so nothing is left
        half-added (the caller gets the ``ValueError`` and the engine holds none of the batch)."""
        self._router.refuse_if_served()  # before anything is added (pump checks again, for a server started since)
        if self.engine.closed:  # asked here too: an empty batch reaches no add_request, and returned [] after close()
            raise RuntimeError("this engine is closed")
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                added.append(self._router.add(prompt, p))
        except BaseException:  # a KeyboardInterrupt while a long batch is being added, too
            for rid in added:
                self.engine.abort_request(rid)
            self._router.close(added)
            raise
        return added

    @staticmethod
    def _progress(total: int, use_tqdm: bool):
        if not use_tqdm or total < 2:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)


class RequestStream:
    """What :meth:`LLM.stream` returns: one request's outputs, in order, as the engine produces them.

    Why a class and not a generator function: a generator's body (and so the ``add_request`` in it) runs only
    at the first ``next``, which put a bad prompt's ``ValueError`` far from the call that sent it.  Here the
    request is already in the engine; reading it pumps the engine (:class:`_Router`), and a stream closed or
    freed before its final output aborts the request, as an abandoned generator's ``finally`` did.  An abort
    from another thread waits for the step to end (the engine's lock); one from inside a step (the cycle
    collector freeing a stream there) is deferred by the engine until the step ends, so it is safe whenever
    it comes.
    """

    def __init__(self, llm: LLM, request_id: str) -> None:
        self.request_id = request_id
        self._router = llm._router
        self._engine = llm.engine
        self._ready: deque[RequestOutput] = deque()
        self._open = True  # the mailbox is open (closed at the final output, an error or close())
        self._finished = False

    def __iter__(self) -> "RequestStream":
        return self

    def __next__(self) -> RequestOutput:
        rid = self.request_id
        try:
            while not self._ready:
                if not self._open:
                    raise StopIteration
                if not self._router.pump([rid]):  # its request ended with no final output: an error, not an end
                    raise RuntimeError(self._router.lost([rid]))
                self._ready.extend(self._router.take(rid))
        except StopIteration:
            raise
        except BaseException:  # an error, or Ctrl-C while a step runs: nobody reads this request any more
            self.close()
            raise
        out = self._ready.popleft()
        if out.finished:
            self._finished = True
            self.close()
        return out

    def close(self) -> None:
        """Stop reading: a request not finished yet is aborted, its blocks go back.  Idempotent."""
        self._ready.clear()
        if self._open:
            self._open = False
            self._router.close([self.request_id])
            if not self._finished:
                self._engine.abort_request(self.request_id)

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the engine may be half torn down already
            pass


class _Router:
    """Hands each step's outputs to the caller that owns the request: one engine, many consumers.

    A consumer that has nothing to read *pumps*: it takes the stepping lock
    and, unless another consumer's step already delivered something for it
    meanwhile, runs one engine step and delivers every output to its owner's
    mailbox.  Consumers on other threads wait on the lock, never spin; an
    interleaved stream finds its deltas waiting in its mailbox.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self._step_lock = threading.Lock()
        self._boxes: dict[str, deque[RequestOutput]] = {}

    def open(self, rid: str) -> None:
        self._boxes[rid] = deque()

    def add(self, prompt, params) -> str:
        """Add a request and open its mailbox with no step in between (a step run by another consumer between
        the two would deliver the request's first -- or only -- output to no one)."""
        with self._step_lock:
            rid = self.engine.add_request(prompt, params)
            self.open(rid)
            return rid

    def close(self, ids) -> None:
        for rid in ids:
            self._boxes.pop(rid, None)

    def take(self, rid: str) -> list[RequestOutput]:
        box = self._boxes.get(rid)
        out = []
        while box:
            out.append(box.popleft())
        return out

    def refuse_if_served(self) -> None:
        """A server's loop stepping the engine would take our outputs (and we, its clients'): refuse instead."""
        if self.engine.served_by() is not None:
            raise RuntimeError("this engine is being served by a running server: send requests to the server, "
                               "or stop it first")

    def lost(self, ids) -> str:
        """Why ``ids`` ended without their final outputs."""
        if self.engine.closed:
            return f"requests {ids} ended unfinished: the engine was closed"
        return f"requests {ids} were aborted by another caller"

    def pump(self, ids) -> bool:
        """Run one engine step unless one of ``ids`` already has output waiting; False if the engine has no work
        left for them.  True does not mean output is waiting now: a step can bring ``ids`` nothing (a final-only
        request mid-decode, one still queued), so the callers loop, taking their mailbox after each call."""
        with self._step_lock:
            if any(self._boxes.get(rid) for rid in ids):
                return True
            self.refuse_if_served()  # (first: a server that stepped our requests to their end took their outputs)
            # None of ids left in the engine (aborted by another caller, the engine closed): no step can bring
            # their outputs.  Waiting for an empty engine instead ran everyone else's work first, for ever
            # under a steady load.
            if not self.engine.holds_any(ids) or not self.engine.has_unfinished_requests():
                return False
            for out in self.engine.step():
                box = self._boxes.get(out.request_id)
                if box is not None:
                    box.append(out)
            return True
