"""Replay measured step times: the check that the simulator schedules exactly as the real engine does.

The simulator's claim is that only the *clock* is simulated: every scheduling
decision is the real scheduler's.  :class:`ReplayExecutor` makes that
testable.  Record a real run with :func:`minivllm.sim.run.drive` (it notes the
clock at the end of each step, as the engine read it once for the step's
token times, its step-time average and its prefill-rate fit; the next arrivals
are injected at that time), then run the same arrivals on a
:class:`ReplayExecutor` that moves its virtual clock to exactly those times.
The engine then sees the same requests at the same step boundaries and
measures the same step times, so the two step logs must be identical, and so
must the estimates (``step_time_s``, the learnt prefill rate, retry hints);
any difference is a simulator bug (or hidden nondeterminism in the engine).

Times are not all a real engine measures: ``preemption_mode="auto"`` starts
from a timed prefill probe and a timed copy over the host link.  A replay
built with :meth:`ReplayExecutor.from_record` starts from those same numbers
(a plain ``ReplayExecutor(times)`` says the simulator's defaults, and its
auto mode swaps where the real one recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.config import PCIE4_X16_BYTES_PER_S
from minivllm.sim.roofline import check_fake_vocab, fake_token
from minivllm.sim.run import DriveRecord


@dataclass
class ReplayExecutor:
    """An :class:`~minivllm.interfaces.Executor` whose clock after its ``k``-th call is ``times[k]``.

    ``times`` are readings of the run's clock, each step's end as its engine read it (:meth:`from_record` gives
    the recorded run's own readings; a plain ``ReplayExecutor(rec.step_ends)`` replays them on a clock from 0);
    past the end of the list the clock advances by ``tail_step_s`` per call.
    ``prefill_tokens_per_s``: auto mode's start-up prefill rate (None: the engine's default guess).
    """

    times: list[float]
    # The recorded run's sampled tokens by request id (DriveRecord.output_token_ids), written in place of made-up
    # ones.  With a prefix cache they decide what is shared: a model gives two equal prompts equal outputs, whose
    # full blocks are cached once; a token made up per request keeps them apart.
    tokens: dict[str, list[int]] | None = field(default=None, kw_only=True)  # (keyword only: the later fields keep their positions)
    vocab_size: int = 49152
    tail_step_s: float = 0.01
    clock: float = 0.0
    calls: int = 0
    kv_bytes_per_block: int = field(default=16 * 1024)
    swap_bytes_per_s: float = PCIE4_X16_BYTES_PER_S
    prefill_tokens_per_s: float | None = None

    def __post_init__(self) -> None:
        check_fake_vocab(self.vocab_size, "ReplayExecutor")

    @classmethod
    def from_record(cls, rec: DriveRecord, **kwargs) -> ReplayExecutor:
        """The replay of a recorded run: its step times, its tokens, its KV block size and auto mode's start-up
        numbers, on the recorded clock itself.

        The clock starts where the real one did (``rec.clock_origin``) and moves to the very readings the real
        engine took (``rec.step_end_readings``).  So every sum the engine forms from the clock rounds as it did in
        the real run: two deadlines that tie there tie here too, and the step-time average is the same float.
        """
        known: dict = {"tokens": rec.output_token_ids, "clock": rec.clock_origin}
        if rec.kv_bytes_per_block:
            known["kv_bytes_per_block"] = rec.kv_bytes_per_block
        if rec.start_costs is not None:
            known["swap_bytes_per_s"], known["prefill_tokens_per_s"] = rec.start_costs
        return cls(list(rec.step_end_readings), **{**known, **kwargs})

    def now(self) -> float:
        return self.clock

    def advance_to(self, t: float) -> None:
        if t > self.clock:
            self.clock = t

    def execute(self, batch) -> dict[str, int]:
        k, self.calls = self.calls, self.calls + 1
        self.clock = max(self.clock, self.times[k] if k < len(self.times) else self.clock + self.tail_step_s)
        out = {}
        recorded = self.tokens or {}
        for s in batch.seqs:
            req = s.request
            if s.start + s.num_tokens == req.num_tokens:
                sampled = recorded.get(req.request_id)
                k = len(req.output_token_ids) if sampled else 0  # the position this row samples, among the outputs
                out[req.request_id] = sampled[k] if sampled and k < len(sampled) else fake_token(
                    req.request_id, req.num_tokens, self.vocab_size)
        return out
