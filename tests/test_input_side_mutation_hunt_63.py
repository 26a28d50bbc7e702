"""Input-side mutants (prompt checks, chat templates, the detokenizer, batch preparation) the suite let through.

The bundled tokenizer is byte-level BPE with no normalizer: every character of a text is at least one character of
some token, so the "could this text ever fit" bound is never close there.  A tokenizer whose normalizer drops
characters (BERT's ``clean_text`` drops zero-width and control characters, common in pasted text) is built here in
memory, as is one whose chat template refuses a conversation.  One survivor was a real bug (the detokenizer
output a U+FFFD the prompt had written; see the tests that name it).  The oracles are the tokenizer's own
``encode`` and ``decode``, the plain reference :func:`build_attention_metadata`, and counts worked out by hand.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.engine.detokenizer import IncrementalDetokenizer
from minivllm.engine.input_processor import InputProcessor
from minivllm.model.runner import BatchPreparer, build_attention_metadata
from minivllm.request import Request
from minivllm.sched.output import ScheduledSeq

WORD = "abcde"  # as long as the longest vocabulary entry ("<unk>"): 5 characters
MAX_LEN = 16


@pytest.fixture(scope="module")
def dropping():
    """A word-level tokenizer whose normalizer drops zero-width spaces (and refuses a system turn in its template)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({"<unk>": 0, WORD: 1}, unk_token="<unk>"))
    tk.normalizer = normalizers.BertNormalizer(clean_text=True, lowercase=False, strip_accents=False,
                                               handle_chinese_chars=False)
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                         "{{ raise_exception('this template takes no system turn') }}{% endif %}"
                         "{{ m['content'] }} {% endfor %}")
    assert max(map(len, tok.get_vocab())) == len(WORD)
    assert tok.encode(WORD + "\u200b" * 5 + " " + WORD) == [1, 1]  # the case is real: the normalizer drops them
    return tok


def _padded(words: int, extra_dropped: int = 0) -> str:
    """``words`` copies of WORD, each followed by as many zero-width spaces as it has characters, then a space:
    11 characters a token, more than twice the longest entry, half of them dropped by the normalizer."""
    return (WORD + "\u200b" * len(WORD) + " ") * words + "\u200b" * extra_dropped


def test_a_text_whose_normalizer_drops_half_of_it_is_not_refused_as_unfittable(dropping):
    """Kills: ``max_fitting_chars`` without its factor of two (one longest entry per position): a text of 10
    tokens, 6 under ``max_model_len``, refused as one that "could never fit".  Oracle: the tokenizer's own
    encode -- 10 tokens -- and the hand count 10 * 11 - 1 = 109 characters, over 5 * 16 = 80 and under 2 * 80."""
    text = _padded(10)[:-1]  # no trailing space: 10 * 11 - 1 = 109 characters
    assert len(dropping.encode(text)) == 10 and 80 < len(text) <= 160
    ip = InputProcessor(dropping, None, MAX_LEN)
    assert ip.encode(text) == (text, [1] * 10)


def test_a_text_exactly_at_the_bound_is_tokenized_not_refused(dropping):
    """Kills: the refusal taken at the bound itself (``>=``), against what ``max_fitting_chars`` promises: "the
    most characters a text can have and still fit".  A text of exactly 2 * 5 * 16 = 160 characters (14 padded
    words of 11 characters, one word alone, 1 more dropped character) is 15 tokens, under 16.  Oracle: the
    tokenizer's encode and that hand count."""
    text = _padded(14) + WORD + "\u200b" * 1
    ip = InputProcessor(dropping, None, MAX_LEN)
    assert len(text) == ip.max_fitting_chars() == 160
    assert len(dropping.encode(text)) == 15
    assert ip.encode(text)[1] == [1] * 15
    with pytest.raises(ValueError, match="could never fit"):
        ip.encode(text + "\u200b")  # one character more is over the bound: refused before tokenizing


def test_a_chat_template_that_refuses_the_conversation_is_the_callers_value_error(dropping):
    """Kills: the template's own exception passed on as another type (a RuntimeError, or the template's
    ``TemplateError`` unwrapped): the server answers a ValueError with 400, anything else with 500, and
    ``LLM.chat`` documents a ValueError for a bad conversation.  Oracle: the template, which raises for a
    system turn by construction, and renders a user turn (the same path works for valid input)."""
    ip = InputProcessor(dropping, None, MAX_LEN)
    assert ip.encode_chat([{"role": "user", "content": WORD}]) == [1]
    with pytest.raises(ValueError, match="cannot apply the chat template"):
        ip.encode_chat([{"role": "system", "content": WORD}, {"role": "user", "content": WORD}])


def test_prompt_token_ids_given_as_a_tuple_are_taken_as_that_list(dropping):
    """Kills: the ``prompt_token_ids`` check narrowed to ``list`` (a tuple of ids, what ``tokenizer(...)`` gives
    some callers and what the message's "a list of ints" covers by the code's own ``(list, tuple)``, refused).
    Oracle: by hand, the request's prompt is those ids, in order, as a list."""
    ip = InputProcessor(dropping, 2, MAX_LEN)
    [req] = ip.process({"prompt_token_ids": (1, 0, 1)}, SamplingParams(max_tokens=2), "r", tenant="t", priority=0,
                       arrival_time=0.0)
    assert list(req.prompt_token_ids) == [1, 0, 1] and req.num_prompt_tokens == 3


@pytest.mark.parametrize("text,prompt_chars", [("odd \ufffd\U0001f600 end", "odd \ufffd"),
                                               ("x \ufffd\ufffd\U0001d11e end", "x \ufffd\ufffd")])
def test_a_replacement_character_the_prompt_wrote_is_not_output_when_its_next_character_completes(
        tokenizer, text, prompt_chars):
    """A real bug, fixed with this test.  A prompt sent as token ids that ends with a U+FFFD it wrote (a complete
    character: scraped text is full of them) and then the first bytes of a 4-byte character.  Its decode ends
    in two U+FFFD; the output token that completes the character must stream that character alone.  The
    detokenizer stripped *every* trailing U+FFFD from the prompt's decode, so the prompt's own one (or two)
    came out again as output text ("\ufffd\U0001f600").  Oracle: the text itself, cut by hand -- the prompt's
    complete characters are ``prompt_chars``, so the output's text is the rest of the decode, and it agrees
    with the tokenizer's decode of prompt plus output."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    k = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]) == prompt_chars + "\ufffd"
             and not tokenizer.decode(ids[:k + 1]).endswith("\ufffd"))  # the next token completes it
    want = tokenizer.decode(ids[:k + 1])[len(prompt_chars):]
    assert want == text[len(prompt_chars)]
    detok = IncrementalDetokenizer(tokenizer, ids[:k])
    assert detok.add_token(ids[k]) + detok.flush() == want == detok.text


def test_a_byte_fallback_tokenizer_completes_the_character_after_the_prompts_own_replacement():
    """The same bug's fix must hold where ``decode`` writes one U+FFFD per byte of an incomplete character
    (SentencePiece-style byte fallback, Llama's and Mistral's tokenizers), not one per character: cutting a single
    U+FFFD from the prompt's decode there left one byte's placeholder standing in for the completed character, and
    the character never streamed.  Oracle: ``tokenizers``' own ByteFallback decoder on the whole sequence."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "odd": 1, "\ufffd": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.decoder = decoders.ByteFallback()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    euro = [3 + b for b in "\u20ac".encode()]  # three byte tokens
    prompt = [1, 2] + euro[:2]  # "odd", the prompt's own U+FFFD, two of the euro sign's three bytes
    assert tok.decode(prompt) == "odd\ufffd\ufffd\ufffd"  # one placeholder per byte: the case is real
    want = tok.decode(prompt + euro[2:])[len(tok.decode([1, 2])):]
    assert want == "\u20ac"
    detok = IncrementalDetokenizer(tok, prompt)
    assert detok.add_token(euro[2]) + detok.flush() == want == detok.text


def _prefill(n: int, first_block: int) -> ScheduledSeq:
    """A whole ``n``-token prompt in one chunk, on blocks ``first_block, first_block + 1, ...`` (block size 4)."""
    req = Request(f"p{n}", [7] * n, SamplingParams(max_tokens=1), 0.0)
    req.block_ids = list(range(first_block, first_block + -(-n // 4)))
    return ScheduledSeq(req, n, 0)


def _tensors(ids, pos, meta) -> list[torch.Tensor]:
    return [ids, pos, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables]


def test_staged_preparation_of_a_step_larger_than_the_staging_buffer_matches_the_reference():
    """Kills: the staging buffer (GPU path: one pinned host buffer per dtype) never grown past its first size.
    A 2,000-token prefill step stages 3 * 2,000 int64 values, more than the first 4,096: the copy into the
    buffer failed, a prompt step on a GPU that the engine turned into an error for every request in it.  And
    the CPU form of the staged path without its copy: the next step's staging rewrote the tensors the last step
    returned.  Oracle: :func:`build_attention_metadata`, the plain reference, on each step."""
    prep = BatchPreparer(4, "cpu", stage=True)
    small, other, big = [_prefill(6, 1)], [_prefill(5, 3)], [_prefill(2000, 10)]
    first = [t.clone() for t in _tensors(*prep.prepare(small))]
    kept = _tensors(*prep.prepare(small))
    for seqs in (other, big, small):  # ``other`` fits the same buffer: the one the kept tensors came from
        got, want = _tensors(*prep.prepare(seqs)), _tensors(*build_attention_metadata(seqs, 4, torch.device("cpu")))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert all(torch.equal(k, f) for k, f in zip(kept, first))  # an earlier step's tensors are still its own
