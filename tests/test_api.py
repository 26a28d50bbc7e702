"""The public API on the real default model: bad input, streaming, stops, seeds, chat, CLI."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.engine.detokenizer import IncrementalDetokenizer
from tests.invariants import steps

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def _assert_still_serving(llm):
    out = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) >= 1
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", GREEDY, "empty prompt"),
        ({"prompt_token_ids": []}, GREEDY, "empty"),
        ({"prompt_token_ids": [1] * 600}, GREEDY, "max_model_len"),
        (3.5, GREEDY, "prompt must be a string"),
        ({"prompt_token_ids": ["a", "b"]}, GREEDY, "token ids must be integers"),
        ({"prompt_token_ids": [1, 10**9]}, GREEDY, "token ids must be integers"),
        ({"text": "hi"}, GREEDY, "needs 'prompt' or 'prompt_token_ids'"),
        ("hi", "not params", "SamplingParams"),
    ],
)
def test_bad_prompts_raise_and_engine_keeps_serving(small_llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        small_llm.generate([prompt], params, use_tqdm=False)
    _assert_still_serving(small_llm)


def test_bad_batch_adds_nothing(small_llm):
    with pytest.raises(ValueError):
        small_llm.generate(["fine", ""], GREEDY, use_tqdm=False)
    assert not small_llm.engine.has_unfinished_requests()
    _assert_still_serving(small_llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"stop": [""]}, "stop"),
        ({"n": 0}, "n must be"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_duplicate_request_id(small_llm):
    engine = small_llm.engine
    engine.add_request("Hi", GREEDY, request_id="dup")
    with pytest.raises(ValueError, match="duplicate request id"):
        engine.add_request("Hi again", GREEDY, request_id="dup")
    for _ in steps(engine):
        pass
    _assert_still_serving(small_llm)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"block_size": 12}, "power of two"),
        ({"num_gpu_blocks_override": 3, "max_model_len": 512}, "cannot hold one request"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"attention_backend": "cuda-magic"}, "attention_backend"),
        ({"no_such_option": 1}, "unknown engine option"),
        ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 512}, "chunked prefill off"),
    ],
)
def test_bad_engine_options(options, match):
    with pytest.raises(ValueError, match=match):
        LLM(**options)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ValueError, match="unknown model|not an HF model directory|neither"):
        LLM(str(tmp_path / "nope" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path / "empty"))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        LLM(str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        LLM(str(path))


def test_streaming_deltas_add_up_and_abort_frees_blocks(small_llm):
    engine = small_llm.engine
    rid = engine.add_request("Tell me a story about a robot.", SamplingParams(temperature=0, max_tokens=24))
    other = engine.add_request("Count to ten.", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    text, final = "", None
    while final is None:
        for out in engine.step():
            if out.request_id == rid:
                text += out.outputs[0].delta_text
                if out.finished:
                    final = out
    assert text == final.outputs[0].text
    assert engine.abort_request(other)
    assert not engine.abort_request(other)
    assert engine.pool.num_free == engine.pool.num_blocks
    m = final.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
    assert len(m.token_times) == len(final.outputs[0].token_ids)


def test_incremental_detokenizer_never_splits_a_character(tokenizer):
    text = "Café 你好 🚀🎉 naïve – done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=[])
    pieces = [detok.add_token(t) for t in ids]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # at least one emoji spans several tokens, so some steps must have held text back
    assert "" in pieces


def test_stop_strings_and_stop_token_ids(small_llm):
    base = small_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    text = base.outputs[0].text
    word = text.split()[1] if len(text.split()) > 1 else text.strip()[:3]
    cut = small_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop=word), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].stop_reason == word
    assert cut.outputs[0].text == text[: text.find(word)]
    tok = base.outputs[0].token_ids[2]
    by_id = small_llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]), use_tqdm=False)[0]
    assert by_id.outputs[0].token_ids == base.outputs[0].token_ids[: base.outputs[0].token_ids.index(tok) + 1]
    assert by_id.outputs[0].stop_reason == tok


def test_a_stop_string_inside_a_long_token_is_found(small_llm):
    """One token can add many characters (a newline and 23 spaces is one token): the stop search must cover
    all of them, not a fixed window at the end of the text."""
    rows = "".join("                        <tr><td>%d</td></tr>\n" % i for i in range(5))
    prompt = "<table>\n" + rows + "                        <tr><td>5</td></tr>"
    greedy = dict(temperature=0, max_tokens=12)
    base = small_llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    tok = small_llm.get_tokenizer()
    pieces = [tok.decode([t]) for t in base.token_ids]
    assert any("\n" in p and len(p) > 17 for p in pieces), pieces  # the case this test is about
    cut = small_llm.generate([prompt], SamplingParams(**greedy, stop=["\n"]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == base.text[: base.text.find("\n")]


def test_seeded_sampling_is_reproducible_across_batches(small_llm):
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)
    alone = small_llm.generate(["Once upon a time"], p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = small_llm.generate(
        ["Once upon a time", "Other prompt here", "And a third one"],
        [p, SamplingParams(temperature=1.0, max_tokens=12), SamplingParams(temperature=1.0, max_tokens=5)],
        use_tqdm=False,
    )[0].outputs[0].token_ids
    assert alone == crowd
    other_seed = small_llm.generate(["Once upon a time"], SamplingParams(temperature=0.9, seed=99, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_ignore_eos_generates_past_eos(small_llm):
    eos = next(iter(small_llm.engine.eos_token_ids))
    stopped = small_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)[0]
    assert stopped.outputs[0].finish_reason == "stop"
    full = small_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), use_tqdm=False)[0]
    assert len(full.outputs[0].token_ids) == 60 and eos in full.outputs[0].token_ids
    assert full.outputs[0].finish_reason == "length"


def test_chat_template_answers(small_llm):
    out = small_llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_cli_streams(capsys):
    from minivllm.cli import main

    assert main(["generate", "What is the capital of France?", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out and "tokens/s" in out and "TTFT" in out and "KV blocks" in out
    assert main(["generate", "", "--no-chat"]) == 2


def test_cli_peak_kv_blocks_count_the_step_a_request_finishes_in(capsys, tokenizer):
    """The summary's peak is the most blocks the prompts held at once.  Read after each step it missed every
    block freed within that step: with ``--max-tokens 1`` each request prefills, samples and leaves in one step,
    and the line said ``KV blocks used (peak) 0/...`` for prompts that filled several blocks."""
    from minivllm.cli import main

    prompts = ["The quick brown fox jumps over the lazy dog, then runs home to sleep.", "One two three four five"]
    assert main(["generate", *prompts, "--no-chat", "--max-tokens", "1", "--block-size", "4"]) == 0
    summary = capsys.readouterr().out.splitlines()[-1]
    peak = int(summary.split("KV blocks used (peak) ")[1].split("/")[0])
    assert peak == sum(-(-len(tokenizer.encode(p)) // 4) for p in prompts), summary


@pytest.mark.parametrize("n", [1, 2])
def test_generate_returns_whole_completions_whatever_the_output_kind(n):
    """``generate`` hands back one final output per prompt, so a ``delta`` request must be switched to
    ``final_only`` as a cumulative one is: kept as delta, its "final" output was the last step's token only.
    Oracle: the simulated executor's token function, applied to each sample's position."""
    from minivllm.sim import SimulatedExecutor
    from minivllm.sim.executor import fake_token

    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    llm.engine.eos_token_ids = set()
    vocab = llm.engine.executor.vocab_size
    [out] = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=n, max_tokens=5, ignore_eos=True,
                                                                         output_kind="delta"), use_tqdm=False)
    assert out.finished and len(out.outputs) == n
    for i, sample in enumerate(out.outputs):
        rid = out.request_id if n == 1 else f"{out.request_id}#{i}"
        assert sample.token_ids == [fake_token(rid, 3 + k, vocab) for k in range(5)]
