"""A prompt sent as token ids that stops inside a character, and an output that ends before completing it.

The output's bytes only extend the prompt's incomplete character, so its decode is still the prompt's U+FFFD
placeholder, and the detokenizer held them back as "nothing new" for good: the final text was empty while the
output's token ids decode to U+FFFD.  Oracle: the Hugging Face tokenizer's decode, by the rule the completing
case follows (``test_more_mutants``): the decode of prompt and output, less the prompt's complete characters.
"""

from __future__ import annotations

from minivllm import LLM, SamplingParams
from minivllm.engine.detokenizer import IncrementalDetokenizer
from tests.test_more_mutants import ScriptedExecutor

TEXT = "Hello world 😀 done x😀😀y, café 日本語 𝄞 ok"


def _cuts(tokenizer, ids):
    """Every cut ``k`` where the prompt ``ids[:k]`` ends mid-character and the next token does not complete it."""
    return [k for k in range(1, len(ids) - 1)
            if tokenizer.decode(ids[:k]).endswith("\ufffd") and tokenizer.decode(ids[:k + 1]).endswith("\ufffd")]


def test_an_output_that_only_extends_the_prompts_broken_character_ends_as_its_decode(tokenizer):
    ids = tokenizer.encode(TEXT)
    cuts = _cuts(tokenizer, ids)
    assert len(cuts) >= 3  # the case is real: emoji, CJK and a 4-byte symbol span three tokens here
    for k in cuts:
        prompt, out = ids[:k], ids[k:k + 1]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        streamed = detok.add_token(out[0]) + detok.flush()
        want = tokenizer.decode(prompt + out)[len(tokenizer.decode(prompt).rstrip("\ufffd")):]
        assert (streamed, detok.text) == (want, want) == ("\ufffd", tokenizer.decode(out)), k


def test_a_real_replacement_character_ending_the_prompt_is_not_output_again(tokenizer):
    """The other side: a prompt ending in a U+FFFD it *wrote* (a complete character) followed by a token that
    decodes to nothing (a special token, skipped) has no output text.  Oracle: the decode of that token."""
    prompt, special = tokenizer.encode("odd \ufffd"), 1
    assert tokenizer.decode([special], skip_special_tokens=True) == ""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.add_token(special) + detok.flush() == "" == detok.text


def test_the_engine_reports_that_text_for_a_request_cut_there_by_max_tokens(tokenizer):
    """The same through the engine, deferred (``generate``: final only) and streamed (deltas): a one-token
    request on such a prompt ends with the decode of its token, U+FFFD, not with no text."""
    ids = tokenizer.encode(TEXT)
    k = _cuts(tokenizer, ids)[0]
    tail = ids[k:k + 1]
    ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts={"req-0": tail, "req-1": tail})
    llm = LLM(executor=ex, tokenizer=tokenizer, num_gpu_blocks_override=64, max_model_len=128)
    llm.engine.inputs.vocab_size = len(tokenizer)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": ids[:k]}, params, use_tqdm=False)
    assert (out.outputs[0].token_ids, out.outputs[0].text) == (tail, tokenizer.decode(tail)) == (tail, "\ufffd")
    deltas = [o.outputs[0].delta_text for o in llm.stream({"prompt_token_ids": ids[:k]}, params)]
    assert "".join(deltas) == "\ufffd"
