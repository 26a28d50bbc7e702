"""Tests from a mutation hunt over the serving boundary (``minivllm/server/api_server.py`` and the engine's input
processor, output processor and detokenizer): each pins a behaviour a planted one-line bug changed while every
test that covers those files still passed.

Nothing loads a model: the engine runs on the simulated executor, with the bundled tokenizer where text matters.
Oracles: the Hugging Face tokenizer (``encode``, ``apply_chat_template``), the OpenAI API's documented answers.
"""

from __future__ import annotations

import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm import SamplingParams  # noqa: E402
from minivllm.bench.loadgen import iter_sse  # noqa: E402
from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from tests.test_server_sim import _Served, _WordTokenizer  # noqa: E402


def _text_engine(tokenizer, max_len: int = 256) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=max_len, device="cpu")
    return LLMEngine(cfg, executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
                     model_max_len=max_len)


def test_a_long_text_prompt_that_fits_in_tokens_is_accepted(tokenizer):
    """The refusal of texts "too long to ever fit" (before tokenizing them) must never refuse a text that does fit:
    its bound is twice the longest vocabulary entry per token.  This vocabulary has an 81-character token (a
    newline and 80 spaces: indented code), so 200 of them are 16,200 characters in 200 tokens, which fit a
    256-token context.  Oracle: the tokenizer's own count.  Kills: the bound tightened below one longest token per
    position (a prompt the model can take refused with "it could never fit")."""
    chunk = "\n" + " " * 80
    text = "x" + chunk * 200 + "y"
    n = len(tokenizer.encode(text, add_special_tokens=True))
    assert n < 256 - 4, n  # the oracle: it fits, with room for the output
    engine = _text_engine(tokenizer)
    engine.add_request(text, SamplingParams(max_tokens=4), request_id="r")  # a ValueError here is the bug
    assert engine.scheduler.waiting[0].num_prompt_tokens == n



@pytest.mark.parametrize("door", ["text", "chat"])
def test_a_text_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(tokenizer, monkeypatch, door):
    """The other side of the bound above: a text (or a rendered conversation) too long for any tokenization of it
    to fit is refused without being tokenized (a 20 MB prompt took 43 s and 2.7 GB to tokenize only to be
    refused).  Oracle: by hand, no token covers more characters than the vocabulary's longest entry, so a text of
    three times that many characters per position cannot fit even if a normalizer dropped half of them; and a
    count of the tokenizer's ``encode`` calls.  Kills: the bound loosened past that (the text is tokenized
    first), and the chat path skipping the check (``LLM.chat`` and ``/v1/chat/completions`` both come here)."""
    longest = max(map(len, tokenizer.get_vocab()))
    text = "ab " * (longest * 256)  # 3 * longest characters for each of the 256 positions
    engine = _text_engine(tokenizer)
    calls, encode = [], tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda *a, **kw: calls.append(1) or encode(*a, **kw))
    with pytest.raises(ValueError, match="could never fit"):
        if door == "text":
            engine.add_request(text, SamplingParams(max_tokens=4))
        else:
            engine.inputs.encode_chat([{"role": "user", "content": text}])
    assert calls == []
    assert not engine.has_unfinished_requests()

def test_a_chat_prompt_is_the_templates_tokens_with_no_special_tokens_added_twice(tokenizer):
    """The chat template writes its own special tokens, so its text is encoded without adding more (HF's
    ``apply_chat_template(tokenize=True)`` does the same).  The bundled tokenizer adds nothing either way, so the
    test wraps it as a Llama-style one whose ``encode`` prepends a BOS by default.  Kills: the template's text
    encoded with ``add_special_tokens=True`` (a second BOS before the template's, a prompt the model never saw)."""
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    class _AddsBos:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __len__(self):
            return len(tokenizer)

        def encode(self, text, add_special_tokens=True, **kw):
            ids = tokenizer.encode(text, add_special_tokens=False, **kw)
            return [bos, *ids] if add_special_tokens else ids

    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    engine = _text_engine(_AddsBos())
    ids = engine.inputs.encode_chat([dict(m) for m in conversation], True)
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    expected = list(expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected)
    assert ids == expected


# -- over HTTP ------------------------------------------------------------------------------------------------


def _events(text: str) -> list:
    return [data if data == "[DONE]" else json.loads(data) for data in iter_sse(text.splitlines())]


def _chat_engine(tokenizer, max_len: int = 256) -> LLMEngine:
    """The simulated executor behind the real chat template; no EOS, so a request runs to its ``max_tokens``."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=max_len, device="cpu")
    return LLMEngine(cfg, executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
                     model_max_len=max_len, eos_token_ids=set())


def test_max_completion_tokens_wins_over_the_deprecated_max_tokens(tokenizer):
    """OpenAI deprecated chat's ``max_tokens`` for ``max_completion_tokens``; given both, the newer one is the
    limit (vLLM: ``max_completion_tokens`` takes precedence).  Kills: ``max_tokens`` winning when both are set."""
    engine = _chat_engine(tokenizer)
    msgs = [{"role": "user", "content": "Count to ten."}]
    with _Served(engine) as srv:
        r = httpx.post(srv.base + "/v1/chat/completions", timeout=30,
                       json={"messages": msgs, "max_tokens": 2, "max_completion_tokens": 5})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_cache_salt_never_names_another_tenants_space_even_when_tenants_share_the_cache():
    """The module's promise: ``cache_salt`` is scoped to the caller's tenant, so it can only split that tenant's
    space, "not even with ``share_prefix_cache_across_tenants``".  With sharing on, bob's unsalted repeat of
    alice's unsalted prompt hits the shared cache (the control), but the same salt sent by both tenants names two
    spaces.  Kills: the salt passed to the engine as the client wrote it (bob's salted request read alice's
    salted blocks: the cross-tenant probe the salt must not open)."""
    cfg = EngineConfig(num_gpu_blocks_override=256, block_size=16, max_model_len=512, max_num_seqs=8,
                       enable_prefix_caching=True, share_prefix_cache_across_tenants=True, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_WordTokenizer(), model_max_len=512,
                       eos_token_ids=set())

    def cached(srv, key: str, prompt: list[int], salt: str | None = None) -> int:
        body = {"prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
        r = httpx.post(srv.base + "/v1/completions", json=body, timeout=30, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    plain, salted = list(range(20, 100)), list(range(200, 280))  # 80 tokens: 5 full blocks each
    with _Served(engine, {"ka": "alice", "kb": "bob"}) as srv:
        assert cached(srv, "ka", plain) == 0
        assert cached(srv, "kb", plain) >= 64  # sharing is on: bob reads alice's unsalted blocks
        assert cached(srv, "ka", salted, "team") == 0
        assert cached(srv, "ka", salted, "team") >= 64  # alice's own salted space is cached...
        assert cached(srv, "kb", salted, "team") == 0  # ...and bob's same salt names another one


def test_a_chat_streams_finishing_chunk_has_an_empty_delta_when_it_adds_no_text():
    """OpenAI's last chat chunk is ``"delta": {}`` with the ``finish_reason`` (the API reference's streaming
    example); the ``openai`` client then reads ``delta.content`` as ``None``, as it does from OpenAI.  A choice
    that ends on a stop token adds no text there.  Kills: the delta always carrying ``"content"`` (``""``)."""
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=4, max_model_len=64, max_num_seqs=8, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_ChatWords(), model_max_len=64,
                       eos_token_ids=set())
    with _Served(engine) as srv:
        prompt = {"messages": [{"role": "user", "content": "w11 w12"}], "max_tokens": 3, "stream": True,
                  "stop": ["w"]}  # every generated token's text starts with "w": the first one stops, no text
        r = httpx.post(srv.base + "/v1/chat/completions", json=prompt, timeout=30)
    assert r.status_code == 200, r.text
    chunks = [e for e in _events(r.text) if isinstance(e, dict)]
    last = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(last) == 1 and last[0]["choices"][0]["finish_reason"] == "stop", chunks
    assert last[0]["choices"][0]["delta"] == {}, last


class _ChatWords(_WordTokenizer):
    """The word tokenizer with a chat template that writes each message's words."""

    def apply_chat_template(self, conversation, tokenize=False, add_generation_prompt=True):
        return " ".join(m["content"] for m in conversation) + (" w1" if add_generation_prompt else "")


class _Positional(SimulatedExecutor):
    """The simulated executor, but every request's i-th output token is ``script[i]`` whatever its id (the server
    names requests with random ids)."""

    def __init__(self, script: list[int], **kw) -> None:
        super().__init__(**kw)
        self.script = script

    def execute(self, batch):
        out = super().execute(batch)
        for s in batch.seqs:
            if s.request.request_id in out:
                out[s.request.request_id] = self.script[len(s.request.output_token_ids)]
        return out


@pytest.fixture(scope="module")
def scripted(tokenizer):
    """A server whose every request generates `` ok done now`` then ``<|im_start|>`` and more words."""
    script = tokenizer.encode(" ok done now", add_special_tokens=False)
    script = script + [tokenizer.convert_tokens_to_ids("<|im_start|>")] + tokenizer.encode(" and on and on",
                                                                                            add_special_tokens=False)
    cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=128, device="cpu")
    engine = LLMEngine(cfg, executor=_Positional(script, vocab_size=len(tokenizer)), tokenizer=tokenizer,
                       model_max_len=128, eos_token_ids=set())
    with _Served(engine) as srv:
        yield srv, script


def _complete(srv, **body):
    r = httpx.post(srv.base + "/v1/completions", json={"prompt": "Hello", **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_stop_token_ids_reach_the_engine(scripted, tokenizer):
    """vLLM's ``stop_token_ids``: generation stops at the first listed id, finish_reason ``stop``, and that id's
    text is not in the output.  Oracle: the script and ``tokenizer.decode``.  Kills: the field dropped on its way
    to ``SamplingParams`` (the request ran to ``max_tokens``)."""
    srv, script = scripted
    body = _complete(srv, max_tokens=6, stop_token_ids=[script[2]])
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["text"] == tokenizer.decode(script[:2])


def test_include_stop_str_in_output_reaches_the_engine(scripted, tokenizer):
    """vLLM's ``include_stop_str_in_output``: the matched stop string stays at the end of the text.  Kills: the
    field dropped on its way to ``SamplingParams`` (the stop string cut as by default)."""
    srv, script = scripted
    text = tokenizer.decode(script[:3])
    assert text.endswith(" now") and " done" in text
    keep = _complete(srv, max_tokens=6, stop=[" done"], include_stop_str_in_output=True)["choices"][0]
    cut = _complete(srv, max_tokens=6, stop=[" done"])["choices"][0]
    assert keep["finish_reason"] == cut["finish_reason"] == "stop"
    assert keep["text"] == " ok done" and cut["text"] == " ok"


def test_skip_special_tokens_false_reaches_the_detokenizer(scripted, tokenizer):
    """vLLM's ``skip_special_tokens=false`` writes special tokens into the text, as ``tokenizer.decode(ids,
    skip_special_tokens=False)`` does; by default they are left out.  Kills: the field dropped on its way to
    ``SamplingParams``."""
    srv, script = scripted
    ids = script[:5]
    shown = _complete(srv, max_tokens=5, skip_special_tokens=False)["choices"][0]["text"]
    hidden = _complete(srv, max_tokens=5)["choices"][0]["text"]
    assert shown == tokenizer.decode(ids, skip_special_tokens=False) and "<|im_start|>" in shown
    assert hidden == tokenizer.decode(ids, skip_special_tokens=True)


def test_add_generation_prompt_false_reaches_the_chat_template(tokenizer):
    """vLLM's ``add_generation_prompt`` (default true): false renders the conversation without the assistant's
    opening, as ``apply_chat_template(add_generation_prompt=False)`` does, so ``usage.prompt_tokens`` is that
    rendering's length.  Kills: the field ignored (the assistant turn always opened)."""
    msgs = [{"role": "user", "content": "Name a colour."}]

    def count(flag: bool) -> int:
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=flag)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    assert count(True) > count(False)  # the case is real: the opening is some tokens long
    with _Served(_chat_engine(tokenizer)) as srv:
        got = {flag: httpx.post(srv.base + "/v1/chat/completions", timeout=30,
                                json={"messages": msgs, "max_tokens": 1, "add_generation_prompt": flag})
               for flag in (True, False)}
    for flag, r in got.items():
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == count(flag), flag


@pytest.mark.slow
def test_min_p_one_keeps_only_the_most_likely_token(small_llm):
    """``min_p`` keeps the tokens whose probability is at least ``min_p`` times the top one's, so ``min_p=1``
    samples only the argmax (ties aside): any seed at temperature 1 gives the greedy text.  The control: without
    ``min_p`` some seed strays from it.  Kills: ``min_p`` dropped on its way to ``SamplingParams``."""
    openai = pytest.importorskip("openai")
    from minivllm.server import BackgroundServer

    prompt = "The best thing about the weekend is"
    with BackgroundServer(small_llm.engine, "smol") as bg:
        client = openai.OpenAI(base_url=bg.base_url + "/v1", api_key="x", max_retries=0, timeout=60)

        def text(**kw) -> str:
            return client.completions.create(model="smol", prompt=prompt, max_tokens=12, **kw).choices[0].text

        greedy = text(temperature=0)
        assert {text(temperature=1.0, seed=s, extra_body={"min_p": 1.0}) for s in range(4)} == {greedy}
        assert any(text(temperature=1.0, seed=s) != greedy for s in range(4))


def test_the_models_path_with_a_trailing_slash_is_the_list():
    """``GET /v1/models/`` answers the list, as ``GET /v1/models`` does (the handler's documented rule; a client
    joining a base URL that ends in ``/`` sends it).  Kills: the empty name looked up as a model (a 404)."""
    cfg = EngineConfig(num_gpu_blocks_override=16, block_size=4, max_model_len=64, device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(), tokenizer=_WordTokenizer(), model_max_len=64)
    with _Served(engine) as srv:
        bare = httpx.get(srv.base + "/v1/models", timeout=30)
        slash = httpx.get(srv.base + "/v1/models/", timeout=30, follow_redirects=False)
    assert bare.status_code == slash.status_code == 200, slash.text
    assert slash.json() == bare.json() and slash.json()["object"] == "list"


def test_a_stop_given_as_one_string_is_one_stop_string(scripted, tokenizer):
    """OpenAI's ``stop`` is "a string or an array of strings": ``"stop": " done"`` is the one string `` done``,
    the same as ``[" done"]``.  Kills: the string taken as a sequence (each of its characters a stop string: the
    first space stopped the request before any text)."""
    srv, script = scripted
    one = _complete(srv, max_tokens=6, stop=" done")["choices"][0]
    listed = _complete(srv, max_tokens=6, stop=[" done"])["choices"][0]
    assert one == {**listed, "index": one["index"]}
    assert one["text"] == " ok" and one["finish_reason"] == "stop"
