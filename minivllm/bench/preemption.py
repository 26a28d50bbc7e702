"""Preemption modes side by side: one overloaded workload, recompute / swap / reject / auto, one run.

The KV pool is sized to a fraction of what the workload needs at its peak, so
the engine must preempt (or, in reject mode, turn requests away).  For each
mode the table shows preemptions (by swap / by recompute), recomputed tokens,
bytes swapped out and in, rejects, output throughput and TTFT/ITL percentiles
of the requests that were served.  Greedy outputs of every served request are
checked against the recompute run: a preemption mode changes *when* tokens
appear, never *which*.

    python -m minivllm.bench preemption                 # the bundled model on this machine
    python -m minivllm.bench preemption --executor sim  # the simulated executor, a bigger workload
"""

from __future__ import annotations

import argparse
import random
import time


from minivllm.argtypes import fraction, nonnegative_int, output_file, positive_int
from minivllm.bench.results import write_result
from minivllm.metrics.stats import interpolated

MODES = ("recompute", "swap", "reject", "auto")
CPU_BLOCKS = 256  # --cpu-blocks' default


def make_workload(n: int, seed: int, vocab: int, prompt_range=(60, 240), output_range=(24, 96)):
    """``n`` seeded ``(prompt ids, output length)`` pairs; ids start at 100 because the lowest ids are the
    tokenizer's special and added tokens (SmolLM2: 0-16, EOS and the chat markers among them), which no prompt
    should hold."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 1) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range))
        for _ in range(n)
    ]


def percentiles(values: list[float]) -> tuple[float, float]:
    return interpolated(values, 50), interpolated(values, 99)


def run_mode(mode: str, workload, args, blocks: int) -> dict:
    from minivllm import LLM, SamplingParams
    from minivllm.sim import SimulatedExecutor

    options = dict(num_gpu_blocks_override=blocks, max_model_len=512, max_num_batched_tokens=args.budget,
                   block_size=16, preemption_mode=mode, num_cpu_blocks_override=args.cpu_blocks, seed=0)
    if args.executor == "sim":
        llm = LLM(executor=SimulatedExecutor(), tokenizer=None, **options)  # no EOS: every request ignore_eos
    else:
        llm = LLM(dtype="float32", **options)
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in workload]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    st = llm.engine.stats()
    served = [o for o in outs if o.outputs[0].finish_reason != "rejected"]
    ttft = [o.metrics.ttft for o in served]
    itl = [g for o in served for g in o.metrics.itls]
    out_tokens = sum(len(o.outputs[0].token_ids) for o in served)
    clock = llm.engine.executor.now() if args.executor == "sim" else wall
    ttft50, ttft99 = percentiles(ttft)
    itl50, itl99 = percentiles(itl)
    return {
        "mode": mode,
        "served": len(served),
        "rejected": st["num_rejected"],
        "preemptions": st["num_preemptions"],
        "swap_preemptions": st["num_swap_preemptions"],
        "recompute_preemptions": st["num_recompute_preemptions"],
        "recomputed_tokens": st["recomputed_tokens"],
        "swapped_out_bytes": st["swapped_out_bytes"],
        "swapped_in_bytes": st["swapped_in_bytes"],
        "output_tokens": out_tokens,
        "seconds": clock,
        "tokens_per_s": out_tokens / clock,
        "ttft_p50_ms": 1e3 * ttft50, "ttft_p99_ms": 1e3 * ttft99,
        "itl_p50_ms": 1e3 * itl50, "itl_p99_ms": 1e3 * itl99,
        "leaked_blocks": st["num_blocks"] - st["free_blocks"],
        "tokens": {o.request_id: o.outputs[0].token_ids for o in served},
        "order": [o.request_id for o in outs],
    }


def format_table(rows: list[dict]) -> str:
    head = (f"{'mode':<10} {'served':>6} {'reject':>6} {'preempt':>7} {'swap/rec':>9} {'recomp tok':>10} "
            f"{'swap out MB':>11} {'swap in MB':>10} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
            f"{'ITL p50':>8} {'ITL p99':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['mode']:<10} {r['served']:>6} {r['rejected']:>6} {r['preemptions']:>7} "
            f"{r['swap_preemptions']:>4}/{r['recompute_preemptions']:<4} {r['recomputed_tokens']:>10} "
            f"{r['swapped_out_bytes'] / 1e6:>11.1f} {r['swapped_in_bytes'] / 1e6:>10.1f} {r['tokens_per_s']:>7.1f} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['itl_p50_ms']:>6.0f}ms {r['itl_p99_ms']:>6.0f}ms"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench preemption", description=__doc__.split("\n\n")[0])
    ap.add_argument("--executor", choices=("model", "sim"), default="model")
    ap.add_argument("--requests", type=positive_int, default=None, help="default 16 (model) / 400 (sim)")
    # (a share in (0, 1]: at 1 the pool holds every request at once and nothing is preempted, and a share past a
    # float's range, 1e308, was an OverflowError traceback sizing the pool)
    ap.add_argument("--kv-share", type=fraction, default=0.15,
                    help="KV pool as a fraction (0-1] of the blocks every request would hold at once at its end (never "
                         "under 32 blocks nor under the longest request's, so a small workload gets a larger share)")
    ap.add_argument("--budget", type=positive_int, default=512, help="max_num_batched_tokens")
    # (None when not given, so that one given beside modes that never swap can be told apart and refused)
    ap.add_argument("--cpu-blocks", type=nonnegative_int, default=None,
                    help=f"host-tier blocks for swap / auto (default {CPU_BLOCKS})")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=output_file, default=None, help="write the result JSON here")
    args = ap.parse_args()
    if args.cpu_blocks is not None and not {"swap", "auto"} & set(args.modes):
        ap.error(f"argument --cpu-blocks: sizes the host tier, which only --modes swap and auto use; "
                 f"{' and '.join(args.modes)} never swap: drop it")
    args.cpu_blocks = CPU_BLOCKS if args.cpu_blocks is None else args.cpu_blocks
    n = args.requests or (16 if args.executor == "model" else 400)
    workload = make_workload(n, args.seed, vocab=49152)
    peak = sum(-(-(len(p) + m) // 16) for p, m in workload)
    longest = max(-(-(len(p) + m) // 16) for p, m in workload)
    blocks = max(32, int(peak * args.kv_share), longest)
    print(f"workload: {n} requests, {sum(len(p) for p, _ in workload)} prompt / {sum(m for _, m in workload)} "
          f"output tokens, all at once; KV pool {blocks} blocks of 16 = {blocks / peak:.0%} of the "
          f"{peak} blocks the batch would need; host tier {args.cpu_blocks} blocks; executor: {args.executor}")
    rows = [run_mode(mode, workload, args, blocks) for mode in args.modes]
    print(format_table(rows))
    base = next((r for r in rows if r["mode"] == "recompute"), rows[0])
    for r in rows:
        same = all(base["tokens"].get(rid) == toks for rid, toks in r["tokens"].items() if rid in base["tokens"])
        r[f"outputs_identical_to_{base['mode']}"] = same  # kept in the result file, not only printed
        print(f"{r['mode']:<10} served outputs identical to {base['mode']}: {'yes' if same else 'NO'}; "
              f"leaked blocks: {r['leaked_blocks']}")
    if args.out:
        slim = [{k: v for k, v in r.items() if k not in ("tokens", "order")} for r in rows]
        write_result(args.out, {"workload": {"requests": n, "kv_blocks": blocks, "peak_blocks": peak,
                                             "cpu_blocks": args.cpu_blocks, "executor": args.executor},
                                "rows": slim}, "python -m minivllm.bench preemption")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
