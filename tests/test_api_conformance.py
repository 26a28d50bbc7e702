"""OpenAI-API conformance the official client sees: fields the server cannot honour are refused, not dropped.

The oracle is the request itself: ``bad_words=[" Paris"]`` on a prompt whose greedy continuation is " Paris"
must not come back containing " Paris"; minivllm cannot ban words, so the only correct answers are a 400 naming
the field.  A chat role outside OpenAI's set is a 400 as OpenAI answers (a typo'd role would otherwise be
written into the template as a turn the model never saw).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

PROMPT = "The capital of France is"  # greedy: " Paris."


@pytest.fixture(scope="module")
def client(small_llm):
    from minivllm.server import BackgroundServer

    with BackgroundServer(small_llm.engine, "smol") as bg:
        yield openai.OpenAI(base_url=bg.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert small_llm.engine.pool.num_free == small_llm.engine.pool.num_blocks, "KV blocks leaked"


def _complete(client, **extra):
    return client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra)


def test_greedy_continuation_is_paris(client):
    assert _complete(client).choices[0].text.startswith(" Paris")  # what the refusals below would change


@pytest.mark.parametrize("field, value", [
    ("bad_words", [" Paris", "Paris"]),
    ("allowed_token_ids", [1]),
    ("truncate_prompt_tokens", 2),
    ("logits_processors", ["pkg.mod:fn"]),
    ("response_format", {"type": "json_object"}),
])
def test_completion_fields_that_change_the_output_are_refused(client, field, value):
    with pytest.raises(openai.BadRequestError) as exc:
        _complete(client, **{field: value})
    assert exc.value.body["param"] == field and exc.value.body["code"] == "unsupported"


@pytest.mark.parametrize("field, value", [("bad_words", []), ("logits_processors", []), ("allowed_token_ids", None),
                                          ("truncate_prompt_tokens", None), ("response_format", {"type": "text"})])
def test_their_no_op_values_are_accepted(client, field, value):
    assert _complete(client, **{field: value}).choices[0].text.startswith(" Paris")


@pytest.mark.parametrize("field, value", [("modalities", ["text", "audio"]), ("audio", {"voice": "alloy", "format": "wav"}),
                                          ("function_call", {"name": "get_weather"})])
def test_chat_fields_asking_for_other_output_are_refused(client, field, value):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       extra_body={field: value})
    assert exc.value.body["param"] == field


def test_chat_text_modality_is_fine(client):
    r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       modalities=["text"], function_call="auto")
    assert r.choices[0].message.content


@pytest.mark.parametrize("message, match", [
    ({"role": "asistant", "content": "x"}, "role must be one of"),
    ({"role": "wizard", "content": "x"}, "role must be one of"),
    ({"role": "user"}, "needs content"),
    ({"role": "system", "content": None}, "needs content"),
])
def test_bad_chat_messages_are_400(client, message, match):
    with pytest.raises(openai.BadRequestError, match=match) as exc:
        client.chat.completions.create(model="smol", messages=[message, {"role": "user", "content": "Hi"}], max_tokens=2)
    assert exc.value.body["param"] == "messages"


def test_assistant_without_content_and_developer_role_are_fine(client):
    r = client.chat.completions.create(model="smol", max_tokens=2, messages=[
        {"role": "developer", "content": "Be terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None}, {"role": "user", "content": "Again"}])
    assert r.choices[0].finish_reason in ("stop", "length")
