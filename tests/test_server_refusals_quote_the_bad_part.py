"""A refusal quotes the part of the request that is wrong -- clipped, and at the depth where it is wrong.

Two ways the server's 4xx messages failed the client reading them, found by a fresh-eyes hunt at the HTTP
boundary (stop 67):

* **Echoed whole.**  The server keeps its messages short on purpose (a wrong-typed value is quoted to 60
  characters, a bad entry of ``stop_token_ids`` alone, not the list; ``test_server_sim`` pins both), but three
  refusals quoted the client's whole input: the 404 for an unknown model (a 200 kB ``model`` came back as a
  200 kB message, on both endpoints and on ``GET /v1/models/{id}``), the 400 for an unknown chat role, and the
  400 for a ``stop`` list with an empty entry, which quoted every other stop string too.
* **The wrong member of a union speaking.**  ``prompt``, ``stop`` and a chat message's ``content`` each take a
  string *or* a list, and the server quoted pydantic's first error, the string member's: a content part
  without its ``type`` was answered "messages.0.content: Input should be a valid string" -- as if list content
  were not accepted at all -- and ``"prompt": [1.5]`` "prompt: Input should be a valid string".  The member the
  input's shape matched went deeper and knows the entry at fault; that error is the one to quote.

Nothing loads a model: the real engine on the simulated executor with the bundled tokenizer, behind the real
HTTP server, reached with the official ``openai`` client.  Oracles: each request's own construction (which
entry is bad, at which index) and the bound the other refusals already keep (under 300 characters).
"""

from __future__ import annotations

import pytest

from minivllm import SamplingParams
from minivllm.sim.executor import SimulatedExecutor

from sim_server import serving, small_engine  # (tests/ is on sys.path)

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

SHORT = 300  # the bound test_server_sim holds the stop and stop_token_ids refusals to
HUGE = 200_000


@pytest.fixture(scope="module")
def served(tokenizer):
    with serving(small_engine(SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer)) as srv:
        yield srv


def _refusal(call) -> tuple[int, dict]:
    with pytest.raises(openai.APIStatusError) as exc:
        call()
    return exc.value.status_code, exc.value.body  # the client unwraps {"error": {...}} into body


def _still_serves(served) -> None:
    """The refusal cost nothing: a plain request is answered (and ``serving`` checks no block is held)."""
    got = served.client.completions.create(model="sim", prompt="Hello", max_tokens=2,
                                           extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 2


def test_an_unknown_model_name_is_quoted_clipped_not_whole(served):
    """A 200 kB model name is a 404 naming ``model`` whose message starts quoting the name and stays short, on
    the completions, chat and model-card endpoints alike (it came back as a 200 kB message)."""
    name = "m" * HUGE
    calls = [lambda: served.client.completions.create(model=name, prompt="Hello", max_tokens=2),
             lambda: served.client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}]),
             lambda: served.client.models.retrieve("m" * 20_000)]
    for call in calls:
        status, err = _refusal(call)
        assert status == 404 and err["code"] == "model_not_found", err["message"][:200]
        assert "'mmmmmmmmmm" in err["message"] and "sim" in err["message"], err["message"][:200]
        assert len(err["message"]) < SHORT, len(err["message"])
    _still_serves(served)


def test_an_unknown_chat_role_is_quoted_clipped_not_whole(served):
    status, err = _refusal(lambda: served.client.chat.completions.create(
        model="sim", messages=[{"role": "r" * HUGE, "content": "Hi"}], max_tokens=2))
    assert status == 400 and err["param"] == "messages", err["message"][:200]
    assert "role must be one of" in err["message"] and "'rrrrrrrrrr" in err["message"], err["message"][:200]
    assert len(err["message"]) < SHORT, len(err["message"])
    _still_serves(served)


def test_an_empty_stop_string_is_named_by_its_index_not_by_quoting_the_list(served):
    """The empty entry is the fourth (index 3) after three long good ones: the 400 says where it is, and quotes
    none of the others whole."""
    stop = ["s" * 50_000, "t" * 50_000, "u" * 50_000, "", "v"]
    for create, kw in ((served.client.completions.create, {"prompt": "Hello"}),
                       (served.client.chat.completions.create, {"messages": [{"role": "user", "content": "Hi"}]})):
        status, err = _refusal(lambda: create(model="sim", max_tokens=2, stop=stop, **kw))
        assert status == 400 and err["param"] == "stop", err["message"][:200]
        assert "non-empty" in err["message"] and "index 3" in err["message"], err["message"][:200]
        assert len(err["message"]) < SHORT, len(err["message"])
    _still_serves(served)


def test_sampling_params_name_the_bad_stop_entry_without_quoting_the_list():
    """The same rule where the server's message comes from: ``SamplingParams``, which ``LLM.generate`` callers
    meet directly.  A lone empty string is quoted as itself."""
    with pytest.raises(ValueError, match=r"^stop must be a non-empty string") as exc:
        SamplingParams(stop=["x" * HUGE, ""])
    assert "index 1" in str(exc.value) and len(str(exc.value)) < SHORT
    with pytest.raises(ValueError, match=r"got ''$"):
        SamplingParams(stop="")


@pytest.mark.parametrize("path, body, where, what", [
    # a content part without its type: list content *is* accepted, the part is what is wrong
    ("chat", {"messages": [{"role": "user", "content": [{"text": "Hi"}]}]}, "messages.0.content.0.type", "Field required"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content.0.text",
     "valid string"),
    # a token-id prompt with a float in it, and one in the second of a list of token-id prompts
    ("completions", {"prompt": [1.5]}, "prompt.0", "valid integer"),
    ("completions", {"prompt": [[1, "a"]]}, "prompt.0.1", "valid integer"),
    ("completions", {"prompt": "Hi", "stop": ["ok", 7]}, "stop.1", "valid string"),
    # members equally deep: the one that accepted more entries names the wrong one (the token-id member stops at
    # entry 0 of a list of strings, the string member at the odd one out)
    ("completions", {"prompt": ["a", 5]}, "prompt.1", "valid string"),
    ("completions", {"prompt": ["a", "b", 5]}, "prompt.2", "valid string"),
    ("completions", {"prompt": [1, 2, "a"]}, "prompt.2", "valid integer"),
    # ... by where each member *first* fails: the string member also fails at the good token id after the bad one
    ("completions", {"prompt": [1, 2, "a", 3]}, "prompt.2", "valid integer"),
    ("completions", {"prompt": ["a", "b", "c", 5, "d"]}, "prompt.3", "valid string"),
    ("completions", {"prompt": "Hi", "stop": ["a", 5, 6]}, "stop.1", "valid string"),
])
def test_a_wrong_entry_inside_a_list_is_named_where_it_is(served, path, body, where, what):
    """Oracle: the body's own construction -- the one entry that is wrong, and its path.  The message must name
    that path and say what the entry should be, not that the whole field should have been a string."""
    create = served.client.chat.completions.create if path == "chat" else served.client.completions.create
    fields = {"model": "sim", "max_tokens": 2, **body}
    status, err = _refusal(lambda: create(**fields))
    assert status == 400 and err["param"] == where.split(".")[0], err
    assert err["message"].startswith(f"{where}: ") and what in err["message"], err["message"]
    _still_serves(served)


@pytest.mark.parametrize("field, value, kind", [("prompt", 5, "valid string"), ("stop", 5, "valid string"),
                                                ("messages", "Hi", "valid list")])
def test_a_wrong_type_for_the_whole_field_is_still_named_at_the_field(served, field, value, kind):
    """A value no member of the union accepts at all stays one message about the field (the rule above must not
    send it digging into one member's inside)."""
    chat = field == "messages"
    body = {"model": "sim", "max_tokens": 2, field: value}
    if not chat and field != "prompt":
        body["prompt"] = "Hi"
    create = served.client.chat.completions.create if chat else served.client.completions.create
    status, err = _refusal(lambda: create(**body))
    assert status == 400 and err["param"] == field, err
    assert err["message"].startswith(f"{field}: ") and kind in err["message"], err["message"]


@pytest.mark.parametrize("bad", [
    pytest.param(lambda big: [{"role": "user", "text": big}], id="message without content"),
    pytest.param(lambda big: [{"role": "user", "content": [big]}], id="content part not a dict"),
    pytest.param(lambda big: [{"role": big, "content": 5}], id="content not a string"),
])
def test_chat_refusals_below_http_are_clipped_too(tokenizer, bad):
    """``LLM.chat`` and ``engine.inputs.encode_chat`` callers (no HTTP in front: pydantic never sees these) get the
    same short quotes: a malformed message carrying a 200 kB string is refused with a message that starts
    quoting it and stays under the bound (each quoted the whole message before)."""
    engine = small_engine(SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer)
    with pytest.raises(ValueError) as exc:
        engine.inputs.encode_chat(bad("x" * HUGE))
    assert len(str(exc.value)) < SHORT and "xxx" in str(exc.value), str(exc.value)[:400]


@pytest.mark.parametrize("field", ["n", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed",
                                   "ignore_eos", "output_kind", "stop_token_ids"])
def test_sampling_params_refusals_quote_a_huge_value_clipped(field):
    """The Python API's own boundary: ``SamplingParams`` with a 200 kB string where a number, a flag or a list
    belongs is refused with a message that names the field and stays under the bound (each quoted the value
    whole, a 200,050-character error for ``stop_token_ids``; over HTTP pydantic's types refuse such values
    first, so only a direct caller met it)."""
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{field: "x" * HUGE})
    assert field in str(exc.value) and len(str(exc.value)) < SHORT, str(exc.value)[:400]


@pytest.mark.parametrize("case", ["token id", "request id", "arrival time"])
def test_add_request_refusals_quote_a_huge_value_clipped(tokenizer, case):
    """``LLMEngine.add_request`` with a 200 kB string as a prompt token id, as the request id or as the arrival
    time: refused with a message naming what is wrong that stays under the bound, nothing queued."""
    engine = small_engine(SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer)
    big = "x" * HUGE
    prompt, kw, says = {"prompt_token_ids": [1, 2]}, {}, ""
    if case == "token id":
        prompt, says = {"prompt_token_ids": [1, big]}, "prompt token ids must be integers"
    elif case == "request id":
        kw, says = {"request_id": ["r"] * HUGE}, "request_id must be a non-empty string"
    else:
        kw, says = {"request_id": "r0", "arrival_time": big}, "arrival_time must be a finite number"
    with pytest.raises(ValueError) as exc:
        engine.add_request(prompt, SamplingParams(max_tokens=2), **kw)
    assert says in str(exc.value) and len(str(exc.value)) < SHORT, str(exc.value)[:400]
    assert not engine.has_unfinished_requests()


def test_a_duplicate_huge_request_id_is_quoted_clipped(tokenizer):
    """The same 200 kB request id sent twice: the second is refused as a duplicate with a short message, and the
    first still runs to its end (the review found this refusal and the sample-id clashes quoting the id whole)."""
    engine = small_engine(SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer)
    rid = "r" * HUGE
    engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, ignore_eos=True), rid)
    with pytest.raises(ValueError) as exc:
        engine.add_request({"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=2), rid)
    assert "duplicate request id" in str(exc.value) and len(str(exc.value)) < SHORT, str(exc.value)[:400]
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [len(o.outputs[0].token_ids) for o in done] == [2]
