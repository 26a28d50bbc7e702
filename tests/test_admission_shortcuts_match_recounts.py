"""The admission pass's shortcuts against recounts from scratch, call by call, on random capped workloads.

Each shortcut saves work an admission pass did per request tried, and must give the answer the work gave:

* ``Scheduler._admission_budget`` (a ranking policy's token budget) reads the running decodes' tokens tallied once
  per pass and kept as the pass seats requests; the oracle recounts every running request's tokens
  (``_chunk_cap``, a token-capped group's share up to its cap) and its rank, as the plain definition reads;
* ``Scheduler._cap_failure`` calls a group at its KV cap exactly ``"full"`` (no request of it can pass, so its
  tenant is passed over for the pass); the oracle charges every waiting request of that tenant its exact need
  (``_cap_needs``) against each group's cap and finds none within them;
* ``Scheduler._class_minima`` takes the keyed needs off the tenant's counts without a copy; the oracle walks the
  waiting queue and takes each class's smallest need.

Workloads: several tenants with KV shares, seat and token caps (some rejecting), share classes (a common system
prompt, its own prefix, none), ``n > 1`` samples, under every ranking policy and FCFS, with and without preemption.
"""

from __future__ import annotations

import random

import pytest

from minivllm import EngineConfig, LLMEngine, SamplingParams
from minivllm.config import TenantConfig, ThreeClassConfig
from minivllm.sched.scheduler import Scheduler
from minivllm.sim import SimulatedExecutor

BS = 8


def _workload(seed: int, policy: str) -> tuple[LLMEngine, list]:
    rng = random.Random(seed)
    mode = rng.choice(("recompute", "swap", "reject")) if policy != "wfq" else rng.choice(("recompute", "swap"))
    tenants = {}
    for i, cls in enumerate(("interactive", "agent", "batch")):
        tenants[f"t{i}"] = TenantConfig(
            max_kv_share=rng.choice((None, 0.1, 0.2, 0.3)), max_running=rng.choice((None, 1, 2, 4)),
            max_tokens_per_step=rng.choice((None, 24, 64)), over_cap=rng.choice(("wait", "wait", "reject")),
            priority_class=cls if policy == "three_class" else None)
    options = dict(scheduling_policy=policy, tenants=tenants, num_gpu_blocks_override=rng.choice((40, 64, 96)),
                   block_size=BS, max_num_seqs=rng.choice((4, 8)), max_num_batched_tokens=rng.choice((64, 128)),
                   max_model_len=256, enable_prefix_caching=True, preemption_mode=mode, device="cpu")
    if policy == "three_class":
        options["three_class"] = ThreeClassConfig(interactive_kv_reserve=0.25, agent_kv_share=rng.choice((0.1, 0.4)),
                                                  batch_max_interactive_queue=rng.choice((1, 100)))
    engine = LLMEngine(EngineConfig(**options), executor=SimulatedExecutor(), model_max_len=256, eos_token_ids=set())
    system = [rng.randrange(10, 500) for _ in range(3 * BS)]
    arrivals = []
    for i in range(rng.randint(20, 40)):
        tenant = rng.choice(list(tenants))
        head = system[:BS * rng.randint(1, 3)] if rng.random() < 0.5 else []  # (one to three shared blocks, or none)
        prompt = head + [rng.randrange(10, 500) for _ in range(rng.randint(1, 60))]
        params = SamplingParams(max_tokens=rng.randint(1, 24), n=rng.choice((1, 1, 1, 2)))
        arrivals.append((rng.randint(0, 30), prompt, params, f"r{i}", tenant, rng.randint(0, 2)))
    return engine, arrivals


def _run(engine: LLMEngine, arrivals: list) -> None:
    for step in range(400):
        for when, prompt, params, rid, tenant, priority in arrivals:
            if when == step:
                try:
                    engine.add_request(prompt, params, rid, tenant=tenant, priority=priority)
                except ValueError:  # (over a cap it could never fit: refused at the door, as it should be)
                    pass
        if step > 30 and not engine.has_unfinished_requests():
            return
        engine.step()


def _recount_budget(sched: Scheduler, req) -> int:
    """The token budget from scratch: every running decode and each running prefill ranked at or ahead of ``req``,
    each its ``_chunk_cap``, a token-capped group's tokens counted up to its cap."""
    key, free, grouped = sched._rank(req), 0, {}
    for r in sched.running:
        if not (r.is_decode or sched._rank(r) <= key):
            continue
        g = next((g for g in sched.caps.groups(r) if g.max_tokens is not None), None) if sched.caps else None
        if g is None:
            free += sched._chunk_cap(r)
        else:
            grouped[g.key] = (grouped.get(g.key, (0, g.max_tokens))[0] + sched._chunk_cap(r), g.max_tokens)
    return sched.config.max_num_batched_tokens - free - sum(min(t, cap) for t, cap in grouped.values())


def _brute_minima(sched: Scheduler, p, tenant: str) -> dict:
    """Per share class of ``tenant``'s waiting requests, the smallest fixed need, from the queue itself."""
    held_keys = sched._sharing_keys(p, next(r for r in sched.waiting if r.tenant == tenant))
    out: dict = {}
    for r in sched.waiting:
        if r.tenant == tenant:
            key = sched._waiting_key.get(r)
            cls = key if key in held_keys else None
            out[cls] = min(out.get(cls, 10**9), sched._waiting_need[r])
    return out


@pytest.mark.parametrize("policy", ["three_class", "wfq", "deadline", "priority", "caps", "fcfs"])
def test_admission_shortcuts_give_the_recounts_answers(monkeypatch, policy):
    budget, cap_check, minima = Scheduler._admission_budget, Scheduler._cap_check, Scheduler._class_minima
    seen = {"budget": 0, "full": 0, "minima": 0}
    misses = []

    def checked_budget(self, p, req):
        got = budget(self, p, req)
        seen["budget"] += 1
        if got != _recount_budget(self, req):
            misses.append(("budget", req.request_id, got, _recount_budget(self, req)))
        return got

    def checked_cap_check(self, p, req, need, per_step=True, exact_needs=True):
        failure, needs = cap_check(self, p, req, need, per_step, exact_needs)
        if failure == "full":
            seen["full"] += 1
            for r in list(self.waiting):  # no request of its tenant is within its caps, charged its exact need
                if r.tenant == req.tenant and r.status.name != "RUNNING":
                    exact = self._cap_needs(r, self._waiting_need[r], p.held)
                    for g, n in zip(self.caps.groups(r), exact, strict=True):
                        u = p.usage.get(g.key)
                        seats, blocks, tokens = (u.seats, u.blocks, u.tokens) if u else (0, 0, 0)
                        if (g.max_running is not None and seats >= g.max_running
                                or g.max_blocks is not None and blocks + n > g.max_blocks
                                or per_step and g.max_tokens is not None and tokens >= g.max_tokens):
                            break
                    else:
                        misses.append(("full", req.request_id, r.request_id, exact))
        return failure, needs

    def checked_minima(self, p, req, cls):
        got = minima(self, p, req, cls)
        seen["minima"] += 1
        want = _brute_minima(self, p, req.tenant)
        if got != want:
            misses.append(("minima", req.request_id, got, want))
        return got

    monkeypatch.setattr(Scheduler, "_admission_budget", checked_budget)
    monkeypatch.setattr(Scheduler, "_cap_check", checked_cap_check)
    monkeypatch.setattr(Scheduler, "_class_minima", checked_minima)
    for seed in range(12):
        engine, arrivals = _workload(seed, policy)
        _run(engine, arrivals)
    assert not misses, misses[:5]
    assert seen["full"] > 20
    if policy not in ("fcfs", "caps"):  # (no rank: the unranked budget is one subtraction per pass)
        assert seen["budget"] > 100
    if policy in ("three_class", "caps"):
        assert seen["minima"] > 5
