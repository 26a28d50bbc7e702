CELLS = [
("md", r"""
# Lab 8 — Observability and serving

**Goals.** After this lab you can

1. build the operator's metric list — running and waiting requests, KV blocks used and free, preemptions, tokens,
   TTFT and ITL — from the engine's step log, and prove it matches the engine's own Prometheus numbers (✏️ exercise 1);
2. serve the model over the OpenAI API from this notebook, load-test it with an open-loop load generator, read
   `/metrics` the way a dashboard does, and turn its per-tenant and per-model token counters into a bill;
3. watch ITL, TTFT, queue depth and KV usage *while* load runs, and find the **knee** of the latency/rate curve;
4. write an alarm on a signal the way Prometheus does (`for: 2s`) and show why utilisation cannot drive scaling
   — *busy* time is on almost from the start, *compute* utilisation never nears its peak — while queue depth, TTFT
   and cache pressure fire once the load passes the knee (✏️ exercise 2);
5. tune while watching preemptions, cache hit rate and latency percentiles *together*.

**Time:** 23 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 45–60 minutes to work through. Section 2 serves the
bundled SmolLM2-135M for real; every bigger measurement runs the real engine (scheduler, KV cache manager, preemption) on
a simulated forward pass with a virtual clock — the `SERVING_GPU` preset of `check_lab08.py`, an 8B-class model
on one datacenter GPU (12 ms per step + 30 µs per batched token + 0.3 µs per KV token read) with 512 KV blocks of 16
tokens — so a minute of GPU serving replays in a second, exactly and reproducibly. Exercises are marked ✏️; until
your checker passes, later cells use the engine's own rule.
"""),
("code", r"""
import asyncio
import time

import httpx
import matplotlib.pyplot as plt

from minivllm import SamplingParams
from minivllm.bench import loadgen
from minivllm.labs import choose
from minivllm.labs import check_lab08 as lab8
from minivllm.labs.check_lab08 import (RAMP_RATES, SLO_ITL_S, SLO_TTFT_S,
                                       check_first_alarm, check_metrics_from_log, knee_sweep, lab_engine,
                                       knee_figure, knee_table, max_rate_meeting_slo, rate_at,
                                       reference_first_alarm)
from minivllm.labs.live import LiveLoad, ramp_arrivals
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz
from minivllm.metrics.prometheus import EngineMetrics, metrics_from_step_log, observe_all
from minivllm.metrics.scrape import label_values, metric_samples, metric_value

%matplotlib inline
"""
, ["setup"]),
("md", r"""
## 1. The picture: what the engine exposes, and where each number comes from

Lesson 06 — the serving lesson this course is built on, whose claims every lab measures — lists what a good engine
shows its operators, and says what they are *for*: "not just dashboards. They are inputs to autoscaling and
admission control."

```
 metric                          where it lives in minivllm                 Prometheus series (* = not in vLLM)
 ──────────────────────────────  ─────────────────────────────────────────  ──────────────────────────────────────
 running / waiting requests      scheduler queues, after each step          vllm:num_requests_running / _waiting
 KV usage; blocks used / free /  the block pool and the prefix cache        vllm:kv_cache_usage_perc
   cached                                                                   *vllm:kv_cache_used_blocks / _free_ / _cached_
 prefix-cache hit rate           cache counters, in tokens                  rate(vllm:prefix_cache_hits_total)
                                                                             / rate(vllm:prefix_cache_queries_total)
 preemption / recompute counts   the scheduler                              vllm:num_preemptions_total{*mode,*tenant}
                                                                            *vllm:num_recomputed_tokens_total
 TTFT and ITL histograms         the time each token came out of a step     vllm:time_to_first_token_seconds
                                                                             vllm:inter_token_latency_seconds
 per-tenant tokens and cost      per-tenant accounting                      vllm:generation_tokens_total{*tenant}
```

Every one of these can be rebuilt from the **step log** — one record per engine step: its end time, the
`(request, start, tokens)` chunks it computed, who was preempted, free and available blocks, running and waiting.
A *gauge* (running, free blocks) is a reading at one moment; a *counter* (preemptions, tokens) only grows; a *histogram*
(TTFT, ITL) counts observations into buckets, so a dashboard can compute percentiles over any window. Every series
vLLM has keeps vLLM's exact name and buckets here, so a Grafana dashboard built for vLLM works against it unchanged;
what vLLM lacks (the `*` rows and labels: block counts, the preemption mode, the tenant) keeps the `vllm:` prefix,
so one selector finds it all.
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
`start .. start + n - 1`), `rec.preempted` (request ids), `rec.free_blocks` (the free list), `rec.available_blocks`
(free plus the cached blocks an allocation could evict), `rec.running`, `rec.waiting`.
`prompt_lens[rid]` is the prompt length, `arrivals[rid]` the arrival time. Return a dict:

* `"running"`, `"waiting"`, `"free_blocks"`: gauges, as of the last record; `"used_blocks"` = `num_blocks` minus
  the *available* blocks (with a prefix cache on, a finished request's cached blocks are neither free nor used:
  the engine evicts them the moment it needs room). With no records: nothing running or waiting, every block free;
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
    #   (the one rule above -- see the hints); record TTFT for a request's first token, an ITL for every
    #   later one; count preemptions; read the gauges from the last record
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
        "used_blocks": num_blocks - end.available_blocks if end else 0,
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
The measurement: a burst of 35 requests (20 a second for 2 s) on the simulated GPU with a KV pool too small for
all of them, the engine's Prometheus metrics attached (what the server does after every step). Stop after 250 steps
(about a quarter of the run: 16 of the 35 requests have their first token), then compare.
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
scraped = metric_samples(prom.render().decode())   # {(series, labels): value}, prometheus_client's parser
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
    print(f"{name:20s}{value:18}{round(metric_value(scraped, series), 4):15}")
"""),
("md", r"""
Every number agrees — the step log is enough to rebuild an operator's view, and the Prometheus series are just
that view, kept incrementally. Two things to notice: the gauges are a *snapshot* (the run is a quarter done,
requests are still waiting), and the preemptions column is not zero — a pool of 160 blocks is too small for this burst.

That engine caches no prefixes, so every block is either free or held by a request. With prefix caching on (lab 3)
there is a third kind: **cached** blocks, which hold KV of finished requests that no running request uses. They
are not free (their KV is kept for the next hit) and not used (the allocator evicts them the moment it needs
room). vLLM's `kv_cache_usage_perc` counts them as free, and so does this engine: free + used + evictable cached
= the pool. The same burst, with the cache on, after the last request finished:
"""),
("code", r"""
cached_engine = lab_engine(num_blocks=160, enable_prefix_caching=True)
cached_prom = EngineMetrics("sim")
for a in ramp_arrivals([20], 2.0, seed=3):
    cached_engine.add_request({"prompt_token_ids": [11] * a.prompt_len},
                              SamplingParams(max_tokens=a.max_tokens, ignore_eos=True), a.request_id, arrival_time=a.time)
while cached_engine.has_unfinished_requests():
    observe_all(cached_prom, cached_engine, cached_engine.step())
st = cached_engine.stats()
gauges = metric_samples(cached_prom.render().decode())
evictable = st["available_blocks"] - st["free_blocks"]
print(f"free list {st['free_blocks']} + used {st['used_blocks']} + evictable cached {evictable} = {st['num_blocks']} "
      f"blocks ({st['cached_blocks']} cached in all)")
print(f"/metrics: kv_cache_free_blocks {metric_value(gauges, 'vllm:kv_cache_free_blocks'):.0f}, "
      f"kv_cache_used_blocks {metric_value(gauges, 'vllm:kv_cache_used_blocks'):.0f}, "
      f"kv_cache_cached_blocks {metric_value(gauges, 'vllm:kv_cache_cached_blocks'):.0f}, "
      f"kv_cache_usage_perc {metric_value(gauges, 'vllm:kv_cache_usage_perc'):.2f}")
"""),
("md", r"""
The finished requests' full blocks (their shared prompt blocks once, each one's own output blocks) stay cached until
the pool needs the room: idle, the engine reports a usage of 0 while nearly all of its pool holds cached KV. Read `kv_cache_usage_perc`
as "memory requests are holding", and the cached-blocks gauge as the cache's size; an alarm on usage (section 4)
then fires on pressure from running work, not on a warm cache.

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
t_start = time.perf_counter()          # the billing window: from the warm-up to the last response
warm_usage = httpx.post(server.base_url + "/v1/completions", json=warm, headers={"Authorization": "Bearer key-a"},
                        timeout=120).json()["usage"]
run = await loadgen.run_load(server.base_url, plan, tenants, "smol", progress=False, rate=2.0)
window_s = time.perf_counter() - t_start
print(loadgen.format_table(loadgen.summarize(run, slo_ttft=2.0, slo_itl=0.5), "SLO: TTFT 2 s, ITL 0.5 s"))
"""),
("code", r"""
samples = metric_samples(httpx.get(server.base_url + "/metrics", timeout=30).text)
ok = [r for r in run.results if r.outcome == "ok"]
client = {t: {"prompt": sum(r.prompt_tokens for r in ok if r.tenant == t),   # the usage fields the client received
              "generation": sum(r.output_tokens for r in ok if r.tenant == t)} for t in ("alice", "bob")}
client["alice"]["prompt"] += warm_usage["prompt_tokens"]          # the warm-up request was alice's too
client["alice"]["generation"] += warm_usage["completion_tokens"]
for tenant in ("alice", "bob"):
    print(f"{tenant:6s}: vllm:generation_tokens_total = {metric_value(samples, 'vllm:generation_tokens_total', tenant=tenant):.0f}"
          f" (the client counted {client[tenant]['generation']}), vllm:prompt_tokens_total = "
          f"{metric_value(samples, 'vllm:prompt_tokens_total', tenant=tenant):.0f} (client: {client[tenant]['prompt']})")
hits, queries = metric_value(samples, "vllm:prefix_cache_hits_total"), metric_value(samples, "vllm:prefix_cache_queries_total")
print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens were hits")
print("running now:", metric_value(samples, "vllm:num_requests_running"),
      "| KV blocks used now:", metric_value(samples, "vllm:kv_cache_used_blocks"))
"""),
("md", r"""
The server's counters agree with what the client received, per tenant — the `tenant` label comes from the API
key, never from the client, so a tenant cannot inflate someone else's bill. The hits come from alice's shared 24-word
system prompt, which the warm-up request put in the cache (only whole 16-token blocks are shared); bob's prompts
share nothing with hers, and could not reuse her blocks anyway: the tenant is the prefix-cache namespace.

Look at the table's latencies: a decode step takes tens of milliseconds on this CPU (the ITL p50), so even this
light load of 2 requests/s gives TTFTs of a few steps, and eight requests are far too few to find where the queue
starts to grow — a sweep of rates on the real model would take many minutes per point. That is why the rest of the
lab runs the engine on a simulated GPU.

### Tokens per tenant and per model, and what they cost

The operator's last question is who pays. The machine is rented by the hour whether it is busy or idle, so the bill
of a window is fixed — price x hours — and the only question is how to split it:

```
 /metrics (counters, per tenant)                  a price and a rule                                the result
 vllm:prompt_tokens_total{model_name,tenant}     ─┐ window cost = GPU_HOUR_USD x hours of the window  bill per tenant
 vllm:generation_tokens_total{model_name,tenant} ─┘ usage(t) = prompt(t) + DECODE_WEIGHT x gen(t)  ─► $ per 1M tokens
                                                    bill(t) = window cost x usage(t) / all usage
```

**The price.** `GPU_HOUR_USD` = $3.00 for one on-demand H100 GPU-hour is an **assumed** price, not a measured or
quoted one: GPU-hour prices differ by provider and by contract and change over time. It is only an input to the
arithmetic: the cells below compute with `gpu_hour_usd`, set from it in the next cell, so put in the price you pay.
Every dollar below scales with it; the shares do not depend on it.

**The attribution rule: weighted tokens.** A tenant's usage is its prompt tokens plus `DECODE_WEIGHT` = 4 times its
generated tokens. Why this rule: (1) it is read from two counters every scrape already has — no step log, no
engine internals; (2) a tenant can audit its bill from the `usage` fields of its own responses (the cell above just
did); (3) it follows engine time: a prompt token is computed with hundreds of others in one step, while every
generated token needs a step of its own that reads the weights and the request's whole KV again, which is also
why hosted APIs charge more per output token than per prompt token (the roofline's own ratio is computed below).
Plain tokens (weight 1) undercharge long answers;
**KV-block-seconds** (blocks held x time) charge what is scarce when *memory* binds — the right rule on the
`SERVING_GPU` machine of sections 3–4 — but need the step log, and no client can check them. The price uses the
window's wall time, so the idle seconds of the window are billed too, split the same way.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (a wall-clock window on a shared CPU)
tokens = lab8.tenant_tokens(samples)                  # {tenant: {"prompt", "generation"}}, read from /metrics
usage = lab8.weighted_tokens(tokens)                  # the rule: prompt + DECODE_WEIGHT x generated
gpu_hour_usd = lab8.GPU_HOUR_USD                      # the assumed price (see above): put in yours
total_usd = lab8.window_usd(window_s, gpu_hour_usd=gpu_hour_usd)  # one GPU for the window, busy or idle
bills = lab8.attribute(usage, total_usd)
print(f"window {window_s:.1f} s (wall clock) at ${gpu_hour_usd:.2f} per GPU-hour: ${total_usd:.5f}")
print(f"{'tenant':8s}{'prompt':>8s}{'generated':>10s}{'tokens/s':>9s}{'share':>7s}{'bill $':>10s}")
for t, v in tokens.items():
    print(f"{t:8s}{v['prompt']:8.0f}{v['generation']:10.0f}{(v['prompt'] + v['generation']) / window_s:9.1f}"
          f"{usage[t] / sum(usage.values()):7.1%}{bills[t]:10.5f}")
print("model names on the page:", label_values(samples, "vllm:generation_tokens_total", "model_name"))
for model, v in lab8.model_tokens(samples).items():  # PromQL: sum by (model_name)
    every = v["prompt"] + v["generation"]
    print(f"model {model!r}: {every / window_s:.1f} tokens/s ({v['generation'] / window_s:.1f} generated) -> "
          f"${lab8.usd_per_million(every, window_s, gpu_hour_usd=gpu_hour_usd):,.0f} per 1M tokens, "
          f"${lab8.usd_per_million(v['generation'], window_s, gpu_hour_usd=gpu_hour_usd):,.0f} per 1M generated tokens")
server.stop()
llm.close()
"""),
("md", r"""
The split is exact (the bills add up to the window's price, and alice pays for the warm-up she sent), but the dollars
per million tokens are absurd: the whole window is paid at an H100's price while two CPU cores serve a few dozen
tokens per second. The last line prints two prices: per million tokens of either kind (about $9 in the stored run;
the window is wall clock, so yours differs) and per million *generated* tokens (about $56: only about one token in
six was generated, and the same window's cost is spread over that sixth). Both are over a hundred times what the same
GPU-hour costs below. A real price needs a real machine's throughput — so here is the same bill on the simulated H100
preset (the roofline, as in section 4's whole-GPU sweep), with two tenants whose tokens look alike in a count but not
in a machine: **rag** sends long retrieved contexts (1,024–1,536 tokens) and reads short answers (16–64); **chat**
sends short questions (64–256) and reads long answers (256–512). 12 requests/s each, 10 s of arrivals, the engine's
own Prometheus series attached the way the server attaches them. Three rules side by side: plain tokens, the weighted
rule, KV-block-seconds.
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())
cost, cost_samples, cost_engine = lab8.cost_run()     # simulated: Llama-3-8B on the h100 preset, one GPU
tokens = lab8.tenant_tokens(cost_samples)
rules = {"tokens": lab8.weighted_tokens(tokens, 1.0),
         f"prompt+{lab8.DECODE_WEIGHT:g}x gen": lab8.weighted_tokens(tokens),
         "KV block-s": lab8.kv_block_seconds(cost_engine.step_log)}
hour_usd = lab8.window_usd(3600, gpu_hour_usd=gpu_hour_usd)  # shares of an hour of this traffic: bills in $/hour
print(f"window {cost.duration:.2f} s (virtual); {cost.summary()['preemptions']} preemptions")
print(f"{'tenant':7s}{'prompt':>8s}{'generated':>10s}{'tokens/s':>9s}" + "".join(f"{r:>17s}" for r in rules))
for t, v in tokens.items():
    cells = "".join(f"{lab8.attribute(u, hour_usd)[t]:>10.2f} $/h{u[t] / sum(u.values()):4.0%}" for u in rules.values())
    print(f"{t:7s}{v['prompt']:8.0f}{v['generation']:10.0f}{(v['prompt'] + v['generation']) / cost.duration:9.0f}{cells}")
every = sum(v["prompt"] + v["generation"] for v in tokens.values())
generated = sum(v["generation"] for v in tokens.values())
print(f"the GPU: ${lab8.usd_per_million(every, cost.duration, gpu_hour_usd=gpu_hour_usd):.3f} per 1M tokens, "
      f"${lab8.usd_per_million(generated, cost.duration, gpu_hour_usd=gpu_hour_usd):.3f} per 1M generated tokens")
print(f"roofline: a generated token costs {lab8.decode_weight(batch=64):.1f} prompt tokens in a step of 64 decodes, "
      f"{lab8.decode_weight(batch=256):.1f} in a step of 256")
""", ["covered-by-solution"]),
("md", r"""
Same machine, same hour, three bills. By plain tokens rag pays two thirds: it *sends* two thirds of the tokens.
The weighted rule turns that around (chat pays about 60 %): chat's tokens are generated ones, each a step of its
own. KV-block-seconds charge chat more still (over three quarters): its requests hold their KV for hundreds of decode
steps, rag's for a few dozen. Which rule is right depends on what binds: this H100 run has room to spare in
memory (no preemptions), so charging chat for KV-seconds nobody else wanted overbills it; on a pool that
preempts, KV is the scarce resource and the block-seconds rule is the fair one. The last line checks the weight
against the roofline: a generated token is worth about 9 prompt tokens at a batch of 64 and about 4 at 256 — the
ratio depends on the batch, so a price list fixes one number, and 4 is the full-batch end of it. And the price:
about 6 cents per million tokens (23 cents per million generated ones) on the simulated H100 — hundreds of times below the
CPU run's.

**Per model.** The `model_name` label is the same on every series of one server: its engines serve one model,
and extra names (`minivllm serve --served-model-name a b`) are aliases of that one engine whose series carry the
first name, as in vLLM. The label earns its keep in a **fleet**: every replica labels its series with its model,
Prometheus scrapes them all, and `sum by (model_name) (rate(vllm:generation_tokens_total[5m]))` is tokens/s per
model. Below: two replicas, each one simulated H100 on the roofline — Llama-3-8B taking 40 requests/s, Llama-3.2-1B
taking 15 (the lab's usual mix of lengths) — scraped and merged the way Prometheus stores them.
"""),
("code", r"""
fleet, fleet_runs = lab8.fleet_scrape()               # simulated: one h100 replica per model, merged scrapes
print(f"{'model_name':14s}{'req/s':>6s}{'tokens/s':>9s}{'generated/s':>12s}{'mean ITL ms':>12s}{'$/1M generated':>15s}")
for model, v in lab8.model_tokens(fleet).items():
    secs = fleet_runs[model].duration
    itl_ms = 1000 * (metric_value(fleet, "vllm:inter_token_latency_seconds_sum", model_name=model)
                     / metric_value(fleet, "vllm:inter_token_latency_seconds_count", model_name=model))
    print(f"{model:14s}{lab8.FLEET[model]:6g}{(v['prompt'] + v['generation']) / secs:9.0f}"
          f"{v['generation'] / secs:12.0f}{itl_ms:12.1f}{lab8.usd_per_million(v['generation'], secs, gpu_hour_usd=gpu_hour_usd):15.3f}")
""", ["covered-by-solution"]),
("md", r"""
Every number comes from the label: tokens/s and mean ITL per model, read from one merged page. The small model is
about three times faster per token and yet its generated tokens cost *more* — its replica receives less than
half the traffic and idles between steps, and an idle GPU-hour costs the same as a busy one. The cost of a token is
set by how full the machine is, not by the model alone: a reason to route traffic so every replica runs near (below)
its knee, and to read per-model throughput before buying another replica.

## 3. ITL under load, live

`LiveLoad` runs open-loop load against the engine on its virtual clock, scrapes it every virtual second and redraws
four panels every 16 scrapes (each picture is a PNG render, the cell's main cost): the ITL histogram, TTFT
percentiles, queue depth, and KV usage next to compute utilisation (tokens per step / the step's token budget).
The load ramps from 2 to 16 requests per second, 5 s per rate; prompts of 64–512 tokens, outputs of 32–256. In
Jupyter the picture updates while it runs; click *run again* to watch it.
"""),
("code", r"""
live = LiveLoad(lab_engine, ramp_arrivals(RAMP_RATES, 5.0, seed=1), every_s=1.0, redraw_every=16,
                itl_slo_ms=1000 * SLO_ITL_S, ttft_slo_s=SLO_TTFT_S,
                title="ramp 2 -> 16 req/s on SERVING_GPU (simulated), 512 KV blocks")
live.show()
"""),
("md", r"""
Read the panels from right to left. KV usage climbs with the load and hits 100 % around 8–10 requests/s; from then
on, arrivals wait (queue depth grows without bound) and TTFT climbs second by second. Meanwhile the ITL histogram
moves much less: the requests that *are* running decode at nearly the same pace, because the batch cannot grow past what
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
the KV pool sized the way vLLM sizes it (90 % of the 81,559 MiB the card reports, minus the weights), 256 seats
(`max_num_seqs`) and an 8,192-token step budget. `vllm serve` would give this card 1,024 seats (256 is its default
on smaller cards); the lab takes 256 because a seat limit that binds shows a second resource besides step time,
and because a 1,024-seat sweep takes the simulator longer. What changes with 1,024 seats is said below.
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())
print(f"KV pool: {at_scale.pool_blocks():,} blocks of 16 tokens")
big = at_scale.knee_sweep()
big_best = max_rate_meeting_slo(big)
print(knee_table(big, big_best))
knee_figure(big, big_best)
""", ["covered-by-solution"]),
("md", r"""
The knee moved about tenfold, and so did its cause. With hundreds of thousands of tokens of KV nothing is
ever preempted; what runs out is **seats and step time**. Every step reads all 16 GB of weights plus the KV of every
running request, so the more requests share a step, the longer the step: p99 ITL climbs with the load toward the
50 ms SLO. Past the knee, new requests wait for one of the 256 seats: p99 TTFT jumps from under 100 ms to over a
second within 10 requests/s, and one step further p99 ITL crosses its line too. With vLLM's 1,024 seats on this card
(`at_scale.knee_sweep(max_num_seqs=1024)`, not run here) the knee stays at 70 requests/s but the other SLO breaks
first: at 80 requests/s everyone gets a seat (p99 TTFT 130 ms) and the fuller steps push p99 ITL to 72 ms. The seat
limit decides *which* latency a client loses past the knee: their first token, or every token after it. Sizing by
the knee works the same way on both machines; what you must measure first is *which* resource the knee is made of.

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
alarm_check = check_first_alarm(first_alarm, ramp=live.result.samples)  # on the ramp section 3 ran
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
TTFT, KV usage and queue depth all fire 8–11 s after the load passes the knee, while the offered load is
10–12 requests/s: a queue needs time to build, which is exactly what the `for:` clause waits for.
Utilisation is no help either way: **busy** is above 95 % from
the first seconds, when two requests per second are served comfortably (a continuous-batching engine always has a
decode to run), so an alarm on it is a false alarm that never clears; **compute utilisation** never reaches 50 %,
let alone 80 %, because memory runs out first — an autoscaler waiting for it waits forever while TTFT grows by a
second every few seconds. This is Lesson 06's warning: *if you scale on GPU utilization alone, you will be
late. Scale on queue depth, TTFT and cache pressure.* Here "late" takes both forms: busy fires too early to mean
anything, compute utilisation never fires at all. (Lab 5 added one more early signal: the reject rate of a
door that answers 429.)

## 5. Tune while watching everything at once

The last lesson of the course is about *how* to tune: on the client's workload, **watching preemption counts, cache
hit rate and latency percentiles together** — never one alone. The knobs are the ones vLLM's *Optimization and
Tuning* guide (docs.vllm.ai, "Optimization and Tuning") walks through, with the same advice to read the preemption
counter while turning them; keep it open when you tune a real deployment. Here is each of its knobs next to the
field of this engine's config that plays its part, and the value it has on the lab's machine:
"""),
("code", r"""
print(lab8.knobs_table(lab_engine(enable_prefix_caching=True).config))   # read from the frozen EngineConfig
"""),
("md", r"""
(vLLM sizes the KV pool from `gpu_memory_utilization`, a share of the device's memory; the simulated machine has no
memory to share, so its pool is given in blocks — section 4's whole-GPU sweep converts one into the other.)

One knob, the cache memory share, just past the knee (8 requests/s), on a workload like a real client's: three
requests in four come from a chat app whose prompts start with the same 256-token **system prompt** (16 blocks of
instructions, sent verbatim every time), the fourth from elsewhere. Prefix caching is on, so the hit rate has
something to find. The last row turns the cache off at 512 blocks, to show what the hit rate is worth.
"""),
("code", r"""
table, rows, tuned = lab8.tuning_table()              # 384..1024 blocks with the prefix cache, 512 without
print(table)
prompt_lens = lab8.tuning_prompt_lens()
shared = sum(lab8.SYSTEM_PROMPT_LEN for rid in prompt_lens if lab8.shares_system_prompt(rid))
print(f"hit rate at 512 blocks, recounted from the step log: {lab8.hit_rate_from_log(tuned['512'].step_log, prompt_lens):.1%}"
      f" | ceiling (system-prompt tokens / all prompt tokens): {shared / sum(prompt_lens.values()):.1%}")
""", ["covered-by-solution"]),
("md", r"""
Read the columns together. More cache takes away the preemptions and the TTFT tail at this load (p99 TTFT from
3.8 s at 384 blocks to 1.6 s at 512 and 55 ms from 768); past 768 blocks the working set fits and more memory buys
nothing. The hit rate sits at 39.5 % in every row, within half a point of its ceiling (39.9 %: the system prompt's share of
all prompt tokens, the only cacheable part of the workload): the system prompt is held by a running request at
almost every moment, so it is never evicted, and every app request but the first few skips its 256 tokens. A flat hit rate is the sign that memory is *not* being spent on the cache;
had it fallen at small pools, the preemptions would be partly the cache's doing. The last row is what those hits
are worth: at 512 blocks without the cache, every app request holds its own copy of the 16 system-prompt blocks and
prefills them again — 46 preemptions instead of 29, p99 TTFT 5.8 s instead of 1.6 s, 774 tokens/s instead of 970.
ITL moves both ways: the median rises a little with more memory (more requests decode together, more KV to read
per step) while the p99 falls (no recompute prefills landing in the batch). On a real GPU that memory also came from
somewhere: the activation workspace that sets the step's token budget. Any one column alone would have told a
different story; that is the point of reading them together.

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
* How per-tenant token counters and a GPU-hour price become a bill (price x window x share under a stated rule),
  why the rule matters (tokens, weighted tokens, KV-block-seconds split the same hour differently), and why an idle
  replica makes every token it serves more expensive.

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
