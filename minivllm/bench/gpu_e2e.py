"""End-to-end check on a GPU: the engine with the Triton backend vs the torch backend.

No weights can be downloaded on the GPU machine, so the model is a random-weight
model of a real architecture (Llama-3.2-1B's shape by default), saved as an HF
directory.  Both backends serve the same token prompts greedily in bf16; the
script reports, per prompt, whether the tokens agree and where they first
diverge (random weights give flat logits, so a bf16 rounding difference can
flip an argmax late in a sequence — the first divergence position says how
close the two are), plus each backend's decode throughput.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def make_model_dir(path: str, arch: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if arch == "tiny":  # for a CPU dry run of this script
        cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, vocab_size=32000)
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
    model.to(torch.bfloat16).save_pretrained(path)


def run(model_dir: str, backend: str, prompts, max_tokens: int, device: str, dtype: str):
    from minivllm import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, device=device,
              attention_backend=backend, max_model_len=4096, kv_cache_memory_bytes=8 << 30)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up / compile
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    return tokens, sum(len(t) for t in tokens) / wall


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--arch", default="llama-3.2-1b", choices=["llama-3.2-1b", "qwen3-0.6b", "tiny"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="float32 makes both backends exact enough to compare tokens")
    ap.add_argument("--max-prompt-len", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check needs a GPU (or --device cpu --arch tiny for a dry run)")
        return 2
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(10, 30000, (int(n),), generator=g).tolist()}
               for n in torch.randint(16, a.max_prompt_len, (a.prompts,), generator=g)]
    with tempfile.TemporaryDirectory() as d:
        make_model_dir(d, a.arch)
        ref, torch_tps = run(d, "torch", prompts, a.max_tokens, a.device, a.dtype)
        got, triton_tps = run(d, "triton", prompts, a.max_tokens, a.device, a.dtype)
    div = [first_divergence(x, y) for x, y in zip(ref, got)]
    identical = sum(d is None for d in div)
    result = {
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "arch": a.arch, "dtype": a.dtype, "prompts": a.prompts, "max_tokens": a.max_tokens,
        "identical_prompts": identical, "first_divergence": div,
        "torch_backend_tok_s": torch_tps, "triton_backend_tok_s": triton_tps,
    }
    print(json.dumps(result, indent=1))
    print(f"{a.arch} {a.dtype}: {identical}/{a.prompts} prompts token-identical over {a.max_tokens} greedy tokens; "
          f"decode throughput torch {torch_tps:.0f} tok/s, triton {triton_tps:.0f} tok/s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
