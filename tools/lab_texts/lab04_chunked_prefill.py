CELLS = [
("md", r"""
# Lab 4 — Chunked prefill

**Goals.** After this lab you can

1. explain why one long prompt freezes every other stream when its prefill runs in one step, and how chunking
   spreads it over many steps;
2. write the engine's step 2 — a decode-first batch builder under a token budget with a per-request cap — and run
   the real engine on it (✏️ exercise 1);
3. measure inter-token latency the way serving teams do: percentiles and the worst gap, per stream (✏️ exercise 2);
4. measure the trade: the long request's **TTFT** against everyone else's **ITL**, as the budget shrinks;
5. tune the first two rows of the tuning table — chunk size and maximum batched tokens — and pick a budget for an ITL
   target (✏️ exercise 3);
6. show how a prefix-cache hit shortens the time a long prompt blocks the batch.

**Time:** 7 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 45–60 minutes to work through. The sweeps use the engine's simulated clock; one small
cell runs the real model. Exercises are marked ✏️; until a checker passes, later cells use the
engine's own code, so you can always run the lab to the end.
"""),
("code", r"""
import math

import matplotlib.pyplot as plt
import torch
from IPython.display import display

from minivllm import LLM, SamplingParams
from minivllm.labs import choose, widgets
from minivllm.labs.check_lab04 import (NO_CHUNKING, check_build_batch, check_itl_stats,
                                       check_pick_budget, install_batch_builder,
                                       mixed_arrivals, prefill_block, serve, step_durations, summarize,
                                       throughput_run)
# the fallbacks, used until yours pass: the engine's own code, by name (read them after your attempt)
from minivllm.labs.check_lab04 import engine_build_batch as ref_build_batch      # Scheduler.build_batch
from minivllm.labs.check_lab04 import engine_itl_stats as ref_itl_stats          # RequestMetrics.itls + numpy
from minivllm.labs.check_lab04 import engine_pick_budget as ref_pick_budget      # bench's sweep verdict
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz

ON_GPU = torch.cuda.is_available()  # the real-model cell uses the GPU when there is one
%matplotlib inline
""", ["setup"]),
("md", r"""
## 1. The picture: one long prompt, everyone waits

Lab 1 showed that a step of the engine is **one forward pass** over everything scheduled in it, and that a step's
time grows with the number of tokens in it. Now a long prompt arrives while other users' answers are streaming.
Lesson 06 — the serving lesson this course is built on, whose claims every lab measures — takes a 64K-token
document as its example; here it is 8,192 tokens. (Section 10's code calls that lesson *the seed*, the one the labs
grow from; it has nothing to do with the `seed=` that fixes a random workload.)

```
                     time ──►
 whole prompt    c0  ▮ ▮ ▮ ▮ [·········· one 180 ms step ··········] ▮ ▮ ▮     every stream freezes
 in one step     c1  ▮ ▮ ▮ ▮ [··································] ▮ ▮ ▮     for the whole prefill
                 L0          [█████████ prefill 8,192 tokens █████████] ▮

 chunked         c0  ▮ ▮ ▮ ▮ ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮ ▮ ▮     each step: every decode first,
 (budget 512)    c1  ▮ ▮ ▮ ▮ ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮  ▮ ▮ ▮     then a chunk of the prompt
                 L0          ██ ██ ██ ██ ██ ██ ██ ██ ██ ██ ██ ██ ██ ██ ██ ██ ▮     fills the rest of the budget
```

Chunked prefill caps the tokens of one step (`max_num_batched_tokens`, the **budget**) and splits a long prompt
into chunks that ride along with the decodes. Every stream keeps getting a token every step; the steps are a little
slower while chunks ride along. The long request pays: its prefill is spread over many steps, so its **time to
first token** (TTFT) grows. The lesson's claim, which this lab measures: *chunking trades the long request's TTFT
for everyone else's inter-token latency (ITL).*

The cost model is the GPU-like one of lab 1: a step costs 15 ms plus 0.02 ms per token in it, so a decode step is
~15 ms and the 8,192-token prefill step ~180 ms (Lesson 06's "hundreds of milliseconds" for 64K tokens fits a ~1B model; an
8B one takes seconds on the simulated H100 of section 10). Below, the same small scene — chat requests (`c*`) streaming, one long prompt `L0` arriving at 0.3 s —
drawn from the engine's step log, x = time: first with the whole prompt in one step, then with a budget of 512
tokens.
"""),
("code", r"""
PICTURE = mixed_arrivals(num_long=1, long_every_s=0.6, first_long_s=0.3, chat_every_s=0.1, chat_output=(30, 50),
                         seed=1)
PICTURE_LENS = {a.request_id: len(a.prompt) for a in PICTURE}


def simulate(budget, threshold=0, builder=None, itl_stats=ref_itl_stats):
    '''Serve the small scene; what widgets.draw_chunking draws, and a one-line summary.'''
    eng, finals = serve(PICTURE, budget, threshold, builder=builder)
    s = summarize(finals, itl_stats)
    label = "whole prompt in one step" if budget >= NO_CHUNKING else f"budget {budget}, threshold {threshold}"
    summary = (f"{label}: L0 TTFT {s['ttft_long'] * 1000:.0f} ms | decoders' ITL p50 {s['itl_p50'] * 1000:.0f} ms, "
               f"p99 {s['itl_p99'] * 1000:.0f} ms, worst {s['itl_worst'] * 1000:.0f} ms")
    itls = [g for rid, o in finals.items() if rid.startswith("c") for g in o.metrics.itls]
    return {"step_log": eng.step_log, "starts": eng.lab_step_starts, "prompt_lens": PICTURE_LENS, "itls": itls,
            "title": label, "summary": summary}


for budget in (NO_CHUNKING, 512):
    run = simulate(budget)
    display(widgets.draw_chunking(run, max_ms=200))
    print(run["summary"])
"""),
("md", r"""
Left: each blue tick is a token coming out of a stream; orange bars are prefill steps. Without chunking `L0`'s
prefill is one long step, and every chat row has a white gap just as long — each stream waits ~180 ms for its next
token (the lonely bar at the right of the histogram). With a budget of 512 the prefill becomes 17 short chunks, the
ticks keep coming (a little further apart), no gap exceeds ~25 ms, and `L0`'s first
token comes later. (Look at p99 in the first run: 17 ms. Only the two streams decoding when `L0` arrived met the
stall, once each: 2 of ~250 gaps, under 1 %, so the 99th percentile does not see it — only the worst gap does. Keep
that in mind for section 3.) And `c2`, which arrives during the prefill, waits for it to end in both runs; `c3`
arrives after the one-step prefill is over, but in the chunked run, whose prefill lasts longer, it waits too. Section 5
shows the knob for that. Now build the piece of the engine that makes this decision.

## 2. ✏️ Exercise 1 — build the batch (step 2 of the loop)

Every step, `Scheduler.build_batch()` decides how many tokens each running request computes. Your
`build_batch(running, budget, threshold)` gets the running requests (in admission order), the budget
`max_num_batched_tokens` and the per-request cap `long_prefill_token_threshold`, and returns
`[(request, num_tokens), ...]`. The engine's rules:

* **decodes first**: a request with `req.is_decode` computes exactly one token, and every decode is served before
  any prefill, so a running stream never stalls;
* **prefills share the rest**, in running order: a prefill wants `req.num_uncomputed_tokens` (the prompt tokens
  without KV yet — after a preemption that includes its generated tokens too);
* **per-request cap**: with `threshold > 0`, no request takes more than `threshold` tokens in a step (0 = no cap);
* **never past the budget**, and never a row of 0 tokens.

The seam: `install_batch_builder(engine, build_batch)` swaps step 2 of a real engine for your function (the engine's
`BatchBuilder` seam in `minivllm/interfaces.py`; an engine built for it takes `LLM(batch_builder=build_batch)`). The
engine checks what comes back (a request twice, a row of 0 tokens, a total over the budget: a `ValueError` naming
it), turns each pair into a `ScheduledSeq(request, num_tokens, start=request.num_computed_tokens, is_decode)` and puts
one-token rows first (`batch.seqs.sort(key=lambda s: s.num_tokens != 1)`), the layout the attention kernels expect;
admission (step 1) and KV allocation (step 3) stay the engine's.

<details><summary>Hint 1</summary>

Split `running` into two lists with `req.is_decode`, then walk one list after the other. Don't decide "decode" by
"one token left": the last prompt token of a chunked prefill is one token too, and it is still a prefill.
</details>
<details><summary>Hint 2</summary>

Keep a running `budget` left. For each request: what it wants, capped by the threshold (when there is one), capped
by the budget left. Subtract the tokens you gave, not 1 per row.
</details>
<details><summary>Hint 3</summary>

Stop as soon as nothing is left of the budget — a row with 0 tokens is not allowed. The checker's last cases compare
you with the engine's own `build_batch` on 300 random states and then run a real engine on your function.
</details>
"""),
("code", r"""
def build_batch(running: list, budget: int, threshold: int) -> list:
    '''Step 2: [(request, num_tokens), ...] for this step -- decodes first, then prefill chunks, under the budget.'''
    # TODO: serve every decode before any prefill; give each request the tokens it may take this step
    #   (see the rules and hints above); stop when the budget is spent
    ### BEGIN SOLUTION
    decodes = [r for r in running if r.is_decode]
    prefills = [r for r in running if not r.is_decode]
    batch = []
    for req in decodes + prefills:
        if budget <= 0:
            break
        want = req.num_uncomputed_tokens
        if threshold:
            want = min(want, threshold)
        n = min(want, budget)
        batch.append((req, n))
        budget -= n
    return batch
    ### END SOLUTION
""", ["exercise:build_batch"]),
("code", r"""
batch_check = check_build_batch(build_batch)
builder = choose(batch_check, build_batch, ref_build_batch, "build_batch")
"""),
("md", r"""
Your builder inside the engine: the steps of the chunked run around `L0`'s arrival, as the step log records them
(`decode` = one token; `prefill[a:b]` = prompt tokens `a..b-1` computed in that step).
"""),
("code", r"""
eng, _ = serve(PICTURE, 512, builder=builder)
took = step_durations(eng)
first = next(i for i, e in enumerate(eng.step_log) if any(rid == "L0" for rid, _, _ in e["seqs"]))
for i in list(range(first - 1, first + 3)) + list(range(first + 15, first + 18)):
    print(f"{took[i] * 1000:5.1f} ms  " + widgets.describe_step(eng.step_log[i], PICTURE_LENS))
"""),
("md", r"""
## 3. ✏️ Exercise 2 — ITL: a percentile and the worst gap

A stream's **inter-token latencies** are the gaps between its consecutive tokens (its first token is TTFT, not an
ITL). A prefill stall is rare per stream — one gap in many — so the *mean* hardly moves; what users notice is the
freeze. Serving teams watch a high percentile over all streams' gaps (the lesson: "measure ITL p99 under mixed
workloads, not just average TTFT") and the worst gap.

Write `itl_stats(token_times, q=99)`: `token_times` maps a request id to its token times (seconds, increasing);
return `(the q-th percentile of all gaps, the worst gap)`, or `(0.0, 0.0)` when there are no gaps. Use the
**nearest-rank** percentile: the smallest gap such that at least `q` % of all gaps are at or below it.

<details><summary>Hint 1</summary>

Gaps come from consecutive times *of one request*. Two streams interleaved in time do not shorten each other's gaps,
so never merge the lists before taking differences.
</details>
<details><summary>Hint 2</summary>

Sort all the gaps: the answer is then a *rank*, a position in that list. Of `n` gaps, how many must be at or below
the answer for "at least `q` %" to hold? When that count is not a whole number, do you round toward more gaps or
fewer? Ranks count from 1, Python lists from 0.
</details>
<details><summary>Hint 3</summary>

A worked example (not a checker case): 40 gaps at q = 95 — 95 % of 40 is 38, so the 38th smallest (index 37).
30 gaps at q = 95 — 95 % of 30 is 28.5; 28 gaps would be under 95 %, so the 29th smallest. Whatever `n`, q = 100
is the largest gap, and q = 0 must still return a gap: the smallest.
</details>
"""),
("code", r"""
def itl_stats(token_times: dict[str, list[float]], q: float = 99) -> tuple[float, float]:
    '''(q-th percentile of all inter-token gaps by nearest rank, worst gap); (0.0, 0.0) without gaps.'''
    # TODO: collect every request's gaps, then read the nearest-rank percentile and the largest gap
    ### BEGIN SOLUTION
    gaps = sorted(b - a for times in token_times.values() for a, b in zip(times, times[1:]))
    if not gaps:
        return 0.0, 0.0
    rank = math.ceil(q / 100 * len(gaps))
    return gaps[max(rank, 1) - 1], gaps[-1]
    ### END SOLUTION
""", ["exercise:itl_stats"]),
("code", r"""
itl_check = check_itl_stats(itl_stats)
itl = choose(itl_check, itl_stats, ref_itl_stats, "itl_stats")
"""),
("md", r"""
## 4. Measured: the long request's TTFT vs everyone's ITL

The workload: chat requests (short prompts, 60–120 output tokens) arrive all along, about 8 a second, and a long
prompt of 8,192 tokens arrives every second, five times — so a stall is not a one-off that p99 could ignore.
Each budget serves exactly the same arrivals on the engine's virtual clock, with your batch builder; the decoders'
ITL is measured with your `itl_stats`. `NO_CHUNKING` is a budget above any step's demand with chunked prefill off:
every prompt in one step.
"""),
("code", r"""
ARRIVALS = mixed_arrivals()
BUDGETS = [NO_CHUNKING, 8192, 4096, 2048, 1024, 512, 256, 128]
sweep = {b: summarize(serve(ARRIVALS, b, builder=builder)[1], itl) for b in BUDGETS}

print(f"{'budget':>10s} {'long TTFT':>10s} {'ITL p50':>8s} {'ITL p99':>8s} {'worst':>8s} {'chat TTFT p99':>14s} "
      f"{'mean TTFT':>10s}   (ms)")
for b, s in sweep.items():
    name = "no chunks" if b == NO_CHUNKING else str(b)
    print(f"{name:>10s} {s['ttft_long'] * 1000:10.0f} {s['itl_p50'] * 1000:8.1f} {s['itl_p99'] * 1000:8.1f} "
          f"{s['itl_worst'] * 1000:8.1f} {s['ttft_chat_p99'] * 1000:14.0f} {s['ttft_mean'] * 1000:10.0f}")

fig, ax = plt.subplots(figsize=(6, 3.2))
ax.plot([s["itl_p99"] * 1000 for s in sweep.values()], [s["ttft_long"] * 1000 for s in sweep.values()], "o-")
for b, s in sweep.items():
    ax.annotate("no chunks" if b == NO_CHUNKING else str(b), (s["itl_p99"] * 1000, s["ttft_long"] * 1000),
                fontsize=8, xytext=(-58, -3) if b == NO_CHUNKING else (4, 4), textcoords="offset points")
ax.set_xlabel("decoders' ITL p99 (ms)")
ax.set_ylabel("long prompt's mean TTFT (ms)")
ax.set_title("chunked prefill: one trade-off curve, one point per budget", fontsize=10)
plt.show()
"""),
("code", r"""
off, chunked = sweep[NO_CHUNKING], sweep[512]
print(f"budget 512 vs no chunking: the long prompt's TTFT x{chunked['ttft_long'] / off['ttft_long']:.1f}, "
      f"decoders' p99 ITL / {off['itl_p99'] / chunked['itl_p99']:.1f}, worst gap / {off['itl_worst'] / chunked['itl_worst']:.1f}")
ordered = [sweep[b] for b in BUDGETS]   # from no chunking down to budget 128
print("as the budget shrinks, the long TTFT only rises:", all(a["ttft_long"] < b["ttft_long"] for a, b in zip(ordered, ordered[1:])))
print("... and the decoders' p99 ITL only falls:      ", all(a["itl_p99"] > b["itl_p99"] for a, b in zip(ordered, ordered[1:])))
print("the median ITL hardly notices any of it:       ", max(s["itl_p50"] for s in ordered[:-2]) * 1000 < 16)
"""),
("md", r"""
The lesson's claim, measured: **chunking trades the long request's TTFT for everyone else's ITL.** Four things to
read off the table:

* **p50 is blind.** The median gap is ~15 ms in every row down to 512; the stalls live in the tail. (Five long
  prompts make ~1.6 % of all gaps stalls, so p99 catches them; with one long prompt, as in section 1, p99 misses
  it and only the worst gap tells.)
* **The average TTFT points the wrong way.** The last column, the mean over all 43 requests (what a dashboard
  shows first), is lowest with no chunking (~59 ms) and only rises as the budget shrinks: ~86 ms at 1,024, ~125 ms
  at 512. A team tuning on it would switch chunking off, the row whose decoders' p99 gap is five times worse than
  at 1,024. The lesson's rule in one table: measure ITL p99 under mixed workloads, not just average TTFT.
* **Too little and long prompts starve.** At 128 tokens per step the engine computes less prompt per second than
  arrives: the long TTFT explodes (queueing), and so does the TTFT of *chat* requests, which now wait for budget to
  be admitted. At 256 it still keeps up — the long TTFT is just its many chunk steps — but every step is full, so
  even p50 rises.
* **Chat TTFT p99 ≈ the long TTFT in every row down to 256** — with nothing capping a request's chunk, a short
  prompt that arrives during a long prefill waits for it to finish. That is what the per-request cap is for.

## 5. Tuning row 1 — chunk size (`long_prefill_token_threshold`)

| Setting | Trade-off |
|---|---|
| Chunk size | Smaller chunks give smoother decoding; larger chunks give faster first tokens for long prompts |

The budget caps a whole step; `long_prefill_token_threshold` caps what **one** request may take in a step — the chunk
size. Keep the budget at 2048 and shrink the chunk:
"""),
("code", r"""
THRESHOLDS = [0, 1024, 512, 256]
print(f"{'threshold':>10s} {'long TTFT':>10s} {'ITL p99':>8s} {'chat TTFT p99':>14s}   (ms, budget 2048)")
for t in THRESHOLDS:
    s = summarize(serve(ARRIVALS, 2048, t, builder=builder)[1], itl)
    print(f"{t or 'none':>10} {s['ttft_long'] * 1000:10.0f} {s['itl_p99'] * 1000:8.1f} {s['ttft_chat_p99'] * 1000:14.0f}")
"""),
("md", r"""
Smaller chunks: smoother decoding (p99 falls), a slower first token for the long prompt — the first row of the
table, measured. And the chat TTFT p99 drops from ~245 ms to ~40–70 ms: with a cap, the long prefill no longer
claims the whole budget, so a short prompt that arrives meanwhile is admitted and prefilled *next to* it (the
scheduler admits a request only while the running requests' next chunks leave budget for it).

## 6. Tuning row 2 — maximum batched tokens, and ✏️ exercise 3

| Setting | Trade-off |
|---|---|
| Maximum batched tokens | Higher improves throughput until latency targets slip |

Throughput needs a saturated engine, so it is measured on a backlog: 64 requests (256–2,048-token prompts) queued at
once. Every step pays the fixed 15 ms, so bigger steps amortize it better — with diminishing returns:
"""),
("code", r"""
THROUGHPUT = {b: throughput_run(b, builder=builder) for b in BUDGETS}
for b in BUDGETS:
    name = "no chunks" if b == NO_CHUNKING else str(b)
    print(f"{name:>10s}: {THROUGHPUT[b]:8.0f} tokens/s (virtual)   ITL p99 {sweep[b]['itl_p99'] * 1000:6.1f} ms")
"""),
("md", r"""
So: the **largest** budget whose ITL still meets the target gives the most throughput and the fastest long
prompts. Write `pick_budget(measure, budgets, itl_target_s)`: `measure(b)` runs a whole workload at budget `b` and
returns a dict with `"itl_p99"`, `"itl_worst"`, `"itl_p50"`, `"ttft_long"` and `"tokens_per_s"`; return the
largest budget whose `"itl_p99"` is at or below the target, or `None` if none is. Each measurement is a whole run:
call `measure` once per budget.

<details><summary>Hint 1</summary>

The target is on the p99 — the worst gap is reported, not the criterion (one stall in ten thousand gaps should not
veto a budget).
</details>
<details><summary>Hint 2</summary>

The list of budgets may come in any order; "at or below" includes equality; "none qualifies" is an answer too.
</details>
"""),
("code", r"""
def pick_budget(measure, budgets: list[int], itl_target_s: float):
    '''The largest budget whose measured p99 ITL meets itl_target_s, or None.'''
    # TODO: measure each budget once and return the best one that meets the target (None if none does)
    ### BEGIN SOLUTION
    meets = [b for b in budgets if measure(b)["itl_p99"] <= itl_target_s]
    return max(meets) if meets else None
    ### END SOLUTION
""", ["exercise:pick_budget"]),
("code", r"""
pick_check = check_pick_budget(pick_budget)
picker = choose(pick_check, pick_budget, ref_pick_budget, "pick_budget")
"""),
("md", r"""
Lesson 06 ends with a *worked policy*: a serving configuration for mixed traffic, written out clause by clause.
It asks interactive traffic for an ITL under 60 ms. Hold the decoders' p99 to it:
"""),
("code", r"""
def measure(budget):
    return dict(sweep[budget], tokens_per_s=THROUGHPUT[budget])   # the runs of section 4 and above


TARGET = 0.060
best = picker(measure, BUDGETS, TARGET)
top = max(THROUGHPUT.values())
print(f"p99 ITL <= {TARGET * 1000:.0f} ms: max_num_batched_tokens = {best}")
print(f"  ITL p99 {sweep[best]['itl_p99'] * 1000:.1f} ms, long TTFT {sweep[best]['ttft_long'] * 1000:.0f} ms, "
      f"throughput {THROUGHPUT[best]:.0f} tokens/s = {THROUGHPUT[best] / top:.0%} of the best budget's")
for target in (0.030, 0.020, 0.010):
    print(f"p99 ITL <= {target * 1000:.0f} ms: {picker(measure, BUDGETS, target)}")
"""),
("md", r"""
At 60 ms the pick keeps ~97 % of the throughput of the largest step. Tighter targets cost more and more: at 20 ms
only the starving budget of 128 tokens qualifies (check its long TTFT in the table) — that target needs a different
fix (a smaller chunk with the budget kept, more hardware, or fewer long prompts per replica). And note what the ITL
came from: the pick is only as good as the workload you measured. Tune on your own traffic mix.

## 7. A prefix-cache hit shortens the block

Lab 3's prefix cache changes this picture too. Three long prompts are the **same** 8,192-token document followed
by different 32-token questions (RAG, or a long system prompt). Serve them without chunking — the worst case — with
the prefix cache off and on, and measure, for each long prompt, the steps that carried its prefill and the longest
of them: the time it blocked everyone.
"""),
("code", r"""
DOCS = mixed_arrivals(num_long=3, shared_long_prefix=True, seed=5)
for caching in (False, True):
    eng, finals = serve(DOCS, NO_CHUNKING, enable_prefix_caching=caching)
    lens = {a.request_id: len(a.prompt) for a in DOCS}
    blocks = [prefill_block(eng, f"L{k}", lens[f"L{k}"]) for k in range(3)]
    s = summarize(finals, itl)
    print(f"prefix cache {'on ' if caching else 'off'}: longest prefill step of L0, L1, L2 = "
          + ", ".join(f"{t * 1000:5.1f} ms" for _, t in blocks)
          + f" | TTFT " + ", ".join(f"{finals[f'L{k}'].metrics.ttft * 1000:4.0f}" for k in range(3)) + " ms"
          + f" | decoders' ITL p99 {s['itl_p99'] * 1000:.0f} ms")
"""),
("md", r"""
A miss is a full 8,192-token prefill that blocks the batch for ~180 ms. A hit computes only the uncached tail (here
the 32-token question; a prompt cached whole would still recompute its last block, lab 3): the step is barely longer than a decode step, and nobody notices. So the prefix
cache is also a latency tool for *other* users — and the first request with a new document still pays, which is why
chunking and caching are used together.

## 8. Explore: move the budget and the chunk size

Drag the sliders (in Jupyter with a live kernel): the small scene of section 1 reruns with your batch builder, and
the timeline and the ITL histogram redraw. Try a budget of 4096 with thresholds 0, 512 and 128, and find the
smallest budget at which `L0`'s TTFT starts to climb fast. Without a live kernel you see the picture for the
starting values.
"""),
("code", r"""
explorer = widgets.BudgetExplorer(lambda b, t: simulate(b, t, builder=builder, itl_stats=itl),
                                  budget=(64, 4096, 64, 512), threshold=(0, 2048, 64, 256), max_ms=200)
explorer.show()
"""),
("md", r"""
## 9. Confirmed on the real model

The same experiment on the bundled SmolLM2-135M, wall clock: three chat requests decoding, then a long prompt
arrives. One loaded model, two runs: your batch builder with a budget that fits the whole prompt in one step, then
with a budget of 64 tokens (on a GPU: a longer prompt and budget 256). Timings are your machine's, so they vary; the
direction is the lesson.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings on the real model)
import time

LONG, SMALL_BUDGET = (4096, 256) if ON_GPU else (384, 64)
threads = torch.get_num_threads()
if not ON_GPU:   # one thread: steadier wall clock on a shared CPU (a multi-threaded op stalls whenever
    torch.set_num_threads(1)   # another process holds one of its cores)
llm = LLM(max_model_len=LONG + 64, max_num_batched_tokens=LONG + 64, num_gpu_blocks_override=(LONG + 256) // 4)
engine = llm.engine
doc = [(7 * i) % 5000 + 100 for i in range(LONG)]


def real_run(budget):
    install_batch_builder(engine, builder, budget=budget)
    for i in range(3):
        engine.add_request({"prompt_token_ids": doc[i * 16:i * 16 + 16]},
                           SamplingParams(max_tokens=10, ignore_eos=True), f"c{i}")
    for _ in range(3):
        engine.step()
    engine.add_request({"prompt_token_ids": doc}, SamplingParams(max_tokens=2, ignore_eos=True), "L")
    finals, prefill_steps = {}, []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        if any(rid == "L" and start < LONG for rid, start, _ in engine.step_log[-1]["seqs"]):
            prefill_steps.append(time.perf_counter() - t0)   # a step every stream waits for
        for out in outs:
            if out.finished:
                finals[out.request_id] = out
    times = {rid: o.metrics.token_times for rid, o in finals.items() if rid.startswith("c")}
    return finals["L"].metrics.ttft, sorted(prefill_steps), itl(times, 50)


engine.add_request({"prompt_token_ids": doc[:32]}, SamplingParams(max_tokens=2, ignore_eos=True))
while engine.has_unfinished_requests():   # warm-up: the first calls pay one-off costs
    engine.step()
for budget in (LONG + 64, SMALL_BUDGET):
    ttft, steps, (p50, worst) = real_run(budget)   # your itl_stats at q=50: (median gap, worst gap)
    name = "whole prompt" if budget > LONG else f"budget {budget}"
    print(f"{name:>12s}: long prompt TTFT {ttft * 1000:6.0f} ms | its prefill: {len(steps)} step(s), median "
          f"{steps[len(steps) // 2] * 1000:5.0f} ms each | decoders' ITL p50 {p50 * 1000:4.0f} ms, worst {worst * 1000:5.0f} ms")
torch.set_num_threads(threads)
"""),
("md", r"""
Same direction as the simulation: chunking raises the long prompt's TTFT, and the steps that carry its prefill —
each one a wait for every stream — get much shorter. What this CPU run shows besides: the chunks together take
longer than the whole prompt did (compare the two TTFTs), because a CPU step's time grows with its tokens almost
from the first token and each step also pays the fixed cost of reading the weights; and a chunk's step still
costs several decode steps (compare its median with the whole-prompt run's ITL p50). On a GPU the trade should
look different — this is reasoning; this cell's output above is a CPU run: at small batches
a GPU step's time is mostly fixed cost (reading the weights, launching kernels) and barely grows with its tokens,
so a chunk of a few hundred tokens adds little beyond that fixed cost, where here every chunk token adds time at
once. The engine's eager prompt steps on an H200 point that way (a random-weight Llama-3.2-1B in bf16): a median
of 10.9 ms with 64 prompt tokens and 10.5 ms with 512
(`benchmarks/results/2026-11-30_nvidia-h200_eager_step_64.json` and `..._512.json`). The same files show the fixed
cost that does count there: such a step runs eagerly (~700 kernel launches), while a decode step alone replays a
CUDA graph in 2.5 ms. Unlike section 4's
simulation, the decoders' *median* gap can rise here too: with a handful of streams and a long prompt in chunks,
most of their gaps sit beside a chunk, so p50 is no longer blind. Wall-clock numbers are noisy on a busy machine (a
worst gap can come from anything else the machine does); the median step is the robust number.
"""),
("md", r"""
## 10. At scale: the same policy on an H100

Every sweep above used lab 1's linear cost: 15 ms a step plus 0.02 ms a token. Here the same engine — with your
batch builder and your `itl_stats` — runs on the **roofline executor** (`minivllm/sim/roofline.py`) with the shape
of Llama-3-8B (bf16) on the H100 preset: each step costs the slower of its FLOPs (at 70 % of 990 TFLOP/s) and its
bytes (at 85 % of 3.35 TB/s), plus ~2 ms of host overhead. Nothing here ran on an H100: the preset is datasheet
peaks times assumed utilisations (`minivllm/sim/presets.py`), so read shapes and orders of magnitude, not the third
digit. The scene, scaled up: chat requests arriving ~20 a second, and two 32K-token prompts 1.5 s apart. The
lesson's worked policy says *"chunk prefill above 8K tokens to protect ITL"*; the dash-dot line is a budget of 8,192.
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())   # every number in this cell is simulated, on this preset
AT_ARRIVALS = mixed_arrivals(num_long=2, long_len=32768, long_every_s=1.5, first_long_s=0.3, chat_every_s=0.05,
                             seed=2)
AT_BUDGETS = [256, 512, 1024, 2048, 4096, 8192, 16384]
at = at_scale.chunk_sweep(AT_BUDGETS + [None], AT_ARRIVALS, builder=builder, itl_stats=itl)
whole = at.pop(None)   # chunked prefill off: every prompt in one step

fig, ax = plt.subplots(figsize=(7.5, 4))
ax.plot(AT_BUDGETS, [at[b]["itl_p99"] * 1000 for b in AT_BUDGETS], "o-", label="decoders' ITL p99")
ax.plot(AT_BUDGETS, [at[b]["itl_worst"] * 1000 for b in AT_BUDGETS], "s--", label="worst gap")
ax.axhline(whole["itl_worst"] * 1000, color="#d62728", lw=1, label="worst gap, no chunking")
ax.axhline(TARGET * 1000, color="#888888", ls=":", label=f"ITL target {TARGET * 1000:.0f} ms")
ax.axvline(8192, color="#bbbbbb", ls="-.", lw=1)
ax.annotate("the 8K rule", (8192, 12), fontsize=8, xytext=(4, 0), textcoords="offset points")
ax.set_xscale("log", base=2); ax.set_yscale("log")
ax.set_xticks(AT_BUDGETS, [str(b) for b in AT_BUDGETS])
ax.set_xlabel("max_num_batched_tokens (budget)"); ax.set_ylabel("ms")
ax2 = ax.twinx()
ax2.plot(AT_BUDGETS, [at[b]["ttft_long"] for b in AT_BUDGETS], "^-", color="#2ca02c", label="32K prompt's TTFT (s)")
ax2.set_ylim(0, max(at[b]["ttft_long"] for b in AT_BUDGETS) * 1.2)
ax2.set_ylabel("long prompt's TTFT (s)", color="#2ca02c")
ax.set_title("Llama-3-8B on the H100 preset (simulated): budget vs ITL and the long prompt's TTFT", fontsize=9)
fig.subplots_adjust(bottom=0.28)
fig.legend(loc="lower center", ncol=3, fontsize=8)
plt.show()
print(f"one step of 8,192 prompt tokens alone: {at_scale.step_s([(0, 8192, False)]) * 1000:.0f} ms; "
      f"a decode step of 16 streams: {at_scale.step_s([(500, 1, True)] * 16) * 1000:.1f} ms")
print("the 32K prompt in 8,192-token chunks, each alone in a step, starting at 0 / 8K / 16K / 24K: "   # later chunks
      + " / ".join(f"{at_scale.step_s([(s, 8192, False)]) * 1000:.0f}" for s in range(0, 32768, 8192)) + " ms")  # attend to more
print(f"no chunking: the 32K prompt's TTFT {whole['ttft_long']:.2f} s, decoders' worst gap {whole['itl_worst'] * 1000:.0f} ms")
for m in ("llama-3.2-1b", "llama-3-8b"):   # the seed's 64K-token prefill as one step, on the same preset
    print(f"the seed's 64K-token prompt in one step, {m}: {at_scale.step_s([(0, 65536, True)], m) * 1000:,.0f} ms")
for b in (1024, 8192):
    print(f"budget {b:5d}: TTFT {at[b]['ttft_long']:.2f} s, ITL p99 {at[b]['itl_p99'] * 1000:.0f} ms")
print(f"your pick_budget for a p99 ITL <= {TARGET * 1000:.0f} ms: {picker(lambda b: at[b], AT_BUDGETS, TARGET)}")
"""),
("md", r"""
Simulated on the H100 preset, four things differ from the small model of sections 4–6:

* **An 8K-token step is not a short stall.** 8,192 prompt tokens of an 8B model are ~1.3 × 10¹⁴ FLOPs: ~190 ms on
  this preset for the prompt's first chunk. Every later chunk costs more, because its tokens attend not only to
  each other but to the whole prefix computed before them: the 32K prompt's four 8K chunks take 193, 244, 294 and
  345 ms. The decoders' stalls are those chunk steps, so a budget of 8,192 gives them a p99 ITL near 300 ms, five
  times the interactive 60 ms target; your `pick_budget` picks 1,024. Read the worked policy's clause as *which*
  prompts get chunked (those above 8K), not as the chunk size: the size comes from the ITL target and the
  hardware. The engine's `three_class` preset (lab 6) keeps the two apart the way vLLM does: `long_prefill_token_threshold=8192` says no *request* prefills more
  than 8K tokens in one step, and the *step's* size is `max_num_batched_tokens`, where your `pick_budget` answer goes.
* **Chunking costs the long prompt little.** A decode step is memory bound (it reads ~15 GB of weights for a few
  dozen tokens), so prompt tokens riding along cost only their FLOPs; each extra step adds its ~2 ms of overhead.
  The 32K prompt's TTFT goes from ~1.1 s (whole) to ~1.2 s at 1,024. Section 4's model charged 15 ms per step, which
  made chunking look far dearer. Only at 256 tokens, where steps are memory bound again, does the TTFT climb.
* **The ITL grows in proportion to the budget** once a step is compute bound (~24 ms per 1K tokens for a chunk at
  the start of the prompt, ~45 ms near its 32K end, where attention to the prefix adds the difference), so halving
  the chunk halves the stall — a straight line on this log-log plot up to a few thousand tokens. Above that the p99
  line bends (16K: 1.5× of 8K): each long prompt then takes only a few steps, so fewer of the gaps are stalls for the
  p99 to land on. Read the worst gap for the stall itself.
* **Lesson 06's 64K-token prefill** "occupies the GPU for hundreds of milliseconds": ~0.6 s for a 1B model on this
  preset, ~2.9 s for the 8B one (attention's cost grows with the square of the length, so 64K costs more than twice
  32K). Unchunked, every decoding stream would freeze that long.

## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive (options in a fixed shuffled order); the plain-text
questions follow, and the answer key, with every *why*, is in a separate cell: run it once you have answered.
Two questions come back from earlier labs.
"""),
("code", r"""
show_quiz(4)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(4)
"""),
("code", r"""
print_answers(4)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* Why a long prefill in one step raises **every** stream's worst inter-token gap, and why the mean and the median
  hide it while p99 (under enough long prompts) and the worst gap show it.
* What the scheduler does in step 2: decodes first, prefill chunks under `max_num_batched_tokens`, at most
  `long_prefill_token_threshold` tokens per request — and why a one-token prefill chunk is not a decode.
* The trade chunking makes (the long request's TTFT for everyone else's ITL), with numbers from your sweep, and
  the two ways it goes wrong: too large a budget (stutter) and too small (long prompts and new requests starve).
* The difference between the two knobs: the budget caps a step, the threshold caps one request in a step, and only
  the threshold lets short prompts in next to a long prefill.
* How to pick `max_num_batched_tokens` for an ITL target, and why the answer depends on your traffic.
* Why a prefix-cache hit makes a long prompt cheap for everyone else, not just for itself.

## Go further

Real servers see several long prompts at once. vLLM bounds how many *partial* prefills run concurrently
(`max_num_partial_prefills`, and `max_long_partial_prefills` for prompts above the threshold) so short prompts can
overtake long ones. Write a batch builder that allows at most one long prefill (more than `threshold` tokens left) per
step and lets short prompts use the rest of the budget, install it with `install_batch_builder`, and measure on
`mixed_arrivals(long_every_s=0.3)` (overlapping long prompts): what happens to the chat TTFT p99, the decoders' ITL
p99 and the long prompts' TTFT? Is there a workload where it is worse than the engine's builder? vLLM's tuning guide
(https://docs.vllm.ai/en/latest/configuration/optimization/) lists the knobs a real deployment turns for the same
trade-off: `max_num_batched_tokens`, `max_num_seqs`, chunked prefill and preemption.
"""),
]
