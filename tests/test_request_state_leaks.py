"""Per-request bookkeeping ends with the request, on every ending path.

A long-lived server must not keep anything keyed by a request once the request
is gone: a dict entry left on one rare path (a sample aborted while its group
runs on, a rejection, an executor failure) grows by one per request, forever.
``no_leak`` in test_reliability checks the request table and the KV blocks;
this test checks every per-request container the engine keeps beside them
(output streams, group slots and first-times, the scheduler's waiting needs
and cap-rejection set, deferred and pending aborts, the metrics' tracking),
after thousands of requests through all the ending paths at once.  The oracle
is emptiness: nothing is in flight, so no container keyed by a request may
hold anything.
"""

from __future__ import annotations

import itertools
import random

from minivllm.config import EngineConfig, TenantConfig
from minivllm.engine.llm_engine import LLMEngine
from minivllm.metrics.prometheus import EngineMetrics, observe_all
from minivllm.sampling_params import SamplingParams
from minivllm.sim.executor import SimulatedExecutor


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        if 777 in ids:
            raise RuntimeError("cannot decode 777")  # the output-processing error path
        return "".join(f"w{i} " for i in ids)

    def encode(self, text, add_special_tokens=True):
        return [int(w[1:]) for w in text.split()]


class _Flaky(SimulatedExecutor):
    """Fails every 23rd step with work (finish reason "error") and aborts from inside a step on request."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.engine = None
        self.abort_inside: list[str] = []
        self.aborted_inside: list[str] = []

    def execute(self, batch):
        self.calls += 1
        while self.abort_inside:  # re-entrant abort: deferred to the end of the step
            rid = self.abort_inside.pop()
            if self.engine.abort_request(rid):
                self.aborted_inside.append(rid)
        if batch.seqs and self.calls % 23 == 0:
            raise RuntimeError("device fell over")
        return super().execute(batch)


def _per_request_state(engine: LLMEngine, metrics: EngineMetrics | None = None) -> dict[str, int]:
    """Everything the engine (and ``metrics``, if given) keeps per request, and the blocks in use: all zero
    once nothing is in flight."""
    sched, out = engine.scheduler, engine.outputs
    state = {
        "engine.requests": len(engine.requests),
        "engine._groups": len(engine._groups),
        "engine._finished_elsewhere": len(engine._finished_elsewhere),
        "engine._deferred_aborts": len(engine._deferred_aborts),
        "outputs._streams": len(out._streams),
        "outputs._groups": len(out._groups),
        "scheduler.waiting": len(sched.waiting),
        "scheduler.running": len(sched.running),
        "scheduler._waiting_need": len(sched._waiting_need),
        "scheduler._needs_by_tenant": len(sched._needs_by_tenant),
        "scheduler._waiting_key": len(sched._waiting_key),
        "scheduler._needs_by_key": len(sched._needs_by_key),
        "scheduler.waiting_by_tenant": len(sched.waiting_by_tenant),
        "scheduler._cap_rejected": len(sched._cap_rejected),
        "used_blocks": engine.stats()["used_blocks"],
        "cpu_blocks_used": engine.stats()["cpu_blocks_used"],
    }
    if metrics is not None:
        state["metrics._tracked"] = len(metrics._tracked)
    return state


def _serve(mode: str, tenants=None, rounds: int = 6, per_round: int = 120) -> tuple[LLMEngine, EngineMetrics, dict]:
    cfg = EngineConfig(num_gpu_blocks_override=48, num_cpu_blocks_override=64, block_size=4, max_model_len=96,
                       max_num_seqs=6, max_num_batched_tokens=32, preemption_mode=mode, enable_prefix_caching=True,
                       device="cpu", **({"tenants": tenants} if tenants else {}))
    executor = _Flaky()
    engine = LLMEngine(cfg, executor=executor, tokenizer=_Tok(), model_max_len=96, eos_token_ids=set())
    executor.engine = engine
    metrics = EngineMetrics("sim")
    rng, ids = random.Random(0), itertools.count()
    paths: dict[str, int] = {}
    for _ in range(rounds):
        later: list[tuple[int, str]] = []  # (step, id to abort)
        for _ in range(per_round):
            rid, path = f"r{next(ids)}", rng.choice(
                ["length", "stop", "n3", "abort", "sample_abort", "group_abort", "abort_in_step", "bad", "detok_error"])
            paths[path] = paths.get(path, 0) + 1
            if path == "bad":  # refused at the boundary: nothing may stay behind
                for prompt, params in (({"prompt_token_ids": list(range(10, 400))}, SamplingParams(max_tokens=5)),
                                       ({"prompt_token_ids": []}, SamplingParams(max_tokens=5))):
                    try:
                        engine.add_request(prompt, params, rid)
                    except ValueError:
                        pass
                continue
            n = 3 if path in ("n3", "sample_abort", "group_abort") else 1
            prompt = list(range(100, 116)) + [rng.randrange(10, 700) for _ in range(rng.randint(1, 30))]
            if path == "detok_error":
                prompt = [777, 11, 12]
            params = SamplingParams(n=n, max_tokens=rng.randint(1, 30), ignore_eos=True,
                                    output_kind=rng.choice(["cumulative", "delta", "final_only"]),
                                    stop=["1"] if path == "stop" else None)
            tenant = rng.choice(["a", "b", "c"])
            try:
                engine.add_request({"prompt_token_ids": prompt}, params, rid, tenant=tenant)
            except ValueError:  # more than its tenant's KV cap could ever hold: refused, as "bad" is
                continue
            metrics.track(rid, tenant)
            if path == "abort":
                later.append((rng.randint(0, 8), rid))
            elif path == "sample_abort":
                later.append((rng.randint(0, 8), f"{rid}#1"))
            elif path == "group_abort":
                later.append((rng.randint(0, 8), rid))
            elif path == "abort_in_step":
                executor.abort_inside.append(rid)
        step = 0
        while engine.has_unfinished_requests() or later:
            for item in [x for x in later if x[0] <= step]:
                later.remove(item)
                if engine.abort_request(item[1]) and "#" not in item[1]:
                    metrics.observe_abort(item[1])  # what the server does; an aborted sample still reports
            outs = engine.step() if engine.has_unfinished_requests() else []
            observe_all(metrics, engine, outs)
            while executor.aborted_inside:  # ended by an in-step (deferred) abort: no output reports it
                metrics.observe_abort(executor.aborted_inside.pop())
            step += 1
            assert step < 50_000
    return engine, metrics, paths


def _check(mode: str, tenants=None) -> None:
    engine, metrics, paths = _serve(mode, tenants)
    assert len(paths) == 9  # every ending path was taken
    stats = engine.stats()
    assert stats["num_errors"] > 0  # the executor's and the detokenizer's failures happened
    leftovers = {k: v for k, v in _per_request_state(engine, metrics).items() if v}
    assert not leftovers, f"per-request state left after {sum(paths.values())} requests ({mode}): {leftovers}"


def test_nothing_per_request_survives_recompute_preemption():
    _check("recompute")


def test_nothing_per_request_survives_swap_preemption():
    _check("swap")


def test_nothing_per_request_survives_reject_mode_and_cap_rejections():
    _check("reject", {"a": TenantConfig(max_running=2, over_cap="reject"), "b": TenantConfig(max_kv_share=0.3)})
