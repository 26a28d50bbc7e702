"""Freezing a serving process's start-up heap out of Python's cyclic garbage collector.

Why: loading a model builds some 200,000 objects the collector tracks (modules,
parameters' wrappers, the tokenizer's tables) that live until the process exits.
A full collection walks every one of them to find cycles that are never there:
with SmolLM2-135M loaded, 210,000 objects and 120 ms on the course's 2-core CPU
(``python -m minivllm.bench eager_step`` records it; frozen: 0.0005 ms at the median), and
the pause lands inside whichever step is running, so in every running request's
inter-token latency.
``gc.freeze`` moves them to a permanent generation the collector never visits;
a full collection then costs what the objects made since start-up cost.  vLLM
freezes its heap the same way once its engine has started.

Only a process that owns its lifetime does this (``minivllm serve``, a benchmark
run): an object alive at the freeze is never collected as part of a cycle
afterwards, so ``LLM()`` -- a library call inside someone else's process -- does
not.  A benchmark unfreezes when it is done (:func:`frozen_heap`).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object still alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[int]:
    """:func:`freeze_startup_heap` for the duration of a ``with`` block (a benchmark's measured part)."""
    frozen = freeze_startup_heap()
    try:
        yield frozen
    finally:
        gc.unfreeze()
