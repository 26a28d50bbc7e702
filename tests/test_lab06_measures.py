"""Lab 6's retry-loop and closed-loop-agent measurements, checked against recounts that do not use the code under
test: the engine's own timestamps and step log, the workload's prompt lengths, and the timeout arithmetic.

The at-scale clauses of the worked policy (the 8K clause with 32K-token documents, the batch class's cost) are
checked against the roofline's own physics: the price of the heaviest chunk the clause allows bounds the worst
gap from below, and the batch alone can never beat its FLOPs at the preset's sustained rate."""

from __future__ import annotations

import itertools
import json
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


# -- the 8K clause with prompts above 8K (lab 6, "The 8K clause, with prompts above 8K") -------------------


@pytest.fixture(scope="module")
def long_prefill():
    from minivllm.labs import at_scale

    return {row: at_scale.long_prefill_run(*row) for row in ((16384, 16384), (16384, 8192), (1024, 8192))}


def test_the_8k_clause_caps_what_one_document_prefills_in_a_step(long_prefill):
    off, on, small = long_prefill[16384, 16384], long_prefill[16384, 8192], long_prefill[1024, 8192]
    assert off["max_chunk"] > 8192, "without the clause a 32K document fills most of a 16K step"
    assert on["max_chunk"] == 8192 and small["max_chunk"] <= 1024


def test_the_8k_clause_shortens_the_stall_but_only_the_budget_keeps_the_itl_promise(long_prefill):
    from minivllm.labs import at_scale

    off, on, small = long_prefill[16384, 16384], long_prefill[16384, 8192], long_prefill[1024, 8192]
    # The oracle is the roofline's own price of the heaviest chunk the clause allows: the document's last 8K
    # tokens, attending to the 24K before them.  A chat's gap that spans that step is at least that long.
    assert on["itl_worst"] >= at_scale.step_s([(32768 - 8192, 8192, False)])
    assert off["itl_worst"] > on["itl_worst"] and off["itl_p99"] > on["itl_p99"]
    assert on["ttft_chat_p99"] < off["ttft_chat_p99"], "the rest of the budget goes to the chats' prompts"
    assert on["itl_p99"] > 0.060, "the clause alone does not keep the interactive ITL promise"
    assert small["itl_p99"] <= 0.060 and small["ttft_chat_p99"] <= 0.700, "lab 4's budget keeps both promises"
    assert small["ttft_long"] > on["ttft_long"], "paid for by the documents' first token"


# -- the batch class: no SLO, minimise cost (lab 6, "The batch class: no SLO, minimise cost") ----------------


@pytest.fixture(scope="module")
def batch_cost():
    from minivllm.labs import at_scale

    return at_scale.batch_cost_runs()


def test_every_run_serves_every_request_and_bills_by_the_rented_time(batch_cost):
    from minivllm.labs.check_lab08 import GPU_HOUR_USD

    for name, r in batch_cost.items():
        assert r["served"] == r["requests"], name
        assert r["busy_s"] <= r["gpu_s"] + 1e-9
        assert r["usd_per_m"] == pytest.approx(GPU_HOUR_USD * r["gpu_s"] / 3600 / (r["tokens"] / 1e6)), name


def test_batch_rides_in_the_chats_slack_and_three_class_keeps_their_promise(batch_cost):
    from minivllm.labs import at_scale

    chats, shared, fcfs, alone = (batch_cost[k] for k in at_scale.BATCH_COST_ROWS)
    # Physics oracle: on its own the batch needs at least its FLOPs at the preset's sustained rate.
    shape, hw = at_scale.presets()
    assert alone["gpu_s"] >= 2 * shape.num_params * alone["tokens"] / (hw.peak_flops * hw.flops_util)
    extra = shared["gpu_s"] - chats["gpu_s"]
    assert 0 <= extra < 0.02 * alone["gpu_s"], "the batch tier fits in the time the chats rent anyway"
    assert shared["batch_done_s"] < chats["gpu_s"], "... finishing inside the chats' window"
    assert shared["chat_ttft_p95"] < 0.7 and shared["chat_itl_p95"] < 0.060, "interactive promise kept"
    assert fcfs["chat_ttft_p95"] > 0.7, "FCFS: same cost, the chats queue behind the backlog"
    assert chats["chat_itl_p95"] < shared["chat_itl_p95"], "the chats pay in ITL"


def test_the_quiz_quotes_the_batch_cost_runs(batch_cost):
    from minivllm.labs.quiz import load_bank

    q = next(q for q in load_bank(6) if q["id"] == "batch-slack")
    text = q["question"] + q["why"] + json.dumps(q["answers"])
    chats, shared, _, alone = (batch_cost[k] for k in ("chats alone", "chats + batch, three_class", "chats + batch, fcfs",
                                                        "batch alone"))
    assert f"({shared['batch_tokens']:,} tokens)" in text
    assert f"added {shared['gpu_s'] - chats['gpu_s']:.2f} GPU-seconds" in text
    assert f"alone they took {alone['gpu_s']:.2f} s" in text
    assert f"finished at {shared['batch_done_s']:.1f} s" in text and f"last chat ({chats['gpu_s']:.1f} s)" in text
    assert f"p95 {chats['chat_itl_p95'] * 1e3:.0f} -> {shared['chat_itl_p95'] * 1e3:.0f} ms" in text


def test_the_quiz_quotes_the_retry_storm_runs():
    """The retry-storm question quotes section 3's runs (the naive client, T = 2 s, under FCFS and under WFQ); its
    numbers are printed beside the lab's tables, so they must be the ones those tables print. The WFQ share went
    stale once (88% quoted after the fairness fix moved the WFQ row to 92%)."""
    from minivllm.labs.quiz import load_bank

    q = next(q for q in load_bank(6) if q["id"] == "retry-storm")
    text = q["question"] + q.get("why", "") + json.dumps(q["answers"], ensure_ascii=False)
    fcfs_res, fcfs = _storm(timeout_s=2.0)
    wfq_res, wfq = _storm(lab.wfq_policy(None), timeout_s=2.0)
    f, w = fcfs.summary(fcfs_res), wfq.summary(wfq_res)
    assert f"send {f['sent']} requests for {f['jobs']} jobs" in text
    assert f"{f['wasted share']:.0%} of its server tokens went to nobody" in text
    assert f"{w['wasted share']:.0%} of its server work was for nobody" in text


def test_lab6_prices_batch_tokens_at_the_notebooks_own_price():
    """Lab 6's batch-cost cell, like lab 8's, tells the learner to put in the price they pay: the runs and the
    per-token cost must follow the notebook's ``gpu_hour_usd``.  Oracle: dollars are proportional to the price, so
    twice the price doubles every ``usd_per_m`` (on the same simulated runs); and every dollar call in the lab's
    cells passes the notebook's price (a default bound at import would ignore a rebound ``GPU_HOUR_USD``)."""
    import ast
    import importlib.util
    from pathlib import Path

    from minivllm.labs import at_scale

    small = dict(seconds=4.0, chat_rate=1.0, num_batch=2)
    base = at_scale.batch_cost_runs(gpu_hour_usd=3.0, **small)
    double = at_scale.batch_cost_runs(gpu_hour_usd=6.0, **small)
    for name, row in base.items():
        assert double[name]["usd_per_m"] == pytest.approx(2 * row["usd_per_m"]), name
    path = Path(__file__).resolve().parents[1] / "tools" / "lab_texts" / "lab06_fairness.py"
    spec = importlib.util.spec_from_file_location("lab06_text", path)
    text = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(text)
    calls = []
    for kind, source, *_ in text.CELLS:
        if kind != "code" or "usd" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "window_usd", "usd_per_million", "batch_cost_runs"):
                calls.append((ast.unparse(node), [k.arg for k in node.keywords]))
    assert len(calls) >= 2, calls
    for call, keywords in calls:
        assert "gpu_hour_usd" in keywords, f"lab 6 prices at the import-time default: {call}"
