"""A prefix-cache ``peek`` costs the blocks it compares, not the length of the prompt, and still counts what
``match`` would return.

WFQ asks :meth:`KVCacheManager.computed_if_admitted` for every waiting request it hands out, and that peeks the
cache.  The peek used to copy the whole token list (``all_token_ids[:-1]``) and cut every block into a tuple
before comparing the first one, so an 8,192-token prompt whose first block is not cached cost O(8,192) per
peek.  The counts are checked against hand-worked numbers (block ``k`` of ``toks`` is ``[k] * BS``) and against
``match`` / ``match_prefix``; the cost is checked by counting the tokens read from the prompt lists.

``match`` (run for every admitted request) walks the same way and used to cut the whole prompt as well; it now
reads lazily too.  Its answers are checked against a brute-force record of every cached prefix on a seeded
random workload with long prompts (the stateful test in ``test_prefix_cache.py`` covers short ones, with
eviction), and its cost by the same token count.
"""

from __future__ import annotations

import random

import pytest

from minivllm.kv.block_pool import BlockPool
from minivllm.kv.kv_cache_manager import KVCacheManager
from minivllm.kv.prefix import CACHE_KINDS, make_prefix_cache
from minivllm.kv.prefix.base import LazyBlocks, TokenRun, split_into_blocks
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

from invariants import block_tokens as toks  # noqa: E402 (tests/ is on sys.path)

BS = 4


class CountingList(list):
    """A token list that counts the tokens read out of it (indexing, slicing, iterating, concatenating)."""

    reads = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        CountingList.reads += len(got) if isinstance(i, slice) else 1
        return got

    def __iter__(self):  # counted as each token is taken (a lookup iterates and stops at its first miss)
        for token in super().__iter__():
            CountingList.reads += 1
            yield token

    def __add__(self, other):
        CountingList.reads += len(self) + len(other)
        return list(self) + list(other)

    def __radd__(self, other):
        CountingList.reads += len(self) + len(other)
        return list(other) + list(self)


def manager(kind: str, share: bool = False) -> KVCacheManager:
    pool = BlockPool(64)
    return KVCacheManager(pool, BS, make_prefix_cache(kind, pool, BS), share_prefix_cache_across_tenants=share)


def request(tokens, tenant: str = "default", salt: str | None = None, output=()) -> Request:
    req = Request(f"r{len(tokens)}", list(tokens), SamplingParams(), 0.0, tenant=tenant, cache_salt=salt)
    req.output_token_ids = list(output)
    return req


def cache_tokens(mgr: KVCacheManager, tokens, tenant: str = "default", salt: str | None = None) -> None:
    """Cache every full block of ``tokens`` in ``tenant``'s (salted) namespace; only the cache holds them after."""
    ns = mgr.namespace(request([0], tenant, salt))
    cache, pool = mgr.prefix_cache, mgr.pool
    table = list(cache.match(tokens, ns))
    for b in table:
        pool.incref(b)
    table += pool.allocate_many(len(tokens) // BS - len(table))
    result = cache.insert(tokens, table, ns)
    assert result.block_ids == table
    pool.free_all(table)


@pytest.fixture(params=CACHE_KINDS)
def kind(request) -> str:
    return request.param


def test_lazy_blocks_are_the_blocks_split_into_blocks_cuts():
    """Same blocks by index, iteration, negative index and slice, for lengths around the block boundary, from a
    list, a tuple (iterated in C) and another sequence (sliced block by block)."""
    for n, make in [(n, make) for n in range(0, 3 * BS + 2) for make in (list, tuple, lambda r: r)]:
        tokens = make(range(100, 100 + n))
        lazy, eager = LazyBlocks(tokens, BS), split_into_blocks(tokens, BS)
        assert len(lazy) == len(eager) == n // BS
        assert list(lazy) == eager == [lazy[i] for i in range(len(lazy))] == lazy[:]
        if eager:
            assert lazy[-1] == eager[-1] and lazy[1:] == eager[1:]
        with pytest.raises(IndexError):
            lazy[len(eager)]


def test_a_token_run_reads_as_the_list_it_stands_for():
    """A run (the first ``length`` tokens of parts laid end to end) against the list built by concatenating and
    cutting: length, iteration, every index and slice, and the blocks LazyBlocks cuts from it -- for lengths around
    the block boundary and the parts' seam, with an empty part too."""
    for a, b in [(7, 0), (0, 7), (5, 6), (8, 4), (3, 9)]:
        parts = (list(range(100, 100 + a)), list(range(200, 200 + b)))
        for length in range(a + b + 1):
            for run_parts in ((parts[0] + parts[1],), parts):
                run, whole = TokenRun(run_parts, length), (parts[0] + parts[1])[:length]
                assert len(run) == length and list(run) == whole
                assert all(run[i] == whole[i] for i in range(-length, length))
                for i in range(-length - 1, length + 2):
                    for j in range(-length - 1, length + 2):
                        assert run[i:j] == whole[i:j], (a, b, length, i, j)
                assert run[::2] == whole[::2]
                with pytest.raises(IndexError):
                    run[length]
                assert list(LazyBlocks(run, BS)) == split_into_blocks(whole, BS)
    with pytest.raises(ValueError):
        TokenRun(([1, 2], [3]), 4)


def test_match_prefix_is_the_longest_cached_prefix_of_all_tokens_but_the_last(kind):
    """Seeded random requests over one cached sequence, their tokens split anywhere between prompt and output
    (block-aligned lengths included, where leaving out the last token drops a whole block).  Oracle, by hand: the
    most whole blocks ``k`` with ``k * BS <= tokens - 1`` whose tokens equal the cached sequence's first ``k``
    blocks.  ``computed_if_admitted`` (the peek) must count the same."""
    rng = random.Random(3)
    cached = [rng.randrange(4) for _ in range(12 * BS)]
    mgr = manager(kind)
    cache_tokens(mgr, cached)
    for _ in range(300):
        n = rng.randrange(1, 14 * BS)
        tokens = cached[:n] + [rng.randrange(4) for _ in range(n - len(cached[:n]))]
        if rng.random() < 0.5 and n > 1:
            tokens[rng.randrange(n)] = 9  # one token differs: the hit stops at its block
        cut = rng.randrange(1, n + 1)
        req = request(tokens[:cut], output=tokens[cut:])
        k = 0
        while (k + 1) * BS <= n - 1 and tokens[k * BS : (k + 1) * BS] == cached[k * BS : (k + 1) * BS]:
            k += 1
        assert mgr.match_prefix(req).num_tokens == k * BS, (n, cut)
        assert mgr.computed_if_admitted(req) == k * BS, (n, cut)


@pytest.mark.parametrize("output", [(), (5, 6, 7)])
def test_match_prefix_that_misses_block_zero_reads_one_block_of_a_long_request(kind, output):
    """A lookup through the manager (run for every admitted request) of 8,192 tokens whose first block is not
    cached reads that block, not the request: it used to build ``all_token_ids[:-1]`` -- the concatenation of
    prompt and output, then a cut of it, two copies of every token -- before the cache compared a block."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3))
    req = request([0])
    req.prompt_token_ids = CountingList([9] + list(range(8191)))
    req.output_token_ids = CountingList(output)
    CountingList.reads = 0
    assert mgr.match_prefix(req).num_tokens == 0
    assert CountingList.reads <= 2 * BS, f"read {CountingList.reads} tokens to find block 0 uncached"


def test_peek_on_hand_cases_counts_what_match_returns(kind):
    """Cached: blocks 1 2 3 (one radix edge).  First block missing -> 0; a partial last block is never
    counted -> 3; a prompt that leaves the edge halfway -> 2 (and the edge is not split); one past it -> 3."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3))
    cache = mgr.prefix_cache
    ns = mgr.namespace(request([0]))
    nodes = getattr(cache, "num_nodes", None)
    cases = {
        (9,): 0, (9, 1, 2, 3): 0, (1,): 1, (1, 2, 9, 3): 2, (1, 2, 3): 3, (1, 2, 3, 4): 3,
    }
    for blocks, expected in cases.items():
        for extra in ((), (7,), (7, 7, 7)):  # a partial last block adds nothing
            tokens = toks(*blocks, extra=extra)
            assert cache.peek(tokens, ns) == expected, (blocks, extra)
    assert cache.peek(toks(1, 2, 3), ()) == 0  # another namespace sees nothing
    assert getattr(cache, "num_nodes", None) == nodes  # no edge was split by a peek
    for blocks, expected in cases.items():
        assert len(cache.match(toks(*blocks, extra=(7,)), ns)) == expected


def test_computed_if_admitted_excludes_the_last_token_and_follows_namespaces(kind):
    """Block-aligned prompts: the last token is not matched, so a fully cached 3-block prompt counts 2 blocks
    (8 tokens), one more token counts all 3 (12).  Tenants and salts are separate spaces unless shared."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3))
    cache_tokens(mgr, toks(5, 6), tenant="alice", salt="s")
    hand = [
        (request(toks(1, 2, 3)), 8),
        (request(toks(1, 2, 3, extra=(9,))), 12),
        (request(toks(1, 2, 3, 4)), 12),
        (request(toks(1)), 0),
        (request(toks(1, 2)), 4),
        (request(toks(9, 2, 3, 4)), 0),
        (request(toks(1, 2, 3)[:1]), 0),
        (request(toks(1, 2, 3), tenant="bob"), 0),
        (request(toks(1, 2, 3), salt="s"), 0),
        (request(toks(5, 6, 7), tenant="alice", salt="s"), 8),
        (request(toks(5, 6, 7), tenant="alice"), 0),
        (request(toks(5, 6, 7), tenant="bob", salt="s"), 0),
    ]
    for req, expected in hand:
        assert mgr.computed_if_admitted(req) == expected, (req.prompt_token_ids, req.tenant, req.cache_salt)
        assert mgr.match_prefix(req).num_tokens == expected


def test_computed_if_admitted_reads_through_a_preempted_requests_output(kind):
    """A request preempted after generating waits with output tokens; its cached prefix runs on into them.
    Cached: blocks 1 2 3 4; prompt 1 2 + half of 3, output the rest of 3 + 4 -> all but the last token:
    3 blocks (12) when 4 is the end, 4 blocks (16) with one more output token."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3, 4))
    full = toks(1, 2, 3, 4)
    cut = 2 * BS + BS // 2
    for output, expected in ((full[cut:], 12), (full[cut:] + [8], 16), (full[cut:-1] + [8], 12)):
        req = request(full[:cut], output=output)
        assert mgr.computed_if_admitted(req) == expected
        assert mgr.match_prefix(req).num_tokens == expected


@pytest.mark.parametrize("output", [(), (5, 6, 7)])
def test_a_miss_at_block_zero_reads_one_block_of_a_long_prompt(kind, output):
    """8,192 tokens whose first block is not cached: the peek reads at most a couple of blocks of the prompt
    (it used to copy it and cut all 2,048 blocks), and still answers 0.  Also true through the manager for a
    request with output tokens, whose tokens are not one list."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3))
    prompt = CountingList([9] + list(range(8191)))
    req = request(prompt, output=output)
    req.prompt_token_ids = prompt
    req.output_token_ids = CountingList(output)
    CountingList.reads = 0
    assert mgr.computed_if_admitted(req) == 0
    assert CountingList.reads <= 2 * BS, f"read {CountingList.reads} tokens to find block 0 uncached"
    CountingList.reads = 0
    assert mgr.prefix_cache.peek(prompt, mgr.namespace(req)) == 0
    assert CountingList.reads <= 2 * BS


def test_a_hit_reads_only_the_blocks_it_matched_and_the_first_miss(kind):
    """A 2,000-block prompt whose first 3 blocks are cached: the peek reads about the 4 blocks it compares."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3))
    prompt = CountingList(toks(1, 2, 3) + list(range(1000, 1000 + 1997 * BS)))
    req = request(prompt)
    req.prompt_token_ids = prompt
    CountingList.reads = 0
    assert mgr.computed_if_admitted(req) == 3 * BS
    assert CountingList.reads <= 6 * BS, f"read {CountingList.reads} tokens for a 3-block hit"


def test_a_match_that_misses_block_zero_reads_one_block_of_a_long_prompt(kind):
    """8,192 tokens whose first block is not cached: ``match`` returns no block and reads that one block of the
    prompt (it used to cut all 2,048 blocks into tuples before comparing the first)."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3))
    prompt = CountingList([9] + list(range(8191)))
    CountingList.reads = 0
    assert mgr.prefix_cache.match(prompt, mgr.namespace(request([0]))) == []
    assert CountingList.reads <= BS, f"read {CountingList.reads} tokens to find block 0 uncached"


def test_a_match_hit_reads_only_the_blocks_it_matched_and_the_first_miss(kind):
    """A 2,000-block prompt whose first 3 blocks are cached: ``match`` returns those blocks, as ``insert``
    reported them, and reads the 4 blocks it compares (the 3 it matched and the first miss), once each."""
    mgr = manager(kind)
    cache_tokens(mgr, toks(1, 2, 3))
    ns = mgr.namespace(request([0]))
    cached = mgr.prefix_cache.match(toks(1, 2, 3), ns)
    assert len(cached) == 3
    prompt = CountingList(toks(1, 2, 3) + list(range(1000, 1000 + 1997 * BS)))
    CountingList.reads = 0
    assert mgr.prefix_cache.match(prompt, ns) == cached
    assert CountingList.reads <= 4 * BS, f"read {CountingList.reads} tokens for a 3-block hit"


def test_match_on_long_random_prompts_returns_the_longest_cached_prefix(kind):
    """Seeded random traffic, prompts of up to 40 blocks grown from a few shared heads (so radix edges split
    at every depth), two namespaces, a pool too large to evict.  Oracle: every block-aligned prefix ever
    inserted, spelled out, with the block its first inserter gave it (the canonical one); a lookup's answer is
    the blocks of its longest such prefix.  ``insert`` is checked against the same record."""
    rng = random.Random(5)
    pool = BlockPool(4096)
    cache = make_prefix_cache(kind, pool, BS)
    seen: dict[tuple, int] = {}  # (namespace, prefix tokens) -> canonical block

    def oracle(ns, tokens) -> list[int]:
        out = []
        for k in range(1, len(tokens) // BS + 1):
            block = seen.get((ns, tuple(tokens[: k * BS])))
            if block is None:
                break
            out.append(block)
        return out

    heads = [[rng.randrange(3) for _ in range(rng.randrange(0, 30 * BS))] for _ in range(4)]
    for step in range(400):
        ns = ((), ("a", None))[rng.randrange(2)]
        tokens = rng.choice(heads)[: rng.randrange(0, 30 * BS + 1)]
        tokens = tokens + [rng.randrange(3) for _ in range(rng.randrange(0, 10 * BS))]
        if step % 2:  # a lookup
            assert cache.match(tokens, ns) == oracle(ns, tokens), (step, ns, len(tokens))
            continue
        table = list(cache.match(tokens, ns))  # an insert after a lookup, as the engine does it
        assert table == oracle(ns, tokens)
        for b in table:
            pool.incref(b)
        table += pool.allocate_many(len(tokens) // BS - len(table))
        result = cache.insert(tokens, table, ns)
        for k, block in enumerate(table):
            seen.setdefault((ns, tuple(tokens[: (k + 1) * BS])), block)
        assert result.block_ids == oracle(ns, tokens)
        pool.free_all(table)
