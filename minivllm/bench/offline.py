"""Offline throughput: minivllm vs HF transformers ``generate``, measured in the same run.

Workload (seeded): 32 chat requests, prompts 20–300 tokens, outputs 16–128
tokens with ``ignore_eos`` so every system produces exactly the same number
of tokens.  HF runs the same requests in static batches of 8 with left padding,
each batch lasting as long as its longest output — that is what static batching
costs, and what continuous batching removes.

Also reported: minivllm's TTFT / ITL percentiles, peak memory, and its share of
the machine's compute floor = model FLOPs of the workload / FLOP/s of a large
fp32 matmul measured here, now.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import time

import torch

from minivllm.argtypes import nonnegative_float, output_file, positive_int, refuse_unread
from minivllm.bench.results import write_result
from minivllm.metrics.stats import interpolated

HF_BATCH = 8  # --hf-batch's default


def make_workload(tokenizer, num_requests: int, seed: int, prompt_range=(20, 300), output_range=(16, 128)):
    """Chat-formatted prompts cut to random lengths, with random output lengths.

    Why cut the templated ids rather than size the text: the cut makes each prompt exactly its drawn length (the
    template's own tokens would add a model-dependent amount), at the price of every prompt ending inside the
    user turn (the default workload's 32 all do) -- harmless here, where ``ignore_eos`` fixes the outputs'
    lengths and only speed is measured.
    """
    rng = random.Random(seed)
    words = (
        "serving engines schedule requests under memory limits paged attention blocks tokens "
        "prefill decode latency throughput cache budget fairness tenants queue preemption"
    ).split()
    requests = []
    for i in range(num_requests):
        target = rng.randint(*prompt_range)
        body = " ".join(rng.choice(words) for _ in range(target))
        ids = tokenizer.apply_chat_template([{"role": "user", "content": body}], tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        ids = ids[:target] if len(ids) > target else ids
        requests.append((ids, rng.randint(*output_range)))
    return requests


def matmul_flops(seconds: float = 2.0, n: int = 2048) -> float:
    """fp32 FLOP/s of a large square matmul: the compute roof of this machine."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * n**3 * count / (time.perf_counter() - start)


def workload_flops(args, requests) -> float:
    """Dense FLOPs: 2 x non-embedding params per token (+ vocab projection per output) + attention."""
    h, L, d = args.hidden_size, args.num_layers, args.head_dim
    per_layer = h * d * (args.num_heads * 2 + args.num_kv_heads * 2) + 3 * h * args.intermediate_size
    total = 0.0
    for prompt, out in requests:
        tokens = len(prompt) + out
        total += 2 * per_layer * L * tokens
        total += 2 * h * args.vocab_size * out
        total += 4 * L * args.num_heads * d * (tokens * tokens / 2)  # QK^T and PV, causal
    return total


percentile = interpolated  # as vLLM's benchmarks report it (numpy's default), NaN for no samples


def run_minivllm(llm, requests, temperature: float = 0.0):
    """Greedy (by default) minivllm on ``requests``: wall time, TTFT and ITL samples, peak KV blocks, token ids.

    The length assert is why the tok/s compare like for like: with ``ignore_eos`` every request must produce
    exactly its ``max_tokens``, the same work HF's ``min_new_tokens`` forces.
    """
    from minivllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True) for _, n in requests]
    engine = llm.engine
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, requests))
    ttft = [o.metrics.ttft for o in outs]
    itl = [x for o in outs for x in o.metrics.itls]
    peak_blocks = max(engine.pool.num_blocks - s.available_blocks for s in engine.step_log[-2000:])
    return elapsed, ttft, itl, peak_blocks, [list(o.outputs[0].token_ids) for o in outs]


def run_hf(model, requests, batch_size: int, pad_id: int, device: str = "cpu"):
    """Static batching: left-pad each batch of ``batch_size``, run it until its longest output is done.

    Returns the wall time and each request's first ``max_tokens`` generated ids (reading them back
    waits for the device, so the time is complete on a GPU too).
    """
    outputs = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            chunk = requests[i : i + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.full((len(chunk), width), pad_id)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for r, (p, _) in enumerate(chunk):
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            longest = max(n for _, n in chunk)
            gen = model.generate(
                input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=pad_id,
            )
            outputs += [gen[r, width : width + n].tolist() for r, (_, n) in enumerate(chunk)]
    return time.perf_counter() - start, outputs


def run_vllm(python: str, model_dir: str, requests, max_num_batched_tokens: int, threads: int) -> dict:
    """vLLM's CPU build on the same token ids, in its own interpreter (see :mod:`minivllm.bench.vllm_runner`).

    ``VLLM_CPU_OMP_THREADS_BIND`` pins vLLM's OpenMP threads to the cores
    minivllm uses here (0..threads-1), so neither side gets more of the machine.
    """
    import os
    import subprocess
    import tempfile
    from pathlib import Path

    runner = Path(__file__).with_name("vllm_runner.py")
    with tempfile.TemporaryDirectory() as tmp:
        work, result = Path(tmp) / "workload.json", Path(tmp) / "result.json"
        work.write_text(json.dumps({
            "prompts": [p for p, _ in requests], "max_tokens": [n for _, n in requests],
            "max_num_batched_tokens": max_num_batched_tokens,
            "max_model_len": max(len(p) + n for p, n in requests) + 16,
        }))
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}" if threads > 1 else "0",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        proc = subprocess.run([python, str(runner), model_dir, str(work), str(result)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.loads(result.read_text())


def count_identical(a: list[list[int]], b: list[list[int]], until: set[int] | frozenset = frozenset()) -> int:
    """How many requests got the same tokens in ``a`` and ``b``, each compared up to ``a``'s first token in ``until``.

    Why ``until``: the workload ignores EOS.  minivllm and vLLM then let the
    model emit EOS and go on, as vLLM's ``ignore_eos`` defines it; HF's
    ``min_new_tokens`` instead masks EOS until the length is reached, so where
    the model's argmax is EOS (request 29 of the default workload, 11th token,
    logit 24.4 against 22.9) HF is forced onto another token and the two
    continuations part.  Up to that point HF is the exact oracle.
    """
    def compared(x: list[int]) -> int:
        return next((i for i, t in enumerate(x) if t in until), len(x))

    return sum(len(y) >= (n := compared(x)) and x[:n] == y[:n] for x, y in zip(a, b))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=positive_int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    # (None when not given, so that one given beside --skip-hf, which runs no HF model, can be refused)
    ap.add_argument("--hf-batch", type=positive_int, default=None,
                    help=f"HF generate's static batch size (default {HF_BATCH}); not with --skip-hf")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--kv-cache-gib", type=nonnegative_float, default=0.375,
                    help="minivllm's KV pool in GiB (default 0.375: the 32-request workload peaks at 363 blocks, "
                         "268 MB, so nothing is preempted; 0 = the engine's default, 1 GiB on a CPU); "
                         "vLLM keeps its 1 GiB (its setting is in whole GiB)")
    ap.add_argument("--linear-backend", default="auto", choices=["auto", "torch", "onednn"])
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "cpu"])
    ap.add_argument("--no-keep-freed-memory", action="store_true",
                    help="leave glibc malloc's thresholds alone (EngineConfig.cpu_keep_freed_memory=False): "
                         "the A/B for minivllm/model/host_malloc.py, run as two processes")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vLLM's CPU build (tools/install_vllm_cpu.sh): also run vLLM, same run")
    ap.add_argument("--sampled-too", action="store_true",
                    help="also run minivllm with temperature 0.8 (unseeded) on the same workload, same process: "
                         "what drawing tokens costs beside greedy decoding")
    ap.add_argument("--json", type=output_file, default=None, help="write the results here")
    a = ap.parse_args()
    if a.skip_hf:
        refuse_unread(ap, a, ("hf_batch",), "with --skip-hf (no HF model runs)")
    a.hf_batch = HF_BATCH if a.hf_batch is None else a.hf_batch

    from minivllm import LLM

    torch.manual_seed(a.seed)
    kv_bytes = int(a.kv_cache_gib * 2**30) if a.kv_cache_gib else None
    load_start = time.perf_counter()
    llm = LLM(a.model, dtype="float32", max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_memory_bytes=kv_bytes,
              linear_backend=a.linear_backend, attention_backend=a.attention_backend,
              cpu_keep_freed_memory=not a.no_keep_freed_memory)
    load_s = time.perf_counter() - load_start  # the model is cached as safetensors by then: a warm load
    model = llm.engine.model_runner.model
    requests = make_workload(llm.tokenizer, a.requests, a.seed)
    out_tokens = sum(n for _, n in requests)
    prompt_tokens = sum(len(p) for p, _ in requests)
    print(f"workload: {len(requests)} requests, {prompt_tokens} prompt tokens, {out_tokens} output tokens "
          f"(ignore_eos), torch threads {torch.get_num_threads()}")

    run_minivllm(llm, requests[:4])  # warm-up
    faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    mv_s, ttft, itl, peak_blocks, mv_ids = run_minivllm(llm, requests)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before  # pages mapped afresh (host_malloc)
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before anything else is loaded
    mv_tps = out_tokens / mv_s
    roof = matmul_flops()
    flops = workload_flops(llm.engine.model_runner.model.args, requests)
    results = {
        "attention_backend": model.backend.name, "linear_backend": model.linear_backend,
        "kv_pool_mb": llm.engine.pool.num_blocks * llm.engine.model_runner.kv_cache.bytes_per_block / 2**20,
        "output_tokens": out_tokens, "prompt_tokens": prompt_tokens,
        "minivllm_s": mv_s, "minivllm_tok_s": mv_tps,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3, "ttft_p95_ms": percentile(ttft, 95) * 1e3,
        "itl_p50_ms": percentile(itl, 50) * 1e3, "itl_p95_ms": percentile(itl, 95) * 1e3,
        "itl_p99_ms": percentile(itl, 99) * 1e3,
        "peak_kv_blocks": peak_blocks, "kv_blocks": llm.engine.pool.num_blocks,
        "peak_rss_mb": peak_rss_mb, "load_s": load_s, "minor_page_faults": faults,
        "cpu_keep_freed_memory": llm.engine.config.cpu_keep_freed_memory,
        "matmul_gflops": roof / 1e9, "workload_gflop": flops / 1e9,
        "compute_floor_s": flops / roof, "share_of_floor": (flops / roof) / mv_s,
    }
    if a.sampled_too:
        sampled_s = run_minivllm(llm, requests, temperature=0.8)[0]
        results.update(minivllm_sampled_s=sampled_s, minivllm_sampled_tok_s=out_tokens / sampled_s,
                       sampled_vs_greedy=mv_s / sampled_s)
    if not a.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.loaded.path), dtype=torch.float32).eval()
        pad = llm.tokenizer.pad_token_id if llm.tokenizer.pad_token_id is not None else 0
        run_hf(hf, requests[:2], a.hf_batch, pad)  # warm-up
        hf_s, hf_ids = run_hf(hf, requests, a.hf_batch, pad)
        results.update(hf_s=hf_s, hf_tok_s=out_tokens / hf_s, speedup=hf_s / mv_s,
                       minivllm_identical_to_hf=count_identical(mv_ids, hf_ids, until=llm.engine.eos_token_ids))
        del hf
    if a.vllm_python:
        v = run_vllm(a.vllm_python, str(llm.engine.loaded.path), requests, a.max_num_batched_tokens,
                     torch.get_num_threads())
        results.update(vllm_s=v["elapsed_s"], vllm_tok_s=out_tokens / v["elapsed_s"], vllm_load_s=v["load_s"],
                       vllm_peak_rss_mb=v.get("peak_rss_mb"), minivllm_vs_vllm=v["elapsed_s"] / mv_s,
                       vllm_identical_to_minivllm=count_identical(v["token_ids"], mv_ids))

    print(f"\nminivllm   {mv_s:7.1f} s  {mv_tps:7.1f} output tok/s")
    if a.sampled_too:
        print(f"  sampled  {results['minivllm_sampled_s']:7.1f} s  {results['minivllm_sampled_tok_s']:7.1f} output tok/s "
              f"(temperature 0.8: {results['sampled_vs_greedy']:.2f}x greedy's throughput)")
    if "hf_s" in results:
        print(f"HF static  {results['hf_s']:7.1f} s  {results['hf_tok_s']:7.1f} output tok/s  (batches of {a.hf_batch}, left padding)")
        print(f"ratio      minivllm / HF = {results['speedup']:.2f}x   "
              f"(token-identical to HF up to EOS, which HF's min_new_tokens masks: "
              f"{results['minivllm_identical_to_hf']}/{len(requests)})")
    if "vllm_s" in results:
        print(f"vLLM CPU   {results['vllm_s']:7.1f} s  {results['vllm_tok_s']:7.1f} output tok/s  (eager; load "
              f"{results['vllm_load_s']:.0f} s, peak RSS {results['vllm_peak_rss_mb'] or 0:.0f} MiB)")
        print(f"ratio      minivllm / vLLM = {results['minivllm_vs_vllm']:.2f}x   "
              f"(vLLM token-identical to minivllm: {results['vllm_identical_to_minivllm']}/{len(requests)})")
    print(f"TTFT p50 {results['ttft_p50_ms']:.0f} ms  p95 {results['ttft_p95_ms']:.0f} ms | "
          f"ITL p50 {results['itl_p50_ms']:.0f} ms  p95 {results['itl_p95_ms']:.0f} ms  p99 {results['itl_p99_ms']:.0f} ms")
    print(f"peak KV blocks {peak_blocks}/{results['kv_blocks']} ({results['kv_pool_mb']:.0f} MiB pool) | "
          f"peak RSS {results['peak_rss_mb']:.0f} MiB | page faults {faults} | load {load_s:.1f} s | attention {results['attention_backend']}, "
          f"linear {results['linear_backend']}")
    print(f"compute floor: {results['workload_gflop']:.0f} GFLOP at {results['matmul_gflops']:.1f} GFLOP/s = "
          f"{results['compute_floor_s']:.1f} s -> minivllm runs at {100 * results['share_of_floor']:.0f}% of the floor")
    if a.json:
        write_result(a.json, results, "python -m minivllm.bench offline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
