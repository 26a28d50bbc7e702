"""Lab 7 beyond what the registry-driven tests cover (tests/test_labs.py runs its checkers and planted bugs).

* The solution kernel compiles for an NVIDIA GPU (sm_90) on this CPU machine: the interpreter accepts
  Python that the Triton compiler rejects (a loop-carried value that changes type, a ``raise``), so a lab
  that is only ever interpreted could ship a kernel that fails on the first GPU it meets.
* The int64 case really is out of int32 range, and its 8 GiB pool costs (almost) no memory.
* The fallbacks the notebook hands out (the engine's gather and decode kernel) agree with the oracle.
* The launch wrapper rejects shapes the kernel cannot handle with a clear ValueError.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (CPU test machines)

import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from minivllm.labs import check_lab07 as lab7

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "lab07_triton_paged_attention.ipynb"


def _exercise_source(name: str) -> str:
    nb = json.loads(SOLUTION.read_text())
    cell = next(c for c in nb["cells"] if f"exercise:{name}" in c.get("metadata", {}).get("tags", []))
    return "".join(cell["source"])


def test_solution_kernel_compiles_for_an_nvidia_gpu(tmp_path):
    """Triton's real compiler (not the interpreter) lowers the kernel to a cubin for sm_90, no GPU needed."""
    pytest.importorskip("triton.backends.nvidia")
    module = tmp_path / "lab07_kernel.py"
    module.write_text("import triton\nimport triton.language as tl\n\n" + _exercise_source("decode_kernel") + "\n")
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from lab07_kernel import decode_kernel
        assert type(decode_kernel).__name__ == "JITFunction", type(decode_kernel)
        sig = {{"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "table_ptr": "*i32", "seq_lens_ptr": "*i32",
               "out_ptr": "*fp32", "scale": "fp32"}}
        for name in ("stride_q_seq", "stride_q_head", "stride_kv_block", "stride_kv_token", "stride_kv_head",
                     "stride_table_seq", "stride_out_seq", "stride_out_head"):
            sig[name] = "i32"
        consts = {{"GROUP": 3, "HEAD_DIM": 64, "PAGE_SIZE": 16}}
        sig.update({{k: "constexpr" for k in consts}})
        compiled = triton.compile(ASTSource(fn=decode_kernel, signature=sig, constexprs=consts),
                                  target=GPUTarget("cuda", 90, 32))
        print("cubin bytes", len(compiled.asm["cubin"]))
    """)
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="1", TRITON_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    if "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cubin bytes" in proc.stdout


def test_big_pool_is_beyond_int32_and_sparse():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    case = lab7._big_pool_case("cpu")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    k, table = case["k_cache"], case["block_tables"]
    first_offset = int(table[0, 0]) * k.stride(0)
    assert first_offset >= 2 ** 32, "the blocks must sit where an int32 offset wraps"
    assert first_offset % 2 ** 32 == 0 and torch.isnan(k[0]).all(), "a wrapped offset must land on a NaN block"
    assert grown_mb < 200, f"the 8 GiB pool should be a sparse mapping, but memory grew by {grown_mb:.0f} MB"


def test_engine_fallbacks_agree_with_the_oracle():
    case = lab7.make_paged([1, 15, 16, 17, 40], kv_heads=3, group=3, head_dim=16, share_first=True, seed=21)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale")]
    want = lab7.reference_decode(*args)
    got = lab7.engine_decode(*args)
    assert torch.isfinite(got).all() and (got - want).abs().max() < 1e-4
    for i, n in enumerate(case["seq_lens"].tolist()):
        rows = lab7.engine_gather_kv(case["k_cache"], case["block_tables"][i], n)
        assert torch.equal(rows, lab7._brute_gather(case["k_cache"], case["block_tables"][i], n))


@pytest.mark.parametrize("layout", [{}, {"interleaved": True}, {"heads_apart": True, "kv_heads": 2}])
def test_a_case_keeps_its_cache_layout_on_another_device(layout):
    """Kills: the caches moved to the device view by view.

    ``.to(device)`` of a view that skips part of its pool (K next to V) is a *contiguous* copy, so on a GPU the
    interleaved cases held an ordinary cache, and a kernel that assumes ``block * PAGE_SIZE * stride_kv_token``
    (or ``kv_head * HEAD_DIM``) passed those cases there.  Oracle: the CPU case's strides.  The meta device takes
    the same ``.to(device)`` path as CUDA, on any machine."""
    cpu = lab7.make_paged([20, 7], seed=9, **layout)
    moved = lab7.make_paged([20, 7], seed=9, device="meta", **layout)
    for name in ("k_cache", "v_cache"):
        assert moved[name].device.type == "meta"
        assert moved[name].stride() == cpu[name].stride(), (name, layout)
        assert moved[name].shape == cpu[name].shape


def _kernel_module(tmp_path, name: str, source: str):
    import importlib.util

    module = tmp_path / f"{name}.py"
    module.write_text("import triton\nimport triton.language as tl\n\n" + source + "\n")
    spec = importlib.util.spec_from_file_location(name, module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.decode_kernel


def test_a_kernel_that_steps_kv_heads_by_head_dim_is_rejected(tmp_path):
    """Kills: every checker cache with its KV heads side by side (``stride_kv_head == HEAD_DIM``).

    Then ``kv_head * HEAD_DIM`` in place of ``kv_head * stride_kv_head`` passed every visible and hidden case, yet
    reads the wrong head in a pool that keeps each head's K next to its V -- a layout the launcher accepts (K and V
    with the same strides, head_dim contiguous) and the engine's kernel reads right.  Oracle: the engine's torch
    reference on that layout."""
    import io
    from contextlib import redirect_stdout

    src = _exercise_source("decode_kernel")
    wrong_src = src.replace("kv_head * stride_kv_head", "kv_head * HEAD_DIM")
    assert wrong_src != src, "the solution's address line moved: update this wrong answer"
    wrong = _kernel_module(tmp_path, "lab07_head_dim_stride", wrong_src)
    right = _kernel_module(tmp_path, "lab07_solution_kernel", src)

    case = lab7.make_paged([17, 6], kv_heads=2, group=2, heads_apart=True, seed=1)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale")]
    want = lab7.reference_decode(*args)
    assert (lab7.launch_decode(wrong, *args) - want).abs().max() > 1e-2, "the wrong answer is not wrong here"
    assert (lab7.engine_decode(*args) - want).abs().max() < 1e-4  # the layout is one the engine serves
    with redirect_stdout(io.StringIO()) as buf:
        result = lab7.check_decode_kernel(wrong, big_pool=False)
    assert not result and result.failed_case == "K and V side by side per KV head: a head's stride is its own"
    assert "stride_kv_head" in buf.getvalue().split("✘", 1)[-1]
    with redirect_stdout(io.StringIO()):
        assert not lab7.hidden_decode_kernel(wrong, 7)
        assert lab7.check_decode_kernel(right, big_pool=False) and lab7.hidden_decode_kernel(right, 7)


def test_online_softmax_trace_matches_softmax():
    scores = torch.randn(37, generator=torch.Generator().manual_seed(0)) * 5
    last = lab7.online_softmax_trace(scores.tolist(), 8)[-1]
    assert abs(last["max"] - scores.max().item()) < 1e-9
    assert abs(last["sum"] - torch.exp(scores - scores.max()).sum().item()) < 1e-4


def test_launch_rejects_shapes_the_kernel_cannot_take():
    def kernel():  # never launched: the wrapper must refuse first
        raise AssertionError("launched")

    odd = lab7.make_paged([5], head_dim=12)
    with pytest.raises(ValueError, match="power of two"):
        lab7.launch_decode(kernel, *[odd[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "scale")])
    two = lab7.make_paged([5], kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="multiple"):
        lab7.launch_decode(kernel, torch.zeros(1, 3, 16), two["k_cache"], two["v_cache"], two["block_tables"],
                           two["seq_lens"], two["scale"])
    with pytest.raises(ValueError, match="strides"):
        v_other_layout = two["v_cache"].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
        lab7.launch_decode(kernel, torch.zeros(1, 2, 16), two["k_cache"], v_other_layout, two["block_tables"],
                           two["seq_lens"], two["scale"])


def test_walk_stepper_redraws_in_place_without_pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    case = lab7.make_paged([40, 17, 5], kv_heads=1, group=3, head_dim=16, q_scale=1.5, seed=26)
    walk = lab7.WalkStepper(case, seq=0)
    pictures = [walk.png()]
    for _ in range(4):  # three blocks, then back to the start
        walk.press("next block")
        pictures.append(walk.png())
    assert all(a != b for a, b in zip(pictures, pictures[1:])), "every click must change the picture"
    assert walk.upto == 0 and pictures[-1] == pictures[0]
    assert plt.get_fignums() == [], "the widget drew on a pyplot figure"
    last = walk.trace[-1]
    assert [t["block"] for t in walk.trace] == [0, 1, 2] and last["max"] == max(t["chunk_max"] for t in walk.trace)


def test_a_kernel_that_ignores_its_scale_argument_is_rejected(tmp_path):
    """Kills: every checker case built with ``scale = 1 / sqrt(head_dim)``.

    Then a kernel that multiplies its scores by the textbook ``1 / sqrt(HEAD_DIM)`` instead of its ``scale``
    argument passes every case, yet is wrong for any model that picks its own scale (Gemma 2's
    ``query_pre_attn_scalar``, Granite's attention multiplier).  Oracle: the engine's torch reference with a
    scale of 0.1 disagrees with that kernel, so the checker must say no."""
    import importlib.util
    import io
    from contextlib import redirect_stdout

    src = _exercise_source("decode_kernel")
    hard_coded = src.replace('* scale, float("-inf"))', '/ tl.sqrt(HEAD_DIM * 1.0), float("-inf"))')
    assert hard_coded != src, "the solution's score line moved: update this mutant"
    module = tmp_path / "lab07_hard_coded_scale.py"
    module.write_text("import triton\nimport triton.language as tl\n\n" + hard_coded + "\n")
    spec = importlib.util.spec_from_file_location("lab07_hard_coded_scale", module)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    case = lab7.make_paged([17, 5], seed=1)
    args = [case[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")]
    got = lab7.launch_decode(mod.decode_kernel, *args, 0.1)
    assert (got - lab7.reference_decode(*args, 0.1)).abs().max() > 1e-2, "the mutant is not wrong at scale 0.1"
    with redirect_stdout(io.StringIO()) as buf:
        result = lab7.check_decode_kernel(mod.decode_kernel, big_pool=False)
    assert not result, "the checker accepts a kernel that ignores its scale argument"
    assert "scale" in buf.getvalue().split("✘", 1)[-1]



@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's import order matters on a CPU only")
@pytest.mark.parametrize("triton_first,late_env", [(True, False), (True, True), (False, False)],
                         ids=["triton-first", "triton-first-then-the-labs-first-cell", "checker-first"])
def test_triton_imported_before_the_checker_is_named_and_its_failure_shown(triton_first, late_env):
    """Triton decorates its own library when triton.language is imported; imported first without the interpreter,
    an interpreted kernel that calls tl.cdiv fails.  The checker must warn then, and stay silent in the lab's order.

    ``late_env``: the lab's first cell sets ``TRITON_INTERPRET=1`` right before importing the checker, which does
    not undo an earlier import of Triton -- the warning must still come."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = textwrap.dedent(f"""
        import os, warnings
        warnings.simplefilter("always")
        if {triton_first}:
            import triton.language
        if {late_env}:
            os.environ["TRITON_INTERPRET"] = "1"
        with warnings.catch_warnings(record=True) as seen:
            import minivllm.labs.check_lab07
        print("WARNED" if any("before minivllm.labs.check_lab07" in str(w.message) for w in seen) else "QUIET")
        import torch, triton, triton.language as tl

        @triton.jit
        def k(out):
            tl.store(out, tl.cdiv(7, 2))

        out = torch.zeros(1, dtype=torch.int32)
        try:
            k[(1,)](out)
            print("RAN", int(out[0]))
        except Exception as e:
            print("FAILED", "outside of the scope of a kernel" in str(e))
    """)
    got = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.split()
    if triton_first:
        assert lines[:3] == ["WARNED", "FAILED", "True"], got.stdout  # the failure the warning names is real
    else:
        assert lines[:3] == ["QUIET", "RAN", "4"], got.stdout


def test_the_recompile_steps_lab7_quotes_are_the_probe_files_own():
    """Lab 7's "go further" quotes the H200 probe file for the mid-serving compiles: its slow prompt steps (over
    100 ms) of the first two rounds, in order; the range of the other prompt steps there; the largest step of the
    later rounds; and the largest collector pause of the first rounds (why the collector is ruled out)."""
    name = "2026-11-30_nvidia-h200_gc_probe.json"
    probe = json.loads((ROOT / "benchmarks" / "results" / name).read_text(encoding="utf-8"))
    first = [v for k, v in probe.items() if k.startswith("normal")]
    later = [v for k, v in probe.items() if k.startswith("frozen")]
    steps = [ms for run in first for ms in run["prompt_steps_ms"]]
    slow = [f"{ms:,.0f}" for ms in steps if ms > 100]
    rest = [ms for ms in steps if ms <= 100]
    text = " ".join((ROOT / "tools" / "lab_texts" / "lab07_triton_paged_attention.py").read_text().split())
    assert f"`benchmarks/results/{name}`" in text
    assert (f"shows such steps: {', '.join(slow[:-1])} and {slow[-1]} ms among prompt steps of "
            f"{min(rest):.0f}–{max(rest):.0f} ms in its first runs") in text, (slow, min(rest), max(rest))
    later_max = max(ms for run in later for ms in run["prompt_steps_ms"])
    assert later_max <= 25 and "none above 25 ms in its later ones" in text, later_max
    assert f"at most {max(r['gc_pause_max_ms'] for r in first):.1f} ms" in text


def test_the_dtype_tolerances_lab7_teaches_are_the_benchmarks_own():
    """Lab 7's CPU fallback for the bandwidth cell teaches how close each dtype must come to the fp32 oracle and
    why bf16 needs the loosest bound.  Oracles: the tolerances ``bench attention`` applies (``TOLERANCE``), the
    spacing of bf16 numbers from torch's own ``finfo`` (eps = the step between 1 and 2), and the bf16 check rows of
    the two H200 files it names -- the run that missed and the one that passed.  Kills a sentence left quoting a
    tolerance the benchmark no longer uses, a step size off by a factor of two, or an error not in the files."""
    import re

    from minivllm.bench.attention import TOLERANCE

    text = (ROOT / "tools" / "lab_texts" / "lab07_triton_paged_attention.py").read_text(encoding="utf-8")
    m = re.search(r"fp32 ([\d.e-]+), fp16 ([\d.e-]+), bf16 ([\d.e-]+)\.", text)
    assert m, "lab 7 no longer states the dtype tolerances"
    assert [float(x) for x in m.groups()] == [TOLERANCE[d] for d in (torch.float32, torch.float16, torch.bfloat16)]
    eps = torch.finfo(torch.bfloat16).eps                  # the gap between 1 and the next bf16 number
    assert f"1/128 of a power of two apart: {eps:.4f} between 1 and 2, {2 * eps:.4f} between 2 and 4" in text
    assert eps == 1 / 128

    def bf16_errs(name):
        rows = (ROOT / "benchmarks" / "results" / name).read_text(encoding="utf-8").splitlines()
        return {r.split()[1]: float(r.split()[-3]) for r in rows if r.startswith("check") and r.endswith("bfloat16")}

    missed, passed = bf16_errs("2026-11-30_nvidia-h200_attention.txt"), bf16_errs("2026-11-30_nvidia-h200_attention_run2.txt")
    assert max(passed.values()) <= TOLERANCE[torch.bfloat16] and f"within {max(passed.values()):.1e}".replace(
        "e-03", "e-3") in text
    assert missed["llama8b"] > TOLERANCE[torch.bfloat16] and missed["llama8b"] == pytest.approx(2 * eps, rel=0.01)
    assert f"off by {missed['llama8b']:.2e}".replace("e-02", "e-2") in text
