"""Checkers for lab 5 (preemption): a victim chooser, the swap-or-recompute rule, a reject rule at the door.

Also the lab's shared measurement harness: one seeded, overloaded, multi-tenant
workload (:func:`overload_workload`), an arrival loop on the engine's virtual
clock that asks a *door* rule before every ``add_request`` (:func:`serve`), and
the summary the lab prints (:class:`ServeResult`).  The quiz answers and the
tests call the same functions, so the numbers in the notebook cannot drift.  The module ends
with the lab's registration (:data:`LAB`, see :mod:`minivllm.labs.registry`).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from minivllm.arrival import Arrival, made_up_ids
from minivllm.config import PCIE4_X16_BYTES_PER_S
from minivllm.labs.checkers import Case, CheckResult, run_checks
from minivllm.labs.registry import Exercise, Lab
from minivllm.labs.workloads import GPU_LIKE
from minivllm.metrics.stats import nearest_rank
from minivllm.request import Request, RequestStatus
from minivllm.sampling_params import SamplingParams
from minivllm.sched.scheduler import PreemptionCosts
from minivllm.sim.executor import SimulatedExecutor

# A GPU-like step cost (lab 1's, :data:`workloads.GPU_LIKE`) and a Llama-8B-like KV block: 16 tokens x 128 KiB per
# token (fp16) = 2 MiB.
PREFILL_TOKENS_PER_S = 1 / GPU_LIKE["per_token_s"]  # 50,000 prompt tokens per second
BLOCK_SIZE = 16
KV_BYTES_PER_BLOCK = 16 * 128 * 1024
PCIE4_BYTES_PER_S = PCIE4_X16_BYTES_PER_S


def executor(link_bytes_per_s: float = PCIE4_BYTES_PER_S) -> SimulatedExecutor:
    """The simulated GPU of this lab, with a host link of ``link_bytes_per_s``."""
    return SimulatedExecutor(**GPU_LIKE, kv_bytes_per_block=KV_BYTES_PER_BLOCK, swap_bytes_per_s=link_bytes_per_s)


# -- the workload and the arrival loop ---------------------------------------------------


TENANTS = {  # tenant: (share of arrivals, prompt tokens, output tokens)
    "chat": (0.5, (32, 192), (32, 160)),
    "agent": (0.3, (256, 640), (64, 192)),
    "batch": (0.2, (512, 1024), (128, 320)),
}


def overload_workload(n: int = 96, *, rate_per_s: float = 24.0, seed: int = 0) -> list[Arrival]:
    """``n`` requests from three tenants arriving as a Poisson process of ``rate_per_s``, reproducible."""
    rng = random.Random(seed)
    names = list(TENANTS)
    weights = [TENANTS[t][0] for t in names]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate_per_s)
        tenant = rng.choices(names, weights)[0]
        out.append(_draw(rng, tenant, t, f"{tenant}-{i}"))
    return out


def _draw(rng: random.Random, tenant: str, t: float, request_id: str) -> Arrival:
    """One request of ``tenant`` at time ``t``, its lengths drawn from :data:`TENANTS` (prompt length, prompt
    tokens, output length: that order, so every workload built on it reproduces from its seed)."""
    _, (p_lo, p_hi), (o_lo, o_hi) = TENANTS[tenant]
    prompt = tuple(made_up_ids(rng, rng.randint(p_lo, p_hi)))
    return Arrival(round(t, 6), request_id, tenant, prompt, rng.randint(o_lo, o_hi))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank), 0.0 for no values."""
    return nearest_rank(values, q, 0.0)


@dataclass
class ServeResult:
    """What one run of :func:`serve` measured."""

    stats: dict
    latency: dict[str, float] = field(default_factory=dict)  # request id -> arrival to last token (s)
    ttft: dict[str, float] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)  # request id -> times preempted
    tenant_of: dict[str, str] = field(default_factory=dict)
    rejected_at_door: list[str] = field(default_factory=list)
    rejected_by_engine: list[str] = field(default_factory=list)
    makespan: float = 0.0
    output_tokens: int = 0
    steps: int = 0
    # running requests after each step (the step log's ``running``), averaged over steps: not quite the batch --
    # a running request the token budget left out of a step counts, one that finished in it does not
    mean_running: float = 0.0

    @property
    def num_rejected(self) -> int:
        return len(self.rejected_at_door) + len(self.rejected_by_engine)

    def p99(self) -> float:
        return percentile(list(self.latency.values()), 99)

    def ttft_p99(self) -> float:
        return percentile(list(self.ttft.values()), 99)

    def preemption_rate(self, tenant: str) -> float:
        """Preemptions per served request of ``tenant``."""
        served = [r for r in self.latency if self.tenant_of[r] == tenant]
        return sum(self.preemptions[r] for r in served) / len(served) if served else 0.0

    def row(self) -> dict:
        s = self.stats
        return {"preemptions": s["num_preemptions"], "recomputed tok": s["recomputed_tokens"],
                "swap MB": (s["swapped_out_bytes"] + s["swapped_in_bytes"]) / 1e6, "rejected": self.num_rejected,
                "p99 latency s": self.p99(), "tokens/s": self.output_tokens / self.makespan if self.makespan else 0.0}


def serve(engine, arrivals: Sequence[Arrival], door: Callable[[dict], bool] | None = None,
          max_steps: int = 200_000, on_step: Callable[[Any], None] | None = None) -> ServeResult:
    """Feed ``arrivals`` to ``engine`` on its virtual clock; ``door(engine.stats())`` may turn one away.

    Each arrival is offered when the engine's clock reaches its time (an idle
    engine's clock jumps to the next arrival).  ``door`` returning True is a
    429: the request is never added.  ``on_step(engine)`` runs after every
    step (an observer: it must not change the engine).  Returns latencies,
    preemptions per request and the engine's counters at the end.
    """
    ex = engine.executor
    res = ServeResult(stats={})
    pending = list(arrivals)
    i = 0
    for _ in range(max_steps):
        if i < len(pending) and not engine.has_unfinished_requests() and ex.clock < pending[i].time:
            ex.clock = pending[i].time  # idle: jump to the next arrival
        while i < len(pending) and pending[i].time <= ex.clock:
            a = pending[i]
            i += 1
            res.tenant_of[a.request_id] = a.tenant
            if door is not None and door(engine.stats()):
                res.rejected_at_door.append(a.request_id)
                continue
            engine.add_request({"prompt_token_ids": list(a.prompt)},
                               SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
                               a.request_id, tenant=a.tenant, priority=a.priority, arrival_time=a.time)
        if not engine.has_unfinished_requests():
            if i >= len(pending):
                break
            continue
        for out in engine.step():
            if not out.finished:
                continue
            if out.outputs[0].finish_reason == "rejected":
                res.rejected_by_engine.append(out.request_id)
                continue
            m = out.metrics
            res.latency[out.request_id] = m.finished_time - m.arrival_time
            res.ttft[out.request_id] = m.ttft
            res.preemptions[out.request_id] = m.num_preemptions
            res.output_tokens += len(out.outputs[0].token_ids)
        if on_step is not None:
            on_step(engine)
    res.stats = engine.stats()
    res.steps = len(engine.step_log)
    res.mean_running = sum(e["running"] for e in engine.step_log) / max(1, len(engine.step_log))
    res.makespan = ex.clock - (arrivals[0].time if arrivals else 0.0)
    return res


def lab_engine(*, num_blocks: int = 384, preemption_mode: str = "recompute", num_cpu_blocks: int = 2048,
               link_bytes_per_s: float = PCIE4_BYTES_PER_S, max_num_seqs: int = 48,
               max_num_batched_tokens: int = 1024, **options: Any):
    """The lab's simulated engine: a real ``LLMEngine`` on :func:`executor`."""
    from minivllm.labs.workloads import sim_engine

    if preemption_mode in ("swap", "auto"):
        options.setdefault("num_cpu_blocks_override", num_cpu_blocks)
    return sim_engine(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=max_num_batched_tokens, model_max_len=2048,
                      preemption_mode=preemption_mode, executor=executor(link_bytes_per_s), **options)


# -- preempted again and again: the anti-thrash guard -----------------------------------

STARVE_CHAT_RATE = 10.0  # chat requests per second: the pool runs dry now and then, the server is not overloaded
STARVE_BATCH = (1500, 200)  # the one batch job: prompt tokens, output tokens


def starvation_workload(stream_s: float, *, seed: int = 1) -> list[Arrival]:
    """One long batch job at t = 1 s (priority 1) inside ``stream_s`` seconds of Poisson chat (priority 0).

    Chat requests are drawn like :data:`TENANTS`' chat; the batch job is the
    only request of its tenant, so its latency is the one number to watch.
    """
    rng = random.Random(seed)
    prompt, output = STARVE_BATCH
    out = [Arrival(1.0, "batch-job", "batch", tuple(made_up_ids(rng, prompt)), output,
                   priority=1)]
    t, i = 0.0, 0
    while (t := t + rng.expovariate(STARVE_CHAT_RATE)) <= stream_s:
        out.append(_draw(rng, "chat", t, f"chat-{i}"))
        i += 1
    return sorted(out, key=lambda a: a.time)


def starvation_run(stream_s: float, protect_after: int, *, seed: int = 1) -> ServeResult:
    """:func:`starvation_workload` under priority scheduling, recompute mode, with the anti-thrash guard
    ``preemption_protect_after=protect_after`` (0 turns it off).

    A waiting chat request may preempt the running batch job to get blocks
    (``PriorityAdmission.may_preempt_for``), and the priority victim rule picks
    the batch job whenever the pool runs dry.  A small pool (192 blocks) and a
    small step (256 tokens, so the 1,500-token prompt takes at least six steps
    to prefill, more while chat decodes share them) make every such preemption
    throw work away.
    """
    engine = lab_engine(num_blocks=192, max_num_batched_tokens=256, scheduling_policy="priority",
                        preemption_protect_after=protect_after)
    return serve(engine, starvation_workload(stream_s, seed=seed))


# -- the host tier: how big it must be, and how long victims stay in it -----------------


@dataclass(frozen=True)
class HostStay:
    """One swapped-out victim's stay in the host tier: out at the end of one step, back in at a later one."""

    request_id: str
    blocks: int
    out_step: int
    in_step: int
    out_time: float
    in_time: float

    @property
    def wait_s(self) -> float:
        return self.in_time - self.out_time

    @property
    def wait_steps(self) -> int:
        return self.in_step - self.out_step


@dataclass(frozen=True)
class SwapAttempt:
    """One preemption in swap mode: the blocks the victim needed in the host tier, the tier's free blocks at
    that moment, and whether it went (``swapped``) or fell back to recompute."""

    time: float
    request_id: str
    blocks: int
    host_free: int
    swapped: bool


@dataclass
class HostTierRun:
    """What :func:`host_tier_run` saw: the serve result plus the host tier step by step."""

    num_cpu_blocks: int
    result: ServeResult
    link_bytes_per_s: float
    attempts: list[SwapAttempt] = field(default_factory=list)  # every preemption, in order
    occupancy: list[tuple[float, int]] = field(default_factory=list)  # (clock after a step, host blocks in use)
    stays: list[HostStay] = field(default_factory=list)
    admitted_while_swapped: int = 0  # newcomers started while a victim waited in the host tier (FCFS: 0)

    @property
    def swapped(self) -> list[SwapAttempt]:
        return [a for a in self.attempts if a.swapped]

    @property
    def fell_back(self) -> list[SwapAttempt]:
        """Preemptions that wanted to swap and were recomputed: the host tier had no room for all their blocks."""
        return [a for a in self.attempts if not a.swapped]

    @property
    def peak_blocks(self) -> int:
        return max((b for _, b in self.occupancy), default=0)

    def block_seconds(self) -> tuple[float, float]:
        """Host memory held over time, two ways: the area under the occupancy curve, and the sum over
        stays of blocks x wait.  They are equal (Little's law: mean occupancy = swap rate x time in the tier)."""
        area = sum(b * (t1 - t0) for (t0, b), (t1, _) in zip(self.occupancy, self.occupancy[1:]))
        return area, sum(s.blocks * s.wait_s for s in self.stays)

    def give_way_s(self) -> float:
        """Device time spent making room: prefill of recomputed tokens plus link time of swapped blocks."""
        s = self.result.stats
        return (s["recomputed_tokens"] / PREFILL_TOKENS_PER_S
                + (s["swapped_out_bytes"] + s["swapped_in_bytes"]) / self.link_bytes_per_s)


def host_tier_run(num_cpu_blocks: int, arrivals: Sequence[Arrival] | None = None, *,
                  link_bytes_per_s: float = PCIE4_BYTES_PER_S, **options: Any) -> HostTierRun:
    """Serve ``arrivals`` (default: :func:`overload_workload`) in swap mode with a host tier of ``num_cpu_blocks``.

    It watches the engine without changing it.  Every swap attempt is recorded
    as the KV manager's ``swap_out`` is called: the victim's blocks, the tier's
    free blocks, the outcome (swap mode falls back to recompute when they do
    not all fit).  After every step it records the tier's occupancy, when each
    victim left and came back, and whether a new request started while a victim
    was still waiting in the tier.
    """
    from minivllm.request import RequestStatus

    engine = lab_engine(preemption_mode="swap", num_cpu_blocks=num_cpu_blocks, link_bytes_per_s=link_bytes_per_s,
                        **options)
    run = HostTierRun(num_cpu_blocks, ServeResult(stats={}), link_bytes_per_s)
    kv = engine.scheduler.kv
    swap_out = kv.swap_out

    def recorded_swap_out(req) -> bool:
        blocks = -(-req.num_computed_tokens // kv.block_size)
        free = kv.cpu_pool.num_free if kv.cpu_pool is not None else 0
        went = swap_out(req)
        run.attempts.append(SwapAttempt(engine.executor.clock, req.request_id, blocks, free, went))
        return went

    waiting: dict[str, tuple[int, float, int]] = {}  # victim in the host tier -> (out step, out time, blocks)
    started: set[str] = set()

    def observe(engine) -> None:
        rec = engine.step_log[-1]
        step, now = len(engine.step_log), engine.executor.clock
        in_tier = {r.request_id: r for r in engine.scheduler.waiting if r.status is RequestStatus.SWAPPED}
        newcomers = [rid for rid in rec.seq_ids if rid not in started]
        started.update(rec.seq_ids)
        if newcomers and any(rid in in_tier for rid in waiting):  # waited through this step, passed by a newcomer
            run.admitted_while_swapped += len(newcomers)
        for rid in list(waiting):
            if rid not in in_tier:
                out_step, out_time, blocks = waiting.pop(rid)
                run.stays.append(HostStay(rid, blocks, out_step, step, out_time, now))
        for rid, req in in_tier.items():
            waiting.setdefault(rid, (step, now, len(req.cpu_block_ids)))
        run.occupancy.append((now, sum(len(r.cpu_block_ids) for r in in_tier.values())))

    kv.swap_out = recorded_swap_out
    try:
        run.result = serve(engine, overload_workload() if arrivals is None else arrivals, on_step=observe)
    finally:
        del kv.swap_out
    return run


# -- the engine-side fallbacks (used by the lab until a checker passes) -------------------


class _LeastWorkRank:
    """A rank for the engine's :class:`~minivllm.sched.fairness.RankPreemption` (worst rank = victim):
    unprotected tenants rank worse than protected ones, then fewer computed tokens rank worse."""

    def __init__(self, protected: set) -> None:
        self.protected = protected

    def rank(self, req) -> tuple:
        return (req.tenant not in self.protected, -req.num_computed_tokens)


class ReferenceVictim:
    """The lab's fallback victim policy: the engine's ``RankPreemption`` (it preempts the running request
    its policy ranks worst, the newest among ties) driven by a protected-tenants-then-least-work rank."""

    def __init__(self, protected_tenants: Sequence[str] = ("chat",)) -> None:
        from minivllm.sched.fairness import RankPreemption

        self.protected = set(protected_tenants)
        self._engine = RankPreemption(_LeastWorkRank(self.protected))

    def choose_victim(self, running):
        return self._engine.choose_victim(running)


def reference_swap_or_recompute(num_tokens: int, num_blocks: int, *, bytes_per_block: int, link_bytes_per_s: float,
                                prefill_tokens_per_s: float) -> str:
    """The engine's :class:`PreemptionCosts` rule, as exercise 2 asks for it."""
    costs = PreemptionCosts(bytes_per_block, link_bytes_per_s, prefill_tokens_per_s)
    return "swap" if costs.prefers_swap(num_tokens, num_blocks) else "recompute"


def engine_should_reject(stats: dict, max_waiting: int, min_free_blocks: int) -> bool:
    """The server's own door (``minivllm serve --max-waiting-requests``): :class:`minivllm.server.door.DoorRule`."""
    from minivllm.server.door import DoorRule

    return DoorRule(max_waiting, min_free_blocks).closed(stats)


class RuleCosts:
    """A :class:`~minivllm.interfaces.PreemptionCostModel` around a ``swap_or_recompute`` function."""

    def __init__(self, rule: Callable[..., str], *, bytes_per_block: int = KV_BYTES_PER_BLOCK,
                 link_bytes_per_s: float = PCIE4_BYTES_PER_S, prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S):
        self.rule = rule
        self.link = dict(bytes_per_block=bytes_per_block, link_bytes_per_s=link_bytes_per_s,
                         prefill_tokens_per_s=prefill_tokens_per_s)

    def prefers_swap(self, num_tokens: int, num_blocks: int) -> bool:
        return self.rule(num_tokens, num_blocks, **self.link) == "swap"


# -- exercise 1: the victim chooser ------------------------------------------------------


class _Running(Request):
    """A real :class:`Request` (any of its fields may be read) that prints as its id in a checker's report."""

    def __repr__(self) -> str:
        return self.request_id


def _R(request_id: str, tenant: str, computed: int, prompt: int | None = None) -> Request:
    """A running request with ``computed`` tokens in KV: still prefilling when ``computed < prompt``, else decoding
    (``prompt`` defaults to ``computed``), with the blocks that hold them."""
    prompt = prompt if prompt is not None else computed
    req = _Running(request_id, list(range(1, prompt + 1)), SamplingParams(max_tokens=1000, ignore_eos=True), 0.0,
                   tenant=tenant, max_tokens=1000, status=RequestStatus.RUNNING)
    req.output_token_ids = list(range(2, 2 + max(0, computed + 1 - prompt)))  # the decode's input: one uncomputed
    req.num_computed_tokens = computed
    req.block_ids = list(range(-(-computed // 16)))
    return req


def _victim_run(cls, seed: int = 5) -> tuple:
    """``(requests finished, victims in order)`` of a small overloaded engine run (swap mode); all 10 finish."""
    from minivllm.labs.workloads import sim_engine

    eng = sim_engine(num_blocks=40, block_size=4, max_num_seqs=8, max_num_batched_tokens=48, model_max_len=128,
                     preemption_mode="swap", num_cpu_blocks_override=64, preemption_policy=cls(("chat",)))
    rng = random.Random(seed)
    for i in range(10):
        tenant = "chat" if i % 2 == 0 else "batch"
        prompt = made_up_ids(rng, rng.randint(6, 30))
        eng.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, ignore_eos=True),
                        f"{tenant}{i}", tenant=tenant)
    finished = 0
    for _ in range(2000):
        if not eng.has_unfinished_requests():
            break
        finished += sum(1 for o in eng.step() if o.finished)
    victims = [v for e in eng.step_log for v in e["preempted"]]
    return finished, victims


@functools.cache
def _expected_victim_run() -> tuple:
    """The reference policy's swap-mode run (computed once per process: mutation tests call the checker often)."""
    return _victim_run(ReferenceVictim)


def check_victim_policy(cls) -> CheckResult:
    """Check a PreemptionPolicy class ``cls(protected_tenants)`` with ``choose_victim(running)``."""
    expected_run = _expected_victim_run()
    a, b, c = _R("a", "batch", 40), _R("b", "batch", 12), _R("c", "batch", 25)
    chat_small, batch_big = _R("chat", "chat", 4), _R("big", "batch", 300)
    voice_small = _R("voice", "voice", 2)

    def pick(k, running, protected=("chat",)):
        return k(protected).choose_victim(running)

    def untouched(k):
        running = [a, b, c]
        pick(k, running)
        return running == [a, b, c]

    def same_object(k):
        running = [_R("x", "batch", 9), _R("y", "batch", 3)]
        return pick(k, running) is running[1]

    tie = [_R("old", "batch", 16), _R("mid", "batch", 16), _R("new", "batch", 16)]
    prefill = [_R("long-prompt", "batch", 16, prompt=400), _R("short", "batch", 30, prompt=20)]
    fresh = [_R("some", "batch", 12), _R("fresh", "batch", 0, prompt=40), _R("more", "batch", 30)]
    cases = [
        Case("one running request is the victim", lambda k: pick(k, [a]).request_id, "a",
             "with a single candidate there is no choice to make"),
        Case("the least work lost", lambda k: pick(k, [a, b, c]).request_id, "b",
             "recompute throws away num_computed_tokens; pick the request with the FEWEST"),
        Case("a tie goes to the newest", lambda k: pick(k, tie).request_id, "new",
             "running is in admission order: among equals, the LAST one (it has waited least)"),
        Case("nothing computed yet is the least work", lambda k: pick(k, fresh).request_id, "fresh",
             "a request admitted this step has 0 tokens in KV: 0 is the fewest, not 'no value yet' -- compare "
             "with `is None` (or use min), not with `not best`",
             diagnose=lambda got: ("'some' has the shortest prompt and the fewest tokens in all, but 12 of them in "
                                   "the KV cache; 'fresh' has 0 there: the work a recompute loses is "
                                   "num_computed_tokens, not the prompt length or num_tokens"
                                   if got == "some" else None)),
        Case("computed tokens, not prompt length", lambda k: pick(k, prefill).request_id, "long-prompt",
             "a long prompt still in chunked prefill has computed few tokens: read num_computed_tokens"),
        Case("a protected tenant is spared", lambda k: pick(k, [chat_small, batch_big]).request_id, "big",
             "drop requests whose tenant is protected BEFORE looking for the least work"),
        Case("other tenants can be protected", lambda k: pick(k, [chat_small, batch_big], ("batch",)).request_id, "chat",
             "use the tenants given to __init__, not a hard-coded name"),
        Case("every listed tenant is protected", lambda k: pick(k, [voice_small, chat_small, batch_big],
                                                                ("chat", "voice")).request_id, "big",
             "protected_tenants may name several tenants: spare every one of them, not only the first "
             "(keep them all, e.g. in a set)"),
        # q is neither the newest nor the oldest: the engine's default (running[-1]) for an all-protected set fails here
        Case("everyone protected: still a victim",
             lambda k: pick(k, [_R("p", "chat", 50), _R("q", "chat", 20), _R("s", "chat", 35)]).request_id, "q",
             "the engine needs a victim: when all are protected, choose among all of them by the same rules "
             "(least work, newest on a tie)"),
        Case("returns one of the running requests, unchanged", lambda k: (same_object(k), untouched(k)), (True, True),
             "return the request object itself, and don't sort or pop the list the engine passed you"),
        Case("the real engine: victims of a swap-mode run", lambda k: _victim_run(k), expected_run,
             "plugged into the engine, the same rule must pick the same victims step by step",
             show_expected=f"all 10 finish; victims {expected_run[1]}"),
    ]
    return run_checks("victim policy", cls, cases)


# -- exercise 2: swap or recompute -------------------------------------------------------


def _auto_run(rule, gbps: float) -> dict:
    eng = lab_engine(num_blocks=96, preemption_mode="auto", link_bytes_per_s=gbps * 1e9, max_num_seqs=16,
                     max_num_batched_tokens=512,
                     preemption_cost_model=RuleCosts(rule, link_bytes_per_s=gbps * 1e9))
    res = serve(eng, overload_workload(16, rate_per_s=50.0, seed=3))
    s = res.stats
    return {k: s[k] for k in ("num_swap_preemptions", "num_recompute_preemptions", "swapped_out_blocks",
                              "recomputed_tokens")}


def check_swap_or_recompute(fn) -> CheckResult:
    """Check ``fn(num_tokens, num_blocks, *, bytes_per_block, link_bytes_per_s, prefill_tokens_per_s) -> str``."""
    MB = 1_000_000

    def call(f, tokens, blocks, bpb, link, rate):
        return f(tokens, blocks, bytes_per_block=bpb, link_bytes_per_s=link, prefill_tokens_per_s=rate)

    rng = random.Random(0)
    grid = []
    for _ in range(300):
        tokens = rng.randint(1, 4096)
        bs = rng.choice([8, 16, 32])
        grid.append((tokens, -(-tokens // bs), rng.choice([256 * 1024, MB, 2 * MB]),
                     rng.choice([1e9, 4e9, 12e9, 25e9, 64e9]), rng.choice([2e3, 1e4, 5e4])))

    def agrees(f):
        return [call(f, *g) for g in grid] == [call(reference_swap_or_recompute, *g) for g in grid]

    expected_runs = (_auto_run(reference_swap_or_recompute, 100.0), _auto_run(reference_swap_or_recompute, 0.5))
    cases = [
        Case("a long context on a fast link swaps", lambda f: call(f, 1024, 64, MB, 10e9, 5000), "swap",
             "swapping 64 MB twice over 10 GB/s takes ~13 ms; recomputing 1024 tokens at 5000/s takes 205 ms"),
        Case("a slow link recomputes", lambda f: call(f, 1024, 64, MB, 0.1e9, 5000), "recompute",
             "at 0.1 GB/s the same 64 MB take 0.64 s each way, 1.28 s out and back: recompute (205 ms) is cheaper"),
        Case("the KV crosses the link twice", lambda f: call(f, 75, 10, MB, 1e9, 5000), "recompute",
             "out now AND back in later: 2 x 10 MB at 1 GB/s = 20 ms > 15 ms of prefill"),
        Case("a tie recomputes", lambda f: call(f, 2, 1, 1000, 1000, 1.0), "recompute",
             "swap only when it is strictly cheaper: it also holds host memory while the request waits"),
        Case("blocks carry the bytes, tokens the compute", lambda f: call(f, 160, 5, MB, 1e9, 1000), "swap",
             "swap time depends on num_blocks x bytes_per_block; recompute time on num_tokens / prefill rate"),
        Case("the answer is the string 'swap' or 'recompute'", lambda f: call(f, 16, 1, 1000, 1e9, 1000),
             "swap", "return one of the two strings, not a bool or a number"),
        Case("agrees with the engine's cost model on 300 cases", agrees, True,
             "compare seconds with seconds: bytes / (bytes per second), tokens / (tokens per second)"),
        Case("the real engine in auto mode: fast link swaps, slow link recomputes",
             lambda f: (_auto_run(f, 100.0), _auto_run(f, 0.5)), expected_runs,
             "wrapped as a PreemptionCostModel, your rule decides every preemption of the run"),
    ]
    return run_checks("swap_or_recompute", fn, cases)


# -- exercise 3: the door rule -----------------------------------------------------------


def _kind(value) -> str:
    """A value's type as a learner should read it: the bare name for a builtin, else with its module -- numpy 2
    names its boolean scalar ``bool`` too, and a bare-name check would take ``numpy.bool`` for Python's."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _stats(waiting: int = 0, free: int = 100, running: int = 0, num_blocks: int = 100, cached: int = 0,
           swapped: int = 0) -> dict:
    """``engine.stats()``'s shape: ``free`` blocks on the free list and ``cached`` evictable cached ones, which
    together are the available blocks; ``swapped`` of the ``waiting`` requests are swapped out (as in the engine,
    ``num_waiting`` already counts them)."""
    assert swapped <= waiting
    return {"num_waiting": waiting, "free_blocks": free, "available_blocks": free + cached, "num_running": running,
            "num_blocks": num_blocks, "num_swapped": swapped, "num_preemptions": 0}


def _door_run(fn) -> tuple[int, int]:
    res = serve(lab_engine(num_blocks=192), overload_workload(40, rate_per_s=30.0, seed=4),
                door=lambda s: fn(s, 4, 16))
    return len(res.rejected_at_door), res.stats["num_preemptions"]


def check_should_reject(fn) -> CheckResult:
    """Check ``fn(stats, max_waiting, min_free_blocks) -> bool`` (True: answer 429, do not add the request)."""
    expected_run = _door_run(engine_should_reject)

    def frozen(f):
        s = _stats(waiting=3, free=5)
        before = dict(s)
        f(s, 4, 16)
        return s == before

    cases = [
        Case("an idle engine accepts", lambda f: f(_stats(), 4, 16), False, "nobody waits and the pool is free"),
        Case("a short queue accepts", lambda f: f(_stats(waiting=3), 4, 16), False,
             "3 waiting with max_waiting=4: there is still room in the queue"),
        Case("a full queue rejects", lambda f: f(_stats(waiting=4), 4, 16), True,
             "the queue is full when num_waiting has REACHED max_waiting"),
        Case("swapped requests are already in num_waiting", lambda f: f(_stats(waiting=3, swapped=2), 4, 16), False,
             "3 waiting, 2 of them swapped out, with max_waiting=4: engine.stats()['num_waiting'] already counts the "
             "swapped requests (num_swapped is a part of it), so adding num_swapped counts them twice"),
        Case("swapped requests still fill the queue", lambda f: f(_stats(waiting=4, swapped=2), 4, 16), True,
             "4 waiting, 2 of them swapped out, with max_waiting=4: the queue is full. A swapped-out request waits "
             "to resume ahead of the newcomer, so it counts like any other: compare num_waiting itself, don't "
             "subtract num_swapped"),
        Case("running requests are not the queue", lambda f: f(_stats(running=50), 4, 16), False,
             "read stats['num_waiting'], not num_running: running requests already have their seats"),
        Case("a full pool with nobody waiting accepts", lambda f: f(_stats(waiting=0, free=0, running=8), 4, 16),
             False, "with no queue the newcomer is next in line, however many requests are running: let it wait for "
                    "the blocks (rule 2 asks for someone WAITING, stats['num_waiting'] > 0)"),
        Case("pressure and a queue reject", lambda f: f(_stats(waiting=1, free=15), 4, 16), True,
             "fewer than min_free_blocks free AND someone already waiting: the newcomer would only queue behind them"),
        Case("exactly min_free_blocks free is not pressure", lambda f: f(_stats(waiting=1, free=16), 4, 16), False,
             "pressure means FEWER than min_free_blocks available"),
        Case("a warm prefix cache is not pressure", lambda f: f(_stats(waiting=1, free=2, cached=40), 4, 16), False,
             "2 blocks on the free list but 40 more hold cached KV nobody uses: the allocator evicts them on demand. "
             "Read stats['available_blocks'], not stats['free_blocks']"),
        Case("the stats are only read", frozen, True, "don't change the dict: the engine's counters are not yours"),
        Case("the answer is a bool", lambda f: [_kind(f(s, 4, 16)) for s in (
            _stats(), _stats(waiting=4), _stats(waiting=1, free=15), _stats(waiting=0, free=0))], ["bool"] * 4,
             "return True or False: `waiting and free < min_free` is 0 (an int) when nobody waits -- "
             "compare instead (waiting > 0)"),
        Case("in the arrival loop: how many turned away", _door_run, expected_run,
             "the same rule, asked before every add_request of an overloaded run",
             show_expected=f"{expected_run[0]} rejected at the door, {expected_run[1]} preemptions"),
    ]
    return run_checks("should_reject", fn, cases)


# -- hidden cases (the grader's, seeded at grading time) ---------------------------------


def hidden_victim_policy(cls, seed: int) -> CheckResult:
    """Random running sets (ties at 16 computed tokens, requests with none computed yet) and protected tenants,
    and a swap-mode engine run on a random workload."""
    rng = random.Random(seed)
    tenants = ["chat", "agent", "batch"]

    def random_sets(k):
        for trial in range(200):
            running = [_R(f"q{i}", rng.choice(tenants), rng.choice([rng.randint(0, 60), 16, 0]),
                          rng.randint(1, 80)) for i in range(rng.randint(1, 7))]
            protected = tuple(rng.sample(tenants, rng.randint(0, 3)))
            before = list(running)
            got = k(protected).choose_victim(running)
            if running != before or got is not ReferenceVictim(protected).choose_victim(before):
                return f"set {trial} differs"
        return "all 200 match"

    run_seed = rng.randrange(1 << 30)
    return run_checks("victim policy (hidden)", cls, [
        Case("200 random running sets", random_sets, "all 200 match"),
        Case("a swap-mode engine run on a random workload",
             lambda k: _victim_run(k, run_seed) == _victim_run(ReferenceVictim, run_seed), True),
    ], verbose=False)


def hidden_swap_or_recompute(fn, seed: int) -> CheckResult:
    """Random costs (ties included) against the engine's :class:`PreemptionCosts`."""
    rng = random.Random(seed)

    def random_costs(f):
        for trial in range(300):
            tokens = rng.randint(1, 8192)
            blocks = -(-tokens // rng.choice([1, 8, 16, 32]))
            bpb = rng.choice([4096, 256 * 1024, 1_000_000, 2 * 1024 * 1024])
            link = rng.choice([1e8, 1e9, 8e9, 25e9, 64e9, rng.uniform(1e8, 1e11)])
            rate = rng.choice([1e3, 5e3, 2e4, 5e4, rng.uniform(1e3, 1e5)])
            if rng.random() < 0.1:  # an exact tie: swap time == recompute time, in powers of two, so that every
                # order of the same arithmetic lands on it (2 * 392 * 262144 / 205520896 is 1.0, but
                # 392 * (262144 / 205520896) * 2 is 0.9999999999999999: a right answer would read a "swap")
                blocks = 2 ** rng.randint(0, 8)
                tokens, bpb = blocks * rng.choice([1, 8, 16, 32]), rng.choice([4096, 256 * 1024, 2 * 1024 * 1024])
                link, rate = 2 * blocks * bpb, tokens
            kw = dict(bytes_per_block=bpb, link_bytes_per_s=link, prefill_tokens_per_s=rate)
            if f(tokens, blocks, **kw) != reference_swap_or_recompute(tokens, blocks, **kw):
                return f"case {trial} differs"
        return "all 300 match"

    return run_checks("swap_or_recompute (hidden)", fn, [Case("300 random costs", random_costs, "all 300 match")],
                      verbose=False)


def hidden_should_reject(fn, seed: int) -> CheckResult:
    """Random engine stats around both thresholds; the stats dict must come back unchanged."""
    rng = random.Random(seed)

    def random_stats(f):
        for trial in range(300):
            max_waiting, min_free = rng.randint(1, 10), rng.randint(0, 40)
            s = _stats(waiting=rng.choice([0, max_waiting - 1, max_waiting, max_waiting + 1, rng.randint(0, 20)]),
                       free=rng.choice([0, min_free - 1, min_free, min_free + 1, rng.randint(0, 100)]),
                       running=rng.randint(0, 60), cached=rng.choice([0, 0, rng.randint(1, 50)]))
            s["num_swapped"] = rng.choice([0, s["num_waiting"], rng.randint(0, s["num_waiting"])])  # a part of it
            before = dict(s)
            got = f(s, max_waiting, min_free)
            if s != before or bool(got) != engine_should_reject(before, max_waiting, min_free) \
                    or not isinstance(got, bool):
                return f"case {trial} differs"
        return "all 300 match"

    return run_checks("should_reject (hidden)", fn, [Case("300 random stats", random_stats, "all 300 match")],
                      verbose=False)


# -- quiz answers (``"compute": "minivllm.labs.check_lab05:<name>"`` in quizzes/lab05.json) ----


def quiz_swapped_blocks_for_100_tokens() -> int:
    """Host blocks a swap preemption fills for a victim with 100 computed tokens (block 16), via the KV manager."""
    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.kv_cache_manager import KVCacheManager
    from minivllm.request import Request

    kv = KVCacheManager(BlockPool(16), 16, cpu_pool=BlockPool(16))
    req = Request("victim", list(range(10, 110)), SamplingParams(), 0.0)
    assert kv.allocate_slots(req, 100)
    req.num_computed_tokens = 100
    assert kv.swap_out(req)
    return len(req.cpu_block_ids)


def quiz_crossover_gbps() -> float:
    """Link bandwidth (GB/s, 1 decimal) at which the engine's cost model is indifferent, for lab 5's GPU:
    2 MiB blocks of 16 tokens, prefill at 50,000 tokens/s."""
    at_1_byte_per_s = PreemptionCosts(KV_BYTES_PER_BLOCK, 1.0, PREFILL_TOKENS_PER_S)
    return round(at_1_byte_per_s.swap_s(1) / at_1_byte_per_s.recompute_s(BLOCK_SIZE) / 1e9, 1)


# -- the registration ---------------------------------------------------------------------

LAB = Lab(5, "lab05_preemption", "Preemption", widgets=("next step", "next swap", "run to end"), exercises=(
    Exercise("victim_policy", "ProtectInteractive", check_victim_policy, points=2, hidden=hidden_victim_policy,
             mutants=(
        ("ignores the protected tenants", "[r for r in running if r.tenant not in self.protected] or list(running)",
         "list(running)"),
        ("protects everyone else instead", "if r.tenant not in self.protected", "if r.tenant in self.protected"),
        ("most work lost", "return min(reversed(candidates)", "return max(reversed(candidates)"),
        ("ties go to the oldest", "min(reversed(candidates), key", "min(candidates, key"),
        ("the engine's default: always the newest", "return min(reversed(candidates), key=lambda r: r.num_computed_tokens)",
         "return running[-1]"),
        ("no victim when everyone is protected", " or list(running)", ""),
        ("prompt length instead of computed work", "key=lambda r: r.num_computed_tokens", "key=lambda r: r.num_prompt_tokens"),
        ("hard-coded tenant", "self.protected = set(protected_tenants)", 'self.protected = {"chat"}'),
        ("only the first protected tenant", "self.protected = set(protected_tenants)",
         "self.protected = {protected_tenants[0]}"),
        ("sorts the engine's list in place", "candidates = [r for r in running",
         "running.sort(key=lambda r: r.num_computed_tokens)\n        candidates = [r for r in running"),
    )),
    Exercise("swap_or_recompute", "swap_or_recompute", check_swap_or_recompute, points=1,
             hidden=hidden_swap_or_recompute, mutants=(
        ("the KV crosses the link once", "swap_s = 2 * num_blocks", "swap_s = num_blocks"),
        ("a tie swaps", 'return "swap" if swap_s < recompute_s', 'return "swap" if swap_s <= recompute_s'),
        ("inverted choice", 'return "swap" if swap_s < recompute_s', 'return "swap" if swap_s > recompute_s'),
        ("bandwidth multiplied", "bytes_per_block / link_bytes_per_s", "bytes_per_block * link_bytes_per_s"),
        ("prefill rate multiplied", "num_tokens / prefill_tokens_per_s", "num_tokens * prefill_tokens_per_s"),
        ("tokens instead of blocks on the link", "2 * num_blocks * bytes_per_block", "2 * num_tokens * bytes_per_block"),
        ("ignores the block size in bytes", "2 * num_blocks * bytes_per_block / link_bytes_per_s",
         "2 * num_blocks / link_bytes_per_s"),
        ("returns a bool", 'return "swap" if swap_s < recompute_s else "recompute"', "return swap_s < recompute_s"),
    )),
    Exercise("door_rule", "should_reject", check_should_reject, points=1, hidden=hidden_should_reject, mutants=(
        ("a full queue still accepts", "waiting >= max_waiting", "waiting > max_waiting"),
        ("counts running requests as the queue", 'waiting = stats["num_waiting"]', 'waiting = stats["num_running"]'),
        ("pressure alone rejects", '(waiting > 0 and stats["available_blocks"] < min_free_blocks)',
         '(stats["available_blocks"] < min_free_blocks)'),
        ("no pressure clause", ' or (waiting > 0 and stats["available_blocks"] < min_free_blocks)', ""),
        ("exactly min_free_blocks counts as pressure", 'stats["available_blocks"] < min_free_blocks',
         'stats["available_blocks"] <= min_free_blocks'),
        ("reads the free list only", 'stats["available_blocks"]', 'stats["free_blocks"]'),
        ("swapped requests not counted as waiting", 'waiting = stats["num_waiting"]',
         'waiting = stats["num_waiting"] - stats["num_swapped"]'),
        ("both conditions required", "waiting >= max_waiting or (", "waiting >= max_waiting and ("),
        ("inverted answer", "return waiting >= max_waiting or", "return not waiting >= max_waiting or"),
        ("changes the stats", 'waiting = stats["num_waiting"]', 'waiting = stats.pop("num_waiting")'),
        # the mistake the bool case's hint names: right truth values, but 0 (an int) when nobody waits
        ("`waiting and ...` answers 0 when nobody waits", "(waiting > 0 and stats", "(waiting and stats"),
    )),
))
