"""The KV cache tensors (``minivllm/kv/kv_cache.py``): how many blocks a budget buys, the host tier's size, the
order block moves run in, the swap-bandwidth probe's arithmetic and the start-up probe's block table.

Every expected value is a hand count or a hand trace of a few blocks holding distinct constants, never the
module's own arithmetic replayed.
"""

from __future__ import annotations

import pytest
import torch

from minivllm.kv.kv_cache import KVCache, num_kv_blocks
from minivllm.kv.kv_cache_manager import BlockMoves

CPU = torch.device("cpu")


def _cache(num_blocks: int, num_cpu_blocks: int) -> KVCache:
    """2 layers of 2-token blocks, 1 KV head of 2 dims; device block b of layer l holds K = 10l + b, V = -(10l + b)."""
    cache = KVCache(2, num_blocks=num_blocks, block_size=2, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                    device=CPU, num_cpu_blocks=num_cpu_blocks)
    for layer, (k, v) in enumerate(cache.layers):
        for b in range(num_blocks):
            k[b], v[b] = 10 * layer + b, -(10 * layer + b)
    return cache


def test_a_cpu_engine_without_a_kv_size_gets_one_gib_of_blocks_whatever_the_gpu_share():
    """The documented default (``num_kv_blocks``: "else 1 GiB"): a CPU engine given no KV size gets 1 GiB of
    blocks, and ``gpu_memory_utilization`` (a share of *free GPU memory*) does not shrink it.  Hand count: a block
    of 2 layers x K and V x 16 tokens x 2 KV heads x 32 dims x 4 bytes is 16,384 bytes; 2**30 / 16,384 = 65,536."""
    per_block = 2 * 2 * 16 * 2 * 32 * 4
    assert num_kv_blocks(None, per_block, CPU, 0.9) == 65_536
    assert num_kv_blocks(None, per_block, CPU, 0.5) == 65_536


@pytest.mark.parametrize("num_blocks, num_cpu_blocks", [(2, 3), (4, 1)])
def test_the_host_tier_holds_exactly_its_own_block_count_and_round_trips_the_last_one(num_blocks, num_cpu_blocks):
    """The host tier is sized by ``num_cpu_blocks``, not by the device pool: a tier larger than the device pool
    (2 device, 3 host blocks) must accept a swap-out into its last block, and a 1-block tier must exist at all
    (``swap_space`` small enough for one block is a legal config).  Hand trace: device block 1 goes out to the
    last host block, device blocks are scribbled over, and the host block comes back into device block 0."""
    cache = _cache(num_blocks, num_cpu_blocks)
    last = num_cpu_blocks - 1
    for ck, cv in cache.cpu_layers:
        assert ck.shape[0] == cv.shape[0] == num_cpu_blocks
    # one block: 2 layers x K and V x 2 tokens x 1 head x 2 dims x 4 bytes = 64 bytes; the device tier alone counts
    assert cache.total_bytes == num_blocks * 64
    cache.apply(BlockMoves(swap_out=[(1, last)]))
    for k, v in cache.layers:
        k.fill_(float("nan"))
        v.fill_(float("nan"))
    cache.apply(BlockMoves(swap_in=[(last, 0)]))
    for layer, (k, v) in enumerate(cache.layers):
        assert bool((k[0] == 10 * layer + 1).all() and (v[0] == -(10 * layer + 1)).all()), f"layer {layer}"


def test_a_swap_out_reads_its_block_before_a_copy_on_write_of_the_same_step_overwrites_it():
    """``BlockMoves`` promises swap-outs before copies: the manager may hand a device block that a swap-out frees
    to a copy-on-write of the same step as its destination.  Copied the other way round, the victim's host copy
    holds the copy's source, and the victim attends to another request's keys when it comes back.  Hand trace:
    device block 2 swaps out to host block 0 while block 1 is copied into block 2."""
    cache = _cache(4, 2)
    cache.apply(BlockMoves(swap_out=[(2, 0)], copies=[(1, 2)]))
    for layer, ((k, v), (ck, cv)) in enumerate(zip(cache.layers, cache.cpu_layers)):
        assert bool((ck[0] == 10 * layer + 2).all() and (cv[0] == -(10 * layer + 2)).all()), f"layer {layer}: swapped"
        assert bool((k[2] == 10 * layer + 1).all() and (v[2] == -(10 * layer + 1)).all()), f"layer {layer}: copied"


@pytest.mark.parametrize("num_blocks, num_cpu_blocks, probed", [(4, 4, 4), (2, 5, 2), (8, 3, 3)])
def test_the_swap_bandwidth_probe_counts_every_block_it_copied(monkeypatch, num_blocks, num_cpu_blocks, probed):
    """Auto mode weighs a swap by this number, so it must be the bytes of *all* the blocks copied over the timed
    interval, and the probe may copy only blocks both tiers have.  The clock is pinned to a 1-second interval;
    one block is 2 layers x K and V x 2 tokens x 1 head x 2 dims x 4 bytes = 64 bytes, so the answer is
    64 x the smaller tier's block count (at most the default 8)."""
    import itertools

    import minivllm.kv.kv_cache as kv_cache

    ticks = itertools.count(100.0, 1.0)  # each reading 1 s after the last: the timed copy takes 1 s
    monkeypatch.setattr(kv_cache.time, "perf_counter", lambda: next(ticks))
    cache = _cache(num_blocks, num_cpu_blocks)
    assert cache.measure_swap_bandwidth() == probed * 64


def test_the_prefill_probes_table_covers_every_token_and_stays_inside_the_pool():
    """``scratch_request`` stands in for a request during the start-up prefill probe, whose slot mapping reads
    ``block_ids[pos // block_size]`` for every token: a table one block short fails on a length that is not a
    whole number of blocks, and a probe longer than the pool must be cut to it.  Hand counts for 16-token
    blocks: 20 tokens need 2 blocks; 10**6 tokens on a 4-block pool are cut to 64 tokens in blocks 0..3; 0 tokens
    still probe 1 token."""
    cache = KVCache(1, num_blocks=4, block_size=16, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=CPU)
    for asked, tokens, blocks in ((20, 20, [0, 1]), (32, 32, [0, 1]), (10**6, 64, [0, 1, 2, 3]), (0, 1, [0])):
        probe = cache.scratch_request(asked)
        assert (probe.num_prompt_tokens, probe.block_ids) == (tokens, blocks), asked
