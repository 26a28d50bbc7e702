"""Host overhead per decode step: what the engine costs in Python when the model costs nothing.

On a GPU a decode step of a small model takes a few milliseconds, so whatever
the engine does on the host -- scheduling, building the batch's tensors,
turning sampled tokens into outputs -- *is* the step.  This benchmark runs the
real engine with the simulated executor (no model) at ``--seqs`` decoding
sequences, block size 16, and reports the median and p90 wall time of:

* ``engine.step()`` as a whole (scheduler + output processing; the executor is free);
* ``build_attention_metadata`` alone (the batch preparation a real executor does),

after the sequences have decoded ``--warmup`` tokens, and again after more
tokens, so one sees whether the cost grows with output length (it should not).
nano-vllm's figures for the same step on this machine class, from the issue:
scheduler + postprocess 250-370 us, decode preparation 3.0 ms at 256 sequences.

    python -m minivllm.bench host_overhead
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

NANO_VLLM_STEP_US = (250, 370)
NANO_VLLM_PREP_US = 3000


def _engine(seqs: int, max_tokens: int, output_kind: str | None):
    from minivllm import EngineConfig, LLMEngine, SamplingParams
    from minivllm.sim import SimulatedExecutor

    cfg = EngineConfig(num_gpu_blocks_override=seqs * (-(-(64 + max_tokens) // 16) + 1), block_size=16,
                       max_num_seqs=seqs, max_num_batched_tokens=max(2048, seqs), max_model_len=64 + max_tokens + 16,
                       device="cpu")
    engine = LLMEngine(cfg, executor=SimulatedExecutor(vocab_size=32000), model_max_len=64 + max_tokens + 16,
                       eos_token_ids=set())
    kw = {} if output_kind is None else {"output_kind": output_kind}
    for i in range(seqs):
        engine.add_request({"prompt_token_ids": [100 + (i * 7 + j) % 900 for j in range(64)]},
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw))
    return engine


def _time_steps(engine, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        engine.step()
        out.append(time.perf_counter() - t0)
    return out


def _time_prep(engine, n: int) -> list[float]:
    from minivllm.model.runner import build_attention_metadata

    batch = engine.scheduler.build_batch()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        build_attention_metadata(batch.seqs, 16, torch.device("cpu"))
        out.append(time.perf_counter() - t0)
    return out


def measure(seqs: int, warmup: int, later: int, samples: int, output_kind: str | None) -> dict:
    engine = _engine(seqs, warmup + later + 2 * samples + 64, output_kind)
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()  # prefill everyone
    for _ in range(warmup):
        engine.step()
    early_step, early_prep = _time_steps(engine, samples), _time_prep(engine, samples)
    for _ in range(later):
        engine.step()
    late_step, late_prep = _time_steps(engine, samples), _time_prep(engine, samples)
    decoding = len(engine.scheduler.running)
    us = lambda xs: round(1e6 * statistics.median(xs), 1)  # noqa: E731
    p90 = lambda xs: round(1e6 * sorted(xs)[int(0.9 * len(xs))], 1)  # noqa: E731
    return {
        "seqs": decoding, "output_kind": output_kind or "cumulative",
        "step_us_median_early": us(early_step), "step_us_p90_early": p90(early_step),
        "step_us_median_late": us(late_step), "step_us_p90_late": p90(late_step),
        "prep_us_median_early": us(early_prep), "prep_us_median_late": us(late_prep),
        "tokens_early": warmup, "tokens_late": warmup + samples + later,
    }


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench host_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=16, help="decode steps before the first measurement")
    ap.add_argument("--later", type=int, default=400, help="decode steps between the two measurements")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(args.seqs, args.warmup, args.later, args.samples, kind) for kind in (None, "final_only")]
    print(f"host overhead per decode step, {args.seqs} sequences, block 16, simulated executor (no model)")
    print(f"{'outputs':<12} {'step p50 @' + str(rows[0]['tokens_early']) + ' tok':>18} {'step p50 @' + str(rows[0]['tokens_late']) + ' tok':>18} "
          f"{'step p90 late':>14} {'prep p50 early':>15} {'prep p50 late':>14}")
    for r in rows:
        print(f"{r['output_kind']:<12} {r['step_us_median_early']:>15.0f} us {r['step_us_median_late']:>15.0f} us "
              f"{r['step_us_p90_late']:>11.0f} us {r['prep_us_median_early']:>12.0f} us {r['prep_us_median_late']:>11.0f} us")
    print(f"nano-vllm, same step, this machine class (issue 12): scheduler+postprocess {NANO_VLLM_STEP_US[0]}-"
          f"{NANO_VLLM_STEP_US[1]} us, decode preparation {NANO_VLLM_PREP_US} us; target: half of those")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"rows": rows, "nano_vllm_step_us": NANO_VLLM_STEP_US,
                                        "nano_vllm_prep_us": NANO_VLLM_PREP_US}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
