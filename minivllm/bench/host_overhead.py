"""Host overhead per decode step: what the engine costs in Python when the model costs nothing.

On a GPU a decode step of a small model takes a few milliseconds, so whatever
the engine does on the host -- scheduling, building the batch's tensors,
turning sampled tokens into outputs -- *is* the step.  This benchmark runs the
real engine at ``--seqs`` decoding sequences, block size 16, with the simulated
executor (no model) wrapped so that every step also does the real executor's
batch preparation (:class:`~minivllm.model.runner.BatchPreparer`), and splits
each step's wall time into:

* **host** -- scheduler + output processing: ``engine.step()`` minus the two below
  (the figure to hold against nano-vllm's "scheduler + postprocess");
* **prep** -- batch preparation (``input_ids``, positions, slot mapping, block
  tables), incremental as the executor does it; the stateless reference
  :func:`~minivllm.model.runner.build_attention_metadata` is timed beside it;
* the simulated executor itself (a hash per sequence), reported, not counted.

Each is measured after the sequences have decoded ``--warmup`` tokens (plus the one their prefill sampled) and again
``--later`` steps on, so one sees whether the cost grows with output length (it
should not), for each output kind: ``final_only`` (what ``LLM.generate`` asks
for), ``delta`` (streaming), ``cumulative`` (every output carries the whole
text so far, so it grows with length by definition).  Medians of wall time and
of thread CPU time are both reported: CPU time is what to compare on a shared
machine, where wall time also counts waiting for a core.
nano-vllm's figures for the same step on this machine class, from issue 12:
scheduler + postprocess 250-370 us, decode preparation 3.0 ms at 256 sequences.

Measured on the 2-core CPU machine (``benchmarks/results/2026-11-30_cpu-2core_host_overhead.json``),
host CPU time per step at 16 / 482 tokens: ``final_only`` 166-176 / 184-190 us over
four runs (175 / 190 before the decode rows were built in the pass that finds
the decodes; 250 / 278 and 326 / 402 in earlier rounds), ``delta`` 517 / 559 us
(526 / 566; 640 / 688; 1,073 / 1,163), most of the difference being one ``RequestOutput`` (three
objects) per request per step.  What is left is a handful of short passes over
the batch -- split decodes from prefills (~17 us), build one row object per
decode (~35 us: making a Python object costs ~100 ns), find the rows that need
a block, append each sampled token, check stops, log the step -- at 15-45 us
each, bound by memory accesses (a few per request) as much as by bytecodes.
So the opcode count is a guide, not the cost: on CPython 3.11
``map(attrgetter(...))`` counts no opcodes yet is slower than a list
comprehension over slotted objects, and a slotted ``Request`` saves a memory
access per field read without changing the count.  A ``final_only`` step keeps no small
containers alive (the step log stores flat tuples), so Python's cyclic garbage collector,
which runs once enough of them accumulate, stays out of the step (one collection in 100
steps at 256 sequences); a ``delta`` or ``cumulative`` step makes three per request, past
the collector's 700, and sets it off about twice a step there.  The opcode
counts are the same early and late; the times still grow ~10% from 16 to 482
tokens, and ``--sweep`` shows why: most of it is one step where the integers a
step reads pass 256 and stop being CPython's shared small-int objects (see
:func:`sweep`), the rest about 1% per 100 tokens.

    python -m minivllm.bench host_overhead [--out results.json]
    python -m minivllm.bench host_overhead --sweep 16,100,200,300,600,900 [--prompt-len 300]
    python -m minivllm.bench host_overhead --backlog 16,500,2000 [--backlog-policy wfq|priority]   (admission beside a backlog)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from minivllm.argtypes import comma_list, nonnegative_int, output_file, positive_int, refuse_unread
from minivllm.bench.results import write_result
from minivllm.metrics.stats import nearest_rank

NANO_VLLM_STEP_US = (250, 370)
NANO_VLLM_PREP_US = 3000
KINDS = ("final_only", "delta", "cumulative")
# The defaults of the flags that only some modes read: None in the parser, so that one given where nothing reads it
# can be told apart and refused, and put in after that check.  (--samples and --out: every mode.)
DEFAULTS = dict(seqs=256, warmup=16, later=400, kinds=KINDS, prompt_len=64, prefix_cache="off",
                backlog_policy="three_class")


class _TimedExecutor:
    """The simulated executor plus the real executor's batch preparation, each timed (wall and CPU)."""

    def __init__(self, block_size: int) -> None:
        from minivllm.model.runner import BatchPreparer
        from minivllm.sim import SimulatedExecutor

        self.sim = SimulatedExecutor(vocab_size=32000)
        self.prep = BatchPreparer(block_size, "cpu")
        self.now = self.sim.now
        self.last = (0, 0, 0, 0)  # prep wall, prep cpu, executor wall, executor cpu (ns) of the newest step

    def execute(self, batch):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        if batch.seqs:
            self.prep.prepare(batch.seqs)
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        out = self.sim.execute(batch)
        w2, c2 = time.perf_counter_ns(), time.thread_time_ns()
        self.last = (w1 - w0, c1 - c0, w2 - w1, c2 - c1)
        return out


def _engine(seqs: int, max_tokens: int, output_kind: str, prompt_len: int = 64, prefix_cache: str = "off"):
    from minivllm import EngineConfig, LLMEngine, SamplingParams

    longest = prompt_len + max_tokens + 16
    cache = {} if prefix_cache == "off" else {"enable_prefix_caching": True, "prefix_cache": prefix_cache}
    cfg = EngineConfig(num_gpu_blocks_override=seqs * (-(-(prompt_len + max_tokens) // 16) + 1) + 64, block_size=16,
                       max_num_seqs=seqs, max_num_batched_tokens=max(2048, seqs), max_model_len=longest,
                       device="cpu", **cache)
    engine = LLMEngine(cfg, executor=_TimedExecutor(16), model_max_len=longest, eos_token_ids=set())
    for i in range(seqs):
        engine.add_request({"prompt_token_ids": [100 + (i * 7 + j) % 900 for j in range(prompt_len)]},
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=output_kind))
    return engine


def _prefill_all(engine) -> None:
    """Step until every request has its first token: from then on each step is all decodes."""
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()


def _time_steps(engine, n: int) -> dict[str, list[float]]:
    """Per step, in microseconds: host (step minus prep minus executor), prep and executor; wall and CPU."""
    rows: dict[str, list[float]] = {k: [] for k in ("host", "host_cpu", "prep", "prep_cpu", "exec", "exec_cpu")}
    ex = engine.executor
    for _ in range(n):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        engine.step()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        pw, pc, ew, ec = ex.last
        for key, value in (("host", w1 - w0 - pw - ew), ("host_cpu", c1 - c0 - pc - ec), ("prep", pw),
                           ("prep_cpu", pc), ("exec", ew), ("exec_cpu", ec)):
            rows[key].append(value / 1e3)
    return rows


def _count_opcodes(engine, steps: int = 16) -> int:
    """Python bytecodes executed per step (mean over ``steps``; 16 = one block boundary per sequence).

    A machine-independent measure: unlike times it does not move with the load
    of a shared machine, so "flat in output length" can be checked exactly.
    It counts the engine's Python work (and the simulated executor's), not C
    work such as a list copy.  The cycle collector stays off while counting: a collection inside a traced
    step would run finalizers of unrelated objects (an abandoned stream, say) and count their bytecodes.
    """
    import gc
    import sys

    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        if event == "opcode":
            count += 1
        return tracer

    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    sys.settrace(tracer)
    try:
        for _ in range(steps):
            engine.step()
    finally:
        sys.settrace(None)
        if was_enabled:
            gc.enable()
    return count // steps


def _time_reference_prep(engine, n: int) -> list[float]:
    """The stateless reference on the current decode batch (blocks allocated, as the executor sees it)."""
    from minivllm.model.runner import build_attention_metadata

    batch = engine.scheduler.allocate(engine.scheduler.build_batch())
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        build_attention_metadata(batch.seqs, 16, torch.device("cpu"))
        out.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def measure(seqs: int, warmup: int, later: int, samples: int, output_kind: str) -> dict:
    """One output kind's row: host, prep and executor cost per step at two output lengths, and opcodes per step.

    Why ``max_tokens`` has 96 tokens beyond the steps taken here (``warmup + later + 2 * (samples + 16)``): the
    first sequences decode while the last still prefill, so they are ahead; none may finish inside a measured step,
    or the late row would time fewer than ``seqs`` sequences.
    """
    engine = _engine(seqs, warmup + later + 2 * samples + 128, output_kind)
    _prefill_all(engine)
    for _ in range(warmup):
        engine.step()
    early, early_ref = _time_steps(engine, samples), _time_reference_prep(engine, max(5, samples // 5))
    ops_early = _count_opcodes(engine)
    for _ in range(later):
        engine.step()
    late, late_ref = _time_steps(engine, samples), _time_reference_prep(engine, max(5, samples // 5))
    ops_late = _count_opcodes(engine)
    med = lambda xs: round(statistics.median(xs), 1)  # noqa: E731
    p90 = lambda xs: round(nearest_rank(xs, 90), 1)  # noqa: E731 - the project's one percentile rule
    row = {"seqs": len(engine.scheduler.running), "output_kind": output_kind,
           # (+1: the prefill step samples each sequence's first token)
           "tokens_early": warmup + 1, "tokens_late": warmup + 1 + samples + 16 + later,
           "python_opcodes_per_step_early": ops_early, "python_opcodes_per_step_late": ops_late}
    for when, rows, ref in (("early", early, early_ref), ("late", late, late_ref)):
        for key, xs in rows.items():
            row[f"{key}_us_median_{when}"] = med(xs)
        row[f"host_us_p90_{when}"] = p90(rows["host"])
        row[f"reference_prep_us_median_{when}"] = med(ref)
    return row


def sweep(seqs: int, points: list[int], samples: int, output_kind: str = "final_only",
          prompt_len: int = 64, prefix_cache: str = "off") -> list[dict]:
    """Host cost per step at each output length in ``points``: where does it grow, and by how much?

    On the 2-core machine, with 64-token prompts, most of the rise is a step, not a slope: ~166 us
    up to 100 output tokens, ~183 us once the requests hold more than 256 tokens in all, 183-188 us
    from there to 900 output tokens (``*_host_overhead_sweep.json``).  With 300-token prompts the
    first figure is already 181-191 us, then 198-206 at 300 output tokens, 192-197 at 600 and
    198-225 at 900 (five runs, ``2026-12-05_*_sweep_prompt300.json`` the first; the 2026-11-30 file's
    197 at 900 was measured while sequences finished).  The step: CPython keeps one shared
    object for each integer from -5 to 256; a larger one -- ``len()`` of a 300-token list, a
    ``num_computed_tokens`` past 256, ``prompt + output`` -- is a fresh heap object each time it
    is computed, and reading it is one more memory access.  The step's code is the same at every
    length (its opcode count does not change); how many of the integers it touches pass 256 does.
    What remains after the step, about 1% per 100 tokens, is the requests' lists and integers
    spreading over more memory.

    Each row is labelled with the output length its measurement started at: a point less than
    ``samples`` above the one before has already been passed, and is measured where the previous
    measurement left off.
    """
    # The prompts are prefilled a budget at a time, and the first ones decode while the rest wait for theirs: by
    # the time the last has its first token the first are up to ``stagger`` tokens ahead (twice the prefill
    # steps: decodes share the budget).  Without that margin they finished inside the last row's measurement
    # (256 x 300-token prompts: 256 sequences at the start of the 900-token row, 99 at its end).
    stagger = 2 * -(-seqs * prompt_len // max(2048, seqs))
    engine = _engine(seqs, max(points) + samples + 16 + stagger, output_kind, prompt_len, prefix_cache)
    _prefill_all(engine)
    rows, done = [], 1
    for point in sorted(points):
        while done < point:
            engine.step()
            done += 1
        t = _time_steps(engine, samples)
        # ``done``, not ``point``: timing a point takes ``samples`` steps, so a point less than that above the one
        # before is already behind the sequences (asked 250, 270, 300 with 50 samples: measured 250, 300, 350)
        rows.append({"output_tokens": done, "total_tokens": done + prompt_len,
                     "host_cpu_us_median": round(statistics.median(t["host_cpu"]), 1),
                     "host_cpu_us_mean": round(statistics.fmean(t["host_cpu"]), 1),
                     "prep_cpu_us_median": round(statistics.median(t["prep_cpu"]), 1)})
        done += samples
    return rows


def backlog_engine(size: int, running: int = 32, policy: str = "three_class"):
    """:func:`backlog`'s engine two steps in: ``running`` requests decoding, as many as the cap (three_class: the
    batch tier's) or the pool (fcfs, wfq, priority) holds at 8 blocks each, with too few blocks left over for a
    waiting prompt's 7, each with 15 decode steps before its next block (so the running set, and the cap, stay as
    they are while it is measured), and ``size`` requests waiting.

    Why two steps: the first prefills as many 7-block prompts as fit; the second writes each one's first sampled
    token into an 8th block, so the cap or the pool preempts the excess (5 of 37).  Measured from the second step
    on, that preemption was counted as admission's work; and with 7 blocks spare under the cap (a pool of 405 for
    32, which ran 37) three_class admitted a fresh prompt every third step and preempted it the next.
    """
    from minivllm import EngineConfig, LLMEngine, SamplingParams
    from minivllm.config import TenantConfig

    held = running * 8 + 4  # ``running`` requests at 8 blocks each, and 4 spare: fewer than a prompt's 7
    if policy == "three_class":
        blocks = held * 4 // 3  # the batch tier may hold 75% of it: ``held`` (259 of 346 for 32), the rest stays free
        tenants, names = {"bulk": TenantConfig(priority_class="batch")}, ["bulk"]
    else:
        blocks = held
        tenants, names = {"a": TenantConfig(weight=1.0), "b": TenantConfig(weight=2.0)}, ["a", "b"]
    cfg = EngineConfig(num_gpu_blocks_override=blocks, block_size=16, max_num_seqs=running + size + 1,
                       max_num_batched_tokens=8192, max_model_len=1024, device="cpu",
                       scheduling_policy=policy, tenants=tenants)
    engine = LLMEngine(cfg, executor=_TimedExecutor(16), model_max_len=1024, eos_token_ids=set())
    params = SamplingParams(max_tokens=512, ignore_eos=True)
    for i in range(running + size):  # 112-token prompts: 7 blocks each, 8 from the first sampled token
        engine.add_request({"prompt_token_ids": [100 + (i * 7 + j) % 900 for j in range(112)]}, params,
                           tenant=names[i % len(names)])
    engine.step()  # prefill: the first requests start; the cap (or the pool) holds the rest back
    engine.step()  # each takes its 8th block; the cap (or the pool) preempts what it cannot hold
    return engine


def backlog(sizes: list[int], samples: int, running: int = 32, policy: str = "three_class") -> list[dict]:
    """Host cost per step beside a waiting backlog that cannot start: what admission pays per waiting request.

    ``three_class`` (the default): the worked three-class policy, batch requests decoding at the batch tier's KV
    cap (a pool sized for about ``running`` of them; ``interactive_kv_reserve``: agent and batch together hold at
    most 75%), and ``size`` more batch prompts waiting behind that cap -- lab 6's backlog of 1,800 prompts in
    small.  Admission walks the waiting queue every step; nothing can start, so the work it does per waiting
    request is pure overhead.  It remembers, per tenant, the smallest request that failed its caps in the pass
    and skips the tenant's requests needing as many blocks or more; once no waiting request of the tenant needs
    fewer (the scheduler keeps each waiting request's need, counted per tenant), it passes the tenant over whole,
    and once every tenant still waiting is passed over it stops walking
    (:meth:`~minivllm.sched.scheduler.Scheduler.admit`).  And the policy does not order the queue each step: it
    keeps its order as requests enter and leave (:class:`~minivllm.interfaces.KeepsOrder`).

    ``fcfs``, ``wfq`` and ``priority``: two tenants (weights 1 and 2) alternate, ``running`` requests fill the KV pool, and
    the backlog waits for blocks.  Admission stops at the first request (head of line is global), so what grows
    with the backlog is the policy's order: FCFS's copy of the queue (admission changes the queue while it walks
    the order; in C: no opcodes, only time), WFQ grouping the queue by tenant and merging it by counter, priority
    sorting it (in C as well), unless the policy kept it.

    Reported: opcodes and host CPU time per step, and their growth per waiting request against the smallest
    backlog.  On the 2-core machine: three_class 0.0 opcodes per waiting request per step; 12.5 (~0.2 us) when the
    policy re-sorted the queue every step, 70.6 (~1.1 us) with the memo alone, 155.0 before it; wfq none (-0.5 and -0.1), and 129.7
    before it kept its order, nor time since its order reads the live queues instead of copying them (at 100,000
    waiting: 396 -> 111 us a step, 107-110 us at 16; ``*_backlog_wfq_live_queues_ab.json``); priority 0.02 us a waiting request, 0.25 us when it sorted; fcfs 0.005 us, its copy
    of the queue (``*_host_overhead_backlog*.json``).
    """
    rows = []
    for size in sizes:
        engine = backlog_engine(size, running, policy)
        ops = _count_opcodes(engine, 8)
        t = _time_steps(backlog_engine(size, running, policy), min(samples, 14))
        rows.append({"policy": policy, "waiting": len(engine.scheduler.waiting),
                     "running": len(engine.scheduler.running),
                     "python_opcodes_per_step": ops,
                     "host_cpu_us_median": round(statistics.median(t["host_cpu"]), 1)})
    base = rows[0]  # the smallest backlog: the cap binds in every row, so the running set is the same
    for r in rows:
        extra = r["waiting"] - base["waiting"]
        r["opcodes_per_waiting_request"] = round((r["python_opcodes_per_step"] - base["python_opcodes_per_step"])
                                                 / extra, 1) if extra else None
        r["host_cpu_us_per_waiting_request"] = round((r["host_cpu_us_median"] - base["host_cpu_us_median"])
                                                     / extra, 3) if extra else None
    return rows


def _kind(text: str) -> str:
    """An output kind for ``--kinds``, checked here (a typo used to surface as a traceback from SamplingParams)."""
    if text not in KINDS:
        raise argparse.ArgumentTypeError(f"unknown output kind {text!r}; choose from {', '.join(KINDS)}")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench host_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=positive_int, default=None, help="sequences decoding (default 256; not with --backlog)")
    ap.add_argument("--warmup", type=nonnegative_int, default=None,
                    help="decode steps before the first measurement (default 16; not with --sweep or --backlog)")
    ap.add_argument("--later", type=positive_int, default=None,
                    help="decode steps between the two measurements (default 400; not with --sweep or --backlog)")
    ap.add_argument("--samples", type=positive_int, default=50)
    ap.add_argument("--kinds", type=comma_list(_kind), default=None,
                    help="output kinds to measure, comma-separated (default all three; not with --sweep or --backlog)")
    ap.add_argument("--out", type=output_file, default=None)
    ap.add_argument("--prompt-len", type=positive_int, default=None,
                    help="--sweep: prompt length of every request (default 64)")
    ap.add_argument("--prefix-cache", choices=("off", "radix", "hash"), default=None,
                    help="--sweep: with prefix caching (a decode's filled block is offered to the cache; default off)")
    instead = ap.add_mutually_exclusive_group()  # (given both, only the backlog ran, in silence)
    instead.add_argument("--sweep", type=comma_list(positive_int), default=None, metavar="N,N,...",
                         help="instead: final_only host cost at these output lengths (e.g. 16,150,250,300,600,900)")
    instead.add_argument("--backlog", type=comma_list(positive_int), default=None, metavar="N,N,...",
                         help="instead: host cost per step beside this many waiting requests (on a three_class cap, or "
                              "for KV blocks: --backlog-policy; e.g. 16,500,2000; the smallest is the baseline)")
    ap.add_argument("--backlog-policy", choices=("three_class", "fcfs", "wfq", "priority"), default=None,
                    help="--backlog: three_class (the default: the backlog waits on a cap), or fcfs, wfq or priority (it "
                         "waits for KV blocks)")
    args = ap.parse_args()
    if args.backlog:
        refuse_unread(ap, args, ("seqs", "warmup", "later", "kinds", "prompt_len", "prefix_cache"),
                      "with --backlog (its own requests, on --backlog-policy)")
    elif args.sweep:
        refuse_unread(ap, args, ("warmup", "later", "kinds", "backlog_policy"), "with --sweep (final_only, per length)")
    else:
        refuse_unread(ap, args, ("prompt_len", "prefix_cache", "backlog_policy"),
                      "without --sweep or --backlog (the output kinds' measurement)")
    for name, value in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    torch.set_num_threads(1)
    if args.backlog:
        rows = backlog(sorted(args.backlog), args.samples, policy=args.backlog_policy)
        print(f"host cost per step beside a capped backlog: three_class, {rows[0]['running']} batch requests "
              "decoding at the batch tier's KV cap, the rest waiting behind it; per step, CPU time in us"
              if args.backlog_policy == "three_class" else
              f"host cost per step beside a backlog: {args.backlog_policy}, two tenants, {rows[0]['running']} "
              "requests decoding in a "
              "full KV pool, the rest waiting for blocks; per step, CPU time in us")
        for r in rows:
            extra = "" if r["opcodes_per_waiting_request"] is None else (
                f"   +{r['opcodes_per_waiting_request']:.1f} opcodes, +{r['host_cpu_us_per_waiting_request']:.2f} us "
                "per waiting request")
            print(f"  {r['waiting']:6d} waiting: {r['python_opcodes_per_step']:8d} opcodes, host median "
                  f"{r['host_cpu_us_median']:8.1f}{extra}")
        if args.out:
            write_result(args.out, {"rows": rows}, "python -m minivllm.bench host_overhead")
            print(f"wrote {args.out}")
        return 0
    if args.sweep:
        rows = sweep(args.seqs, args.sweep, args.samples, prompt_len=args.prompt_len,
                     prefix_cache=args.prefix_cache)
        print(f"host overhead per decode step vs output length, {args.seqs} sequences ({args.prompt_len}-token prompts), "
              f"prefix cache {args.prefix_cache}, final_only, CPU time in us")
        for r in rows:
            print(f"  {r['output_tokens']:5d} output tokens ({r['total_tokens']:5d} in all): host median "
                  f"{r['host_cpu_us_median']:6.1f}, mean {r['host_cpu_us_mean']:6.1f}  prep {r['prep_cpu_us_median']:6.1f}")
        if args.out:
            write_result(args.out, {"rows": rows}, "python -m minivllm.bench host_overhead")
            print(f"wrote {args.out}")
        return 0
    rows = [measure(args.seqs, args.warmup, args.later, args.samples, kind) for kind in args.kinds]
    early, late = rows[0]["tokens_early"], rows[0]["tokens_late"]
    print(f"host overhead per decode step, {args.seqs} sequences, block 16, simulated executor (no model); "
          f"medians in us, wall (cpu)")
    print(f"{'outputs':<11} {'host @' + str(early):>15} {'host @' + str(late):>15} {'prep @' + str(early):>15} "
          f"{'prep @' + str(late):>15} {'ref prep @' + str(late):>12} {'sim exec':>9} {'opcodes/step early, late':>25}")
    for r in rows:
        cell = lambda k, w: f"{r[k + '_us_median_' + w]:.0f} ({r[k + '_cpu_us_median_' + w]:.0f})"  # noqa: E731
        ops = f"{r['python_opcodes_per_step_early']}, {r['python_opcodes_per_step_late']}"
        print(f"{r['output_kind']:<11} {cell('host', 'early'):>15} {cell('host', 'late'):>15} "
              f"{cell('prep', 'early'):>15} {cell('prep', 'late'):>15} {r['reference_prep_us_median_late']:>12.0f} "
              f"{r['exec_us_median_late']:>9.0f} {ops:>25}")
    print(f"nano-vllm, same step, this machine class (issue 12): scheduler+postprocess {NANO_VLLM_STEP_US[0]}-"
          f"{NANO_VLLM_STEP_US[1]} us, decode preparation {NANO_VLLM_PREP_US} us; target: half of those "
          f"(<= {NANO_VLLM_STEP_US[0] // 2}-{NANO_VLLM_STEP_US[1] // 2} us, <= {NANO_VLLM_PREP_US // 2} us)")
    if args.out:
        # nano-vllm's figures are quoted (issue 12), not measured by this run: the key says so in the file
        write_result(args.out, {"rows": rows, "nano_vllm_quoted_from_issue_12": {
            "step_us": NANO_VLLM_STEP_US, "prep_us": NANO_VLLM_PREP_US}}, "python -m minivllm.bench host_overhead")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
