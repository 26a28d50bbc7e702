"""``python -m minivllm.bench fleet``: capacity planning for a fleet of replicas behind a router, simulated.

Two questions a learner has once one engine is not enough:

(a) **How many replicas for X requests/s under an SLO?**  Sweep the number of
    replicas at a fixed offered load; the answer is the smallest N whose
    goodput (the fraction of requests meeting both the TTFT and the ITL SLO)
    reaches the target.
(b) **How much does prefix-aware routing buy?**  The same sweep for every
    router on a chat mix (shared system prompts, multi-turn sessions whose
    history grows): replicas x router -> goodput, p99 TTFT and the fleet's
    prefix-cache hit rate.

Every replica is the real engine (scheduler, KV manager, prefix cache) on a
simulated forward pass: by default the roofline cost model of a Llama-3-8B
shape on an L4 (datasheet preset, :mod:`minivllm.sim.presets`; ``--hardware h100``
for an H100), or
``--hardware linear`` for the three-constant :data:`~minivllm.sim.fleet.GPU_LIKE`
model; see :mod:`minivllm.sim.fleet`.  Runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

from minivllm.argtypes import fraction, output_file, positive_float, refuse_unread
from minivllm.bench.results import write_result
from minivllm.sim.fleet import (GPU_LIKE, KEY_BLOCKS, REPLICA, ChatMix, gpu_like_executor, replica_kv_blocks,
                                roofline_factory, run_fleet)
from minivllm.sim.router import ROUTERS, HashRing

DEFAULT_OUT = "benchmarks/results/2026-12-05_cpu-2core_warmup_fleet_sim.json"
MODEL = "llama-3-8b"  # --model's default (None in the parser: the linear cost model has no model to take one)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("replica counts must be >= 1")
    return sorted(set(values))


def _routers(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in ROUTERS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown router(s) {bad}; choose from {', '.join(ROUTERS)}")
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench fleet", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=positive_float, default=20.0, help="offered load while sessions overlap, requests/s (default 20)")
    ap.add_argument("--duration", type=positive_float, default=6.0, help="seconds measured after the warm-up (virtual, default 6)")
    ap.add_argument("--hardware", default="l4", help="roofline hardware preset (l4, a100, h100, h200) or 'linear' "
                    "(default l4: an H100 serves this mix at ~60 requests/s per replica, and simulating a fleet of them "
                    "takes minutes on a laptop; try --hardware h100 --rate 200)")
    ap.add_argument("--model", default=None, help=f"roofline model preset (default {MODEL}); not with --hardware linear")
    ap.add_argument("--replicas", type=_ints, default=[1, 2, 3, 4, 5, 6, 7, 8], help="replica counts to sweep (default 1-8)")
    ap.add_argument("--routers", type=_routers, default=list(ROUTERS), help="routers (default all three)")
    ap.add_argument("--slo-ttft-ms", type=positive_float, default=500.0)
    ap.add_argument("--slo-itl-ms", type=positive_float, default=100.0, help="per-request p99 ITL bound")
    ap.add_argument("--min-goodput", type=fraction, default=0.95, help="fraction of requests within both SLOs")
    ap.add_argument("--seed", type=int, default=0)
    # "" is the default's "print only"; any other name is checked as every benchmark's --out is, before the sweep
    # (a directory failed only once every fleet had run, and "results/" wrote a file named results)
    ap.add_argument("--out", type=lambda text: output_file(text) if text else text, default="",
                    help=f"write the JSON results here (the committed run: {DEFAULT_OUT}; "
                         "default: print only, so a rerun never overwrites it)")
    return ap


def sweep(workload: ChatMix, replicas: list[int], routers: list[str], slo_ttft: float, slo_itl: float,
          executor_factory=None) -> list[dict]:
    """One row per (replicas, router), every figure the measuring window's; with one replica every router makes
    the same choice, so it runs once.  Each fleet runs only until the window's requests are done
    (``until``, :meth:`~minivllm.sim.fleet.Fleet.run`): what follows cannot change them."""
    rows = []
    for n in replicas:
        single = None
        for name in routers:
            if n == 1 and single is not None:
                rows.append({**single, "router": name})
                continue
            t0 = time.perf_counter()
            res = run_fleet(workload, n, name, executor_factory=executor_factory, until=workload.window[1])
            s = res.summary(slo_ttft, slo_itl, window=workload.window)
            row = {"replicas": n, "router": name, "requests": s["requests"], "offered_rps": s["offered_rps"], "good": s["good"],
                   "goodput_fraction": s["goodput_fraction"], "goodput_rps": s["goodput_rps"],
                   "ttft_ms": s["ttft_ms"], "itl_ms": s["itl_ms"], "e2e_s": s["e2e_s"],
                   "prefix_hit_rate": s["prefix_hit_rate"], "replica_requests": s["replica_requests"],
                   "replica_hit_rate": s["replica_hit_rate"], "spilled": s["spilled"],
                   "preemptions": s["preemptions"], "wall_s": time.perf_counter() - t0}
            rows.append(row)
            if n == 1:
                single = row
    return rows


def key_movement(sizes: list[int], num_keys: int = 4000, seed: int = 0) -> list[dict]:
    """The share of prefix keys that change owner when a fleet of N replicas grows to N + 1.

    Why it is part of the capacity plan: a key that changes owner lands on a replica whose cache has never seen
    its conversation, so every moved key is a cold prefill.  The ring (the router's own :class:`HashRing`,
    64 virtual nodes) should move about ``1/(N+1)`` of them, all to the new replica; ``hash % N`` keeps a key
    only when ``hash mod N(N+1) < N``, so it moves ``N/(N+1)`` of them.  Keys are random 64-bit hashes, as
    :func:`~minivllm.sim.router.prefix_key` makes them.
    """
    rng = random.Random(seed)
    keys = [rng.getrandbits(64) for _ in range(num_keys)]
    rows = []
    for n in sizes:
        old, new = HashRing(n), HashRing(n + 1)
        moved = [k for k in keys if old.owner(k) != new.owner(k)]
        rows.append({"from": n, "to": n + 1, "keys": num_keys, "ring_moved": len(moved) / num_keys,
                     "ring_moved_elsewhere": sum(new.owner(k) != n for k in moved),
                     "modulo_moved": sum(k % n != k % (n + 1) for k in keys) / num_keys,
                     "ideal_ring": 1 / (n + 1), "ideal_modulo": n / (n + 1)})
    return rows


def smallest_meeting(rows: list[dict], router: str, min_goodput: float) -> int | None:
    """The fewest replicas whose goodput fraction reaches ``min_goodput`` with ``router`` (None: none swept)."""
    ok = [r["replicas"] for r in rows if r["router"] == router and (r["goodput_fraction"] or 0) >= min_goodput]
    return min(ok) if ok else None


def _cell(x, fmt: str) -> str:
    """``x`` formatted, or "-" when the window had no finished request to measure (a very low --rate)."""
    return format(x, fmt) if x is not None else format("-", fmt.rstrip("%f").split(".")[0])


def format_table(rows: list[dict]) -> str:
    head = f"{'replicas':>8} {'router':<18} {'req/s':>6} {'goodput':>8} {'good/s':>7} {'TTFT p50/p99 ms':>16} {'ITL p99 ms':>10} {'hit rate':>8} {'spill':>5} {'preempt':>7}  requests per replica"
    lines = [head, "-" * len(head)]
    for r in rows:
        t = r["ttft_ms"]
        lines.append(f"{r['replicas']:>8} {r['router']:<18} {r['offered_rps']:>6.1f} {_cell(r['goodput_fraction'], '>8.1%')} "
                     f"{_cell(r['goodput_rps'], '>7.1f')} {_cell(t['p50'], '>7.0f')}/{_cell(t['p99'], '<8.0f')} "
                     f"{_cell(r['itl_ms']['p99'], '>10.0f')} {r['prefix_hit_rate']:>8.1%} "
                     f"{r['spilled']:>5} {r['preemptions']:>7}  {r['replica_requests']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.hardware == "linear":  # three constants per step: no model shape enters them
        refuse_unread(ap, args, ("model",), "with --hardware linear (a step cost of three constants, no model)")
    args.model = MODEL if args.model is None else args.model
    t0 = time.perf_counter()
    slo_ttft, slo_itl = args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000
    if args.hardware == "linear":
        factory, cost = gpu_like_executor, f"linear step cost {GPU_LIKE}"
    else:
        try:
            factory = roofline_factory(args.hardware, args.model)
        except ValueError as exc:
            print(f"python -m minivllm.bench fleet: error: {exc}", file=sys.stderr)
            return 2
        cost = f"roofline, {args.model} on {args.hardware}"
    workload = ChatMix(args.rate, args.duration, seed=args.seed, executor_factory=factory)  # warm-up: these replicas' answers
    device_blocks = replica_kv_blocks(factory())  # None: the linear model, which has no device to size a pool from
    replica = dict(REPLICA, num_blocks=device_blocks or REPLICA["num_blocks"])
    sized = "fixed" if device_blocks is None else "what the device holds after the weights at 90%"
    print(f"fleet (simulated: real engines; {cost}; {replica['num_blocks']} KV blocks of 16 tokens per replica, {sized})")
    print(f"chat mix: {len(workload.arrivals())} sessions ({workload.num_requests()} requests, {workload.warmup:g} s of "
          f"warm-up), measured over {args.duration:g} s; nominal ~{args.rate:g} requests/s (closed loop: measured per row); "
          f"SLO TTFT <= {args.slo_ttft_ms:g} ms, p99 ITL <= {args.slo_itl_ms:g} ms, goal {args.min_goodput:.0%} of requests")
    rows = sweep(workload, args.replicas, args.routers, slo_ttft, slo_itl, factory)
    print(format_table(rows))
    answers = {r: smallest_meeting(rows, r, args.min_goodput) for r in args.routers}
    rates = [r["offered_rps"] for r in rows]
    print(f"(a) smallest fleet meeting the SLO at {min(rates):.1f}-{max(rates):.1f} requests/s (measured; the later "
          f"turns are closed loop, so a slower fleet is offered a little less): " + ", ".join(
              f"{r} {'> ' + str(max(args.replicas)) if n is None else n}" for r, n in answers.items()))
    n_max = max(args.replicas)
    by = {(r["replicas"], r["router"]): r for r in rows}
    if n_max > 1 and {"round_robin", "prefix_affinity"} <= set(args.routers):
        a, b = by[(n_max, "round_robin")], by[(n_max, "prefix_affinity")]
        print(f"(b) at {n_max} replicas prefix affinity: hit rate {_cell(a['prefix_hit_rate'], '.1%')} -> "
              f"{_cell(b['prefix_hit_rate'], '.1%')}, p99 TTFT {_cell(a['ttft_ms']['p99'], '.0f')} -> "
              f"{_cell(b['ttft_ms']['p99'], '.0f')} ms, goodput {_cell(a['goodput_fraction'], '.1%')} -> "
              f"{_cell(b['goodput_fraction'], '.1%')} (vs round robin)")
    moves = key_movement(list(range(max(1, min(args.replicas)), n_max + 1)))
    print("(c) keys that change owner when one replica is added (a moved key is a cold prefill): " + ", ".join(
        f"{m['from']}->{m['to']}: ring {m['ring_moved']:.0%} (ideal {m['ideal_ring']:.0%}), hash % N {m['modulo_moved']:.0%}"
        for m in moves))
    wall = time.perf_counter() - t0
    print(f"{len(rows)} fleet runs in {wall:.1f} s wall")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_result(out, {
            "benchmark": "fleet", "simulated": True,
            "executor": cost, "replica": replica, "key_blocks": KEY_BLOCKS,
            "workload": {"kind": "ChatMix", "rate": args.rate, "duration_s": args.duration, "seed": args.seed,
                         "sessions": len(workload.arrivals()), "requests": workload.num_requests()},
            "slo": {"ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms, "min_goodput": args.min_goodput},
            "rows": rows, "smallest_fleet_meeting_slo": answers, "key_movement": moves, "wall_s": wall,
        }, "python -m minivllm.bench fleet", argv)
        print(f"wrote {out}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
