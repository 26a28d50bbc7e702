CELLS = [
("md", r"""
# Lab 1 — The serving loop

**Goals.** After this lab you can

1. explain why *prefill* (the prompt) and *decode* (one new token) cost so differently, with numbers you measured on a real model;
2. name the seven steps of one engine iteration and watch them on a step timeline;
3. tell prefill chunks from decode tokens in the engine's step log (✏️ exercise 1);
4. implement static batching as an admission policy and measure why continuous batching beats it (✏️ exercise 2).

**Time:** 7 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 30–60 minutes to work through. Later cells use the
engine's own code until your checker passes, so you can always run the whole notebook.
"""),
("code", r"""
import time

import matplotlib.pyplot as plt
import torch

from minivllm import LLM, SamplingParams
from minivllm.labs import choose, widgets, workloads
from minivllm.labs.check_lab01 import check_split_step, check_static_batching
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz
from minivllm.sched.policies import FCFSAdmission
from minivllm.sim.executor import SimulatedExecutor

ON_GPU = torch.cuda.is_available()  # bigger measurements on a GPU, same code
%matplotlib inline
""", ["setup"]),
("md", r"""
## 1. The picture: one loop, two kinds of work

A serving engine is a loop. Each iteration (`LLMEngine.step()`) runs **one forward pass** over a batch that mixes
requests in different phases:

```
 waiting queue ──admit──► running requests ──────────────────────────────────────► finished
                           │ r0: prompt 0..99 ███████████░░░ prefill chunk (many tokens, no KV yet)
                           │ r1: ...token 57  █               decode        (1 new token, reads all its KV)
                           │ r2: ...token 12  █               decode
                           ▼
      ┌─ step() ────────────────────────────────────────────────────────────────────────────┐
      │ 1 admit  2 build batch  3 allocate KV  4 execute  5 append KV  6 emit  7 finish     │
      └─────────────────────────────────────────────────────────────────────────────────────┘
```

* **Prefill** runs the whole prompt at once: hundreds of tokens share one pass over the weights. The matrix
  multiplies are big, so the GPU's arithmetic units are the limit — *compute-bound*.
* **Decode** produces one token per request per step. Every step still reads *all* the weights (and the request's
  KV) from memory to do a tiny amount of arithmetic — *memory-bound*. The cure is batching: one read of the
  weights serves every decode in the step, so a batch of decodes costs little more than one (on a GPU, 32 for about
  a third more than one: on the H200 this project borrowed, a random-weight Llama-3.2-1B replayed as a CUDA graph
  took about 2.6 ms for one decode, 3.1–3.4 ms for 12 or 16 and 3.4 ms for 32, in
  `benchmarks/results/2026-11-30_nvidia-h200_llama1b_profile_run2.json`).

Let's measure that claim on the bundled SmolLM2-135M before believing it.
"""),
("md", r"""
## 2. Measured: prefill vs decode on the real model

One request with a long prompt: its first step is the prefill, the next ones are decodes. Then eight requests
decode together. Times are wall clock on *your* machine, so the numbers vary; the *ratios* are the lesson.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings)
llm = LLM(max_model_len=2048, num_gpu_blocks_override=512)
engine = llm.engine
PROMPT_LEN = 1024 if ON_GPU else 256
BATCH = 32 if ON_GPU else 8
prompt = [(7 * i) % 5000 + 100 for i in range(PROMPT_LEN)]


def timed_step():
    t0 = time.perf_counter()
    engine.step()
    if ON_GPU:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure_once():
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
    prefill = timed_step()                                # PROMPT_LEN tokens in one pass
    decode_1 = min(timed_step() for _ in range(3))        # 1 token per pass
    for i in range(BATCH):
        engine.add_request({"prompt_token_ids": prompt[i * 8:i * 8 + 16]},
                           SamplingParams(max_tokens=4, ignore_eos=True))
    timed_step()                                          # their (short) prefills
    decode_b = min(timed_step() for _ in range(2))        # BATCH decodes in one pass
    while engine.has_unfinished_requests():
        engine.step()
    return prefill, decode_1, decode_b


# The first pass over each new shape pays one-off costs (the CPU's matmul library plans each shape; a GPU sets up
# kernels), and a busy machine adds noise: measure three times and keep each quantity's best. (Another busy
# process on a 2-core machine can make torch's threads wait for each other and every step several times slower.)
runs = [measure_once() for _ in range(3)]
prefill_s, decode_1_s, decode_b_s = (min(r[k] for r in runs) for k in range(3))

print(f"prefill of {PROMPT_LEN} tokens: {prefill_s * 1000:8.1f} ms  = {prefill_s / PROMPT_LEN * 1000:6.2f} ms per token")
print(f"decode, 1 request:      {decode_1_s * 1000:8.1f} ms  = {decode_1_s * 1000:6.2f} ms per token")
print(f"decode, {BATCH} requests:     {decode_b_s * 1000:8.1f} ms  = {decode_b_s / BATCH * 1000:6.2f} ms per token")
print(f"a decode token costs {decode_1_s / (prefill_s / PROMPT_LEN):.0f}x a prefill token; "
      f"batching {BATCH} decodes costs {decode_b_s / decode_1_s:.1f}x one decode")
"""),
("code", r"""
print("per token, prefill is cheaper than an unbatched decode:", prefill_s / PROMPT_LEN < decode_1_s)
print(f"batched decode is cheaper per token than single decode:", decode_b_s / BATCH < decode_1_s)
"""),
("md", r"""
Why? Count bytes. SmolLM2-135M has ~135 M parameters, 540 MB in fp32 (4 bytes each). To compute one token, a
decode step reads every parameter once and does one multiply and one add with it: 2 floating-point operations per
4 bytes read, i.e. **0.5 FLOP per byte** (1 in bf16, 2 bytes a weight). A chip can do far more than that — a modern GPU does hundreds of FLOPs
in the time it reads one byte from memory, a CPU tens — so the arithmetic units mostly wait for memory. The prefill
above (`PROMPT_LEN` tokens: 256 on a CPU, 1,024 when a GPU is present) reads the weights once and uses each of them
for every prompt token: ~128 FLOP per byte at 256 tokens in fp32, and ~1,024 at 1,024 tokens in bf16 (2 bytes a
weight, the GPU default), so it keeps the arithmetic busy instead.
Batching decodes is the same trick: one read of the weights, many tokens (`BATCH` of them: 8 on a CPU, 32 on a GPU).

The engine's what-if tool, `SimulatedExecutor`, models a step as
`fixed_overhead + per_token * tokens + per_context_token * KV tokens read`. Your measurements calibrate it:
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (derived from your wall-clock measurements)
calibrated = dict(fixed_overhead_s=decode_1_s, per_token_s=max(prefill_s - decode_1_s, 0.0) / PROMPT_LEN,
                  per_context_token_s=0.0)
print({k: f"{v * 1000:.3f} ms" for k, v in calibrated.items()})
"""),
("md", r"""
## 3. The seven steps, one at a time

`LLMEngine.step()` is seven lines (`minivllm/engine/llm_engine.py`). Below we run those seven lines by hand on a small engine
(a simulated forward pass, so it is instant and every number is reproducible): three requests, a budget of 16
tokens per step, so the longest prompt is **chunked** over several steps. Step 3 hands out **KV blocks**: the
engine stores each request's keys and values (its KV cache) in fixed-size pages, here 4 tokens each, and gives a
request a block as its tokens need one; lab 2 builds that allocator.
"""),
("code", r"""
def small_engine(admission_policy=None):
    eng = workloads.sim_engine(block_size=4, max_num_seqs=3, max_num_batched_tokens=16, model_max_len=256,
                               admission_policy=admission_policy)
    for rid, (n_prompt, n_out) in {"A": (20, 5), "B": (6, 8), "C": (9, 3)}.items():
        eng.add_request({"prompt_token_ids": list(range(10, 10 + n_prompt))},
                        SamplingParams(max_tokens=n_out, ignore_eos=True), request_id=rid)
    return eng


eng = small_engine()
s = eng.scheduler
admitted = s.admit()                                   # 1. admit
print("1 admit:       ", [r.request_id for r in admitted])
batch = s.build_batch()                                # 2. build batch
print("2 build batch: ", [(q.request.request_id, q.start, q.num_tokens) for q in batch.seqs], "(id, start, tokens)")
batch = s.allocate(batch)                              # 3. allocate KV blocks
print("3 allocate:    ", {r.request_id: r.block_ids for r in s.running})
sampled = eng.executor.execute(batch)                  # 4. execute (the forward pass)
print("4 execute:     ", "sampled", sampled, f"at t={eng.executor.now():.4f} s (virtual)")
grew = eng.append(batch, sampled)                      # 5. append KV and tokens
print("5 append:      ", {r.request_id: r.num_computed_tokens for r in s.running}, "computed tokens")
outputs = eng.emit(grew)                               # 6. emit
print("6 emit:        ", [(o.request_id, o.outputs[0].token_ids) for o in outputs])
eng.finish(outputs, batch)                             # 7. finish
print("7 finish:      ", [o.request_id for o in outputs if o.finished], "finished")
eng.log_step(batch)
"""),
("md", r"""
Steps 4 and 6 came back empty: `sampled {}` and `emit: []`. Why? *Admit* starts a waiting request only while
three things are free: a seat (`max_num_seqs`), token budget for its first chunk, and KV blocks for the rest of its
prompt, which it sets aside on admission (`Scheduler.admit`). A request that does not fit waits its turn. Here the
budget ran out first: A, first in line, took the whole 16-token budget as a prefill chunk, so B and C were not
admitted yet. And A's prompt has 20 tokens: after 16 of them there is nothing to sample, because a request's first
output token comes from the step that runs its *last* prompt token. So the executor sampled nothing, and *emit* had
nothing to send.

When *emit* does send something here, it is token ids: the simulated executor has no vocabulary. On the real model,
*emit* also turns them into text, incrementally: a detokenizer per request that holds back bytes until they form
whole characters, so a stream never shows half a multi-byte character. `LLM.stream` hands you each step's output as
it is emitted — the same deltas the OpenAI-compatible server sends as server-sent events (lab 8):
"""),
("code", r"""
for out in llm.stream("The capital of France is", SamplingParams(max_tokens=6, temperature=0)):
    c = out.outputs[0]
    print(f"step emits token {c.delta_token_ids} -> text {c.delta_text!r}" + ("   (finished)" if out.finished else ""))
"""),
("md", r"""
Back to the small engine. Its next step (step 1 in the log, which counts from 0) finishes A's prefill (4 tokens) and
samples its first token in that same step — **the first output token comes from the prefill step** — while B and
C start. Watch the rest as a timeline of the step log, one step per click of **next step**: orange = prefill chunk
(number = tokens), blue = decode. The widget steps its own copy of this engine, built the same way and stepped
once, so nothing else in the notebook can run it ahead of you.
"""),
("code", r"""
PROMPT_LENS = {"A": 20, "B": 6, "C": 9}
timeline = widgets.Stepper(small_engine(), draw=lambda e, ax: widgets.draw_timeline(e.step_log, PROMPT_LENS, ax=ax),
                           describe=lambda e: widgets.describe_step(e.step_log[-1], PROMPT_LENS), figsize=(9, 1.8))
print(timeline.step(1))   # the widget's engine, at the point your `eng` is now
timeline.show()           # in Jupyter: click "next step"; elsewhere: this picture, static
"""),
("md", r"""
The same run without buttons: your `eng` from the seven steps above, to the end, and its whole timeline.
"""),
("code", r"""
while eng.has_unfinished_requests():
    eng.step()
    print(widgets.describe_step(eng.step_log[-1], PROMPT_LENS))
widgets.draw_timeline(eng.step_log, PROMPT_LENS, title="the whole run")
plt.show()
"""),
("md", r"""
## ✏️ Exercise 1 — prefill or decode?

Each entry of `engine.step_log` lists the sequences of a step as `(request_id, start, num_tokens)`: the request ran
`num_tokens` tokens starting at position `start`. Write `split_step(seqs, prompt_lens)` that returns
`(prefill_tokens, decode_tokens)` for one step. Careful: a chunked prefill can end with a 1-token chunk. And a
request that was preempted to free memory (lab 5 shows how) later computes its prompt *and the tokens it had
already generated* again, as prefill, in chunks when the budget is small: a chunk of many tokens can start past the
prompt. (One case `seqs` alone cannot settle: a one-token chunk of such a recompute looks exactly like a decode.
The engine's own record counts its decode rows, `entry["num_decodes"]`, for that reason; this exercise leaves that
case out.)

Try it without help first; open the hints one at a time.

<details><summary>Hint 1</summary>

Decide per sequence, then add up tokens, not sequences: one entry of `seqs` can carry many prefill tokens.
</details>
<details><summary>Hint 2</summary>

Start from *where* a sequence starts: is the token at `start` still part of the prompt, or an output token the model
sampled earlier? Then, for one that starts past the prompt: how many tokens does a decode step compute for its
request, and what else could many tokens past the prompt be?
</details>
<details><summary>Hint 3</summary>

Positions `0 .. prompt_len - 1` are the prompt. Watch the boundary: the step that runs the last prompt token is
still a prefill (it samples the first output token), and the next step starts exactly at `prompt_len`.
</details>
"""),
("code", r"""
def split_step(seqs: list[tuple[str, int, int]], prompt_lens: dict[str, int]) -> tuple[int, int]:
    '''(prefill tokens, decode tokens) in one step of the engine's step log.'''
    # TODO: return (prefill tokens, decode tokens) of this step -- see the hints above
    ### BEGIN SOLUTION
    prefill = decode = 0
    for request_id, start, num_tokens in seqs:
        if start >= prompt_lens[request_id] and num_tokens == 1:
            decode += num_tokens
        else:
            prefill += num_tokens
    return prefill, decode
    ### END SOLUTION
""", ["exercise:split_step"]),
("code", r"""
split_check = check_split_step(split_step)
# until yours passes: widgets.step_composition, what the timeline widget uses (minivllm/labs/widgets.py)
split = choose(split_check, split_step, widgets.step_composition, "split_step")
"""),
("md", r"""
With it, the composition of every step of a bigger run: 12 requests, budget 64 tokens. The first step is all
prefill; then decodes take a token each first and prefill chunks fill the rest of the budget (decode-first
scheduling), in bursts whenever a finished request frees a seat for a waiting prompt; at the end only decodes
remain and steps are small — the engine is memory-bound there.
"""),
("code", r"""
big = workloads.sim_engine(block_size=16, max_num_seqs=8, max_num_batched_tokens=64)
reqs = workloads.random_requests(12, seed=1, prompt_range=(20, 120), output_range=(5, 40))
finals = workloads.run_engine(big, reqs)
lens = {f"r{i}": len(p) for i, (p, _) in enumerate(reqs)}
parts = [split(e["seqs"], lens) for e in big.step_log]
steps = range(len(parts))
plt.figure(figsize=(9, 2.4))
plt.bar(steps, [p for p, _ in parts], color="#f28e2b", label="prefill tokens")
plt.bar(steps, [d for _, d in parts], bottom=[p for p, _ in parts], color="#4e79a7", label="decode tokens")
plt.xlabel("engine step"); plt.ylabel("tokens in step"); plt.legend(fontsize=8)
plt.show()
print(f"{len(parts)} steps, {sum(p for p, _ in parts)} prefill + {sum(d for _, d in parts)} decode tokens")
"""),
("md", r"""
### Latency, per request: TTFT and ITL

Every `RequestOutput` carries `metrics`: **TTFT** (time to first token: queueing + prefill) and **ITL**
(inter-token latencies: the gaps between decode steps, which grow when a step also carries prefill chunks).
"""),
("code", r"""
for rid in ("r0", "r5", "r11"):
    m = finals[rid].metrics
    print(f"{rid}: prompt {lens[rid]:3d} tokens, TTFT {m.ttft * 1000:6.1f} ms, {len(m.itls)} gaps")
"""),
("md", r"""
How should we summarise the gaps? A user does not feel the *mean* gap; they feel the stream freezing. So look at
the distribution of all gaps of all requests, and report **percentiles** (p50, p90, p99 by nearest rank: the
smallest gap such that at least q % of all gaps are at or below it) next to the mean. The engine's `nearest_rank`
computes them here; lab 4 has you write one. In this run the early decodes share their steps with
prefill chunks, and those gaps (the p90 and p99 below) are about two and a half times the typical gap (p50):
"""),
("code", r"""
from minivllm.metrics.stats import nearest_rank  # the engine's percentile (lab 4's exercise 2 is to write one)

gaps = [g for o in finals.values() for g in o.metrics.itls]
print(f"{len(gaps)} gaps: mean {sum(gaps) / len(gaps) * 1000:5.1f} ms | "
      + " | ".join(f"p{q} {nearest_rank(gaps, q) * 1000:5.1f} ms" for q in (50, 90, 99))
      + f" | worst {max(gaps) * 1000:5.1f} ms")
plt.figure(figsize=(7, 2.2))
plt.hist([g * 1000 for g in gaps], bins=40, color="#4e79a7")
for q, c in ((50, "#59a14f"), (99, "#d62728")):
    plt.axvline(nearest_rank(gaps, q) * 1000, color=c, ls="--", label=f"p{q}")
plt.xlabel("inter-token gap (ms)"); plt.ylabel("gaps"); plt.legend(fontsize=8)
plt.show()
"""),
("md", r"""
The mean sits between the typical gap and the slow ones and describes neither; the median says what most tokens
feel, p99 what the unlucky ones feel. The worst gap is one sample — report it, but set targets on a percentile
(lab 4 builds its chunking policy on exactly that).
"""),
("md", r"""
## 4. Static vs continuous batching

Before Orca (OSDI 2022), servers batched *requests*: take B requests, run them until the **last** one finishes, then
take the next B. A request that finishes early leaves its seat empty until then. **Continuous batching** (what the
step loop above does) admits a waiting request into any free seat at the next step.

![static vs continuous batching timelines, drawn from the engine's step log](../figures/step_timeline.png)

## ✏️ Exercise 2 — static batching as an admission policy

The engine asks its `AdmissionPolicy` every step: *in which order should I try the waiting requests?*
(`order(waiting, running) -> list`). Leaving a request out holds it back this step. Write `StaticBatching.order`
so that the engine runs batches the pre-Orca way described above. The engine's `max_num_seqs` caps the batch size.

<details><summary>Hint 1</summary>

What does static batching *forbid* that continuous batching allows? Say it as a sentence about when a waiting
request may start, before you write any code.
</details>
<details><summary>Hint 2</summary>

Which of the two arguments tells you whether that forbidden moment has come? `order` sees only `waiting` and
`running`; it does not admit anyone itself (the engine tries the requests you return, in that order), and it need
not count seats: `max_num_seqs` is the engine's business.
</details>
<details><summary>Hint 3</summary>

What must `order` return when nobody may start, and what when everybody waiting may try? The engine iterates over
the result, so the type is the same in both cases. Your rule has exactly two cases; the first-come-first-served
order of `waiting` is already the order you want.
</details>

If your policy leaves everyone out while nothing runs, the engine cannot move. It does not spin for ever: after 64
steps that compute nothing (on this simulated clock, which stands still on an empty step), it ends the stuck
requests with `finish_reason="error"`, and their output's `error` says why. The checker below then shows requests
that were never scheduled.
"""),
("code", r"""
class StaticBatching:
    '''Admit a new batch only when the previous one has completely finished.'''

    def order(self, waiting, running):
        # TODO: which waiting requests may the engine try to admit this step? -- see the hints above
        ### BEGIN SOLUTION
        return [] if running else list(waiting)
        ### END SOLUTION
""", ["exercise:static_batching"]),
("code", r"""
static_check = check_static_batching(StaticBatching)

# until yours passes: workloads.StaticBatchAdmission (minivllm/labs/workloads.py), which also draws the figure above
Static = choose(static_check, StaticBatching, workloads.StaticBatchAdmission, "static batching policy")
"""),
("md", r"""
Now the measurement: 32 requests with very different output lengths (4 to 128 tokens), at most 8 running. The
executor models a GPU: a step costs ~15 ms plus a little per token, so throughput grows with the batch.
"""),
("code", r"""
GPU_LIKE = workloads.GPU_LIKE  # the step cost labs 4 and 5 use too
print("step cost:", GPU_LIKE)
requests = workloads.random_requests(32, seed=5, prompt_range=(32, 256), output_range=(4, 128))


def run(policy, cost=GPU_LIKE):
    eng = workloads.sim_engine(max_num_seqs=8, max_num_batched_tokens=512, admission_policy=policy,
                               executor=SimulatedExecutor(**cost))
    finals = workloads.run_engine(eng, requests)
    ttft = sum(o.metrics.ttft for o in finals.values()) / len(finals)
    running = sum(e["running"] for e in eng.step_log) / len(eng.step_log)
    return eng, workloads.throughput(finals, eng), ttft, running


results = {}
for name, policy in [("static", Static()), ("continuous", FCFSAdmission())]:
    eng, tput, ttft, running = results[name] = run(policy)
    print(f"{name:10s}: {tput:7.1f} tokens/s   mean TTFT {ttft:6.2f} s   {running:4.1f} of 8 seats busy on average")
print(f"continuous batching: {results['continuous'][1] / results['static'][1]:.2f}x the throughput")

fig, axes = plt.subplots(2, 1, figsize=(11, 6))
for ax, name in zip(axes, results):
    lens = {f"r{i}": len(p) for i, (p, _) in enumerate(requests)}
    widgets.draw_timeline(results[name][0].step_log, lens, ax=ax, title=f"{name} batching", annotate=False)
    ax.tick_params(axis="y", labelsize=5)
fig.tight_layout()
plt.show()
"""),
("md", r"""
In the static timeline the seats empty out as short requests finish and stay empty until the longest one of the
batch is done (the staircase). Continuous batching refills them every step.

And with *your* machine's measured cost model (section 2) — on a CPU the per-token cost is large, so the gain is
smaller; on a GPU it is larger:
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (uses your wall-clock calibration)
for name, policy in [("static", Static()), ("continuous", FCFSAdmission())]:
    _, tput, ttft, _ = run(policy, calibrated)
    print(f"{name:10s}: {tput:7.1f} tokens/s (your machine's cost model), mean TTFT {ttft:6.2f} s")
"""),
("md", r"""
## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive (options in a fixed shuffled order); the plain-text
questions follow, and the answer key, with every *why*, is in a separate cell: run it once you have answered.
"""),
("code", r"""
show_quiz(1)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(1)
"""),
("code", r"""
print_answers(1)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* Why a prefill token is cheap and a lone decode token expensive on the same model (FLOPs per byte of weights
  read), and why batching decodes is almost free until the arithmetic units are busy — with your measured ratios.
* The seven steps of `LLMEngine.step()` in order, and which of them samples a request's first token (the step
  that prefills its last prompt token) and which frees its blocks (finish).
* How to read the step log: prefill chunk vs decode by the position a sequence starts at and the tokens it runs,
  why a 1-token chunk can still be prefill, and why a recomputed request's chunks past its prompt are too.
* TTFT vs ITL, and why ITL is reported as percentiles (p50/p99) with the worst gap, not as a mean.
* Why continuous batching beats static batching when output lengths differ (empty seats), and what the gain
  depends on (how much a step's cost grows with its batch).

## Go further

Static batching wastes seats; continuous batching can hurt the *running* requests instead: every admitted
newcomer's prefill lands in a step the decoders wait for. Write an `AdmissionPolicy` that admits at most one new
request per step (return at most one waiting request), run it next to `FCFSAdmission` on the 32 requests of
section 4, and compare throughput, mean TTFT and the p99 of all ITL gaps (with `nearest_rank`). Which metric
does each policy win, and why? Lab 4 gives the engine a better tool for the same problem: chunked prefill
under a token budget.
"""),
]
