"""Replay identity over a grid: does the simulator make the real engine's decisions under every policy?

The simulator claims that only the clock is simulated (see :mod:`minivllm.sim.replay`).  One test shows it for
one workload; this benchmark shows it for many.  For each policy setting and seed it serves a seeded open-loop
workload on the real model, records the run with :func:`~minivllm.sim.run.drive`, replays the recorded step
ends on a :class:`~minivllm.sim.replay.ReplayExecutor` and compares, step by step, what the two engines did:
the batch (ids, first positions, token counts), who was preempted, rejected or failed, blocks swapped each way,
running / waiting / free blocks.  It also compares what the engines *estimated*: the step-time average, auto
mode's learnt prefill rate, and every rejection's retry hint -- exactly, since the replay reads the very clock
readings the real engine took (from the same origin: see :meth:`ReplayExecutor.from_record`).

Two replays run per case, in the same run:

* ``record``: :meth:`ReplayExecutor.from_record`, which also carries what the real engine measured at start-up
  (auto mode's prefill probe and host-link copy), the sampled tokens and the clock's origin.  This is the
  simulator's claim; any divergence is a bug.
* ``times_only`` (the baseline): ``ReplayExecutor(step_ends)``, the step times and nothing else, on a clock
  from 0.  Where it diverges, the record's extra facts were needed -- the measured number of cases a replay of
  times alone gets wrong.

    python -m minivllm.bench replay                       # 10 settings x 5 seeds on the bundled model
    python -m minivllm.bench replay --seeds 10 --settings auto,swap --out benchmarks/results/FILE.json
    python -m minivllm.bench replay --workload mixed --seeds 3          # n > 1, long prompts, shared prefixes

The engine is deliberately tight (14 KV blocks, 5 seats, 40 tokens a step, requests arriving in bursts), so
that preemption, swapping, rejection and chunking all happen; the result counts them per setting, which shows
the grid exercised what it claims to check.  Two workload shapes: ``bursts`` (the default: short prompts, one
sample each) and ``mixed`` (:func:`mixed_workload`: requests of n > 1, prompts longer than a step's budget, and
system prompts shared across tenants, with prefix caching on and shared across tenants in every setting), which
reaches the decisions ``bursts`` never asks for: sibling samples sharing blocks, prefix-cache hits that shorten
a prefill, chunk boundaries that fall after a hit.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from minivllm.argtypes import output_file, positive_int
from minivllm.metrics.step_log import decode_flags

REQUESTS = 12  # per case: enough to fill the 14-block pool and the 5 seats several times over
ENGINE = dict(max_num_batched_tokens=40, max_num_seqs=5, num_gpu_blocks_override=14, max_model_len=128)


def _settings() -> dict[str, tuple[dict, tuple[str, ...], bool]]:
    """Setting name -> (engine options, tenants drawn from, whether prompts share prefixes).

    One per mechanism whose decision depends on time or on a start-up measurement: auto preemption (with
    host blocks, with a slow link, with swap space sized by the block bytes), swap, deadlines with aging,
    three classes, WFQ, caps that reject (retry hints), prefix caching (what a block holds decides what it
    shares), and no chunking (a whole prompt against the budget).  (On a fast host link auto mode swaps
    every victim here, so ``auto``, ``auto_swap_space`` and ``swap`` decide alike; the slow link recomputes.)
    """
    from minivllm.config import TenantConfig

    three = {"i": TenantConfig(priority_class="interactive"), "a": TenantConfig(priority_class="agent"),
             "b": TenantConfig(priority_class="batch")}
    return {
        "auto": (dict(preemption_mode="auto", num_cpu_blocks_override=32), ("a", "b"), False),
        "auto_slow_link": (dict(preemption_mode="auto", num_cpu_blocks_override=32, swap_bandwidth_gbps=0.01),
                           ("a", "b"), False),
        "auto_swap_space": (dict(preemption_mode="auto"), ("a", "b"), False),
        "swap": (dict(preemption_mode="swap", num_cpu_blocks_override=6), ("a", "b"), False),
        "deadline": (dict(scheduling_policy="deadline", deadline_aging_s=0.05, preemption_mode="auto",
                          num_cpu_blocks_override=16), ("a", "b"), False),
        "three_class": (dict(scheduling_policy="three_class", tenants=three, preemption_mode="auto",
                             num_cpu_blocks_override=16), ("i", "a", "b"), False),
        "caps_reject": (dict(scheduling_policy="caps", tenants={
            "a": TenantConfig(max_running=1, over_cap="reject"),
            "b": TenantConfig(max_kv_share=0.4, over_cap="reject")}), ("a", "b", "c"), False),
        "wfq": (dict(scheduling_policy="wfq", preemption_mode="auto", num_cpu_blocks_override=16),
                ("a", "b", "c"), False),
        "prefix": (dict(enable_prefix_caching=True, preemption_mode="auto", num_cpu_blocks_override=16),
                   ("a", "b"), True),
        "no_chunking": (dict(enable_chunked_prefill=False, max_num_batched_tokens=128), ("a", "b"), False),
    }


def _token_list(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    """``n`` seeded token ids that every prompt of a workload is cut from (so prompts can share prefixes)."""
    top = min(vocab_size, 40000)
    return [rng.randrange(100, top) for _ in range(n)]


def _next_arrival(rng: random.Random, t: float) -> float:
    """Bursts: several requests at once, then gaps of 1-10 ms."""
    return t + rng.choice([0.0, 0.0, 0.001, 0.003, 0.01])


def _draw_deadline(rng: random.Random, req) -> None:
    """A deadline 1-40 ms after ``req``'s arrival, or none (then it ages into line ``deadline_aging_s`` after it).
    Drawn last for each request, so a workload without deadlines draws the same requests."""
    gap = rng.choice([0.001, 0.01, 0.04, None])
    req.deadline = None if gap is None else req.arrival + gap


def workload(seed: int, tenants: tuple[str, ...], shared: bool, vocab_size: int, deadlines: bool = False) -> list:
    """``REQUESTS`` seeded requests arriving in bursts (several at once, then gaps of 1-10 ms), prompts of 6-60
    tokens cut from one seeded token list (so with ``shared`` most start alike), 4-30 tokens out each.
    ``deadlines``: each also gets a deadline 1-40 ms after its arrival, or none (then it ages into line
    ``deadline_aging_s`` after it), so a later, tighter request passes an earlier one."""
    from minivllm.sim.run import SimRequest

    rng = random.Random(seed)
    base = _token_list(rng, vocab_size, 300)
    t, out = 0.0, []
    for i in range(REQUESTS):
        t = _next_arrival(rng, t)
        length = rng.randint(6, 60)
        offset = 0 if shared and rng.random() < 0.6 else rng.randint(0, 200)
        req = SimRequest(i, round(t, 4), rng.choice(tenants), base[offset:offset + length], rng.randint(4, 30))
        if deadlines:
            _draw_deadline(rng, req)
        out.append(req)
    return out


def mixed_workload(seed: int, tenants: tuple[str, ...], vocab_size: int, deadlines: bool = False) -> list:
    """``REQUESTS`` seeded requests in bursts, as :func:`workload`, but shaped to reach what its short prompts
    cannot: about half start with one of two system prompts (32 and 48 tokens: two and three full blocks) and
    come from any tenant, so with a prefix cache shared across tenants a hit crosses tenants; about a third are
    long (62-100 prompt tokens, chunked at the 40-token budget, hit or not); about four in ten ask for n = 2 or 3
    samples, which share their prompt's blocks through the cache.  Every prompt plus its outputs fits
    ``ENGINE['max_model_len']`` (128), so no request is refused at the door for its length; but one tenant may
    hold only 40% of the 14 blocks (5: 80 tokens) under ``caps_reject`` (b) and ``three_class`` (a, the agent
    class), and its requests that need more are refused as ones that could never run (0-2 of 12 a seed for seeds 0-4).
    ``deadlines``: as :func:`workload`."""
    from minivllm.sim.run import SimRequest

    rng = random.Random(seed)
    base = _token_list(rng, vocab_size, 400)
    systems = (base[:32], base[32:80])
    t, out = 0.0, []
    for i in range(REQUESTS):
        t = _next_arrival(rng, t)
        long = rng.random() < 0.35
        head = list(rng.choice(systems)) if rng.random() < 0.5 else []
        length = rng.randint(62, 100) - len(head) if long else rng.randint(6, 24)
        offset = rng.randint(80, 400 - length)
        prompt = head + base[offset:offset + length]
        max_tokens = rng.randint(4, min(24, ENGINE["max_model_len"] - len(prompt)))
        req = SimRequest(i, round(t, 4), rng.choice(tenants), prompt, max_tokens, n=rng.choice([1, 1, 1, 2, 3]))
        if deadlines:
            _draw_deadline(rng, req)
        out.append(req)
    return out


WORKLOADS = ("bursts", "mixed")
# what the mixed shape turns on in every setting: its shared system prompts hit only with a cache, and they
# cross tenants only where the cache is shared
MIXED_OPTIONS = dict(enable_prefix_caching=True, share_prefix_cache_across_tenants=True)


def decisions(engine) -> list[tuple]:
    """What the engine decided at each step, as plain values to compare."""
    return [(r.seqs, r.num_decodes, r.preempted, r.rejected, r.failed, r.swapped_in, r.swapped_out, r.running,
             r.waiting, r.free_blocks, r.available_blocks) for r in engine.step_log]


def first_difference(a: list, b: list) -> int | None:
    """The first step at which two decision lists differ (a length difference counts at the shorter end)."""
    k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if k is None and len(a) != len(b):
        k = min(len(a), len(b))
    return k


def continued_prefill_steps(records) -> int:
    """Steps that carry the next chunk of a prefill an earlier step began: a row starting where the same request's
    last prefill row ended, with no recompute preemption of it in between.

    Why not "a prefill row that starts past position 0": a prompt whose head the prefix cache held starts past 0
    in the one step that computes all of it, and so does a recompute restarting from cached blocks; the mixed
    grid's ``no_chunking`` setting, whose prompts are never cut, counted 41 chunked steps.  A request recomputed
    after a preemption part-way through a prompt starts over: its next prompt row is not counted, even where it
    restarts from cached blocks at the very cut (the rest of its prompt in one step, as a cache hit).  One swapped
    out (the record's ``swapped``) keeps its KV and resumes at the cut: that row is the prompt's next chunk, and
    counts.  A record without ``num_decodes`` (one written by hand) has its one-token rows read as decodes.
    """
    ends: dict[str, int] = {}  # request id -> where its last prefill row ended
    count = 0
    for r in records:
        for rid in r.preempted:
            if rid not in r.swapped:
                ends.pop(rid, None)
        continued = False
        for (rid, start, n), decode in zip(r.seqs, decode_flags(r)):
            if decode:  # not a prompt's row
                continue
            continued = continued or ends.get(rid) == start
            ends[rid] = start + n
        count += continued
    return count


def _estimates(engine, rec) -> dict:
    """What the engine computed from its clock readings: a replay reading the same readings must reproduce these
    floats exactly, so a difference here is a replay bug even where every decision matched."""
    costs = engine.scheduler.costs
    return {"step_time_s": engine.step_time_s,
            "prefill_tokens_per_s": getattr(costs, "prefill_tokens_per_s", None),
            "retry_hints": sorted((r.index, r.retry_after) for r in rec.results if r.retry_after is not None)}


def run_case(model: str | None, name: str, seed: int, device: str = "cpu", shape: str = "bursts") -> dict:
    """One setting and seed of workload ``shape`` (:data:`WORKLOADS`): the real run, then both replays; what each
    replay got wrong (if anything)."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sim.replay import ReplayExecutor
    from minivllm.sim.run import drive

    extra, tenants, shared = _settings()[name]
    if shape not in WORKLOADS:
        raise ValueError(f"unknown workload {shape!r}; choose from {', '.join(WORKLOADS)}")
    mixed = shape == "mixed"
    options = {**ENGINE, "model": model, "device": device, "dtype": "float32", **extra, **(MIXED_OPTIONS if mixed else {})}
    real = LLMEngine(EngineConfig(**options))
    vocab, deadlines = real.loaded.model.args.vocab_size, extra.get("scheduling_policy") == "deadline"
    reqs = (mixed_workload(seed, tenants, vocab, deadlines) if mixed
            else workload(seed, tenants, shared, vocab, deadlines=deadlines))
    rec = drive(real, reqs)
    want, want_est = decisions(real), _estimates(real, rec)
    row = {"setting": name, "seed": seed, "steps": len(want),
           "preempted": sum(len(r.preempted) for r in real.step_log),
           "blocks_swapped_out": sum(r.swapped_out for r in real.step_log),
           "rejected": sum(len(r.rejected) for r in real.step_log),
           "chunked_prefill_steps": continued_prefill_steps(real.step_log),
           "prefix_hit_tokens": real.stats().get("prefix_cache_hits", 0),
           "samples_of_n_gt_1": sum(r.n for r in reqs if r.n > 1)}
    for label, ex in (("record", ReplayExecutor.from_record(rec)), ("times_only", ReplayExecutor(rec.step_ends))):
        sim = LLMEngine(EngineConfig(**options), executor=ex, model_max_len=real.config.max_model_len,
                        eos_token_ids=set())
        rec_sim = drive(sim, reqs)
        got = decisions(sim)
        step = first_difference(want, got)
        est = _estimates(sim, rec_sim)
        row[label] = {"first_divergent_step": step,
                      "estimates_differ": sorted(k for k in want_est if est[k] != want_est[k]),  # exactly: the same readings
                      "clock_max_abs_diff_s": max((abs(x - y) for x, y in zip(rec.step_ends, rec_sim.step_ends)),
                                                  default=0.0)}
        if step is not None:  # the two steps side by side: where a reader starts looking
            row[label]["real_step"] = repr(want[step]) if step < len(want) else None
            row[label]["replayed_step"] = repr(got[step]) if step < len(got) else None
    return row


def _diverged(case: dict) -> bool:
    return case["first_divergent_step"] is not None or bool(case["estimates_differ"])


COUNTS = ("steps", "preempted", "blocks_swapped_out", "rejected", "chunked_prefill_steps", "prefix_hit_tokens",
          "samples_of_n_gt_1")  # how much each run exercised, summed per setting


def summarize(rows: list[dict]) -> dict[str, dict]:
    """Per setting: runs; per replay, the runs whose decisions diverged and those whose estimates alone differed
    (the same decisions, but a step-time average, learnt rate or retry hint that is not the real run's float);
    and how much the runs exercised (totals)."""
    out: dict[str, dict] = {}
    for row in rows:
        s = out.setdefault(row["setting"], {"runs": 0, "diverged_record": 0, "estimates_only_record": 0,
                                            "diverged_times_only": 0, "estimates_only_times_only": 0,
                                            **dict.fromkeys(COUNTS, 0)})
        s["runs"] += 1
        for label in ("record", "times_only"):
            case = row[label]
            decided_otherwise = case["first_divergent_step"] is not None
            s[f"diverged_{label}"] += decided_otherwise
            s[f"estimates_only_{label}"] += not decided_otherwise and bool(case["estimates_differ"])
        for k in COUNTS:
            s[k] += row[k]
    return out


def _names(text: str) -> list[str]:
    known = _settings()
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown setting(s) {bad}; choose from {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--seeds", type=positive_int, default=5, help="seeds per setting (default 5)")
    ap.add_argument("--settings", type=_names, default=list(_settings()), help="settings (default: all ten)")
    ap.add_argument("--workload", choices=WORKLOADS, default="bursts",
                    help="bursts: short prompts, one sample each (default); mixed: n > 1, long prompts, system prompts "
                         "shared across tenants, prefix caching on")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=output_file, default=None, help="write the JSON result here (default: print only)")
    args = ap.parse_args(argv)

    import torch

    torch.manual_seed(0)
    t0 = time.perf_counter()
    rows = []
    for name in args.settings:
        for seed in range(args.seeds):
            row = run_case(args.model, name, seed, args.device, args.workload)
            rows.append(row)
            for label in ("record", "times_only"):
                if _diverged(row[label]):
                    print(f"{name} seed {seed}: the {label} replay diverged: {row[label]}", flush=True)
    summary = summarize(rows)
    print("runs whose decisions diverged (+ runs with the same decisions but other estimates), per replay")
    print(f"{'setting':16s} {'runs':>4s} {'record':>8s} {'times only':>10s} {'steps':>6s} {'preempt':>7s} "
          f"{'swapped':>7s} {'reject':>6s} {'chunked':>7s} {'hit tok':>7s} {'n>1':>4s}")
    for name, s in summary.items():
        rec_col = f"{s['diverged_record']}+{s['estimates_only_record']}"
        times_col = f"{s['diverged_times_only']}+{s['estimates_only_times_only']}"
        print(f"{name:16s} {s['runs']:4d} {rec_col:>8s} {times_col:>10s} {s['steps']:6d} "
              f"{s['preempted']:7d} {s['blocks_swapped_out']:7d} {s['rejected']:6d} {s['chunked_prefill_steps']:7d} "
              f"{s['prefix_hit_tokens']:7d} {s['samples_of_n_gt_1']:4d}")
    keys = ("runs", "diverged_record", "estimates_only_record", "diverged_times_only", "estimates_only_times_only")
    total = {k: sum(s[k] for s in summary.values()) for k in keys}
    wall = time.perf_counter() - t0
    print(f"replayed from the record: {total['diverged_record']} of {total['runs']} runs decided otherwise, "
          f"{total['estimates_only_record']} more estimated otherwise; replaying step times only: "
          f"{total['diverged_times_only']} and {total['estimates_only_times_only']}; {wall:.1f} s")
    if args.out:
        from minivllm.bench.results import write_result

        write_result(args.out, {"benchmark": "replay", "model": args.model or "SmolLM2-135M-Instruct (bundled)",
                                "engine": {**ENGINE, **(MIXED_OPTIONS if args.workload == "mixed" else {})},
                                "workload": args.workload, "requests_per_case": REQUESTS, "seeds": args.seeds,
                                "total": total, "settings": summary, "wall_s": wall, "cases": rows},
                     "python -m minivllm.bench replay", argv)
        print(f"wrote {args.out}")
    return 1 if total["diverged_record"] or total["estimates_only_record"] else 0


if __name__ == "__main__":
    sys.exit(main())
