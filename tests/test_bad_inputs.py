"""Every bad input a caller can send gets a clear ``ValueError`` at the boundary -- and the engine keeps serving.

One table, one row per bad input, across engine options, sampling parameters, prompts, request fields
and chat messages.  After each row the same engine must still serve a good request and hold no blocks.
The engine runs on the simulated executor with the bundled model's real tokenizer (chat template,
special tokens, byte-level BPE), so the whole table needs no forward pass.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.sim import SimulatedExecutor
from tests.invariants import steps

OK = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def api(tokenizer):
    llm = LLM(executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
              num_gpu_blocks_override=64, max_model_len=256)
    llm.engine.inputs.vocab_size = len(tokenizer)
    return llm


def sp(**kw):
    return lambda llm: llm.generate(["hi"], SamplingParams(**kw), use_tqdm=False)


def opt(**kw):
    return lambda llm: EngineConfig(**kw)


def gen(prompt, params=OK):
    return lambda llm: llm.generate(prompt, params, use_tqdm=False)


def add(prompt={"prompt_token_ids": [1, 2, 3]}, params=OK, **kw):  # noqa: B006 - never mutated
    return lambda llm: llm.engine.add_request(prompt, params, **kw)


def chat(messages):
    return lambda llm: llm.chat(messages, OK, use_tqdm=False)


CASES = [
    # engine options
    ("block_size not a power of two", opt(block_size=12), "power of two"),
    ("block_size zero", opt(block_size=0), "power of two"),
    ("block_size float", opt(block_size=16.0), "block_size"),
    ("max_num_seqs float", opt(max_num_seqs=2.5), "max_num_seqs"),
    ("max_num_seqs zero", opt(max_num_seqs=0), "max_num_seqs"),
    ("max_num_seqs bool", opt(max_num_seqs=True), "max_num_seqs"),
    ("max_model_len negative", opt(max_model_len=-5), "max_model_len"),
    ("max_model_len string", opt(max_model_len="4k"), "max_model_len"),
    ("token budget zero", opt(max_num_batched_tokens=0), "max_num_batched_tokens"),
    ("threshold negative", opt(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    ("chunked prefill as string", opt(enable_chunked_prefill="yes"), "enable_chunked_prefill"),
    ("prefix caching as int", opt(enable_prefix_caching=1), "enable_prefix_caching"),
    ("unknown prefix cache kind", opt(prefix_cache="lru"), "prefix_cache"),
    ("unknown preemption mode", opt(preemption_mode="kill"), "preemption_mode"),
    ("negative swap space", opt(swap_space=-1), "swap_space"),
    ("zero swap bandwidth", opt(swap_bandwidth_gbps=0), "swap_bandwidth_gbps"),
    ("unknown attention backend", opt(attention_backend="flash"), "attention_backend"),
    ("unknown dtype", opt(dtype="int4"), "dtype"),
    ("unknown device", opt(device="tpu"), "device"),
    ("seed as string", opt(seed="abc"), "seed"),
    ("seed beyond 63 bits", opt(seed=2**64), "seed"),
    ("gpu_memory_utilization above 1", opt(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    ("zero KV blocks", opt(num_gpu_blocks_override=0), "num_gpu_blocks_override"),
    ("zero KV bytes", opt(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
    ("negative quota", opt(prefix_cache_quota_blocks=-1), "prefix_cache_quota_blocks"),
    ("unknown LLM option", lambda llm: LLM(executor=SimulatedExecutor(), max_num_sequences=4), "unknown engine option"),
    ("max_model_len beyond the model", lambda llm: EngineConfig(max_model_len=10**6).resolve(8192), "trained"),
    ("chunking off with a small budget",
     lambda llm: EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=16).resolve(8192), "chunked prefill off"),
    ("chunking off with a small long-prefill threshold (a longer prompt was admitted and never scheduled)",
     lambda llm: EngineConfig(enable_chunked_prefill=False, long_prefill_token_threshold=5, max_model_len=64,
                              max_num_batched_tokens=64).resolve(64), "long_prefill_token_threshold"),
    # sampling parameters
    ("n zero", sp(n=0), "n must"),
    ("n bool", sp(n=True), "n must"),
    ("n float", sp(n=2.0), "n must"),
    ("temperature negative", sp(temperature=-0.1), "temperature"),
    ("temperature nan", sp(temperature=float("nan")), "temperature"),
    ("temperature inf", sp(temperature=float("inf")), "temperature"),
    ("temperature string", sp(temperature="hot"), "temperature"),
    ("temperature bool (True is not 1.0)", sp(temperature=True), "temperature"),
    ("top_p bool", sp(top_p=True), "top_p"),
    ("top_p zero", sp(top_p=0.0), "top_p"),
    ("top_p above one", sp(top_p=1.5), "top_p"),
    ("top_k below -1", sp(top_k=-2), "top_k"),
    ("top_k float", sp(top_k=5.5), "top_k"),
    ("min_p above one", sp(min_p=1.2), "min_p"),
    ("max_tokens zero", sp(max_tokens=0), "max_tokens"),
    ("max_tokens bool", sp(max_tokens=True), "max_tokens"),
    ("max_tokens float", sp(max_tokens=8.0), "max_tokens"),
    ("seed string", sp(seed="abc"), "seed"),
    ("seed negative", sp(seed=-1), "seed"),
    ("seed beyond 63 bits", sp(seed=2**64), "seed"),
    ("stop empty string", sp(stop=""), "stop"),
    ("stop list with a non-string", sp(stop=["a", 3]), "stop"),
    ("stop as a number", sp(stop=5), "stop"),
    ("stop_token_ids negative", sp(stop_token_ids=[-1]), "stop_token_ids"),
    ("stop_token_ids as int", sp(stop_token_ids=7), "stop_token_ids"),
    ("stop_token_ids with a bool (True is not token 1)", sp(stop_token_ids=[5, True]), "stop_token_ids"),
    ("ignore_eos as string", sp(ignore_eos="false"), "ignore_eos"),
    ("skip_special_tokens as string", sp(skip_special_tokens="no"), "skip_special_tokens"),
    ("include_stop_str_in_output as int", sp(include_stop_str_in_output=1), "include_stop_str_in_output"),
    # prompts
    ("empty text", gen(""), "empty prompt"),
    ("empty token list", gen({"prompt_token_ids": []}), "empty"),
    ("bare list of ints", gen([1, 2, 3]), "ambiguous"),
    ("prompt is a number", gen(3.5), "prompts must"),
    ("token id negative", gen({"prompt_token_ids": [1, -2]}), "token ids"),
    ("token id -1, the usual padding id: the lowest a fast path could let through",
     gen({"prompt_token_ids": [1, -1]}), "token ids"),
    ("token id past the vocabulary", gen({"prompt_token_ids": [1, 10**9]}), "token ids"),
    ("token id = vocabulary size", lambda llm: llm.generate({"prompt_token_ids": [llm.engine.inputs.vocab_size]},
                                                              OK, use_tqdm=False), "token ids"),
    ("token id bool", gen({"prompt_token_ids": [True, 2]}), "token ids"),
    ("token id string", gen({"prompt_token_ids": ["a"]}), "token ids"),
    ("token ids not a list", gen({"prompt_token_ids": "1 2 3"}), "prompt_token_ids"),
    ("dict without a prompt", gen({"text": "hi"}), "needs 'prompt' or 'prompt_token_ids'"),
    ("dict with both prompt forms", gen({"prompt": "hi", "prompt_token_ids": [1, 2]}), "not both"),
    ("dict with an unknown field", gen({"prompt": "hi", "user": "bob"}), "unknown prompt field"),
    ("prompt field not a string", gen({"prompt": 5}), "'prompt' must be a string"),
    ("lone surrogate", gen("bad \ud800 text"), "Unicode"),
    ("prompt fills max_model_len", gen({"prompt_token_ids": [5] * 256}), "max_model_len"),
    ("params list of the wrong length", lambda llm: llm.generate(["a", "b"], [OK], use_tqdm=False), "sampling params"),
    ("params of the wrong type", lambda llm: llm.generate(["a"], {"temperature": 0}, use_tqdm=False), "sampling_params"),
    ("one bad prompt in a batch", gen(["fine", ""]), "empty prompt"),
    # request fields
    ("request id empty", add(request_id=""), "request_id"),
    ("request id not a string", add(request_id=7), "request_id"),
    ("tenant empty", add(tenant=""), "tenant"),
    ("tenant not a string", add(tenant=5), "tenant"),
    ("cache_salt not a string", add({"prompt_token_ids": [1, 2], "cache_salt": 5}), "cache_salt"),
    # vLLM's rule: a salt, when given, is non-empty; "" is not a quiet "no salt"
    ("cache_salt empty", add({"prompt_token_ids": [1, 2], "cache_salt": ""}), "cache_salt must be a non-empty"),
    ("cache_salt empty via generate", gen({"prompt": "hi", "cache_salt": ""}), "cache_salt must be a non-empty"),
    ("priority as a word", add(priority="high"), "priority"),
    ("priority float", add(priority=0.5), "priority"),
    ("arrival_time as a string", add(arrival_time="x"), "arrival_time"),
    ("arrival_time nan", add(arrival_time=float("nan")), "arrival_time"),
    ("arrival_time a bool", add(arrival_time=True), "arrival_time"),  # a bool is an int to Python, not a time
    ("params not SamplingParams", add(params={"max_tokens": 3}), "SamplingParams"),
    # chat
    ("chat content None", chat([{"role": "user", "content": None}]), "content"),
    ("chat message without a role", chat([{"content": "hi"}]), "role"),
    ("chat message not a dict", chat(["hi"]), "role"),
    ("chat role not a string", chat([{"role": 1, "content": "hi"}]), "role"),
    ("chat role misspelt", chat([{"role": "asistant", "content": "hi"}, {"role": "user", "content": "hi"}]),
     "role must be one of"),
    ("chat with no messages", chat([]), "conversation"),
    ("chat given one message, not a list", chat({"role": "user", "content": "hi"}), "conversation"),
    ("chat given a number", chat(5), "conversation"),
    ("chat content with a lone surrogate", chat([{"role": "user", "content": "bad \ud800 text"}]),
     "message 0's content is not valid Unicode"),
    ("chat role with a lone surrogate", chat([{"role": "user", "content": "hi"}, {"role": "\udfff", "content": "x"}]),
     "message 1's role is not valid Unicode"),
    # sampling limits
    ("n past 128", sp(n=129), "n must"),
    # aborts
    ("abort with a list id", lambda llm: llm.engine.abort_request(["x"]), "request_id"),
]


def test_the_table_is_large():
    assert len(CASES) >= 60


@pytest.mark.parametrize("name,call,match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error_and_the_engine_keeps_serving(api, name, call, match):
    with pytest.raises(ValueError, match=match):
        call(api)
    engine = api.engine
    assert not engine.requests and not engine.has_unfinished_requests(), "a bad request was left behind"
    out = api.generate(["still serving?"], OK, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert engine.pool.num_free == engine.pool.num_blocks


def test_duplicate_and_clashing_ids(api):
    engine = api.engine
    engine.add_request({"prompt_token_ids": [1, 2]}, OK, "dup")
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request({"prompt_token_ids": [1, 2]}, OK, "dup")
    engine.add_request({"prompt_token_ids": [1, 2]}, OK, "k#0")
    with pytest.raises(ValueError, match="clashes"):
        engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(n=2, max_tokens=2), "k")
    # the other way round: a group's sample id may not be an n > 1 group's own id either ("k#0" is, above)
    engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(n=2, max_tokens=2), "g#0")
    with pytest.raises(ValueError, match="clashes"):
        engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(n=2, max_tokens=2), "g")
    engine.abort_request("dup")
    engine.abort_request("k#0")
    engine.abort_request("g#0")
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_finished_samples_id_stays_reserved_while_its_group_lives(api):
    """``g#0`` names sample 0 of group ``g`` for as long as ``g`` lives, even once that sample is gone.  Taken
    by a caller, aborting ``g`` removed the caller's request from the engine's tables while the scheduler kept
    it: the next step raised KeyError."""
    engine = api.engine
    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=2, max_tokens=8, ignore_eos=True), "g")
    engine.step()
    assert engine.abort_request("g#0")  # one sample ends; the group goes on
    engine.step()  # (which reports it, and forgets it)
    assert "g#0" not in engine.requests and "g" in engine._groups
    with pytest.raises(ValueError, match="clashes"):
        engine.add_request({"prompt_token_ids": [1, 2]}, OK, "g#0")
    engine.add_request({"prompt_token_ids": [1, 2]}, OK, "g#x")  # not shaped like a sample id: fine
    assert engine.abort_request("g")
    outs = []
    for new in steps(engine):
        outs += new
    assert [o.request_id for o in outs if o.finished] == ["g#x"]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_stop_strings_without_a_tokenizer_are_refused():
    """Stop strings are matched on detokenized text.  An engine with no tokenizer (a simulated one, or a model
    folder without one) has no text, so they were accepted and never matched: the request ran to max_tokens."""
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=16, max_model_len=64)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, stop=["x"]), "s")
    llm.engine.add_request({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, stop_token_ids=[7]), "t")
    assert list(llm.engine.requests) == ["t"]
