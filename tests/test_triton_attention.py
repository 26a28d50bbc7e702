"""Triton paged-attention kernels vs the torch reference, run in Triton's CPU interpreter.

Every case builds a paged cache the way the engine does -- random,
non-contiguous block tables, some blocks shared between sequences -- and
poisons everything a correct kernel must not read (unused slots, the tail of a
sequence's last block, block-table padding) and every output slot it must write
with NaN.  A kernel that reads past a length, trusts padding, or skips a store
therefore shows up as a NaN, not as a small numeric error.

The interpreter runs programs one at a time in Python, so each launch is kept
to roughly 100 programs or fewer.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede any triton / minivllm.model.kernels import

import pytest
import torch
from paged_cases import (  # noqa: E402  (tests/ is on sys.path)
    PagedCase,
    assert_close,
    make_case,
    make_tiny_llama,
    nan_like,
)

from minivllm.model.attention import TorchAttentionBackend, write_kv
from minivllm.model.backends import get_attention_backend
from minivllm.model.kernels import (
    TritonAttentionBackend,
    choose_num_splits,
    paged_decode,
    paged_prefill,
    write_kv_triton,
)


# --------------------------------------------------------------------------- kernel runners
def run_decode(case: PagedCase, **kwargs) -> torch.Tensor:
    """The decode kernel on the case's decode rows, into a NaN-poisoned buffer."""
    nd = case.meta.num_decodes
    out = nan_like(case.q[:nd])
    paged_decode(
        case.q[:nd], case.k_cache, case.v_cache, case.meta.block_tables, case.meta.seq_lens, case.scale,
        max_seq_len=max(case.meta.context_lens[:nd]) + 1, out=out, **kwargs,
    )
    return out


def run_prefill(case: PagedCase, **kwargs) -> torch.Tensor:
    """The prefill kernel on the case's non-decode rows; decode rows of the buffer stay NaN."""
    meta = case.meta
    out = nan_like(case.q)
    paged_prefill(
        case.q, case.k_cache, case.v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        case.scale, first_seq=meta.num_decodes, num_seqs=meta.num_seqs - meta.num_decodes,
        max_query_len=max(meta.query_lens[meta.num_decodes :]), out=out, **kwargs,
    )
    return out[meta.num_decodes :]


P = 16  # page size of most cases
RAGGED_DECODE = [(0, 1), (P - 2, 1), (P - 1, 1), (P, 1), (3 * P + 4, 1)]  # kv lens 1, P-1, P, P+1, 3P+5


# --------------------------------------------------------------------------- decode
# Every GQA group in fp32; fp16 for two of them (the interpreter's time budget is small).
GROUP_DTYPES = [(g, torch.float32) for g in (1, 3, 4, 8)] + [(3, torch.float16), (8, torch.float16)]
GROUP_DTYPE_IDS = [f"group{g}-{str(d).removeprefix('torch.')}" for g, d in GROUP_DTYPES]


@pytest.mark.parametrize("group,dtype", GROUP_DTYPES, ids=GROUP_DTYPE_IDS)
def test_decode_matches_reference(group: int, dtype: torch.dtype) -> None:
    case = make_case(RAGGED_DECODE, num_decodes=5, group=group, dtype=dtype, seed=group)
    assert_close(run_decode(case, num_splits=2), case.reference(), dtype)


def test_decode_head_dim_128_tile_spans_pages() -> None:
    """d=128, and 32-token tiles over 8-token pages: one tile gathers four scattered blocks."""
    seqs = [(0, 1), (6, 1), (7, 1), (8, 1), (40, 1)]
    case = make_case(seqs, num_decodes=5, group=4, head_dim=128, page=8, seed=3)
    assert_close(run_decode(case, block_n=32), case.reference(), torch.float32)


def test_decode_splits_agree_and_runs_are_bitwise_identical() -> None:
    """S=1 (direct store) and S=7 (merge, with empty splits for short rows) agree; reruns are exact."""
    case = make_case(RAGGED_DECODE, num_decodes=5, group=3, kv_heads=1, seed=7)
    one = run_decode(case, num_splits=1, block_n=16)
    many = run_decode(case, num_splits=7, block_n=16)
    assert_close(one, case.reference(), torch.float32)
    assert_close(many, case.reference(), torch.float32)
    assert torch.allclose(one, many, atol=1e-5, rtol=0)
    assert torch.equal(run_decode(case, num_splits=7, block_n=16), many)


def test_decode_bf16_upcast_in_interpreter() -> None:
    """bf16 only works in the interpreter through the UPCAST path (cast to fp32 after load)."""
    case = make_case(RAGGED_DECODE, num_decodes=5, group=3, kv_heads=1, dtype=torch.bfloat16, seed=11)
    assert_close(run_decode(case, num_splits=3), case.reference(), torch.bfloat16)


def test_choose_num_splits() -> None:
    assert choose_num_splits(batch=256, kv_heads=8, max_seq_len=4096, num_units=132) == 1
    assert choose_num_splits(batch=1, kv_heads=3, max_seq_len=16384, num_units=132) == 64
    assert choose_num_splits(batch=1, kv_heads=8, max_seq_len=300, num_units=132) == 2
    assert choose_num_splits(batch=4, kv_heads=2, max_seq_len=100, num_units=1) == 1


# --------------------------------------------------------------------------- prefill
# Ragged chunks: fresh prompts of 1 and P-1 tokens, chunks starting mid-block, on a block
# boundary, and at P-2 (a tile boundary falls one key after the first row's position).
PREFILL_SEQS = [(0, 1), (0, P - 1), (P + 5, P + 1), (2 * P, P), (P - 2, 3), (P + 3, 2)]


@pytest.mark.parametrize("group,dtype", GROUP_DTYPES, ids=GROUP_DTYPE_IDS)
def test_prefill_matches_reference(group: int, dtype: torch.dtype) -> None:
    kv_heads = 1 if group >= 4 else 2
    case = make_case(PREFILL_SEQS, num_decodes=0, group=group, kv_heads=kv_heads, dtype=dtype,
                     seed=20 + group)
    assert_close(run_prefill(case), case.reference(), dtype)


def test_prefill_long_chunk_mid_block_head_dim_128() -> None:
    """A 40-token chunk starting mid-block behind 21 cached tokens: several diagonal and full tiles."""
    case = make_case([(21, 40), (0, 17)], num_decodes=0, group=2, kv_heads=1, head_dim=128, page=8, seed=5)
    assert_close(run_prefill(case), case.reference(), torch.float32)


# --------------------------------------------------------------------------- backend
def mixed_case(dtype: torch.dtype, group: int) -> PagedCase:
    seqs = [(P - 1, 1), (2 * P, 1), (0, 1), (P + 7, 9), (0, P + 1)]  # 3 decodes, then 2 prefills
    return make_case(seqs, num_decodes=3, group=group, kv_heads=1, dtype=dtype, seed=30 + group)


@pytest.mark.parametrize("dtype,group", [(torch.float32, 3), (torch.float16, 4)])
def test_backend_mixed_decode_and_prefill(dtype: torch.dtype, group: int) -> None:
    case = mixed_case(dtype, group)
    out = TritonAttentionBackend().attend(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == case.q.shape and out.dtype == dtype
    assert_close(out, case.reference(), dtype)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_backend_random_ragged_batches(seed: int) -> None:
    """Random decode/prefill mixes, group sizes and page sizes, checked end to end through attend()."""
    gen = torch.Generator().manual_seed(100 + seed)
    randint = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    num_decodes, num_prefills = randint(0, 3), randint(1, 3)
    seqs = [(randint(0, 50), 1) for _ in range(num_decodes)]
    seqs += [(randint(0, 40), randint(1, 30)) for _ in range(num_prefills)]
    group = [1, 3, 4, 8][randint(0, 3)]
    case = make_case(seqs, num_decodes=num_decodes, group=group, kv_heads=1, page=[8, 16][randint(0, 1)],
                     seed=seed)
    out = TritonAttentionBackend().attend(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
    assert_close(out, case.reference(), torch.float32)


def test_backend_write_kv_matches_torch() -> None:
    case = mixed_case(torch.float32, 2)
    caches = [nan_like(case.k_cache), nan_like(case.v_cache)]
    TritonAttentionBackend().write_kv(case.k_new, case.v_new, *caches, case.meta)
    slots = case.meta.slot_mapping
    flat = lambda c: c.view(-1, *c.shape[2:])  # noqa: E731
    assert torch.equal(flat(caches[0])[slots], case.k_new)
    assert torch.equal(flat(caches[1])[slots], case.v_new)


def test_kv_write_kernel_matches_torch_and_skips_padding_slots() -> None:
    """The GPU write kernel, interpreted: same result as index_copy_, slot -1 writes nothing."""
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 4, 3, 64, generator=gen)
    v_cache = torch.randn(6, 4, 3, 64, generator=gen)
    k = torch.randn(5, 3, 64, generator=gen)
    v = torch.randn(5, 3, 64, generator=gen)
    slots = torch.tensor([17, 2, -1, 23, 8])
    want_k, want_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv(k[keep], v[keep], want_k, want_v, slots[keep])
    write_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    # auto on a CPU: the C decode kernel when it builds, else the torch reference (never the slow interpreter)
    from minivllm.model.cpu_attention import load_kernel

    assert get_attention_backend("auto", cpu).name == ("cpu" if load_kernel() is not None else "torch")
    assert isinstance(get_attention_backend("torch", cpu), TorchAttentionBackend)
    assert get_attention_backend("triton", cpu).name == "triton"
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("flashinfer", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_attention_backend("triton", cpu)


# --------------------------------------------------------------------------- benchmark helpers
def test_benchmark_accounting() -> None:
    """The FLOP and byte counts the GPU benchmark reports (its --smoke run is too slow for CI here)."""
    from minivllm.bench.attention import AttnShape, PrefillCase, Row, format_table, kv_bytes, visible_pairs

    assert visible_pairs(PrefillCase(num_seqs=1, ctx=0, q_len=4)) == 1 + 2 + 3 + 4
    assert visible_pairs(PrefillCase(num_seqs=2, ctx=10, q_len=2)) == 2 * (11 + 12)
    assert kv_bytes(2, 100, AttnShape("x", 9, 3, 64), torch.bfloat16) == 2 * 100 * 3 * 64 * 2 * 2
    table = format_table([Row("decode", "x", 1, 512, 1, triton_ms=0.5, ok=True)])
    assert "decode" in table.splitlines()[-1] and "yes" in table.splitlines()[-1]


# --------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_engine_greedy_tokens_match_torch_backend(request: pytest.FixtureRequest) -> None:
    from minivllm.llm import LLM
    from minivllm.sampling_params import SamplingParams

    tiny_llama_dir = request.getfixturevalue("tiny_llama_dir")  # built only when the engine exists
    prompts = [{"prompt_token_ids": [1, 5, 9, 200, 33, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0, max_tokens=8)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=tiny_llama_dir, attention_backend=backend, dtype="float32",
                  num_gpu_blocks_override=16, max_model_len=128)  # a small cache: fast to allocate
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outputs]
    assert all(len(t) == 8 for t in tokens["torch"])
    assert tokens["triton"] == tokens["torch"]


# --------------------------------------------------------------------------- specialisation
def specialisation_key(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a separate binary for, per launch: constexprs, and -- except for the
    arguments in ``do_not_specialize`` -- whether an int is 1 or divisible by 16 and whether a
    pointer is 16-byte aligned (Triton's documented specialisation rules, modelled here because the
    interpreter compiles nothing)."""
    skip = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name, value in list(zip(kernel.arg_names, args)) + sorted(kwargs.items()):
        if name in skip or name.startswith("num_") and name in kwargs:  # num_warps / num_stages: launch options
            continue
        if isinstance(value, torch.Tensor):
            key.append((name, value.data_ptr() % 16 == 0, value.dtype))
        elif isinstance(value, int) and not isinstance(value, bool):
            key.append((name, value == 1, value % 16 == 0) if name not in kwargs else (name, value))
        else:
            key.append((name, value))
    return tuple(key)


@pytest.mark.parametrize("stage", [False, True], ids=["cpu-upload", "gpu-staging"])
def test_step_varying_arguments_are_not_specialised(tiny_llama_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                    stage: bool) -> None:
    """A served workload with many different lengths compiles each kernel about once.

    Every launch of an engine run (decode splits and merges, prefill chunks, KV writes; batches of
    1..9 sequences, tables 1..7 pages wide) is reduced to its specialisation key; a step-varying
    argument missing from a kernel's ``*_STEP_VARYING`` list shows up as extra keys.  Only the decode
    kernel's ``DIRECT`` constexpr (one split or several) may add one.  The split count a GPU would
    choose is replaced by one that varies with the step (1, 2, 3, 16), since the interpreter never splits;
    the KV-write kernel runs on a GPU only (its arguments are all fixed strides and pointers).
    ``gpu-staging`` prepares each step as on a GPU: the integer arrays packed into one staging buffer
    and handed to the kernels as views into it, whose pointers must stay 16-byte aligned whatever the
    batch size (packed end to end they were not: a second prefill binary, compiled mid-serving on an H200).

    A launch whose key was already seen is recorded and not run, as a GPU would reuse its binary: the
    interpreter's cost per launch was 70 s of CI for the two cases, and the test reads the launches' arguments,
    never their results.  Those arguments depend on lengths, not on token values (``ignore_eos``, fixed
    ``max_tokens``, prompts sharing no block), so the skipped outputs change no later launch; each distinct
    key still runs once through the interpreter.  (Removing ``num_q_tiles`` or the merge kernel's
    ``num_splits`` from its ``*_STEP_VARYING`` list fails both cases.)
    """
    from minivllm import LLM, SamplingParams
    from minivllm.model.kernels import decode, prefill

    # 1, 2, 3 and (one step in eight) 16: one split and several, ints that are and are not multiples of 16 --
    # every case of Triton's int specialisation, at a third of the interpreted work of cycling through 1..17.
    monkeypatch.setattr(decode, "choose_num_splits",
                        lambda batch, kv_heads, max_len, units: 16 if max_len % 8 == 0 else 1 + max_len % 3)
    kernels = {"split": decode._decode_split_kernel, "merge": decode._decode_merge_kernel,
               "prefill": prefill._prefill_kernel}
    keys: dict[str, set] = {name: set() for name in kernels}
    for name, kernel in kernels.items():
        def recording_run(*args, _name=name, _kernel=kernel, _run=kernel.run, grid, warmup, **kw):
            key = specialisation_key(_kernel, args, kw)
            if key in keys[_name]:
                return None  # a binary already "compiled": see the docstring
            keys[_name].add(key)
            return _run(*args, grid=grid, warmup=warmup, **kw)

        monkeypatch.setattr(kernel, "run", recording_run, raising=False)
    llm = LLM(model=tiny_llama_dir, attention_backend="triton", dtype="float32", num_gpu_blocks_override=48,
              max_model_len=160, max_num_batched_tokens=64)
    if stage:
        from minivllm.model.runner import BatchPreparer

        runner = llm.engine.executor
        runner.prep = BatchPreparer(runner.kv_cache.block_size, "cpu", stage=True)
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)  # alone: a table one page wide
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()}
               for n in (1, 15, 16, 17, 33, 64, 70, 2, 100)]
    llm.generate(prompts, params, use_tqdm=False)
    counts = {name: len(k) for name, k in keys.items()}
    assert counts["merge"] == 1 and counts["prefill"] == 1, counts
    # DIRECT (one split or several) is the split kernel's one constexpr that may change: one binary for each.
    per_direct = {direct: sum(("DIRECT", direct) in k for k in keys["split"]) for direct in (True, False)}
    assert per_direct == {True: 1, False: 1}, keys["split"]


def test_bench_smoke_plan_runs_the_split_and_merge_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench attention --smoke`` is there to prove on a CPU that the GPU run works, and ``SMOKE_PLAN`` says it
    takes every code path once; on a GPU most decode cases split the KV range and merge (S > 1).  Oracle: the
    merge kernel's launches, counted while the smoke plan's decode grid runs (in the order ``run`` uses), and
    the row's own comparison with SDPA on contiguous K/V."""
    from minivllm.bench import attention
    from minivllm.model.kernels import decode

    merges = []
    real = decode._decode_merge_kernel

    class Counted:
        def __getitem__(self, grid):
            merges.append(grid)
            return real[grid]

    monkeypatch.setattr(decode, "_decode_merge_kernel", Counted())
    plan = attention.SMOKE_PLAN
    for shape in attention.SHAPES:
        for batch in plan.batches:
            for ctx in plan.contexts:
                row = attention.bench_decode(shape, batch, ctx, 100.0, torch.device("cpu"), plan)
                if merges:  # the first case that merged: it must also agree with SDPA
                    assert row.ok and row.extra["splits"] > 1, row
                    return
    pytest.fail("no decode case of the smoke plan ran the merge stage")
