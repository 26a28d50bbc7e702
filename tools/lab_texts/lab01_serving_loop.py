CELLS = [
("md", r"""
# Lab 1 — The serving loop

**Goals.** After this lab you can

1. explain why *prefill* (the prompt) and *decode* (one new token) cost so differently, with numbers you measured on a real model;
2. name the seven steps of one engine iteration and watch them on a step timeline;
3. tell prefill chunks from decode tokens in the engine's step log (✏️ exercise 1);
4. implement static batching as an admission policy and measure why continuous batching beats it (✏️ exercise 2).

**Time:** about 1 minute to run on a CPU laptop; 30–60 minutes to work through. Later cells use the engine's own
code until your checker passes, so you can always run the whole notebook.
"""),
("code", r"""
import time

import matplotlib.pyplot as plt
import torch

from minivllm import LLM, SamplingParams
from minivllm.labs import choose, widgets, workloads
from minivllm.labs.check_lab01 import check_split_step, check_static_batching
from minivllm.labs.quiz import print_quiz, show_quiz
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
  KV) from memory to do a tiny amount of arithmetic — *memory-bound*. The cure is batching: 32 decodes in one step
  cost about as much as one.

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


engine.add_request({"prompt_token_ids": prompt[:32]}, SamplingParams(max_tokens=2, ignore_eos=True))
while engine.has_unfinished_requests():   # warm-up: the first calls pay one-off costs (on a GPU, kernel setup)
    engine.step()
engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True))
prefill_s = timed_step()                                  # PROMPT_LEN tokens in one pass
decode_1_s = min(timed_step() for _ in range(3))          # 1 token per pass
for i in range(BATCH):
    engine.add_request({"prompt_token_ids": prompt[i * 8:i * 8 + 16]}, SamplingParams(max_tokens=4, ignore_eos=True))
timed_step()                                              # their (short) prefills
decode_b_s = min(timed_step() for _ in range(2))          # BATCH decodes in one pass
while engine.has_unfinished_requests():
    engine.step()

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
Why? Count bytes. SmolLM2-135M has ~135 M parameters, 540 MB in fp32. A decode step of one request reads all of
them to compute one token: ~2 floating-point operations per parameter per byte-pair read — far below what a CPU
or GPU can do per byte of memory bandwidth. A prefill of 256 tokens reads the weights once and reuses each 256
times. Batching decodes is the same trick: one read of the weights, many tokens.

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

`LLMEngine.step()` is seven lines (`minivllm/engine.py`). Below we run those seven lines by hand on a small engine
(a simulated forward pass, so it is instant and every number is reproducible): three requests, a budget of 16
tokens per step, so the longest prompt is **chunked** over several steps.
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
A, first in line, took the whole 16-token budget as a prefill chunk, so B and C were not admitted yet (no
budget left), and nothing was sampled: A's prompt is not finished. Step 1 below finishes A's prefill (4 tokens) and
samples its first token in that same step — **the first output token comes from the prefill step** — while B and
C start. Now let the engine run the rest, and draw the step log as a timeline: orange = prefill chunk (number = tokens), blue = decode.
"""),
("code", r"""
PROMPT_LENS = {"A": 20, "B": 6, "C": 9}
stepper = widgets.Stepper(eng, draw=lambda e, ax: widgets.draw_timeline(e.step_log, PROMPT_LENS, ax=ax),
                          describe=lambda e: widgets.describe_step(e.step_log[-1], PROMPT_LENS), figsize=(9, 1.8))
print(stepper.step(10_000))
stepper.show()
"""),
("md", r"""
## ✏️ Exercise 1 — prefill or decode?

Each entry of `engine.step_log` lists the sequences of a step as `(request_id, start, num_tokens)`: the request ran
`num_tokens` tokens starting at position `start`. Write `split_step(seqs, prompt_lens)` that returns
`(prefill_tokens, decode_tokens)` for one step. A sequence is decode when the token at `start` is an *output*
token, i.e. `start >= prompt_len`. Careful: a chunked prefill can end with a 1-token chunk.
"""),
("code", r"""
def split_step(seqs: list[tuple[str, int, int]], prompt_lens: dict[str, int]) -> tuple[int, int]:
    '''(prefill tokens, decode tokens) in one step of the engine's step log.'''
    # TODO: add num_tokens to the prefill count when start < prompt_lens[request_id],
    #   else to the decode count
    ### BEGIN SOLUTION
    prefill = decode = 0
    for request_id, start, num_tokens in seqs:
        if start >= prompt_lens[request_id]:
            decode += num_tokens
        else:
            prefill += num_tokens
    return prefill, decode
    ### END SOLUTION
""", ["exercise:split_step"]),
("code", r"""
split_check = check_split_step(split_step)
split = choose(split_check, split_step, lambda seqs, lens: (
    sum(n for r, s, n in seqs if s < lens[r]), sum(n for r, s, n in seqs if s >= lens[r])), "split_step")
"""),
("md", r"""
With it, the composition of every step of a bigger run: 12 requests, budget 64 tokens. Early steps are all
prefill; then decodes take a token each first and prefill chunks fill the rest of the budget (decode-first
scheduling); at the end only decodes remain and steps are small — the engine is memory-bound there.
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
    print(f"{rid}: prompt {lens[rid]:3d} tokens, TTFT {m.ttft * 1000:6.1f} ms, "
          f"mean ITL {sum(m.itls) / len(m.itls) * 1000:5.1f} ms, max ITL {max(m.itls) * 1000:5.1f} ms")
"""),
("md", r"""
## 4. Static vs continuous batching

Before Orca (OSDI 2022), servers batched *requests*: take B requests, run them until the **last** one finishes, then
take the next B. A request that finishes early leaves its seat empty until then. **Continuous batching** (what the
step loop above does) admits a waiting request into any free seat at the next step.

![static vs continuous batching timelines, drawn from the engine's step log](../figures/step_timeline.png)

## ✏️ Exercise 2 — static batching as an admission policy

The engine asks its `AdmissionPolicy` every step: *in which order should I try the waiting requests?*
(`order(waiting, running) -> list`). Leaving a request out holds it back this step. Static batching is then one
rule: admit only when nothing is running. The engine's `max_num_seqs` caps the batch size.
"""),
("code", r"""
class StaticBatching:
    '''Admit a new batch only when the previous one has completely finished.'''

    def order(self, waiting, running):
        # TODO: return the waiting requests in queue order when nothing runs, else an empty list
        ### BEGIN SOLUTION
        return [] if running else list(waiting)
        ### END SOLUTION
""", ["exercise:static_batching"]),
("code", r"""
static_check = check_static_batching(StaticBatching)


class _Static:  # the engine-side fallback: the same rule
    def order(self, waiting, running):
        return [] if running else list(waiting)


Static = choose(static_check, StaticBatching, _Static, "static batching policy")
"""),
("md", r"""
Now the measurement: 32 requests with very different output lengths (4 to 128 tokens), at most 8 running. The
executor models a GPU: a step costs ~15 ms plus a little per token, so throughput grows with the batch.
"""),
("code", r"""
GPU_LIKE = dict(fixed_overhead_s=0.015, per_token_s=0.00002, per_context_token_s=0.0)
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

Answer from memory first. In Jupyter the quiz is interactive; the plain-text version with every *why* follows.
"""),
("code", r"""
show_quiz(1)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(1)
"""),
]
