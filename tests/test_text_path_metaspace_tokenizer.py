"""The text path with a SentencePiece-style ("Metaspace") tokenizer that adds a BOS, where the bundled one cannot tell.

The bundled SmolLM2 tokenizer is byte-level BPE: every token carries its own leading space and it adds no special
tokens, so a detokenizer that decodes each new token with no context, or a prompt encoded without its BOS, still
gives the right text there.  Llama-family tokenizers are not like that: their decoder drops the space of the
first piece it is given, and text prompts start with ``<s>``.  A tiny such tokenizer is built here in memory (a
word-level vocabulary, the ``tokenizers`` library's Metaspace pre-tokenizer and decoder, a BOS template).  Nothing
runs a model: the engine runs on the scripted executor of ``test_more_mutants``.  The oracles are the tokenizer's
own ``decode`` of the whole token list and ``encode`` of the text, and counts worked out by hand.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from tests.test_more_mutants import ScriptedExecutor, run

BOS, EOS = 1, 2
WORDS = ["Hello", "world", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture(scope="module")
def spm():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{"\u2581" + w: 3 + i for i, w in enumerate(WORDS)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = "<s>{% for m in messages %}{{ m['content'] }} {% endfor %}"
    # the case is real: decoded alone, the first piece loses its space, and a text prompt starts with the BOS
    assert tok.decode(tok.encode(" one two", add_special_tokens=False)) == "one two"
    assert tok.encode("Hello world") == [BOS, 3, 4]
    return tok


def _text(outs, kind):
    return "".join(o.outputs[0].delta_text for o in outs) if kind == "delta" else outs[-1].outputs[0].text


@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_streamed_text_keeps_the_spaces_the_tokenizer_writes_between_pieces(spm, kind):
    """Kills: the detokenizer's window moved past the text it already released (each new token decoded alone, so
    Metaspace drops its space: " worldonetwo"), and a skipped special token in mid-stream taken as released text
    (the window then starts at it, and the next word loses its space).  Oracle: the tokenizer's decode of prompt
    plus output, less the decode of the prompt -- what a client that decodes the whole sequence reads."""
    prompt = spm.encode("Hello")
    out = spm.encode("world one", add_special_tokens=False) + [BOS] + spm.encode("two three", add_special_tokens=False)
    outs = run(spm, {"r": out}, SamplingParams(max_tokens=len(out), ignore_eos=True, output_kind=kind), prompt=prompt)
    full, head = spm.decode(prompt + out, skip_special_tokens=True), spm.decode(prompt, skip_special_tokens=True)
    assert _text(outs, kind) == full[len(head):] == " world one two three"


def test_each_new_token_decodes_a_window_of_bounded_length(spm):
    """Kills: a prefix offset that never advances.  The text is the same, but every token then re-decodes the
    whole output so far: O(n) per token and O(n^2) per request, on the engine's thread.  Oracle: the length of
    each ``decode`` call, counted by a wrapper -- at most the prompt context plus the tokens of one character."""
    class Counting:
        def __init__(self, tok):
            self.tok, self.longest = tok, 0

        def __len__(self):
            return len(self.tok)

        def __getattr__(self, name):
            return getattr(self.tok, name)

        def decode(self, ids, **kw):
            self.longest = max(self.longest, len(ids))
            return self.tok.decode(ids, **kw)

    counting = Counting(spm)
    out = spm.encode(" ".join(WORDS * 20), add_special_tokens=False)
    outs = run(spm, {"r": out}, SamplingParams(max_tokens=len(out), ignore_eos=True), prompt=spm.encode("Hello"),
               decode_with=counting, max_model_len=1024)
    assert outs[-1].outputs[0].text == spm.decode(spm.encode("Hello") + out, skip_special_tokens=True)[len("Hello"):]
    assert len(out) == 240 and counting.longest <= 8


def test_a_text_prompt_gets_the_tokenizers_bos_and_a_chat_prompt_gets_it_once(spm):
    """Kills: a text prompt encoded without the tokenizer's special tokens (no ``<s>``: the model reads a prompt
    unlike any in training), and a chat prompt encoded with them (the template already wrote ``<s>``, so it
    would start ``<s> <s>``).  Oracle: the tokenizer's own ``encode`` (which adds the BOS by default), and one BOS
    counted by hand in the template's output."""
    llm = LLM(executor=ScriptedExecutor(vocab_size=len(spm)), tokenizer=spm, num_gpu_blocks_override=64,
              max_model_len=64)
    req = llm.engine.inputs.process("Hello world", SamplingParams(), "t", tenant="default", priority=0,
                                    arrival_time=0.0)[0]
    assert req.prompt_token_ids == spm.encode("Hello world") == [BOS, 3, 4]
    ids = llm.engine.inputs.encode_chat([{"role": "user", "content": "Hello world"}])
    assert ids.count(BOS) == 1 and ids[0] == BOS
