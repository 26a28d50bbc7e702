"""An empty ``cache_salt`` is refused, at the engine's boundary and over HTTP, as vLLM refuses it.

vLLM's server answers ``"cache_salt": ""`` with a 400 ("must be a non-empty string if provided").  minivllm took it
silently: the server dropped a falsy salt and the engine folded ``""`` into "no salt", so a client that meant to
split its cache (a salt computed from an empty per-user value, say) shared its tenant's space without a word.

Nothing loads a model: the real engine runs on the simulated executor with the bundled model's tokenizer, behind
the real HTTP server, reached with the official ``openai`` client.  Oracles: vLLM's documented rule (a salt, when
given, is a non-empty string; a bad field is a 400 naming it), the OpenAI error body, and the prefix cache's
documented namespaces (the same prompt under one salt hits its own blocks and no others), read through
``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sim.executor import SimulatedExecutor

from sim_server import serving, small_engine  # (tests/ is on sys.path)

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

OK = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
PROMPT = "The quick brown fox jumps over the lazy dog, again and again, until the dog gives up."


def test_the_engine_refuses_an_empty_salt_and_queues_nothing(tokenizer):
    """``LLMEngine.add_request`` and ``LLM.generate`` both raise ``ValueError`` naming ``cache_salt``; no request
    is left behind and no block is held; a salted and an unsalted request are still served afterwards."""
    llm = LLM(executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
              num_gpu_blocks_override=32, max_model_len=128)
    engine = llm.engine
    calls = [lambda: engine.add_request({"prompt_token_ids": [5, 6, 7], "cache_salt": ""}, OK, "r"),
             lambda: llm.generate({"prompt_token_ids": [5, 6, 7], "cache_salt": ""}, OK, use_tqdm=False),
             lambda: llm.generate([{"prompt": "fine"}, {"prompt": "hi", "cache_salt": ""}], OK, use_tqdm=False)]
    for call in calls:
        with pytest.raises(ValueError, match=r"^cache_salt must be a non-empty string") as err:
            call()
        assert "leave it out" in str(err.value)
        assert not engine.requests and not engine.has_unfinished_requests()
        assert engine.pool.num_free == engine.pool.num_blocks
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7], "cache_salt": "s"}, {"prompt_token_ids": [5, 6, 7]}],
                        OK, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.fixture(scope="module")
def served(tokenizer):
    engine = small_engine(SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer)
    with serving(engine) as srv:
        yield srv


def _complete(served, **kw):
    return served.client.completions.create(model="sim", prompt=PROMPT, max_tokens=2, **kw)


def _chat(served, **kw):
    return served.client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hi there"}],
                                                 max_tokens=2, **kw)


@pytest.mark.parametrize("create", [_complete, _chat], ids=["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_empty_salt_is_a_400_naming_it_and_the_server_goes_on(served, create, stream):
    """A 400 in OpenAI's error shape with ``param: "cache_salt"`` -- streamed requests too, before any byte of
    the stream -- never a 5xx; the next request on the same server is served."""
    with pytest.raises(openai.BadRequestError) as err:
        create(served, stream=stream, extra_body={"cache_salt": ""})
    e = err.value
    assert e.status_code == 400
    assert e.param == "cache_salt" and e.type == "invalid_request_error"
    assert "non-empty string" in e.message
    after = create(served, extra_body={"cache_salt": "tenant-a-user-1"})
    assert after.usage.completion_tokens == 2


def test_a_non_empty_salt_still_splits_the_cache(served):
    """The same prompt: unsalted (caches it in the tenant's space), then under a fresh salt (a space of its own:
    nothing cached there yet), then under that salt again (its own blocks, now cached)."""
    plain = _complete(served)
    first = _complete(served, extra_body={"cache_salt": "fresh-salt"})
    again = _complete(served, extra_body={"cache_salt": "fresh-salt"})
    assert plain.usage.prompt_tokens > 8, "the case is real: the prompt spans several blocks"
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
