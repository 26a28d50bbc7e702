"""What a client reads in a *successful* answer of the OpenAI-compatible server: usage counts, each choice's
``finish_reason`` and ``index``, the ``model`` it names, the streamed chunk sequence.

Written from a mutation pass over ``minivllm/server/api_server.py`` past its refusals: each test names the planted
bug it kills, one that every fast server test (those without a model) let through.  One server for the module, no
model: the real engine on a simulated executor behind the real HTTP server, with the default model's Hugging Face
tokenizer (so its chat template) and prefix caching on.  Oracles: the official ``openai`` client's parsing of
each answer, HF's ``tokenizer.encode`` / ``apply_chat_template`` for token counts, the executor's scripted ending
for finish reasons, and the OpenAI API's documented semantics (``usage.prompt_tokens`` counts the whole prompt,
cached or not; ``prompt_tokens_details.cached_tokens`` is the part of it served from cache).
"""

from __future__ import annotations

import time

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from minivllm.sim.executor import SimulatedExecutor  # noqa: E402
from minivllm.sim.roofline import fake_token  # noqa: E402

from sim_server import serving, small_engine  # noqa: E402  (tests/ is on sys.path)

EOS = 0
MAX_TOKENS = 6


class _SampleOneStops(SimulatedExecutor):
    """Tokens drawn from the prompt and the sample's number, not the request id, so the same prompt sent twice
    gets the same answer (a test reads an answer, then asks again with a stop string cut from it).  Sample ``#1``
    of an ``n > 1`` request draws EOS (token 0) as its third token; no other row does (``fake_token`` never
    draws 0-9)."""

    def execute(self, batch):
        out = super().execute(batch)
        for s in batch.seqs:
            req = s.request
            if req.request_id not in out:
                continue
            sample = req.request_id.rpartition("#")[2] if "#" in req.request_id else ""
            token = fake_token(f"{req.prompt_token_ids}#{sample}", req.num_tokens, self.vocab_size)
            if sample == "1" and len(req.output_token_ids) == 2:
                token = EOS
            out[req.request_id] = token
        return out


@pytest.fixture(scope="module")
def served(tokenizer):
    """The server, serving the engine as ``sim`` and as ``sim-alias`` (``BackgroundServer``'s aliases)."""
    engine = small_engine(_SampleOneStops(vocab_size=len(tokenizer)), tokenizer, eos_token_ids={EOS})
    with serving(engine, aliases=("sim-alias",)) as srv:
        yield srv


def test_prompt_tokens_count_the_whole_prompt_when_part_of_it_was_cached(served, tokenizer):
    """OpenAI: ``usage.prompt_tokens`` is the prompt's length, and ``prompt_tokens_details.cached_tokens`` says
    how much of it came from the cache -- a subset, not a discount (``total_tokens`` = prompt + completion).  The
    same prompt twice: the second is served partly from the prefix cache and must report the same prompt length.
    Oracle: HF's ``tokenizer.encode`` of the prompt.  Kills: ``prompt_tokens`` less the cached tokens."""
    prompt = "The quick brown fox jumps over the lazy dog, again and again, until the dog gives up."
    want = len(tokenizer.encode(prompt))
    first = served.client.completions.create(model="sim", prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    again = served.client.completions.create(model="sim", prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    assert again.usage.prompt_tokens_details.cached_tokens > 0, "the case is real: the repeat hit the cache"
    for got in (first, again):
        assert got.usage.prompt_tokens == want
        assert got.usage.total_tokens == want + got.usage.completion_tokens == want + 3
        assert got.usage.prompt_tokens_details.cached_tokens <= want


def _chat(served, **kw):
    return served.client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hi there"}],
                                                 max_tokens=MAX_TOKENS, n=3, temperature=1.0, seed=3, **kw)


def test_each_chat_choice_reports_its_own_finish_reason_plain_and_streamed(served):
    """With ``n > 1`` chat choices end independently, as completion choices do: choice 1 stops at EOS, the others
    run to ``max_tokens`` and say ``length`` (how a client tells a truncated answer from a finished one).
    Oracle: the executor's script, read through the official client.
    Kills: the non-streamed chat answer giving every choice the first finish reason, and the streamed chat
    chunk saying ``stop`` for a choice cut by ``max_tokens``."""
    want = {0: "length", 1: "stop", 2: "length"}
    plain = _chat(served)
    assert {c.index: c.finish_reason for c in plain.choices} == want
    assert plain.usage.completion_tokens == MAX_TOKENS + 3 + MAX_TOKENS  # the EOS is generated (vLLM counts it)
    streamed: dict[int, str] = {}
    for chunk in _chat(served, stream=True):
        for c in chunk.choices:
            if c.finish_reason:
                assert c.index not in streamed, "a choice finishes once"
                streamed[c.index] = c.finish_reason
    assert streamed == want


def test_a_stream_with_stream_options_but_no_include_usage_gets_no_usage_chunk(served):
    """OpenAI: ``include_usage`` "if set" adds the usage chunk; ``stream_options`` without it (``{}``) asks for
    nothing, so the stream is the plain one: every chunk has a choice, none carries usage.
    Kills: ``include_usage`` defaulting to true when ``stream_options`` is given."""
    for create, kw in ((served.client.completions.create, {"prompt": "Hello"}),
                       (served.client.chat.completions.create, {"messages": [{"role": "user", "content": "Hi"}]})):
        chunks = list(create(model="sim", max_tokens=3, stream=True, stream_options={}, **kw))
        assert chunks and all(c.choices for c in chunks), "no usage-only chunk"
        assert all(c.usage is None for c in chunks)


def test_the_chat_prompt_is_the_hf_chat_template_of_the_messages_as_sent(served, tokenizer):
    """The prompt a chat request runs is the conversation written by the model's chat template, as HF's
    ``apply_chat_template`` writes it: an empty system turn stays empty, and text content parts are joined by
    newlines (vLLM's rule, the one ``InputProcessor.encode_chat`` documents).  A client sees the prompt two ways:
    ``usage.prompt_tokens`` (its length), and the prefix cache -- HF's token ids sent next as a completion prompt
    are served from the blocks the chat request cached, all but the last few, only if the ids are the same.
    Kills: an empty content written as a space (same length here: "\n " is one token), parts joined by spaces."""
    block = served.async_engine.engine.config.block_size
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word."}]
    cases = [([{"role": "system", "content": ""}, {"role": "user", "content": "Say hello to the reader."}],
              [{"role": "system", "content": ""}, {"role": "user", "content": "Say hello to the reader."}]),
             ([{"role": "user", "content": parts}], [{"role": "user", "content": "Name a colour.\nOne word."}])]
    for sent, oracle in cases:
        want = tokenizer.apply_chat_template(oracle, add_generation_prompt=True, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = served.client.chat.completions.create(model="sim", messages=sent, max_tokens=1)
        assert got.usage.prompt_tokens == len(want), sent
        again = served.client.completions.create(model="sim", prompt=want, max_tokens=1)
        assert again.usage.prompt_tokens_details.cached_tokens >= len(want) - block, sent


def test_every_stop_string_of_a_list_cuts_the_text(served):
    """OpenAI's ``stop`` takes up to four sequences and generation stops at whichever comes first; the text
    returned excludes it.  The answer is read once without ``stop``; asked again (same prompt, same answer) with
    a stop list whose *second* string is a piece of that answer, the text ends just before the piece's first
    occurrence, with ``finish_reason == "stop"``.  Oracle: ``str.find`` on the unstopped text.
    Kills: only the first string of a stop list reaching the engine."""
    kw = {"model": "sim", "prompt": "Tell me a story", "max_tokens": 16, "extra_body": {"ignore_eos": True}}
    full = served.client.completions.create(**kw).choices[0].text
    k = next(k for k in range(len(full) // 2, len(full) - 3) if full[k:k + 3].isascii() and full[k:k + 3].isalpha())
    piece = full[k:k + 3]
    cut = served.client.completions.create(**kw, stop=["\x01never", piece]).choices[0]
    assert (cut.text, cut.finish_reason) == (full[:full.find(piece)], "stop")


def test_a_completion_without_max_tokens_gets_openais_default_of_16(served):
    """OpenAI's completions endpoint documents ``max_tokens`` defaulting to 16 (chat's has no such default).
    EOS never comes here, so the answer is exactly 16 tokens, cut by length.
    Kills: no default (the answer running to the end of the context)."""
    got = served.client.completions.create(model="sim", prompt="Once upon a time")
    assert (got.usage.completion_tokens, got.choices[0].finish_reason) == (16, "length")


def test_every_answer_names_the_model_asked_for_and_its_creation_second(served):
    """OpenAI: ``model`` is "the model used" -- the name the client asked for, an alias included -- and
    ``created`` is a Unix timestamp in seconds.  Checked on both endpoints, plain and streamed (every chunk),
    and for a body with no ``model`` (the first served name, as vLLM answers).  Oracle: the request's own
    ``model`` and the wall clock around the call.
    Kills: a chat answer or a chat chunk naming the first served model, ``created`` in milliseconds, a
    completion's id with chat's prefix, and an omitted ``model`` answered as the last served name."""
    for name in ("sim-alias", "sim"):
        before = int(time.time())
        answers = [served.client.completions.create(model=name, prompt="Hi", max_tokens=2),
                   served.client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                         max_tokens=2)]
        answers += list(served.client.completions.create(model=name, prompt="Hi", max_tokens=2, stream=True))
        answers += list(served.client.chat.completions.create(model=name, max_tokens=2, stream=True,
                                                              messages=[{"role": "user", "content": "Hi"}]))
        after = int(time.time())
        assert len(answers) > 4
        for a in answers:
            assert a.model == name, (name, a)
            assert before <= a.created <= after, (before, a.created, after)
            # OpenAI's id prefixes: "cmpl-" for a completion, "chatcmpl-" for a chat completion and its chunks
            assert a.id.startswith("chatcmpl-" if a.object.startswith("chat.") else "cmpl-"), a
        # one id per request: a stream's chunks share it, two requests never do
        assert len({a.id for a in answers}) == 4
    r = httpx.post(served.base_url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "sim", r.text


def test_the_models_endpoint_lists_every_served_name_with_its_context_length(served):
    """``/v1/models`` lists each name the server answers to (``models.list``), and ``models.retrieve(name)`` is
    that name's card; vLLM's cards carry ``max_model_len``, the engine's context length (256 here).
    Kills: only the first name listed, a retrieved alias's card naming the first model, ``max_model_len`` left out."""
    cards = served.client.models.list().data
    assert [c.id for c in cards] == ["sim", "sim-alias"]
    alias = served.client.models.retrieve("sim-alias")
    assert alias.id == "sim-alias" and alias.owned_by
    assert {getattr(c, "max_model_len", None) for c in [*cards, alias]} == {256}
