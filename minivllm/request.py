"""A request's life inside the engine: its tokens, its KV blocks, its clock.

One rule drives scheduling (vLLM's v1 design): a request has ``num_tokens``
tokens (prompt + generated so far) and ``num_computed_tokens`` of them have
their K/V in the cache.  Every step the scheduler tries to close the gap.
Prefill, chunked prefill, decode, prefix-cache hits and recompute after
preemption are all just different sizes of that gap.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field, fields

import torch

from minivllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # recompute: blocks freed, computed tokens forgotten
    SWAPPED = "swapped"  # swap: KV parked in the host tier, computed tokens kept
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_REJECTED = "rejected"  # reject mode (could not be served without preempting others) or over_cap="reject"
    FINISHED_ERROR = "error"  # something failed for this request alone (its neighbours went on)

    finished: bool  # set on every member below


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_REJECTED,
        RequestStatus.FINISHED_ERROR,
    }
)
# ``status.finished`` is asked for every request every step.  A plain attribute on each member costs one
# lookup; a property testing set membership ran enum's Python-level ``__hash__`` twice per request per step.
for _status in RequestStatus:
    _status.finished = _status in _FINISHED


# eq=False: identity, not field-by-field, so queues find and remove *this* request, fast.  slots=True: the
# fields live in the object itself (no per-instance dict), so the per-step passes over every running request
# read them with one memory access fewer; a request also cannot grow a stray attribute by a typo.
@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    tenant: str = "default"
    cache_salt: str | None = None
    priority: int = 0
    deadline: float | None = None  # seconds on the executor's clock (scheduling_policy="deadline")
    max_tokens: int = 16  # resolved: never past max_model_len

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # The block tables.  Only minivllm.kv writes them (the memory manager owns every block).
    block_ids: list[int] = field(default_factory=list)  # device blocks, logical order
    cpu_block_ids: list[int] = field(default_factory=list)  # host blocks while swapped out
    generator: torch.Generator | None = None

    # bookkeeping the metrics and the labs read
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    prefix_lookup_recorded: bool = False  # first lookup counted in the hit rate; later ones are recompute
    num_inserted_blocks: int = 0  # leading full blocks already offered to the prefix cache (-1: no more)
    parent_id: str | None = None  # n > 1: the id the caller knows; this request is one sample of it
    sample_index: int = 0
    leader: "Request | None" = None  # n > 1: the sample whose prefill the others fork from
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0
    num_tokens_computed_once: int = 0  # the furthest any computation reached: below it, a re-prefill recomputes
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    stop_reason: int | str | None = None
    retry_after_s: float | None = None  # reject mode: when a retry might succeed
    error: str | None = None  # finish reason "error": what went wrong

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode reads one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self.num_computed_tokens

    def steps_to_finish(self, chunk: int) -> int:
        """Steps this request still needs if it runs every step, computing at most ``chunk`` prompt tokens in one.

        Its uncomputed tokens go in chunks (the rest of its prompt, or prompt and outputs again after a
        recompute preemption; a decode's is its last sampled token), the last of which also samples an
        output; then one step per output still to come.  Both retry hints -- a tenant cap's and reject mode's
        -- order the running requests by it to guess who leaves first: one rule, so the two cannot disagree
        about a request still in its prefill (counting outputs alone, a 24-token prompt a chunk of 4 at a time
        with 2 outputs to go looked 2 steps from the end; it is 7).
        """
        return -(-max(1, self.num_uncomputed_tokens) // chunk) + max(0, self.max_tokens - len(self.output_token_ids) - 1)

    @property
    def is_decode(self) -> bool:
        """The prompt is in the cache and exactly one token -- the last sampled -- still lacks K/V.

        The one definition of "decode" in minivllm (the scheduler asks this
        property, or :meth:`split_decodes`' copy of its rule, and the batch
        keeps the answer in ``ScheduledSeq.is_decode``).  A one-token prefill chunk
        (the last prompt token of a forked ``n > 1`` sample, say) is not a
        decode, even though the attention kernels treat it as a one-token row.
        """
        # Written out on the two lists (no nested properties): the scheduler asks this once per running
        # request per step, so at 256 decodes it is a measurable share of the host overhead.
        computed, prompt = self.num_computed_tokens, len(self.prompt_token_ids)
        return computed >= prompt and prompt + len(self.output_token_ids) - computed == 1

    @staticmethod
    def split_decodes(reqs, as_rows=None) -> tuple[list, list["Request"]]:
        """``(decodes, others)`` of ``reqs``, each in order: :attr:`is_decode` over many requests at once.

        The same rule, written out with no property call per request:
        the scheduler splits every running request this way on every step.
        With ``as_rows`` (the scheduler passes :class:`~minivllm.sched.output.ScheduledSeq`)
        each decode comes back already as its one-token row of the batch,
        ``as_rows(request, 1, num_computed_tokens, True)``, built in the same pass.
        """
        # Two passes in C-driven comprehensions rather than one Python loop with two appends: in a steady
        # decode step every request is a decode, and the second pass is skipped.
        if as_rows is None:
            decodes = [r for r in reqs if (c := r.num_computed_tokens) >= (p := len(r.prompt_token_ids))
                       and p + len(r.output_token_ids) - c == 1]
        else:  # the same test; building the row here saves a second pass over the decodes (host overhead)
            decodes = [as_rows(r, 1, c, True) for r in reqs if (c := r.num_computed_tokens) >= (
                p := len(r.prompt_token_ids)) and p + len(r.output_token_ids) - c == 1]
        if len(decodes) == len(reqs):
            return decodes, []
        others: list[Request] = []
        picked = iter(decodes if as_rows is None else [row.request for row in decodes])  # in reqs' order
        nxt = next(picked, None)
        for r in reqs:
            if r is nxt:
                nxt = next(picked, None)
            else:
                others.append(r)
        return decodes, others

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    @property
    def max_total_tokens(self) -> int:
        """The most tokens this request can come to hold KV for: what reject mode reserves for it at admission,
        so that a request once admitted never needs a block nobody can give it."""
        return self.num_prompt_tokens + self.max_tokens

    def __deepcopy__(self, memo: dict) -> "Request":
        """Copy every field as ``copy.deepcopy`` would, except a seeded ``generator``: that is cloned
        (:func:`clone_generator`), so the copy draws the same numbers as the original will, independently.

        Why not the default: ``deepcopy`` reaches a ``torch.Generator`` through its ``__reduce__``, whose CPU
        path (torch 2.13's ``THPGenerator_reduce``, pytorch/pytorch#188032) puts ``None`` into the state tuple
        without taking a reference to it.  Every copy so drops one reference to ``None``; on Python below 3.12,
        where ``None`` is not immortal, a fuzzer copying requests (the tests' dry runs on a copy of the KV
        manager do it every step) freed ``None`` after ~1,500 copies: "Fatal Python error: none_dealloc".
        A clone through ``get_state``/``set_state`` never calls ``__reduce__``.  ``memo`` is honoured, so a
        leader shared by its samples, or a generator reached twice, is copied once within one ``deepcopy``.
        """
        new = object.__new__(type(self))
        memo[id(self)] = new
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Generator):
                clone = memo.get(id(value))
                if clone is None:
                    clone = memo[id(value)] = clone_generator(value)
                value = clone
            else:
                value = copy.deepcopy(value, memo)
            object.__setattr__(new, f.name, value)
        return new


def clone_generator(gen: torch.Generator) -> torch.Generator:
    """A new generator on ``gen``'s device in ``gen``'s exact state: it draws what ``gen`` will draw next.

    The one way minivllm copies a generator (never ``copy.deepcopy`` or ``pickle`` of it: see
    :meth:`Request.__deepcopy__` for the reference ``torch.Generator.__reduce__`` drops).
    """
    clone = torch.Generator(device=gen.device)
    clone.set_state(gen.get_state())
    return clone
