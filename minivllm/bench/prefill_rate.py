"""Auto preemption's learnt prefill rate on a busy stream: the fitted marginal cost against a plain prefill.

``preemption_mode="auto"`` prices recomputing a victim of ``N`` tokens as ``N / prefill rate``.  The rate
starts from a prefill timed at start-up and is then fitted from the steps the engine serves
(:class:`~minivllm.sched.scheduler.PrefillRateFit`: step time = a + b * prefill tokens + c * decode rows, rate
1 / b).  This benchmark serves a stream that keeps ``--max-num-seqs`` requests running on the real model and
reports, from the very same steps:

* the engine's learnt rate (the fit, where it trusted one; else the start-up probe's);
* the estimate the fit replaced, as a baseline: a moving average (weight 0.2) of *all* of a step's tokens over
  its time, over the steps that carried prefill -- which charges each prefill token a share of the step's
  fixed cost and of every decode row riding along;
* an independent check of the fit: ordinary least squares (numpy) over every step;
* a plain prefill of 64, 128 and 256 tokens timed after the stream, the cost a recompute actually adds.

    python -m minivllm.bench prefill_rate                       # chat-like: short prompts, long answers
    python -m minivllm.bench prefill_rate --prompt-range 20,300 --output-range 10,80
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

from minivllm.argtypes import output_file, positive_int
from minivllm.bench.results import write_result
from minivllm.metrics.step_log import decode_flags

_OLD_EMA = 0.2  # the weight the replaced estimate gave the newest step


def int_range(text: str) -> tuple[int, int]:
    """``LO,HI`` with ``1 <= LO < HI``: a half-open range of lengths to draw from."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two integers), got {text!r}") from None
    if not 1 <= lo < hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO < HI, got {text!r}")
    return lo, hi


def step_terms(step_log, prompt_lens: dict[str, int]) -> list[tuple[int, int, float]]:
    """``(prefill tokens, decode rows, seconds)`` per step, each timed from the end of the step before.

    A row is a decode as the engine's record counts it (``num_decodes``: a recompute's chunks past the prompt,
    one-token ones included, are prefill), or, in a record without the count, when it computes one token past
    its prompt.  Steps that moved KV over the host link are left out, as the engine's fit
    leaves them out: their time holds copies that are neither kind of work.
    """
    out, last = [], None
    for rec in step_log:
        if last is not None and rec.seq_ids and not (rec.swapped_in or rec.swapped_out) and rec.time > last:
            decode = sum(decode_flags(rec, prompt_lens))
            out.append((rec.num_tokens - decode, decode, rec.time - last))
        last = rec.time
    return out


def whole_step_rate(terms, start: float) -> float:
    """The replaced estimate: a moving average of (all tokens / step time) over the steps that carried prefill."""
    rate = start
    for prefill, decode, dt in terms:
        if prefill:
            rate = (1 - _OLD_EMA) * rate + _OLD_EMA * (prefill + decode) / dt
    return rate


def least_squares(terms) -> dict[str, float]:
    """Ordinary least squares of step time on (1, prefill tokens, decode rows) over every step: no decay, no
    guards -- the independent check of the engine's running fit."""
    import numpy as np

    x = np.array([[1.0, p, d] for p, d, _ in terms])
    t = np.array([dt for _, _, dt in terms])
    a, b, c = np.linalg.lstsq(x, t, rcond=None)[0]
    return {"step_s": float(a), "per_prefill_token_s": float(b), "per_decode_row_s": float(c),
            "rate": float(1 / b) if b > 0 else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench prefill_rate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=positive_int, default=40)
    ap.add_argument("--prompt-range", type=int_range, default=(8, 40), help="prompt lengths drawn from [LO, HI)")
    ap.add_argument("--output-range", type=int_range, default=(40, 120), help="output lengths drawn from [LO, HI)")
    ap.add_argument("--max-num-seqs", type=positive_int, default=16)
    ap.add_argument("--budget", type=positive_int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=output_file, default=None,
                    help="result JSON (default: benchmarks/results/<date>_cpu-<N>core_prefill_rate.json)")
    args = ap.parse_args(argv)

    import torch

    from minivllm import LLM, SamplingParams

    torch.manual_seed(0)
    llm = LLM(preemption_mode="auto", device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.budget, max_model_len=1024)
    engine = llm.engine
    probe = engine.scheduler.costs.prefill_tokens_per_s
    rng, prompt_lens = random.Random(args.seed), {}

    def add() -> None:
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randrange(*args.prompt_range))]
        rid = engine.add_request({"prompt_token_ids": prompt},
                                 SamplingParams(max_tokens=rng.randrange(*args.output_range), ignore_eos=True))
        prompt_lens[rid] = len(prompt)

    added = min(args.requests, args.max_num_seqs)
    for _ in range(added):
        add()
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():  # one new request whenever one finishes: the engine stays full
        for out in engine.step():
            if out.finished and added < args.requests:
                add()
                added += 1
    wall = time.perf_counter() - t0
    terms = step_terms(engine.step_log, prompt_lens)
    learnt = engine.scheduler.costs.prefill_tokens_per_s
    plain = {n: engine.model_runner.measure_prefill_rate(n) for n in (64, 128, 256)}
    with_prefill = [t for t in terms if t[0]]
    doc = {
        "benchmark": "prefill_rate", "model": "SmolLM2-135M-Instruct", "device": str(engine.config.device),
        "torch_threads": torch.get_num_threads(), "requests": args.requests, "prompt_range": list(args.prompt_range),
        "output_range": list(args.output_range), "max_num_seqs": args.max_num_seqs, "budget": args.budget,
        "steps": len(terms), "steps_with_prefill": len(with_prefill),
        "mean_prefill_tokens_in_prefill_steps": sum(p for p, _, _ in with_prefill) / max(1, len(with_prefill)),
        "mean_decode_rows_in_prefill_steps": sum(d for _, d, _ in with_prefill) / max(1, len(with_prefill)),
        "wall_s": wall, "startup_probe_rate": probe, "learnt_rate": learnt,
        "learnt_from_fit": learnt != probe,  # the probe's rate stands until the fit trusts a slope
        "whole_step_rate_baseline": whole_step_rate(terms, probe), "least_squares": least_squares(terms),
        "plain_prefill_rate": {str(n): r for n, r in plain.items()},
    }
    ls = doc["least_squares"]
    print(f"{len(terms)} steps ({len(with_prefill)} with prefill: {doc['mean_prefill_tokens_in_prefill_steps']:.0f} "
          f"prefill tokens and {doc['mean_decode_rows_in_prefill_steps']:.1f} decode rows on average), {wall:.1f} s")
    print(f"start-up probe                  {probe:8.0f} tokens/s")
    print(f"learnt (marginal fit)           {learnt:8.0f} tokens/s   "
          f"{'fitted' if doc['learnt_from_fit'] else 'the probe still: no fit trusted yet'}")
    print(f"baseline: whole-step average    {doc['whole_step_rate_baseline']:8.0f} tokens/s   (the estimate the fit replaced)")
    print(f"check: least squares, all steps {ls['rate'] or float('nan'):8.0f} tokens/s   "
          f"(a {1e3 * ls['step_s']:.1f} ms, b {1e6 * ls['per_prefill_token_s']:.0f} us/token, "
          f"c {1e3 * ls['per_decode_row_s']:.2f} ms/row)")
    print("plain prefill                   " + ", ".join(f"{n} tokens {r:.0f}" for n, r in plain.items()) + " tokens/s")
    path = args.json or os.path.join("benchmarks", "results",
                                     f"{time.strftime('%Y-%m-%d')}_cpu-{os.cpu_count()}core_prefill_rate.json")
    write_result(path, doc, "python -m minivllm.bench prefill_rate", argv)
    print(f"wrote {path}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
