"""End-to-end check on a GPU: the engine with the Triton backend vs the torch backend.

No weights can be downloaded on the GPU machine, so the model is a random-weight
model of a real architecture (Llama-3.2-1B's shape by default), saved as an HF
directory.  Both backends serve the same token prompts greedily in bf16; the
script reports, per prompt, whether the tokens agree and where they first
diverge (random weights give flat logits, so a bf16 rounding difference can
flip an argmax late in a sequence — the first divergence position says how
close the two are), plus each backend's output tokens per second (prefill included).

``--workload nano`` is issue 12's throughput check instead: nano-vllm's
benchmark shape (``--requests`` 256 requests, input and output lengths uniform
in 100-1024, EOS ignored) served by minivllm with each attention backend, and
by HF ``generate`` in static batches of ``--hf-batch`` on the same GPU, in one
run; output tokens per second of each, and the ratios the issue asks for.
``--scale`` shrinks the lengths and counts for a CPU dry run (``--arch tiny``, with ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from minivllm.argtypes import comma_list, given_flags, nonnegative_int, output_file, positive_float, positive_int, refuse_unread
from minivllm.bench.results import write_result

BACKENDS = ("torch", "triton", "triton-eager")
# The defaults of the flags that one workload (or a run at all, beside --save-model) reads: None in the parser, so
# that one given where nothing reads it can be told apart and refused, and put in after that check.
DEFAULTS = dict(device="cuda", dtype="bfloat16", workload="parity", max_prompt_len=1500, prompts=16, max_tokens=64,
                requests=256, hf_batch=32, hf_requests=0, backends=BACKENDS, scale=1.0)
PARITY_ONLY = ("max_prompt_len", "prompts", "max_tokens")
NANO_ONLY = ("requests", "hf_batch", "hf_requests", "backends", "scale")


def make_model_dir(path: str, arch: str) -> None:
    """Save a random-weight model of ``arch`` to ``path`` (bf16), initialised on the GPU when there is one.

    Initialising 1.2B parameters takes tens of seconds on a CPU and well under one on a GPU; on a lent
    GPU every second counts.
    """
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        random_model(arch).save_pretrained(path)


def random_model(arch: str):
    """A random-weight HF model of ``arch``'s shape, in bf16."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if arch == "tiny":  # for a CPU dry run of this script
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=32000, max_position_embeddings=8192)
        model = LlamaForCausalLM(cfg)
    elif arch == "llama-3.2-1b":
        cfg = LlamaConfig(
            hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
            rope_theta=500000.0, tie_word_embeddings=True, rms_norm_eps=1e-5,
        )
        model = LlamaForCausalLM(cfg)
    else:
        cfg = Qwen3Config(
            hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192,
            tie_word_embeddings=True,
        )
        model = Qwen3ForCausalLM(cfg)
    return model.to(torch.bfloat16)


def run(model_dir: str, backend: str, prompts, params, device: str, dtype: str, *, eager: bool = False,
        max_model_len: int = 4096, kv_bytes: int | None = None):
    """Serve ``prompts`` (all submitted at once) after a warm-up; (token ids, output tok/s).

    The KV pool is 8 GiB on a GPU by default (the nano runs ask for 16 GiB) and 256 MiB elsewhere: a CPU dry
    run serves ``--arch tiny``, whose KV takes 512 B a token in bf16: 256 MiB holds 512 K tokens.
    (Triton's interpreter works on CPU tensors in place, so the pool's size does not slow its launches.)
    """
    from minivllm import LLM

    if kv_bytes is None:
        kv_bytes = 8 << 30 if on_gpu(device) else 256 << 20

    llm = LLM(model_dir, dtype=dtype, device=device, attention_backend=backend, enforce_eager=eager,
              max_model_len=max_model_len, kv_cache_memory_bytes=kv_bytes)
    from minivllm import SamplingParams

    # warm-up on every prompt, two tokens each: the prefill chunks and decode shapes the timed run will
    # meet, so no kernel is compiled inside the timing (the first GPU run warmed up on two prompts, and its
    # fp32 Triton figure mostly timed compilation)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    sync = (lambda: torch.cuda.synchronize(device)) if on_gpu(device) else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, sum(len(t) for t in tokens) / wall


def nano_workload(requests: int, lo: int, hi: int, seed: int = 0):
    """``[(prompt ids, output length)]``: lengths uniform in ``[lo, hi]`` (nano-vllm's benchmark shape)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (requests, 2), generator=g).tolist()
    return [(torch.randint(10, 30000, (n_in,), generator=g).tolist(), n_out) for n_in, n_out in lens]


def run_nano_minivllm(model_dir: str, backend: str, work, device: str, dtype: str, eager: bool = False) -> float:
    """Output tokens per second of minivllm on ``work``, every output exactly as long as asked."""
    from minivllm import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    tokens, tps = run(model_dir, backend, prompts, params, device, dtype, eager=eager,
                      max_model_len=max(len(p) + n for p, n in work) + 16, kv_bytes=16 << 30 if on_gpu(device) else None)
    assert [len(t) for t in tokens] == [n for _, n in work]
    return tps


def run_nano_hf(model_dir: str, work, device: str, dtype: str, batch: int) -> float:
    """Output tokens per second of HF ``generate`` in static batches (:func:`minivllm.bench.offline.run_hf`)."""
    from transformers import AutoModelForCausalLM

    from minivllm.bench.offline import run_hf

    from minivllm.config import parse_device, parse_dtype

    # the engine's spellings (fp32, bf16, auto), not getattr(torch, ...): --dtype fp32 was an AttributeError here
    torch_dtype = parse_dtype(dtype, parse_device(device))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    run_hf(model, [(p, min(n, 8)) for p, n in work[:2]], batch, 0, device)  # warm-up: a few tokens suffice
    seconds, _ = run_hf(model, work, batch, 0, device)
    return sum(n for _, n in work) / seconds


def nano_main(a, model_dir: str) -> dict:
    """Each engine on the workload in turn; the result so far is written after each (a time box may end it)."""
    lo, hi = max(4, int(100 * a.scale)), max(8, int(1024 * a.scale))
    work = nano_workload(max(2, int(a.requests * a.scale)), lo, hi)
    hf_work = work[: a.hf_requests] if a.hf_requests else work
    res = {"device": device_label(a.device), "arch": a.arch,
           "dtype": a.dtype, "requests": len(work), "lengths": [lo, hi], "output_tokens": sum(n for _, n in work),
           "hf_requests": len(hf_work), "hf_batch": a.hf_batch}

    def save() -> None:
        if a.json:
            write_result(a.json, res, "python -m minivllm.bench gpu_e2e")

    def record(key: str, value: float) -> None:
        res[key] = value
        print(f"{key}: {value:.1f}", flush=True)
        save()

    backends = a.backends
    for backend in [b for b in backends if b in ("torch", "triton")]:
        record(f"minivllm_{backend}_tok_s", run_nano_minivllm(model_dir, backend, work, a.device, a.dtype))
    # HF on the first --hf-requests only: static batches cost minutes on a 15-minute GPU lease, and
    # tokens per second of random-length static batches does not depend on which batches are run
    record("hf_tok_s", run_nano_hf(model_dir, hf_work, a.device, a.dtype, a.hf_batch))
    if "triton-eager" in backends:
        record("minivllm_triton_eager_tok_s",
               run_nano_minivllm(model_dir, "triton", work, a.device, a.dtype, eager=True))
    # the best of the minivllm runs that happened: with --backends triton-eager alone, a max over torch and
    # triton only was 0, and the summary said "minivllm 0 tok/s = 0.0x HF" of an engine that had just run
    best = max(res[f"minivllm_{b.replace('-', '_')}_tok_s"] for b in backends)
    res["vs_hf"] = best / res["hf_tok_s"]
    if "minivllm_torch_tok_s" in res and "minivllm_triton_tok_s" in res:
        res["triton_vs_torch"] = res["minivllm_triton_tok_s"] / res["minivllm_torch_tok_s"]
    if "minivllm_triton_eager_tok_s" in res and "minivllm_triton_tok_s" in res:
        res["cuda_graphs_speedup"] = res["minivllm_triton_tok_s"] / res["minivllm_triton_eager_tok_s"]
    save()
    print(json.dumps(res, indent=1))
    print(f"nano workload, {res['requests']} requests: minivllm {best:.0f} tok/s = {res['vs_hf']:.1f}x HF generate "
          f"(target >= 10x); Triton / torch backend {res.get('triton_vs_torch', float('nan')):.2f}x (target >= 1.3x); "
          f"CUDA graphs {res.get('cuda_graphs_speedup', float('nan')):.2f}x over eager")
    return res


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def _backend(text: str) -> str:
    """One of ``--backends``: a typo ran no minivllm engine at all and reported 0 tok/s with exit 0."""
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"unknown backend {text!r}; choose from {', '.join(BACKENDS)}")
    return text


def on_gpu(device: str) -> bool:
    """Is ``device`` a GPU?  By its type, not its spelling: ``cuda:0`` compared unequal to ``"cuda"``, and a run on
    it was labelled "cpu", got the CPU's 256 MiB KV pool instead of 8-16 GiB, and was timed without a sync."""
    return torch.device(device).type == "cuda"


def device_label(device: str) -> str:
    """What the result file names the machine by: the GPU's own name, or ``"cpu"``."""
    return torch.cuda.get_device_name(device) if on_gpu(device) else "cpu"


def _device(text: str) -> str:
    """``--device``: refused here, before a model of random weights is written, unless torch reads it as a CPU or
    a CUDA device (a typo used to fail only after the model had been written)."""
    try:
        kind = torch.device(text).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; use cuda, cuda:N or cpu")
    return text


def _dtype(text: str) -> str:
    """``--dtype``, checked by the engine's own rule before a model of random weights is written (a typo failed
    after that)."""
    from minivllm.config import parse_dtype

    try:
        parse_dtype(text, torch.device("cpu"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="llama-3.2-1b", choices=["llama-3.2-1b", "qwen3-0.6b", "tiny"])
    d = DEFAULTS
    ap.add_argument("--device", type=_device, default=None, help=f"cuda, cuda:N or cpu (default {d['device']})")
    ap.add_argument("--dtype", type=_dtype, default=None,
                    help=f"float32 makes both backends exact enough to compare tokens (default {d['dtype']})")
    ap.add_argument("--max-prompt-len", type=positive_int, default=None,
                    help=f"parity workload: prompt lengths are drawn from [16, this) (so more than 16; default "
                         f"{d['max_prompt_len']})")
    ap.add_argument("--prompts", type=positive_int, default=None, help=f"parity workload (default {d['prompts']})")
    ap.add_argument("--max-tokens", type=positive_int, default=None,
                    help=f"parity workload: greedy tokens per prompt (default {d['max_tokens']})")
    ap.add_argument("--json", type=output_file, default=None)
    ap.add_argument("--workload", choices=["parity", "nano"], default=None, help=f"(default {d['workload']})")
    ap.add_argument("--requests", type=positive_int, default=None,
                    help=f"nano workload: number of requests (default {d['requests']})")
    ap.add_argument("--hf-batch", type=positive_int, default=None,
                    help=f"nano workload: HF generate's static batch size (default {d['hf_batch']})")
    ap.add_argument("--hf-requests", type=nonnegative_int, default=None,
                    help="nano workload: run HF on the first N requests only (0, the default: all), to fit a short "
                         "GPU lease")
    ap.add_argument("--backends", type=comma_list(_backend), default=None,
                    help="nano workload: which minivllm runs (comma-separated; HF always runs; default all three)")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="serve this HF model directory (e.g. one --save-model wrote) instead of writing one")
    ap.add_argument("--scale", type=positive_float, default=None,
                    help=f"nano workload: shrink lengths and count (dry runs; default {d['scale']})")
    ap.add_argument("--save-model", default=None, metavar="DIR",
                    help="only write the random-weight model of --arch to DIR (e.g. for `bench sim_accuracy --model`)")
    a = ap.parse_args()
    if a.save_model:
        # it writes the model and runs nothing: a --model to serve, a --json to write, any workload's flag (and
        # --device: the model is initialised on the GPU when there is one) was dropped in silence
        dropped = given_flags(ap, a, ("model", "json", *DEFAULTS))
        if dropped:
            ap.error(f"argument --save-model: only writes a model and runs nothing: drop {', '.join(dropped)}")
    elif a.workload == "nano":
        refuse_unread(ap, a, PARITY_ONLY, "by --workload nano (its own lengths: --requests, --scale)")
    else:
        refuse_unread(ap, a, NANO_ONLY, "by the parity workload (--workload nano reads it)")
    for name, value in DEFAULTS.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    if a.max_prompt_len <= 16:
        ap.error(f"--max-prompt-len must be more than 16 (prompts are 16 to max-1 tokens), got {a.max_prompt_len}")
    if a.save_model:
        make_model_dir(a.save_model, a.arch)
        print(f"wrote a random-weight {a.arch} to {a.save_model}")
        return 0
    if on_gpu(a.device) and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (or, for a dry run on the CPU, TRITON_INTERPRET=1 and "
              "--device cpu --arch tiny)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if a.model is None:
            make_model_dir(tmp, a.arch)
        model_dir = a.model or tmp
        if a.workload == "nano":
            nano_main(a, model_dir)
            return 0
        return parity_main(a, model_dir)


def parity_main(a, model_dir: str) -> int:
    from minivllm import SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 30000, (int(n),), generator=g).tolist()}
               for n in torch.randint(16, a.max_prompt_len, (a.prompts,), generator=g)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    # room for the longest prompt and all its tokens: at the fixed 4096, a prompt of 4090 tokens got 6 of the 64
    # asked (the engine caps max_tokens at what fits) while the summary spoke of 64, and one of 4096 or more failed
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    max_model_len = max(4096, longest + a.max_tokens)
    ref, torch_tps = run(model_dir, "torch", prompts, params, a.device, a.dtype, max_model_len=max_model_len)
    got, triton_tps = run(model_dir, "triton", prompts, params, a.device, a.dtype, max_model_len=max_model_len)
    div = [first_divergence(x, y) for x, y in zip(ref, got)]
    identical = sum(d is None for d in div)
    result = {
        "device": device_label(a.device), "arch": a.arch, "dtype": a.dtype, "prompts": a.prompts, "max_tokens": a.max_tokens,
        "identical_prompts": identical, "first_divergence": div,
        "torch_backend_tok_s": torch_tps, "triton_backend_tok_s": triton_tps,
    }
    print(json.dumps(result, indent=1))
    print(f"{a.arch} {a.dtype}: {identical}/{a.prompts} prompts token-identical over {a.max_tokens} greedy tokens; "
          f"output tok/s (prefill included) torch {torch_tps:.0f}, triton {triton_tps:.0f}")
    if a.json:
        write_result(a.json, result, "python -m minivllm.bench gpu_e2e")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
