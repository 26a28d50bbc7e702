"""Benchmark of the Triton paged-attention kernels against the hardware and against SDPA.

Usage::

    python -m minivllm.bench.attention [--json PATH]      # on a CUDA GPU, about a minute (47-52 s on an H200)
    python -m minivllm.bench.attention --smoke            # tiny, CPU interpreter, < 60 s

What it does, in order:

1. **Correctness first.**  Ragged decode+prefill batches with non-contiguous
   block tables go through the Triton backend (``write_kv`` and ``attend``) and
   are compared with the fp32 torch reference, for both model shapes and
   bf16/fp16/fp32.  A benchmark of a wrong kernel is worthless, so failures are
   reported in the table and the JSON, and make the exit status 1.
2. **The ceiling.**  Decode attention is memory-bound, so its yardstick is the
   bandwidth of a device-to-device copy measured in the same run (bytes read +
   written per second).
3. **Decode**, bf16, batch {1, 16, 64, 256} x context {512, 4096, 16384}, for a
   SmolLM2-like shape (9 query / 3 KV heads, d=64) and a Llama-8B-like one
   (32 / 8, d=128).  Achieved bandwidth = bytes of K and V read / time.  The
   same K/V, laid out contiguously, goes through
   ``torch.nn.functional.scaled_dot_product_attention`` (with ``enable_gqa``):
   the ratio says what paging plus our kernel cost against a contiguous,
   vendor-tuned kernel.  Both outputs are compared, too.
4. **Prefill**, bf16: 4 sequences x 2048 new tokens without and with 2048 cached
   tokens, and 4 x 512 new tokens behind 8192 cached ones, in TFLOP/s counting only the causally visible scores
   (4 * head_dim FLOPs per visible query-key pair and head), against SDPA on
   contiguous tensors (causal mask aligned bottom-right when there is context).
5. A mixed step (many decodes + one prefill chunk) through ``backend.attend``.

Times are medians of ``triton.testing.do_bench`` (which flushes L2 between
runs).  A decode case whose K/V fits in the 50-60 MB L2 of an H100/H200 (9 of the
24 on the default grid) is not memory-bound in the sense the %copy column assumes,
so the table marks it "K/V fit in L2"; judge bandwidth on the others.

``--smoke`` runs the same code paths with tiny sizes on the CPU under
``TRITON_INTERPRET=1`` (set by the script before the kernels are imported) so a
machine without a GPU can prove the script works.  Its timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from minivllm.argtypes import output_file
from minivllm.bench.results import write_result
from minivllm.model.attention import AttentionMetadata, paged_attention_reference, write_kv

PAGE_SIZE = 16
L2_BYTES = 60 * 2**20


@dataclass(frozen=True)
class AttnShape:
    """The attention dimensions of a model: what the kernels specialise on."""

    name: str
    q_heads: int
    kv_heads: int
    head_dim: int


SHAPES = (AttnShape("smollm2", 9, 3, 64), AttnShape("llama8b", 32, 8, 128))


@dataclass(frozen=True)
class PrefillCase:
    """``num_seqs`` sequences, each a chunk of ``q_len`` new tokens behind ``ctx`` cached ones."""

    num_seqs: int
    ctx: int
    q_len: int


@dataclass(frozen=True)
class Plan:
    """Everything that differs between a GPU run and a ``--smoke`` run."""

    dtype: torch.dtype
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefills: tuple[PrefillCase, ...]
    mixed: tuple[int, int, PrefillCase]  # (num_decodes, decode ctx, prefill case)
    check_lens: tuple[tuple[int, int], ...]  # (ctx, q_len) per sequence, decode-first
    check_dtypes: tuple[torch.dtype, ...]
    copy_bytes: int
    mem_limit_bytes: float
    warmup_ms: int = 20
    rep_ms: int = 80
    cpu_reps: int = 1  # the interpreter compiles nothing, so no warm-up run on the CPU


GPU_PLAN = Plan(
    dtype=torch.bfloat16,
    batches=(1, 16, 64, 256),
    contexts=(512, 4096, 16384),
    prefills=(PrefillCase(4, 0, 2048), PrefillCase(4, 2048, 2048), PrefillCase(4, 8192, 512)),
    mixed=(64, 4096, PrefillCase(1, 2048, 2048)),
    check_lens=((0, 1), (15, 1), (16, 1), (17, 1), (300, 1), (5000, 1), (0, 77), (33, 64), (500, 200)),
    check_dtypes=(torch.bfloat16, torch.float16, torch.float32),
    copy_bytes=4 * 2**30,
    mem_limit_bytes=100e9,
)

SMOKE_PLAN = Plan(  # every code path once, with the fewest interpreted programs
    dtype=torch.float32,
    batches=(1, 2),
    # 300: past choose_num_splits' 256 tokens, so one SmolLM2 sequence takes the split + merge decode (S=2)
    # that most GPU decode cases take; at 40 every case is S=1.  (The Triton K/V write is still GPU-only.)
    contexts=(40, 300),
    prefills=(PrefillCase(1, 0, 16), PrefillCase(1, 8, 16)),
    mixed=(2, 20, PrefillCase(1, 8, 16)),
    check_lens=((0, 1), (15, 1), (17, 1), (0, 5), (9, 20)),
    check_dtypes=(torch.float32,),
    copy_bytes=64 * 2**20,
    mem_limit_bytes=1e9,
)

TOLERANCE = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 1.5e-2}


@dataclass
class Row:
    """One line of the result table (and one record of the JSON)."""

    kind: str
    shape: str
    batch: int
    ctx: int
    q_len: int
    triton_ms: float | None = None
    metric: float | None = None  # GB/s for decode, TFLOP/s for prefill
    metric_unit: str = ""
    pct_of_copy: float | None = None
    sdpa_ms: float | None = None
    sdpa_over_triton: float | None = None  # > 1: the Triton kernel is faster
    max_err: float | None = None
    ok: bool | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], Any], device: torch.device, plan: Plan) -> float:
    """Median milliseconds of ``fn``: ``do_bench`` on a GPU, ``Plan.cpu_reps`` wall-clock runs on the CPU
    (one by default: the interpreter is slow, and the CPU numbers are a smoke test, not a measurement)."""
    if device.type == "cuda":
        import triton.testing

        ms = triton.testing.do_bench(fn, warmup=plan.warmup_ms, rep=plan.rep_ms, return_mode="median")
        return float(ms)
    runs = []
    for _ in range(plan.cpu_reps):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def copy_bandwidth_gbps(device: torch.device, plan: Plan) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(plan.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, plan)
    return 2 * plan.copy_bytes / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------- inputs
def random_paged_batch(
    seqs: list[tuple[int, int]],
    shape: AttnShape,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A filled paged cache with randomly permuted blocks and the metadata for ``seqs``.

    ``seqs`` lists ``(ctx, q_len)`` decode-first.  Returns ``(q, k_new, v_new,
    k_cache, v_cache, meta)``; the new tokens' K/V are *not* written yet.
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    seq_lens = [c + q for c, q in seqs]
    blocks = [math.ceil(n / PAGE_SIZE) for n in seq_lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros((len(seqs), max(blocks)), dtype=torch.int32, device=device)
    slots, cursor = [], 0
    for i, ((ctx, q_len), n) in enumerate(zip(seqs, blocks)):
        tables[i, :n] = perm[cursor : cursor + n]
        cursor += n
        pos = torch.arange(ctx, ctx + q_len, device=device)
        slots.append(tables[i, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE)
    cache_shape = (num_blocks, PAGE_SIZE, shape.kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    num_tokens = sum(q for _, q in seqs)
    q = torch.randn((num_tokens, shape.q_heads, shape.head_dim), generator=gen, device=device, dtype=dtype)
    kv_shape = (num_tokens, shape.kv_heads, shape.head_dim)
    k_new = torch.randn(kv_shape, generator=gen, device=device, dtype=dtype)
    v_new = torch.randn_like(k_new)
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        num_decodes=next((i for i, (_, q_len) in enumerate(seqs) if q_len != 1), len(seqs)),
        query_lens=[q for _, q in seqs],
        context_lens=[c for c, _ in seqs],
    )
    return q, k_new, v_new, k_cache, v_cache, meta


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of every sequence, ``[batch, kv_heads, length, D]`` contiguous.

    Gathered one sequence at a time so the peak extra memory is one sequence.
    """
    batch = tables.shape[0]
    out = torch.empty((batch, cache.shape[2], length, cache.shape[3]), dtype=cache.dtype, device=cache.device)
    blocks = math.ceil(length / PAGE_SIZE)
    for b in range(batch):
        seq = cache[tables[b, :blocks].long()].reshape(-1, cache.shape[2], cache.shape[3])[:length]
        out[b] = seq.transpose(0, 1)
    return out


def make_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kwargs: Any
) -> Callable[[], torch.Tensor]:
    """A closure running SDPA on ``[B, heads, L, D]`` tensors with fewer KV heads.

    Uses ``enable_gqa`` when this torch (and mask) supports it; otherwise repeats
    the KV heads once, here, so the repetition is not part of the timed call.
    """
    attention = torch.nn.functional.scaled_dot_product_attention
    try:
        attention(q, k, v, scale=scale, enable_gqa=True, **kwargs)
        return lambda: attention(q, k, v, scale=scale, enable_gqa=True, **kwargs)
    except (TypeError, RuntimeError):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return lambda: attention(q, k, v, scale=scale, **kwargs)


# --------------------------------------------------------------------------- checks
def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error, absolute up to magnitude 1 and relative above it.

    A bf16 value near 3 is only representable to 2^-7 (0.0156 between neighbours), so an absolute
    tolerance would fail a correct kernel on large outputs and be loose on small ones.
    """
    return ((got.float() - want.float()).abs() / want.float().abs().clamp(min=1.0)).max().item()


def check_correctness(backend: Any, device: torch.device, plan: Plan) -> list[Row]:
    """``backend.write_kv`` + ``backend.attend`` vs the torch reference on ragged mixed batches."""
    rows = []
    for shape in SHAPES:
        for dtype in plan.check_dtypes:
            batch = random_paged_batch(list(plan.check_lens), shape, dtype, device)
            q, k_new, v_new, k_cache, v_cache, meta = batch
            want_k, want_v = k_cache.clone(), v_cache.clone()
            write_kv(k_new, v_new, want_k, want_v, meta.slot_mapping)
            backend.write_kv(k_new, v_new, k_cache, v_cache, meta)
            written = torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
            scale = shape.head_dim**-0.5
            got = backend.attend(q, k_cache, v_cache, meta, scale)
            want = paged_attention_reference(q, k_cache, v_cache, meta, scale)
            err = max_error(got, want)
            ok = written and bool(torch.isfinite(got).all()) and err <= TOLERANCE[dtype]
            note = str(dtype).replace("torch.", "") + ("" if written else ", write_kv MISMATCH")
            rows.append(Row("check", shape.name, meta.num_seqs, max(meta.context_lens), max(meta.query_lens),
                            max_err=err, ok=ok, note=note))
    return rows


# --------------------------------------------------------------------------- decode
def kv_bytes(batch: int, ctx: int, shape: AttnShape, dtype: torch.dtype) -> int:
    """Bytes of K and V one decode step reads."""
    return batch * ctx * shape.kv_heads * shape.head_dim * 2 * torch.finfo(dtype).bits // 8


def bench_decode(
    shape: AttnShape, batch: int, ctx: int, copy_gbps: float, device: torch.device, plan: Plan
) -> Row:
    """Time one decode step (batch x ctx) with the Triton kernel and with SDPA on contiguous K/V."""
    from minivllm.model.kernels import choose_num_splits, paged_decode
    from minivllm.model.kernels.launch import num_compute_units

    row = Row("decode", shape.name, batch, ctx, 1)
    nbytes = kv_bytes(batch, ctx, shape, plan.dtype)
    if 2 * nbytes > plan.mem_limit_bytes:  # paged + contiguous copy
        row.note = "skipped: cache too large"
        return row
    q, _, _, k_cache, v_cache, meta = random_paged_batch([(ctx - 1, 1)] * batch, shape, plan.dtype, device)
    scale = shape.head_dim**-0.5
    out = torch.empty_like(q)
    splits = choose_num_splits(batch, shape.kv_heads, ctx, num_compute_units(device))

    def run_triton() -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                            max_seq_len=ctx, out=out)

    row.triton_ms = time_ms(run_triton, device, plan)
    row.metric, row.metric_unit = nbytes / (row.triton_ms * 1e-3) / 1e9, "GB/s"
    row.pct_of_copy = 100 * row.metric / copy_gbps
    row.extra = {"splits": splits, "kv_bytes": nbytes, "fits_in_l2": nbytes < L2_BYTES}
    if nbytes < L2_BYTES:
        row.note = "K/V fit in L2"

    k = contiguous_kv(k_cache, meta.block_tables, ctx)
    v = contiguous_kv(v_cache, meta.block_tables, ctx)
    run_sdpa = make_sdpa(q.unsqueeze(2), k, v, scale)  # q as [B, heads, 1, D]
    row.sdpa_ms = time_ms(run_sdpa, device, plan)
    row.sdpa_over_triton = row.sdpa_ms / row.triton_ms
    row.max_err = max_error(run_triton(), run_sdpa().squeeze(2))
    row.ok = row.max_err <= TOLERANCE[plan.dtype]
    return row


# --------------------------------------------------------------------------- prefill
def visible_pairs(case: PrefillCase) -> int:
    """Query-key pairs the causal mask lets through, summed over the batch."""
    per_seq = case.q_len * case.ctx + case.q_len * (case.q_len + 1) // 2
    return case.num_seqs * per_seq


def bench_prefill(shape: AttnShape, case: PrefillCase, backend: Any, device: torch.device, plan: Plan) -> Row:
    """Time a chunked-prefill batch through ``backend.attend`` and SDPA on contiguous tensors."""
    row = Row("prefill", shape.name, case.num_seqs, case.ctx, case.q_len)
    seqs = [(case.ctx, case.q_len)] * case.num_seqs
    q, _, _, k_cache, v_cache, meta = random_paged_batch(seqs, shape, plan.dtype, device)
    scale = shape.head_dim**-0.5
    row.triton_ms = time_ms(lambda: backend.attend(q, k_cache, v_cache, meta, scale), device, plan)
    flops = 4 * shape.head_dim * shape.q_heads * visible_pairs(case)
    row.metric, row.metric_unit = flops / (row.triton_ms * 1e-3) / 1e12, "TFLOP/s"
    row.extra = {"flops": flops}

    kv_len = case.ctx + case.q_len
    k = contiguous_kv(k_cache, meta.block_tables, kv_len)
    v = contiguous_kv(v_cache, meta.block_tables, kv_len)
    q4 = q.view(case.num_seqs, case.q_len, shape.q_heads, shape.head_dim).transpose(1, 2)
    if case.ctx == 0:
        mask_kwargs: dict[str, Any] = {"is_causal": True}
    else:
        from torch.nn.attention.bias import causal_lower_right

        mask_kwargs = {"attn_mask": causal_lower_right(case.q_len, kv_len)}
    try:
        run_sdpa = make_sdpa(q4, k, v, scale, **mask_kwargs)
        ref = run_sdpa()
        row.sdpa_ms = time_ms(run_sdpa, device, plan)
        row.sdpa_over_triton = row.sdpa_ms / row.triton_ms
        got = backend.attend(q, k_cache, v_cache, meta, scale)
        row.max_err = max_error(got, ref.transpose(1, 2).reshape_as(got))
        row.ok = row.max_err <= TOLERANCE[plan.dtype]
    except (RuntimeError, NotImplementedError) as exc:  # an SDPA build without this mask
        row.note = f"sdpa unavailable: {type(exc).__name__}"
    return row


def bench_mixed(shape: AttnShape, backend: Any, device: torch.device, plan: Plan) -> Row:
    """A realistic step: many decodes and one prefill chunk in one ``attend`` call."""
    num_decodes, decode_ctx, chunk = plan.mixed
    seqs = [(decode_ctx - 1, 1)] * num_decodes + [(chunk.ctx, chunk.q_len)] * chunk.num_seqs
    q, _, _, k_cache, v_cache, meta = random_paged_batch(seqs, shape, plan.dtype, device)
    scale = shape.head_dim**-0.5
    row = Row("mixed", shape.name, meta.num_seqs, decode_ctx, chunk.q_len)
    row.triton_ms = time_ms(lambda: backend.attend(q, k_cache, v_cache, meta, scale), device, plan)
    row.note = f"{num_decodes} decodes@{decode_ctx} + {chunk.num_seqs}x{chunk.q_len}@{chunk.ctx}"
    return row


# --------------------------------------------------------------------------- report
def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(rows: list[Row]) -> str:
    """A fixed-width text table of all rows."""
    header = (f"{'kind':8} {'shape':8} {'batch':>5} {'ctx':>6} {'q_len':>5} {'triton ms':>10} "
              f"{'metric':>9} {'unit':7} {'%copy':>6} {'sdpa ms':>9} {'sdpa/tri':>8} {'max err':>9} "
              f"{'ok':>3}  note")
    lines = [header, "-" * len(header)]
    for r in rows:
        ok = "-" if r.ok is None else ("yes" if r.ok else "NO")
        lines.append(
            f"{r.kind:8} {r.shape:8} {r.batch:5d} {r.ctx:6d} {r.q_len:5d} {_fmt(r.triton_ms, '10.4f')} "
            f"{_fmt(r.metric, '9.1f')} {r.metric_unit:7} {_fmt(r.pct_of_copy, '6.1f')} "
            f"{_fmt(r.sdpa_ms, '9.4f')} {_fmt(r.sdpa_over_triton, '8.2f')} {_fmt(r.max_err, '9.2e')} "
            f"{ok:>3}  {r.note}"
        )
    return "\n".join(lines)


def environment(device: torch.device, copy_gbps: float, smoke: bool) -> dict[str, Any]:
    """Where and with what the numbers were measured."""
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    return {
        "device": name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "smoke": smoke,
        "copy_bandwidth_GBps": copy_gbps,
    }


# --------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=output_file, metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--smoke", action="store_true", help="tiny run on the CPU under TRITON_INTERPRET=1")
    return parser.parse_args(argv)


def run(plan: Plan, device: torch.device, smoke: bool) -> tuple[dict[str, Any], list[Row]]:
    """All measurements of one plan; prints progress to stderr as it goes."""
    from minivllm.model.backends import get_attention_backend

    backend = get_attention_backend("triton", device)
    rows = check_correctness(backend, device, plan)
    copy_gbps = copy_bandwidth_gbps(device, plan)
    print(f"copy bandwidth: {copy_gbps:.1f} GB/s (read + write)", file=sys.stderr)
    for shape in SHAPES:
        for batch in plan.batches:
            for ctx in plan.contexts:
                rows.append(bench_decode(shape, batch, ctx, copy_gbps, device, plan))
                print(f"decode {shape.name} b={batch} ctx={ctx}: {rows[-1].triton_ms} ms", file=sys.stderr)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for shape in SHAPES:
        for case in plan.prefills:
            rows.append(bench_prefill(shape, case, backend, device, plan))
            print(f"prefill {shape.name} {case}: {rows[-1].triton_ms} ms", file=sys.stderr)
        rows.append(bench_mixed(shape, backend, device, plan))
    return environment(device, copy_gbps, smoke), rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before minivllm.model.kernels is imported
        device, plan = torch.device("cpu"), SMOKE_PLAN
    elif torch.cuda.is_available():
        device, plan = torch.device("cuda"), GPU_PLAN
    else:
        print("no CUDA device: run with --smoke for a CPU check of this script", file=sys.stderr)
        return 2
    started = time.perf_counter()
    env, rows = run(plan, device, args.smoke)
    env["wall_s"] = round(time.perf_counter() - started, 1)
    if args.json:
        write_result(args.json, {**env, "rows": [asdict(r) for r in rows]}, "python -m minivllm.bench attention", argv)
    print(f"\n{env['device']} | torch {env['torch']} | triton {env['triton']} | "
          f"copy {env['copy_bandwidth_GBps']:.0f} GB/s | {env['wall_s']} s")
    print(format_table(rows))
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
