"""The offline API, shaped like vLLM's: ``LLM(...).generate(prompts, params)``.

``generate`` adds every prompt to an :class:`~minivllm.engine.llm_engine.LLMEngine` and
steps it until all are done — continuous batching does the rest — then returns
``RequestOutput`` objects in the order the prompts were given.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine
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
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        admission_policy: Any = None,
        preemption_policy: Any = None,
        preemption_cost_model: Any = None,
        prefix_cache: Any = None,
        executor: Any = None,
        tokenizer: Any = None,
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
            prefix_cache=prefix_cache,
        )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # -- offline generation ----------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order."""
        prompts = self._as_list(prompts)
        params = self._params_for(prompts, sampling_params)
        ids = self._add_all(prompts, params)
        finals: dict[str, RequestOutput] = {}
        bar = self._progress(len(ids), use_tqdm)
        try:
            while len(finals) < len(ids) and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in ids:
                        finals[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finals[rid] for rid in ids]

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Yield each step's ``RequestOutput`` for one prompt (its ``delta_text`` is the new text)."""
        rid = self._add_all([prompt], [sampling_params or SamplingParams()])[0]
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.chat_prompt(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True) -> dict:
        for m in conversation:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {m!r}")
        ids = self.tokenizer.apply_chat_template(
            conversation, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if hasattr(ids, "keys"):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return {"prompt_token_ids": list(ids)}

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
        """Validate every prompt before queueing any, so a bad one leaves nothing half-added."""
        added: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                added.append(self.engine.add_request(prompt, p))
        except Exception:
            for rid in added:
                self.engine.abort_request(rid)
            raise
        return added

    @staticmethod
    def _progress(total: int, use_tqdm: bool):
        if not use_tqdm or total < 2:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
