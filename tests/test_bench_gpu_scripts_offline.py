"""The CPU-visible parts of the GPU benchmarks (``bench attention``, ``bench gpu_e2e``) and of vLLM's runner script.

Written in a mutation pass: each test pins a planted change that no other test noticed -- a correctness check
loosened or skipped, a ratio inverted, a documented default changed, a key of the result file lost.  No GPU and no
vLLM: timers return fixed numbers, engines are stand-ins, the kernels are replaced by a brute-force softmax or by
the torch reference.  The oracles are independent of the code under test: hand arithmetic, ``statistics.median``,
the fp32 torch reference, the tolerances of ``docs``/the modules' own docstrings.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
from types import SimpleNamespace

import pytest
import torch

from minivllm.bench import attention
from minivllm.model.attention import TorchAttentionBackend

CPU = torch.device("cpu")
SHAPE = attention.AttnShape("t", 4, 2, 16)


def _timer(monkeypatch, *values):
    """``time_ms`` replaced by the given milliseconds, one per call, in call order."""
    it = iter(values)
    monkeypatch.setattr(attention, "time_ms", lambda fn, device, plan: next(it))


def _brute_decode(q, k_cache, v_cache, tables, seq_lens, scale, max_seq_len=None, out=None):
    """Decode attention by the textbook formula, one sequence at a time (the stand-in for the Triton kernel)."""
    group = q.shape[1] // k_cache.shape[2]
    for b in range(q.shape[0]):
        n = int(seq_lens[b])
        k = k_cache[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(group, 1).float()
        v = v_cache[tables[b].long()].flatten(0, 1)[:n].repeat_interleave(group, 1).float()
        p = (torch.einsum("hd,nhd->hn", q[b].float(), k) * scale).softmax(-1)
        out[b] = torch.einsum("hn,nhd->hd", p, v).to(out.dtype)
    return out


# -- bench attention: the correctness checks made before anything is timed --------------------------------------


class _Backend(TorchAttentionBackend):
    """The torch reference, optionally ``off`` by a constant and optionally not writing the new K/V."""

    def __init__(self, off: float = 0.0, writes: bool = True):
        self.off, self.writes = off, writes

    def write_kv(self, k, v, k_cache, v_cache, meta):
        if self.writes:
            super().write_kv(k, v, k_cache, v_cache, meta)

    def attend(self, q, k_cache, v_cache, meta, scale):
        return super().attend(q, k_cache, v_cache, meta, scale) + self.off


def test_check_flags_an_fp32_kernel_a_thousandth_off_and_passes_one_within_fp32_rounding():
    """A kernel 1e-3 off everywhere is wrong in fp32 (the expected agreement is ~1e-4, docs' Triton notes); one
    1e-6 off is right.  Oracle: the torch reference plus a known offset, so the error is that offset by hand."""
    plan = dataclasses.replace(attention.SMOKE_PLAN, check_lens=((0, 1), (17, 1), (9, 20)))
    bad = attention.check_correctness(_Backend(off=1e-3), CPU, plan)
    good = attention.check_correctness(_Backend(off=1e-6), CPU, plan)
    assert [r.ok for r in bad] == [False] * len(attention.SHAPES)
    assert [r.ok for r in good] == [True] * len(attention.SHAPES)
    assert bad[0].max_err == pytest.approx(1e-3, rel=1e-3)


def test_check_flags_a_backend_that_does_not_write_the_new_kv():
    """``write_kv`` left the cache unchanged: ``attend`` then agrees with the reference on that same (stale)
    cache, so only the cache comparison sees it.  Oracle: the torch ``write_kv`` on a copy of the cache."""
    plan = dataclasses.replace(attention.SMOKE_PLAN, check_lens=((0, 1), (9, 20)))
    rows = attention.check_correctness(_Backend(writes=False), CPU, plan)
    assert all(r.ok is False and "write_kv MISMATCH" in r.note for r in rows), rows


def test_max_error_is_absolute_below_one_and_relative_above_and_takes_the_worst_element():
    """Oracle: the docstring's rule by hand -- 0.03 off at 3.0 is 1 %, 1e-3 off at 0.5 is 1e-3, 1e-3 off at 1e-6 is
    1e-3 (not a relative 1000)."""
    got = torch.tensor([0.5 + 1e-3, 3.0 + 0.03, 0.0, 1e-6 + 1e-3])
    want = torch.tensor([0.5, 3.0, 0.0, 1e-6])
    assert attention.max_error(got, want) == pytest.approx(0.01, rel=1e-4)
    assert attention.max_error(got[[0, 2, 3]], want[[0, 2, 3]]) == pytest.approx(1e-3, rel=1e-3)


def test_decode_row_checks_the_kernel_against_sdpa_and_reports_sdpa_over_triton(monkeypatch):
    """Kills: the decode row's check replaced by ``ok = True`` and the ratio inverted.  Oracles: a brute-force
    softmax as the kernel must agree with SDPA; a kernel that copies its query out must not; the Triton run timed
    2 ms and SDPA 6 ms is "3.00" in the column whose docstring says > 1 means Triton is faster."""
    import minivllm.model.kernels as kernels

    monkeypatch.setattr(kernels, "paged_decode", _brute_decode)
    _timer(monkeypatch, 2.0, 6.0)
    row = attention.bench_decode(SHAPE, 2, 40, 100.0, CPU, attention.SMOKE_PLAN)
    assert row.ok is True and row.max_err < 1e-5
    assert (row.triton_ms, row.sdpa_ms, row.sdpa_over_triton) == (2.0, 6.0, pytest.approx(3.0))
    monkeypatch.setattr(kernels, "paged_decode", lambda q, *a, out=None, **k: out.copy_(q))
    _timer(monkeypatch, 1.0, 1.0)
    assert attention.bench_decode(SHAPE, 2, 40, 100.0, CPU, attention.SMOKE_PLAN).ok is False


@pytest.mark.parametrize("ctx", [0, 8])
def test_prefill_row_checks_the_backend_against_sdpa_with_the_mask_aligned_to_the_context(monkeypatch, ctx):
    """Kills: the SDPA comparison's causal mask dropped (no context) or aligned top-left (with context) -- a
    correct backend was then reported wrong -- and the check replaced by ``ok = True``.  Oracles: the torch
    reference backend must pass, one that returns zeros must fail; 4 ms against SDPA's 1 ms is 0.25."""
    case = attention.PrefillCase(num_seqs=2, ctx=ctx, q_len=12)
    _timer(monkeypatch, 4.0, 1.0)
    row = attention.bench_prefill(SHAPE, case, TorchAttentionBackend(), CPU, attention.SMOKE_PLAN)
    assert row.note == "" and row.ok is True and row.max_err < 1e-5
    assert row.sdpa_over_triton == pytest.approx(0.25)

    class Zeros:
        def attend(self, q, k_cache, v_cache, meta, scale):
            return torch.zeros_like(q)

    _timer(monkeypatch, 1.0, 1.0)
    assert attention.bench_prefill(SHAPE, case, Zeros(), CPU, attention.SMOKE_PLAN).ok is False


def test_gpu_grid_is_the_documented_24_decode_cases_of_which_9_fit_in_l2():
    """Oracle: the module docstring -- batch {1, 16, 64, 256} x context {512, 4096, 16384} x two shapes, "9 of the
    24 on the default grid" under the 50-60 MB L2; by hand, SmolLM2 reads 768 B of K/V a token and Llama-8B 4096."""
    plan = attention.GPU_PLAN
    cases = [(s, b, c) for s in attention.SHAPES for b in plan.batches for c in plan.contexts]
    assert (plan.batches, plan.contexts, len(cases)) == ((1, 16, 64, 256), (512, 4096, 16384), 24)
    per_token = {"smollm2": 3 * 64 * 2 * 2, "llama8b": 8 * 128 * 2 * 2}
    fit = [(s.name, b, c) for s, b, c in cases if b * c * per_token[s.name] < attention.L2_BYTES]
    assert len(fit) == 9
    assert all(attention.kv_bytes(b, c, s, plan.dtype) == b * c * per_token[s.name] for s, b, c in cases)


def test_cpu_time_is_the_median_of_the_runs_in_milliseconds(monkeypatch):
    """Oracle: ``statistics.median`` of the runs' durations (2, 9 and 4 ms) -- the docstring's "median
    milliseconds"."""
    clock = iter([0.0, 0.002, 1.0, 1.009, 2.0, 2.004])
    monkeypatch.setattr(attention.time, "perf_counter", lambda: next(clock))
    plan = dataclasses.replace(attention.SMOKE_PLAN, cpu_reps=3)
    assert attention.time_ms(lambda: None, CPU, plan) == pytest.approx(statistics.median([2.0, 9.0, 4.0]))


def test_json_records_every_row_with_its_check(monkeypatch, tmp_path):
    """The docstring: failures "are reported in the table and the JSON".  Oracle: the rows given, field by field."""
    rows = [attention.Row("check", "x", 1, 16, 1, max_err=1.0, ok=False, note="float32"),
            attention.Row("decode", "x", 1, 512, 1, triton_ms=0.5, ok=True)]
    env = {"device": "cpu", "torch": torch.__version__, "triton": "-", "copy_bandwidth_GBps": 1.0}
    monkeypatch.setattr(attention, "run", lambda plan, device, smoke: (dict(env), list(rows)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "attn.json"
    assert attention.main(["--smoke", "--json", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert doc["rows"] == [dataclasses.asdict(r) for r in rows] and doc["rows"][0]["ok"] is False


# -- bench gpu_e2e: the parity summary, the nano summary, the defaults -------------------------------------------


def _argv_main(monkeypatch, main, argv):
    monkeypatch.setattr(sys, "argv", ["gpu_e2e", *argv])
    return main()


@pytest.fixture
def e2e(monkeypatch):
    from minivllm.bench import gpu_e2e

    seen = {"arch": []}
    monkeypatch.setattr(gpu_e2e, "make_model_dir", lambda path, arch: seen["arch"].append(arch))
    return gpu_e2e, seen


def test_parity_counts_identical_prompts_and_where_the_others_first_diverge(monkeypatch, tmp_path, e2e):
    """Oracle by hand: three prompts; the Triton run agrees on the first, differs at token 0 on the second and at
    token 2 on the third.  Prompt lengths lie in the documented [16, --max-prompt-len); the model written is the
    documented default, Llama-3.2-1B's shape."""
    gpu_e2e, seen = e2e
    torch_out = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    triton_out = [[1, 2, 3, 4], [0, 6, 7, 8], [9, 10, 0, 12]]
    lengths = []

    def run(model_dir, backend, prompts, params, *a, **k):
        lengths.extend(len(p["prompt_token_ids"]) for p in prompts)
        return (torch_out if backend == "torch" else triton_out), 1.0

    monkeypatch.setattr(gpu_e2e, "run", run)
    out = tmp_path / "p.json"
    argv = ["--device", "cpu", "--prompts", "3", "--max-prompt-len", "18", "--json", str(out)]
    assert _argv_main(monkeypatch, gpu_e2e.main, argv) == 0
    doc = json.loads(out.read_text())
    assert (doc["identical_prompts"], doc["first_divergence"]) == (1, [None, 0, 2])
    assert seen["arch"] == ["llama-3.2-1b"] and "Llama-3.2-1B" in gpu_e2e.__doc__
    many = []
    monkeypatch.setattr(gpu_e2e, "run", lambda m, b, prompts, *a, **k: (many.extend(
        len(p["prompt_token_ids"]) for p in prompts), ([[1]] * len(prompts), 1.0))[1])
    assert _argv_main(monkeypatch, gpu_e2e.main, ["--device", "cpu", "--prompts", "64", "--max-prompt-len", "18"]) == 0
    assert set(many) == {16, 17}


def test_nano_summary_ratios_and_defaults(monkeypatch, tmp_path, e2e):
    """Oracles by hand: Triton 40 tok/s over torch 20 is 2.0 ("Triton / torch backend"); graphed Triton 40 over its
    eager run 30 is 1.33 ("CUDA graphs ... over eager"); HF serves every request unless --hf-requests says
    otherwise; the output tokens are the sum of the lengths the engines were asked for; at --scale 1 the workload
    is the docstring's 256 requests with lengths in 100-1024."""
    gpu_e2e, _ = e2e
    rates = {("torch", False): 20.0, ("triton", False): 40.0, ("triton", True): 30.0}
    works, hf = [], []
    monkeypatch.setattr(gpu_e2e, "run_nano_minivllm",
                        lambda _dir, backend, work, *a, eager=False: (works.append(work), rates[backend, eager])[1])
    monkeypatch.setattr(gpu_e2e, "run_nano_hf", lambda _dir, work, *a: (hf.append(len(work)), 10.0)[1])
    out = tmp_path / "n.json"
    assert _argv_main(monkeypatch, gpu_e2e.main, ["--device", "cpu", "--workload", "nano", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["triton_vs_torch"] == pytest.approx(2.0)
    assert doc["cuda_graphs_speedup"] == pytest.approx(40 / 30)
    assert (doc["requests"], doc["lengths"], doc["hf_requests"], hf) == (256, [100, 1024], 256, [256])
    assert doc["output_tokens"] == sum(n for _, n in works[0])
    assert min(n for _, n in works[0]) >= 100 and max(n for _, n in works[0]) <= 1024


def test_nano_workload_draws_both_ends_of_the_length_range():
    """Oracle: the docstring's lengths "uniform in [lo, hi]", both ends included: 400 draws from {1, 2} give both."""
    from minivllm.bench.gpu_e2e import nano_workload

    work = nano_workload(400, 1, 2)
    assert {len(p) for p, _ in work} == {1, 2} and {n for _, n in work} == {1, 2}


@pytest.mark.parametrize("device,kv_bytes", [("cpu", 256 << 20), ("cuda", 8 << 30)])
def test_run_counts_output_tokens_per_second_of_the_timed_run_only(monkeypatch, e2e, device, kv_bytes):
    """Oracle by hand: the timed run returns 3 + 5 tokens and the clock moves 2 s across it: 4 tok/s.  The KV pool
    is the docstring's "8 GiB on a GPU by default ... and 256 MiB elsewhere"."""
    import minivllm

    gpu_e2e, _ = e2e
    built = []

    class LLM:
        def __init__(self, model_dir, **kwargs):
            built.append(kwargs["kv_cache_memory_bytes"])

        def generate(self, prompts, params, use_tqdm=False):
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * n)]) for n in (3, 5)]

    clock = iter([10.0, 12.0])
    monkeypatch.setattr(minivllm, "LLM", LLM)
    monkeypatch.setattr(gpu_e2e, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    tokens, tps = gpu_e2e.run("unused", "torch", [{}, {}], None, device, "float32")
    assert (tokens, tps, built) == ([[1] * 3, [1] * 5], pytest.approx(4.0), [kv_bytes])


# -- vllm_runner.py: run with a stand-in ``vllm`` package ----------------------------------------------------------


def test_vllm_runner_times_only_the_measured_run_and_asks_for_what_the_workload_says(monkeypatch, tmp_path):
    """Oracles: the stand-in's clock moves one second per prompt generated, so the timed run of 6 prompts took
    6 s (the 4-prompt warm-up is not timed); every request asks for its own length with EOS ignored (as
    minivllm's side does), greedy, and prefix caching is off as on minivllm's side (``EngineConfig``'s default)."""
    import types

    from minivllm.bench import vllm_runner
    from minivllm.config import EngineConfig

    clock = [0.0]
    seen = {}

    class LLM:
        def __init__(self, **kwargs):
            seen["llm"] = kwargs

        def generate(self, prompts, params, use_tqdm=False):
            clock[0] += len(prompts)
            seen.setdefault("params", []).append(params)
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(p.max_tokens)))]) for p in params]

    class SamplingParams:
        def __init__(self, **kwargs):
            self.__dict__.update(kwargs)

    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(vllm_runner, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    lengths = [3, 1, 4, 1, 5, 9]
    (tmp_path / "w.json").write_text(json.dumps({"prompts": [[7, 8]] * 6, "max_tokens": lengths}))
    assert vllm_runner.main(["x", "model", str(tmp_path / "w.json"), str(tmp_path / "r.json")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["elapsed_s"] == 6.0 and [len(t) for t in res["token_ids"]] == lengths
    timed = seen["params"][-1]
    assert [p.max_tokens for p in timed] == lengths and all(p.ignore_eos and p.temperature == 0 for p in timed)
    assert seen["llm"]["enable_prefix_caching"] is EngineConfig().enable_prefix_caching is False
