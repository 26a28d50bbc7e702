"""Tests from a parity hunt over the text path (``LLM.chat``, the server's chat prompt, detokenization) with
Hugging Face ``transformers`` as the oracle: the tokenizer's own ``apply_chat_template`` and ``decode``.

Nothing runs a model: the engine runs on the scripted simulated executor of ``test_more_mutants``, so the
output token ids are chosen, and the text the engine reports is compared with ``tokenizer.decode`` of them.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from tests.test_more_mutants import EOS, ScriptedExecutor, run

KINDS = ["cumulative", "delta", "final_only"]


def _text(outs, kind: str) -> str:
    """What a client reads: the deltas added up (``delta``), else the last output's text."""
    return "".join(o.outputs[0].delta_text for o in outs) if kind == "delta" else outs[-1].outputs[0].text


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("then_eos", [False, True])
def test_a_replacement_character_the_model_generates_last_is_kept_in_the_text(tokenizer, kind, then_eos):
    """U+FFFD is a character like any other, and this vocabulary has it as one token (24211, bytes EF BF BD).
    The detokenizer holds back text ending in U+FFFD because it may be an incomplete character, and held it
    for good when that token was the last to decode (``max_tokens`` reached, or EOS next): the reply lost a
    character the model wrote.  Oracle: ``tokenizer.decode`` of the output ids (less the EOS, whose text a
    stop token never adds)."""
    ids = tokenizer.encode(" ok \ufffd")
    assert tokenizer.decode(ids[-1:]) == "\ufffd"  # the case is real: one token, a whole character
    script = ids + [EOS] if then_eos else ids
    outs = run(tokenizer, {"r": script + [0]}, SamplingParams(max_tokens=len(script), output_kind=kind))
    assert outs[-1].outputs[0].finish_reason == ("stop" if then_eos else "length")
    assert _text(outs, kind) == tokenizer.decode(ids) == " ok \ufffd"


@pytest.mark.parametrize("kind", KINDS)
def test_text_cut_mid_character_by_max_tokens_is_the_decode_of_the_token_ids(tokenizer, kind):
    """A request that reaches ``max_tokens`` inside a character (an emoji's first byte tokens) reports the text
    of the tokens it got, as ``decode`` writes it -- the incomplete bytes as U+FFFD -- not that text less the
    character's start, so ``text`` is always ``decode(token_ids)``.  (vLLM drops the incomplete bytes; HF's
    decode, the oracle here, does not.)"""
    ids = tokenizer.encode("Hi 😀😀 there")
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts  # the case is real: an emoji spans several tokens
    for k in cuts:
        outs = run(tokenizer, {"r": ids + [0]}, SamplingParams(max_tokens=k, ignore_eos=True, output_kind=kind))
        assert outs[-1].outputs[0].finish_reason == "length"
        assert _text(outs, kind) == tokenizer.decode(ids[:k]), k


def test_llm_chat_accepts_text_content_parts_as_the_server_does(tokenizer):
    """OpenAI's content as a list of text parts is served by ``/v1/chat/completions`` (the parts joined by
    single newlines, vLLM's rule), and ``InputProcessor.encode_chat`` is documented as the one chat path whichever
    door a conversation comes through; ``LLM.chat`` refused the same conversation with ``ValueError``.
    Oracle: HF's ``apply_chat_template(tokenize=True)`` of the conversation with the parts joined by newlines."""
    llm = LLM(executor=ScriptedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer, num_gpu_blocks_override=64,
              max_model_len=256)
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "One word, café 😀."}]
    conversation = [{"role": "system", "content": ""}, {"role": "user", "content": parts}]
    joined = [conversation[0], {"role": "user", "content": "Name a colour.\nOne word, café 😀."}]
    want = tokenizer.apply_chat_template(joined, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert llm.chat_prompt(conversation)["prompt_token_ids"] == want
    assert conversation[1]["content"] is parts  # the caller's messages are not rewritten
    with pytest.raises(ValueError, match="text content parts"):
        llm.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_a_chat_prompt_without_the_generation_prompt_is_the_templates(tokenizer):
    """Kills: ``add_generation_prompt`` lost on the way to the template (always True).  ``LLM.chat`` and the
    server's field of that name take False to continue or score the conversation as it stands; with the flag
    lost it got an opened assistant turn appended, a different prompt.  Oracle: HF's
    ``apply_chat_template(tokenize=True)`` with the same flag, for both values (and the two differ here)."""
    llm = LLM(executor=ScriptedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer, num_gpu_blocks_override=64,
              max_model_len=256)
    conversation = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}]
    got = {}
    for flag in (True, False):
        want = tokenizer.apply_chat_template(conversation, add_generation_prompt=flag, tokenize=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got[flag] = llm.chat_prompt(conversation, add_generation_prompt=flag)["prompt_token_ids"]
        assert got[flag] == want, flag
    assert got[True] != got[False]  # the case is real: this template opens an assistant turn only when asked
