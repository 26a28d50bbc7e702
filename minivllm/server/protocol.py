"""OpenAI API request models (the subset minivllm serves) and the models endpoint's cards, as pydantic models.

Responses are plain dicts built where they are sent (``api_server``): one definition of each shape, checked
against the official ``openai`` client's own types in the tests rather than restated here.

Requests accept OpenAI's fields plus a few of vLLM's extras (``top_k``,
``min_p``, ``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``,
``skip_special_tokens``, ``cache_salt``).  Unknown fields are ignored, as
OpenAI's clients send fields a server may not know; fields -- OpenAI's or
vLLM's -- whose non-default values minivllm cannot honour (``logprobs``,
``echo``, ``best_of``, penalties, ``min_tokens``, guided decoding, ``tools``...)
are refused with a 400, never silently dropped: a client moving from vLLM with
``extra_body={"repetition_penalty": 1.2}`` must not get different text unwarned.  Types are checked strictly for counts (``max_tokens: "7"`` or
``true`` is a 400), the engine's :class:`~minivllm.sampling_params.SamplingParams`
checks every value.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator, model_validator

# A real number, strictly: ints are accepted (and become floats), strings and bools are not.  One type
# rather than ``Union[StrictInt, StrictFloat]``, whose first member's error ("should be a valid integer")
# is what a client sending ``"temperature": "0.5"`` would read.
Number = StrictFloat

# Every stop string is searched for on every step of its request, on the engine thread every request shares: a
# request with thousands of them slows every stream.  (OpenAI allows 4; this leaves room for vLLM-style lists.)
MAX_STOP_STRINGS = 64


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


# Fields minivllm does not implement, each with the value that asks for nothing (besides null): anything
# else is refused.
_NOTHING_ASKED = (("top_logprobs", 0), ("presence_penalty", 0), ("frequency_penalty", 0), ("logit_bias", {}),
                  ("repetition_penalty", 1), ("length_penalty", 1), ("min_tokens", 0), ("use_beam_search", False),
                  ("prompt_logprobs", None), ("guided_json", None), ("guided_regex", None), ("guided_choice", None),
                  ("guided_grammar", None), ("structured_outputs", None),
                  # vLLM extras that change which tokens come out: were they ignored, a client moving from vLLM would get
                  # text its request forbade (bad_words), or a prompt it asked to have cut (truncate_prompt_tokens)
                  ("bad_words", []), ("allowed_token_ids", None), ("truncate_prompt_tokens", None),
                  ("logits_processors", []),
                  # vLLM's scheduling priority: the server does not pass a client's priority to the engine (any
                  # client could put itself ahead of every other tenant), so a non-zero one is refused, not dropped
                  ("priority", 0))


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    n: Optional[StrictInt] = 1
    seed: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    # vLLM extras
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    ignore_eos: Optional[StrictBool] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    include_stop_str_in_output: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    cache_salt: Optional[StrictStr] = None
    # OpenAI fields minivllm does not implement: refused unless left at their defaults
    logprobs: Optional[Any] = None
    top_logprobs: Optional[Any] = None
    presence_penalty: Optional[Number] = None
    frequency_penalty: Optional[Number] = None
    logit_bias: Optional[dict] = None
    # vLLM extras minivllm does not implement: refused likewise
    repetition_penalty: Optional[Number] = None
    length_penalty: Optional[Number] = None
    min_tokens: Optional[StrictInt] = None
    use_beam_search: Optional[StrictBool] = None
    prompt_logprobs: Optional[Any] = None
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    structured_outputs: Optional[Any] = None
    bad_words: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    truncate_prompt_tokens: Optional[Any] = None
    logits_processors: Optional[Any] = None
    priority: Optional[Any] = None
    response_format: Optional[dict] = None  # chat's field, and vLLM's on completions too

    @field_validator("stop")
    @classmethod
    def _few_stop_strings(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}")
        return stop

    def unsupported(self) -> Optional[str]:
        """The first field set to something minivllm cannot do, or None.

        ``logprobs`` may only be null or false (chat's "no"): a number, even 0, asks a completion for
        the sampled tokens' log-probabilities (vLLM returns them for 0 too).
        """
        if self.logprobs is not None and self.logprobs is not False:
            return "logprobs"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        for name, default in _NOTHING_ASKED:
            value = getattr(self, name)
            if value is not None and value != default:
                return name
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options.continuous_usage_stats"
        return None


class CompletionRequest(_SamplingRequest):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16  # OpenAI's default for completions
    echo: Optional[StrictBool] = False
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None

    def unsupported(self) -> Optional[str]:
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        if self.best_of not in (None, 1):
            return "best_of"
        return super().unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: StrictStr
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[StrictStr] = None

    # (the role is checked where every conversation goes, InputProcessor.encode_chat)
    @model_validator(mode="after")
    def _content_given(self):
        # only an assistant turn may have no content (OpenAI: one that made tool calls)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False  # vLLM: prefix the reply with the last message
    continue_final_message: Optional[StrictBool] = False
    chat_template_kwargs: Optional[dict] = None
    # vLLM's other template inputs: the request's own template, RAG documents for it, special tokens on top of it
    chat_template: Optional[StrictStr] = None
    documents: Optional[list] = None
    add_special_tokens: Optional[StrictBool] = False
    tools: Optional[list] = None
    functions: Optional[list] = None  # the legacy form of tools
    tool_choice: Optional[Any] = None
    function_call: Optional[Any] = None  # the legacy form of tool_choice
    modalities: Optional[list] = None
    audio: Optional[Any] = None
    add_generation_prompt: Optional[StrictBool] = True

    def unsupported(self) -> Optional[str]:
        if self.tools:
            return "tools"
        if self.functions:
            return "functions"
        if self.tool_choice not in (None, "none", "auto"):  # "auto" with no tools asks for nothing
            return "tool_choice"
        if self.function_call not in (None, "none", "auto"):
            return "function_call"
        if self.modalities not in (None, [], ["text"]):  # audio out: a text-only reply is not what was asked
            return "modalities"
        if self.audio is not None:
            return "audio"
        for name in ("echo", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
                     "add_special_tokens"):
            if getattr(self, name):
                return name
        return super().unsupported()


# -- the models endpoint ---------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "minivllm"
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
