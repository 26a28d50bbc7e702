"""Lab 6's retry-loop and closed-loop-agent measurements, checked against recounts that do not use the code under
test: the engine's own timestamps and step log, the workload's prompt lengths, and the timeout arithmetic."""

from __future__ import annotations

import itertools
import math

import pytest

from minivllm.bench import fairness as bench
from minivllm.config import TenantConfig, ThreeClassConfig
from minivllm.labs import check_lab06 as lab

STORM = lab.retry_storm(12.0)
JOBS = [a for a in STORM if a.tenant == "app"]
CAP_REJECT = {"scheduling_policy": "caps", "tenants": {"app": TenantConfig(max_running=2, over_cap="reject")}}
CLASSES = {"chat": TenantConfig(priority_class="interactive"), "agent": TenantConfig(priority_class="agent"),
           "bulk": TenantConfig(priority_class="batch")}
KNOBS = ThreeClassConfig(interactive_kv_reserve=0.25, agent_kv_share=0.4, batch_max_interactive_queue=1)


def _storm(policy: dict | None = None, **client):
    c = lab.RetryClient("app", **client)
    return lab.serve(lab.lab_engine(policy), STORM, window=12.0, client=c), c


def _app_requests(res) -> list[str]:
    return [rid for rid, t in res.tenant_of.items() if t == "app"]


@pytest.mark.parametrize("abort", [False, True], ids=["keeps-abandoned", "aborts"])
def test_retry_sends_match_a_recount_from_first_token_times(abort):
    """Walk each job's sends with the timeout alone: send k+1 exists iff send k got no first token within T
    (by the engine's own first-token timestamps) and fewer than max_attempts were sent; it leaves at s_k + T."""
    T, most = 2.0, 5
    res, client = _storm(timeout_s=T, abort=abort, max_attempts=most)
    expected, accepted = 0, {}
    for job in JOBS:
        sent_at, rid, n = job.time, job.request_id, 1
        while True:
            assert res.arrival[rid] == pytest.approx(sent_at, abs=1e-6), (rid, res.arrival[rid], sent_at)
            first = res.first_token.get(rid)
            if first is not None and first - sent_at <= T:
                accepted[job.request_id] = rid
                break
            if n == most:
                break
            sent_at, rid, n = sent_at + T, f"{job.request_id}.r{n}", n + 1
        expected += n
    app = _app_requests(res)
    assert len(app) == expected == client.summary(res)["sent"]  # the engine saw exactly the recounted sends
    assert accepted == client.accepted
    assert expected > len(JOBS)  # T = 2 s is below the app's patient p95 wait: the loop does fire
    if abort:  # cancelled: the engine never finished an abandoned request
        assert not set(client.abandoned) & set(res.finished)
    else:  # nobody told the server: every abandoned request ran to its end
        assert set(client.abandoned) <= {r for r, why in res.finish_reason.items() if why == "length"}


def test_server_work_is_prompt_plus_output_per_request_sent():
    """Without preemption each request costs its prompt once plus one token per decode step (max_tokens - 1):
    a recount from the workload's prompt lengths, against the client's step-log total and its wasted share."""
    res, client = _storm(timeout_s=2.0)
    assert res.stats["per_tenant"]["app"]["num_preemptions"] == 0
    job_of = {a.request_id: a for a in JOBS}
    cost = {rid: len(job_of[rid.split(".")[0]].prompt) + job_of[rid.split(".")[0]].max_tokens - 1
            for rid in _app_requests(res)}
    m = client.summary(res)
    assert m["work"] == sum(cost.values())
    assert m["wasted"] == sum(c for rid, c in cost.items() if rid not in client.accepted.values())
    patient, pc = _storm()
    assert m["work"] > 2 * pc.summary(patient)["work"]  # the amplification the lab reports


def test_a_timeout_longer_than_every_wait_sends_what_the_patient_client_sends():
    patient, pc = _storm()
    longest = max(patient.first_token[rid] - patient.arrival[rid] for rid in _app_requests(patient))
    res, client = _storm(timeout_s=longest + 0.01)
    assert client.summary(res)["sent"] == pc.summary(patient)["sent"] == len(JOBS)
    assert not client.abandoned and len(client.accepted) == len(JOBS)
    assert res.ttft == patient.ttft and len(res.records) == len(patient.records)
    short, sc = _storm(timeout_s=longest - 0.01)  # just below the longest wait: that job is sent again
    assert sc.summary(short)["sent"] > len(JOBS)


def test_a_client_that_honours_retry_after_waits_for_the_hint():
    """Each rejected request's next send leaves no earlier than the engine's hint (timestamps from the engine's
    outputs), and no later than hint x 2^(k-1) x 1.5; a rejection costs the server no tokens."""
    res, client = _storm(CAP_REJECT, timeout_s=2.0)
    rejected = [r for r, why in res.finish_reason.items() if why == "rejected"]
    assert rejected and sorted(rejected) == sorted(client.rejected)
    for sends in client.sends.values():
        for k, ((rid, _), (_, at)) in enumerate(itertools.pairwise(sends), start=1):
            assert rid in rejected  # with this cap nobody times out: every resend follows a rejection
            hint = res.retry_after[rid]
            assert hint > 0
            assert res.finished[rid] + hint <= at + 1e-6 <= res.finished[rid] + hint * 2 ** (k - 1) * 1.5 + 2e-6
    m = client.summary(res)
    assert m["wasted"] == 0 and m["done"] == len(JOBS)
    at_once, ac = _storm(CAP_REJECT, timeout_s=2.0, honour_retry_after=False)
    for sends in ac.sends.values():  # retrying at once: the next send leaves when the rejection came back
        for (rid, _), (_, at) in itertools.pairwise(sends):
            assert at == pytest.approx(at_once.finished[rid], abs=1e-6)


@pytest.fixture(scope="module")
def agents():
    out = {}
    work, sessions = lab.agent_tasks(4)  # one workload for both runs: serve must not use up its sessions
    for policy in ("fcfs", "three_class"):
        out[policy] = lab.serve(lab.class_engine(policy, CLASSES, KNOBS), work, window=60.0, sessions=sessions)
    return out


@pytest.mark.parametrize("policy", ["fcfs", "three_class"])
def test_closed_loop_agent_calls_follow_the_previous_finish(agents, policy):
    res = agents[policy]
    assert len(res.calls) == len(lab.AGENT_STARTS)
    for s, ids in res.calls.items():
        assert len(ids) == 4 and res.arrival[ids[0]] == lab.AGENT_STARTS[s]
        for prev, nxt in itertools.pairwise(ids):
            assert res.arrival[nxt] >= res.finished[prev]
            assert res.arrival[nxt] == pytest.approx(res.finished[prev] + 0.05)
            first_step = next(r for r in res.records if nxt in r.seq_ids)  # from the engine's step log
            last_prev = [r for r in res.records if prev in r.seq_ids][-1]
            assert first_step.step > last_prev.step and first_step.time > res.finished[prev]
    for t in lab.agent_task_times(res).values():  # the identity the lab's table adds up
        assert t["task"] == pytest.approx(t["ttft"] + t["decode"] + 0.05 * (t["calls"] - 1))


def test_agent_tokens_and_calls_do_not_depend_on_the_policy(agents):
    fcfs, tc = agents["fcfs"], agents["three_class"]
    assert fcfs.calls == tc.calls
    ids = [rid for calls in fcfs.calls.values() for rid in calls]
    assert [fcfs.tokens[r] for r in ids] == [tc.tokens[r] for r in ids]
    wait = {p: sum(t["ttft"] for t in lab.agent_task_times(agents[p]).values()) for p in agents}
    assert wait["three_class"] < wait["fcfs"] / 2  # the lab's claim: the policy sets the per-call wait


def test_the_lab_and_the_benchmark_share_one_agent_mechanism():
    assert lab.next_agent_call is bench.next_agent_call
    s = {"calls_left": 1, "rng": __import__("random").Random(0)}
    t, prompt, n = bench.next_agent_call(s, [1, 2], [3], 10.0, 4096)
    assert t == 10.05 and prompt[:3] == [1, 2, 3] and len(prompt) == 3 + 80 and 40 <= n <= 100
    assert bench.next_agent_call(s, prompt, [], t, 4096) is None and s["calls_left"] == 0
    assert math.isinf(lab.RetryClient("x").timeout_s)
