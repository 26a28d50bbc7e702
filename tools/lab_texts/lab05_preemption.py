CELLS = [
("md", r"""
# Lab 5 — Preemption

**Goals.** After this lab you can

1. say what an engine can do when its KV blocks run out — **recompute**, **swap** or **reject** — and what each
   one costs, and watch blocks leave the device for the host tier and come back;
2. choose *who* gives way: a victim policy that spares an interactive tenant (✏️ exercise 1, plugged into the real
   engine), and see why the same request must not give way without end;
3. decide *how* a victim gives way from a cost model — swap when the link is fast relative to prefill, recompute
   otherwise — and find the crossover (✏️ exercise 2); measure when swap stops paying because the host tier is
   too small for the victims waiting in it;
4. turn requests away at the door on queue depth and cache pressure, the way a server answers HTTP 429, and read
   the reject rate as an autoscaling signal (✏️ exercise 3);
5. explain why more KV memory means more concurrent sequences and fewer preemptions, and measure what it costs:
   the activation memory of a step, which grows with the token budget.

**Time:** 15 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 45–60 minutes to work through. The real model is used twice: to measure activation
memory in section 3, and at the end. Every other measurement runs the real engine —
scheduler, KV cache manager, host tier, preemption — on a simulated forward pass with a virtual clock
(`SimulatedExecutor`), so the numbers are exact and reproducible.
Exercises are marked ✏️; until your checker passes, later cells use the engine's own rule.
"""),
("code", r"""
import matplotlib.pyplot as plt
import torch

from minivllm import SamplingParams
from minivllm.labs import choose, widgets, workloads
from minivllm.labs.check_lab05 import (BLOCK_SIZE, KV_BYTES_PER_BLOCK, PCIE4_BYTES_PER_S, PREFILL_TOKENS_PER_S,
                                       TENANTS, ReferenceVictim, RuleCosts, check_should_reject,
                                       check_swap_or_recompute, check_victim_policy, lab_engine, overload_workload,
                                       percentile, engine_should_reject, host_tier_run, reference_swap_or_recompute,
                                       serve, starvation_run)
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz
from minivllm.request import RequestStatus

ON_GPU = torch.cuda.is_available()  # the real-model cell uses the GPU when there is one
%matplotlib inline
"""
, ["setup"]),
("md", r"""
## 1. The picture: the pool is empty and a running request needs one more block

Admission (lab 1) sets aside blocks for a request's *prompt*, not for the outputs it will generate (reject mode,
below, is the exception). Then every running request grows by one token per step, and every `block_size` tokens it needs a new block. Sooner or later the pool is empty while a running
request must write its next token. Someone has to give blocks back:

```
 device (GPU) pool: full                      who gives way?   the PreemptionPolicy picks a victim (✏️ 1)
 ┌──┬──┬──┬──┬──┬──┬──┬──┐                   how?             recompute or swap (the cost model, ✏️ 2)
 │A │A │B │B │B │C │C │C │ ← A needs a block
 └──┴──┴──┴──┴──┴──┴──┴──┘
   recompute: free C's blocks, forget its KV;      C waits at the FRONT of the queue and prefills
              cost = C's tokens of prefill again    prompt + generated tokens again when readmitted
   swap:      copy C's blocks to the host tier;    C waits at the front and is copied back
              cost = 2 x C's KV bytes over the link (out now, in later); host memory while it waits
   reject:    never preempt anyone: admit a request only if its WORST case (prompt + max_tokens) fits
              next to everyone's worst case; turn the rest away with a retry hint
```

Lesson 06 — the serving lesson this course is built on, whose claims every lab measures — has a name for a device
pool backed by a host tier — the lesson's *hierarchical* allocation: the fast memory holds what runs, the
slow one holds what waits. Recompute wastes **compute**, swap wastes **link bandwidth** (PCIe) and host memory, reject wastes **availability**
— but it is honest, and a rising reject rate is exactly what an autoscaler wants to see. Preemption also has a
fairness side: a request preempted again and again has unbounded latency even though the system is "up", so we
track preemptions **per tenant**. (The engine also keeps preemption from thrashing: after it preempts because the
pool ran dry, it admits nothing new in the next step (the pool is still full, and a newcomer would only force
another preemption); and a request that has already been preempted several times is spared while anyone else can
give way. "Preempted again and again", after exercise 1, measures why that second rule is needed.)

## 2. Watch blocks leave and come back

A tiny engine in `preemption_mode="swap"`: a 24-block device pool of 4-token blocks, a 16-block host tier, six
requests that together need more than 24 blocks. Each colour is one request; the engine stops at the first swap-out.
"""),
("code", r"""
import random


def tiny_engine():
    engine = workloads.sim_engine(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=32,
                                  model_max_len=64, preemption_mode="swap", num_cpu_blocks_override=16)
    rng = random.Random(3)
    for i in range(6):
        prompt = [rng.randrange(10, 900) for _ in range(rng.randint(6, 16))]
        engine.add_request({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=rng.randint(12, 30), ignore_eos=True), f"r{i}")
    return engine


def first_swap_out(engine):
    return engine.step_log[-1]["swapped_out"] > 0


tiny = tiny_engine()
walk = widgets.TierStepper(tiny, stop=first_swap_out)   # text only: the cells below step `tiny` on
print(walk.step(100))      # run until the first swap-out

tiers = widgets.TierStepper(tiny_engine(), stop=first_swap_out)   # the widget's own engine ...
tiers.step(100)                                                    # ... at the same step
tiers.stop = None
tiers.show()               # in Jupyter: buttons; elsewhere: the same picture, static
"""),
("md", r"""
The newest request (`r5`, the default victim: it has done the least work) left the device; its computed KV now sits
in the host tier and it waits at the **front** of the queue, with status `SWAPPED`. It keeps its computed tokens,
so when it comes back it does not prefill again. Step on until it is swapped back in:
"""),
("code", r"""
victim = tiny.requests["r5"]
print("r5:", victim.status.value, "| host blocks:", victim.cpu_block_ids, "| computed tokens kept:", victim.num_computed_tokens)
walk.stop = lambda e: victim.status is not RequestStatus.SWAPPED
print(walk.step(100))
print("r5:", victim.status.value, "| device blocks now:", victim.block_ids)
walk.stop = None
print(walk.step(10_000).splitlines()[-1])
s = tiny.stats()
print(f"swap preemptions {s['num_swap_preemptions']}, blocks out {s['swapped_out_blocks']}, in {s['swapped_in_blocks']}, "
      f"recomputed tokens {s['recomputed_tokens']}, free device blocks {s['free_blocks']}/24, host {s['num_cpu_blocks'] - s['cpu_blocks_used']}/16")
"""),
("md", r"""
Every block that went out came back in, nothing was recomputed, and both tiers are empty at the end.

### The three modes on one overloaded workload

Now a bigger picture. `overload_workload()` is 96 requests from three tenants arriving in about 4 seconds —
far more than the engine can serve that fast:

| tenant | share | prompt tokens | output tokens |
|---|---|---|---|
| `chat` (interactive) | 50 % | 32–192 | 32–160 |
| `agent` | 30 % | 256–640 | 64–192 |
| `batch` | 20 % | 512–1024 | 128–320 |

The engine models a GPU serving a Llama-8B-sized model: a step costs 15 ms plus 20 µs per token (prefill runs at
50,000 tokens/s), a 16-token KV block is 2 MiB, the host link is PCIe 4.0 (25 GB/s), and the device pool holds 384
blocks (6,144 tokens). `serve()` is the arrival loop: it adds each request when the virtual clock reaches its
arrival time and steps the engine. Latency is arrival to last token.
"""),
("code", r"""
arrivals = overload_workload()
MODES = {"recompute": {}, "swap": {}, "reject": {}}


def show(results):
    print(f"{'':22s}{'preempt':>8s}{'recomputed':>11s}{'swap MB':>9s}{'rejected':>9s}{'p99 s':>7s}{'tok/s':>7s}   "
          + "  ".join(f"{t} preempt/req" for t in TENANTS))
    for name, r in results.items():
        row = r.row()
        rates = "  ".join(f"{r.preemption_rate(t):{len(t) + 13}.2f}" for t in TENANTS)
        print(f"{name:22s}{row['preemptions']:8d}{row['recomputed tok']:11d}{row['swap MB']:9.0f}{row['rejected']:9d}"
              f"{row['p99 latency s']:7.2f}{row['tokens/s']:7.0f}   {rates}")


modes = {m: serve(lab_engine(preemption_mode=m, **o), arrivals) for m, o in MODES.items()}
show(modes)
"""),
("md", r"""
Read the table row by row:

* **recompute** threw away and recomputed thousands of tokens; **swap** moved the same kind of work over the link
  instead (GBs of traffic, zero recomputed tokens). Both serve everybody, eventually: the p99 latency is the
  queueing of an overloaded server.
* **reject** never preempts (its running requests reserve their worst case), so no work is wasted — and about half
  the requests are turned away. Those it serves finish much sooner.
* The preemption rate per tenant is not equal: the default victim is the *newest* request, whoever it belongs to.

## ✏️ Exercise 1 — who gives way?

The engine asks its `PreemptionPolicy` for a victim whenever the pool is dry: `choose_victim(running)`, where
`running` is in admission order. The default (`running[-1]`) ignores tenants. Write `ProtectInteractive`:

1. requests of a **protected tenant** (`request.tenant` in the tenants given to `__init__`) are spared while anyone
   else could give way;
2. among the rest, preempt the request that **loses the least work** if it is recomputed;
3. among equals, the **newest**.

If everyone running is protected, the engine still needs a victim: apply rules 2–3 to all of them.

<details><summary>Hint 1</summary>

What does a recompute throw away? Look at the fields of a `minivllm.request.Request`: one of them counts the
tokens whose K/V are in the cache right now. A prompt still in chunked prefill has *fewer* of those than its length.
</details>
<details><summary>Hint 2</summary>

Work in two stages: first the candidates (who *may* give way — and what if nobody may?), then the choice among
them. Build new lists; don't sort or pop the list the engine gave you.
</details>
<details><summary>Hint 3</summary>

`min()` returns the *first* of several equal items. Which order should it look at them in so that the newest wins
a tie?
</details>
"""),
("code", r"""
class ProtectInteractive:
    '''Spare protected tenants; otherwise preempt the request with the least computed work, newest on ties.'''

    def __init__(self, protected_tenants=("chat",)):
        # TODO: remember the protected tenants (a set)
        ### BEGIN SOLUTION
        self.protected = set(protected_tenants)
        ### END SOLUTION

    def choose_victim(self, running):
        # TODO: the candidates are the unprotected requests (all of them if none is unprotected);
        #   return the candidate that loses the least work, the newest one on a tie
        ### BEGIN SOLUTION
        candidates = [r for r in running if r.tenant not in self.protected] or list(running)
        return min(reversed(candidates), key=lambda r: r.num_computed_tokens)
        ### END SOLUTION
""", ["exercise:victim_policy"]),
("code", r"""
victim_check = check_victim_policy(ProtectInteractive)
Victim = choose(victim_check, ProtectInteractive, ReferenceVictim, "victim policy")
"""),
("md", r"""
The measurement: the same overloaded workload, recompute mode, with the default victim and with the policy `choose`
picked above (yours once it passes its checker, the engine's `ReferenceVictim` until then).
"""),
("code", r"""
policies = {"default (newest)": serve(lab_engine(), arrivals),
            "protect chat": serve(lab_engine(preemption_policy=Victim(("chat",))), arrivals)}
show(policies)
for name, r in policies.items():
    p99 = {t: percentile([v for k, v in r.ttft.items() if r.tenant_of[k] == t], 99) for t in TENANTS}
    print(f"{name:22s} TTFT p99 per tenant: " + ", ".join(f"{t} {v:.2f} s" for t, v in p99.items()))
"""),
("md", r"""
The chat tenant's preemption rate drops to zero; the preemptions did not disappear, they moved, all of them, to
`agent`, whose long prompts in chunked prefill have the least computed work at any moment (batch's rate fell to zero
too). Total recomputed work even grows, by about a third. Notice also what *did not* improve much: chat latency. In
an overloaded server the queue, not preemption, dominates latency — which is what exercise 3 addresses.

### Preempted again and again: a latency with no bound

Moving every preemption onto one tenant has a limit case. Take the priority policy: a chat request (priority 0)
waiting for blocks may preempt a running batch job (priority 1), and when the pool runs dry the victim is again the
batch job. Now let chat traffic keep coming:

```
 chat, 10/s:  ▮▮ ▮ ▮▮▮ ▮ ▮▮ ▮▮ ▮ ▮▮▮ ▮ ▮▮ ▮ ▮▮▮ ▮▮ ▮ ▮▮ ▮ ▮▮▮ ▮ ▮▮ ▮▮ ▮ ▮▮▮ ▮ ▮▮|  (the stream stops)
 batch job:   prefill ██▌✗  prefill ███ decode ▮▮✗  prefill █✗  ...  prefill ████ decode ▮▮▮▮▮▮▮ done
              ✗ = preempted: its KV is thrown away, and it waits at the front of the queue to prefill again
```

Each ✗ costs the batch job everything it had computed. If a chat request can always take its blocks, the job
finishes only when chat stops, however long that is. The server is up the whole time, and chat looks healthy.
Lesson 06 puts it this way: a tenant whose requests are preempted again and again has, in effect, unbounded
latency.

The engine's guard is `preemption_protect_after` (default 3). A request preempted that many times is never preempted
to seat a better-ranked request, and it becomes a victim for lack of blocks only when *everyone* running is protected
too. `starvation_run(stream_s, protect_after)` serves one 1,500-token batch job at t = 1 s inside `stream_s` seconds
of chat, on this lab's simulated GPU with a small pool (192 blocks). `protect_after=0` turns the guard off.
"""),
("code", r"""
STREAMS = (10, 20, 40)  # seconds of chat traffic
guard = {k: [starvation_run(s, k) for s in STREAMS] for k in (0, 3)}

fig, ax = plt.subplots(figsize=(6.5, 3.4))
ax.plot(STREAMS, STREAMS, ":", color="grey", label="length of the chat stream")
for k, label in ((0, "no guard (preemption_protect_after=0)"), (3, "guard: protected after 3 preemptions")):
    ax.plot(STREAMS, [r.latency["batch-job"] for r in guard[k]], "o-", label=label)
ax.set(xlabel="seconds of chat traffic", ylabel="batch job latency (s)", ylim=(0, None),
       title="Simulated (lab 5's GPU): one batch job inside a chat stream")
ax.legend(fontsize=8)
plt.show()
for k in (0, 3):
    for s, r in zip(STREAMS, guard[k]):
        chat = [v for q, v in r.latency.items() if r.tenant_of[q] == "chat"]
        print(f"protect_after={k}, {s:2d} s of chat: batch job preempted {r.preemptions['batch-job']:2d} times, "
              f"latency {r.latency['batch-job']:5.1f} s | chat p99 latency {percentile(chat, 99):.2f} s, "
              f"{r.preemption_rate('chat'):.2f} preemptions per chat request")
"""),
("md", r"""
Without the guard, the batch job's latency follows the chat stream: it finishes a few seconds (2.6–4.1 s) after the
stream stops, and each doubling of the stream roughly doubles its latency (13 → 23 → 42 s) and adds preemptions (4 → 6 → 16).
Nothing bounds it except the traffic stopping. Meanwhile chat's p99 stays near 2.7 s. A dashboard with one global
preemption count would show a healthy server. Count preemptions *per tenant* (the server exports
`vllm:num_preemptions_total{tenant=...}`, lab 8) and the batch tenant stands out: every one of its requests preempted
again and again.

With the guard, the job is preempted three times, then keeps its blocks. It finishes 10.2 s after it arrives
(at t = 1 s), whatever the length of the stream. The cost lands on chat: its p99 latency rises to about 4.2 s, and chat requests are preempted two to
three times as often, because once the job is protected a chat request has to give way instead. That is the trade
the guard makes: a bounded worst case for the victim, paid for by everyone else.

## ✏️ Exercise 2 — swap or recompute?

Both cost time, in different currencies:

* **recompute** a victim with `num_tokens` computed tokens: prefill them again, at `prefill_tokens_per_s`;
* **swap** a victim holding `num_blocks` blocks of `bytes_per_block` bytes: its KV is copied to host memory over
  the host link (`link_bytes_per_s`), and the victim decodes again only once its KV is back on the device.

Write `swap_or_recompute(...)`: return `"swap"` when swapping is strictly cheaper, else `"recompute"` (a tie
recomputes: swap also holds host memory while the request waits).

<details><summary>Hint 1</summary>

Sort the five arguments into two piles: what the cost of a recompute depends on, and what the cost of a swap
depends on. No argument is in both piles, and you never need to turn tokens into blocks or back.
</details>
<details><summary>Hint 2</summary>

The piles are priced in different currencies, tokens and bytes, so compare neither count directly: bring each
option to **seconds** first (what does dividing a count by a per-second rate give?). Then follow a swapped victim
from its preemption to its next decode: how many trips over the link does its KV make?
</details>
<details><summary>Hint 3</summary>

A worked example (not a checker case): a victim with 320 computed tokens in 20 blocks of 0.5 MB, a link of
2 GB/s, a prefill rate of 6,400 tokens/s. Recomputing takes 320 / 6,400 = 0.05 s = 50 ms. The KV is
20 × 0.5 MB = 10 MB; one trip over the link takes 10 MB / 2 GB/s = 5 ms, and it makes two (out now, back before it
decodes): 10 ms. 10 ms < 50 ms: swap. On a 0.25 GB/s link one trip takes 40 ms, two take 80 ms > 50 ms: recompute
(counting one trip, 40 ms < 50 ms, would have swapped).
</details>
"""),
("code", r"""
def swap_or_recompute(num_tokens: int, num_blocks: int, *, bytes_per_block: int, link_bytes_per_s: float,
                      prefill_tokens_per_s: float) -> str:
    '''"swap" if swapping the victim costs less time than recomputing it, else "recompute".'''
    # TODO: price both options in one unit and compare them; "swap" only when swapping is strictly cheaper
    #   -- see the hints above
    ### BEGIN SOLUTION
    swap_s = 2 * num_blocks * bytes_per_block / link_bytes_per_s
    recompute_s = num_tokens / prefill_tokens_per_s
    return "swap" if swap_s < recompute_s else "recompute"
    ### END SOLUTION
""", ["exercise:swap_or_recompute"]),
("code", r"""
cost_check = check_swap_or_recompute(swap_or_recompute)
rule = choose(cost_check, swap_or_recompute, reference_swap_or_recompute, "swap_or_recompute")
"""),
("md", r"""
### The crossover, measured

Your rule becomes a `PreemptionCostModel` (the engine's seam: `prefers_swap(num_tokens, num_blocks) -> bool`) in
two lines — `RuleCosts` in `check_lab05.py` does exactly that — and goes into the engine with
`preemption_mode="auto"`. Now sweep the host link's bandwidth from 1 to 50 GB/s and run the overloaded workload
three ways: always recompute, always swap, and auto with your rule. Per block, swapping costs
`2 × 2 MiB / link`, recomputing costs `16 tokens / 50,000 per s` = 320 µs: the rule predicts a crossover where they
are equal.
"""),
("code", r"""
GBPS = [1, 2, 4, 8, 13, 16, 25, 50]
crossover = 2 * KV_BYTES_PER_BLOCK * PREFILL_TOKENS_PER_S / BLOCK_SIZE / 1e9
runs = {"recompute": [], "swap": [], "auto (your rule)": []}
for g in GBPS:
    link = g * 1e9
    runs["recompute"].append(serve(lab_engine(link_bytes_per_s=link), arrivals))
    runs["swap"].append(serve(lab_engine(preemption_mode="swap", link_bytes_per_s=link), arrivals))
    costs = RuleCosts(rule, link_bytes_per_s=link)
    runs["auto (your rule)"].append(serve(lab_engine(preemption_mode="auto", link_bytes_per_s=link,
                                                     preemption_cost_model=costs), arrivals))

fig, ax = plt.subplots(figsize=(7, 3))
for (name, rs), style in zip(runs.items(), ["o-", "s-", "x--"]):
    ax.plot(GBPS, [r.makespan for r in rs], style, label=name)
ax.axvline(crossover, color="#888888", ls=":", label=f"predicted crossover {crossover:.1f} GB/s")
ax.set_xscale("log", base=2); ax.set_xlabel("host link bandwidth (GB/s)"); ax.set_ylabel("time to serve all (s)")
ax.legend(fontsize=8)
plt.show()
print(f"{'GB/s':>5s}" + "".join(f"{n:>18s}" for n in runs) + "   auto: swapped / recomputed victims")
for i, g in enumerate(GBPS):
    a = runs["auto (your rule)"][i].stats
    print(f"{g:5d}" + "".join(f"{rs[i].makespan:17.3f}s" for rs in runs.values())
          + f"   {a['num_swap_preemptions']:3d} / {a['num_recompute_preemptions']:3d}")
"""),
("md", r"""
Below the crossover every swap costs more than the recompute it replaces, so the swap line sits above the
recompute line; above it, the order flips. Auto follows whichever is cheaper, victim by victim, and it switches
where the cost model predicts — the lines really cross near 13 GB/s. So: on PCIe 4.0 and faster, swap; on a slow
or shared link (or a small model whose prefill is very fast), recompute. The ratio does not depend on context
length — both costs grow linearly with it — except that a swap moves whole blocks, which makes very short victims
relatively cheaper to recompute. (Real attention makes prefill cost grow faster than linearly with context, which
is why "swap long contexts" is the usual advice.)

### Swap needs room: how big the host tier is, and how soon victims come back

The cost model compares link time with prefill time, but a swap also needs somewhere to put the KV. The host tier
is a second block pool (`num_cpu_blocks_override`, or vLLM's `swap_space` in GiB); `swap_out` moves **all** of a
victim's computed blocks or none, and when they do not fit the scheduler recomputes that victim instead, silently.
So the lesson's condition — *swap is attractive when CPU memory is plentiful and the request resumes soon* — comes
down to one question: is there room in the tier for every victim until it comes back?

Sweep the tier from nothing to 128 blocks (256 MiB) in swap mode on the same overloaded workload.
`host_tier_run` (in `check_lab05.py`) is `serve()` with an observer that reads the engine after every step: which
victims went to the host tier, which fell back to recompute, the tier's occupancy, and when each victim came back.
"""),
("code", r"""
# Simulated: lab 5's GPU-like engine on a virtual clock (Llama-8B-like 2 MiB blocks, PCIe 4.0), swap mode;
# only the host tier's size changes.
HOST = [0, 8, 16, 24, 32, 48, 64, 128]
tier = {n: host_tier_run(n, arrivals) for n in HOST}

fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6))
x = list(range(len(HOST)))
swapped = [len(t.swapped) for t in tier.values()]
ax.bar(x, swapped, color="#4e79a7", label="swapped")
ax.bar(x, [len(t.fell_back) for t in tier.values()], bottom=swapped, color="#d62728",
       label="fell back to recompute")
ax.set_xticks(x, [str(n) for n in HOST]); ax.set_ylim(0, 36)
ax.set_xlabel("host tier (2 MiB blocks)"); ax.set_ylabel("preemptions")
ax2 = ax.twinx()
ax2.plot(x, [t.result.stats["recomputed_tokens"] for t in tier.values()], "k.--", label="recomputed tokens")
ax2.set_ylabel("recomputed tokens"); ax2.set_ylim(0, 13000)
fig.legend(loc="upper left", bbox_to_anchor=(0.07, 0.9), fontsize=7, ncol=3)
ax.set_title("every preemption, by host tier size (simulated)", fontsize=9)
for n, marker in ((16, "o"), (32, "s")):
    for went, color in ((True, "#4e79a7"), (False, "#d62728")):
        pts = [(a.blocks, a.host_free) for a in tier[n].attempts if a.swapped == went]
        bx.plot([p[0] for p in pts], [p[1] for p in pts], marker, color=color, mfc="none" if n == 16 else color,
                alpha=0.8, label=f"{n}-block tier: {'swapped' if went else 'fell back'}")
bx.plot([0, 64], [0, 64], color="#888888", lw=1, ls=":", label="needed = free")
bx.set_xlim(0, 64); bx.set_ylim(-1, 34)
bx.set_xlabel("host blocks the victim needed"); bx.set_ylabel("host blocks free at that moment")
bx.legend(fontsize=7, loc="lower right"); bx.set_title("all or nothing: each swap attempt (simulated)", fontsize=9)
fig.tight_layout()
plt.show()
print(f"{'host blocks':>11s}{'swapped':>9s}{'fell back':>10s}{'recomputed':>11s}{'peak used':>10s}"
      f"{'giving way s':>13s}{'p99 s':>7s}")
for n, t in tier.items():
    s = t.result.stats
    print(f"{n:11d}{len(t.swapped):9d}{len(t.fell_back):10d}{s['recomputed_tokens']:11d}{t.peak_blocks:10d}"
          f"{t.give_way_s():13.3f}{t.result.p99():7.2f}")
for n in (16, 32):
    full = sum(a.blocks > n for a in tier[n].fell_back)
    print(f"{n}-block tier: {len(tier[n].fell_back)} fell back, {full} of them needed more than the whole tier, "
          f"{len(tier[n].fell_back) - full} found it occupied by earlier victims")
"""),
("md", r"""
Read the left panel from left to right. With no host tier every preemption recomputes — swap mode degrades to
recompute mode, silently. A small tier swaps the victims that happen to fit and recomputes the rest; from 64 blocks
on, every victim is swapped and nothing is recomputed. The right panel shows the rule at work: every attempt above
the diagonal (the tier had room for all of the victim's blocks) swapped, every one below it fell back. A victim
falls back for one of two reasons — it is bigger than the whole tier (all ten fallbacks of the 32-block tier needed
33–61 blocks), or earlier victims still fill the tier (four victims of 6–9 blocks found only 3 of the 16-block
tier's blocks free). "Giving way" is the device time spent making room (recomputed tokens at 50,000 a second, plus
swapped blocks over the link): it halves once the tier is big enough. The p99 latency moves by less than a tenth
of a second here, because recompute is cheap on this GPU and the queue dominates (as in the mode table above); the
saving grows with the victims' contexts (section 5).

How big is "big enough"? It depends on how long victims stay. Take the 128-block run, where every victim fitted:
"""),
("code", r"""
big = tier[128]
waits = [s.wait_s for s in big.stays]
steps = [s.wait_steps for s in big.stays]
area, little = big.block_seconds()
fig, ax = plt.subplots(figsize=(9, 2.6))
ax.step([t for t, _ in big.occupancy], [b for _, b in big.occupancy], where="post", color="#4e79a7", lw=1,
        label="host blocks in use")
ax.axhline(area / big.result.makespan, color="#f28e2b", ls="--", lw=1, label="time average")
ax.set_xlabel("virtual time (s)"); ax.set_ylabel("host blocks")
ax.set_title("the 128-block host tier over time (simulated)", fontsize=9); ax.legend(fontsize=8)
plt.show()
print(f"{len(big.stays)} victims went to the host tier and came back; time there: median {percentile(waits, 50) * 1000:.0f} ms "
      f"({percentile(steps, 50)} steps), max {max(waits) * 1000:.0f} ms ({max(steps)} steps); run length {big.result.makespan:.1f} s")
print(f"host memory held: {area:.2f} block-seconds under the occupancy curve, {little:.2f} as the sum of blocks x stay "
      f"-> {area / big.result.makespan:.1f} blocks in use on average, {big.peak_blocks} at the peak")
print("new requests started while a victim waited in the host tier:", big.admitted_while_swapped)
"""),
("md", r"""
A victim stays a fraction of a second — eight steps at the median, 61 at the most — because it waits at the
**front** of the queue: no new request started while one was in the tier (the engine's FCFS order puts preempted requests first).
The two block-second totals are the same number computed two ways, which is Little's law: *blocks in use on
average = swapped blocks per second × time each stays*. So the tier a workload needs scales with how long victims
wait: if they stayed ten times longer (a deep priority queue ahead of them, a scheduler that lets newcomers pass),
the same swap traffic would need ten times the host memory, and with a fixed tier more victims would fall back to
recompute. Little's law gives the *average*, though, and a tier must hold the *peak*: 8.3 blocks on average here, 61
at the peak, and one victim alone can be that large (the 32-block tier, four times the average, still recomputed the
ten victims bigger than itself). Size the tier for the peak, at least the largest victim; the average says how that
need grows with the stay. Swap pays when the host tier is large relative to *swap rate × stay* — plentiful CPU
memory, victims that resume soon.

## ✏️ Exercise 3 — reject at the door

The engine's `reject` mode decides inside the scheduler. A server can also decide at the door, before a request
enters the queue at all: answer **429 Too Many Requests** and let the client (or the load balancer) go elsewhere.
Write `should_reject(stats, max_waiting, min_free_blocks)`, called with `engine.stats()` before every
`add_request` in the arrival loop. Turn a request away when

1. the **queue is full**: `max_waiting` requests are already waiting (`stats["num_waiting"]`; it already counts the
   preempted and swapped-out requests waiting to resume, which are ahead of the newcomer: `stats["num_swapped"]` is
   a part of `num_waiting`, so don't add it again), or
2. the **cache is under pressure and there is a queue**: fewer than `min_free_blocks` device blocks are available
   (`stats["available_blocks"]`) *and* someone is already waiting — the newcomer would only queue behind them.
   "Available" is the free list plus cached blocks that no request holds: with prefix caching on (lab 3) the
   allocator evicts those on demand, so a warm cache is not pressure. `stats["free_blocks"]` counts the free list
   alone; this lab's engine caches no prefixes, so the two are equal here, but the server's door
   (`minivllm serve --max-waiting-requests N --min-free-blocks M`) runs your rule next to a cache.

Otherwise accept. An idle engine must never reject.

<details><summary>Hint 1</summary>

Each rule is a question about `stats` alone. For each one, name the keys it reads, and write it as its own
comparison before you decide how the two combine: either rule is reason enough to say no.
</details>
<details><summary>Hint 2</summary>

Rule 2 is not "few blocks available": with nobody waiting, the newcomer is the next to be admitted, whatever the
pool holds. What else must be true before pressure is a reason to turn it away?
</details>
<details><summary>Hint 3</summary>

Boundaries: is a queue of exactly `max_waiting` full? Is exactly `min_free_blocks` available blocks "fewer than"?
</details>
"""),
("code", r"""
def should_reject(stats: dict, max_waiting: int, min_free_blocks: int) -> bool:
    '''True: answer 429 and do not add the arriving request.'''
    # TODO: True on a full queue, or on cache pressure while someone waits (rules 1 and 2 above);
    #   read the stats, never change them
    ### BEGIN SOLUTION
    waiting = stats["num_waiting"]
    return waiting >= max_waiting or (waiting > 0 and stats["available_blocks"] < min_free_blocks)
    ### END SOLUTION
""", ["exercise:door_rule"]),
("code", r"""
door_check = check_should_reject(should_reject)
reject_rule = choose(door_check, should_reject, engine_should_reject, "should_reject")
"""),
("md", r"""
Add it to the table: the door (queue of at most 8, pressure below 16 available blocks) in front of the recompute engine.
"""),
("code", r"""
door = lambda stats: reject_rule(stats, 8, 16)
modes["door + recompute"] = serve(lab_engine(), arrivals, door=door)
show(modes)
"""),
("md", r"""
The door rejects about as many requests as the engine's reject mode, but for another reason — the queue, not the
worst case — so the requests it admits can still be preempted: fewer preemptions in total, since fewer requests
run, but not fewer per admitted request (read the rates above: chat's and batch's go *up*; an admitted request meets
a fuller engine). Both keep the p99 latency of what they serve at a few seconds instead of 17.

### Reject as an autoscaling signal

Serving more requests than the machine can handle does not make it faster; it makes the queue longer. Now vary the
offered load (arrivals per second, 12 seconds of arrivals each) and watch what the door does. The rate to read is
the **served** rate while the load lasts: requests finished per second from the 4th second (an empty engine takes a
few seconds to fill) to the last arrival. Two easier measures mislead. Everything served divided by the whole run
counts the seconds after the last arrival, while the engine drains what it admitted, so even a lightly loaded
machine seems to serve less than it was offered. What the door *admitted* per second of arrivals counts the queue it
let fill as if it had been served: at 12 requests/s and more, 15-19 admitted requests are still in the engine at the last
arrival.
"""),
("code", r"""
RATES = [2, 4, 6, 8, 12, 16, 24, 32]
ARRIVAL_S = 12                                          # seconds of arrivals at every rate
offered = [ARRIVAL_S * rate for rate in RATES]
WARM_S = 4                                              # an empty engine fills in the first seconds
offered_runs = [overload_workload(n, rate_per_s=rate) for n, rate in zip(offered, RATES)]
loads = [serve(lab_engine(), arrivals_at, door=door) for arrivals_at in offered_runs]
reject_rate = [r.num_rejected / n for r, n in zip(loads, offered)]

def served_while_arriving(result, arrivals_at, warm_s=WARM_S):
    # requests finished per second from warm_s to the last arrival (the drain after it is left out)
    start = {a.request_id: a.time for a in arrivals_at}
    end = max(start.values())
    return sum(warm_s <= start[rid] + s <= end for rid, s in result.latency.items()) / (end - warm_s)

served_per_s = [served_while_arriving(r, a) for r, a in zip(loads, offered_runs)]

def still_in_engine(result, arrivals_at):
    # admitted requests not finished yet when the last one arrives
    end = max(a.time for a in arrivals_at)
    return sum(a.time + result.latency[a.request_id] > end for a in arrivals_at if a.request_id in result.latency)

in_engine = [still_in_engine(r, a) for r, a in zip(loads, offered_runs)]

fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(RATES, [100 * x for x in reject_rate], "o-", color="#d62728", label="rejected (%)")
ax.set_xlabel("offered load (requests/s)"); ax.set_ylabel("rejected (%)")
ax2 = ax.twinx()
ax2.plot(RATES, served_per_s, "s-", color="#4e79a7", label="served while arrivals last (requests/s)")
ax2.set_ylabel("served requests/s")
fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88), fontsize=8)
plt.show()
for rate, r, x, s, left in zip(RATES, loads, reject_rate, served_per_s, in_engine):
    print(f"offered {rate:3d}/s: rejected {x:6.1%}, served {s:5.2f}/s (offered / served {rate / s:4.2f}), "
          f"p99 latency of served {r.p99():5.2f} s, {r.mean_running:4.1f} running on average, "
          f"{left:2d} still in the engine at the last arrival")
"""),
("md", r"""
At low load the machine serves about what is offered (a sample of a few seconds: 2.40/s at 2/s offered) and
rejects nothing, or little (2% at 4/s: a burst fills the queue). Past its capacity the served rate flattens at
about what this machine can serve (about 5 requests/s), while the reject rate keeps climbing and the latency of
what is served stays bounded. That makes the reject rate a clean signal for an autoscaler: it climbs steeply once
the offered load passes capacity, and offered / served is about how many replicas the load needs (about 7 at 32
requests/s). Scaling on utilisation instead would be blind: the batch is about as full at 12 requests/s as at 32,
so a utilisation metric cannot tell "just at capacity" from "far past it". Rejection must be deliberate, though:
the threshold *is* a latency promise (a queue of 8 is about the wait you are willing to let a request see).

## 3. The KV memory share

The third row of the tuning table: *cache memory share — more cache means more concurrent sequences, less room for
activations.* On a real GPU, `gpu_memory_utilization` (or `kv_cache_memory_bytes`) sets how much memory is left for
KV after the weights and the activation workspace. Sweep the device pool from 192 blocks (3,072 tokens) to 1,536
(24,576 tokens), recompute mode, same workload:
"""),
("code", r"""
POOLS = [192, 256, 384, 512, 768, 1024, 1536]
share = [serve(lab_engine(num_blocks=n), arrivals) for n in POOLS]
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot([n * 2 / 1024 for n in POOLS], [r.stats["num_preemptions"] for r in share], "o-", color="#d62728",
        label="preemptions")
ax.set_xlabel("KV cache (GiB, 2 MiB blocks)"); ax.set_ylabel("preemptions")
ax2 = ax.twinx()
ax2.plot([n * 2 / 1024 for n in POOLS], [r.mean_running for r in share], "s-", color="#4e79a7",
         label="requests in the batch (mean)")
ax2.set_ylabel("concurrent sequences")
fig.legend(loc="upper center", bbox_to_anchor=(0.5, 0.88), fontsize=8)
plt.show()
for n, r in zip(POOLS, share):
    print(f"{n:5d} blocks: {r.mean_running:5.1f} running on average, {r.stats['num_preemptions']:3d} preemptions, "
          f"{r.stats['recomputed_tokens']:6d} tokens recomputed, {r.output_tokens / r.makespan:6.0f} tokens/s, "
          f"p99 {r.p99():5.2f} s")
"""),
("md", r"""
More cache, more sequences decoding together (each decode step is memory-bound, so a bigger batch is nearly free
throughput — lab 1), and a downward trend in preemptions and recomputed work; at 1,536 blocks the working set fits
and nothing is preempted at all. The trend is not step by step: at a small pool fewer requests fit at all, so fewer
are running to be preempted, and which requests happen to collide moves the count around — read preemption counts
next to throughput and latency, never alone. The price is the other half of the row: memory given to KV is not
available for activations — a smaller `max_num_batched_tokens`, or no room for CUDA graphs — so the knob is tuned,
not maxed, watching preemption counts and latency percentiles together.

### The other side of the share: activation memory, measured

"Less room for activations" is a number you can measure. A forward pass over the step's tokens creates intermediate
tensors — each layer's normed input, its q/k/v, the MLP's gate and up projections — and frees most of them before
the next layer. The most memory that is alive at any moment is the **activation peak**, and it grows with the
tokens in the step, which the token budget (`max_num_batched_tokens`) caps. vLLM measures it at start-up by running
one dummy step at the full budget and sizes the KV pool from what is left; a bigger KV share leaves less, so a
smaller budget must do.

`ActivationMeter` (in `minivllm/bench/activations.py`) measures it exactly. It is a `TorchDispatchMode` — it sees
every tensor operation the model dispatches — that adds the bytes of each operation's **new** output storage to a
live total (a view or an in-place update creates no new storage and adds nothing) and subtracts them when the last
tensor using that storage is freed (`weakref.finalize`). Its peak is deterministic: it counts tensors, not the
allocator's pages, so it does not depend on the machine or the number of threads (a fused kernel's internal
scratch is invisible to it). Below, the real SmolLM2-135M (fp32, on this CPU) prefills one prompt of *N* tokens for
each *N*, and the meter records the peak of that one forward pass.
"""),
("code", r"""
# Real model: SmolLM2-135M, fp32, on this machine. Peak bytes alive during ONE prefill forward of N tokens.
import json
from pathlib import Path

import minivllm
from minivllm.bench.activations import analytic_bytes_per_token, budget_room, fit_line, make_engine, prefill_peaks
from minivllm.sim.presets import bundled_shape, hardware_preset, model_preset

BUDGETS = [16, 32, 64, 128, 256, 512]
act_engine = make_engine(max(BUDGETS))
peaks = prefill_peaks(act_engine, BUDGETS)   # {N: peak bytes}
del act_engine
slope, fixed = fit_line(peaks)
small = bundled_shape()                      # SmolLM2-135M's config, fp32
predicted = analytic_bytes_per_token(small)
traffic = small.act_elems_per_token_layer * small.dtype_bytes
recorded = Path(minivllm.__file__).resolve().parents[1] / "benchmarks" / "results" / "2026-12-01_cpu-2core_activations.json"
bench = {int(n): p for n, p in json.loads(recorded.read_text())["peak_bytes"].items()} if recorded.exists() else {}

fig, ax = plt.subplots(figsize=(7, 3.2))
grid = [0, 2048]
ax.plot(grid, [n * predicted / 2**20 for n in grid], "-", color="#888888", lw=1,
        label=f"analytic: (3h + 4I + 2 head_dim) x 4 B = {predicted:,} B/token")
ax.plot(grid, [n * traffic / 2**20 for n in grid], ":", color="#888888",
        label=f"roofline's activation traffic of one layer: {traffic:,} B/token")
ax.plot(list(peaks), [p / 2**20 for p in peaks.values()], "o", color="#d62728", label="measured now")
if bench:
    ax.plot(list(bench), [p / 2**20 for p in bench.values()], "s", mfc="none", color="#4e79a7",
            label="recorded: python -m minivllm.bench activations")
ax.set_xlabel("tokens in the step (token budget)"); ax.set_ylabel("peak activation memory (MiB)")
ax.set_title("one prefill forward of SmolLM2-135M, fp32 (real model, this CPU)", fontsize=9)
ax.legend(fontsize=7)
plt.show()
for n, p in peaks.items():
    print(f"{n:5d} tokens: peak {p / 2**20:6.2f} MiB = {p // n:,} B/token")
for n, p in bench.items():
    if n not in peaks:
        print(f"{n:5d} tokens: peak {p / 2**20:6.2f} MiB = {p // n:,} B/token   (recorded)")
print(f"least-squares line: {slope:,.0f} B/token + {fixed:,.0f} B; analytic {predicted:,} B/token "
      f"({slope / predicted - 1:+.1%}); roofline traffic figure {traffic:,} B/token ({traffic / slope - 1:+.1%})")
"""),
("md", r"""
A straight line through the origin: every token in the step adds the same 32,000 bytes, and nothing is fixed. The
analytic count predicts it to the byte. The widest moment of a layer is the MLP's `silu(gate) * up`: alive then are
the layer's input (the caller still holds it), the residual sum after attention, the normed MLP input, the fused
gate|up output (2 × intermediate), `silu(gate)` and the product (intermediate each), plus the step's RoPE cos and
sin rows — `3·576 + 4·1536 + 2·64 = 8,000` floats a token. It does **not** grow with the number of layers: layers run
one after another and each frees its intermediates before the next begins. (The roofline's
`act_elems_per_token_layer` is a different quantity — the activation bytes one layer's GEMMs read and write — and
lands 6 % above.)

Now the trade-off in numbers. The same count for Llama-3-8B in bf16 is `(3·4096 + 4·14336) × 2 + 2·128 × 4` bytes a
token (the cos and sin rows stay fp32 in a bf16 model; in bf16 RoPE's fp32 arithmetic can be the widest point
instead — it is for SmolLM2 — and `analytic_bytes_per_token` takes the larger of the two). On a GPU the share
given to KV is `gpu_memory_utilization`: the simulator sizes the pool as `share × memory − weights`
(`minivllm.sim.run.kv_pool_bytes`), and what is left of the device is the room for one step's activations:
"""),
("code", r"""
# Analytic, not measured: Llama-3-8B (bf16) shapes on the H100 and L4 datasheet presets; nothing ran on those GPUs.
big = model_preset("llama-3-8b")
print(f"Llama-3-8B, bf16: {analytic_bytes_per_token(big):,} B of activations per token of budget (this engine's "
      f"unfused MLP), {big.kv_bytes_per_token:,} B of KV per token of context, {big.num_params * 2 / 1e9:.1f} GB of weights")
print(f"{'GPU':5s}{'KV share':>9s}{'KV GiB':>8s}{'KV tokens':>11s}{'room GiB':>10s}{'budget tokens':>15s}")
for gpu in ("h100", "l4"):
    for share in (0.8, 0.9, 0.95):
        r = budget_room(big, hardware_preset(gpu), share)
        print(f"{gpu:5s}{share:9.2f}{r['kv_bytes'] / 2**30:8.1f}{r['kv_tokens']:11,d}{r['room_bytes'] / 2**30:10.2f}"
              f"{r['budget_tokens']:15,d}")
lo, hi = budget_room(big, hardware_preset("h100"), 0.8), budget_room(big, hardware_preset("h100"), 0.95)
print(f"H100, KV share 0.80 -> 0.95: {(lo['room_bytes'] - hi['room_bytes']) / 2**30:.1f} GiB leave the activations, "
      f"{lo['budget_tokens'] - hi['budget_tokens']:,} tokens of budget at {lo['act_bytes_per_token']:,} B/token; "
      f"the KV cache gains {hi['kv_tokens'] - lo['kv_tokens']:,} tokens of context")
"""),
("md", r"""
On the H100 (simulated sizing, analytic counts) the 0.80 → 0.95 move takes 11.9 GiB from the activations — about
91,000 tokens of budget — and gives the KV cache about 98,000 more tokens of context: a token of budget and a token
of KV cost about the same here. Even at 0.95, over 30,000 tokens of budget fit, far above the usual 2,048–8,192: on
a big GPU the KV share can go high. On the L4 the weights take two thirds of the memory and the same share leaves
room for a budget of about 8,600 tokens; at a smaller share the room grows but the KV pool (the concurrency of
section 3) shrinks. Real engines fuse `silu(gate) * up` into one kernel (which removes the `silu(gate)` tensor) and
must also fit CUDA graphs and the sampler's logits, so measure on the engine you run — which is what vLLM's start-up
profiling does.

## 4. The real model: swapping does not change a single token

Everything above ran on the simulated executor. Does swap preemption really preserve the KV cache? On the bundled
SmolLM2-135M, a device pool of 4 blocks (64 tokens) is too small for three requests of ~32 tokens each: the engine
preempts. Greedy outputs with recompute and with swap must be identical.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings)
import time

from minivllm import LLM

prompts = ["The capital of France is a city that", "Paging in operating systems means that memory",
           "Three planets of the solar system are"]
params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
texts, report = {}, {}
for mode in ("recompute", "swap"):
    t0 = time.perf_counter()
    llm = LLM(max_model_len=64, num_gpu_blocks_override=4, num_cpu_blocks_override=16, preemption_mode=mode)
    outs = llm.generate(prompts, params, use_tqdm=False)
    texts[mode] = [o.outputs[0].token_ids for o in outs]
    s = llm.engine.stats()
    report[mode] = (time.perf_counter() - t0, s["num_preemptions"], s["num_swap_preemptions"], s["swapped_in_blocks"],
                    s["recomputed_tokens"])
for mode, (secs, pre, swp, back, rec) in report.items():
    print(f"{mode:9s}: {secs:5.1f} s, {pre} preemptions ({swp} by swap, {back} blocks swapped back in), "
          f"{rec} tokens recomputed")
print("swap == recompute, token for token:", texts["swap"] == texts["recompute"])
print(repr(llm.tokenizer.decode(texts["swap"][0])))
"""),
("md", r"""
## 5. At scale: swap or recompute for Llama-3-8B on an H100

Exercise 2's crossover was a link bandwidth (~13 GB/s) that did not depend on context length, because the lab's cost
model is linear: recomputing costs 20 µs a token, whatever the context and whatever else the step does. The
**roofline executor** (`minivllm/sim/roofline.py`) knows two things that model does not. A busy decode step is
memory bound (it reads every weight for a few dozen tokens), so a short victim's tokens ride in it almost free. And
attention makes token *k* of a prefill read *k* keys, so recomputing a long context grows faster than its length.

Below, on the H100 preset with the shape of Llama-3-8B (bf16, 128 KiB of KV a token), simulated — nothing ran on an
H100; the preset is datasheet peaks times assumed utilisations (`minivllm/sim/presets.py`):

* **recompute** = the extra time of the steps that prefill the victim again in 2,048-token chunks next to 32
  decoding streams (the server is busy: that is why it preempts);
* **swap** = the victim's KV out and back in over the preset's host link (PCIe 5, 64 GB/s one way).

Your `swap_or_recompute` decides at each length, fed the preset's link, Llama-3-8B's block size in bytes and the
roofline's prefill rate *at that length*.
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())   # every number in this cell is simulated, on this preset
CTX = at_scale.context_grid(16, 131072)   # victims' context lengths, whole blocks
shape, hw = at_scale.presets()
recompute_ms = [at_scale.recompute_s(n) * 1000 for n in CTX]
swap_ms = [at_scale.swap_s(n) * 1000 for n in CTX]
says = [rule(n, -(-n // BLOCK_SIZE), bytes_per_block=BLOCK_SIZE * shape.kv_bytes_per_token,
             link_bytes_per_s=hw.swap_bandwidth, prefill_tokens_per_s=n / (r / 1000)) for n, r in zip(CTX, recompute_ms)]
switch = next((n for k, n in enumerate(CTX) if all(s == "swap" for s in says[k:])), None)

fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8))
ax.plot(CTX, recompute_ms, "-", color="#d62728", label="recompute (roofline)")
ax.plot(CTX, swap_ms, "-", color="#4e79a7", label=f"swap out + in ({hw.swap_bandwidth / 1e9:.0f} GB/s)")
ax.plot(CTX, [n / PREFILL_TOKENS_PER_S * 1000 for n in CTX], ":", color="#d62728", label="recompute, lab's linear model")
ax.plot(CTX, [2 * -(-n // BLOCK_SIZE) * KV_BYTES_PER_BLOCK / PCIE4_BYTES_PER_S * 1000 for n in CTX], ":",
        color="#4e79a7", label="swap, lab's model (25 GB/s)")
if switch:
    ax.axvline(switch, color="#888888", lw=1, ls="-.")
    ax.annotate(f"your rule: swap from\n{switch} tokens on", (switch, 300), fontsize=8, xytext=(-100, 0),
                textcoords="offset points")
ax.set_xscale("log", base=2); ax.set_yscale("log")
ax.set_xlabel("victim's context (tokens)"); ax.set_ylabel("ms to give way and come back")
ax.legend(fontsize=7, loc="lower right")
ax.set_title("Llama-3-8B on the H100 preset (simulated)", fontsize=9)
for (m, h), style in zip([("llama-3-8b", "h100"), ("llama-3-8b", "a100"), ("llama-3-8b", "l4"), ("qwen3-0.6b", "h100")],
                         ["-", "--", "-.", ":"]):
    grid = at_scale.model_context_grid(m)   # CTX up to the model's positions: Qwen3-0.6B stops at 40,960
    x = at_scale.crossover_tokens(m, h, grid)
    where = "never" if x is None else ("always" if x == grid[0] else f"from {x} tokens")
    bx.plot(grid, [at_scale.recompute_s(n, m, h) / at_scale.swap_s(n, m, h) for n in grid], style,
            label=f"{m} on {h}: swap {where}")
bx.axhline(1, color="#888888", lw=1)
bx.set_xscale("log", base=2); bx.set_yscale("log")
bx.set_xlabel("victim's context (tokens)"); bx.set_ylabel("recompute / swap  (> 1: swap wins)")
bx.legend(fontsize=7, loc="upper left"); bx.set_title("the same comparison on other presets (simulated)", fontsize=9)
fig.tight_layout()
plt.show()
for n in (256, 2048, 32768):
    k = CTX.index(n)
    print(f"{n:6d} tokens: recompute {recompute_ms[k]:6.1f} ms, swap {swap_ms[k]:6.1f} ms -> your rule: {says[k]}")
"""),
("md", r"""
Simulated on the H100 preset: below a few hundred tokens your rule recomputes (a 256-token victim rides in a step
that reads the weights anyway: ~0.6 ms, against ~1 ms of link traffic); once its chunk makes the step compute bound,
recomputing costs ~18 µs a token against ~4 µs to swap; and at 32K tokens attention makes recompute ~7× dearer. That
is the clause *"swap rather than recompute for long contexts"* of the serving policy Lesson 06 works through, which
the lab's parallel straight lines could not produce. The right panel shows what moves the crossover: FLOPs per
token against KV bytes per token, and the link. A slower GPU (the L4 preset) makes recompute dear at every length; a small model with a large KV
(Qwen3-0.6B: 112 KiB a token for 0.6 B parameters) recomputes more cheaply up to ~23K tokens even on an H100. Its
curve ends at 40,960 tokens, the positions Qwen3-0.6B was trained for: no victim of that model is longer (the
simulator refuses such a request). A caveat the simulation does not see: a link shared by eight GPUs gives each
far less than 64 GB/s.

The engine's own auto mode, on a real machine, charges recomputation at *one* measured prefill rate
(`prefill_tokens_per_s`), so its answer hardly depends on the victim's length. The simulator's auto mode
(`minivllm sim run --preemption-mode auto`) decides with the curves above instead: its cost model,
`RooflinePreemptionCosts` in `minivllm/sim/roofline.py`, is the same roofline that times the steps (these cells
call it through `at_scale.costs`). On a workload of three long prompts and many short ones (Llama-3-8B on the H100
preset, a 700-block pool), the one-rate model swaps all 21 victims; the roofline model swaps the 5 long ones and
recomputes the 16 short ones (`tests/test_sim_roofline.py`).
"""),
("md", r"""
## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive (options in a fixed shuffled order); the plain-text
questions follow, and the answer key, with every *why*, is in a separate cell: run it once you have answered.
The last two questions come from labs 1 and 2.
"""),
("code", r"""
show_quiz(5)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(5)
"""),
("code", r"""
print_answers(5)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* Why a continuous-batching engine runs out of KV *after* admitting a request, and the three ways out: recompute
  (costs prefill compute), swap (costs 2 × the victim's KV bytes of link traffic and host memory), reject (costs
  availability, wastes nothing).
* Why the default victim is the newest request, and how a victim policy moves preemptions away from an interactive
  tenant without reducing them — and why that barely helps its latency when the queue dominates.
* Why a request that one tenant's traffic may always preempt has a latency with no bound, though the server is up,
  and how the anti-thrash guard (`preemption_protect_after`) bounds it — at the price of the other tenants'
  latency, since someone else must give way; why preemption rates must be counted per tenant.
* The swap-or-recompute rule in seconds, where its crossover lies (link bandwidth vs prefill rate per block), and
  why it hardly depends on context length in a linear cost model.
* Why a reject rule at the door keeps latency bounded, and why the reject rate (not GPU utilisation) is what an
  autoscaler should scale on.
* What a bigger KV memory share buys (concurrency, fewer preemptions) and what it costs (activation room).
* Why swap mode quietly turns into recompute when the host tier is full, and why the tier a workload needs is set
  by its peak (at least the largest victim), while swap rate × how long victims stay (Little's law) gives only the
  average — small, because swapped victims wait at the front of the queue.
* How to measure a forward pass's activation peak (new storages counted at creation, subtracted when freed), why it
  grows linearly with the token budget and not with the number of layers, and how many tokens of budget a KV share
  leaves on a given GPU.

## Go further

* **Preempt by deadline.** Give each tenant a latency target (chat 2 s, agent 10 s, batch none) and write a victim
  policy that preempts the request with the most *slack* (target minus time already spent). Measure per-tenant p99
  against the targets. Does it beat `ProtectInteractive`?
* **A better door.** Replace the fixed `max_waiting` with an estimate of the newcomer's wait: queued tokens divided by
  the measured token rate (`engine.step_time_s`), rejecting when it exceeds a TTFT target. Send `retry_after_s` back
  like the engine's reject mode does. Plot served p99 TTFT against offered load for both doors.
* **A host-tier-aware auto mode.** The fallback measured above is all or nothing and blind: a victim that does not
  fit is recomputed whole, even when it holds 60 blocks and 58 would fit. Give `PreemptionCostModel` a look at the
  host tier (free host blocks, and the victim's expected stay: its place in the queue × `engine.step_time_s`) and
  choose, per victim, among swap, recompute, and *swap the oldest blocks, recompute the tail* (this needs a change
  in `KVCacheManager.swap_out`). On a 32-block tier, compare recomputed tokens and time spent giving way with the
  sweep above; then put a priority scheduler in front (`scheduling_policy="priority"`), where stays get long, and
  watch which rule degrades first.
* **A non-linear cost model.** Prefill attention grows with context. Make `recompute_s` grow faster than linearly
  (e.g. add a `tokens²` term) and find the context length above which a PCIe 3 link (12 GB/s) starts to swap.
"""),
]
