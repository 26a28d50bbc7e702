"""What the engine returns: vLLM-shaped ``RequestOutput`` objects, plus timings.

The engine's ``step()`` returns one ``RequestOutput`` per request that changed
in the step.  What ``outputs[i].text`` and ``.token_ids`` hold depends on the
request's ``output_kind``: everything so far (``"cumulative"``, the default),
only the step's additions (``"delta"``), or -- one output, when the request
finishes (with ``n > 1``, when each sample does) -- everything (``"final_only"``,
what ``LLM.generate`` uses).  The
``delta_text`` / ``delta_token_ids`` fields always carry just what the step
added, which is what a streaming client prints.  ``CompletionOutput.token_times``
(minivllm's, not vLLM's) holds the times of the sample's own tokens, the same
slice as its ``token_ids``: an ``n > 1`` request's ``metrics`` are one
sample's, and its samples' tokens do not come at the same times once one of
them is preempted.

The three classes are slotted: a streaming (``delta``) run builds one of each per
request per step, and slotted instances are quicker to build and smaller.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # minivllm's addition: when each of ``token_ids`` was sampled (seconds on the executor's clock).  Why here and
    # not only in ``RequestMetrics``: an ``n > 1`` request has one ``metrics`` for all its samples, and a sample
    # that was preempted got its tokens at other times than the one whose metrics the request carries, so its
    # inter-token gaps can be read only from its own times (``EngineMetrics`` reads them so).
    token_times: list[float] = field(default_factory=list)

    def finished(self) -> bool:
        """A method, not a field (``RequestOutput.finished`` is one): vLLM's ``CompletionOutput`` has it so, and
        code written against vLLM calls it."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (seconds on the executor's clock) of one request's life.

    For an ``n > 1`` request, ``token_times`` (and so ``itls``) are one sample's (``OutputProcessor.fold`` says
    which) and the other fields the group's; each sample's own token times are its ``CompletionOutput.token_times``.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache; n > 1: the group's first lookup's (fold)
    retry_after_s: float | None = None  # finish_reason "rejected": seconds after which a retry may fit
    error: str | None = None  # finish_reason "error": what went wrong, in words
