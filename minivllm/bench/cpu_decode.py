"""``python -m minivllm.bench cpu_decode`` -- the CPU decode-attention kernel alone, by batch and context.

Why a kernel-only benchmark: a decode step of the bundled model is mostly the weights' read (on the 2-core course
machine one sequence's step took ~18 ms at 64 tokens of context and ~20 ms at 1,024), so a change to the attention
kernel moves a whole step by a few per cent, inside the step-to-step noise.  Timed alone, on the model's shape (9 query heads on 3 K/V heads, 64 dims, 16-token
blocks, 30 layers' worth of calls), the kernel's own time and its effective K/V read rate show what the change does.

What it runs: ``minivllm.model.cpu_attention.paged_decode`` on ``batch`` sequences of ``context`` tokens each,
their blocks scattered over the pool as a server's are, one call per layer, and reports the median of ``repeats``
such 30-call passes: milliseconds per pass (one step's decode attention) and the K/V bytes read per second.

    python -m minivllm.bench cpu_decode                                   # batches 1,2,4 x contexts 64,1024,4096
    python -m minivllm.bench ab --base REV --same-bench -- cpu_decode --out {out}   # two kernels, one session
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.argtypes import comma_list, output_file, positive_int
from minivllm.bench.results import write_result

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16  # SmolLM2-135M, as the engine serves it


def case(batch: int, context: int, seed: int = 0):
    """Queries, each layer's K/V pool and the block tables for ``batch`` sequences of ``context`` tokens, blocks in
    random order.  A pool per layer, as the engine keeps them: one pool read 30 times would stay in cache from
    the second call on, which no step of a real model enjoys."""
    g = torch.Generator().manual_seed(seed)
    per = -(-context // BLOCK)
    num_blocks = batch * per
    k = torch.randn(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(LAYERS, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g)
    table = torch.randperm(num_blocks, generator=g).to(torch.int32).view(batch, per)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g)
    return q, k, v, table, torch.full((batch,), context, dtype=torch.int32)


def time_pass(batch: int, context: int, repeats: int) -> float:
    """Median seconds of ``LAYERS`` kernel calls (one step's decode attention), after one warm-up pass."""
    from minivllm.model.cpu_attention import load_kernel, paged_decode

    kernel = load_kernel()
    if kernel is None:
        raise ValueError("the CPU decode kernel could not be built here (no C compiler?)")
    q, k, v, table, lens = case(batch, context)
    times = []
    for i in range(repeats + 1):
        t = time.perf_counter()
        for layer in range(LAYERS):
            paged_decode(q, k[layer], v[layer], table, lens, 0.125, kernel)
        if i:  # the first pass pays for cold caches
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench cpu_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=comma_list(positive_int), default=[1, 2, 4], metavar="N,N,...")
    ap.add_argument("--contexts", type=comma_list(positive_int), default=[64, 1024, 4096], metavar="N,N,...")
    ap.add_argument("--repeats", type=positive_int, default=20, help="30-call passes per cell (median)")
    ap.add_argument("--out", type=output_file, default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    print(f"CPU decode attention, SmolLM2 shape x {LAYERS} layers, torch threads {torch.get_num_threads()}")
    print(f"{'batch':>5} {'context':>8} {'ms / step':>10} {'K/V GB/s':>9}")
    rows = []
    for batch in a.batches:
        for context in a.contexts:
            s = time_pass(batch, context, a.repeats)
            kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * 4
            rows.append({"batch": batch, "context": context, "ms_per_step": 1e3 * s, "kv_gb_per_s": kv_bytes / s / 1e9})
            print(f"{batch:5d} {context:8d} {1e3 * s:10.3f} {kv_bytes / s / 1e9:9.2f}", flush=True)
    if a.out:
        write_result(a.out, {"benchmark": "cpu_decode", "torch_threads": torch.get_num_threads(), "rows": rows},
                     "python -m minivllm.bench cpu_decode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
