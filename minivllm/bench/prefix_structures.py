"""Radix tree vs hash index: what a prefix lookup costs as the cache grows.

Usage::

    python -m minivllm.bench.prefix_structures            # under a minute, CPU only
    python -m minivllm.bench.prefix_structures --quick    # seconds, a smoke test
    python -m minivllm.bench prefix_structures --json out.json   # also write the rows as JSON

The workload imitates a chat service: a handful of long system prompts
shared by many requests, each followed by a distinct user part that ends in
a partial block.  Every request goes through the engine's cycle: ``match``
(on all tokens but the last, which is always recomputed for its logits),
reference the hits, evict if the pool is short, allocate the rest,
``insert`` (a duplicate block is kept, as the engine keeps it), finish.

The pool is sized to the target cache size, so after a warm-up the cache
sits at that size and every new block evicts an old one: the steady state of
a busy server, not an empty cache filling up.  For each size the table gives
the time per request of ``match``, ``insert`` and ``evict`` (median over
chunks, see :func:`measure_size`), and the time of one
``num_evictable_blocks`` call (the scheduler asks it before admitting
work; constant time: the pool reports every block's refcount change
between 1 and 2, and the cache keeps the count, see ``PinIndex``).

Both structures see the identical request stream, so their hit rates must
agree; the script checks that.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import asdict, dataclass

from minivllm.argtypes import output_file, positive_int
from minivllm.bench.results import times, write_result
from minivllm.engine.startup import frozen_heap
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.kv_cache_manager import KVCacheManager
from minivllm.kv.prefix import PrefixCache, make_prefix_cache, sha256_block_hash
from minivllm.request import Request
from minivllm.sampling_params import SamplingParams

BLOCK_SIZE = 16
VOCAB = 32_000
STRUCTURES = ("radix", "hash", "hash+sha256")


@dataclass(frozen=True)
class Workload:
    """Shape of the synthetic traffic (lengths in blocks)."""

    num_system_prompts: int = 16
    system_blocks: tuple[int, int] = (8, 64)
    user_blocks: tuple[int, int] = (2, 16)


def make_requests(workload: Workload, count: int, seed: int) -> list[list[int]]:
    """``count`` token sequences: a shared system prompt + a distinct suffix."""
    rng = random.Random(seed)
    systems = [
        [rng.randrange(VOCAB) for _ in range(BLOCK_SIZE * rng.randint(*workload.system_blocks))]
        for _ in range(workload.num_system_prompts)
    ]
    requests = []
    for _ in range(count):
        user_len = BLOCK_SIZE * rng.randint(*workload.user_blocks) + rng.randrange(1, BLOCK_SIZE)
        user = [rng.randrange(VOCAB) for _ in range(user_len)]
        requests.append(rng.choice(systems) + user)
    return requests


@dataclass
class Timings:
    """Seconds and token counts accumulated over the measured requests."""

    match_s: float = 0.0
    insert_s: float = 0.0
    evict_s: float = 0.0  # allocation, evicting cached blocks when the free list is empty
    query_tokens: int = 0
    hit_tokens: int = 0
    requests: int = 0

    def per_request_us(self, seconds: float) -> float:
        return 1e6 * seconds / max(1, self.requests)


_PARAMS = SamplingParams(max_tokens=1)


def serve(cache: PrefixCache, pool: BlockPool, tokens: list[int], timings: Timings) -> None:
    """One request through the engine's memory manager: match / allocate (evicting) / insert / finish."""
    kv = KVCacheManager(pool, BLOCK_SIZE, cache)  # stateless beyond pool and cache: cheap to make
    req = Request("bench", tokens, _PARAMS, 0.0)
    t0 = time.perf_counter()
    kv.share_prefix(req, kv.match_prefix(req))
    t1 = time.perf_counter()
    hits = req.num_computed_tokens
    need = len(tokens) // BLOCK_SIZE * BLOCK_SIZE - hits
    t2 = time.perf_counter()
    assert kv.allocate_slots(req, need), "the benchmark pool holds every prompt"
    t3 = time.perf_counter()
    req.num_computed_tokens += need
    t4 = time.perf_counter()
    kv.cache_full_blocks(req)
    t5 = time.perf_counter()
    kv.free(req)
    timings.match_s += t1 - t0
    timings.evict_s += t3 - t2
    timings.insert_s += t5 - t4
    timings.query_tokens += len(tokens) - 1
    timings.hit_tokens += hits
    timings.requests += 1


def build_cache(structure: str, pool: BlockPool) -> PrefixCache:
    if structure == "hash+sha256":
        return make_prefix_cache("hash", pool, BLOCK_SIZE, hash_fn=sha256_block_hash)
    return make_prefix_cache(structure, pool, BLOCK_SIZE)


@dataclass
class Row:
    size: int
    structure: str
    cached: int
    match_us: float
    insert_us: float
    evict_us: float
    hit_rate: float
    evictable_us: float

    @property
    def lookup_us(self) -> float:
        """match + insert: the cost the two structures differ in most."""
        return self.match_us + self.insert_us


def measure_size(
    size: int, structures: list[str], warmup: list[list[int]], measured: list[list[int]], rounds: int
) -> list[Row]:
    """Fill one cache per structure to ``size`` blocks, then time ``measured``.

    The measured requests are cut into ``rounds`` chunks served round-robin
    across the structures, and each column reports the median of the chunk
    means: a burst of noise from the rest of the machine then hits every
    structure alike and is voted out.
    """
    longest = max(len(t) for t in warmup + measured) // BLOCK_SIZE
    setups = []
    for structure in structures:
        pool = BlockPool(max(size, 2 * longest))
        cache = build_cache(structure, pool)
        scratch = Timings()
        for tokens in warmup:
            serve(cache, pool, tokens, scratch)
        setups.append((structure, cache, pool, []))
    rounds = min(rounds, len(measured))  # no empty chunk: its 0 us would enter the median
    # Chunk boundaries spread the remainder over the chunks, so every measured request is served (a fixed
    # ``len // rounds`` chunk left the last ``len % rounds`` out, while the header counts them all); chunk
    # means are per request, so chunks one request apart in size weigh alike in the median.
    bounds = [len(measured) * k // rounds for k in range(rounds + 1)]
    # Long-lived objects are frozen out of the cyclic GC, as ``minivllm serve`` does;
    # otherwise collector pauses that grow with the heap swamp the timings.
    with frozen_heap():
        for start, stop in zip(bounds, bounds[1:]):
            for structure, cache, pool, chunks in setups:
                timings = Timings()
                for tokens in measured[start:stop]:
                    serve(cache, pool, tokens, timings)
                chunks.append(timings)
        return [_summarize(size, structure, cache, chunks) for structure, cache, _, chunks in setups]


def _summarize(size: int, structure: str, cache: PrefixCache, chunks: list[Timings]) -> Row:
    def median_us(attr: str) -> float:
        return statistics.median(t.per_request_us(getattr(t, attr)) for t in chunks)

    t0 = time.perf_counter()
    cache.num_evictable_blocks()
    evictable_us = 1e6 * (time.perf_counter() - t0)
    hits = sum(t.hit_tokens for t in chunks) / max(1, sum(t.query_tokens for t in chunks))
    return Row(
        size,
        structure,
        cache.num_cached_blocks,
        median_us("match_s"),
        median_us("insert_s"),
        median_us("evict_s"),
        hits,
        evictable_us,
    )


def min_cache_size(workload: Workload) -> int:
    """The smallest ``size`` a row can honour: :func:`measure_size` makes the pool at least twice the full
    blocks of the longest prompt, and the workload's longest has ``system + user`` full blocks at most (its
    partial tail holds none).  Below it the cache would sit at that floor, not at the size the row is labelled
    with."""
    return 2 * (workload.system_blocks[1] + workload.user_blocks[1])


def cache_size(text: str) -> int:
    """``type=`` for ``--sizes``: a size in blocks the default workload's pool can be made to (see
    :func:`min_cache_size`)."""
    n = positive_int(text)
    floor = min_cache_size(Workload())
    if n < floor:
        raise argparse.ArgumentTypeError(
            f"must be at least {floor} blocks (twice the longest prompt's {floor // 2}), got {text!r}: the pool "
            f"is made big enough for the prompts, so the cache measured would be larger than {n}")
    return n


def warmup_requests(size: int, workload: Workload) -> int:
    """Enough requests to fill ``size`` blocks and start evicting."""
    mean_user_blocks = sum(workload.user_blocks) / 2
    return int(1.3 * size / mean_user_blocks) + 100


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'cached blocks':>13} {'structure':>12} {'match us':>9} {'insert us':>10} "
        f"{'alloc us':>9} {'total us':>9} {'hit rate':>9} {'num_evictable us':>17}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.cached:>13,} {r.structure:>12} {r.match_us:>9.1f} {r.insert_us:>10.1f} "
            f"{r.evict_us:>9.1f} {r.lookup_us + r.evict_us:>9.1f} "
            f"{r.hit_rate:>9.3f} {r.evictable_us:>17.0f}"
        )


def radix_vs_hash(rows: list[Row]) -> list[tuple[int, Row, Row]]:
    """``(size, radix row, hash row)`` for every size measured with both structures."""
    by_key = {(r.size, r.structure): r for r in rows}
    return [(size, by_key[size, "radix"], by_key[size, "hash"]) for size in sorted({r.size for r in rows})
            if (size, "radix") in by_key and (size, "hash") in by_key]


def print_comparison(rows: list[Row]) -> None:
    """One line per size: how radix compares with the default hash index."""
    for size, radix, hashed in radix_vs_hash(rows):
        print(
            f"{size:>7,} blocks: radix match+insert is {times(hashed.lookup_us / radix.lookup_us, 'faster', 'slower')} "
            f"than hash ({radix.lookup_us:.1f} vs {hashed.lookup_us:.1f} us/request)"
        )


def check_same_hits(rows: list[Row]) -> None:
    for size in {r.size for r in rows}:
        rates = {round(r.hit_rate, 12) for r in rows if r.size == size}
        if len(rates) != 1:
            raise SystemExit(f"structures disagree on hits at size {size}: {rates}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=cache_size, nargs="+", default=None, help="default 1000 10000 100000 (--quick: 200 1000)")
    parser.add_argument("--requests", type=positive_int, default=None, help="measured requests per size (default 2000, --quick: 200)")
    parser.add_argument("--structures", nargs="+", default=list(STRUCTURES), choices=STRUCTURES)
    parser.add_argument("--rounds", type=positive_int, default=8, help="chunks per row (median taken)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=output_file, default=None, help="also write the rows and the radix/hash ratios here")
    args = parser.parse_args(argv)
    # --quick fills in only what was not given (it replaced an explicit --sizes / --requests in silence)
    args.sizes = args.sizes or ([200, 1_000] if args.quick else [1_000, 10_000, 100_000])
    args.requests = args.requests or (200 if args.quick else 2_000)
    workload = Workload()
    rows = []
    for size in args.sizes:
        stream = make_requests(workload, warmup_requests(size, workload) + args.requests, args.seed)
        warmup, measured = stream[: -args.requests], stream[-args.requests :]
        rows += measure_size(size, args.structures, warmup, measured, args.rounds)
    print(
        f"block_size={BLOCK_SIZE}; {workload.num_system_prompts} shared system prompts of "
        f"{workload.system_blocks} blocks + user parts of {workload.user_blocks} blocks; "
        f"{args.requests} measured requests per row; times per request, median of "
        f"{args.rounds} chunk means; num_evictable = one call"
    )
    print_table(rows)
    print_comparison(rows)
    check_same_hits(rows)
    if args.json:
        ratios = {str(size): hashed.lookup_us / radix.lookup_us for size, radix, hashed in radix_vs_hash(rows)}
        write_result(args.json, {"rows": [{**asdict(r), "lookup_us": r.lookup_us} for r in rows],
                                 "hash_over_radix_match_insert": ratios},
                     "python -m minivllm.bench prefix_structures", argv)


if __name__ == "__main__":
    main()
