"""The server and the Prometheus metrics without a model: the real engine on the virtual-clock executor.

Fast (no model load), so it runs in the default suite: per-tenant preemption
counters (by mode) match ``engine.stats()``, token counters match the
responses, and the offline helper records the same numbers without a server.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from minivllm.config import EngineConfig  # noqa: E402
from minivllm.engine.llm_engine import LLMEngine  # noqa: E402
from minivllm.sampling_params import SamplingParams  # noqa: E402
from minivllm.sim.executor import SimulatedExecutor  # noqa: E402


def _sim_engine(mode: str = "recompute", blocks: int = 12) -> LLMEngine:
    cfg = EngineConfig(num_gpu_blocks_override=blocks, num_cpu_blocks_override=64, block_size=4, max_model_len=40,
                       max_num_seqs=8, preemption_mode=mode, device="cpu")
    return LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=40, eos_token_ids=set())


def _samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def _value(samples: dict, name: str, **labels) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))


def test_offline_metrics_count_preemptions_by_mode_and_tenant():
    from minivllm.metrics.prometheus import EngineMetrics, observe_all

    engine = _sim_engine("recompute")
    metrics = EngineMetrics("sim")
    tenants = {}
    for i in range(6):
        rid = engine.add_request({"prompt_token_ids": list(range(10, 22))}, SamplingParams(max_tokens=20, ignore_eos=True),
                                 tenant=f"t{i % 2}")
        tenants[rid] = f"t{i % 2}"
        metrics.track(rid, tenants[rid])
    generated = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        generated += sum(len(o.delta_token_ids) for out in outs for o in out.outputs)
        observe_all(metrics, engine, outs, tenants.get)
    stats = engine.stats()
    s = _samples(metrics.render().decode())
    assert stats["num_preemptions"] > 0
    assert _value(s, "vllm:num_preemptions_total", mode="recompute") == stats["num_recompute_preemptions"]
    assert _value(s, "vllm:num_preemptions_total", tenant="unknown") == 0
    assert _value(s, "vllm:num_preemptions_total", tenant="t0") + _value(s, "vllm:num_preemptions_total", tenant="t1") \
        == stats["num_preemptions"]
    assert _value(s, "vllm:num_recomputed_tokens_total") == stats["recomputed_tokens"]
    assert _value(s, "vllm:generation_tokens_total") == generated == 6 * 20
    assert _value(s, "vllm:prompt_tokens_total", tenant="t0") == 3 * 12
    assert _value(s, "vllm:request_success_total", finished_reason="length") == 6
    assert _value(s, "vllm:time_to_first_token_seconds_count") == 6
    assert _value(s, "vllm:inter_token_latency_seconds_count") == 6 * 19
    assert _value(s, "vllm:iteration_tokens_total_count") == sum(1 for r in engine.step_log if r.num_tokens)
    assert _value(s, "vllm:iteration_tokens_total_sum") == sum(r.num_tokens for r in engine.step_log)
    assert _value(s, "vllm:num_requests_running") == 0 and _value(s, "vllm:kv_cache_used_blocks") == 0


def test_two_registries_do_not_share_state():
    from minivllm.metrics.prometheus import EngineMetrics

    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.prompt_tokens.labels("a", "x").inc(5)
    assert "vllm:prompt_tokens_total" in a.render().decode()
    assert 'model_name="a"' not in b.render().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_on_the_simulated_engine_counts_per_tenant():
    from minivllm.server import build_app

    engine = _sim_engine("swap")
    app = build_app(engine, ["sim"], {"ka": "alice", "kb": "bob"})
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < end and thread.is_alive()
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"

        async def main() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                jobs = [
                    client.post(base + "/v1/completions", headers={"Authorization": f"Bearer {'ka' if i % 2 else 'kb'}"},
                                json={"prompt": list(range(10, 22)), "max_tokens": 20, "ignore_eos": True})
                    for i in range(6)
                ]
                return await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)

        responses = asyncio.run(main())
        assert [r.status_code for r in responses] == [200] * 6
        assert all(r.json()["usage"]["completion_tokens"] == 20 for r in responses)
        s = _samples(httpx.get(base + "/metrics", timeout=30).text)
        stats = engine.stats()
        assert stats["num_preemptions"] > 0
        for mode in ("recompute", "swap"):
            assert _value(s, "vllm:num_preemptions_total", mode=mode) == stats[f"num_{mode}_preemptions"]
        assert _value(s, "vllm:num_preemptions_total", tenant="alice") + _value(s, "vllm:num_preemptions_total", tenant="bob") \
            == stats["num_preemptions"]
        assert _value(s, "vllm:generation_tokens_total", tenant="alice") == 60
        assert _value(s, "vllm:generation_tokens_total", tenant="bob") == 60
    finally:
        server.should_exit = True
        thread.join(20)
    assert not thread.is_alive()
