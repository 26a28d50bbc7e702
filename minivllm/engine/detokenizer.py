"""Incremental detokenization: stream text as tokens arrive, never half a character.

Byte-level BPE tokenizers can split one UTF-8 character (an emoji, a CJK
character) across several tokens.  Decoding token by token would emit the
replacement character ``\ufffd`` for the incomplete bytes.  So the detokenizer
re-decodes a short window ending at the newest token and releases new text
only when it no longer ends in an incomplete character.  The window starts a
few tokens back because many tokenizers decide a leading space from context.
A prompt given as token ids may itself end mid-character; the first output
token that completes it releases the whole character.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field

_CONTEXT_TOKENS = 5


@dataclass
class IncrementalDetokenizer:
    tokenizer: object | None
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    text: str = ""
    _tokens: list[int] = field(default_factory=list)
    _prefix_offset: int = 0
    _read_offset: int = 0

    def __post_init__(self) -> None:
        self._tokens = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one generated token; return the text it completes (maybe ``""``)."""
        if self.tokenizer is None:
            return ""
        self._tokens.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """At the request's end, release what :meth:`add_token` still holds as a maybe-incomplete character, as
        ``decode`` writes it: a U+FFFD the model generated as a whole character (one token in byte-level
        vocabularies) is real text, and bytes no later token will complete decode to U+FFFD.  Held back for
        good, the final text was not the decode of the output's token ids."""
        if self.tokenizer is None or self._read_offset == len(self._tokens):
            return ""
        return self._release(final=True)

    def _text_before_tail(self, before: str) -> str:
        """The decode of the window up to the tokens of the prompt's incomplete last character (``""`` where it
        is not a prefix of ``before``, the decode of the window up to the read offset).

        Why: a request that ends with its bytes only extending the prompt's incomplete character outputs that
        character's placeholder, and only it; a U+FFFD the prompt wrote right before it is the prompt's text.
        ``decode`` alone cannot tell the two apart by looking at ``before``, but the tokens can: a byte-level
        decode writes one U+FFFD for a character however many of its bytes are there, so dropping the
        character's later tokens leaves the decode as it is, and dropping its first token removes the
        placeholder.  Walking back while the decode stays ``before`` finds that first token.  (A byte-fallback
        decode -- one U+FFFD per byte -- does not reach here: its output bytes add placeholders, so ``after``
        differs from ``before``.)  Cost: a decode per token of the character, once, at the request's end.
        """
        end, head = self._read_offset, before
        while head == before and end > self._prefix_offset:
            end -= 1
            head = self._decode(self._tokens[self._prefix_offset : end])
        return head if before.startswith(head) else ""

    def _carries_on(self, before: str) -> bool:
        """Does the first token past the read offset carry on the incomplete character ``before`` ends with --
        its bytes join it, so the window's decode is still ``before`` -- rather than add text of its own?

        Why: then the output's bytes are part of that character, and its placeholder is output text whenever
        the character ends up broken -- at the request's end, or when a later token starts a character of its
        own.  Asked only at the final release, the placeholder was output by a request that stopped right there
        and dropped by one that went on (``[carry, "x"]`` gave ``"x"`` where one token fewer gave ``"\ufffd"``):
        the shorter output's text was no prefix of the longer's.  (A token that decodes to nothing, a skipped
        special token, carries nothing on.)  Reached only while ``before`` ends in U+FFFD: a prompt cut
        mid-character, until its character is settled."""
        first = self._tokens[self._read_offset : self._read_offset + 1]
        return bool(first) and bool(self._decode(first)) and (
            self._decode(self._tokens[self._prefix_offset : self._read_offset + 1]) == before)

    def _release(self, final: bool) -> str:
        """The text the tokens past the read offset add, once it does not end mid-character (or ``final``)."""
        before = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        after = self._decode(self._tokens[self._prefix_offset :])
        if before.endswith("\ufffd") and (not after.startswith(before) or self._carries_on(before) or (
                final and after == before and self._decode(self._tokens[self._read_offset :]))):
            # The prompt (token ids sent as such) ended mid-character and this token completes it: the
            # character is the output's first text.  Measured from the prompt's U+FFFD instead, it would be
            # lost (the completed text is no longer than that placeholder), and with it a real character.
            # So too at the end when the output's bytes only extended that character (its decode is the
            # same placeholder): they are output text, U+FFFD as ``decode`` writes them, not nothing.  (A
            # real U+FFFD ending the prompt is complete: bytes after it add a U+FFFD of their own, and a
            # token that decodes to nothing, a skipped special token, adds nothing.)  Which trailing U+FFFD
            # are the placeholder?  A byte-level decode writes one for the incomplete character, a byte-fallback
            # one one per byte; any before them are the prompt's own text.  Where the character completed,
            # ``after`` keeps the prompt's own and replaces the placeholder, so the placeholder is what follows
            # their common prefix (cut no further back than the trailing run).  Where it did not (the final
            # case, or a later token that breaks it off: :meth:`_carries_on`), what precedes the incomplete
            # character's tokens is the prompt's own text (:meth:`_text_before_tail`).
            run = len(before.rstrip("\ufffd"))
            if not after.startswith(before):
                run = max(run, len(os.path.commonprefix([before, after])))
            else:
                run = max(run, len(self._text_before_tail(before)))
            before = before[:run]
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # an incomplete character, or a token that decodes to nothing yet
        delta = after[len(before) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta
