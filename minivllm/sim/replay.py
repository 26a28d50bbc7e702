"""Replay measured step times: the check that the simulator schedules exactly as the real engine does.

The simulator's claim is that only the *clock* is simulated: every scheduling
decision is the real scheduler's.  :class:`ReplayExecutor` makes that
testable.  Record a real run with :func:`minivllm.sim.run.drive` (it notes the
clock at the first moment after each step, when the next arrivals are
injected), then run the same arrivals on a :class:`ReplayExecutor` that moves
its virtual clock to exactly those times.  The engine then sees the same
requests at the same step boundaries, so the two step logs must be identical;
any difference is a simulator bug (or hidden nondeterminism in the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.config import PCIE4_X16_BYTES_PER_S
from minivllm.sim.roofline import fake_token


@dataclass
class ReplayExecutor:
    """An :class:`~minivllm.interfaces.Executor` whose clock after its ``k``-th call is ``times[k]``.

    ``times`` are seconds on the run's clock (``DriveRecord.check_after_step``);
    past the end of the list the clock advances by ``tail_step_s`` per call.
    """

    times: list[float]
    vocab_size: int = 49152
    tail_step_s: float = 0.01
    clock: float = 0.0
    calls: int = 0
    kv_bytes_per_block: int = field(default=16 * 1024)
    swap_bytes_per_s: float = PCIE4_X16_BYTES_PER_S

    def now(self) -> float:
        return self.clock

    def advance_to(self, t: float) -> None:
        if t > self.clock:
            self.clock = t

    def execute(self, batch) -> dict[str, int]:
        k, self.calls = self.calls, self.calls + 1
        self.clock = max(self.clock, self.times[k] if k < len(self.times) else self.clock + self.tail_step_s)
        out = {}
        for s in batch.seqs:
            req = s.request
            if s.start + s.num_tokens == req.num_tokens:
                out[req.request_id] = fake_token(req.request_id, req.num_tokens, self.vocab_size)
        return out
