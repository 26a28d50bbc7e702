"""A deep copy of a seeded request leaks nothing and draws what the original draws.

torch 2.13's ``torch.Generator.__reduce__`` (pytorch/pytorch#188032) drops a reference to ``None`` on every call
on a CPU generator; ``copy.deepcopy`` of a request used to reach it, and the tests' dry runs deep-copy requests
every step (``tests/test_kv_gaps.py``, ``tests/invariants.py``), so a long fuzz run on Python 3.11 could free
``None`` and die ("Fatal Python error: none_dealloc").  :meth:`minivllm.request.Request.__deepcopy__` clones the
generator through its state instead.

Oracles: ``sys.getrefcount(None)`` before and after (it cannot fall on a sound copy; on Python >= 3.12 ``None`` is
immortal and the count is constant, so there the first test guards nothing and passes); a fresh generator seeded
the same and advanced the same, whose draws the copy must reproduce.
"""

from __future__ import annotations

import copy
import gc
import sys

import torch

from minivllm.request import Request, clone_generator
from minivllm.sampling_params import SamplingParams

SEED = 1234


def _seeded_request(request_id: str = "r", seed: int = SEED, leader: Request | None = None) -> Request:
    """A request as the input processor builds one for ``SamplingParams(seed=...)``: its own CPU generator."""
    req = Request(request_id, [1, 2, 3, 4], SamplingParams(seed=seed, temperature=1.0), 0.0, leader=leader)
    req.generator = torch.Generator().manual_seed(seed)
    return req


def _none_refs_lost(make_copy, n: int = 400) -> int:
    """How far ``None``'s reference count falls over ``n`` calls of ``make_copy``.  The collector is run first and
    kept off meanwhile: a collection inside the loop, freeing garbage an earlier test left (a tuple holding
    ``None``, say), would lower the count with no leak at all."""
    make_copy()  # one warm-up call: whatever a first call caches is not counted
    gc.collect()
    gc.disable()
    try:
        before = sys.getrefcount(None)
        for _ in range(n):
            make_copy()
        return before - sys.getrefcount(None)
    finally:
        gc.enable()


def test_deep_copies_of_a_seeded_request_leave_none_refcount_alone():
    """400 copies; the old code lowered ``None``'s count by one per copy (by 400 here)."""
    req = _seeded_request()
    assert _none_refs_lost(lambda: copy.deepcopy(req)) < 40, "deep copies of a request drop references to None"


def test_a_copy_draws_what_the_original_draws_and_independently():
    req = _seeded_request()
    torch.rand(5, generator=req.generator)  # a request part-way through its sampling
    twin = copy.deepcopy(req)
    assert twin.generator is not req.generator
    oracle = torch.Generator().manual_seed(SEED)
    torch.rand(5, generator=oracle)
    expected = torch.rand(8, generator=oracle)
    assert torch.equal(torch.rand(8, generator=twin.generator), expected)
    assert torch.equal(torch.rand(8, generator=req.generator), expected)  # the copy's draws did not advance it
    assert twin.generator.device == req.generator.device


def test_one_deepcopy_keeps_what_is_shared_shared():
    """A sample's ``leader`` copied alongside the leader is that copy (``memo`` honoured); a generator reached
    twice is cloned once; every other field is an equal, separate copy."""
    leader = _seeded_request("p-0")
    sample = _seeded_request("p-1", seed=SEED + 1, leader=leader)
    sample.output_token_ids.append(7)
    other = _seeded_request("q")
    other.generator = leader.generator  # not what the engine builds; the copy must still mirror the sharing
    leader2, sample2, other2 = copy.deepcopy((leader, sample, other))
    assert sample2.leader is leader2 and other2.generator is leader2.generator
    assert sample2.output_token_ids == [7] and sample2.output_token_ids is not sample.output_token_ids
    assert sample2.sampling_params == sample.sampling_params and sample2.request_id == "p-1"
    assert sample2.generator is not sample.generator
    assert torch.equal(torch.rand(4, generator=sample2.generator),
                       torch.rand(4, generator=torch.Generator().manual_seed(SEED + 1)))


def test_clone_generator_leaves_none_refcount_alone_too():
    gen = torch.Generator().manual_seed(SEED)
    assert _none_refs_lost(lambda: clone_generator(gen)) < 40
