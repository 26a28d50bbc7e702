"""A stand-in executor with a virtual clock: the engine runs, no model does.

It implements :class:`~minivllm.interfaces.Executor` exactly as the real model
runner does, so every scheduling decision, block allocation and preemption is
the real engine's — only the forward pass is replaced by a cost model::

    step time = fixed_overhead + per_token * tokens_in_batch + per_context_token * KV tokens read
                + swapped bytes / swap bandwidth

and the "sampled" token is a deterministic function of the request and its
position (:func:`~minivllm.sim.roofline.fake_token`, a CRC, not Python's
``hash``, which is salted per process), so runs are reproducible to the bit,
in every process.  Tests use it to hammer the
scheduler with thousands of workloads; the labs use it for what-if studies
that would take minutes with a real model.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.config import PCIE4_X16_BYTES_PER_S
from minivllm.sched.output import ScheduledBatch
from minivllm.sim.roofline import check_fake_vocab, fake_token


@dataclass
class SimulatedExecutor:
    fixed_overhead_s: float = 0.010
    per_token_s: float = 0.0004
    per_context_token_s: float = 0.000002
    vocab_size: int = 1000
    kv_bytes_per_block: int = 16 * 1024
    swap_bytes_per_s: float = PCIE4_X16_BYTES_PER_S
    clock: float = 0.0

    def __post_init__(self) -> None:
        check_fake_vocab(self.vocab_size, "SimulatedExecutor")

    def now(self) -> float:
        return self.clock

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` on the virtual clock (an open-loop driver calls it between arrivals)."""
        if t > self.clock:
            self.clock = t

    def step_time(self, batch: ScheduledBatch) -> float:
        context = sum(s.start + s.num_tokens for s in batch.seqs)
        compute = self.per_token_s * batch.num_tokens + self.per_context_token_s * context
        swapped = len(batch.moves.swap_in) + len(batch.moves.swap_out)
        return self.fixed_overhead_s + compute + swapped * self.kv_bytes_per_block / self.swap_bytes_per_s

    def execute(self, batch: ScheduledBatch) -> dict[str, int]:
        if batch.seqs or batch.moves:
            self.clock += self.step_time(batch)
        out = {}
        for s in batch.seqs:
            if s.samples:
                req = s.request
                out[req.request_id] = fake_token(req.request_id, req.num_tokens, self.vocab_size)
        return out
