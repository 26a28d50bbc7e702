"""The step log: one small typed record per engine step, kept in a bounded ring buffer.

Widgets draw timelines from it, labs compute TTFT/ITL breakdowns from it, and
benchmarks read peak block usage from it.  Two things keep it cheap:

* a record is a slotted dataclass of plain values (ids, counts, one tuple per
  scheduled sequence), never a reference to a live request;
* the buffer is bounded by the number of *sequence entries* it holds (a step of
  256 decodes costs 256 entries, an idle step one), so a long run at large
  batch sizes keeps the newest history in a fixed memory budget (about 100 bytes
  per entry) instead of growing without bound.

Records also answer ``record["seqs"]`` like the dicts they replace, so notebook
code that reads them stays short.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator


@dataclass(slots=True, frozen=True)
class StepRecord:
    step: int
    time: float
    seqs: tuple[tuple[str, int, int], ...]  # (request id, first position, tokens) per scheduled sequence
    num_tokens: int
    preempted: tuple[str, ...]
    swapped_out: int  # blocks copied to the host tier this step
    swapped_in: int
    rejected: tuple[str, ...]
    failed: tuple[str, ...]
    free_blocks: int
    running: int
    waiting: int

    def __getitem__(self, key: str):
        return getattr(self, key)

    def get(self, key: str, default=None):
        return getattr(self, key, default)

    @property
    def size(self) -> int:
        """Entries this record counts against the log's budget."""
        return 1 + len(self.seqs)


class StepLog:
    """A ring buffer of :class:`StepRecord`, bounded by ``max_entries`` sequence entries."""

    def __init__(self, max_entries: int = 500_000) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._records: deque[StepRecord] = deque()
        self.num_entries = 0

    def append(self, record: StepRecord) -> None:
        self._records.append(record)
        self.num_entries += record.size
        while self.num_entries > self.max_entries and len(self._records) > 1:
            self.num_entries -= self._records.popleft().size

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[StepRecord]:
        return iter(self._records)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return list(self._records)[index]
        return self._records[index]

    def clear(self) -> None:
        self._records.clear()
        self.num_entries = 0
