CELLS = [
("md", r"""
# Lab 8 — Observability and serving

**Goals.** After this lab you can

1. build the operator's metric list — running and waiting requests, KV blocks used and free, preemptions, tokens,
   TTFT and ITL — from the engine's step log, and prove it matches the engine's own Prometheus numbers (✏️ exercise 1);
2. serve the model over the OpenAI API from this notebook, load-test it with an open-loop load generator, and read
   `/metrics` the way a dashboard does;
3. watch ITL, TTFT, queue depth and KV usage *while* load runs, and find the **knee** of the latency/rate curve;
4. write an alarm on a signal the way Prometheus does (`for: 2s`) and show that scaling on utilisation reacts
   later than scaling on queue depth, TTFT or cache pressure (✏️ exercise 2);
5. tune while watching preemptions, cache hit rate and latency percentiles *together*.

**Time:** about two minutes to run on a CPU laptop; 45–60 minutes to work through. Section 3 serves the bundled
SmolLM2-135M for real; every bigger measurement runs the real engine (scheduler, KV cache manager, preemption) on
a simulated forward pass with a virtual clock — the `SERVING_GPU` preset of `check_lab08.py`, an 8B-class model
on one datacenter GPU (12 ms per step + 30 µs per batched token + 0.3 µs per KV token read) with 512 KV blocks of 16
tokens — so a minute of GPU serving replays in a second, exactly and reproducibly. Exercises are marked ✏️; until
your checker passes, later cells use the engine's own rule.
"""),
("code", r"""
import asyncio

import httpx
import matplotlib.pyplot as plt
from prometheus_client.parser import text_string_to_metric_families

from minivllm import SamplingParams
from minivllm.bench import loadgen
from minivllm.labs import choose
from minivllm.labs.check_lab08 import (RAMP_RATES, SLO_ITL_S, SLO_TTFT_S,
                                       check_first_alarm, check_metrics_from_log, knee_sweep, lab_engine,
                                       knee_figure, knee_table, max_rate_meeting_slo, rate_at,
                                       reference_first_alarm)
from minivllm.labs.live import LiveLoad, ramp_arrivals, run_sim_load
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz
from minivllm.metrics.prometheus import EngineMetrics, metrics_from_step_log, observe_all

%matplotlib inline
"""
, ["setup"]),
("md", r"""
## 1. The picture: what the engine exposes, and where each number comes from

The seed lesson lists what a good engine shows its operators — and says what they are *for*: "not just dashboards.
They are inputs to autoscaling and admission control."

```
 metric                          where it lives in minivllm                 Prometheus series (vLLM's names)
 ──────────────────────────────  ─────────────────────────────────────────  ──────────────────────────────────────
 running / waiting requests      scheduler queues, after each step          vllm:num_requests_running / _waiting
 KV blocks used / free / cached  the block pool and the prefix cache        vllm:kv_cache_used_blocks / _free_ / _cached_
 prefix-cache hit rate           cache counters, in tokens                  rate(vllm:prefix_cache_hits_total)
                                                                             / rate(vllm:prefix_cache_queries_total)
 preemption / recompute counts   the scheduler                              vllm:num_preemptions_total{mode,tenant}
 TTFT and ITL histograms         the time each token came out of a step     vllm:time_to_first_token_seconds
                                                                             vllm:inter_token_latency_seconds
 per-tenant tokens and cost      per-tenant accounting                      vllm:generation_tokens_total{tenant}
```

Every one of these can be rebuilt from the **step log** — one record per engine step: its end time, the
`(request, start, tokens)` chunks it computed, who was preempted, free blocks, running and waiting. A *gauge*
(running, free blocks) is a reading at one moment; a *counter* (preemptions, tokens) only grows; a *histogram*
(TTFT, ITL) counts observations into buckets, so a dashboard can compute percentiles over any window. minivllm
uses vLLM's exact names and buckets, so a Grafana dashboard built for vLLM works against it unchanged.
**Cost per tenant** is two counters and a price list: a tenant that sent 3 M prompt tokens and received 1.2 M
generated tokens at $0.20 and $0.60 per million costs 3 x 0.20 + 1.2 x 0.60 = $1.32, read straight from
`vllm:prompt_tokens_total{tenant}` and `vllm:generation_tokens_total{tenant}`.

The one subtle part is **when a step produces a token**. A chunk of a prompt in chunked prefill (lab 4) produces
nothing; the chunk that completes the prompt samples the first token; each decode step samples one more. After a
recompute preemption (lab 5) the request prefills its prompt *and* its generated tokens again — and only the chunk
that reaches its last known token samples a new one. One rule covers all of it: a step samples a token for a
request exactly when, after the step, **every token the request knows about has been computed**.

## ✏️ Exercise 1 — the metric list, from the step log

Write `metrics_from_log(step_log, prompt_lens, arrivals, num_blocks)`. A record `rec` has `rec.time` (the end of the
step, on the engine's clock), `rec.seqs` (tuples `(request_id, start, n)`: the step computed positions
`start .. start + n - 1`), `rec.preempted` (request ids), `rec.free_blocks`, `rec.running`, `rec.waiting`.
`prompt_lens[rid]` is the prompt length, `arrivals[rid]` the arrival time. Return a dict:

* `"running"`, `"waiting"`, `"free_blocks"`: gauges, as of the last record; `"used_blocks"` = `num_blocks` minus
  free (this engine runs without a prefix cache, so nothing is cached). With no records: nothing running or
  waiting, every block free;
* `"preemptions"`: how many times a request was preempted, over the whole log;
* `"generation_tokens"`: how many tokens were sampled;
* `"ttft"`: `{request_id: seconds}` from arrival to the step that sampled its first token;
* `"itl"`: a list of every gap between two consecutive tokens of the same request.

The checker runs small workloads on the simulated engine with the engine's own Prometheus metrics attached and
compares your numbers with the series `GET /metrics` would serve: counters, gauges, and the count and sum of each
histogram.

<details><summary>Hint 1</summary>

Keep, per request, how many tokens it has generated so far and when its last token came out. A request "knows"
`prompt_lens[rid] + generated` tokens.
</details>
<details><summary>Hint 2</summary>

For a chunk `(rid, start, n)` the step has computed everything up to position `start + n - 1`. Compare `start + n`
with the number of tokens the request knows. A recompute after a preemption starts again at `start = 0` — your rule
needs no special case for it.
</details>
<details><summary>Hint 3</summary>

The first token of a request has a TTFT and no ITL; every later token has an ITL and no TTFT. A request with 5
tokens: 1 TTFT, 4 ITLs.
</details>
"""),
("code", r"""
def metrics_from_log(step_log, prompt_lens: dict, arrivals: dict, num_blocks: int) -> dict:
    '''Gauges from the last record; preemptions, sampled tokens, TTFT and ITL from all of them.'''
    # TODO: walk the records; for each chunk decide whether the step sampled a token for that request
    #   (it did when start + n reaches every token the request knows: prompt + generated so far);
    #   record TTFT for a request's first token, an ITL for every later one; count preemptions;
    #   read the gauges from the last record
    ### BEGIN SOLUTION
    generated: dict[str, int] = {}
    last: dict[str, float] = {}
    ttft: dict[str, float] = {}
    itl: list[float] = []
    preemptions = 0
    for rec in step_log:
        preemptions += len(rec.preempted)
        for rid, start, n in rec.seqs:
            if start + n == prompt_lens[rid] + generated.get(rid, 0):  # computed every known token: samples one
                generated[rid] = generated.get(rid, 0) + 1
                if rid in last:
                    itl.append(rec.time - last[rid])
                else:
                    ttft[rid] = rec.time - arrivals[rid]
                last[rid] = rec.time
    end = step_log[-1] if len(step_log) else None
    return {
        "running": end.running if end else 0,
        "waiting": end.waiting if end else 0,
        "used_blocks": num_blocks - end.free_blocks if end else 0,
        "free_blocks": end.free_blocks if end else num_blocks,
        "preemptions": preemptions,
        "generation_tokens": sum(generated.values()),
        "ttft": ttft,
        "itl": itl,
    }
    ### END SOLUTION
""", ["exercise:metrics_from_log"]),
("code", r"""
metrics_check = check_metrics_from_log(metrics_from_log)
log_metrics = choose(metrics_check, metrics_from_log, metrics_from_step_log, "metrics_from_log")
"""),
("md", r"""
The measurement: a burst of 40 requests on the simulated GPU with a KV pool too small for all of them, the engine's
Prometheus metrics attached (what the server does after every step). Stop halfway, then compare.
"""),
("code", r"""
engine = lab_engine(num_blocks=160)
prom = EngineMetrics("sim")
prompt_lens, arrivals = {}, {}
for a in ramp_arrivals([20], 2.0, seed=3):
    engine.add_request({"prompt_token_ids": [11] * a.prompt_len}, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
                       a.request_id, arrival_time=a.time)
    prompt_lens[a.request_id], arrivals[a.request_id] = a.prompt_len, a.time
engine.executor.clock = max(arrivals.values())  # everyone has arrived
for _ in range(250):
    observe_all(prom, engine, engine.step())

mine = log_metrics(engine.step_log, prompt_lens, arrivals, engine.stats()["num_blocks"])
scraped = {}
for family in text_string_to_metric_families(prom.render().decode()):
    for s in family.samples:
        scraped[s.name] = scraped.get(s.name, 0.0) + s.value
rows = [("running", mine["running"], "vllm:num_requests_running"),
        ("waiting", mine["waiting"], "vllm:num_requests_waiting"),
        ("KV blocks used", mine["used_blocks"], "vllm:kv_cache_used_blocks"),
        ("KV blocks free", mine["free_blocks"], "vllm:kv_cache_free_blocks"),
        ("preemptions", mine["preemptions"], "vllm:num_preemptions_total"),
        ("tokens generated", mine["generation_tokens"], "vllm:generation_tokens_total"),
        ("TTFT observations", len(mine["ttft"]), "vllm:time_to_first_token_seconds_count"),
        ("TTFT sum (s)", round(sum(mine["ttft"].values()), 4), "vllm:time_to_first_token_seconds_sum"),
        ("ITL observations", len(mine["itl"]), "vllm:inter_token_latency_seconds_count"),
        ("ITL sum (s)", round(sum(mine["itl"]), 4), "vllm:inter_token_latency_seconds_sum")]
print(f"{'metric':20s}{'from the step log':>18s}{'from /metrics':>15s}")
for name, value, series in rows:
    print(f"{name:20s}{value:18}{round(scraped[series], 4):15}")
"""),
("md", r"""
Every number agrees — the step log is enough to rebuild an operator's view, and the Prometheus series are just
that view, kept incrementally. Two things to notice: the gauges are a *snapshot* (the run is halfway, requests are
still waiting), and the preemptions column is not zero — a pool of 160 blocks is too small for this burst.

## 2. Serve the model, load-test it, read `/metrics`

Now the real thing: the bundled SmolLM2-135M behind the OpenAI-compatible server, in a background thread on a free
`127.0.0.1` port (`BackgroundServer`: the same app `minivllm serve` runs). Two API keys map to two tenants. The load
generator (`minivllm bench serve`) is open loop: requests are sent at their Poisson arrival times whether or not
earlier ones have finished — a closed loop (send the next when one finishes) would slow down with the server and
hide its queue. It speaks only the OpenAI API, so the same functions measure a vLLM or SGLang server.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings on a shared CPU)
from minivllm import LLM
from minivllm.server import BackgroundServer

llm = LLM(dtype="float32", max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8, enable_prefix_caching=True)
server = BackgroundServer(llm.engine, "smol", api_keys={"key-a": "alice", "key-b": "bob"})
print("serving on", server.base_url)

tenants = [loadgen.parse_tenant("name=alice,key=key-a,input=uniform:16:40,output=fixed:8,prefix=sys:24"),
           loadgen.parse_tenant("name=bob,key=key-b,input=uniform:16:40,output=fixed:8")]
plan = loadgen.plan_requests(tenants, 8, rate=2.0, seed=0)
# one request first, so alice's shared system prompt is in the prefix cache before the load arrives
warm = {"model": "smol", "prompt": loadgen.prefix_text("sys", 24, 0) + "\nhello", "max_tokens": 1}
warm_tokens = httpx.post(server.base_url + "/v1/completions", json=warm, headers={"Authorization": "Bearer key-a"},
                         timeout=120).json()["usage"]["completion_tokens"]
run = await loadgen.run_load(server.base_url, plan, tenants, "smol", progress=False, rate=2.0)
print(loadgen.format_table(loadgen.summarize(run, slo_ttft=2.0, slo_itl=0.5), "SLO: TTFT 2 s, ITL 0.5 s"))
"""),
("code", r"""
text = httpx.get(server.base_url + "/metrics", timeout=30).text
series = {}
for family in text_string_to_metric_families(text):
    for s in family.samples:
        key = (s.name, s.labels.get("tenant", ""))
        series[key] = series.get(key, 0.0) + s.value
served_tokens = {t: sum(r.output_tokens for r in run.results if r.tenant == t and r.outcome == "ok") for t in ("alice", "bob")}
served_tokens["alice"] += warm_tokens  # the warm-up request was alice's too
for tenant in ("alice", "bob"):
    print(f"{tenant:6s}: vllm:generation_tokens_total = {series[('vllm:generation_tokens_total', tenant)]:.0f}"
          f"   (the client counted {served_tokens[tenant]})")
hits, queries = series[("vllm:prefix_cache_hits_total", "")], series[("vllm:prefix_cache_queries_total", "")]
print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens were hits")
print("running now:", series[("vllm:num_requests_running", "")], "| KV blocks used now:", series[("vllm:kv_cache_used_blocks", "")])
server.stop()
llm.close()
"""),
("md", r"""
The server's counters agree with what the client received, per tenant — the `tenant` label comes from the API
key, never from the client, so a tenant cannot inflate someone else's bill. The hits come from alice's shared 24-word
system prompt, which the warm-up request put in the cache (only whole 16-token blocks are shared); bob's prompts
share nothing with hers, and could not reuse her blocks anyway: the tenant is the prefix-cache namespace.

Look at the table's latencies: on this CPU even 2 requests per second queue up — a 135M model on two cores is past
its knee almost at once. That is why the rest of the lab runs the engine on a simulated GPU.

## 3. ITL under load, live

`LiveLoad` runs open-loop load against the engine on its virtual clock and redraws four panels after every scrape:
the ITL histogram, TTFT percentiles, queue depth, and KV usage next to compute utilisation (tokens per step / the
step's token budget). The load ramps from 2 to 16 requests per second, 5 s per rate; prompts of 64–512 tokens,
outputs of 32–256. In Jupyter the picture updates while it runs; click *run again* to watch it.
"""),
("code", r"""
live = LiveLoad(lab_engine, ramp_arrivals(RAMP_RATES, 5.0, seed=1), every_s=1.0, redraw_every=8,
                itl_slo_ms=1000 * SLO_ITL_S, ttft_slo_s=SLO_TTFT_S,
                title="ramp 2 -> 16 req/s on SERVING_GPU (simulated), 512 KV blocks")
live.show()
"""),
("md", r"""
Read the panels from right to left. KV usage climbs with the load and hits 100 % around 8–10 requests/s; from then
on, arrivals wait (queue depth grows without bound) and TTFT climbs second by second. Meanwhile the ITL histogram
barely moves: the requests that *are* running decode at the same pace, because the batch cannot grow past what
the KV pool holds. Its thin tail (gaps of 100–400 ms) is the preempted requests: a recompute victim waits in the
queue and prefills again before its next token, and that wait is an inter-token gap for its client. And compute
utilisation never rises above about 20 %: this machine runs out of **memory**, not
compute, long before its arithmetic is busy.

## 4. The knee of the latency/rate curve

Now a flat load at each rate (20 s each, same machine) and the p99s against a stated SLO: **p99 TTFT ≤ 1 s and p99
ITL ≤ 50 ms**.
"""),
("code", r"""
sweep = knee_sweep()                  # {rate: p50/p99 TTFT and ITL, tokens/s, preemptions}
best = max_rate_meeting_slo(sweep)
print(knee_table(sweep, best))
knee_figure(sweep, best)              # the p99s against the rate: SLO lines dotted, the knee dashed
"""),
("md", r"""
Below the knee, latency is flat and throughput grows with the load. Past it, throughput flattens (about 1,100
tokens/s: what 512 blocks of KV can hold in flight) and TTFT grows by an order of magnitude within a couple of
requests per second: every extra request only lengthens the queue. Preemptions start right at the knee — the pool
is full. The ITL SLO is never the one that breaks here; on a compute-bound machine (bigger prefills in the batch,
lab 4) it can be. The knee is the number to size a deployment by: run each replica somewhat *below* it.

### The same sweep on a whole GPU

`SERVING_GPU` is a three-constant cost model with a small KV pool, chosen so memory binds and the lab stays
readable. What happens on a real deployment's shape? The cell below reruns the sweep — same arrivals, same engine,
same SLO — on the roofline simulator (`minivllm.labs.at_scale`): Llama-3-8B in bf16 on the H100 datasheet preset,
the KV pool sized the way vLLM sizes it (90 % of 80 GB minus the weights), vLLM's default 256 seats and 8,192-token
step budget.
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())
print(f"KV pool: {at_scale.pool_blocks():,} blocks of 16 tokens")
big = at_scale.knee_sweep()
big_best = max_rate_meeting_slo(big)
print(knee_table(big, big_best))
knee_figure(big, big_best)
"""),
("md", r"""
The knee moved about tenfold, and so did its cause. With hundreds of thousands of tokens of KV nothing is
ever preempted; what runs out is **seats and step time**. Every step reads all 16 GB of weights plus the KV of every
running request, so the more requests share a step, the longer the step: p99 ITL climbs with the load toward the
50 ms SLO. Past the knee, new requests wait for one of the 256 seats: p99 TTFT jumps from under 100 ms to over a
second within 10 requests/s, and one step further p99 ITL crosses its line too. Sizing by the knee works the same
way on both machines; what you must measure first is *which* resource the knee is made of.

## ✏️ Exercise 2 — an alarm on a signal

An autoscaler does not react to one scrape: Prometheus alert rules say `expr: signal > threshold` and `for: 2s` —
the condition must hold at every evaluation for that long before the alert fires. Write
`first_alarm(samples, signal, threshold, for_s)`: `samples` are scrapes in time order, each with `.time` and a value
per signal (`getattr(sample, signal)`); return the time of the first scrape at which the signal has been strictly
above `threshold` at *every* scrape since a scrape at least `for_s` seconds earlier (with `for_s = 0`: the first
scrape above), or `None` if it never fires. A value of NaN means "no data in that window" (no request got its first
token, say) and is not above anything.

<details><summary>Hint 1</summary>

Remember when the current run of "above" scrapes began; forget it at the first scrape that is not above.
</details>
<details><summary>Hint 2</summary>

`float("nan") > x` is `False` for every `x`; `not (nan <= x)` is `True`. Which one does "no data is not above" need?
</details>
"""),
("code", r"""
def first_alarm(samples, signal: str, threshold: float, for_s: float):
    '''The time of the first scrape at which signal > threshold has held at every scrape for for_s seconds.'''
    # TODO: walk the samples in order; track since when the signal has been above the threshold
    #   (a scrape that is not above resets it); fire as soon as it has held for for_s
    ### BEGIN SOLUTION
    since = None
    for s in samples:
        v = getattr(s, signal)
        if v > threshold:  # NaN (no data) is not above anything
            if since is None:
                since = s.time
            if s.time - since >= for_s:
                return s.time
        else:
            since = None
    return None
    ### END SOLUTION
""", ["exercise:first_alarm"]),
("code", r"""
alarm_check = check_first_alarm(first_alarm)
alarm = choose(alarm_check, first_alarm, reference_first_alarm, "first_alarm")
"""),
("md", r"""
### Which signal should an autoscaler watch?

The ramp of section 3 again (the widget kept its run), scraped every second. Each alarm needs its condition to hold for 2 s. "Utilisation"
comes in two flavours: **busy** (the fraction of time the device was running a step — what `nvidia-smi`'s
utilisation reports) and **compute utilisation** (tokens per step / the step's token budget — how much of the
device's arithmetic was used).
"""),
("code", r"""
ramp = live.result  # the ramp of section 3 (the same run as check_lab08.ramp_run())
ALARMS = [("queue depth > 4", "waiting", 4), ("TTFT p90 > 0.5 s", "ttft_p90", 0.5), ("KV usage > 90 %", "kv_usage", 0.9),
          ("busy > 95 %", "busy", 0.95), ("compute util > 80 %", "utilisation", 0.8),
          ("compute util > 50 %", "utilisation", 0.5)]
fired = {name: alarm(ramp.samples, sig, th, 2.0) for name, sig, th in ALARMS}
knee_t = next(s.time for s in ramp.samples if rate_at(s.time) > best)
print(f"the offered rate passes the knee ({best} req/s) at t = {knee_t:.0f} s")
for name, t in fired.items():
    when = "never" if t is None else f"t = {t:4.0f} s, offered {rate_at(t):2d} req/s"
    print(f"{name:22s} fires: {when}")

xs = [s.time for s in ramp.samples]
fig, ax = plt.subplots(figsize=(8, 3))
ax.plot(xs, [min(1, s.waiting / 40) for s in ramp.samples], color="#e15759", label="queue depth / 40")
ax.plot(xs, [s.kv_usage for s in ramp.samples], color="#b07aa1", label="KV usage")
ax.plot(xs, [min(1, s.ttft_p90 / 5) for s in ramp.samples], color="#f28e2b", label="TTFT p90 / 5 s")
ax.plot(xs, [s.busy for s in ramp.samples], color="#888888", ls="--", label="busy")
ax.plot(xs, [s.utilisation for s in ramp.samples], color="#9c755f", label="compute utilisation")
ax.axvline(knee_t, color="black", ls=":", lw=1, label="load passes the knee")
for name, sig, _ in ALARMS[:3]:
    if fired[name] is not None:
        ax.axvline(fired[name], color={"waiting": "#e15759", "ttft_p90": "#f28e2b", "kv_usage": "#b07aa1"}[sig], lw=0.8)
ax.set_xlabel("time (s, virtual)"); ax.set_ylim(0, 1.05); ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
fig.tight_layout()
plt.show()
"""),
("md", r"""
TTFT, KV usage and queue depth all fire a few seconds after the load passes the knee, while the offered load is
10–12 requests/s: a queue needs a little time to build, which is exactly what the `for:` clause waits for.
Utilisation is no help either way: **busy** is above 95 % from
the first seconds, when two requests per second are served comfortably (a continuous-batching engine always has a
decode to run), so an alarm on it is a false alarm that never clears; **compute utilisation** never reaches 50 %,
let alone 80 %, because memory runs out first — an autoscaler waiting for it waits forever while TTFT grows by a
second every few seconds. This is the seed lesson's warning: *if you scale on GPU utilization alone, you will be
late. Scale on queue depth, TTFT and cache pressure.* (Lab 5 added one more early signal: the reject rate of a
door that answers 429.)

## 5. Tune while watching everything at once

The last lesson of the course is about *how* to tune: on the client's workload, **watching preemption counts, cache
hit rate and latency percentiles together** — never one alone. One knob, the cache memory share, at the knee's
load (8 requests/s): more KV blocks, fewer preemptions — but read what happens to latency and throughput next to it.
The knobs of this course are the ones vLLM's *Optimization and Tuning* guide (docs.vllm.ai, "Optimization and
Tuning") walks through — preemption and the KV memory share (`gpu_memory_utilization`), the chunked-prefill token
budget (`max_num_batched_tokens`), the number of sequences per step (`max_num_seqs`) — with the same advice to read
the preemption counter while turning them; keep it open when you tune a real deployment.
"""),
("code", r"""
print(f"{'KV blocks':>9s}{'preempt':>8s}{'TTFT p50/p99 ms':>17s}{'ITL p50/p99 ms':>16s}{'tokens/s':>9s}")
for blocks in (384, 512, 768, 1024):
    s = run_sim_load(lab_engine(num_blocks=blocks), ramp_arrivals([8], 20, seed=1)).summary()
    print(f"{blocks:9d}{s['preemptions']:8d}{s['ttft_p50_ms']:8.0f} /{s['ttft_p99_ms']:6.0f}"
          f"{s['itl_p50_ms']:8.1f} /{s['itl_p99_ms']:5.1f}{s['tokens_per_s']:9.0f}")
"""),
("md", r"""
More cache takes away the preemptions and the TTFT tail at this load; past 768 blocks the working set fits and
more memory buys nothing. ITL moves both ways: the median rises a little (more requests decode together, more KV to
read per step) while the p99 falls (no recompute prefills landing in the batch). On a real GPU that memory also came from
somewhere: the activation workspace that sets the step's token budget. Any one column alone would have told a
different story; that is the point of reading them together, with the hit rate from `/metrics` next to them when
the workload shares prefixes.

## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive (options in a fixed shuffled order); the plain-text
questions follow, and the answer key, with every *why*, is in a separate cell: run it once you have answered.
The last two questions come from labs 4 and 5.
"""),
("code", r"""
show_quiz(8)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(8)
"""),
("code", r"""
print_answers(8)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* Where each metric of an operator's list comes from, and why gauges are snapshots, counters only grow and
  latencies are histograms (percentiles over any window, summed across replicas).
* When a step produces a token — the one rule that covers chunked prefill, decode and recompute after preemption —
  and why TTFT starts at arrival, not at first scheduling.
* How an OpenAI-compatible server maps API keys to tenants, why the tenant label can be trusted, and why a load
  generator must be open loop.
* What the knee of the latency/rate curve is, why TTFT (not ITL) breaks first on a memory-bound machine, and how to
  read a maximum rate under an SLO off a sweep.
* Why an alarm on utilisation is either always on (busy time) or never on (compute), and which signals react at the
  knee instead: cache pressure, queue depth, TTFT.
* Why tuning means reading preemptions, hit rate and latency percentiles together.

## Go further

* **Point the load generator at a real deployment.** `minivllm bench serve --base-url http://HOST:8000 --rates
  1,2,4,8 --slo-ttft-ms 1000 --slo-itl-ms 50 --figures out/` works unchanged against vLLM or SGLang: find their knee
  on your GPU and compare it with this lab's simulated one.
* **A TTFT you can trust from a histogram.** Prometheus computes percentiles from bucket counts
  (`histogram_quantile`). Compute the p99 TTFT of the ramp from the `vllm:time_to_first_token_seconds` buckets and
  compare it with the exact value: how far off is it at vLLM's bucket edges, and where?
* **Scale out, for real.** Turn an alarm into an action: when `first_alarm` fires on the ramp, add a second
  simulated replica (a second `lab_engine`, arrivals split round-robin from then on) and plot TTFT p90 with and
  without it. How much earlier must the alarm fire to keep p90 TTFT under the SLO?
"""),
]
