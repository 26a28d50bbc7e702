"""Input processing: from what a caller sends to :class:`~minivllm.request.Request` objects.

Everything a caller can get wrong about the prompt is checked here, at the
boundary, so that a bad value is a ``ValueError`` for that caller and never an
exception inside a running engine step: the prompt's form and token ids, the
tenant and cache salt, the length against ``max_model_len``.  (The request id
and the fit against the whole KV pool are checked by ``LLMEngine.add_request``,
which knows the live ids and the pool.)  ``n > 1`` fans out here into one request per sample; the
samples' ids live in their own space (``parent#i`` is never a valid user id
while that parent exists, see :meth:`InputProcessor.sample_id`).
"""

from __future__ import annotations

import itertools

import torch

from minivllm.argtypes import is_int, is_real
from minivllm.interfaces import Tokenizer
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams, brief_repr


def check_prompt_fits(num_prompt_tokens: int, max_model_len: int) -> None:
    """A prompt must leave room for one output token: one that fills the context can never run.

    One rule for both doors a prompt comes in by: the engine's (:meth:`InputProcessor.process`) and the HTTP
    server's, which checks before its admission door so such a prompt is a 400, never a 429 to retry.
    """
    if num_prompt_tokens >= max_model_len:
        raise ValueError(f"prompt has {num_prompt_tokens} tokens but max_model_len is {max_model_len}: "
                         "no room for even one output token")


def output_room(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The output tokens a request is given: what it asked for (``None``: as many as fit), clamped to the room
    its prompt leaves in the context.  The engine sizes a request's KV worst case by it, and the server asks
    the same question before its door (:meth:`~minivllm.engine.llm_engine.LLMEngine.never_runs`)."""
    return min(max_tokens or max_model_len, max_model_len - num_prompt_tokens)


def check_priority_deadline(priority, deadline) -> None:
    """The scheduling fields a caller sets, checked at the boundary (``ValueError``)."""
    if not is_int(priority):
        raise ValueError(f"priority must be an integer (lower runs first), got {brief_repr(priority)}")
    if deadline is not None and not is_real(deadline):  # (an int no float holds too: it is stored as a float)
        raise ValueError(f"deadline must be a finite number of seconds on the executor's clock, got {brief_repr(deadline)}")


def check_cache_salt(cache_salt) -> None:
    """A salt, when given, is a non-empty string (vLLM's rule, and its server's 400).

    ``""`` is refused rather than read as "no salt": a caller who sends one meant to split its cache (a salt
    built from an empty per-user value, say) and would otherwise share its tenant's space unwarned.  The HTTP
    server asks this too, about the client's own salt, before it scopes the salt to the tenant (the scoped
    string is never empty, so the engine alone could not tell).
    """
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string when given (leave it out to use the tenant's "
                         f"shared prefix cache), got {brief_repr(cache_salt)}")


# OpenAI's roles.  Any other (a typo: "asistant") would be written into the chat template as a turn of its own,
# a prompt the model never saw in training: a ValueError (HTTP 400, as OpenAI answers), not a quietly odd reply.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._ids = itertools.count()
        self._chars_per_token: int | None = None  # the longest vocabulary entry (0: unknown), read on first use

    @staticmethod
    def sample_id(parent_id: str, index: int) -> str:
        """The engine's id of sample ``index`` of ``parent_id``.  Why derived, not drawn: a sample id leads back
        to its parent (:meth:`sample_parent`: the metrics label a sample's preemption with the parent's tenant,
        a replay finds a sample's recorded tokens), and ``add_request`` refuses a user id of this shape while
        that parent lives, so the two id spaces never meet."""
        return f"{parent_id}#{index}"

    @classmethod
    def engine_id(cls, request_id: str, n: int, index: int) -> str:
        """The engine's id for sample ``index`` of a request of ``n`` samples: the request's own id when it is
        the only one, else :meth:`sample_id` (a replay looks recorded tokens up by it)."""
        return request_id if n == 1 else cls.sample_id(request_id, index)

    @staticmethod
    def sample_parent(request_id: str) -> str | None:
        """The parent id if ``request_id`` is shaped like a :meth:`sample_id` (``parent#<digits>``), else None."""
        parent, sep, index = request_id.rpartition("#")
        return parent if sep and index.isdigit() else None

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def process(
        self,
        prompt: str | dict | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        tenant: str,
        priority: int,
        arrival_time: float,
        deadline: float | None = None,
    ) -> list[Request]:
        """One request per sample (``params.n``), validated; nothing is queued here.

        A prompt dict may carry ``"tenant"``, ``"priority"`` and ``"deadline"``; they win
        over the keyword arguments, so a caller holding only prompts (``LLM.generate``)
        can schedule each one differently.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(prompt, dict):
            priority = prompt.get("priority", priority)
            deadline = prompt.get("deadline", deadline)
        if params.stop and self.tokenizer is None:  # matched on detokenized text, which needs a tokenizer
            raise ValueError("stop strings need a tokenizer and this engine has none: use stop_token_ids")
        text, token_ids, cache_salt, tenant = self._prompt_to_tokens(prompt, tenant)
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"tenant must be a non-empty string, got {brief_repr(tenant)}")
        check_priority_deadline(priority, deadline)
        check_cache_salt(cache_salt)
        max_len = self.max_model_len
        check_prompt_fits(len(token_ids), max_len)
        max_tokens = output_room(len(token_ids), params.max_tokens, max_len)
        samples: list[Request] = []
        for i in range(params.n):
            req = Request(
                request_id=self.engine_id(request_id, params.n, i),
                prompt_token_ids=token_ids,
                sampling_params=params,
                arrival_time=arrival_time,
                prompt=text,
                tenant=tenant,
                cache_salt=cache_salt,
                priority=priority,
                deadline=None if deadline is None else float(deadline),
                max_tokens=max_tokens,
                parent_id=None if params.n == 1 else request_id,
                sample_index=i,
                leader=samples[0] if samples else None,
            )
            if params.seed is not None:
                req.generator = torch.Generator().manual_seed((params.seed + i) % 2**63)
            samples.append(req)
        return samples

    def _prompt_to_tokens(self, prompt, tenant: str) -> tuple[str | None, list[int], str | None, str]:
        cache_salt = None
        if isinstance(prompt, dict):
            if "prompt" not in prompt and "prompt_token_ids" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "tenant", "priority", "deadline"}
            if unknown:
                raise ValueError(f"unknown prompt field(s) {sorted(unknown)}")
            if "prompt" in prompt and "prompt_token_ids" in prompt:
                raise ValueError("a prompt dict takes 'prompt' or 'prompt_token_ids', not both")
            cache_salt = prompt.get("cache_salt")
            tenant = prompt.get("tenant", tenant)
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)):
                    raise ValueError(f"prompt_token_ids must be a list of ints, got {type(ids).__name__}")
                prompt = list(ids)
            else:
                prompt = prompt["prompt"]
                if not isinstance(prompt, str):
                    raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            return (*self.encode(prompt), cache_salt, tenant)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("empty prompt: prompt_token_ids is empty")
            vocab = self.vocab_size
            # Plain ints in range, checked with C-level passes (a simulated 1,800-prompt backlog adds 800,000
            # ids); anything else -- an int subclass, a bool, a stray float -- gets the loop's precise answer.
            if not (set(map(type, prompt)) == {int} and min(prompt) >= 0 and not (vocab and max(prompt) >= vocab)):
                for t in prompt:
                    if not is_int(t) or t < 0 or (vocab and t >= vocab):
                        raise ValueError(f"prompt token ids must be integers in [0, {vocab}), got {brief_repr(t)}")
            return None, list(prompt), cache_salt, tenant
        raise ValueError(
            f"a prompt must be a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
        )

    def encode(self, text: str) -> tuple[str, list[int]]:
        """``(text, token ids)`` of a text prompt, validated (``ValueError``).  Thread-safe: a server
        tokenizes long prompts on a worker thread, so the engine's loop never waits for them."""
        if not text:
            raise ValueError("empty prompt")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass {'prompt_token_ids': [...]}")
        self._refuse_unfittable(text, "prompt")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"the prompt is not valid Unicode text (a lone surrogate at {exc.start}?)") from exc
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        if not ids:
            raise ValueError("prompt encodes to zero tokens")
        return text, ids

    def max_fitting_chars(self) -> int:
        """The most characters a text can have and still fit in ``max_model_len`` tokens; 0 when unknown.

        Twice the longest vocabulary entry per position (the factor for normalizers that drop characters).
        One bound for the two places that refuse what could never fit before paying for it: the tokenizer's
        input here (:meth:`_refuse_unfittable`) and the HTTP server's request body, read before it is parsed.
        """
        return 2 * self._max_chars_per_token() * self.max_model_len

    def _refuse_unfittable(self, text: str, what: str) -> None:
        """ValueError, before tokenizing, for a text no tokenization of which could fit in ``max_model_len``
        (tokenizing a 20 MB text took 43 s and 2.7 GB only to say it was too long)."""
        limit = self.max_fitting_chars()
        if limit and len(text) > limit:
            raise ValueError(f"{what} has {len(text)} characters but max_model_len is {self.max_model_len} tokens, and "
                             f"no token of this tokenizer covers more than {self._max_chars_per_token()} characters: "
                             "it could never fit")

    def _max_chars_per_token(self) -> int:
        """An upper bound on the characters of text one token covers: its longest vocabulary entry (byte-level
        BPE writes one character per byte, SentencePiece the piece itself); the caller doubles it for
        normalizers that drop characters.  0 when the tokenizer has no vocabulary to read (then no check)."""
        if self._chars_per_token is None:
            try:
                vocab = self.tokenizer.get_vocab()
                self._chars_per_token = max(map(len, vocab), default=0) if isinstance(vocab, dict) else 0
            except Exception:  # noqa: BLE001 - no get_vocab (a test tokenizer, say): no shortcut, tokenize as before
                self._chars_per_token = 0
        return self._chars_per_token

    def encode_chat(self, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a conversation rendered by the model's chat template, validated (``ValueError``).

        The one chat path: :meth:`minivllm.LLM.chat` and the server's
        ``/v1/chat/completions`` both come here, so a conversation tokenizes the
        same way whichever door it comes through.  The template's text is
        encoded without adding special tokens: the template already wrote them.
        Thread-safe, like :meth:`encode`.
        """
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': ...} messages")
        conversation = [_joined_parts(m) for m in conversation]
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each chat message needs 'role' and 'content', got {brief_repr(m)}")
            if not isinstance(m["role"], str) or not isinstance(m["content"], str):
                raise ValueError(f"a chat message's role and content must be strings, got {brief_repr(m)}")
            for field in ("role", "content"):
                try:
                    m[field].encode("utf-8")
                except UnicodeEncodeError as exc:
                    raise ValueError(f"message {i}'s {field} is not valid Unicode text "
                                     f"(a lone surrogate at {exc.start}?)") from exc
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"message {i}'s role must be one of {', '.join(CHAT_ROLES)}, "
                                 f"got {brief_repr(m['role'])}")
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - a template that refuses these messages is the caller's input
            raise ValueError(f"cannot apply the chat template to these messages: {exc}") from exc
        self._refuse_unfittable(text, "the conversation")
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError("the conversation encodes to zero tokens")
        return list(ids)


def _joined_parts(message):
    """A message whose content is OpenAI's list of text parts, with the parts joined by single newlines (one
    part a line, as vLLM joins them): the chat template takes a string.  ``LLM.chat`` gets the same conversations the server
    does, so the parts are joined here, on the one chat path, not at one door only.  Anything else is returned
    as it is, for the checks that follow."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), list):
        return message
    parts = message["content"]
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str) for p in parts):
        raise ValueError(f"only text content parts ({{'type': 'text', 'text': ...}}) are supported, got {brief_repr(parts)}")
    return {**message, "content": "\n".join(p.get("text", "") for p in parts)}
