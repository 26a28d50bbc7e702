CELLS = [
("md", r"""
# Lab 6 — Fairness

> *"Be fair" is not a policy until you name a metric and an enforcement.*

**Goals.** After this lab you can

1. show, with numbers, how one tenant's backlog starves another under first-come-first-served, and name the metric
   that exposes it (per-tenant p95 TTFT next to per-tenant throughput and KV share);
2. enforce a **per-tenant cap** (✏️ exercise 1) and measure what it costs: it protects the quiet tenant only when it
   binds, and then it leaves capacity idle;
3. write the **virtual token counter** of weighted fair queueing (VTC, OSDI 2024) (✏️ exercise 2), which protects the
   quiet tenant *without* idling the engine, and measure fairness with Jain's index;
4. order by **deadline with aging** (✏️ exercise 3) and state the bound that keeps it from starving anybody;
5. measure how a client's **retry loop** turns a load the engine carries into a storm (requests sent per job done,
   server work nobody used, the neighbour's p95 TTFT), and which defences stop what: cancelling, WFQ, a cap that
   rejects with a `retry_after_s` hint the client honours;
6. assemble the three-class policy (interactive / agent / batch) from engine rules and check its SLOs and its cost
   to the batch tier on a mixed workload, and measure why an agent, whose task is many sequential calls, pays its
   per-call queueing once per call.

**Time:** 34 s to run, measured on the course's 2-core VM with the bundled model already converted
(`benchmarks/results/2026-12-06_cpu-2core_lab_times.json`; the first load ever converts it once, 25–35 s more there:
`benchmarks/results/2026-12-06_cpu-2core_first_load.txt`); 60 minutes to work through. The large workloads run the real
engine (scheduler, KV cache manager, preemption) on a **simulated forward pass** with a virtual clock (`SimulatedExecutor`),
so a 16-second overload takes well under a second of CPU and the numbers are exact and reproducible; the real model runs once,
at the end. Every policy you write is plugged into the engine through its two seams, `admission_policy` (who starts
next) and `preemption_policy` (who gives way). Exercises are marked ✏️; until your checker passes, later cells use
the engine's own policy of the same name.
"""),
("code", r"""
import math

import matplotlib.pyplot as plt

from minivllm import SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig
from minivllm.labs import choose
from minivllm.labs.check_lab06 import (CLASS_STEP, FAIR_STEP, SLOS, RetryClient, TenantTimeline, agent_task_times,
                                       agent_tasks, aging_run, backlogged, cap_policy, check_deadline_aging,
                                       check_tenant_cap, check_virtual_token_counter, class_engine, deadline_policy,
                                       jain, lab_engine, mixed_classes, noisy_quiet, percentile, retry_report,
                                       retry_storm, serve, slo_report, table, wfq_policy)
from minivllm.labs.quiz import print_answers, print_quiz, show_quiz
from minivllm.sched.fairness import THREE_CLASS_RULES

%matplotlib inline
"""
, ["setup"]),
("md", r"""
## 1. The picture: one queue, two tenants

Two tenants share one engine. **quiet** sends short chats (4 per second, prompts of 150–450 tokens) and wants a fast
first token. **noisy** is a bulk importer: 2.5 requests per second of 3,000–5,000-token prompts, about ten times
quiet's tokens and more than the engine can serve, so its backlog grows for as long as it sends.

```
 waiting queue (FCFS)                        running (token budget 2,048 per step, KV pool 1,024 blocks)
 ┌────┬────┬────┬────┬────┬────┬────┐        ┌──────────────────────────────────────────────┐
 │ N  │ N  │ q  │ N  │ N  │ q  │ N  │ ──────►│ N N N N N N N N ... (long prefills, 69% KV)  │
 └────┴────┴────┴────┴────┴────┴────┘        └──────────────────────────────────────────────┘
   a quiet request (q) waits behind every noisy request (N) that arrived before it:
   its TTFT is the noisy backlog's drain time, not its own 0.05 s of work
```

FCFS is "fair" to *requests* (first come, first served) and unfair to *tenants*: a tenant that sends more gets more,
and everybody else's latency becomes a function of the heaviest sender. To say anything precise we need a metric per
tenant. We will read three: **p95 TTFT** (the latency promise), **tokens per second** (the service received: each
prompt token counted once, since a prompt computed again after a preemption is the engine's loss, not service) and
**KV share** (the memory held: the mean fraction of the pool over the arrival window, each step's blocks weighted by
how long the step took, since one prefill step can last as long as fifty decodes). The engine's step log records, for
every step, each tenant's tokens, KV blocks, running and waiting requests (`record.tenants`), so all three come from
one run.

## 2. Starvation, measured

The same arrivals (16 seconds of them, seeded), with quiet alone and with both tenants, FCFS.
"""),
("code", r"""
arrivals = noisy_quiet(16.0)
solo = serve(lab_engine(), noisy_quiet(16.0, quiet_alone=True), window=16.0)
runs = {"fcfs": serve(lab_engine(), arrivals, window=16.0)}
print(f"{len(arrivals)} requests: {sum(a.tenant == 'quiet' for a in arrivals)} quiet, "
      f"{sum(a.tenant == 'noisy' for a in arrivals)} noisy; "
      f"noisy sends {sum(len(a.prompt) for a in arrivals if a.tenant == 'noisy') / sum(len(a.prompt) for a in arrivals if a.tenant == 'quiet'):.0f}x "
      f"quiet's prompt tokens")
print(table({"quiet alone": solo}, ["quiet"]))
print(table(runs, ["quiet", "noisy"]))
timeline = TenantTimeline({"fcfs": runs["fcfs"]}, ["quiet", "noisy"])
timeline.show()
"""),
("md", r"""
Alone, quiet's p95 TTFT is a few hundredths of a second. Sharing a FCFS engine with noisy, it is **seconds** — and
it grows with how long noisy keeps sending (run it with 32 seconds of arrivals and it roughly doubles). Its
throughput halves too: it is *served later*, so fewer of its tokens fall inside the window. The top panel shows why:
the noisy queue never drains while it sends, and quiet requests land behind it. The bottom panel shows noisy holding
most of the KV pool. Nothing here is a bug; it is what FCFS promises.

## ✏️ Exercise 1 — a per-tenant cap

The bluntest enforcement: a tenant may have at most `max_running[tenant]` requests running at once. Write
`TenantCap`, an **admission policy**: the engine calls `order(waiting, running)` before admitting and starts requests
in the order you return, stopping at the first that does not fit. Return the waiting requests that may start, in
queue order:

* a tenant's **running** requests already hold seats;
* walk `waiting` in order and let a request through while its tenant is below its cap — and count it, because the
  engine may admit it;
* a tenant without an entry in `max_running` is not capped.

<details><summary>Hint 1</summary>

Keep a dictionary `tenant -> seats taken`. Fill it from `running` first, then update it as you walk `waiting`.
</details>
<details><summary>Hint 2</summary>

`waiting` is in the engine's queue order, which puts preempted requests first. Don't sort it, and don't remove
anything from it: build a new list.
</details>
<details><summary>Hint 3</summary>

`self.max_running.get(tenant)` is `None` for a tenant without a cap. What should the comparison be then?
</details>
"""),
("code", r"""
class TenantCap:
    '''Admission policy: a tenant may have at most max_running[tenant] requests running (unlisted: no cap).'''

    def __init__(self, max_running: dict):
        # TODO: remember the caps (a copy of the dict)
        ### BEGIN SOLUTION
        self.max_running = dict(max_running)
        ### END SOLUTION

    def order(self, waiting, running):
        # TODO: count the seats each tenant holds (running), then return, in queue order, the waiting
        #   requests that fit under their tenant's cap (count each one you let through)
        ### BEGIN SOLUTION
        seats = {}
        for r in running:
            seats[r.tenant] = seats.get(r.tenant, 0) + 1
        out = []
        for r in waiting:
            cap = self.max_running.get(r.tenant)
            if cap is None or seats.get(r.tenant, 0) < cap:
                out.append(r)
                seats[r.tenant] = seats.get(r.tenant, 0) + 1
        return out
        ### END SOLUTION
""", ["exercise:tenant_cap"]),
("code", r"""
cap_check = check_tenant_cap(TenantCap)
Cap = choose(cap_check, TenantCap, None, "per-tenant cap")   # None: the engine's FCFS with TenantConfig caps
"""),
("md", r"""
Now cap noisy at 4, 2 and 1 running requests and measure. (`cap_policy` plugs your class into the engine as
`admission_policy`, or falls back to the engine's `TenantConfig(max_running=...)` caps.)
"""),
("code", r"""
for n in (4, 2, 1):
    caps = {"noisy": n}
    runs[f"cap noisy at {n}"] = serve(lab_engine(cap_policy(Cap and Cap(caps), caps)), arrivals, window=16.0)
print(table(runs, ["quiet", "noisy"]))
"""),
("md", r"""
Three lessons in one table:

* **A cap that barely binds buys almost nothing.** Noisy rarely has more than four requests running anyway (its
  long prompts are limited by the token budget and KV), so a cap of 4 leaves quiet starving: its p95 TTFT is 14.6 s
  against FCFS's 16.5 s, and its requests are even preempted more often (6 times against once).
* **A cap that binds protects quiet** — its p95 TTFT falls from seconds to a fraction of one (0.28 s at a cap of 2,
  0.17 s at 1; 0.07 s when quiet runs alone) — **and costs throughput**: noisy
  holds less KV and gets fewer tokens per second, *even in steps where nobody else wanted them*. A cap is not
  work-conserving: it idles capacity to buy isolation.
* The right cap depends on the workload, which is why caps are an *enforcement* for contracts ("you bought 2
  seats"), not a fairness policy.

## ✏️ Exercise 2 — weighted fair queueing: the virtual token counter

VTC (Sheng et al., *Fairness in Serving Large Language Models*, OSDI 2024) keeps one counter per tenant: the
tokens it has been served, divided by its weight. The engine serves the **lowest counter first**. A tenant that sent
nothing for a while must not bank credit — otherwise it could return and monopolise the engine — so when a tenant
becomes active its counter is **lifted to the minimum counter of the tenants already active** (never lowered).

Write `VirtualTokenCounter`:

* `weight(tenant)`: the tenant's weight from `weights`, 1.0 if unlisted;
* `charge(tenant, prefill_tokens, output_tokens)`: add `prefill_weight × prefill_tokens + decode_weight ×
  output_tokens`, divided by the tenant's weight (output tokens cost more: each is a whole step for that sequence);
* `activate(tenant, active)`: `tenant` has just become active; `active` is the set of tenants that already were.

The engine's WFQ order (interleave the tenants, lowest counter first; `CounterWFQ` in `check_lab06.py`) calls
`charge` after every step with the tokens each request really got, and `activate` when a tenant appears.

(The engine adds one rule of its own, outside the exercise. Trickling must not bank credit either: a tenant kept
active by one running request, with nothing waiting, takes less than its share while the others are served, and a
burst would then win every admission until it caught up. So when a tenant whose queue had emptied sends again, the
engine lifts it to within two steps' budget of the backlogged tenants, `WFQAdmission._rejoin`; the checker applies
that rule to your counters itself.)

<details><summary>Hint 1</summary>

Two tenants of weight 1 and 2 served the same tokens: whose counter should be higher?
</details>
<details><summary>Hint 2</summary>

A worked example of `activate` (not a checker case): counters `a` 120, `b` 90, `c` 40 (`c` was idle).
`activate("c", {"a", "b"})` lifts `c` to 90, the lowest of the others. Had `c` stood at 150, it would stay at 150.
With no other tenant active there is nobody to catch up with: `c` keeps 40. A tenant that has no counter yet has
been served nothing.
</details>
"""),
("code", r"""
class VirtualTokenCounter:
    '''Per-tenant virtual token counters (VTC): served tokens / weight; newcomers start at the active minimum.'''

    def __init__(self, weights: dict, prefill_weight: float = 1.0, decode_weight: float = 2.0):
        self.weights = dict(weights)
        self.prefill_weight = prefill_weight
        self.decode_weight = decode_weight
        self.counters = {}   # tenant -> virtual tokens served

    def weight(self, tenant):
        # TODO: the tenant's weight, 1.0 when it is not listed
        ### BEGIN SOLUTION
        return self.weights.get(tenant, 1.0)
        ### END SOLUTION

    def charge(self, tenant, prefill_tokens, output_tokens):
        # TODO: add this step's weighted tokens, divided by the tenant's weight, to its counter
        ### BEGIN SOLUTION
        cost = self.prefill_weight * prefill_tokens + self.decode_weight * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)
        ### END SOLUTION

    def activate(self, tenant, active):
        # TODO: lift the newly active tenant's counter to the minimum of the already active tenants (never lower it)
        ### BEGIN SOLUTION
        others = [self.counters.get(t, 0.0) for t in active if t != tenant]
        if others:
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(others))
        ### END SOLUTION
""", ["exercise:virtual_token_counter"]),
("code", r"""
vtc_check = check_virtual_token_counter(VirtualTokenCounter)
VTC = choose(vtc_check, VirtualTokenCounter, None, "virtual token counter")   # None: scheduling_policy="wfq"
"""),
("md", r"""
Two measurements. First the noisy/quiet workload. Then the textbook test of a fair scheduler: three tenants that all
send at once, one with 12 long prompts, one with 36 medium ones, one with 120 short ones (about the same tokens
each), all backlogged. Fairness is then a number: **Jain's index** of their weighted service, `(Σx)² / (n·Σx²)`,
1.0 when all get the same, 1/n when one gets everything.
"""),
("code", r"""
runs["wfq"] = serve(lab_engine(wfq_policy(VTC and VTC({}))), arrivals, window=16.0)
print(table({k: runs[k] for k in ("fcfs", "cap noisy at 2", "wfq")}, ["quiet", "noisy"]))
print("tokens computed again after a preemption: " + ", ".join(f"{k} {runs[k].stats['recomputed_tokens']:,}"
                                                             for k in ("fcfs", "cap noisy at 2", "wfq")))
print()
for name, policy in [("fcfs", {}), ("wfq", wfq_policy(VTC and VTC({}), budget=512))]:
    service = backlogged(policy)
    print(f"{name:5s} service in the first 1.5 s: " + ", ".join(f"{t} {v:6.0f}" for t, v in service.items())
          + f"   Jain's index {jain(list(service.values())):.3f}")
for window in (1.5, 3.0):
    weighted = backlogged(wfq_policy(VTC and VTC({"short": 2.0}), {"short": 2.0}, budget=512), window=window)
    print(f"wfq with short at weight 2, first {window} s: " + ", ".join(f"{t} {v:6.0f}" for t, v in weighted.items())
          + "   short gets " + ", ".join(f"{weighted['short'] / v:.2f}x {t}'s" for t, v in weighted.items() if t != "short"))
"""),
("md", r"""
WFQ brings quiet's p95 TTFT back to within a couple of steps of its solo value, like the binding cap — but nothing
is left idle: noisy loses less than quiet gains (read the tok/s column: the two tenants get 6,111 tokens per second
together under WFQ, 5,678 under FCFS, which computed more tokens twice after its preemptions: the line under the table), while the binding cap idled
capacity (5,271). WFQ is work-conserving. Whenever quiet has nothing waiting,
noisy gets everything;
when quiet has work, it goes first because its counter is lower. On the backlogged workload FCFS gives the tenant
with the biggest requests most of the service (Jain ≈ 0.57); WFQ equalises it (Jain ≈ 1.0). Weights change the
shares, not the principle: the last two lines give `short` weight 2. It gets 1.51x long's service and 1.87x
medium's in the first 1.5 s, and 1.75x and 1.98x in the first 3 s: the share moves towards the weight as the window
grows, while every tenant still has work queued.

What WFQ does *not* give is a latency target. It shares tokens; it does not know that a chat must start within
700 ms while a batch job can wait an hour.

## ✏️ Exercise 3 — deadlines, with aging

Earliest deadline first (EDF) serves the request due soonest. Its failure mode is starvation: a request without a
deadline (or with a distant one) waits forever behind a stream of urgent ones. **Aging** fixes that: no request's
sort key is later than its arrival plus `aging_s`. Write `AgingDeadline`:

* `key(req)`: `req.deadline`, but never later than `req.arrival_time + aging_s` (a request without a deadline is
  due exactly then), and never earlier than `req.arrival_time` (an already-expired deadline must not jump ahead of
  requests that arrived before it);
* `rank(req)`: `(key, arrival time)`, smaller = more urgent — the engine also uses it to pick a preemption victim
  (the running request with the largest rank) and to decide which prefills get the token budget first (smallest
  rank first);
* `order(waiting, running)`: the waiting requests by rank, best first.

<details><summary>Hint 1</summary>

Draw one request's time line: its arrival, then `arrival + aging_s`. Put a deadline before the arrival, one between
the two marks and one after the second. Where should each one's key land? What about no deadline at all?
</details>
<details><summary>Hint 2</summary>

The key is the deadline pushed inside a window: each end of the window is one comparison, so one builtin each.
</details>
<details><summary>Hint 3</summary>

`sorted()` returns a new list; `list.sort()` changes the engine's list.
</details>
"""),
("code", r"""
class AgingDeadline:
    '''Admission policy: earliest deadline first; nobody's key is later than arrival + aging_s.'''

    def __init__(self, aging_s: float):
        # TODO: remember aging_s
        ### BEGIN SOLUTION
        self.aging_s = aging_s
        ### END SOLUTION

    def key(self, req):
        # TODO: the deadline clamped into [arrival, arrival + aging_s] (no deadline: arrival + aging_s)
        ### BEGIN SOLUTION
        latest = req.arrival_time + self.aging_s
        due = latest if req.deadline is None else min(req.deadline, latest)
        return max(req.arrival_time, due)
        ### END SOLUTION

    def rank(self, req):
        # TODO: (key, arrival time)
        ### BEGIN SOLUTION
        return (self.key(req), req.arrival_time)
        ### END SOLUTION

    def order(self, waiting, running):
        # TODO: a new list of the waiting requests, best rank first
        ### BEGIN SOLUTION
        return sorted(waiting, key=self.rank)
        ### END SOLUTION
""", ["exercise:deadline_aging"]),
("code", r"""
deadline_check = check_deadline_aging(AgingDeadline)
Deadline = choose(deadline_check, AgingDeadline, None, "deadline order")   # None: scheduling_policy="deadline"
"""),
("md", r"""
**The bound.** A request that arrived at time `a` has a key of at most `a + aging_s`; one that arrives later than
`a + aging_s` has a key larger than that. The engine admits in key order and stops at the first request that does
not fit, so **no request is ever started after a request that arrived more than `aging_s` after it**. Its wait is
at most `aging_s` plus the time to serve what arrived before `a + aging_s` — finite, whatever keeps arriving. (Two
fine prints: a tenant cap outranks the order, so a capped tenant's request is passed by the others, however late;
and a second sample of an `n > 1` request keeps its seat while its leader prefills the shared prompt.)

Measure it: three bulk jobs without deadlines arrive at t = 0, then a chat every 20 ms due 50 ms after arrival, on an
engine with only two seats. Plain EDF (aging of 1,000 s) against aging of 0.5 s. Then the noisy/quiet workload,
where quiet's deadlines are 1 s and noisy's 30 s.
"""),
("code", r"""
for aging in (1000.0, 0.5):
    r = aging_run(deadline_policy(Deadline and Deadline(aging), aging))
    starts = {k: r.arrival[k] + r.ttft[k] for k in r.ttft if k.startswith("bulk")}
    print(f"aging {aging:6.1f} s: bulk first tokens at " + ", ".join(f"{v:.2f} s" for v in starts.values())
          + f"; chats' p95 TTFT {percentile([v for k, v in r.ttft.items() if k.startswith('chat')], 95):.2f} s")
for aging in (30.0, 5.0):
    runs[f"deadline, aging {aging:.0f} s"] = serve(lab_engine(deadline_policy(Deadline and Deadline(aging), aging)),
                                                  arrivals, window=16.0)
print(table({k: runs[k] for k in ("fcfs", "wfq", "deadline, aging 30 s", "deadline, aging 5 s")}, ["quiet", "noisy"]))
"""),
("md", r"""
Without aging, two of the bulk jobs start only when the chat stream ends; with aging of 0.5 s they start after the
chats that arrived in their first half second — the bound at work. The chats pay for it: their p95 TTFT rises from
5.17 s to 5.64 s.

On the noisy/quiet workload the aging bound shows its price. With `aging_s = 30` quiet's 1 s deadlines always beat
noisy's keys, and quiet is protected about as well as by WFQ, without idling anything. With `aging_s = 5` every noisy
request that has waited 4 seconds outranks a quiet request that has just arrived — and noisy's backlog is deeper than
that, so quiet's p95 TTFT climbs back towards FCFS. Aging is a promise *to the tenant that waits*; under sustained
overload somebody pays for it. A deadline order expresses urgency, not shares: it is fair only if the deadlines are.

### Everything over time

The widget replays every run of this lab from its step log: pick a policy, move the cursor, and watch who waits and
who holds the KV cache. Compare `fcfs` with `cap noisy at 2` (noisy's KV share flattens at the cap), with `wfq` (quiet's
queue never builds) and with the two deadline runs.
"""),
("code", r"""
timeline = TenantTimeline(runs, ["quiet", "noisy"])
print(timeline.at(8.0))
timeline.show()
"""),
("md", r"""
## 3. A retry loop, measured

Lesson 06 — the lesson this course is built on, whose mechanisms, numbers and questions every lab measures — names
two ways one tenant starves the others: "a single retry loop or a bulk import". Section 2
measured the bulk import, a tenant that sends more than the engine serves. A retry loop needs no such tenant. Take
`app`, an application backend that sends 1.2 jobs per second of 2,000–4,000-token prompts: together with quiet's
chats about half of what this engine prefills, a load it carries. Its client library has a timeout: no first token
within `T` seconds, and it gives up and sends the same request again. Nobody tells the server:

```
 t = 0     app sends job 7          queue: … q  a7
 t = T     no token yet: resend     queue: … q  a7  a7'          a7 still waits, and will run for nobody
 t = 2T    no token yet: resend     queue: … q  a7  a7'  a7''    every timeout adds a whole prompt of work
```

The loop feeds itself: every retry lengthens the queue, a longer queue makes more requests time out, and every
timeout is another retry. Once the queueing delay crosses `T`, a load the engine carried becomes one it cannot.
Three numbers tell the story: **requests sent per job done** and the **share of the server's work on app's requests
that nobody used** (the amplification), and quiet's **p95 TTFT** (the damage to the neighbour).

`RetryClient` is such a client on the virtual clock: `serve` hands it every step's outputs; it accepts a first
token that came within `T` of the send, otherwise it gives up and sends again (at most 5 sends per job); with
`abort=True` it cancels the abandoned request first (`engine.abort_request`, what a server should do when the
connection closes). **Simulated**, like section 2 and the exercises: the lab's engine on the 3-constant step time `FAIR_STEP`,
12 s of seeded arrivals, FCFS. First the curve: quiet's p95 TTFT and app's amplification against the timeout.
"""),
("code", r"""
storm = retry_storm(12.0)
print(f"{sum(a.tenant == 'quiet' for a in storm)} quiet requests, {sum(a.tenant == 'app' for a in storm)} app jobs; "
      f"simulated, step time {FAIR_STEP}")
patient = RetryClient("app")   # timeout_s = inf: waits as long as it takes
waited = serve(lab_engine(), storm, window=12.0, client=patient)
print(retry_report("FCFS, patient client", waited, patient))
TIMEOUTS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
curve = {}
for abort in (False, True):
    for T in TIMEOUTS:
        client = RetryClient("app", timeout_s=T, abort=abort)
        res = serve(lab_engine(), storm, window=12.0, client=client)
        curve[abort, T] = res.p95_ttft("quiet"), client.summary(res)
        if T in (1.0, 2.0, 4.0):
            print(retry_report(f"FCFS, T = {T:.0f} s" + (", aborts first" if abort else ""), res, client))

base_work = patient.summary(waited)["work"]
fig, axes = plt.subplots(1, 3, figsize=(12, 3.3))
for abort, style, label in ((False, "o-", "retries (abandoned requests run on)"), (True, "s--", "aborts, then retries")):
    axes[0].plot(TIMEOUTS, [curve[abort, T][0] for T in TIMEOUTS], style, label=label)
    axes[1].plot(TIMEOUTS, [curve[abort, T][1]["work"] / base_work for T in TIMEOUTS], style, label=label)
    axes[2].plot(TIMEOUTS, [curve[abort, T][1]["done"] for T in TIMEOUTS], style, label=label)
for ax, y, title in ((axes[0], waited.p95_ttft("quiet"), "quiet's p95 TTFT (s)"),
                     (axes[1], 1.0, "server tokens on app / patient run's"),
                     (axes[2], len(patient.sends), f"app jobs done (of {len(patient.sends)})")):
    ax.axhline(y, color="gray", ls=":", label="patient client")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("client timeout T (s)")
axes[0].set_yscale("log")
axes[0].legend(fontsize=8)
fig.suptitle("simulated (FAIR_STEP, FCFS): one client's timeout against everybody's latency", fontsize=10)
fig.tight_layout()
plt.show()
"""),
("md", r"""
Read the curves from the right. With a timeout above the longest wait app sees with a patient client (its p95 is
3.1 s) the loop never fires and nothing changes. Below it, the loop tips over fast. At `T = 2 s` app sends 43
requests for its 15 jobs, only 8 of them get done, the server spends almost three times the patient run's tokens on
app (132k instead of 46k) and 81% of them on requests nobody is waiting for — and quiet's p95 TTFT triples, from
2.19 s to 6.33 s. At `T = 1 s` it collapses: 75 requests, no job done, quiet waits 28 s. Nothing about app's load
changed, only its patience.

Cancelling the abandoned request (dashed) removes most of the waste: at `T = 2 s` app sends 18 requests, all 15 jobs
get done and quiet is no worse off than beside the patient client. It does not make app faster: a resent request
starts again at the back of the queue, and with a timeout below 1.5 s most jobs fail. (There quiet even does
better than beside the patient client — because app now gets only 5 of its 15 jobs done.) The client's own fixes
are a timeout above the server's real latency and cancellation when it gives up. The server cannot count on either.

### The server's defences

Now keep the naive client (`T = 2 s`, no cancellation) and change the server. The seat cap of exercise 1 comes in
two flavours: over the cap a request **waits** (`TenantConfig(max_running=2)`), or it is **rejected** at once
(`over_cap="reject"`) and finishes `"rejected"` with the engine's `retry_after_s` estimate of when a seat frees up
(the server's `429` + `Retry-After`). Rejecting is the engine's scheduler at work, not your `TenantCap`, which only
orders the queue. For a rejected request the client either retries at once, or honours the hint: it waits
`retry_after_s`, doubled for each further rejection (exponential backoff), plus up to 50% random jitter, so that
clients turned away together do not return together.
"""),
("code", r"""
CAP_WAIT = {"scheduling_policy": "caps", "tenants": {"app": TenantConfig(max_running=2)}}
CAP_REJECT = {"scheduling_policy": "caps", "tenants": {"app": TenantConfig(max_running=2, over_cap="reject")}}
defences = [("FCFS, patient client", {}, RetryClient("app")),
            ("FCFS, retries", {}, RetryClient("app", timeout_s=2.0)),
            ("WFQ, patient client", wfq_policy(VTC and VTC({})), RetryClient("app")),
            ("WFQ, retries", wfq_policy(VTC and VTC({})), RetryClient("app", timeout_s=2.0)),
            ("WFQ, aborts then retries", wfq_policy(VTC and VTC({})), RetryClient("app", timeout_s=2.0, abort=True)),
            ("cap 2 (wait), retries", CAP_WAIT, RetryClient("app", timeout_s=2.0)),
            ("cap 2 (reject), retries at once", CAP_REJECT, RetryClient("app", timeout_s=2.0, honour_retry_after=False)),
            ("cap 2 (reject), honours the hint", CAP_REJECT, RetryClient("app", timeout_s=2.0))]
print("simulated, FAIR_STEP; client timeout 2 s, at most 5 sends per job; backoff x2, jitter up to 50%")
for name, policy, client in defences:
    print(retry_report(name, serve(lab_engine(policy), storm, window=12.0, client=client), client))
"""),
("md", r"""
* **WFQ** protects quiet from the storm as it did from the bulk importer: 0.37 s, the same as beside a patient app
  (first WFQ row) — the storm's cost lands on the tenant that makes it. But WFQ does not stop the storm: it shares tokens and cannot
  know that a request is abandoned. App still sends 55 requests, 92% of the server's work on it is for nobody, and
  10 of its 15 jobs fail. With a client that cancels, WFQ gives the best row of the table: quiet protected, all
  15 jobs done, 1.3 requests per job.
* **A cap that waits** isolates quiet too, and makes the storm worse *for app*: its abandoned requests keep its two
  seats, so its retries queue behind its own abandoned work. 2 of 15 jobs get done.
* **A cap that rejects** makes an over-cap request cost nothing: turned away at once, it spends no tokens (0% for
  nobody: the server works only on jobs that get done — 23k tokens when the client retries at once, exactly the
  patient run's 46k when it honours the hint). What the client does with the answer decides the
  rest. Retrying at once burns its 5 sends in 5 steps: 7 of 15 jobs done. Honouring the hint gets all 15 done with
  2.1 requests per job. The price is the cap's price from exercise 1: it binds, so app's jobs wait longer (p95 26 s)
  while capacity idles.

Fairness keeps the storm away from the neighbours; only cancellation, or rejection plus a client that honours the
hint, removes the amplification. That is why production clients combine them: a timeout above the server's p99,
cancel on give-up, exponential backoff with jitter, honour `Retry-After`, and a retry budget.
"""),
("md", r"""
## 4. The worked policy: three classes

Lesson 06's worked policy serves three classes with different promises:

| class | promise | example |
|---|---|---|
| interactive | p95 TTFT < 700 ms, p95 ITL < 60 ms | chat |
| agent | p95 TTFT < 2 s, p95 ITL < 120 ms, many sequential calls | a tool-using agent on a long shared preamble |
| batch | no latency SLO; minimise cost; must still finish | bulk summarisation |

It is six clauses, and each is a named rule in the engine (`scheduling_policy="three_class"`). Read them:
"""),
("code", r"""
for name, rule in THREE_CLASS_RULES.items():
    print(f"{name:34s} {rule}")
"""),
("md", r"""
Assemble it for our three tenants: map each tenant to its class, and pick the knobs (`ThreeClassConfig`). The mixed
workload below (60 s of chats at 0.5/s with 20–60-token prompts, agent calls at 0.25/s on a shared 300-token
preamble, and 6 batch prompts of 300–600 tokens queued at t = 0) runs on the simulated executor **calibrated to this
course's CPU machine**: `CLASS_STEP` was fitted to the bundled SmolLM2-135M's real step times on one CPU core
(`minivllm.bench.fairness.calibrate_step`: 66 ms per step, 3.1 ms per token). It is pinned, because a step's cost
belongs to the machine, not to the code: the same engine takes about a third of that on a faster CPU (24 ms + 1.2 ms
per token; `benchmarks/README.md`, "fairness", keeps the measurements). Run `calibrate_step()` for your machine and
pass its `"step"` to the simulator to see which conclusions move. The engine (`class_engine`) is small on purpose:
a step carries at most **64 tokens** (the token budget, shared by decodes and prefill chunks),
32 requests run at once, and the KV cache holds 512 blocks. Prefix
caching is on for both policies, so the comparison is about scheduling alone. Change the knobs and rerun.
"""),
("code", r"""
CLASSES = {"chat": TenantConfig(priority_class="interactive"),
           "agent": TenantConfig(priority_class="agent"),
           "bulk": TenantConfig(priority_class="batch")}
KNOBS = ThreeClassConfig(interactive_kv_reserve=0.25, agent_kv_share=0.4, batch_max_interactive_queue=1)

mixed = mixed_classes(60.0)
classes = {name: serve(class_engine(name, CLASSES, KNOBS), mixed, window=60.0) for name in ("fcfs", "three_class")}
floor = CLASS_STEP["fixed_overhead_s"] + CLASS_STEP["per_token_s"]   # one sequence, one decode step
print(f"step time {CLASS_STEP}; a lone decode step takes {floor * 1e3:.0f} ms on the pinned course machine")
for name, res in classes.items():
    print(slo_report(name, res))   # per tenant: p95 TTFT and ITL, share meeting the TTFT SLO and both SLOs
"""),
("md", r"""
Read the TTFT columns first. Under FCFS the batch backlog sits in front of every chat and agent call: their p95 TTFT
is many seconds, and a third of chats and a quarter of agent calls miss it. The three-class policy meets the TTFT SLO for every agent call
and for 93% of chats, and the batch tier still finishes at the same
time — its cost is the latency nobody promised it. Read against Lesson 06's own definition (a *p95* under 700 ms), the
chats' SLO is still narrowly missed on this machine: their p95 is 0.76 s, against 12 s under FCFS, because more than
5% of them miss. The chats that miss waited for the step's *token budget*, taken by
the running decodes: the engine preempts to free seats or KV blocks, never to free budget, which comes back at the
next step (a decode gives back one token, and preempting it throws its whole KV away, as vLLM's scheduler also
declines to do).

Now the ITL columns: **no policy meets the interactive ITL SLO on the pinned machine**, and none could. On it
a lone decode step of the 135M model takes about 70 ms, already above the interactive SLO of 60 ms, and
every step that also carries a prefill chunk is several times longer. (On the faster host a lone decode takes 26 ms
and would meet it; a step that carries the mix's 64-token budget would take about 100 ms and still would not.) The agent's 120 ms is within reach of a lone
decode but not of a step beside prefill chunks: a third of agent calls meet both SLOs under FCFS and a quarter under
`three_class`, whose earlier start for agent calls — next to the batch prefills — lowers their ITL p95 only a little
(348 ms against FCFS's 393 ms). Lesson 06's numbers assume a GPU. This is the point of naming the metric: a scheduler moves latency *between*
tenants; it cannot make the hardware faster. When a promise is below the hardware's floor, the fix is capacity (a
GPU, a smaller model, fewer prefill tokens per step), not a policy.

### The same mix where the hardware can keep the promise

Test that claim. The cell below serves the same mix, 300 times denser (chats at 150/s, agent calls at 75/s, a
backlog of 1,800 batch prompts at t = 0, 20 s of arrivals), with the same classes and knobs, on a datacenter GPU:
the roofline simulator with Llama-3-8B on the H100 preset (`minivllm.labs.at_scale`). Same scheduler code, same
SLOs.
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())
for name in ("fcfs", "three_class"):
    print(slo_report(name, at_scale.class_mix(name, CLASSES, KNOBS)))
""", ["covered-by-solution"]),
("md", r"""
Now the policy is the whole difference. Under FCFS the backlog still sits in front of every chat: p95 TTFT is about 20
seconds and almost nobody's promise is kept — a faster machine does not fix a bad order. Under the three-class policy
both tenants meet **both** SLOs for every request: the GPU's steps are short enough (about 50 ms even with a
2,048-token prefill chunk in them, under the 60 ms interactive ITL SLO) that the ITL promise is within reach, and the policy makes sure the
interactive tiers get the seats and the budget first. The batch tier finishes a few seconds later than under FCFS.
Capacity makes a promise *possible*; the policy decides who gets it.

### The batch class: no SLO, minimise cost

The third class has no latency promise. Its promise is about cost: what does a batch token cost? A GPU is rented by
the hour, busy or not. An interactive service keeps its steps short, and a decode step reads all the weights to
produce a few dozen tokens (memory bound, lab 4), so most of the GPU's arithmetic goes unused. `batch_cost_runs()`
serves four runs on the same simulated H100: 10 s of chats at 20 a second, alone; the same chats with a backlog of
200 batch prompts (500–1,000 tokens each) queued at t = 0, under `three_class` and under FCFS; and the batch alone, on
a GPU of its own. "GPU s" is first arrival to last token, the time the GPU is rented for. Dollars use lab 8's assumed
price of an H100 hour (an assumption, not a measurement: put in the price you pay).
"""),
("code", r"""
from minivllm.labs import at_scale
from minivllm.labs.check_lab08 import GPU_HOUR_USD, window_usd

gpu_hour_usd = GPU_HOUR_USD   # lab 8's assumed price: put in yours
print(at_scale.label(), f"at ${gpu_hour_usd:.2f} per GPU-hour")
cost = at_scale.batch_cost_runs(gpu_hour_usd=gpu_hour_usd)
print(f"{'':28s}{'GPU s':>7}{'tokens':>9}{'$ / 1M tok':>11}{'chat p95 TTFT':>15}{'chat p95 ITL':>14}{'batch done':>12}")


def ms(v, width):  # a latency in ms, or a dash for a run without chats
    return f"{v * 1e3:{width - 3}.0f} ms" if v == v else f"{'-':>{width}}"


for name, r in cost.items():
    done = f"{r['batch_done_s']:10.1f} s" if r["batch_tokens"] else f"{'-':>12}"
    print(f"{name:28s}{r['gpu_s']:7.2f}{r['tokens']:9,d}{r['usd_per_m']:11.3f}{ms(r['chat_ttft_p95'], 15)}"
          f"{ms(r['chat_itl_p95'], 14)}{done}")
shared, alone = cost["chats + batch, three_class"], cost["batch alone"]
extra_s = shared["gpu_s"] - cost["chats alone"]["gpu_s"]   # what adding the batch tier added to the rental
print(f"the batch tier's {shared['batch_tokens']:,} tokens: {extra_s:.2f} extra GPU-seconds beside the chats, "
      f"{alone['gpu_s']:.2f} GPU-seconds on a GPU of their own")
print(f"cost per 1M batch tokens: ${window_usd(extra_s, gpu_hour_usd=gpu_hour_usd) / (shared['batch_tokens'] / 1e6):.4f} beside the chats "
      f"(the extra rental), ${alone['usd_per_m']:.3f} alone")
""", ["covered-by-solution"]),
("md", r"""
Read the first two rows together. The chats alone cost about $0.11 per million tokens: the GPU is rented for 11.8 s,
and its short, memory-bound steps use a small part of its arithmetic. Add the batch backlog under `three_class`, and
the same 11.8 s serve 3.2 times the tokens. The batch tier's 192,000 tokens added 0.02 GPU-seconds to the rental,
against 7.5 s on a GPU of their own. The chats had paid for the machine; batch work used the arithmetic their steps
left idle, at a cost close to zero. The chats pay in latency, and it stays inside their promise: ITL p95 11 → 51 ms
(under 60), TTFT p95 26 → 72 ms.

FCFS serves the same tokens in the same time for the same money, and the chats wait behind the backlog (p95 TTFT
3.4 s). Cost does not separate the two policies; the promise kept beside it does. The batch work finishes at 10.0 s
instead of 9.0 s (FCFS) or 7.5 s alone, and nobody was promised otherwise.

Two limits. "Close to zero" holds while the backlog fits in the chats' slack; a bigger one runs past the chat window,
and every second beyond it is billed like the dedicated GPU. And the chats' ITL rose towards its 60 ms line: the
2,048-token step budget is what keeps it under. That is why the batch class needs the other clauses around it.

### Which clause buys what

Lesson 06's point is that every clause of a policy corresponds to a measurable behaviour. Measure it: switch the
clauses off one at a time. On the H100's full pool (29,043 blocks) memory is never short, so the KV clauses have
nothing to do; the cell squeezes the same mix into **700 blocks** (11,200 tokens, 2.4% of that pool: memory as
tight as a far larger model's weights would leave), where they do. It keeps the first **600** of the 1,800 batch
prompts: the squeezed pool starts only 520 to 570 of them in the 20 s window, so batch work still waits when the window
closes (the cell prints how much) and the chats and agents meet the same crowded pool as under the whole backlog. (With
every clause on, the whole backlog gives the chats and agents the very same TTFTs and ITLs; it only drains until 56 s
instead of 22 s, which made the cell slower and taught nothing.) The preemption column counts the whole run, the drain
included. A clause is switched off by its knob: no KV reserve, an agent share of everything, batch
admitted whatever queue of chats waits, no per-tenant cache cap, every victim recomputed. (`chunk_long_prefills` has
nothing to chunk here: no prompt reaches 8K. The next section gives it prompts that do.)
"""),
("code", r"""
import dataclasses

CLAUSE_OFF = {"every clause on": KNOBS,
              "reserve_kv_for_interactive off": dataclasses.replace(KNOBS, interactive_kv_reserve=0.0),
              "bounded_agent_queue off": dataclasses.replace(KNOBS, agent_kv_share=1.0, agent_max_running_share=1.0),
              "bounded_agent_queue at 10% of the KV": dataclasses.replace(KNOBS, agent_kv_share=0.1),
              "batch_only_when_interactive_idle off": dataclasses.replace(KNOBS, batch_max_interactive_queue=10**9),
              "capped_prefix_cache off": dataclasses.replace(KNOBS, tenant_cache_share=1.0),
              "swap for long contexts off": dataclasses.replace(KNOBS, swap_min_tokens=10**9)}
print(at_scale.label(), "squeezed to 700 KV blocks, the first 600 batch prompts")
print(f"{'three_class with':38s}{'chat p95 TTFT':>14}{'agent p95 TTFT':>16}{'agent SLO met':>15}"
      f"{'preemptions (swapped)':>23}")
waiting = []   # batch prompts not yet started when the window closed, per row
for clause, knobs in CLAUSE_OFF.items():
    r = at_scale.class_mix("three_class", CLASSES, knobs, num_blocks=700, batch=600)
    print(f"{clause:38s}{r.p95_ttft('chat') * 1e3:11.0f} ms{r.p95_ttft('agent') * 1e3:13.0f} ms"
          f"{r.slo_met('agent', 2.0, 0.120):14.1%}{r.stats['num_preemptions']:15d} ({r.stats['num_swap_preemptions']})")
    waiting.append(sum(r.tenant_of[k] == "bulk" and t > r.window for k, t in r.first_token.items()))
print(f"batch prompts still waiting when the {r.window:.0f} s window closed: {min(waiting)} to {max(waiting)} of 600")
""", ["covered-by-solution"]),
("md", r"""
Read the rows against the first. The **KV reserve** is what the chats are owed and what the agents pay for it: with
it off the chats' p95 TTFT rises (37 to 43 ms), and the agents', no longer queued behind the batch work inside the
75% of the pool left to both, falls (53 to 48 ms). The **bounded agent queue** does not move at 40%: every agent
call starts with the same 300-token tool preamble, and a KV cap counts a block its requests share once (the blocks
they pin, as the tenant gauges count them, and a waiting call is not charged for the preamble its class already
holds), so the agents never reach their share. A cap that summed the calls' block tables would charge the preamble to
every call and bind far sooner. Tighten it to 10% and it binds: the agents' p95 TTFT goes from 53 ms to 8.5 s and
only 36% of their calls meet the SLO, and the chats do not gain either (37 to 43 ms) while the preemptions more than
quadruple (70 to 321). That is the bound's trade in one row: the agents pay, so that a heavy agent load cannot crowd out
the rest -- and on this mix, where the agents were crowding out nobody, the payment buys nothing back.
Without **batch-only-when-idle** batch work is admitted into a busy engine: more preemptions (70 to 116), though on
this mix the agents' p95 TTFT does not move (53 ms). The **swap rule** decides the kind of preemption (all 70 are
swaps): the victims are batch prompts of about 370 tokens, just above the crossover lab 5 measured on this
preset (~300), so the cost model swaps them; recomputing them instead (75 preemptions, none swapped) leaves the
agents' p95 TTFT about where it was (49 ms): this close to the crossover the two costs are close, which is what the
crossover means. The **cache cap** moves nothing on this mix (53 ms, 70 preemptions): one tenant's cache
never crowds out another's here; it is insurance against a tenant whose prompts share nothing (lab 3's quota
section shows that case). A clause that is idle on one workload (the agent bound at 40% here) is not a wasted clause; but a
policy whose clauses you have never seen move is a policy you cannot tune.
"""),
("md", r"""
### The 8K clause, with prompts above 8K

The clause `chunk_long_prefills` is Lesson 06's *"chunk prefill above 8K tokens to protect ITL"*. Give it something to
chunk: lab 4's at-scale scene (chats arriving about 20 a second, two 32K-token documents 1.5 s apart, Llama-3-8B on
the H100 preset), now under the three-class preset, with the chats interactive and the documents sent by an
agent-class tenant. The clause bounds what *one request* prefills in a step; the step's size is the budget,
`max_num_batched_tokens`. So there are three rows: a budget of 16,384 chosen for throughput, without the clause and
with it, and the budget lab 4's `pick_budget` chose for a 60 ms ITL (1,024), with the clause.
"""),
("code", r"""
from minivllm.labs import at_scale

print(at_scale.label())
ROWS = {"budget 16,384, clause off": (16384, 16384), "budget 16,384, 8K clause": (16384, 8192),
        "budget 1,024, 8K clause": (1024, 8192)}
print(f"{'three_class with':28s}{'largest chunk':>14}{'chat ITL p99':>14}{'worst gap':>11}{'chat TTFT p99':>15}"
      f"{'document TTFT':>15}")
for name, (budget, clause) in ROWS.items():
    r = at_scale.long_prefill_run(budget, clause)
    print(f"{name:28s}{r['max_chunk']:9,d} tok{r['itl_p99'] * 1e3:11.0f} ms{r['itl_worst'] * 1e3:8.0f} ms"
          f"{r['ttft_chat_p99'] * 1e3:12.0f} ms{r['ttft_long']:14.2f} s")
"""),
("md", r"""
Read it row by row:

* **Without the clause** one document takes 16,337 tokens of a single step, and every chat stream freezes for 626 ms
  (p99 ITL 434 ms).
* **The clause** caps each document at 8,192 tokens a step. The worst gap falls to 357 ms. That is not half of 626,
  because a chunk deep into a 32K prompt attends to everything before it, so the last chunks cost more than the first.
  The chats' TTFT p99 falls from 1.03 s to 0.64 s, under their 700 ms promise, because the rest of the budget now goes
  to their prompts. So the clause protects ITL, and here TTFT even more. But a p99 ITL of 349 ms is still about six
  times the 60 ms promise.
* **The budget keeps the promise.** At 1,024 tokens a step the chats' ITL p99 is 45 ms and their TTFT p99 80 ms. The
  documents wait 1.21 s for their first token instead of 1.10 s. With a budget under 8K the clause never binds: it is
  the guard for an engine whose budget was set for throughput.

This is lab 4's conclusion again, now under the full policy: the clause says *which* prompts are chunked, and the
ITL target says how small the chunks must be.
"""),
("md", r"""
### Agents: a task is many sequential calls

The agent row of the table promises a per-call TTFT, and adds *many sequential calls*. An agent does not send on a
timetable: it reads the answer, runs a tool, and calls again with the whole conversation so far. Call k+1 leaves
only when call k has finished, and the user waits for the task, not for a call:

```
 call 1: [wait | prefill | decode ····]  tool  call 2: [wait | prefill | decode ····]  tool  call 3: ...
 task time = Σ over its K calls of (TTFT + decode)  +  (K − 1) × tool time        TTFT = queueing + prefill
```

Every second of queueing a policy lets one call suffer is paid K times. The agents above arrived open loop (each call
on its own, at random times), which hides this. Here they are **closed loop**, with the benchmark's own mechanism
(`minivllm.bench.fairness.next_agent_call`): four tasks start at 4, 12, 20 and 28 s, each makes K calls on the
shared 300-token preamble, and each next call is sent 50 ms after the previous one finished, with the conversation
so far plus 40 tokens of tool output as its prompt (the prefix cache keeps the shared context, so a call prefills
only what is new). Around them run the same chats and, instead of a one-off backlog, a **steady batch stream**
(0.15 prompts/s of 300–600 tokens for 60 s), so that there is a queue for every call, not just the first.
**Simulated** on the calibrated CPU step time `CLASS_STEP`, with the classes and knobs above.
"""),
("code", r"""
CALLS = (1, 2, 4, 8)
agents = {}
for name in ("fcfs", "three_class"):
    for k in CALLS:
        work, sessions = agent_tasks(k)
        res = serve(class_engine(name, CLASSES, KNOBS), work, window=60.0, sessions=sessions)
        agents[name, k] = agent_task_times(res), res.p95_ttft("agent")
print(f"simulated, CLASS_STEP; 4 agent tasks per run, means per task\n"
      f"{'policy':12s}{'calls':>6}{'wait per call':>15}{'Σ TTFT':>9}{'Σ decode':>10}{'task time':>11}{'agent p95 TTFT':>16}")
for (name, k), (tasks, p95) in agents.items():
    mean = {key: sum(t[key] for t in tasks.values()) / len(tasks) for key in ("ttft", "decode", "task")}
    print(f"{name:12s}{k:6d}{mean['ttft'] / k:14.2f}s{mean['ttft']:8.1f}s{mean['decode']:9.1f}s{mean['task']:10.1f}s"
          f"{p95:15.2f}s")

fig, ax = plt.subplots(figsize=(6.5, 3.3))
for name, color in (("fcfs", "#e15759"), ("three_class", "#4e79a7")):
    for key, style, what in (("task", "o-", "task time"), ("ttft", "s--", "Σ TTFT (waiting)")):
        means = [sum(t[key] for t in agents[name, k][0].values()) / len(agents[name, k][0]) for k in CALLS]
        ax.plot(CALLS, means, style, color=color, label=f"{name}: {what}")
ax.set_xlabel("sequential calls per task (K)")
ax.set_ylabel("seconds (mean over 4 tasks)")
ax.set_title("simulated (CLASS_STEP): an agent pays its queueing once per call", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
plt.show()
"""),
("md", r"""
Under FCFS each call waits a few seconds behind the batch stream (the agent's p95 TTFT is 6–8 s: its 2 s SLO is
missed), and over an 8-call task that adds up to 25 s of waiting, almost half the task. Under `three_class` a call
waits about 0.7 s (p95 under 2 s: the SLO is met), under 6 s for the whole 8-call task. The waiting grows with K under
both policies; the policy sets the slope, K multiplies it. That is why the agent class gets its own queue with a
bounded share rather than a place in line behind batch: its per-call promise is a per-step cost of every task.

The decode column does not improve: a policy changes when a call starts, not how long a step takes (at K = 8 decode
is even longer under `three_class`, whose calls run earlier, next to the batch stream, while FCFS pushes the late
tasks' last calls past its end). On this CPU decode is most of an agent's task: the ITL floor again.
"""),
("md", r"""
## 5. The real model: policies change when, never what

Everything above was simulated. On the bundled model, two long noisy prompts arrive just before two short quiet ones,
with a token budget of 32 per step: under FCFS the quiet prompts wait for the noisy prefills; under WFQ they start
in the very first step, beside the first noisy chunk (quiet has been served nothing, so its counter is the lowest). Each engine is warmed up once
before it is timed. The TTFTs differ; the greedy tokens must not.
"""),
("code", r"""
# NBVAL_IGNORE_OUTPUT  (wall-clock timings)
from minivllm import LLM

prompts = [{"prompt": "Write a long story about a lighthouse keeper who " * 4, "tenant": "noisy"},
           {"prompt": "List every planet of the solar system and describe " * 4, "tenant": "noisy"},
           {"prompt": "The capital of France is", "tenant": "quiet"},
           {"prompt": "Two plus two equals", "tenant": "quiet"}]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
tokens = {}
for policy in ("fcfs", "wfq"):
    llm = LLM(max_model_len=256, num_gpu_blocks_override=64, max_num_batched_tokens=32, scheduling_policy=policy)
    # warm-up: a new engine's first prefill and decode steps pay one-off costs; two tokens reach both
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens[policy] = [o.outputs[0].token_ids for o in outs]
    print(f"{policy:4s} TTFT: " + ", ".join(f"{p['tenant']} {o.metrics.ttft:.2f} s" for p, o in zip(prompts, outs)))
print("fcfs == wfq, token for token:", tokens["fcfs"] == tokens["wfq"])
"""),
("md", r"""
## Retrieval check

Answer from memory first. In Jupyter the quiz is interactive; the plain-text questions follow, and the answer key,
with every *why*, is in a separate cell: run it once you have answered. The last two questions come from labs 3 and 5.
"""),
("code", r"""
show_quiz(6)
""", ["nbval-ignore-output"]),
("code", r"""
print_quiz(6)
"""),
("code", r"""
print_answers(6)   # the answer key: run it after you have answered
"""),
("md", r"""
## What you should now be able to explain

* Why FCFS is fair to requests and unfair to tenants, and which per-tenant metrics show it (p95 TTFT, tokens/s, KV
  share — read together).
* What a cap buys (isolation) and what it costs (idle capacity when it binds, nothing when it does not).
* How VTC's counter works — weighted tokens served, lowest first, newcomers lifted to the active minimum — and why
  that is work-conserving and cannot be gamed by going idle to bank credit.
* Why EDF starves without aging, and the aging bound: nobody starts after a request that arrived more than `aging_s`
  after it.
* Why a client's retry loop starves the others without sending more work of its own — every timeout re-sends a whole
  prompt while the abandoned one runs on — how to measure it (requests sent per job done, server work nobody used,
  the neighbour's p95 TTFT), and what each defence stops: WFQ isolates the neighbour but not the waste;
  cancellation, or a rejecting cap with a client that honours `retry_after_s`, removes the waste.
* How the three-class policy turns "be fair" into named promises per class, each with a metric and an enforcement.
* Why a batch token can cost almost nothing on a GPU that interactive traffic already pays for (decode steps leave
  its arithmetic idle), how to measure that (extra GPU-seconds per batch token), and what keeps it from breaking
  the interactive promises.
* What the clause "chunk prefill above 8K tokens" bounds (one request's share of a step) and what it does not (the
  step's length, set by the budget), and why it matters only when the budget is larger than 8K.
* Why an agent's task time is the sum of its sequential calls' TTFT and decode, so the queueing a policy allows one
  call is paid once per call.

## Go further

* **Weights.** Give noisy weight 3 in `VirtualTokenCounter({"noisy": 3})` and measure both tenants' tokens/s on the
  backlogged workload: does the ratio reach 3 : 1? What happens to quiet's TTFT?
* **Retry budgets and metastability.** Section 3's storm started from a timeout that was simply too short. Start
  instead from a healthy client (`T = 4 s`) and add a burst of 10 extra app jobs at t = 3 s: does the storm start,
  and does it stop once the burst has passed, or does the retry load keep the queue above `T` on its own? Then give
  `RetryClient` a retry budget (retries at most 10% of its sends, as gRPC and Finagle clients do) and measure
  whether it recovers. Finally, check the engine's `retry_after_s` estimate: compare each hint with when that job's
  next send actually got a seat.
* **A cache-share cap.** `TenantConfig(max_cache_share=0.1)` limits how much of the prefix cache one tenant may keep.
  Give noisy and quiet shared system prompts and find the share below which quiet's hit rate collapses.
"""),
]
