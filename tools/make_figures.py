#!/usr/bin/env python
"""Draw the course figures in ``figures/`` from the engine itself.

Why generated?  A hand-drawn block table or a pasted plot drifts from the code.
These come from real engine objects (a ``LLMEngine`` with the simulated
executor, the engine's ``RadixCache``), drawn by the same widget functions the
labs use, and the measured plots re-run the labs' measurements -- so the
README, the labs and the engine always agree.  Everything is seeded; no model
or GPU is needed (about 10 s).

    python tools/make_figures.py [--out figures]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minivllm import SamplingParams  # noqa: E402
from minivllm.kv.block_pool import BlockPool  # noqa: E402
from minivllm.kv.kv_cache_manager import blocks_for  # noqa: E402
from minivllm.labs import widgets, workloads  # noqa: E402
from minivllm.sched.policies import FCFSAdmission  # noqa: E402
from minivllm.kv.prefix import make_prefix_cache  # noqa: E402
from minivllm.kv.prefix.radix import RadixCache  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
META = {"Software": None}  # no version/date stamps: reruns give identical files


def save(fig, out: Path, name: str) -> None:
    fig.savefig(out / name, dpi=130, bbox_inches="tight", metadata=META)
    plt.close(fig)
    print(f"wrote {(out / name).relative_to(ROOT) if out.is_relative_to(ROOT) else out / name}")


def block_table(out: Path) -> None:
    """The engine mid-run: block tables of the running requests and the pool they map into."""
    eng = workloads.sim_engine(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, model_max_len=64)
    for i, (n_prompt, n_out) in enumerate([(10, 6), (7, 12), (13, 4)]):
        eng.add_request({"prompt_token_ids": list(range(10 + i, 10 + i + n_prompt))},
                        SamplingParams(max_tokens=n_out, ignore_eos=True), f"req {chr(65 + i)}")
    for _ in range(4):
        eng.step()
    owners = widgets.block_owners(eng)
    fig, (ax_t, ax_p) = plt.subplots(2, 1, figsize=(9, 3.6), gridspec_kw={"height_ratios": [1.1, 1]})
    ax_t.axis("off")
    y = 0.85
    for i, (name, table) in enumerate(owners.items()):
        req = eng.scheduler.running[i]
        ax_t.text(0.0, y, f"{name}: {req.num_computed_tokens} tokens", fontsize=9, va="center",
                  color=widgets.request_colour(name), fontweight="bold")
        ax_t.text(0.22, y, "block table  " + "  ".join(f"[{j}]→{b}" for j, b in enumerate(table)),
                  fontsize=9, va="center", family="monospace")
        y -= 0.3
    ax_t.set_title("block tables map each request's logical blocks to physical blocks (block_size 4)", fontsize=10)
    widgets.draw_block_pool(eng.pool, owners, cols=16, ax=ax_p, title="the block pool they point into")
    save(fig, out, "block_table.png")


def radix_tree(out: Path) -> None:
    """The tree a lab's prefix replay builds, stopped while its last request still runs, so the path that
    request holds is drawn locked (the replay frees a request only at its next step)."""
    pool = BlockPool(256)
    tree = RadixCache(pool, 16)
    replay = workloads.PrefixReplay(tree, pool, workloads.shared_system_chats(3, 3, seed=2))
    for _ in range(7):
        replay.step()
    fig, ax = plt.subplots(figsize=(9, 3.2))
    widgets.draw_radix_tree(tree, ax=ax, title="radix tree after 7 chat turns sharing a system prompt (red = locked by the running request)")
    save(fig, out, "radix_tree.png")


def timelines(out: Path) -> None:
    requests = workloads.random_requests(16, seed=5, prompt_range=(32, 256), output_range=(4, 64))
    lens = {f"r{i}": len(p) for i, (p, _) in enumerate(requests)}
    fig, axes = plt.subplots(2, 1, figsize=(10, 6))
    for ax, (name, policy) in zip(axes, [("static", workloads.StaticBatchAdmission()), ("continuous", FCFSAdmission())]):
        eng = workloads.sim_engine(max_num_seqs=4, max_num_batched_tokens=256, admission_policy=policy,
                                   executor=SimulatedExecutor(fixed_overhead_s=0.015, per_token_s=0.00002))
        finals = workloads.run_engine(eng, requests)
        tput = workloads.throughput(finals, eng)
        widgets.draw_timeline(eng.step_log, lens, ax=ax, annotate=False,
                              title=f"{name} batching, 4 seats: {len(eng.step_log)} steps, {tput:.0f} tokens/s (simulated GPU)")
    fig.tight_layout()
    save(fig, out, "step_timeline.png")


def fragmentation(out: Path) -> None:
    lens = workloads.lengths_sample(2000, seed=0, max_len=2048)
    tokens = sum(lens)
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]
    util = [tokens / workloads.reserved_slots_paged(lens, b) for b in sizes]
    table = [sum(blocks_for(n, b) for n in lens) / len(lens) for b in sizes]
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(sizes, [100 * u for u in util], "o-", color="#4e79a7", label="KV memory holding real tokens (%)")
    ax.axhspan(20.4, 38.2, color="#d62728", alpha=0.15, label="earlier systems (PagedAttention, Fig. 2)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block_size (tokens); 2048 = reserve max_model_len up front")
    ax.set_ylabel("% of reserved slots used")
    ax.set_ylim(0, 105)
    ax2 = ax.twinx()
    ax2.plot(sizes, table, "s--", color="#888888", label="blocks per request")
    ax2.set_yscale("log")
    ax2.set_ylabel("block-table entries")
    fig.legend(loc="lower left", bbox_to_anchor=(0.12, 0.18), fontsize=8)
    ax.set_title("measured: 2,000 chat-like lengths (median ~330, max 2048)", fontsize=10)
    save(fig, out, "fragmentation.png")


def hit_rates(out: Path) -> None:
    """Both structures replay the same prompts through ``make_prefix_cache``, the factory the engine builds its
    cache with: the figure shows that the index changes what a lookup costs, not which blocks it hits."""
    loads = {"system prompt": workloads.system_prompt_workload(40), "multi-turn": workloads.multi_turn_workload(8, 5),
             "RAG": workloads.rag_workload(40)}
    fig, ax = plt.subplots(figsize=(6, 2.8))
    for k, kind in enumerate(("radix", "hash")):
        rates = []
        for prompts in loads.values():
            pool = BlockPool(1024)
            rates.append(100 * workloads.hit_rate(workloads.replay_prefix_cache(make_prefix_cache(kind, pool, 16), pool, prompts)))
        xs = [i + 0.38 * k for i in range(len(loads))]
        ax.bar(xs, rates, width=0.36, label=f"{kind}", color=("#4e79a7", "#f28e2b")[k])
        for x, r in zip(xs, rates):
            ax.text(x, r + 1, f"{r:.0f}%", ha="center", fontsize=8)
    ax.set_xticks([i + 0.19 for i in range(len(loads))], list(loads))
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize=8)
    ax.set_title("measured: radix tree and hash index hit the same blocks", fontsize=10)
    save(fig, out, "prefix_hit_rates.png")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "figures")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for make in (block_table, radix_tree, timelines, fragmentation, hit_rates):
        make(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
