"""What a caller asks for when it submits a request: how to pick tokens and when to stop.

Names and defaults follow vLLM's ``SamplingParams`` so that what learners know
transfers: ``temperature=1.0``, ``top_p=1.0``, ``top_k=-1`` (off; 0 also means
off), ``max_tokens=16``.  Every field is validated here, at the boundary --
types included (``True`` is not a count, ``"false"`` is not a bool) -- so a bad
value is a ``ValueError`` for the caller and never an exception deep in a
running engine step.

The object is **frozen** once validated: the engine reads it while the request
runs, and a caller that changed ``max_tokens`` afterwards would change a
request the engine already sized.  Make a new one with :func:`dataclasses.replace`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.argtypes import is_int, is_real

GREEDY_EPSILON = 1e-5
"""Temperatures below this are greedy: dividing logits by ~0 overflows to inf/nan."""

MAX_N = 128
"""Most samples one request may ask for (OpenAI's limit on ``n``).  Each sample is a request the engine
builds on its own thread: an unbounded ``n`` would let one call stall and exhaust the server."""

OUTPUT_KINDS = ("cumulative", "delta", "final_only")
"""vLLM's ``RequestOutputKind``: what each ``RequestOutput`` of a request carries.

``cumulative`` (default): every step's output holds all text and token ids so
far (and the step's delta) -- convenient, but building it costs time that
grows with the output's length.  ``delta``: only the step's new text and
tokens.  ``final_only``: one output, when the request finishes (what
``LLM.generate`` uses: no per-step output work at all).  With ``n > 1``, one
output each time one of its samples finishes, ``finished`` only on the last:
each sample's output carries its own token times, which is how the metrics
time every sample's gaps (vLLM's ``FINAL_ONLY`` holds the parent's output until
every child is done; a caller that wants that keeps the ``finished`` one, as
``LLM.generate`` does).
"""


QUOTE_CHARS = 60
"""Most characters of a caller's value an error message quotes (then ``...``)."""


def brief_repr(value) -> str:
    """``repr(value)``, cut to :data:`QUOTE_CHARS` characters and ``...``.

    Why: a refusal quotes what was wrong so its caller can find it, but the value can be as large as the request
    (a 200 kB model name, a list of long stop strings); quoted whole, it made the error as large.  The start of a
    value is enough to recognise it.  An int of more than 4,300 digits (or a list holding one) has no repr:
    Python refuses to write it out with a ValueError of its own, which replaced the refusal that named the field.
    """
    try:
        text = repr(value)
    except ValueError:  # sys.get_int_max_str_digits(): too long to write in decimal
        return f"<a {type(value).__name__} too large to write out>"
    return text[:QUOTE_CHARS] + "..." if len(text) > QUOTE_CHARS else text


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: str = "cumulative"
    _stop_list: tuple[str, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {brief_repr(self.n)}")
        if not is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {brief_repr(self.temperature)}")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {brief_repr(self.top_p)}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled), 0 (disabled) or a positive integer, got {brief_repr(self.top_k)}")
        if not is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {brief_repr(self.min_p)}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {brief_repr(self.max_tokens)}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {brief_repr(self.seed)}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {brief_repr(getattr(self, name))}")
        if self.output_kind not in OUTPUT_KINDS:
            raise ValueError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {brief_repr(self.output_kind)}")
        if isinstance(self.stop, str):
            stops: tuple = (self.stop,)
        elif self.stop is None or isinstance(self.stop, (list, tuple)):
            stops = tuple(self.stop or ())
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {brief_repr(self.stop)}")
        bad = next((i for i, s in enumerate(stops) if not isinstance(s, str) or not s), None)
        if bad is not None:  # the offending entry, not the whole list (whose other strings may be long)
            where = f" at index {bad}" if isinstance(self.stop, (list, tuple)) else ""
            raise ValueError(f"stop must be a non-empty string or a list of them, got {brief_repr(stops[bad])}{where}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {brief_repr(self.stop_token_ids)}")
        ids = tuple(self.stop_token_ids or ())
        bad = next((i for i, t in enumerate(ids) if not is_int(t) or t < 0), None)
        if bad is not None:  # the offending entry, not the whole list (which may hold thousands)
            raise ValueError(f"stop_token_ids must be non-negative integers, got {brief_repr(ids[bad])} at index {bad}")
        # frozen: the validated, normalised forms are set once, here
        object.__setattr__(self, "_stop_list", stops)
        object.__setattr__(self, "stop_token_ids", ids)
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        """Argmax: temperature 0 (or below :data:`GREEDY_EPSILON`), the choice compared with HF."""
        return self.temperature < GREEDY_EPSILON
