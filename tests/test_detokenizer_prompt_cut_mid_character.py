"""A prompt sent as token ids that stops inside a character, and an output that ends before completing it.

The output's bytes only extend the prompt's incomplete character, so its decode is still the prompt's U+FFFD
placeholder, and the detokenizer held them back as "nothing new" for good: the final text was empty while the
output's token ids decode to U+FFFD.  Oracle: the Hugging Face tokenizer's decode, by the rule the completing
case follows (``test_more_mutants``): the decode of prompt and output, less the prompt's complete characters.

Why that oracle and not ``decode(prompt + output)`` less ``decode(prompt)``: that difference is undefined whenever
the output completes the character (the prompt's placeholder is not a prefix of the character), and where it is
defined here it is empty -- the output's bytes vanish into the prompt's placeholder, which is vLLM's drop, not
``decode``'s text of the bytes.  Less the prompt's complete characters, one rule covers both ends, and
``complete prompt text + output text == decode(prompt + output)`` holds in each.  The tests below build each
prompt as complete text plus the first token of a character, so where the complete text ends is known by
construction, not found by the code under test.
"""

from __future__ import annotations

import pytest

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


HEADS = ("odd \ufffd", "\ufffd", "x\ufffd\ufffd", "odd ")  # complete text; three end in U+FFFD of their own
SPLIT = ("😀", "語", "𝄞", "🎉")  # three tokens each in this vocabulary: a prompt may hold the first, an output the second


def _broken_prompts(tokenizer):
    """(complete text, prompt ids, one output token): the prompt is that text plus a character's first token, and
    the output token is the character's second, which does not complete it."""
    cases = []
    for text in HEADS:
        head = tokenizer.encode(text)
        assert tokenizer.decode(head) == text  # the head's text is complete: the boundary is known
        for char in SPLIT:
            ids = tokenizer.encode(char)
            assert len(ids) == 3 and tokenizer.decode(ids) == char  # the case is real
            cases.append((text, head + ids[:1], ids[1]))
    return cases


def test_a_prompts_own_replacement_character_before_its_broken_character_is_not_output_again(tokenizer):
    """A prompt ending in a U+FFFD it wrote, then half a character, and an output that only extends that
    character before the request ends: the output text is the one placeholder of the incomplete character, as
    the decode of prompt and output writes it less the prompt's complete text.  The old code cut the whole
    trailing U+FFFD run as placeholder and output the prompt's own U+FFFD again ("\ufffd\ufffd"); a head with
    no U+FFFD of its own (``"odd "``) keeps its answer."""
    for text, prompt, token in _broken_prompts(tokenizer):
        whole = tokenizer.decode(prompt + [token])
        assert whole.startswith(text)
        want = whole[len(text):]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        streamed = detok.add_token(token)
        assert streamed == ""  # held while the request runs: the character may still complete
        assert (streamed + detok.flush(), detok.text) == (want, want) == ("\ufffd", "\ufffd"), (text, prompt, token)


def test_the_engine_reports_one_placeholder_after_a_prompts_own_replacement_character(tokenizer):
    """The same through the engine, deferred (``generate``) and streamed: a one-token request on ``'odd \ufffd'``
    plus half an emoji, cut there by ``max_tokens``, ends with the text ``'\ufffd'`` (old code: two)."""
    text, prompt, token = _broken_prompts(tokenizer)[0]
    ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts={"req-0": [token], "req-1": [token]})
    llm = LLM(executor=ex, tokenizer=tokenizer, num_gpu_blocks_override=64, max_model_len=128)
    llm.engine.inputs.vocab_size = len(tokenizer)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    want = tokenizer.decode(prompt + [token])[len(text):]
    [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert (out.outputs[0].token_ids, out.outputs[0].text) == ([token], want) == ([token], "\ufffd")
    deltas = [o.outputs[0].delta_text for o in llm.stream({"prompt_token_ids": prompt}, params)]
    assert "".join(deltas) == want


@pytest.mark.parametrize("own", [False, True], ids=["plain prompt", "prompt ending in its own U+FFFD"])
def test_a_token_that_breaks_off_the_carried_character_keeps_its_placeholder(tokenizer, own):
    """The review's case: the prompt ends with an emoji's first token, the output's first token carries it on
    without finishing it, and a second token (``x``) breaks it off.  The output's bytes are part of that broken
    character, so its placeholder is output text whether the request stops after one token or goes on: with
    ``max_tokens=1`` the text was ``'\ufffd'`` and with 2 it was ``'x'`` -- the shorter no prefix of the longer.
    Oracle: the HF tokenizer's decode of prompt + output, less the prompt's complete text; and streamed deltas
    concatenated equal the final text."""
    head = tokenizer.encode("odd \ufffd" if own else "odd ")
    emoji, x = tokenizer.encode("\U0001F600"), tokenizer.encode("x")
    assert len(emoji) >= 2 and len(x) == 1
    prompt, out = head + emoji[:1], [emoji[1], x[0]]
    complete = tokenizer.decode(head)
    assert tokenizer.decode(prompt + out[:1]) == complete + "\ufffd"  # the case is real: the first only carries on
    for n in (1, 2):
        want = tokenizer.decode(prompt + out[:n])[len(complete):]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.add_token(t) for t in out[:n]] + [detok.flush()]
        assert ("".join(deltas), detok.text) == (want, want) == (("\ufffd", "\ufffdx")[n - 1],) * 2, (n, deltas)
    ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts={"req-0": out, "req-1": out})
    llm = LLM(executor=ex, tokenizer=tokenizer, num_gpu_blocks_override=64, max_model_len=128)
    llm.engine.inputs.vocab_size = len(tokenizer)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    [final] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert final.outputs[0].text == "\ufffdx"
    assert "".join(o.outputs[0].delta_text for o in llm.stream({"prompt_token_ids": prompt}, params)) == "\ufffdx"
