"""What the scheduler hands the executor: the step's sequences and its block moves.

Kept apart from the scheduler (as vLLM keeps ``sched/output.py``) so that the
executor, the simulator and the seams module can name the batch without
importing the scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from minivllm.kv.kv_cache_manager import BlockMoves
from minivllm.request import Request


@dataclass(slots=True)
class ScheduledSeq:
    """One request's share of a step: ``num_tokens`` tokens starting at ``start``.

    Slotted: a decode step builds one per running request, and a slotted
    dataclass is smaller and a little quicker to build than a plain one
    (about 10% on CPython 3.11).
    """

    request: Request
    num_tokens: int
    start: int  # == request.num_computed_tokens when scheduled
    is_decode: bool = False  # request.is_decode when the batch was built

    @property
    def samples(self) -> bool:
        """Does this step reach the request's last token (so its logits are sampled)?"""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass
class ScheduledBatch:
    """What the executor runs.

    ``seqs`` are ordered one-token rows first (the attention backends batch
    those together), the decode rows leading (so the step log keeps which rows
    are decodes as one count); ``moves`` are the block copies to perform before the
    forward pass.  ``preempted`` and ``rejected`` are what the scheduler did
    to make the step fit; the engine reports them.  An executor that fails
    for one request (a sampling error, say) records it in ``errors`` and
    leaves that request out of its result: only that request finishes, with
    ``finish_reason == "error"``.
    """

    seqs: list[ScheduledSeq] = field(default_factory=list)
    moves: BlockMoves = field(default_factory=BlockMoves)
    preempted: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # request id -> what failed (the executor fills it)
    # Requests swapped back in by this step's admission (their copies in are among ``moves``).  If the step fails,
    # one that got no row must not run on: the copy may never have happened (``LLMEngine.execute``).  A tuple
    # unless a swap-in happened, so a step without one allocates nothing for it.
    swapped_in: Sequence[Request] = ()
    # The clock when this step began: the end of the step before (``ended``), or the arrival that woke an idle
    # engine.  A request first scheduled in this batch stopped queueing then, not when the forward pass ended:
    # its queue time must not include its own prefill.  Steps tile the clock ([started, ended] is the time the
    # engine's step-time average counts), and both ends are times a replay's clock reproduces.
    started: float | None = None
    # The clock right after the forward pass, read once (LLMEngine._step_end): every later stage's time.
    ended: float | None = None
    # ``(prefill tokens, decode rows)``, counted by the scheduler while it builds the batch (it adds up both as it
    # spends the token budget): the scheduler and the engine read them every step, and a step of 256 decodes
    # would otherwise be walked again for each read.  None -- a batch built by hand, or one whose rows changed
    # after it was counted -- is counted from ``seqs`` on each read.
    split: tuple[int, int] | None = None

    # Plain list comprehensions: on CPython 3.11 they beat ``map(attrgetter(...))`` over slotted objects by
    # about 1.5x (specialised attribute loads), and a filtered one builds no list in a steady decode step.
    @property
    def num_tokens(self) -> int:
        return sum([s.num_tokens for s in self.seqs])

    @property
    def num_decode_tokens(self) -> int:
        split = self.split
        return split[1] if split is not None else sum([s.is_decode for s in self.seqs])

    @property
    def num_prefill_tokens(self) -> int:
        split = self.split
        return split[0] if split is not None else sum([s.num_tokens for s in self.seqs if not s.is_decode])

    def __len__(self) -> int:
        return len(self.seqs)

