"""Tests written in a mutation pass over the command lines (``minivllm``, ``python -m minivllm``,
``python -m minivllm.bench``) and the report arithmetic of the fairness, activations, eager_step and attention
benchmarks.

Each test pins a bug that was planted in the code and that no other test noticed: a flag parsed and then not
forwarded, a default changed, an exit status lost, a unit or percentile slip in a benchmark's table.  The oracles
are independent of the code under test: the command line typed (argparse's own parse of it), the engine's own
defaults, a subprocess's exit status, hand counts and the benchmarks' documented formulas.  No model is loaded:
the engine is a stand-in or the simulated executor, a benchmark's timer is replaced by a fixed number.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import minivllm
from minivllm.cli import main as cli_main

from tests.test_cli_errors import _argv_main


class _Reached(Exception):
    pass


# -- minivllm generate / serve: every flag reaches the engine, defaults are the engine's ------------------------


def _record_generate(monkeypatch, argv):
    """Run ``minivllm generate`` up to its first ``add_request``: what the LLM, the sampling parameters and the
    engine were given."""
    seen = {"chat": []}

    class Engine:
        def add_request(self, source, params):
            seen["source"], seen["params"] = source, params
            raise _Reached

    class StandIn:
        tokenizer = object()
        engine = Engine()

        def __init__(self, model, **options):
            seen["model"], seen["options"] = model, options

        def chat_prompt(self, messages):
            seen["chat"].append(messages)
            return {"prompt_token_ids": [1, 2, 3]}

    monkeypatch.setattr(minivllm, "LLM", StandIn)
    with pytest.raises(_Reached):
        cli_main(["generate", *argv])
    return seen


def test_generate_forwards_every_engine_and_sampling_flag_as_typed(monkeypatch):
    """Kills: ``--block-size``, ``--max-num-batched-tokens``, ``--dtype`` or ``--linear-backend`` parsed and then
    dropped (the engine ran on its defaults), ``--top-p`` replaced by 1.0, and ``--top-p`` parsed as an int (0.9
    refused).  Oracle: the command line typed."""
    seen = _record_generate(monkeypatch, [
        "hi", "--model", "some/dir", "--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9", "--top-k", "3",
        "--seed", "11", "--dtype", "float32", "--block-size", "8", "--max-num-batched-tokens", "96",
        "--attention-backend", "torch", "--linear-backend", "torch"])
    assert seen["model"] == "some/dir"
    assert seen["options"] == dict(dtype="float32", block_size=8, max_num_batched_tokens=96,
                                   attention_backend="torch", linear_backend="torch")
    p = seen["params"]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0.5, 0.9, 3, 11)


def test_generate_defaults_are_greedy_64_tokens_and_the_engines_own_block_size(monkeypatch):
    """Kills: ``--temperature`` defaulting to 1.0 (a demo that samples), ``--max-tokens`` to 16 and
    ``--block-size`` to 32.  Oracle: ``EngineConfig``'s own block size (the CLI must not change the engine
    it demonstrates), greedy decoding (the README's demo answers are reproducible) and the README's
    ``--max-tokens 64`` example, which restates the default."""
    from minivllm.config import EngineConfig

    seen = _record_generate(monkeypatch, ["hi"])
    assert seen["options"]["block_size"] == EngineConfig().block_size
    assert seen["options"]["max_num_batched_tokens"] is None  # None: the engine sizes it
    p = seen["params"]
    assert p.temperature == 0.0 and p.max_tokens == 64 and p.top_p == 1.0 and p.top_k == -1 and p.seed is None


def test_generate_sends_the_chat_template_unless_no_chat(monkeypatch):
    """Kills: ``--no-chat`` inverted (raw prompts by default, the template only with ``--no-chat``).  Oracle: the
    flag's help, "send prompts raw, without the chat template"."""
    seen = _record_generate(monkeypatch, ["hello there"])
    assert seen["chat"] == [[{"role": "user", "content": "hello there"}]]
    assert seen["source"] == {"prompt_token_ids": [1, 2, 3]}
    seen = _record_generate(monkeypatch, ["hello there", "--no-chat"])
    assert seen["chat"] == [] and seen["source"] == "hello there"


def _record_serve(monkeypatch, argv):
    """Run ``minivllm serve`` with a stand-in model (a tiny simulated engine) and no listening socket: what the
    LLM, ``build_app`` and uvicorn were given."""
    uvicorn = pytest.importorskip("uvicorn")
    import minivllm.engine.startup
    import minivllm.server

    from tests.invariants import tiny_engine

    seen = {}

    class StandIn:
        def __init__(self, model, **options):
            seen["model"], seen["options"] = model, options
            self.engine = tiny_engine()

        def close(self):
            pass

    real_build_app = minivllm.server.build_app

    def build_app(engine, model_names, api_keys, **kw):
        seen["model_names"], seen["api_keys"], seen["door"] = model_names, api_keys, kw.get("door")
        return real_build_app(engine, model_names or ["stand-in"], api_keys, **kw)

    monkeypatch.delenv("MINIVLLM_API_KEYS", raising=False)
    monkeypatch.setattr(minivllm, "LLM", StandIn)
    monkeypatch.setattr(minivllm.server, "build_app", build_app)
    monkeypatch.setattr(minivllm.engine.startup, "freeze_startup_heap", lambda: 0)  # the test process goes on
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **k: seen.setdefault("config", self.config))
    assert cli_main(["serve", *argv]) == 0
    return seen


def test_serve_forwards_every_engine_and_server_flag_as_typed(monkeypatch, tmp_path):
    """Kills: ``--num-gpu-blocks-override`` and ``--enable-prefix-caching`` dropped, ``--port`` and
    ``--log-level`` not handed to uvicorn, ``--served-model-name`` replaced by the model's own name,
    ``--min-free-blocks`` not handed to the door rule and ``--api-keys-file`` not read.  Oracle: the command
    line typed."""
    keys = tmp_path / "keys.json"
    keys.write_text('{"k1": "alice"}')
    seen = _record_serve(monkeypatch, [
        "some/dir", "--host", "127.0.0.2", "--port", "8123", "--served-model-name", "a", "b",
        "--api-keys-file", str(keys), "--max-num-seqs", "3", "--max-num-batched-tokens", "64", "--max-model-len", "128",
        "--block-size", "8", "--enable-prefix-caching", "--preemption-mode", "swap", "--num-gpu-blocks-override", "50",
        "--dtype", "float32", "--attention-backend", "torch", "--linear-backend", "torch",
        "--max-waiting-requests", "5", "--min-free-blocks", "2", "--log-level", "warning", "--stall-timeout-s", "2.5"])
    assert seen["model"] == "some/dir"
    assert seen["options"] == dict(max_num_seqs=3, max_num_batched_tokens=64, max_model_len=128, block_size=8,
                                   preemption_mode="swap", num_gpu_blocks_override=50, dtype="float32",
                                   attention_backend="torch", linear_backend="torch", enable_prefix_caching=True,
                                   stall_timeout_s=2.5)
    assert seen["model_names"] == ["a", "b"] and seen["api_keys"] == {"k1": "alice"}
    assert (seen["door"].max_waiting, seen["door"].min_free_blocks) == (5, 2)
    config = seen["config"]
    assert (config.host, config.port, config.log_level) == ("127.0.0.2", 8123, "warning")


def test_serve_defaults_leave_the_engine_alone_and_listen_on_loopback_port_8000(monkeypatch):
    """Kills: ``--port`` defaulting to 8080 and ``--host`` to every interface (0.0.0.0 exposes an
    unauthenticated server to the network), and ``--min-free-blocks`` defaulting to 1.  Oracle: the README
    (``minivllm serve --port 8000``, clients on ``localhost:8000``; vLLM's port), and the engine's own
    defaults: no option is passed that the operator did not type."""
    seen = _record_serve(monkeypatch, ["--max-waiting-requests", "4"])
    assert seen["model"] is None and seen["options"] == {} and seen["model_names"] is None
    assert seen["door"].min_free_blocks == 0
    assert (seen["config"].host, seen["config"].port, seen["config"].log_level) == ("127.0.0.1", 8000, "info")


@pytest.mark.parametrize("spelling", ["off", "OFF", "inf"])
def test_serve_stall_timeout_off_turns_the_engines_watchdog_off(monkeypatch, spelling):
    """Kills: ``off`` forwarded as ``inf`` (the engine refuses a timeout that is not finite, so the server would
    not start) or dropped (the engine's 10 s default would stay on).  Oracle: ``EngineConfig``'s own meaning,
    ``stall_timeout_s=None`` is "no watchdog", checked on a config built from the forwarded options."""
    from minivllm.config import EngineConfig

    seen = _record_serve(monkeypatch, ["--stall-timeout-s", spelling])
    assert seen["options"] == {"stall_timeout_s": None}
    assert EngineConfig(**seen["options"]).stall_timeout_s is None


def test_python_dash_m_minivllm_exits_with_mains_status():
    """Kills: ``python -m minivllm`` calling ``main()`` without ``sys.exit`` (every error exited 0, so a script
    or CI step could not tell).  Oracle: the subprocess's exit status for a missing API-keys file, an error
    ``main`` reports by returning 2 (argparse errors exit 2 on their own and would not notice)."""
    r = subprocess.run([sys.executable, "-m", "minivllm", "serve", "--api-keys-file", "/nonexistent/keys.json"],
                       capture_output=True, text=True, timeout=120,
                       cwd=Path(minivllm.__file__).parent.parent)  # this checkout's package, first on sys.path
    assert r.returncode == 2, r.stderr
    assert "minivllm: error:" in r.stderr and "keys.json" in r.stderr and "Traceback" not in r.stderr


# -- python -m minivllm.bench ------------------------------------------------------------------------------------


def _launch(monkeypatch, *argv):
    import runpy

    monkeypatch.setattr(sys, "argv", ["minivllm.bench", *argv])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("minivllm.bench", run_name="__main__")
    return exc.value.code


def test_bench_launcher_passes_a_benchmarks_own_failure_status_through(monkeypatch, capsys):
    """Kills: the launcher replacing a benchmark's return value by 0.  Oracle: the attention benchmark returns 2
    when there is no CUDA device (and no ``--smoke``): the launcher must exit 2 too."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _launch(monkeypatch, "attention") == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bench_launcher_without_a_name_lists_the_benchmarks_and_exits_2(monkeypatch, capsys):
    """Kills: the "no name" check dropped (an IndexError traceback).  Oracle: the launcher's usage, exit 2."""
    assert _launch(monkeypatch) == 2
    err = capsys.readouterr().err
    assert "name a benchmark" in err and "Traceback" not in err


@pytest.mark.parametrize("name", ["activations", "eager_step", "fairness", "fleet", "host_overhead", "linear",
                                  "prefix_structures"])
def test_bench_launcher_runs_the_benchmark_it_is_asked_for(monkeypatch, capsys, name):
    """Kills: a copy-paste slip in the name -> module table (``activations`` running eager_step).  Oracle: each
    benchmark's ``--help`` opens with its own docstring's first line, which names it."""
    import importlib

    assert _launch(monkeypatch, name, "--help") == 0
    doc = importlib.import_module(f"minivllm.bench.{name}").__doc__
    first = " ".join(doc.split("\n\n")[0].split())
    out = " ".join(capsys.readouterr().out.split())
    assert first[:60] in out, (first, out[:300])


# -- bench fairness: the report rows ----------------------------------------------------------------------------


def _out(tenant_ttft, itls=(), finished=10.0, reason="length"):
    return SimpleNamespace(metrics=SimpleNamespace(ttft=tenant_ttft, itls=list(itls), finished_time=finished),
                           outputs=[SimpleNamespace(finish_reason=reason)])


def test_fairness_rows_report_nearest_rank_p95_tokens_per_window_second_and_the_engines_preemptions():
    """Kills: TTFT p95 computed as p90, tokens/s divided by the run's length instead of the window, and the
    preemptions read from a key the engine's stats do not have (always 0).  Oracle: the nearest-rank rule by hand
    (p95 of 1..20 is the 19th value, p50 the 10th), the window's tokens over the window, and the per-tenant
    ``num_preemptions`` of ``LLMEngine.stats()``."""
    from minivllm.bench import fairness as bench

    res = bench.Run(outputs={f"r{i}": ("quiet", _out(float(i), itls=[0.01 * i])) for i in range(1, 21)},
                    window_stats={"quiet": {"prompt_tokens": 300, "output_tokens": 100}},
                    kv_share={"quiet": 0.25}, clock=100.0,
                    stats={"per_tenant": {"quiet": {"num_preemptions": 3}}})
    [row] = bench.tenant_rows("wfq", res, window=20.0)
    assert row["ttft_p50_s"] == 10.0 and row["ttft_p95_s"] == 19.0
    assert row["itl_p95_s"] == pytest.approx(0.19)
    assert row["tokens_per_s"] == 400 / 20.0 and row["kv_share"] == 0.25 and row["preemptions"] == 3
    assert row["requests"] == 20
    # the stats key, checked against a real run that preempts
    from tests.test_labs import recompute_run

    stats = recompute_run()[0].stats()
    assert stats["num_preemptions"] > 0
    res.stats = stats
    assert bench.tenant_rows("x", res, 1.0)[0]["preemptions"] == 0  # "quiet" ran nothing here
    res.outputs = {"a": ("default", _out(1.0))}
    assert bench.tenant_rows("x", res, 1.0)[0]["preemptions"] == stats["num_preemptions"]


def test_fairness_table_shows_itl_in_milliseconds():
    """Kills: ``ITL p95`` printed in microseconds under an ``ms`` header.  Oracle: 25 ms is 0.025 s."""
    from minivllm.bench.fairness import format_rows

    row = dict(policy="fcfs", tenant="quiet", requests=3, ttft_p50_s=0.1, ttft_p95_s=0.2, itl_p95_s=0.025,
               tokens_per_s=100.0, kv_share=0.5, preemptions=0)
    line = format_rows([row]).splitlines()[-1]
    assert "    25ms" in line and "50%" in line


def test_fairness_kv_share_counts_only_the_window():
    """Kills: the KV share taken over the whole run instead of the window.  Hand count, 1 s steps, an 8-block pool,
    a 2.5 s window: a 4-token prompt with 5 outputs holds one block after each step, so inside the window it holds
    1 block for 2.5 s (the steps ending at 1 and 2 s, and half the one ending at 3 s): 2.5/2.5/8 = 1/8.  (When
    the share was a mean per step, the run's 5 steps gave 2/5/8 where the window's gave 1/8.)"""
    from minivllm.arrival import Arrival
    from minivllm.bench import fairness as bench

    res = bench.run("fcfs", [Arrival(0.0, "a-0", "a", (1, 2, 3, 4), 5)], window=2.5, blocks=8, max_len=128,
                    step=dict(fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0))
    assert res.steps == 5
    assert res.kv_share == {"a": pytest.approx(1 / 8)}


def test_fairness_kv_share_weights_each_step_by_its_time():
    """Kills: the KV share as a mean per step (every step one vote, a 1 s decode as heavy as a 33 s prefill).
    Hand trace, step time = tokens x 1 s, an 8-block pool of 16-token blocks, a 40 s window: a (4-token prompt, 3
    outputs, at 0 s) holds 1 block after its 4 s prefill and after its 1 s decode, then finishes in the 33 s step
    that also prefills b (32 tokens, 2 outputs, arriving at 4.5 s), after which b holds 2 blocks for that step and
    nothing after its 1 s last decode.  Block-seconds: a 1x4 + 1x1 = 5, b 2x33 = 66, so the shares are 5/40/8 and
    66/40/8.  A mean over the 4 steps reads 1/16 for both.  (The holdings are the step log's, after each step, as a
    scraped gauge reads them: a's block during the 33 s step in which it finishes is not counted; counted during
    the step, the block-seconds would be 38 and 69.)"""
    from minivllm.arrival import Arrival
    from minivllm.bench import fairness as bench

    arrivals = [Arrival(0.0, "a-0", "a", (1, 2, 3, 4), 3), Arrival(4.5, "b-0", "b", tuple(range(5, 37)), 2)]
    res = bench.run("fcfs", arrivals, window=40.0, blocks=8, max_len=128,
                    step=dict(fixed_overhead_s=0.0, per_token_s=1.0, per_context_token_s=0.0))
    assert res.steps == 4 and res.clock == pytest.approx(39.0)
    assert res.kv_share == {"a": pytest.approx(5 / 40 / 8), "b": pytest.approx(66 / 40 / 8)}


def test_fairness_slo_report_scores_each_request_on_its_own_itl_p95_and_counts_finished_requests():
    """Kills: a request's ITL judged by its median instead of its p95, the "finished" count reading the wrong
    finish reason (the benchmark's requests ignore EOS: they all end by "length"), the last finish taken as the
    first, the TTFT-only attainment divided by every request of the run, a request's ITL judged by its p99 (one
    spike in 20 gaps is its p99, not its p95), and every request counted as finished (a rejected one is not).
    Oracle: by hand, the nearest-rank rule (p95 of 20 gaps is the 19th)."""
    from minivllm.bench import fairness as bench

    smooth = _out(0.1, itls=[0.01] * 20, finished=5.0)
    spiky = _out(0.1, itls=[0.01] * 18 + [0.5, 0.5], finished=9.0)  # median 10 ms, p95 500 ms
    late = _out(3.0, itls=[0.01] * 20, finished=7.0)
    other = _out(0.1, finished=1.0)
    one_spike = _out(0.1, itls=[0.01] * 19 + [0.5], finished=2.0)  # p95 10 ms, p99 500 ms
    refused = _out(5.0, finished=0.5, reason="rejected")
    res = bench.Run(outputs={"a": ("chat", smooth), "b": ("chat", spiky), "c": ("chat", late), "d": ("bulk", other),
                             "e": ("chat", one_spike), "f": ("chat", refused)})
    r = bench.slo_report(res, {"chat": (0.7, 0.060)})["chat"]
    assert r["requests"] == 5 and r["slo_attainment"] == pytest.approx(2 / 5)
    assert r["ttft_slo_attainment"] == pytest.approx(3 / 5)
    assert r["finished"] == 4 and r["last_finish_s"] == 9.0


def test_an_agents_next_call_is_made_exactly_when_the_engine_would_serve_its_whole_answer():
    """Kills: the agent's next call checked against ``max_len`` without room for its answer, and the check
    refusing one token early (``len(ctx) + 100 >= max_len`` refused an 83-token call with up to 100 output tokens
    at ``max_len`` 183, which the engine serves whole).  Oracle: the engine itself, given that very call (its
    prompt and ``max_tokens``) at each ``max_len`` around the edge: the call is made exactly when the engine
    accepts it and returns all ``max_tokens`` tokens (at one less the engine cuts the answer short, and a prompt
    that fills the context it refuses outright)."""
    import copy

    from minivllm import EngineConfig, LLMEngine, SamplingParams
    from minivllm.bench.fairness import next_agent_call
    from minivllm.sim import SimulatedExecutor

    def engine_serves_whole(prompt: list[int], max_tokens: int, max_len: int) -> bool:
        cfg = EngineConfig(num_gpu_blocks_override=64, block_size=16, max_model_len=max_len, device="cpu")
        engine = LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=max_len, eos_token_ids=set())
        try:
            engine.add_request({"prompt_token_ids": prompt}, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        except ValueError:
            return False
        out = [o for _ in range(10_000) if engine.has_unfinished_requests() for o in engine.step() if o.finished]
        return len(out[0].outputs[0].token_ids) == max_tokens

    session = {"calls_left": 3, "rng": random.Random(0)}
    _, ctx, n = next_agent_call(copy.deepcopy(session), [1, 2], [3], 0.0, 10**6)  # the call, whatever the limit
    assert len(ctx) == 83 and 40 <= n <= 100
    edge = len(ctx) + n
    seen = {}
    for max_len in (len(ctx), len(ctx) + 1, edge - 1, edge, edge + 1):
        call = next_agent_call(copy.deepcopy(session), [1, 2], [3], 0.0, max_len)
        assert call is None or (call[1], call[2]) == (ctx, n)
        seen[max_len] = call is not None
        assert seen[max_len] == engine_serves_whole(ctx, n, max_len), max_len
    assert seen == {len(ctx): False, len(ctx) + 1: False, edge - 1: False, edge: True, edge + 1: True}
    # at 183 (83 + the default range's top, 100) the call is made whatever it draws: the engine serves it whole
    assert next_agent_call({"calls_left": 3, "rng": random.Random(0)}, [1, 2], [3], 0.0, 183) is not None


def test_fairness_calibration_recovers_the_simulators_cost_model_from_median_step_times(monkeypatch):
    """Kills: the decode rows' KV tokens counted without the token being decoded (``n x ctx``), and the minimum of
    the repeats fitted instead of their median.  Oracle: run on the simulated executor, whose step time *is*
    ``fixed + per_token x tokens + per_context_token x KV tokens`` (a decode at position ``ctx`` reads ``ctx + 1``);
    the fit must return its three constants.  The clock reads the simulator's, with a one-sided jitter on the
    first and last of each shape's three repeats, so only their median is the true step time."""
    from minivllm import EngineConfig, LLMEngine, SamplingParams
    from minivllm.bench import fairness as bench
    from minivllm.sim import SimulatedExecutor

    np = pytest.importorskip("numpy")
    truth = dict(fixed_overhead_s=0.02, per_token_s=0.001, per_context_token_s=3e-5)
    executor = SimulatedExecutor(**truth)

    def engine(cfg):
        return LLMEngine(cfg, executor=executor, model_max_len=cfg.max_model_len, eos_token_ids=set())

    calls = {"n": 0}

    def process_time():
        calls["n"] += 1
        if calls["n"] % 2:  # a start
            return executor.clock
        jitter = (-0.004, 0.0, 0.009)[(calls["n"] // 2 - 1) % 3]
        return executor.clock + jitter

    monkeypatch.setattr(bench, "time", SimpleNamespace(process_time=process_time))
    got = bench._calibrate(bench.CALIBRATION_SHAPES, 3, np, EngineConfig, engine, SamplingParams)
    for k, v in truth.items():
        assert got["step"][k] == pytest.approx(v, rel=1e-6), (k, got["step"])
    assert got["max_rel_error"] < 1e-6


def test_fairness_backlogged_service_weights_prefill_and_decode_as_wfq_does(monkeypatch, capsys):
    """Kills: section 2's service counted as prompt + output tokens instead of WFQ's charge.  Oracle:
    ``EngineConfig``'s default ``wfq_prefill_weight`` and ``wfq_decode_weight`` (the module docstring: "prefill x
    wfq_prefill_weight + output x wfq_decode_weight"), applied to the window counters of the run it reports.  The
    three runs are stand-ins (the real ones are covered above); section 3 is skipped by the same stand-in."""
    from minivllm.bench import fairness as bench
    from minivllm.config import EngineConfig

    window_stats = {"long": {"prompt_tokens": 3000, "output_tokens": 30},
                    "short": {"prompt_tokens": 100, "output_tokens": 300}}

    def stand_in(policy, arrivals, *, step, window, **kw):
        return bench.Run(outputs={"r": ("x", _out(0.1, itls=[0.01]))}, window_stats=window_stats,
                         stats={"per_tenant": {}}, clock=window)

    monkeypatch.setattr(bench, "run", stand_in)
    monkeypatch.setattr(bench, "slo_report", lambda res, slos: {})
    assert _argv_main(monkeypatch, bench.main, ["--duration", "1", "--policies", "fcfs", "--sections", "noisy_quiet",
                                                "backlogged", "three_class"]) == 0
    cfg = EngineConfig()
    line = next(x for x in capsys.readouterr().out.splitlines() if x.strip().startswith("fcfs") and "Jain" in x)
    for t, s in window_stats.items():
        want = s["prompt_tokens"] * cfg.wfq_prefill_weight + s["output_tokens"] * cfg.wfq_decode_weight
        assert f"{t} {int(want)}" in line, line


# -- bench activations ------------------------------------------------------------------------------------------


def test_budget_room_counts_kv_tokens_by_bytes_per_token_and_refuses_a_cpu_profile():
    """Kills: KV tokens computed as KV bytes over one element's bytes, and a device without memory of its own
    (a CPU profile) given a negative room instead of refused.  Oracle: Llama-3-8B keeps 2 (K, V) x 32 layers x 8
    KV heads x 128 x 2 bytes = 131,072 bytes a token."""
    from minivllm.bench.activations import budget_room
    from minivllm.sim.presets import hardware_preset, model_preset

    big = model_preset("llama-3-8b")
    r = budget_room(big, hardware_preset("h100"), 0.9)
    assert r["kv_tokens"] == r["kv_bytes"] // (2 * 32 * 8 * 128 * 2)
    with pytest.raises(ValueError, match="own memory"):
        budget_room(big, hardware_preset("cpu-2core"), 0.9)


def test_an_activation_meter_used_twice_reports_each_blocks_own_peak():
    """Kills: ``__enter__`` not resetting the counters (the second block reported the first one's peak).  Oracle:
    a fresh meter around the same code."""
    torch = pytest.importorskip("torch")
    from minivllm.bench.activations import ActivationMeter

    x = torch.ones(64)
    m = ActivationMeter()
    with m:
        big = torch.ones(1024) * 2  # 4 KiB alive
        del big
    with m:
        y = x * 3
    with ActivationMeter() as fresh:
        z = x * 3
    assert m.peak == fresh.peak == 64 * 4 and m.num_storages == fresh.num_storages
    del y, z


def test_activations_print_mebibytes(monkeypatch, capsys):
    """Kills: the table dividing by 10**6 under a MiB label.  Oracle: 1 MiB = 2**20 bytes."""
    from minivllm.bench import activations

    res = {"peak_bytes": {"16": 2**20}, "bytes_per_token": 65536.0, "fixed_bytes": 0.0,
           "llama-3-8b_on_h100 (analytic)": []}
    monkeypatch.setattr(activations, "run", lambda *a, **k: res)
    assert activations.main(["--tokens", "16"]) == 0
    assert "peak activations     1.00 MiB (   65536 B/token)" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from tests.paged_cases import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_acts"))


def test_activations_engine_fits_a_prompt_of_exactly_its_budget_and_one_count_is_a_line_through_zero(tiny_llama_dir):
    """Kills: ``make_engine`` sized with no block to spare (a 32-token prompt plus its one output token did not fit
    ``max_model_len`` = 32), and a single token count reported as bytes per forward instead of per token.
    Oracle: a prompt of ``max_tokens`` tokens is what ``make_engine`` promises to prefill in one step; one point
    through the origin has slope peak / N."""
    from minivllm.bench.activations import make_engine, prefill_peaks, run

    peaks = prefill_peaks(make_engine(32, model=tiny_llama_dir), [32])
    assert peaks[32] > 0
    res = run((16,), model=tiny_llama_dir)
    assert res["bytes_per_token"] == pytest.approx(res["peak_bytes"]["16"] / 16) and res["fixed_bytes"] == 0.0


# -- bench eager_step ---------------------------------------------------------------------------------------------


def test_eager_step_stats_min_and_mean_by_hand():
    """Kills: ``min_ms`` taken as the second smallest and ``mean_ms`` as the median.  Oracle: 1, 2, 3, 10 ms have
    min 1 and mean 4 (median 2.5)."""
    from minivllm.bench.eager_step import _stats

    s = _stats([0.010, 0.003, 0.001, 0.002])
    assert s["n"] == 4 and s["min_ms"] == pytest.approx(1.0) and s["max_ms"] == pytest.approx(10.0)
    assert s["mean_ms"] == pytest.approx(4.0)


def test_op_counter_counts_non_view_ops_and_starts_from_zero_each_time():
    """Kills: views counted as operations, and a reused counter adding to its last count.  Oracle: ``x * 2 + 1``
    is two operations (a mul, an add); ``x.view(...)`` and ``x[1:]`` are views."""
    torch = pytest.importorskip("torch")
    from minivllm.bench.eager_step import OpCounter

    x = torch.ones(8)
    c = OpCounter()
    with c:
        x * 2 + 1
        x.view(2, 4)
        x[1:]
    assert c.n == 2
    with c:
        x * 2
    assert c.n == 1 and dict(c.names) == {"mul": 1}


def test_profile_summary_counts_kernel_and_graph_launches_per_step():
    """Kills: the launch total not divided by the number of steps, and CUDA-graph replays left out of the count.
    Oracle: by hand, 4 steps of 10 kernel launches and 2 graph launches are 3 launches a step."""
    from minivllm.bench.eager_step import _ops

    events = [SimpleNamespace(key="cudaLaunchKernel", count=10, self_cpu_time_total=40.0),
              SimpleNamespace(key="cudaGraphLaunch", count=2, self_cpu_time_total=8.0),
              SimpleNamespace(key="aten::mm", count=8, self_cpu_time_total=80.0)]
    got = _ops(SimpleNamespace(key_averages=lambda: events), steps=4)
    assert got["kernel_launches_per_step"] == 3.0
    assert got["top_cpu_self"][0] == {"op": "aten::mm", "calls_per_step": 2.0, "self_cpu_us_per_step": 20.0}


def test_decode_step_stats_leave_the_prompt_step_out(monkeypatch):
    """Kills: the prompt step counted among the decode steps.  Oracle: the docstring ("its prompt step left out"),
    by hand: a 500 ms prompt step then decode steps of 1, 2 and 3 ms are n=3, max 3 ms, mean 2 ms.  The engine is a
    stand-in (``measure`` returns the step times)."""
    import minivllm.sim.calibrate as calibrate
    from minivllm.bench import eager_step

    times = [0.5, 0.001, 0.002, 0.003]
    monkeypatch.setattr(calibrate, "measure", lambda engine, reqs: ([SimpleNamespace(time_s=t) for t in times], None))
    s = eager_step.decode_step_stats(None, vocab=100, max_tokens=4)
    assert (s["n"], s["max_ms"], s["mean_ms"]) == (3, pytest.approx(3.0), pytest.approx(2.0))


def test_decode_profile_reports_python_self_time_in_microseconds_per_step():
    """Kills: cProfile's seconds scaled by 1e3 under the ``self_us_per_step`` key (milliseconds labelled us).
    Oracle: a stand-in engine whose every step sleeps 2 ms: ``time.sleep`` is called once a step and never returns
    early, so its own time is at least 2,000 us a step."""
    import time

    import torch

    from minivllm.bench.eager_step import _profile_decode

    class Engine:
        def add_request(self, *args, **kwargs):
            pass

        def step(self):
            time.sleep(0.002)

        def has_unfinished_requests(self):
            return False

    _, python = _profile_decode(Engine(), [torch.profiler.ProfilerActivity.CPU], vocab=100, steps=4)
    sleep = next(e for e in python if "sleep" in e["function"])
    assert sleep["calls_per_step"] == 1.0 and 1_990 <= sleep["self_us_per_step"] < 1_000_000


# -- bench attention: the report arithmetic (the timer replaced by a fixed number) --------------------------------


def test_copy_bandwidth_counts_bytes_read_and_written_in_decimal_gigabytes(monkeypatch):
    """Kills: the copy's bandwidth counting only the bytes read.  Oracle: its docstring ("bytes read plus bytes
    written"): copying 10**6 bytes in 1 ms moves 2 x 10**6 bytes, 2 GB/s."""
    import dataclasses

    import torch

    from minivllm.bench import attention

    monkeypatch.setattr(attention, "time_ms", lambda fn, device, plan: 1.0)
    plan = dataclasses.replace(attention.SMOKE_PLAN, copy_bytes=10**6)
    assert attention.copy_bandwidth_gbps(torch.device("cpu"), plan) == pytest.approx(2.0)


def test_prefill_flops_are_four_per_head_dim_per_visible_pair(monkeypatch):
    """Kills: the prefill FLOP count halved (only QK^T counted, not PV).  Oracle: each query-key pair the causal
    mask lets through costs a ``head_dim`` dot product for the score and another for the value sum, 2 FLOPs per
    multiply-add each; pairs counted by brute force over the mask."""
    import torch

    from minivllm.bench import attention

    class Backend:
        def attend(self, q, k_cache, v_cache, meta, scale):
            return torch.zeros_like(q)

    monkeypatch.setattr(attention, "time_ms", lambda fn, device, plan: 1.0)
    shape, case = attention.AttnShape("t", 4, 2, 16), attention.PrefillCase(num_seqs=2, ctx=5, q_len=3)
    row = attention.bench_prefill(shape, case, Backend(), torch.device("cpu"), attention.SMOKE_PLAN)
    pairs = case.num_seqs * sum(1 for qpos in range(case.ctx, case.ctx + case.q_len) for k in range(qpos + 1))
    assert row.extra["flops"] == 4 * shape.head_dim * shape.q_heads * pairs
    assert row.metric == pytest.approx(row.extra["flops"] / 1e-3 / 1e12)


def test_decode_bandwidth_is_decimal_gigabytes_and_percent_of_copy(monkeypatch):
    """Kills: the decode bandwidth in GiB/s under a GB/s label (beside a copy bandwidth in GB/s) and the %copy
    column as a fraction.  Oracle: K/V bytes by hand (batch x ctx x KV heads x head_dim x 2 tensors x 4 bytes)
    over the fixed 1 ms."""
    import torch

    import minivllm.model.kernels as kernels
    from minivllm.bench import attention

    monkeypatch.setattr(attention, "time_ms", lambda fn, device, plan: 1.0)
    monkeypatch.setattr(kernels, "paged_decode", lambda q, *a, out=None, **k: out.copy_(q))
    shape = attention.AttnShape("t", 4, 2, 16)
    row = attention.bench_decode(shape, 2, 40, 100.0, torch.device("cpu"), attention.SMOKE_PLAN)
    nbytes = 2 * 40 * 2 * 16 * 2 * 4
    assert row.extra["kv_bytes"] == nbytes
    assert row.metric == pytest.approx(nbytes / 1e-3 / 1e9) and row.metric_unit == "GB/s"
    assert row.pct_of_copy == pytest.approx(100 * row.metric / 100.0)


def test_attention_table_marks_a_failed_check_no_and_rows_without_a_check_do_not_fail_the_run(monkeypatch, capsys):
    """Kills: a failed row shown as "-" (unchecked) instead of "NO", and ``main`` failing the run on rows that
    have no check (the mixed rows: ``ok`` is None).  Oracle: the exit-status rule "1 only if a check failed"."""
    import torch

    from minivllm.bench import attention

    rows = [attention.Row("decode", "x", 1, 512, 1, triton_ms=0.5, ok=True),
            attention.Row("mixed", "x", 3, 20, 16, triton_ms=0.5)]
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "copy_bandwidth_GBps": 1.0}
    monkeypatch.setattr(attention, "run", lambda plan, device, smoke: (dict(env), list(rows)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for --smoke; restored after the test
    assert attention.main(["--smoke"]) == 0
    rows.append(attention.Row("check", "x", 1, 16, 1, ok=False))
    assert attention.main(["--smoke"]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.split()[-1] == "NO", last
