"""Checkers for lab 6 (fairness): a per-tenant cap, a WFQ virtual token counter, a deadline order with aging.

Also the lab's measurement harness: a seeded noisy-vs-quiet workload
(:func:`noisy_quiet`), a mixed three-class workload (:func:`mixed_classes`), an
arrival loop on the engine's virtual clock (:func:`serve`) returning a
:class:`ServeResult` with per-tenant TTFT, throughput, KV share and the step
log's per-tenant rows, and :class:`TenantTimeline`, the widget of per-tenant
queues and KV shares over time.  Every learner object is plugged into the
*real* engine through its policy seams (``admission_policy`` and
``preemption_policy``, see :mod:`minivllm.interfaces`); until a checker passes,
the lab falls back to the engine's own policies
(FCFS with ``TenantConfig`` caps, ``"wfq"``, ``"deadline"``).  The module ends with
the lab's registration (:data:`LAB`, see :mod:`minivllm.labs.registry`).
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from minivllm.arrival import Arrival, made_up_ids
from minivllm.bench.fairness import CLASS_STEP, FAIR_STEP, MIX_IDS, ArrivalDriver, jain
from minivllm.bench.fairness import next_agent_call  # noqa: F401 (the agents' mechanism, by the name lab 6 gives it)
from minivllm.config import EngineConfig, TenantConfig
from minivllm.labs.checkers import Case, CheckResult, run_checks
from minivllm.labs.registry import Exercise, Lab
from minivllm.labs.widgets import PictureWidget
from minivllm.metrics.stats import meets_slo, nearest_rank
from minivllm.metrics.step_log import HeldBlocks
from minivllm.sampling_params import SamplingParams
from minivllm.sched.fairness import DeadlineAdmission, RankPreemption, WFQAdmission, new_prompt_tokens
from minivllm.sim.executor import SimulatedExecutor

BLOCK_SIZE = 16
TENANT_COLORS = {"quiet": "#4e79a7", "noisy": "#e15759", "chat": "#4e79a7", "agent": "#f28e2b", "bulk": "#76b7b2",
                 "app": "#b07aa1"}
SLOS = {"chat": (0.7, 0.060), "agent": (2.0, 0.120)}  # the seed lesson's interactive and agent SLOs (TTFT, ITL p95)


# -- workloads ---------------------------------------------------------------------------------------


def _poisson(rng: random.Random, rate: float, until: float):
    t = rng.expovariate(rate)
    while t < until:
        yield t
        t += rng.expovariate(rate)


def noisy_quiet(duration: float = 8.0, *, seed: int = 0, quiet_alone: bool = False) -> list[Arrival]:
    """A quiet tenant's short chats (4/s, prompts 150-450) and a noisy bulk importer (2.5/s, prompts 3000-5000):
    about 10x the quiet tenant's tokens, more than the engine serves, so its backlog grows for ``duration`` s.
    Quiet requests carry a 1 s deadline, noisy ones 30 s."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(_poisson(rng, 4.0, duration)):
        prompt = tuple(made_up_ids(rng, rng.randint(150, 450), MIX_IDS))
        out.append(Arrival(round(t, 6), f"quiet-{i}", "quiet", prompt, rng.randint(20, 60),
                           deadline=round(t + 1.0, 6)))
    if not quiet_alone:
        for i, t in enumerate(_poisson(rng, 2.5, duration)):
            prompt = tuple(made_up_ids(rng, rng.randint(3000, 5000), MIX_IDS))
            out.append(Arrival(round(t, 6), f"noisy-{i}", "noisy", prompt, rng.randint(40, 120),
                               deadline=round(t + 30.0, 6)))
    return sorted(out, key=lambda a: a.time)


def mixed_classes(duration: float = 30.0, *, seed: int = 0, scale: float = 1.0,
                  batch: int | None = None) -> list[Arrival]:
    """Interactive chats (0.5/s, prompts 20-60), agent calls on a shared 300-token preamble (0.25/s) and a
    batch backlog of 6 prompts at t=0: sized for the calibrated CPU step time
    (:data:`~minivllm.bench.fairness.CLASS_STEP`, about 300 prompt tokens per second).  ``scale``
    multiplies both rates and the backlog (the at-scale run of :mod:`minivllm.labs.at_scale`).

    ``batch`` keeps only the backlog's first ``batch`` prompts (of ``6 x scale``): the backlog is drawn last, so
    the chats, the agent calls and the prompts kept are the full mix's own, and a run on a pool too small to drain
    the whole backlog inside the window can skip the part it would only serve after the window closed."""
    backlog = round(6 * scale)
    if batch is not None and not 0 <= batch <= backlog:
        raise ValueError(f"mixed_classes: batch must be between 0 and the backlog's {backlog} prompts, got {batch}")
    rng = random.Random(seed)
    system = tuple(made_up_ids(rng, 300, MIX_IDS))  # the agents' shared tool preamble
    out = []
    for i, t in enumerate(_poisson(rng, 0.5 * scale, duration)):
        prompt = tuple(made_up_ids(rng, rng.randint(20, 60), MIX_IDS))
        out.append(Arrival(round(t, 6), f"chat-{i}", "chat", prompt, rng.randint(8, 24)))
    for i, t in enumerate(_poisson(rng, 0.25 * scale, duration)):
        prompt = system + tuple(made_up_ids(rng, rng.randint(20, 60), MIX_IDS))
        out.append(Arrival(round(t, 6), f"agent-{i}", "agent", prompt, rng.randint(8, 24)))
    for i in range(backlog if batch is None else batch):
        prompt = tuple(made_up_ids(rng, rng.randint(300, 600), MIX_IDS))
        out.append(Arrival(0.001 * i, f"bulk-{i}", "bulk", prompt, rng.randint(32, 64)))
    return sorted(out, key=lambda a: a.time)


def retry_storm(duration: float = 12.0, *, seed: int = 0, rate: float = 1.2) -> list[Arrival]:
    """:func:`noisy_quiet`'s quiet tenant and an application backend, ``app``: ``rate`` jobs per second of
    2000-4000-token prompts (40-120 output tokens), about half of what the engine serves -- a load it carries
    when its client waits, and a storm when its client retries (:class:`RetryClient`)."""
    rng = random.Random(seed + 1)
    out = noisy_quiet(duration, seed=seed, quiet_alone=True)
    for i, t in enumerate(_poisson(rng, rate, duration)):
        prompt = tuple(made_up_ids(rng, rng.randint(2000, 4000), MIX_IDS))
        out.append(Arrival(round(t, 6), f"app-{i}", "app", prompt, rng.randint(40, 120)))
    return sorted(out, key=lambda a: a.time)


AGENT_STARTS = (4.0, 12.0, 20.0, 28.0)


def agent_tasks(calls: int, *, duration: float = 60.0, seed: int = 0, batch_rate: float = 0.15,
                starts: Sequence[float] = AGENT_STARTS) -> tuple[list[Arrival], dict]:
    """Closed-loop agent tasks among :func:`mixed_classes`' chats and a steady batch stream.

    Each task (one per time in ``starts``) makes ``calls`` sequential calls on a shared 300-token tool
    preamble: the next call is sent 50 ms after the previous one finished, its prompt the whole
    conversation so far plus 40 tokens of tool output, 8-24 output tokens per call (the benchmark's
    :func:`~minivllm.bench.fairness.next_agent_call`, sized for the CPU step time).  The batch tier
    sends ``batch_rate`` prompts of 300-600 tokens per second for ``duration`` s, so a queue is there
    for every call, not only for the first.  Returns ``(arrivals, sessions)`` for :func:`serve`.
    """
    rng = random.Random(seed + 5)
    out = [a for a in mixed_classes(duration, seed=seed) if a.tenant == "chat"]
    for i, t in enumerate(_poisson(rng, batch_rate, duration)):
        prompt = tuple(made_up_ids(rng, rng.randint(300, 600), MIX_IDS))
        out.append(Arrival(round(t, 6), f"bulk-{i}", "bulk", prompt, rng.randint(32, 64)))
    system = tuple(made_up_ids(rng, 300, MIX_IDS))
    sessions = {}
    for s, t in enumerate(starts):
        sessions[s] = {"calls_left": calls - 1, "rng": random.Random(seed * 100 + s), "tool_tokens": 40,
                       "max_tokens": (8, 24), "think_s": 0.05}
        prompt = system + tuple(made_up_ids(rng, rng.randint(20, 60), MIX_IDS))
        out.append(Arrival(t, f"agent-s{s}-c0", "agent", prompt, rng.randint(8, 24), session=s))
    return sorted(out, key=lambda a: a.time), sessions


def agent_task_times(res: ServeResult) -> dict:
    """Per agent task: its calls, the sum of their TTFTs (queueing + prefill), the sum of their decode times
    (first token to finish), and the task's time (first call sent to last call finished)."""
    out = {}
    for s, ids in sorted(res.calls.items()):
        out[s] = {"calls": len(ids), "ttft": sum(res.first_token[i] - res.arrival[i] for i in ids),
                  "decode": sum(res.finished[i] - res.first_token[i] for i in ids),
                  "task": res.finished[ids[-1]] - res.arrival[ids[0]]}
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    return nearest_rank(values, q)


# -- the engine and the arrival loop ------------------------------------------------------------------


def lab_engine(policy: dict | None = None, *, num_blocks: int = 1024, budget: int = 2048, max_seqs: int = 128,
               chunk: int = 512, step: dict | None = None, max_len: int = 8192, executor=None, **options):
    """The lab's engine: a real ``LLMEngine`` on a simulated forward pass (virtual clock).

    ``policy`` is engine keyword arguments: ``{"scheduling_policy": "wfq"}``, ``{"admission_policy": obj}``,
    ``{"scheduling_policy": "caps", "tenants": {...}}`` ...  ``executor`` replaces the
    3-constant :class:`SimulatedExecutor` (``step``), e.g. by a roofline one.
    """
    from minivllm.engine.llm_engine import LLMEngine

    policy = dict(policy or {})
    objects = {k: policy.pop(k) for k in ("admission_policy", "preemption_policy") if k in policy}
    cfg = EngineConfig(num_gpu_blocks_override=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
                       max_num_seqs=max_seqs, max_model_len=max_len, long_prefill_token_threshold=chunk,
                       device="cpu", **policy, **options)
    return LLMEngine(cfg, executor=executor or SimulatedExecutor(**(step or FAIR_STEP)), model_max_len=max_len,
                     eos_token_ids=set(), **objects)


def class_engine(policy: str, classes: dict, knobs=None):
    """The three-class experiment's engine: ``policy`` by name, tenants mapped to classes, on the calibrated
    CPU step time (:data:`~minivllm.bench.fairness.CLASS_STEP`), prefix caching on whatever the policy."""
    from minivllm.config import ThreeClassConfig

    return lab_engine({"scheduling_policy": policy, "tenants": classes, "three_class": knobs or ThreeClassConfig()},
                      num_blocks=512, budget=64, max_seqs=32, chunk=0, step=CLASS_STEP, max_len=4096,
                      enable_prefix_caching=True)  # on for every policy: the comparison is about scheduling


@dataclass
class ServeResult:
    """Per-tenant numbers of one run; ``records`` is the engine's step log (with its per-tenant rows)."""

    ttft: dict = field(default_factory=dict)  # request id -> seconds
    itl_p95: dict = field(default_factory=dict)  # request id -> seconds
    tenant_of: dict = field(default_factory=dict)
    first_step: dict = field(default_factory=dict)  # request id -> step of its first scheduled token
    arrival: dict = field(default_factory=dict)
    records: list = field(default_factory=list)
    step_starts: list = field(default_factory=list)  # the clock when each step began (``records`` holds the same
    # steps while the engine's step log has not dropped its oldest: 500,000 sequence entries)
    held: HeldBlocks | None = None  # block-seconds per tenant in the window (the KV share)
    num_blocks: int = 0
    window: float = 0.0
    makespan: float = 0.0
    stats: dict = field(default_factory=dict)
    window_tokens: dict = field(default_factory=dict)  # tenant -> (prompt computed first time, output) in the window
    first_token: dict = field(default_factory=dict)  # request id -> virtual time of its first token
    finished: dict = field(default_factory=dict)  # request id -> virtual time it finished (or was rejected)
    finish_reason: dict = field(default_factory=dict)  # request id -> "length", "rejected", ...
    retry_after: dict = field(default_factory=dict)  # rejected request id -> the engine's retry_after_s hint
    calls: dict = field(default_factory=dict)  # agent session -> its calls' request ids, in order
    tokens: dict = field(default_factory=dict)  # finished request id -> its output token ids

    def tenants(self) -> list[str]:
        return sorted(set(self.tenant_of.values()))

    def p95_ttft(self, tenant: str) -> float:
        return percentile([v for k, v in self.ttft.items() if self.tenant_of[k] == tenant], 95)

    def p50_ttft(self, tenant: str) -> float:
        return percentile([v for k, v in self.ttft.items() if self.tenant_of[k] == tenant], 50)

    def kv_share(self, tenant: str) -> float:
        """Mean share of the pool its running requests held over the arrival window, weighted by time
        (:class:`~minivllm.metrics.step_log.HeldBlocks`: a 500 ms prefill step counts fifty 10 ms decodes)."""
        return self.held.share(tenant, self.num_blocks) if self.held is not None else 0.0

    def tokens_per_s(self, tenant: str) -> float:
        """Prompt + output tokens served per second while arrivals lasted."""
        return sum(self.window_tokens.get(tenant, (0, 0))) / self.window

    def service(self, tenant: str, prefill_weight: float = 1.0, decode_weight: float = 2.0) -> float:
        """Weighted token service in the window (what WFQ equalises): prefill x 1 + output x 2 by default."""
        p, o = self.window_tokens.get(tenant, (0, 0))
        return prefill_weight * p + decode_weight * o

    def slo_met(self, tenant: str, ttft_slo: float, itl_slo: float | None = None) -> float:
        """Share of the tenant's requests with TTFT within ``ttft_slo`` (and, if given, their p95 ITL within
        ``itl_slo``): the project's one SLO check, :func:`minivllm.metrics.stats.meets_slo`."""
        ids = [k for k in self.ttft if self.tenant_of[k] == tenant]
        ok = [k for k in ids if meets_slo(self.ttft[k], self.itl_p95.get(k), ttft_slo, itl_slo)]
        return len(ok) / max(1, len(ids))

    def itl_p95_all(self, tenant: str) -> float:
        """p95 over the tenant's requests of their own p95 inter-token latency."""
        return percentile([v for k, v in self.itl_p95.items() if self.tenant_of[k] == tenant], 95)

    def row(self, tenant: str) -> dict:
        return {"p50 TTFT s": self.p50_ttft(tenant), "p95 TTFT s": self.p95_ttft(tenant),
                "tok/s": self.tokens_per_s(tenant), "KV share": self.kv_share(tenant),
                "preemptions": self.stats["per_tenant"].get(tenant, {}).get("num_preemptions", 0)}


@dataclass
class RetryClient:
    """One tenant's client library with a retry loop, run on the virtual clock by :func:`serve`.

    Each of the tenant's arrivals is a *job*.  The client sends it and waits ``timeout_s`` for the first
    token; when none has come, it gives up and sends the same prompt again as a new request, at most
    ``max_attempts`` sends per job.  Nobody tells the server: the abandoned request keeps its place, its
    seat and its KV and runs to the end for nobody -- unless ``abort``, when the client cancels it first
    (``engine.abort_request``, what a server does when the connection closes).  A request turned away
    (finish reason ``"rejected"``: ``TenantConfig(over_cap="reject")``) is sent again at once, or, when
    ``honour_retry_after``, after the engine's ``retry_after_s`` hint x ``backoff``^(k-1) for its k-th
    rejection, x (1 + U(0, ``jitter``)) so that clients turned away together do not return together.
    The timer is read at step boundaries; a first token counts if it came within ``timeout_s`` of the send.
    """

    tenant: str
    timeout_s: float = math.inf
    max_attempts: int = 5
    abort: bool = False
    honour_retry_after: bool = True
    backoff: float = 2.0
    jitter: float = 0.5
    seed: int = 0
    sends: dict = field(default_factory=dict)  # job -> [(request id, sent at)], in order
    job_of: dict = field(default_factory=dict)  # request id -> job
    accepted: dict = field(default_factory=dict)  # job -> the request whose first token came in time
    abandoned: list = field(default_factory=list)  # requests the client timed out on
    rejected: list = field(default_factory=list)  # requests the engine turned away
    failed: list = field(default_factory=list)  # jobs that ran out of attempts
    live: dict = field(default_factory=dict)  # job -> (request id, sent at, arrival) the client waits on

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def sent(self, a: Arrival) -> None:
        """:func:`serve` added ``a`` to the engine (every tenant's arrivals come through here)."""
        if a.tenant != self.tenant:
            return
        job = self.job_of.setdefault(a.request_id, a.request_id)  # a first send: the job is named after it
        self.sends.setdefault(job, []).append((a.request_id, a.time))
        self.live[job] = (a.request_id, a.time, a)

    def _again(self, job: str, a: Arrival, at: float) -> list[Arrival]:
        """The job's next send at ``at``, or none once it has had ``max_attempts``.  A new request id
        (``<job>.r<k>``), not the job's: the engine refuses an id that is still in it, and an abandoned request
        stays in it unless ``abort``."""
        if len(self.sends[job]) >= self.max_attempts:
            self.failed.append(job)
            return []
        rid = f"{job}.r{len(self.sends[job])}"
        self.job_of[rid] = job
        return [Arrival(at, rid, a.tenant, a.prompt, a.max_tokens, deadline=a.deadline)]

    def after_step(self, engine, outputs, now: float) -> list[Arrival]:
        """Read this step's outputs, give up on requests past the timeout; return the requests to send."""
        again = []
        for out in outputs:
            job = self.job_of.get(out.request_id)
            if job is None or job not in self.live or self.live[job][0] != out.request_id:
                continue  # another tenant's, or a request the client no longer waits on
            rid, sent_at, a = self.live[job]
            first = out.metrics.first_token_time
            if first is not None and first - sent_at <= self.timeout_s:
                self.accepted[job] = rid  # in time: the client streams the rest
                del self.live[job]
            elif out.finished and out.outputs[0].finish_reason == "rejected":
                del self.live[job]
                self.rejected.append(rid)
                k = sum(r in self.rejected for r, _ in self.sends[job])
                wait = out.retry_after_s * self.backoff ** (k - 1) * (1 + self.jitter * self.rng.random()) \
                    if self.honour_retry_after else 0.0
                again += self._again(job, a, round(now + wait, 6))
        for job, (rid, sent_at, a) in list(self.live.items()):
            if now - sent_at >= self.timeout_s:  # no first token in time: give up, send it again
                del self.live[job]
                self.abandoned.append(rid)
                if self.abort:
                    engine.abort_request(rid)
                again += self._again(job, a, round(sent_at + self.timeout_s, 6))
        return again

    def summary(self, res: ServeResult) -> dict:
        """Jobs, requests sent, jobs done, the server tokens spent on the tenant and the share nobody used,
        and the p95 time from a job's first send to the first token the client accepted."""
        useful = set(self.accepted.values())
        work = wasted = 0
        for rec in res.records:
            for rid, n in zip(rec.seq_ids, rec.seq_tokens):
                if rid in self.job_of:
                    work += n
                    wasted += 0 if rid in useful else n
        waits = [res.first_token[rid] - self.sends[job][0][1] for job, rid in self.accepted.items()]
        jobs, sent = len(self.sends), sum(len(v) for v in self.sends.values())
        return {"jobs": jobs, "sent": sent, "done": len(self.accepted), "failed": len(self.failed),
                "sent per job done": sent / len(self.accepted) if self.accepted else math.inf, "work": work, "wasted": wasted,
                "wasted share": wasted / max(1, work), "job TTFT p95": percentile(waits, 95)}


def serve(engine, arrivals: Sequence[Arrival], window: float | None = None, max_steps: int = 100_000, *,
          sessions: dict | None = None, client: RetryClient | None = None) -> ServeResult:
    """Add each request when the virtual clock reaches its arrival, step until all finish.

    ``sessions`` makes agents closed loop: an arrival with ``session=s`` is the first call of session ``s``,
    and each call's finish triggers the next (the benchmark's
    :func:`~minivllm.bench.fairness.next_agent_call`: same mechanism, same context growth).  ``client``
    is one tenant's :class:`RetryClient`: after every step it may give up on requests and send new ones.
    The loop itself is the benchmark's :class:`~minivllm.bench.fairness.ArrivalDriver`; this function adds the
    lab's own records (request ids, first steps, finish times, tokens) and the client.

    Only a client reads a request before it finishes (its timer needs the first token when it comes), so without
    one each request reports once, at its end (``final_only``: the same first-token time, token ids and token
    times): building every running request's cumulative output on every step was a tenth of an at-scale run.
    """
    ex = engine.executor
    output_kind = "cumulative" if client is not None else "final_only"
    res = ServeResult(num_blocks=engine.pool.num_blocks)
    res.window = window if window is not None else (max(a.time for a in arrivals) if arrivals else 0.0)
    sessions = {k: {**v, "rng": copy.deepcopy(v["rng"])} for k, v in (sessions or {}).items()}  # reruns: same calls

    def add(a: Arrival) -> str:
        engine.add_request({"prompt_token_ids": list(a.prompt), "tenant": a.tenant, "deadline": a.deadline},
                           SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, output_kind=output_kind),
                           a.request_id, arrival_time=a.time)
        res.tenant_of[a.request_id] = a.tenant
        res.arrival[a.request_id] = a.time
        if client is not None:
            client.sent(a)
        return a.request_id

    loop = ArrivalDriver(engine, arrivals, add=add, window=res.window, max_steps=max_steps, sessions=sessions)
    res.held, res.calls = loop.held, loop.calls
    for step in loop:
        for out in step.outputs:
            if out.metrics.first_token_time is not None:
                res.first_token.setdefault(out.request_id, out.metrics.first_token_time)
            if not out.finished:
                continue
            res.finished[out.request_id] = out.metrics.finished_time if out.metrics.finished_time is not None else ex.clock
            res.tokens[out.request_id] = tuple(out.outputs[0].token_ids)
            res.finish_reason[out.request_id] = out.outputs[0].finish_reason
            if out.retry_after_s is not None:
                res.retry_after[out.request_id] = out.retry_after_s
            if out.metrics.ttft is not None:
                res.ttft[out.request_id] = out.metrics.ttft
                res.itl_p95[out.request_id] = percentile(out.metrics.itls, 95) if out.metrics.itls else 0.0
        if client is not None:
            for a in client.after_step(engine, step.outputs, ex.clock):
                loop.push(a)
        for rid, _, _ in step.record.seqs if step.record is not None else ():
            res.first_step.setdefault(rid, step.index)
        res.step_starts.append(step.started)
    res.window_tokens = loop.window_tokens
    res.records = list(engine.step_log)
    res.makespan = ex.clock
    res.stats = engine.stats()
    return res


def slo_report(name: str, res: ServeResult, slos: dict = SLOS) -> str:
    """One line per SLO'd tenant (p95 TTFT and ITL, share of requests meeting TTFT / both) and the batch tier's end."""
    lines = []
    for tenant, (ttft_slo, itl_slo) in slos.items():
        lines.append(f"{name:12s} {tenant:6s} p95 TTFT {res.p95_ttft(tenant):6.3f} s: TTFT SLO ({ttft_slo} s) met by "
                     f"{res.slo_met(tenant, ttft_slo):6.1%};  ITL p95 {res.itl_p95_all(tenant) * 1e3:4.0f} ms "
                     f"(SLO {itl_slo * 1e3:.0f} ms; both met by {res.slo_met(tenant, ttft_slo, itl_slo):6.1%})")
    bulk = [k for k in res.ttft if res.tenant_of[k] == "bulk"]
    lines.append(f"{name:12s} bulk   finished {len(bulk)}, all work done at {res.makespan:5.1f} s")
    return "\n".join(lines)


def retry_report(name: str, res: ServeResult, client: RetryClient) -> str:
    """One line per run of :func:`retry_storm`: quiet's p95 TTFT, and what the app's client sent and got."""
    m = client.summary(res)
    waited = "   none" if m["done"] == 0 else f"{m['job TTFT p95']:5.1f} s"
    return (f"{name:<34} quiet p95 TTFT {res.p95_ttft('quiet'):5.2f} s | app sent {m['sent']:3d} for "
            f"{m['done']:2d}/{m['jobs']} jobs done ({m['sent per job done']:4.1f} per job), server tokens "
            f"{m['work'] / 1e3:4.0f}k, {m['wasted share']:4.0%} for nobody; jobs done waited p95 {waited}")


def table(results: dict[str, ServeResult], tenants: Sequence[str]) -> str:
    """policy x tenant: p50/p95 TTFT, tokens/s in the window, mean KV share, preemptions."""
    width = max([len("policy")] + [len(name) for name in results]) + 2
    lines = [f"{'policy':<{width}}{'tenant':<8}{'TTFT p50':>9}{'TTFT p95':>9}{'tok/s':>8}{'KV share':>9}{'preempt':>8}"]
    for name, res in results.items():
        for t in tenants:
            r = res.row(t)
            lines.append(f"{name:<{width}}{t:<8}{r['p50 TTFT s']:8.2f}s{r['p95 TTFT s']:8.2f}s{r['tok/s']:8.0f}"
                         f"{r['KV share']:9.0%}{r['preemptions']:8d}")
    return "\n".join(lines)


# -- the widget: per-tenant queues and KV shares over time ---------------------------------------------


class TenantTimeline(PictureWidget):
    """Per-tenant waiting queues (top) and KV shares (bottom) over virtual time, one run per choice.

    Reads only finished runs' step logs (their per-tenant rows), so the cells
    after it cannot change what it shows; a dropdown picks the run, a slider
    moves the cursor, and the log says who held what at that moment.
    """

    caption = "[timeline controls: run this notebook in Jupyter to pick a policy and move through time]"

    def __init__(self, runs: dict[str, ServeResult], tenants: Sequence[str]) -> None:
        super().__init__(figsize=(11, 4.2))
        self.runs, self.tenants = runs, list(tenants)
        self.current = next(iter(runs))
        self.cursor = 0.0

    def paint(self, fig) -> None:
        res = self.runs[self.current]
        times = [r.time for r in res.records]
        top, bottom = fig.subplots(2, 1, sharex=True)
        for t in self.tenants:
            color = TENANT_COLORS.get(t)
            top.plot(times, [r.tenant(t).waiting for r in res.records], color=color, label=f"{t} waiting")
            bottom.plot(times, [r.tenant(t).kv_blocks / res.num_blocks for r in res.records], color=color,
                        label=f"{t} KV share")
        for ax in (top, bottom):
            ax.axvline(self.cursor, color="#555555", ls=":")
            ax.legend(fontsize=8, loc="upper left")
        top.set_ylabel("requests waiting")
        bottom.set_ylabel("share of KV blocks")
        bottom.set_ylim(0, 1)
        bottom.set_xlabel("virtual time (s)")
        top.set_title(f"{self.current}: per-tenant queue and KV share")
        fig.tight_layout()

    def at(self, time_s: float) -> str:
        """Move the cursor; one line per tenant describing that moment."""
        self.cursor = time_s
        res = self.runs[self.current]
        rec = min(res.records, key=lambda r: abs(r.time - time_s))
        return f"t = {rec.time:.2f} s, step {rec.step}: " + "; ".join(
            f"{t} {rec.tenant(t).running} running / {rec.tenant(t).waiting} waiting / "
            f"{rec.tenant(t).kv_blocks / res.num_blocks:.0%} KV" for t in self.tenants)

    def pick(self, name: str) -> str:
        self.current = name
        return self.at(self.cursor)

    def controls(self, w) -> list:
        end = max(r.records[-1].time for r in self.runs.values())
        choice = w.Dropdown(options=list(self.runs), value=self.current, description="policy")
        slider = w.FloatSlider(value=0.0, min=0.0, max=round(end, 2), step=0.1, description="time (s)",
                               continuous_update=False)

        def on_choice(change):
            self.handle("policy", lambda: self.pick(change["new"]))

        def on_slider(change):
            self.handle("time", lambda: self.at(change["new"]))

        choice.observe(on_choice, names="value")
        slider.observe(on_slider, names="value")
        return [w.HBox([choice, slider])]


# -- the engine-side adapters (the seams the learner's objects plug into) ----------------------------------


class CounterWFQ(WFQAdmission):
    """The engine's WFQ order (interleave tenants, lowest counter first) with the counter arithmetic delegated
    to ``vtc`` (a learner's ``VirtualTokenCounter``: ``counters``, ``weight``, ``charge``, ``activate``)."""

    def __init__(self, vtc, budget: int = 2048) -> None:
        super().__init__(EngineConfig(device="cpu", max_num_batched_tokens=budget,
                                      wfq_prefill_weight=vtc.prefill_weight, wfq_decode_weight=vtc.decode_weight))
        self.vtc = vtc

    def counter(self, tenant: str) -> float:
        return self.vtc.counters.get(tenant, 0.0)

    def weight(self, tenant: str) -> float:
        return self.vtc.weight(tenant)

    def activity(self, tenants) -> None:
        self._forget_places()  # as the engine's WFQ does: a new step, counters that may move
        active = set(tenants)
        already = active & self._active
        for t in sorted(active - self._active):
            self.vtc.activate(t, set(already))
        self._active = active

    def _raise_to(self, tenant: str, floor: float) -> None:  # the engine's rejoin lift, on the learner's counters
        if self.counter(tenant) < floor:
            self.vtc.counters[tenant] = floor

    def observe(self, batch, now: float) -> None:
        self._forget_places()
        for s in batch.seqs:
            self.vtc.charge(s.request.tenant, 0 if s.is_decode else new_prompt_tokens(s), 1 if s.samples else 0)


def wfq_policy(vtc_or_none, weights: dict | None = None, budget: int = 2048) -> dict:
    """Engine keyword arguments for WFQ: the learner's counter plugged in, or the engine's own ``"wfq"``
    (``budget`` must be the engine's ``max_num_batched_tokens``: WFQ's preemption margin is one step's budget)."""
    if vtc_or_none is None:
        tenants = {t: TenantConfig(weight=w) for t, w in (weights or {}).items()} or None
        return {"scheduling_policy": "wfq", "tenants": tenants}
    adm = CounterWFQ(vtc_or_none, budget)
    return {"admission_policy": adm, "preemption_policy": RankPreemption(adm)}


def cap_policy(cap_or_none, max_running: dict) -> dict:
    """Engine keyword arguments for per-tenant seat caps (``{tenant: max running}``): the learner's order, or
    the engine's FCFS with the same caps as ``TenantConfig(max_running=...)``.

    FCFS, not ``"caps"``: that policy also lets other tenants pass a tenant whose head request cannot start
    (``CapsAdmission.head_of_line``), which the exercise's order does not do -- on lab 6's workload that alone
    rescues quiet at a cap of 4, and the fallback would contradict the lesson it stands in for."""
    if cap_or_none is None:
        return {"scheduling_policy": "fcfs", "tenants": {t: TenantConfig(max_running=n) for t, n in max_running.items()}}
    return {"admission_policy": cap_or_none}


def deadline_policy(order_or_none, aging_s: float) -> dict:
    """Engine keyword arguments for deadline-with-aging: the learner's order, or the engine's ``"deadline"``."""
    if order_or_none is None:
        return {"scheduling_policy": "deadline", "deadline_aging_s": aging_s}
    return {"admission_policy": order_or_none, "preemption_policy": RankPreemption(order_or_none)}


# -- test doubles ------------------------------------------------------------------------------------------


class _R:
    """A stand-in request: what the policies read."""

    def __init__(self, rid: str, tenant: str, arrival: float = 0.0, deadline: float | None = None) -> None:
        self.request_id, self.tenant, self.arrival_time, self.deadline = rid, tenant, arrival, deadline
        self.priority = 0

    def __repr__(self) -> str:
        return self.request_id


def _ids(reqs) -> list[str]:
    return [r.request_id for r in reqs]


# -- exercise 1: a per-tenant cap --------------------------------------------------------------------------


def _cap_engine_run(policy: dict, seed: int = 1) -> tuple:
    """Per-step running counts of two tenants on a pool and budget too large to bind: only the seat cap does."""
    rng = random.Random(seed)
    engine = lab_engine(policy, num_blocks=2048, budget=4096, max_seqs=64)
    arrivals = []
    for i in range(18):
        tenant = "noisy" if i % 3 else "quiet"
        prompt = tuple(made_up_ids(rng, rng.randint(20, 200), MIX_IDS))
        arrivals.append(Arrival(0.004 * i, f"{tenant}-{i}", tenant, prompt, rng.randint(4, 30)))
    res = serve(engine, arrivals)
    return (len(res.ttft), tuple((r.tenant("noisy").running, r.tenant("quiet").running) for r in res.records))


_CAPS = {"noisy": 2}


@functools.cache
def _expected_cap_run() -> tuple:
    """The engine's own cap policy on the checker's workload (computed once per process, as each below)."""
    return _cap_engine_run(cap_policy(None, _CAPS))


def check_tenant_cap(cls) -> CheckResult:
    """Check ``cls(max_running: dict)`` with ``order(waiting, running) -> list`` (an AdmissionPolicy)."""
    expected_run = _expected_cap_run()
    a = [_R(f"a{i}", "a", i) for i in range(4)]
    b = [_R(f"b{i}", "b", 10 + i) for i in range(3)]

    def order(k, waiting, running, caps=None):
        return _ids(k({"a": 2, "b": 2} if caps is None else caps).order(list(waiting), list(running)))

    def untouched(k):
        waiting = a + b
        k({"a": 2, "b": 2}).order(waiting, [])
        return _ids(waiting)

    def own_copy(k):
        caps = {"a": 1, "b": 1}
        policy = k(caps)
        caps["a"] = 0  # the caller reuses its dict for another engine
        return _ids(policy.order(list(a + b), []))

    cases = [
        Case("no one running: each tenant's first max_running, in queue order",
             lambda k: order(k, a + b, []), ["a0", "a1", "b0", "b1"],
             "walk the queue in order; let a request through while its tenant has fewer than its cap"),
        Case("running requests take seats", lambda k: order(k, a + b, [_R("ra", "a")]), ["a0", "b0", "b1"],
             "count each tenant's RUNNING requests first: they hold seats already"),
        Case("a tenant at its cap waits, the other goes ahead", lambda k: order(k, a + b, [_R("x", "a"), _R("y", "a")]),
             ["b0", "b1"], "tenant a already has its cap running: none of its waiting requests may start"),
        Case("a tenant over its cap waits too", lambda k: order(k, a + b, [_R(f"x{i}", "a") for i in range(3)]),
             ["b0", "b1"], "running may already hold MORE of a tenant's requests than its cap (the grader's cases "
             "do): let a request through only while seats < cap -- a count of seats left goes below 0, and -1 is "
             "truthy"),
        Case("a tenant without a cap is not limited", lambda k: order(k, a + b, [_R("x", "b")], caps={"b": 1}),
             ["a0", "a1", "a2", "a3"], "only the tenants in max_running are capped; the others pass untouched"),
        Case("caps differ per tenant", lambda k: order(k, b + a, [], caps={"a": 1, "b": 3}), ["b0", "b1", "b2", "a0"],
             "look up the cap of each request's own tenant"),
        Case("queue order is kept (preempted requests wait at the front)",
             lambda k: order(k, [b[2], a[3], b[0]], [], caps={"a": 3, "b": 3}), ["b2", "a3", "b0"],
             "don't sort: the engine's queue order already puts preempted requests first"),
        Case("the engine's queue is not changed", untouched, _ids(a + b),
             "build a new list; never remove from or sort the list the engine passes you"),
        Case("the caps are the policy's own", own_copy, ["a0", "b0"],
             "keep a copy (dict(max_running)): a caller that changes its dict afterwards must not change your caps"),
        Case("the real engine: per-step running counts equal the engine's caps policy",
             lambda k: _cap_engine_run(cap_policy(k(dict(_CAPS)), _CAPS)), expected_run,
             "plugged in as admission_policy, your order must admit exactly what the engine's cap admits",
             show_expected=f"all {expected_run[0]} finish, never more than 2 noisy requests running"),
    ]
    return run_checks("per-tenant cap", cls, cases)


def hidden_tenant_cap(cls, seed: int) -> CheckResult:
    """Grader-only: a queue and caps drawn from ``seed`` (chosen at grading time), the expected order computed
    here from the rule, so an answer fitted to the visible cases does not pass."""
    rng = random.Random(seed)
    caps = {t: rng.randint(1, 3) for t in "ab"}  # c is uncapped
    waiting = [_R(f"w{i}", rng.choice("abc"), i) for i in range(rng.randint(4, 12))]
    running = [_R(f"r{i}", rng.choice("abc")) for i in range(rng.randint(0, 4))]
    seats = {t: sum(r.tenant == t for r in running) for t in "abc"}
    expected = []
    for r in waiting:
        if r.tenant not in caps or seats[r.tenant] < caps[r.tenant]:
            expected.append(r.request_id)
            seats[r.tenant] += 1
    return run_checks("per-tenant cap (hidden)", cls, [
        Case(f"random queue, caps {caps}", lambda k: _ids(k(dict(caps)).order(list(waiting), list(running))), expected)])


# -- exercise 2: the WFQ virtual token counter ---------------------------------------------------------------


def _wfq_engine_run(policy: dict, seed: int = 2, window: float = 1.5) -> tuple:
    """Three backlogged tenants of very different request sizes (each sends about the same tokens): who gets
    each step's tokens, and each tenant's weighted service in the first ``window`` seconds."""
    rng = random.Random(seed)
    shapes = {"long": (12, (1200, 1600), (10, 20)), "medium": (36, (300, 500), (10, 30)),
              "short": (120, (60, 150), (4, 12))}
    arrivals = []
    for i in range(120):
        for name, (n, p, o) in shapes.items():
            if i >= n:
                continue
            prompt = tuple(made_up_ids(rng, rng.randint(*p), MIX_IDS))
            arrivals.append(Arrival(0.0005 * len(arrivals), f"{name}-{i}", name, prompt, rng.randint(*o)))
    engine = lab_engine(policy, num_blocks=1024, budget=512, max_seqs=24)
    res = serve(engine, arrivals, window=window)
    service = {t: res.service(t) for t in res.tenants()}
    per_step = tuple(r.seqs for r in res.records[:400])
    return per_step, service


def backlogged(policy: dict, window: float = 1.5) -> dict:
    """Weighted token service of three backlogged tenants (12 long / 36 medium / 120 short requests, all sent
    at once) in the first ``window`` seconds (at 3 s every tenant still has work queued, equal weights or not)."""
    return _wfq_engine_run(policy, window=window)[1]


def aging_run(policy: dict) -> ServeResult:
    """Three no-deadline bulk jobs under a stream of 60 chats due 50 ms after arrival, on two seats."""
    return _deadline_engine_run(policy, result=True)


@functools.cache
def _expected_wfq_run() -> tuple:
    return _wfq_engine_run(wfq_policy(None, budget=512))


def check_virtual_token_counter(cls) -> CheckResult:
    """Check ``cls(weights, prefill_weight, decode_weight)`` with ``counters``, ``weight``, ``charge``, ``activate``."""
    expected_run = _expected_wfq_run()

    def charged(k):
        v = k({"a": 2.0}, prefill_weight=1.0, decode_weight=2.0)
        v.charge("a", 60, 0)  # in two steps: an answer that divides the running total divides the 60 twice
        v.charge("a", 40, 0)
        v.charge("b", 100, 0)
        v.charge("b", 0, 3)
        return round(v.counters["a"], 6), round(v.counters["b"], 6)

    def weighted_decode(k):
        v = k({"a": 4.0}, prefill_weight=0.5, decode_weight=3.0)
        v.charge("a", 40, 2)
        return round(v.counters["a"], 6)

    def lift(k, own, others, uncharged=(), idle=None):
        v = k({}, prefill_weight=1.0, decode_weight=2.0)
        for t, c in {**(idle or {}), **others}.items():  # idle: counters of tenants that are not active now
            v.counters[t] = c
        if own is not None:
            v.counters["new"] = own
        v.activate("new", set(others) | set(uncharged))
        # a missing counter reads as 0 (as the engine's WFQ reads it): an answer that writes only when it lifts
        # is right, and must not fail with a KeyError raised here
        return round(v.counters.get("new", 0.0), 6), {t: v.counters[t] for t in others}

    cases = [
        Case("prefill tokens, divided by the weight", charged, (50.0, 106.0),
             "counter += (prefill_weight x prefill tokens + decode_weight x output tokens) / the tenant's weight; "
             "an unlisted tenant has weight 1. Divide each charge's cost, not the counter: (counter + cost) / weight "
             "divides every earlier charge again"),
        Case("both token weights", weighted_decode, 6.5, "0.5 x 40 + 3 x 2 = 26, divided by weight 4"),
        Case("a newcomer starts at the minimum of the active tenants", lambda k: lift(k, None, {"x": 500, "y": 300}),
             (300.0, {"x": 500, "y": 300}), "not 0 (it would get the whole engine until it caught up), not the maximum"),
        Case("a returning tenant below the active minimum is lifted", lambda k: lift(k, 100.0, {"x": 500}),
             (500.0, {"x": 500}), "lift every tenant that becomes active, not only one never seen before: a tenant "
                                  "that went idle at 100 while x reached 500 would otherwise bank 400 of credit and "
                                  "take the whole engine when it returns; its counter becomes max(its own, the "
                                  "minimum)"),
        Case("a returning tenant keeps a counter that is already higher", lambda k: lift(k, 900.0, {"x": 500}),
             (900.0, {"x": 500}), "activation only ever raises a counter: take the larger of its own and the minimum"),
        Case("alone: nothing to catch up with", lambda k: lift(k, 42.0, {}), (42.0, {}),
             "with no other active tenant there is no minimum; leave the counter as it is"),
        Case("an active tenant not yet charged counts as 0", lambda k: lift(k, None, {"x": 500}, uncharged=["z"]),
             (0.0, {"x": 500}), "take the minimum over every active tenant, reading a missing counter as 0 "
                                "(counters.get(t, 0.0)): z has served nothing yet"),
        Case("an idle tenant's counter sets no floor", lambda k: lift(k, None, {"x": 500}, idle={"gone": 20}),
             (500.0, {"x": 500}), "the minimum is over the tenants in `active` only: `gone` went idle at 20 and is "
                                  "not competing now, so reading its counter would hand the newcomer 480 of credit"),
        Case("the real engine: the same steps and service as the engine's WFQ", lambda k: _wfq_engine_run(
            wfq_policy(k({}, prefill_weight=1.0, decode_weight=2.0), budget=512)), expected_run,
             "plugged into the engine's WFQ order, your counter must produce the engine's schedule, step by step",
             show_expected=f"service per tenant {expected_run[1]}"),
    ]
    return run_checks("virtual token counter", cls, cases)


def hidden_virtual_token_counter(cls, seed: int) -> CheckResult:
    rng = random.Random(seed)
    weights = {t: rng.choice([0.5, 1.0, 2.0, 3.0]) for t in "ab"}
    # a, b may both draw weight 1, and neither may be charged twice: d, weighted and charged twice whatever the
    # seed, tells dividing each charge from dividing the running total (d takes no rng draw, no activation)
    weights["d"] = 2.0
    ops: list[tuple] = [("charge", "d", 120, 1), ("charge", "d", 40, 3)]
    for _ in range(10):
        t = rng.choice("abc")
        if rng.random() < 0.3:
            ops.append(("activate", t, frozenset(rng.sample([u for u in "abc" if u != t], rng.randint(0, 2)))))
        else:
            ops.append(("charge", t, rng.randint(0, 300), rng.randint(0, 5)))
    expected: dict = {}

    def apply(op):
        if op[0] == "charge":
            _, t, p, d = op
            expected[t] = expected.get(t, 0.0) + (1.5 * p + 2.5 * d) / weights.get(t, 1.0)
        else:
            _, t, active = op
            others = [expected.get(u, 0.0) for u in active]
            if others:
                expected[t] = max(expected.get(t, 0.0), min(others))

    for op in ops:
        apply(op)
    # always end on a returning tenant that is behind: the lowest counter rejoins the others
    low = min("abc", key=lambda t: (expected.get(t, 0.0), t))
    if all(expected.get(t, 0.0) <= expected.get(low, 0.0) for t in "abc" if t != low):
        ops.append(("charge", "c" if low != "c" else "a", 200, 0))  # all equal: put someone ahead first
        apply(ops[-1])
    ops.append(("activate", low, frozenset(t for t in "abc" if t != low)))
    apply(ops[-1])

    def run(k):
        v = k(weights, prefill_weight=1.5, decode_weight=2.5)
        for op in ops:
            if op[0] == "charge":
                v.charge(*op[1:])
            else:
                v.activate(op[1], set(op[2]))
        return {t: round(v.counters.get(t, 0.0), 6) for t in "abcd"}

    return run_checks("virtual token counter (hidden)", cls, [
        Case("random charges and activations", run, {t: round(expected.get(t, 0.0), 6) for t in "abcd"},
             "charge adds weighted tokens / weight; activate lifts the tenant (new or returning) to the minimum "
             "of the other active tenants, never lowering it")])


# -- exercise 3: deadline order with aging ---------------------------------------------------------------


def _deadline_engine_run(policy: dict, seed: int = 3, result: bool = False):
    """A stream of tight-deadline chats over a few no-deadline bulk jobs on two seats (``max_seqs=2``): the start
    order and how many finished (or, with ``result``, the whole :class:`ServeResult`)."""
    rng = random.Random(seed)
    arrivals = [Arrival(0.0, f"bulk-{i}", "bulk", tuple(made_up_ids(rng, 300, MIX_IDS)), 40)
                for i in range(3)]
    for i in range(60):
        t = round(0.02 * i, 6)
        arrivals.append(Arrival(t, f"chat-{i}", "chat", tuple(made_up_ids(rng, 60, MIX_IDS)), 20,
                                deadline=round(t + 0.05, 6)))
    engine = lab_engine(policy, num_blocks=512, budget=512, max_seqs=2)
    res = serve(engine, arrivals)
    if result:
        return res
    return tuple(sorted(res.first_step, key=lambda k: (res.first_step[k], k))), len(res.ttft)


@functools.cache
def _expected_deadline_run() -> tuple:
    return _deadline_engine_run(deadline_policy(None, 0.5))


def check_deadline_aging(cls) -> CheckResult:
    """Check ``cls(aging_s)`` with ``key(req)``, ``rank(req)`` and ``order(waiting, running)``."""
    expected_run = _expected_deadline_run()

    def keys(k, reqs, aging=10.0):
        return [round(k(aging).key(r), 6) for r in reqs]

    def order(k, reqs, aging=10.0):
        return _ids(k(aging).order(list(reqs), []))

    tight = _R("tight", "chat", 1.0, deadline=1.5)
    loose = _R("loose", "bulk", 0.0, deadline=40.0)
    none = _R("none", "bulk", 0.5)
    expired = _R("expired", "chat", 2.0, deadline=-3.0)
    past_positive = _R("past", "chat", 2.0, deadline=1.0)
    far_late = _R("far-late", "bulk", 2.0, deadline=40.0)

    def untouched(k):
        waiting = [loose, tight, none]
        k(10.0).order(waiting, [])
        return _ids(waiting)

    running = [_R("bulk", "bulk", 0.0), _R("urgent", "chat", 1.0, deadline=1.5), _R("soon", "chat", 0.5, deadline=4.0)]

    def victim(k):
        return RankPreemption(k(10.0)).choose_victim(list(running)).request_id

    expected_victim = RankPreemption(DeadlineAdmission(10.0)).choose_victim(list(running)).request_id

    cases = [
        Case("the key is the deadline", lambda k: keys(k, [tight]), [1.5],
             "a request with a deadline inside the aging window is ordered by its deadline"),
        Case("no deadline: arrival + aging_s", lambda k: keys(k, [none]), [10.5],
             "a request without a deadline is due aging_s after it arrived"),
        # loose arrived at 0.0, where arrival + aging_s and aging_s agree: far_late tells them apart
        Case("a far deadline is pulled in to arrival + aging_s", lambda k: keys(k, [loose, far_late]), [10.0, 12.0],
             "aging: nobody's key is later than its arrival + aging_s (take the smaller of the two); the bound counts "
             "from the request's own arrival_time, not from time 0"),
        # past_positive: past when it arrived, though not negative
        Case("an expired deadline does not jump ahead of its own arrival", lambda k: keys(k, [expired, past_positive]),
             [2.0, 2.0], "a deadline already past when the request arrived counts as its arrival time (the larger of "
                         "the two) -- any deadline before arrival_time, not only a negative one"),
        Case("a deadline of 0.0 is a deadline", lambda k: keys(k, [_R("zero", "chat", 0.0, deadline=0.0)]), [0.0],
             "test `req.deadline is None`, not its truth: 0.0 is falsy but a real (very urgent) deadline"),
        Case("earliest key first", lambda k: order(k, [loose, tight, none]), ["tight", "loose", "none"],
             "sort the waiting requests by key, smallest first"),
        Case("aging_s is the one given to __init__", lambda k: order(k, [loose, none], aging=0.1), ["loose", "none"],
             "with aging 0.1 s, loose is due at 0.1 and none at 0.6"),
        Case("ties go to the earlier arrival", lambda k: order(k, [_R("late", "x", 3.0, 5.0), _R("z-early", "x", 1.0, 5.0)]),
             ["z-early", "late"], "rank = (key, arrival time): equal keys keep first come, first served"),
        Case("rank: smaller is more urgent", lambda k: _ids(sorted(
            [loose, _R("late", "x", 3.0, 5.0), tight, none, _R("early", "x", 1.0, 5.0)], key=k(10.0).rank)),
             ["tight", "early", "late", "loose", "none"],
             "rank(req) = (key, arrival time), smaller = more urgent: the engine sorts by rank, smallest first (the "
             "most urgent prefill gets the token budget first), and preempts the running request with the largest "
             "rank. Don't negate it or put the arrival time first: the engine reads rank, not only order()"),
        Case("the engine preempts the least urgent running request", victim, expected_victim,
             "RankPreemption(your policy) evicts max(running, key=rank): with rank = (key, arrival time) that is "
             "the request due last (here the one without a deadline, due at arrival + aging_s), never the urgent one"),
        Case("the engine's queue is not changed", untouched, ["loose", "tight", "none"],
             "return a new sorted list (sorted(...)), don't sort the engine's list in place"),
        Case("the real engine: start order under a stream of tight deadlines",
             lambda k: _deadline_engine_run(deadline_policy(k(0.5), 0.5)), expected_run,
             "plugged in as admission_policy (with RankPreemption), your order must start requests as the engine does",
             show_expected="the engine's start order; all 63 finish",
             diagnose=lambda got: _first_difference(got, expected_run)),
    ]
    return run_checks("deadline with aging", cls, cases)


def _first_difference(got, expected) -> str | None:
    """Where two (start order, finished) runs part: the first start that differs, named, instead of two long tuples."""
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], tuple)):
        return None
    for i, (mine, want) in enumerate(zip(got[0], expected[0])):
        if mine != want:
            return (f"the orders part at start {i + 1}: yours started {mine}, the engine {want}. Rank by "
                    "(key, arrival): a request without a deadline keys on its arrival + aging; check the clamp")
    if got[1] != expected[1]:
        return f"{got[1]} requests finished, not {expected[1]}: a request your order never admits waits for ever"
    return None


def hidden_deadline_aging(cls, seed: int) -> CheckResult:
    rng = random.Random(seed)
    aging = rng.choice([0.2, 1.0, 5.0])
    reqs = [_R(f"q{i}", "t", round(rng.uniform(0, 3), 3), rng.choice([None, round(rng.uniform(-1, 8), 3)]))
            for i in range(10)]

    def key(r):
        latest = r.arrival_time + aging
        return max(r.arrival_time, latest if r.deadline is None else min(r.deadline, latest))

    expected = _ids(sorted(reqs, key=lambda r: (key(r), r.arrival_time)))
    # The random queue need not hold a deadline between 0 and its arrival, nor a far deadline on a late arrival,
    # and a wrong clamp there may leave the order alone: these two are in every seed's key case.
    pinned = [_R("past", "t", 2.5, 0.5), _R("far", "t", 2.0, round(2.0 + 3 * aging, 3))]
    return run_checks("deadline with aging (hidden)", cls, [
        Case(f"keys of a random queue, aging {aging}", lambda k: [round(k(aging).key(r), 6) for r in reqs + pinned],
             [round(key(r), 6) for r in reqs + pinned],
             "key = the deadline clamped into [arrival_time, arrival_time + aging_s]; no deadline: arrival + aging_s"),
        Case(f"random queue, aging {aging}", lambda k: _ids(k(aging).order(list(reqs), [])), expected),
        Case(f"random queue sorted by rank, aging {aging}", lambda k: _ids(sorted(reqs, key=k(aging).rank)), expected,
             "rank(req) = (key, arrival time): smaller is more urgent")])


# -- quiz helpers --------------------------------------------------------------------------------------------


def quiz_vtc_after_prefill() -> float:
    """The engine's WFQ counter of a weight-2 tenant after a 600-token prefill (which samples the first token)
    and 9 decode steps, with the default weights (prefill 1, decode 2)."""
    from types import SimpleNamespace as NS

    adm = WFQAdmission(EngineConfig(device="cpu", tenants={"t": TenantConfig(weight=2.0)}))
    req = NS(tenant="t", prompt_token_ids=[0] * 600, num_tokens_computed_once=0)
    adm.observe(NS(seqs=[NS(request=req, is_decode=False, start=0, num_tokens=600, samples=True)]), 0.0)
    for _ in range(9):
        adm.observe(NS(seqs=[NS(request=req, is_decode=True, num_tokens=1, samples=True)]), 0.0)
    return adm.counter("t")


def quiz_jain_two_to_one() -> float:
    """Jain's index when one of two tenants gets twice the other's service."""
    return round(jain([2.0, 1.0]), 2)


LAB = Lab(6, "lab06_fairness", "Fairness", widgets=(), exercises=(
    Exercise("tenant_cap", "TenantCap", check_tenant_cap, points=1, hidden=hidden_tenant_cap, mutants=(
        ("off by one: cap + 1 seats", "seats.get(r.tenant, 0) < cap:", "seats.get(r.tenant, 0) <= cap:"),
        ("a tenant over its cap is let through", "seats.get(r.tenant, 0) < cap:", "seats.get(r.tenant, 0) != cap:"),
        ("keeps the caller's dict", "self.max_running = dict(max_running)", "self.max_running = max_running"),
        ("ignores the running requests", "for r in running:\n            seats[r.tenant]",
         "for r in []:\n            seats[r.tenant]"),
        ("does not count what it lets through",
         "                out.append(r)\n                seats[r.tenant] = seats.get(r.tenant, 0) + 1",
         "                out.append(r)"),
        ("one count for the whole engine", "seats.get(r.tenant, 0) < cap:", "sum(seats.values()) < cap:"),
        ("uncapped tenants are blocked", "if cap is None or ", "if cap is not None and "),
        ("a missing cap means zero seats", "self.max_running.get(r.tenant)", "self.max_running.get(r.tenant, 0)"),
        ("the same cap for everyone", "cap = self.max_running.get(r.tenant)",
         "cap = min(self.max_running.values())"),
        ("sorts by arrival", "for r in waiting:", "for r in sorted(waiting, key=lambda r: r.arrival_time):"),
        ("changes the engine's queue", "        out = []\n", "        out = waiting\n        waiting = list(waiting)\n"),
    )),
    Exercise("virtual_token_counter", "VirtualTokenCounter", check_virtual_token_counter, points=2,
             hidden=hidden_virtual_token_counter, mutants=(
        ("no weight", "cost / self.weight(tenant)", "cost"),
        ("multiplies by the weight", "cost / self.weight(tenant)", "cost * self.weight(tenant)"),
        ("decode weight on prefill tokens", "self.prefill_weight * prefill_tokens", "self.decode_weight * prefill_tokens"),
        ("ignores output tokens", " + self.decode_weight * output_tokens", ""),
        ("overwrites instead of adding", "self.counters.get(tenant, 0.0) + cost", "cost"),
        ("newcomer starts at the maximum", "max(self.counters.get(tenant, 0.0), min(others))",
         "max(self.counters.get(tenant, 0.0), max(others))"),
        ("activation can lower a counter", "max(self.counters.get(tenant, 0.0), min(others))", "min(others)"),
        ("no activation at all", "        if others:\n", "        if False:\n"),
        ("the minimum over every tenant seen, idle ones too",
         "others = [self.counters.get(t, 0.0) for t in active if t != tenant]",
         "others = [self.counters.get(t, 0.0) for t in set(active) | set(self.counters) if t != tenant]"),
        ("a tenant alone takes the minimum of nobody", "if others:\n            self.counters[tenant]",
         "self.counters[tenant]"),
        ("unlisted tenants weigh 0.5", "self.weights.get(tenant, 1.0)", "self.weights.get(tenant, 0.5)"),
    )),
    Exercise("deadline_aging", "AgingDeadline", check_deadline_aging, points=2, hidden=hidden_deadline_aging, mutants=(
        ("no aging", "latest if req.deadline is None else min(req.deadline, latest)",
         "math.inf if req.deadline is None else req.deadline"),
        ("a far deadline is not pulled in", "min(req.deadline, latest)", "req.deadline"),
        ("later of deadline and aging", "min(req.deadline, latest)", "max(req.deadline, latest)"),
        ("no-deadline requests jump the queue", "latest if req.deadline is None", "req.arrival_time if req.deadline is None"),
        ("expired deadlines jump ahead", "return max(req.arrival_time, due)", "return due"),
        ("latest first", "sorted(waiting, key=self.rank)", "sorted(waiting, key=self.rank, reverse=True)"),
        ("ties by the newest", "return (self.key(req), req.arrival_time)", "return (self.key(req), -req.arrival_time)"),
        ("ties by request id", "return (self.key(req), req.arrival_time)", "return (self.key(req), req.request_id)"),
        ("hard-coded aging", "self.aging_s = aging_s", "self.aging_s = 30.0"),
        ("sorts the engine's queue in place", "return sorted(waiting, key=self.rank)",
         "waiting.sort(key=self.rank)\n        return waiting"),
    )),
))
