"""A fleet: N replicas, each a full engine on a simulated executor, behind a router, on one virtual clock.

Why simulate a fleet with *real* engines?  The questions a learner has once
one machine is not enough -- how many replicas for X requests/s under an SLO,
and what cache-aware routing buys -- depend on what each engine does with
the traffic it gets: its prefix cache, its batching, its preemptions.  Here
every replica is an unmodified :class:`~minivllm.engine.LLMEngine` (the real
scheduler, KV manager and prefix cache); only the forward pass is a cost
model (:class:`~minivllm.sim.executor.SimulatedExecutor`, or anything an
``executor_factory`` returns, e.g. a roofline executor).

One virtual clock: each replica's executor keeps its own clock (the time its
last step ended), and the fleet always advances the busy replica whose clock
is earliest, after dispatching every arrival up to that time -- a discrete-
event simulation in which no replica ever runs ahead of an arrival it should
have seen.  Replicas whose clocks are equal step in index order, so a run is
a function of its inputs: follow-up turns that two such steps release reach
the router in that order.  An idle replica's clock jumps to the arrival routed
to it.

The router (:class:`~minivllm.interfaces.Router`) sees per replica the
*outstanding tokens* a load balancer can count: a request's prompt plus its
``max_tokens`` from the moment it is routed; the prompt leaves the count with
the first token streamed back, each output token as it streams.
"""

from __future__ import annotations

import heapq
import math
import operator
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from minivllm.argtypes import is_int, is_real
from minivllm.arrival import Arrival, made_up_ids
from minivllm.bench.loadgen import RequestResult, summarize_group
from minivllm.interfaces import Router
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor
from minivllm.sim.roofline import RESERVED_TOKEN_IDS, check_fake_vocab

# One replica's step cost: a Llama-3-8B-class model (fp16) on an L4-class GPU (~120 TFLOP/s, 300 GB/s):
# a step reads the 16 GB of weights (~50 ms), prefill runs at ~6,700 tokens/s, and each context token's
# 128 KiB of KV costs ~0.4 us to read.  Slow enough that a few replicas matter at tens of requests/s.
GPU_LIKE = dict(fixed_overhead_s=0.05, per_token_s=0.00015, per_context_token_s=4e-7)
# The prefix-affinity key for ChatMix: its 16-block system prompt plus 4 blocks of the first question, so a
# key tells conversations apart (a key inside the system prompt would send a whole app to one replica).
KEY_BLOCKS = 20
# One replica: the KV pool an L4 holds beside Llama-3-8B's 16 GB of weights (2,707 blocks of 16 tokens: 43,312 tokens,
# 5.3 GiB at 128 KiB per token, what 90% of its 23,034 MiB leaves, as `minivllm sim run` sizes a roofline replica; a test
# recomputes it), 64 sequences, 512 tokens per step (a chunk of prefill adds a bounded slice to the decoders' step).
# The linear model has no device to size a pool from, so it gets the one its costs describe.
REPLICA = dict(num_blocks=2707, block_size=16, max_num_seqs=64, max_num_batched_tokens=512, model_max_len=8192)


def _replica_index(k: Any, num_replicas: int) -> int:
    """A router's answer as a plain ``int`` in ``[0, num_replicas)``, or a ValueError that names it.

    Any integer type is an index (``operator.index``): ``np.argmin(loads)`` is a right least-loaded router, and
    its numpy integer must place the request like the int it equals, not fail with "expected a replica index"
    while naming a value in range.  A bool, a float or a string is a router bug, refused."""
    if not isinstance(k, bool):
        try:
            i = operator.index(k)
        except TypeError:
            pass
        else:
            if 0 <= i < num_replicas:
                return i
    raise ValueError(f"router returned {k!r}; expected an int replica index in [0, {num_replicas})")


class ChatMix:
    """A chat app's traffic: sessions of several turns and single questions, all under shared system prompts.

    Sessions start as a Poisson process during ``[0, warmup + duration)``, at a
    rate that makes about ``rate`` requests per second once sessions overlap;
    the ``warmup`` (about one session's length) brings the fleet to that steady
    state, and ``window = (warmup, warmup + duration)`` is what
    :meth:`FleetResult.summary` should measure.  A session's length counts an
    answer as ``answer_s`` seconds: by default its mean output tokens at the
    decode step the replicas' executor predicts (``executor_factory``, the one
    given to :class:`Fleet`; default the fleet's, :func:`gpu_like_executor`)
    for a full batch of mid-session chats (:func:`typical_decode_step_s`;
    at least 1 s).  Why the executor's own step: for Llama-3-8B it is 88 ms
    on an L4 and 10 ms on an H100, and a warm-up shorter than the answers
    really take makes the window a ramp (a chat's later turns, the ones with
    the longest histories, arrive only after it); a longer one costs only
    simulated seconds, hence the full batch.  Every prompt starts with one of
    ``num_system_prompts`` system prompts.  A chat's next turn is *closed
    loop*: it arrives a think time after the previous answer finished, and its
    prompt is the whole conversation so far -- the previous prompt, the answer
    the engine actually generated, and a new question -- so the KV of every
    earlier turn, answers included, is a prefix of the next one.  That history
    is what prefix-aware routing keeps on one replica.

    :meth:`arrivals` are the first turns (and single questions); the fleet asks
    :meth:`follow_up` for the next turn each time a request finishes.  New
    questions come from a random stream per (seed, session, turn), so runs are
    reproducible whatever order replicas finish in.
    """

    def __init__(self, rate: float = 20.0, duration: float = 10.0, *, seed: int = 0, num_system_prompts: int = 2,
                 system_len: int = 256, turns: int = 4, single_shot_share: float = 0.3,
                 user_range=(64, 256), output_range=(32, 160), think_s=(1.0, 3.0), vocab: int = 900,
                 answer_s: float | None = None, executor_factory: Callable[[], Any] | None = None) -> None:
        if not (is_real(rate) and rate > 0):
            raise ValueError(f"rate must be a positive finite number, got {rate!r}")
        if not (is_real(duration) and duration > 0):
            raise ValueError(f"duration must be a positive finite number, got {duration!r}")
        if not is_int(turns) or turns < 1 or not 0.0 <= single_shot_share <= 1.0:
            raise ValueError("turns must be an int >= 1 and 0 <= single_shot_share <= 1")
        if not (len(think_s) == 2 and all(math.isfinite(x) for x in think_s) and 0 <= think_s[0] <= think_s[1]):
            raise ValueError(f"think_s must be (low, high) seconds with 0 <= low <= high, got {think_s!r}")
        # (a chat opens with one of the system prompts, and its tokens are drawn from ids 10 to vocab - 1: none of
        # either failed inside random, naming no argument)
        if not is_int(num_system_prompts) or num_system_prompts < 1:
            raise ValueError(f"num_system_prompts must be an int >= 1, got {num_system_prompts!r}")
        check_fake_vocab(vocab, "ChatMix")  # (the simulator's one rule for ids 0-9, kept for special tokens)
        # (drawn with randint: a reversed range failed inside random without naming the argument, and an answer of
        # 0 tokens made every such turn a request the engine refuses, ending its chat in silence)
        for name, pair, least in (("user_range", user_range, 0), ("output_range", output_range, 1)):
            if not (len(pair) == 2 and all(map(is_int, pair))
                    and least <= pair[0] <= pair[1]):
                raise ValueError(f"{name} must be (low, high) ints with {least} <= low <= high, got {pair!r}")
        if answer_s is None:
            step_s = typical_decode_step_s((executor_factory or gpu_like_executor)(), system_len, turns,
                                           user_range, output_range)
            answer_s = max(1.0, step_s * sum(output_range) / 2)
        if not (is_real(answer_s) and answer_s >= 0):
            raise ValueError(f"answer_s must be a finite number of seconds >= 0, got {answer_s!r}")
        self.rate, self.duration, self.seed, self.turns = rate, duration, seed, turns
        self.user_range, self.output_range, self.think_s, self.vocab = user_range, output_range, think_s, vocab
        rng = random.Random(seed)
        self.systems = [self._tokens(rng, system_len) for _ in range(num_system_prompts)]
        session_rate = rate / (single_shot_share + (1 - single_shot_share) * turns)
        self.session_turns: dict[int, int] = {}
        self._first: list[Arrival] = []
        self._questions: dict[tuple[int, int], tuple[int, ...]] = {}  # (session, turn) -> its question
        self.warmup = (turns - 1) * (sum(think_s) / 2 + answer_s)  # about one session: turns, answers, thinking
        self.window = (self.warmup, self.warmup + duration)
        t = rng.expovariate(session_rate)
        while t < self.window[1]:
            s = len(self.session_turns)
            k_turns = 1 if rng.random() < single_shot_share else turns
            self.session_turns[s] = k_turns
            prompt = tuple(self.systems[rng.randrange(num_system_prompts)]) + self._question(s, 0)
            self._first.append(Arrival(round(t, 6), f"s{s}t0", "chat" if k_turns > 1 else "single", prompt,
                                       self._max_tokens(s, 0), session=s, turn=0))
            t += rng.expovariate(session_rate)

    def _tokens(self, rng: random.Random, n: int) -> list[int]:
        return made_up_ids(rng, n, (RESERVED_TOKEN_IDS, self.vocab))

    def _rng(self, session: int, turn: int) -> random.Random:
        """A stream of its own per (seed, session, turn), seeded by a string: ``random`` turns a str seed into an
        int from its bytes (no salted ``hash``), so a turn's question is the same in every process and run order."""
        return random.Random(f"{self.seed}/{session}/{turn}")

    def _question(self, session: int, turn: int) -> tuple[int, ...]:
        """The new question of ``session``'s turn ``turn``, drawn once and kept: a pure function of (seed, session,
        turn), and a sweep serves one mix to many fleets (``bench fleet``: 22), each asking again for
        every next turn (drawing them token by token again cost that study about 3% of its CPU time)."""
        question = self._questions.get((session, turn))
        if question is None:
            rng = self._rng(session, turn)
            question = self._questions[(session, turn)] = tuple(self._tokens(rng, rng.randint(*self.user_range)))
        return question

    def _max_tokens(self, session: int, turn: int) -> int:
        return random.Random(f"{self.seed}/{session}/{turn}/out").randint(*self.output_range)

    def num_requests(self) -> int:
        """Requests the workload sends when every turn is answered: every turn of every session.

        An upper bound, not a count of a run: :meth:`Fleet.run` asks for a next turn only after an answer
        that finished ``"ok"``, so a turn refused or failed ends its chat (as a user given an error stops)."""
        return sum(self.session_turns.values())

    def arrivals(self) -> list[Arrival]:
        """The first turn of every session, sorted by time."""
        return list(self._first)

    def follow_up(self, arrival: Arrival, output_token_ids: Sequence[int], finished_at: float) -> Arrival | None:
        """The next turn of ``arrival``'s chat, or None when the chat is over."""
        s, k = arrival.session, arrival.turn + 1
        if s is None or k >= self.session_turns.get(s, 1):
            return None
        think = self._rng(s, k).uniform(*self.think_s)
        prompt = tuple(arrival.prompt) + tuple(output_token_ids) + self._question(s, k)
        # (rounded to the microsecond, never to before the answer it follows: a zero think time is allowed)
        return Arrival(max(finished_at, round(finished_at + think, 6)), f"s{s}t{k}", arrival.tenant, prompt,
                       self._max_tokens(s, k), session=s, turn=k)


def gpu_like_executor() -> SimulatedExecutor:
    """The fleet's default replica executor: the linear cost model with :data:`GPU_LIKE` costs."""
    return SimulatedExecutor(**GPU_LIKE)


def typical_decode_step_s(executor: Any, system_len: int, turns: int, user_range: Sequence[int],
                          output_range: Sequence[int]) -> float:
    """The decode step ``executor`` predicts for a replica full of chats half-way through their sessions.

    A batch of :data:`REPLICA`'s ``max_num_seqs`` sequences, each decoding one token after a context of the
    system prompt plus half a session's questions and answers (at their means).  Asked of the executor's own
    ``step_time``, the call that advances its clock in a run, so the answer is whatever cost model the fleet
    runs: a roofline preset or the linear model.
    """
    from minivllm.request import Request
    from minivllm.sched.output import ScheduledBatch, ScheduledSeq

    context = max(1, round(system_len + turns * (sum(user_range) + sum(output_range)) / 4))
    seqs = [ScheduledSeq(Request(f"typical-{i}", [0] * context, SamplingParams(max_tokens=1), 0.0),
                         num_tokens=1, start=context - 1, is_decode=True) for i in range(REPLICA["max_num_seqs"])]
    return executor.step_time(ScheduledBatch(seqs))


def roofline_factory(hardware: str = "h100", model: str = "llama-3-8b", block_size: int = 16) -> Callable[[], Any]:
    """Executors for :class:`Fleet`: the roofline cost model (:mod:`minivllm.sim.roofline`) of ``model`` on ``hardware``."""
    from minivllm.sim.presets import hardware_preset, simulated_shape
    from minivllm.sim.roofline import RooflineExecutor

    hw = hardware_preset(hardware)
    shape = simulated_shape(model, hw)
    return lambda: RooflineExecutor(shape, hw, block_size)


def replica_kv_blocks(executor: Any, gpu_memory_utilization: float = 0.9) -> int | None:
    """The KV blocks a replica's device holds, as ``minivllm sim run`` sizes them; None for an executor
    without a device (the linear cost model), which keeps :data:`REPLICA`'s count."""
    from minivllm.sim.roofline import RooflineExecutor
    from minivllm.sim.run import kv_pool_blocks

    if not isinstance(executor, RooflineExecutor):
        return None
    return kv_pool_blocks(executor.shape, executor.hardware, gpu_memory_utilization, executor.block_size)


def sim_replica(executor: Any = None, *, enable_prefix_caching: bool = True, prefix_cache: str = "hash", **options: Any):
    """One replica: a real ``LLMEngine`` on a virtual-clock executor.

    :data:`REPLICA` gives the sizes, except that a roofline replica's KV pool is what its device holds
    (:func:`replica_kv_blocks`): the router comparison measures per-replica prefix-cache capacity, so an L4
    must not get an H100's pool.  An explicit ``num_blocks`` wins.  The engine's blocks are the executor's
    (a roofline executor's ``block_size``): the pool is counted, and a swapped block priced, in the executor's
    blocks, so an engine of other blocks would hold twice or half the device's KV."""
    from minivllm.labs.workloads import sim_engine
    from minivllm.sim.roofline import RooflineExecutor

    # (no per-tenant step-log rows: no fleet figure reads them, and counting each tenant's blocks every step
    # -- a set union per tenant, ChatMix's "chat" and "single" -- was about a tenth of the CPU time of lab 9's capacity study)
    sizes = {**REPLICA, "step_log_tenants": False, **options}
    # (the executors whose pool replica_kv_blocks counts: another executor's block_size, a test's KV checker's
    # say, sizes nothing here)
    exec_block = executor.block_size if isinstance(executor, RooflineExecutor) else None
    if exec_block is not None:
        if "block_size" not in options:
            sizes["block_size"] = exec_block
        elif options["block_size"] != exec_block:
            raise ValueError(f"block_size={options['block_size']!r} differs from the executor's block_size "
                             f"{exec_block!r}; a replica's engine and executor must use the same blocks")
    if "num_blocks" not in options and executor is not None:
        sizes["num_blocks"] = replica_kv_blocks(executor) or sizes["num_blocks"]
    return sim_engine(executor=executor if executor is not None else gpu_like_executor(),
                      enable_prefix_caching=enable_prefix_caching, prefix_cache=prefix_cache, **sizes)


@dataclass
class ReplicaStats:
    """What one replica did in a run."""

    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0
    peak_outstanding: int = 0
    preemptions: int = 0
    step_spans: list[tuple[float, float]] = field(default_factory=list, repr=False)  # (start, end) of each step

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass
class FleetResult:
    """Per-request results (loadgen's :class:`~minivllm.bench.loadgen.RequestResult`) and per-replica load."""

    results: list[RequestResult]
    replicas: list[ReplicaStats]
    placement: dict[str, int]  # request id -> replica index
    outputs: dict[str, list[int]]  # request id -> generated token ids
    duration: float  # first arrival to last finish, virtual seconds
    cached_tokens: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens served from cache
    spilled_ids: set[str] = field(default_factory=set)  # requests the router sent past their owner
    preempted: dict[str, int] = field(default_factory=dict)  # request id -> times preempted (if any)
    _index: dict[str, int] = field(default_factory=dict)  # request id -> RequestResult.index
    # Set when :meth:`Fleet.run` stopped at ``until`` with work left: the requests still in flight are not in
    # ``results``, yet the replicas' counts and cache counters include them, so only a window ending by then is whole.
    until: float | None = None

    @property
    def spilled(self) -> int:
        """Requests the router sent past their ring owner (prefix affinity's spill-over)."""
        return len(self.spilled_ids)

    @property
    def hit_rate(self) -> float:
        """Fleet prefix-cache hit rate: hit tokens over looked-up tokens, summed over replicas."""
        q = sum(r.query_tokens for r in self.replicas)
        return sum(r.hit_tokens for r in self.replicas) / q if q else 0.0

    def result(self, request_id: str) -> RequestResult:
        """The result of one request, by its id."""
        return self.results[self._index[request_id]]

    def summary(self, slo_ttft: float | None = None, slo_itl: float | None = None,
                window: tuple[float, float] | None = None) -> dict:
        """Loadgen's summary (TTFT/ITL/e2e percentiles, goodput under the SLOs) plus the fleet's hit rate and load.

        With ``window=(t0, t1)`` only requests arriving in it count, rates are per
        second of the window, and the hit rates, fleet-wide and per replica, are theirs
        (cached prompt tokens over looked-up ones), as are the requests per replica, the
        spill and preemption counts (of the window's requests, wherever they happened)
        and the busy fractions (step time inside the window): the steady state, without
        warm-up and drain.
        """
        if self.until is not None and (window is None or window[1] > self.until):
            raise ValueError(f"this run stopped at until={self.until:g} s with requests in flight: only a window "
                             f"ending by then is whole, got window={window!r}")
        if window is None:
            out = summarize_group(self.results, self.duration, slo_ttft, slo_itl)
            out["prefix_hit_rate"] = self.hit_rate
            out["replica_requests"] = [r.requests for r in self.replicas]
            out["replica_hit_rate"] = [r.hit_rate for r in self.replicas]
        else:
            t0, t1 = window
            # (an empty or reversed window has no seconds to divide by: every rate would be a crash or negative)
            if not (math.isfinite(t0) and math.isfinite(t1) and t0 < t1):
                raise ValueError(f"window must be (t0, t1) with finite t0 < t1, got {window!r}")
            ids = {r.index for r in self.results if t0 <= r.arrival < t1}
            chosen = [r for r in self.results if r.index in ids]
            out = summarize_group(chosen, t1 - t0, slo_ttft, slo_itl)
            rid = {i: k for k, i in self._index.items()}
            # (a request refused at the door or rejected never looked the cache up: it has no cached_tokens entry;
            # a lookup counts the whole prompt, as the engines' own counters behind the unwindowed rate do)
            looked = sum(r.prompt_len for r in chosen if rid[r.index] in self.cached_tokens)
            out["prefix_hit_rate"] = sum(self.cached_tokens.get(rid[r.index], 0) for r in chosen) / looked if looked else 0.0
            out["offered_rps"] = len(chosen) / (t1 - t0)
            # per replica, the same recount over the window's requests admitted there (a rejected request was
            # admitted, as the replica's own count has it, but looked nothing up)
            n = len(self.replicas)
            requests, hits, queries = [0] * n, [0] * n, [0] * n
            for r in chosen:
                key = rid[r.index]
                k = self.placement.get(key)
                if k is None:  # (a result built by hand, with no placement)
                    continue
                if key in self.cached_tokens:
                    hits[k] += self.cached_tokens[key]
                    queries[k] += r.prompt_len
                if key in self.cached_tokens or r.outcome == "rejected":
                    requests[k] += 1
            out["replica_requests"] = requests
            out["replica_hit_rate"] = [h / q if q else 0.0 for h, q in zip(hits, queries)]
            keys = {rid[r.index] for r in chosen}
            out["spilled"] = len(self.spilled_ids & keys)
            out["preemptions"] = sum(self.preempted.get(key, 0) for key in keys)
            out["replica_busy_fraction"] = [sum(max(0.0, min(end, t1) - max(start, t0)) for start, end in r.step_spans)
                                            / (t1 - t0) for r in self.replicas]
            return out
        out["replica_busy_fraction"] = [r.busy_s / self.duration if self.duration else 0.0 for r in self.replicas]
        out["spilled"] = self.spilled
        out["preemptions"] = sum(r.preemptions for r in self.replicas)
        return out


class Fleet:
    """``num_replicas`` engines behind ``router``, driven on one virtual clock by :meth:`run`.

    ``engine_factory(executor)`` builds a replica (default :func:`sim_replica`);
    ``executor_factory()`` builds each replica's executor (default: a
    :class:`SimulatedExecutor` with :data:`GPU_LIKE` costs).  The executor must
    keep its virtual clock in a writable ``clock`` attribute (seconds), as
    ``SimulatedExecutor`` does, so an idle replica can jump to an arrival.
    """

    def __init__(self, num_replicas: int, router: Router, *, executor_factory: Callable[[], Any] | None = None,
                 engine_factory: Callable[[Any], Any] | None = None) -> None:
        if not is_int(num_replicas) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        if not callable(getattr(router, "route", None)):
            raise ValueError("router must have a route(prompt_token_ids, loads) method")
        self.router = router
        make_exec = executor_factory or gpu_like_executor
        make_engine = engine_factory or sim_replica
        self.engines = [make_engine(make_exec()) for _ in range(num_replicas)]
        for e in self.engines:
            if not hasattr(e.executor, "clock"):
                raise ValueError("each replica's executor needs a virtual 'clock' attribute")
        self.loads = [0] * num_replicas  # outstanding tokens, the router's view

    def run(self, arrivals: Sequence[Arrival], *,
            follow_up: Callable[[Arrival, list[int], float], Arrival | None] | None = None,
            max_steps: int = 2_000_000, until: float | None = None) -> FleetResult:
        """Serve ``arrivals`` to the end; every request finishes exactly once.

        ``follow_up(arrival, output_token_ids, finished_at)`` (e.g.
        :meth:`ChatMix.follow_up`) may return a new request when one finishes:
        the next turn of a chat, arriving at or after ``finished_at``.

        ``until`` (a time on the virtual clock: a measuring window's end) stops the run as soon as nothing left
        to simulate can change a request that arrives before it: each of those has finished, and every busy
        replica's clock has reached ``until``.  A step depends only on what arrived before it began, so those
        requests, and every step that begins before ``until``, are the whole run's; the requests still in flight
        are left out of the result (and in the engines: a fleet stopped early is not run again).  Why: lab 9's
        capacity study measures 6 s after 31 s of warm-up, and the drain that followed -- the window's chats going
        on to their last turns, which no figure of the window reads -- was a third of its CPU time (22 runs: 108 -> 74 s).
        """
        if until is not None and not is_real(until):
            raise ValueError(f"until must be a finite time in seconds, got {until!r}")
        pending: list[tuple[float, int, Arrival]] = []
        seen: set[str] = set()
        seq = 0

        def push(a: Arrival) -> None:
            nonlocal seq
            if a.request_id in seen:
                raise ValueError(f"request id {a.request_id!r} is used twice")
            if not is_real(a.time):
                raise ValueError(f"arrival time must be a finite number, got {a.time!r}")
            seen.add(a.request_id)
            heapq.heappush(pending, (a.time, seq, a))
            seq += 1

        for a in arrivals:
            push(a)
        if pending and pending[0][0] < min(e.executor.clock for e in self.engines):
            raise ValueError(f"the first arrival (t={pending[0][0]}) precedes the replicas' clocks; "
                             "arrival times are seconds on the executors' virtual clock, which starts at 0")
        engines, loads = self.engines, self.loads
        stats = [ReplicaStats() for _ in engines]
        # the engines' counters as this run finds them: a fleet run again keeps its engines (warm caches, clocks),
        # and each run's ReplicaStats count that run alone, as its requests and steps do
        before_run = [e.stats() for e in engines]
        placement: dict[str, int] = {}
        by_id: dict[str, Arrival] = {}
        order: dict[str, int] = {}
        # outstanding tokens of each request in flight (the router's view), in the order they were routed: arrival order
        remaining: dict[str, int] = {}
        streamed: dict[str, int] = {}
        results: dict[str, RequestResult] = {}
        outputs: dict[str, list[int]] = {}
        cached: dict[str, int] = {}
        spilled: set[str] = set()
        preempted: dict[str, int] = {}
        steps = 0
        t0 = pending[0][0] if pending else 0.0
        # Tokens a replica's step streamed back, taken off the router's count only at the step's end: the
        # replica with the earliest clock steps next, and its step may end after the next arrival, which must
        # be routed on what a load balancer could count at its own time.  (time, seq, replica, tokens)
        drops: list[tuple[float, int, int, int]] = []
        stopped = False  # cut at ``until`` with work left

        def before_until() -> bool:
            """Is a request that arrives before ``until`` still unfinished (waiting to be routed, or in flight)?

            Read off the queue and the in-flight map, not counted by hand: arrivals are routed in time order and
            ``remaining`` keeps that order, so its first key is the oldest request in flight, as the heap's top is
            the earliest one waiting -- O(1), and a request refused at the door is in neither."""
            return bool(pending and pending[0][0] < until or remaining and by_id[next(iter(remaining))].time < until)

        while True:
            busy = [k for k, e in enumerate(engines) if e.has_unfinished_requests()]
            k_min = min(busy, key=lambda k: (engines[k].executor.clock, k)) if busy else None
            if until is not None and (k_min is None or engines[k_min].executor.clock >= until) and not before_until():
                stopped = bool(busy or pending)  # (nothing left: the whole run, as without ``until``)
                break
            if pending and (k_min is None or pending[0][0] <= engines[k_min].executor.clock):
                a = heapq.heappop(pending)[2]
                while drops and drops[0][0] <= a.time:
                    _, _, k, done = heapq.heappop(drops)
                    loads[k] -= done
                spills_before = getattr(self.router, "num_spilled", 0)
                k = self.router.route(a.prompt, list(loads))
                if getattr(self.router, "num_spilled", 0) != spills_before:
                    spilled.add(a.request_id)
                k = _replica_index(k, len(engines))
                ex = engines[k].executor
                if not engines[k].has_unfinished_requests() and ex.clock < a.time:
                    ex.clock = a.time  # an idle replica waits for the arrival
                placement[a.request_id], by_id[a.request_id], order[a.request_id] = k, a, len(order)
                try:
                    engines[k].add_request({"prompt_token_ids": list(a.prompt)},
                                           SamplingParams(max_tokens=a.max_tokens, ignore_eos=True,
                                                          output_kind="final_only"),
                                           a.request_id, tenant=a.tenant, arrival_time=a.time)
                except ValueError as exc:  # refused at the door (e.g. longer than the replica's max_model_len):
                    # an error for this request, as HTTP 400 is and as drive() records it; the run goes on
                    results[a.request_id] = RequestResult(order[a.request_id], a.tenant, a.time, len(a.prompt),
                                                          a.max_tokens, outcome="error", start=a.time, error=str(exc),
                                                          prompt_tokens=len(a.prompt))
                    outputs[a.request_id] = []  # (never looked the cache up: no cached-tokens entry)
                    continue
                remaining[a.request_id] = len(a.prompt) + a.max_tokens
                streamed[a.request_id] = 0
                loads[k] += remaining[a.request_id]
                stats[k].requests += 1
                stats[k].prompt_tokens += len(a.prompt)
                stats[k].peak_outstanding = max(stats[k].peak_outstanding, loads[k])
                continue
            if k_min is None:
                break
            steps += 1
            if steps > max_steps:
                raise RuntimeError(f"the fleet did not drain in {max_steps} steps")
            eng = engines[k_min]
            before = eng.executor.clock
            outs = eng.step()
            stats[k_min].steps += 1
            stats[k_min].busy_s += eng.executor.clock - before
            stats[k_min].step_spans.append((before, eng.executor.clock))
            # Outputs are final_only, one per request, when it finishes: the stream the router counts is read
            # off the engine (num_output_tokens, one read) for the rows this step ran -- the counts a streamed output per
            # running request per step carried, without building those outputs (a seventh of the CPU time of
            # lab 9's capacity study).  The step's tokens leave the count together, as one drop at its end.
            step_done = 0
            for out in outs:
                rid = out.request_id
                a = by_id[rid]
                n_out = len(out.outputs[0].token_ids)
                if rid in results:
                    raise RuntimeError(f"request {rid} finished twice")
                m = out.metrics
                reason = out.outputs[0].finish_reason
                outcome = "ok" if reason not in ("rejected", "error", "abort") else (
                    "rejected" if reason == "rejected" else "error")
                results[rid] = RequestResult(
                    order[rid], a.tenant, a.time, len(a.prompt), a.max_tokens, outcome=outcome,
                    start=a.time, ttft=m.ttft, itl=m.itls,
                    e2e=(m.finished_time - m.arrival_time) if m.finished_time is not None else None,
                    chunks=n_out, output_tokens=n_out, prompt_tokens=len(a.prompt))
                outputs[rid] = list(out.outputs[0].token_ids)
                if outcome != "rejected":  # (a rejected request was never admitted: no lookup)
                    cached[rid] = out.num_cached_tokens
                if m.num_preemptions:
                    preempted[rid] = m.num_preemptions
                stats[k_min].output_tokens += n_out
                if follow_up is not None and outcome == "ok":
                    nxt = follow_up(a, outputs[rid], eng.executor.clock)
                    if nxt is not None:
                        if nxt.time < eng.executor.clock:
                            raise ValueError("a follow-up cannot arrive before the request it follows finished")
                        push(nxt)
                step_done += remaining.pop(rid)
                del streamed[rid]
            ran = eng.step_log[-1].seq_ids
            for rid, n_out in zip(ran, eng.num_output_tokens(ran)):
                was = streamed.get(rid)
                if was is None:
                    continue  # it finished in this step: its whole count left above
                if n_out > was:
                    # the prompt leaves the router's count with the first token, each output token as it streams
                    done = (len(by_id[rid].prompt) if was == 0 else 0) + n_out - was
                    streamed[rid] = n_out
                    remaining[rid] -= done
                    step_done += done
            if step_done:
                heapq.heappush(drops, (eng.executor.clock, steps, k_min, step_done))
        for _, _, k, done in drops:
            loads[k] -= done
        for k, e in enumerate(engines):
            s, b = e.stats(), before_run[k]
            stats[k].hit_tokens = s.get("prefix_cache_hits", 0) - b.get("prefix_cache_hits", 0)
            stats[k].query_tokens = s.get("prefix_cache_queries", 0) - b.get("prefix_cache_queries", 0)
            stats[k].preemptions = s["num_preemptions"] - b["num_preemptions"]
        missing = [rid for rid in by_id if rid not in results]
        if missing and not stopped:
            raise RuntimeError(f"{len(missing)} requests never finished: {missing[:5]}")
        if missing:  # stopped at ``until``: the finished requests, numbered again in arrival order
            finished = sorted(results, key=order.__getitem__)
            order = {rid: i for i, rid in enumerate(finished)}
            results = {rid: replace(results[rid], index=i) for rid, i in order.items()}
            placement = {rid: placement[rid] for rid in finished}
            spilled &= order.keys()
        ends = [r.arrival + r.e2e for r in results.values() if r.e2e is not None]
        duration = (max(ends) - t0) if ends else 0.0
        return FleetResult(sorted(results.values(), key=lambda r: r.index), stats, placement, outputs, duration,
                           cached_tokens=cached, spilled_ids=spilled, preempted=preempted, _index=order,
                           until=until if stopped else None)


def run_fleet(workload: "ChatMix | Sequence[Arrival]", num_replicas: int, router: Router | str, *,
              executor_factory: Callable[[], Any] | None = None, engine_factory: Callable[[Any], Any] | None = None,
              until: float | None = None, **router_options: Any) -> FleetResult:
    """Build a fleet and serve ``workload`` (a :class:`ChatMix`, closed loop, or a list of arrivals), up to
    ``until`` if given (:meth:`Fleet.run`).

    ``router`` is a router object or a name for :func:`~minivllm.sim.router.make_router`; a named
    ``prefix_affinity`` router keys on :data:`KEY_BLOCKS` blocks unless ``key_blocks`` is given.
    """
    from minivllm.sim.router import make_router

    if isinstance(router, str):
        if router == "prefix_affinity":
            router_options.setdefault("key_blocks", KEY_BLOCKS)
        router = make_router(router, num_replicas, **router_options)
    fleet = Fleet(num_replicas, router, executor_factory=executor_factory, engine_factory=engine_factory)
    if isinstance(workload, ChatMix):
        return fleet.run(workload.arrivals(), follow_up=workload.follow_up, until=until)
    return fleet.run(workload, until=until)


__all__ = ["KEY_BLOCKS", "Fleet", "FleetResult", "ReplicaStats", "GPU_LIKE", "REPLICA", "ChatMix",
           "run_fleet", "sim_replica", "roofline_factory", "gpu_like_executor", "typical_decode_step_s"]
