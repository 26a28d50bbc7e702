"""The model's projections at serving batch sizes: the default BLAS (``F.linear``) vs oneDNN.

A decode step multiplies a handful of rows by every weight of the model, so
its matmuls are long and thin, and the weights cannot stay in cache between
steps (a 135M-parameter fp32 model is 540 MB).  This benchmark builds random
weights of the model's real shapes (every layer's fused q/k/v, o, fused
gate/up and down projections, plus the vocabulary projection), streams through
all of them for ``M`` rows, and reports milliseconds per full pass with each
backend, the achieved GFLOP/s and the weight-read bandwidth -- the numbers
behind ``linear_backend="auto"`` choosing oneDNN on a CPU.

    python -m minivllm.bench linear [--rows 1 2 4 8 16 32 256 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import time

import torch

from minivllm.argtypes import output_file, positive_int
from minivllm.bench.results import write_result


def model_shapes(model: str | None) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """``(per-layer [(in, out)], num_layers, vocab (in, out))`` read from the model's config, no weights."""
    from minivllm.model.llama import ModelArgs
    from minivllm.model.loader import read_config, resolve_model_dir

    args = ModelArgs.from_hf_config(read_config(resolve_model_dir(model)))
    h, d, i = args.hidden_size, args.head_dim, args.intermediate_size
    layer = [(h, (args.num_heads + 2 * args.num_kv_heads) * d), (args.num_heads * d, h), (h, 2 * i), (i, h)]
    return layer, args.num_layers, (h, args.vocab_size)


def time_pass(weights, rows: int, linear, repeats: int) -> float:
    """Best-of-``repeats`` seconds for one pass over every weight with ``rows`` input rows.

    The best pass, not the mean: it is the one the rest of the machine disturbed least, and the two backends'
    own speed is what ``linear_backend="auto"`` is chosen by."""
    inputs = {w_in: torch.randn(rows, w_in) for w_in, _, _ in weights}
    for w_in, _, w in weights:  # warm-up: oneDNN builds a primitive per shape on first use
        linear(inputs[w_in], w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w_in, _, w in weights:
            linear(inputs[w_in], w)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16, 32, 256, 2048])
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--json", type=output_file, default=None)
    a = ap.parse_args()

    from minivllm.model.backends import onednn_linear_works
    from minivllm.model.llama import linear, onednn_weight

    layer, num_layers, vocab = model_shapes(a.model)
    gen = torch.Generator().manual_seed(0)
    plain = [(w_in, w_out, torch.randn(w_out, w_in, generator=gen) * 0.02)
             for _ in range(num_layers) for w_in, w_out in layer]
    plain.append((vocab[0], vocab[1], torch.randn(vocab[1], vocab[0], generator=gen) * 0.02))
    packed = [(w_in, w_out, onednn_weight(w)) for w_in, w_out, w in plain] if onednn_linear_works() else None
    weight_bytes = sum(w.numel() * 4 for _, _, w in plain)
    flops_per_row = sum(2 * w_in * w_out for w_in, w_out, _ in plain)
    print(f"{len(plain)} projections, {weight_bytes / 1e6:.0f} MB of fp32 weights, torch threads {torch.get_num_threads()}")
    print(f"{'rows':>5} {'F.linear ms':>12} {'GFLOP/s':>8} {'GB/s':>6} {'oneDNN ms':>10} {'GFLOP/s':>8} {'GB/s':>6} {'speed-up':>8}")
    results = []
    with torch.inference_mode():
        for weights, fn in ((plain, torch.nn.functional.linear), (packed, linear)):  # a throwaway pass each:
            if weights is not None:  # library start-up and cold caches would otherwise land on the first row
                time_pass(weights, a.rows[0], fn, 1)
        for rows in a.rows:
            row = {"rows": rows, "torch_ms": time_pass(plain, rows, torch.nn.functional.linear, a.repeats) * 1e3}
            if packed is not None:
                row["onednn_ms"] = time_pass(packed, rows, linear, a.repeats) * 1e3
            cells = []
            for key in ("torch_ms", "onednn_ms"):
                ms = row.get(key)
                cells.append(f"{ms:12.1f} {flops_per_row * rows / ms / 1e6:8.1f} {weight_bytes / ms / 1e6:6.1f}"
                             if ms else f"{'n/a':>12} {'':8} {'':6}")
            ratio = row["torch_ms"] / row["onednn_ms"] if packed is not None else float("nan")
            print(f"{rows:5d} {cells[0]} {cells[1]} {ratio:7.2f}x", flush=True)
            results.append(row)
    if a.json:
        write_result(a.json, {"torch_threads": torch.get_num_threads(), "weight_mb": weight_bytes / 1e6,
                              "rows": results}, "python -m minivllm.bench linear")
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
