"""What only a GPU can show: the compiled Triton kernels, CUDA-graph replay, no per-step recompilation.

Skipped without CUDA (CI has none); ``tools/gpu_checks.sh`` runs this file on a
lent GPU.  It must run in its own pytest process: ``test_triton_attention.py``
sets ``TRITON_INTERPRET=1`` when it is imported, and a kernel module imported
after that is interpreted for the rest of the process, so collected together
these tests would be checking the interpreter again.

The oracles are the same as on the CPU: the fp32 torch reference for the
kernels, HF transformers for the engine's tokens.
"""

from __future__ import annotations


import pytest
import torch
from conftest import hf_greedy
from paged_cases import TOLERANCE, assert_close, make_case, make_tiny_llama

from minivllm.model.backends import triton_interpreting

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tools/gpu_checks.sh runs it)"),
    pytest.mark.skipif(triton_interpreting(),
                       reason="kernels are interpreted in this process: run `pytest tests/test_gpu.py` alone"),
]

P = 16
# decode rows first: KV lengths around page boundaries and long enough for the split-KV path
SHAPES = [
    [(0, 1), (P - 1, 1), (P, 1), (5 * P + 3, 1), (700, 1), (2100, 1)],  # decode only
    [(P - 2, 1), (3 * P, 1), (0, 37), (P + 5, 70), (200, 1)],  # mixed decode + prefill chunks (ctx, q)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 64), (8, 128)])
@pytest.mark.parametrize("shape", [0, 1], ids=["decode", "mixed"])
def test_compiled_kernels_match_reference(shape: int, group: int, head_dim: int, dtype: torch.dtype) -> None:
    from minivllm.model.kernels import TritonAttentionBackend

    seqs = SHAPES[shape]
    seqs = sorted(seqs, key=lambda s: s[1] != 1)  # decode-first, as the engine orders them
    case = make_case(seqs, num_decodes=sum(q == 1 for _, q in seqs), kv_heads=2, group=group, head_dim=head_dim,
                     dtype=dtype, seed=group).to("cuda")
    out = TritonAttentionBackend().attend(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.is_cuda and out.dtype == dtype
    assert_close(out, case.reference(), dtype)
    assert TOLERANCE[dtype] > 0


def _prompts(lengths: list[int], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in lengths]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_gpu"), head_dim=64)


def test_cuda_graph_engine_matches_hf_and_replays(tiny_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton backend + CUDA graphs, a batch that needs padding to its bucket: tokens equal HF greedy."""
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams
    from minivllm.model.cuda_graphs import DecodeGraphRunner

    replays = []
    original = DecodeGraphRunner.run
    monkeypatch.setattr(DecodeGraphRunner, "run", lambda self, *a: replays.append(1) or original(self, *a))
    prompts = _prompts([5, 17, 33, 64, 90, 3, 120, 48, 16, 77, 9], seed=1)  # 11 sequences: padded to a bucket
    llm = LLM(tiny_dir, device="cuda", dtype="float32", attention_backend="triton", max_model_len=256,
              kv_cache_memory_bytes=64 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert replays, "no decode step went through the CUDA graphs"
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    want = [hf_greedy(hf, p["prompt_token_ids"], 24) for p in prompts]
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def _compiled_variants() -> dict[str, int]:
    """Compiled binaries per Triton kernel of the backend (Triton keeps one per specialisation)."""
    import triton

    from minivllm.model.kernels import decode, kv_write, prefill

    counts = {}
    for module in (decode, prefill, kv_write):
        for name, fn in vars(module).items():
            caches = getattr(fn, "device_caches", None)
            if isinstance(fn, triton.runtime.JITFunction) and caches:
                counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts


def test_no_recompilation_per_step(tiny_dir: str) -> None:
    """Eager steps of many different lengths reuse the kernels compiled for the first ones.

    A ``tl.constexpr`` that depended on a step's lengths would compile a new
    binary for nearly every step (dozens here); specialisations Triton makes
    on its own (an int equal to 1, divisible by 16) are a handful.
    """
    from minivllm import LLM, SamplingParams

    before = _compiled_variants()  # what earlier tests in this process compiled (other dtypes, shapes)
    llm = LLM(tiny_dir, device="cuda", dtype="float32", attention_backend="triton", max_model_len=256,
              enforce_eager=True, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(_prompts([1, 2, 15, 16, 17, 31, 32, 33, 100], seed=2), params, use_tqdm=False)
    first = _compiled_variants()
    assert first, "no compiled Triton kernel found: is the backend interpreted?"
    llm.generate(_prompts([7, 45, 58, 63, 81, 99, 140, 3, 200, 26], seed=3), params, use_tqdm=False)
    second = _compiled_variants()
    grown = {k: second[k] - first.get(k, 0) for k in second if second[k] != first.get(k, 0)}
    assert sum(grown.values()) <= 2, f"kernels recompiled for new lengths: {grown} (first run: {first})"
    added = {k: n - before.get(k, 0) for k, n in second.items()}
    assert sum(added.values()) <= 8, f"compiled variants for one engine: {added}"
