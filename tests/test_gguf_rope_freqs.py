"""A Llama 3 GGUF must keep its RoPE scaling.

llama.cpp's converter does not write Llama 3.1/3.2's ``rope_scaling`` into the
GGUF's metadata: it stores the per-frequency divisors it implies as a tensor,
``rope_freqs.weight`` (llama.cpp PR 8676), and transformers' GGUF loader drops
that tensor, so a converted model ran plain RoPE -- different logits at every
position, silently.  The oracle here is the HF model the GGUF was written from:
a tiny random Llama with ``rope_type="llama3"``, written the way
``convert_hf_to_gguf.py`` writes one (q/k rows permuted for llama.cpp's rope,
the scaling as ``rope_freqs``), then served and compared logit for logit.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.kv.block_pool import BlockPool
from minivllm.kv.kv_cache import KVCache
from minivllm.kv.kv_cache_manager import KVCacheManager
from minivllm.request import Request
from minivllm.sched.scheduler import ScheduledBatch, ScheduledSeq

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
np = pytest.importorskip("numpy")

ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.down_proj": "ffn_down",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output"}


def _llama_cpp_permute(w, n_head):
    """``convert_hf_to_gguf.py``'s ``LlamaModel.permute``: rotate-half pairs become adjacent rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_cpp_rope_factors(config):
    """``convert_hf_to_gguf.py``'s Llama 3 ``rope_freqs``, computed from the HF config as llama.cpp does."""
    rope, dim = config.rope_parameters, config.head_dim
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    factors = []
    for freq in (1.0 / rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def gguf_writer_for(cfg, path, arch: str):
    """A GGUFWriter with the shape keys llama.cpp's converter writes for every Llama-like model (also used by
    tests/test_gguf_head_dim.py)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    return w


# a byte-level BPE vocabulary of 256 symbols and one merge: the conversion needs a tokenizer, and a tiny one keeps
# these tests fast (the bundled model's 49,152-token one took most of a minute to convert on a loaded 2-core machine)
VOCAB = [chr(c) for c in range(ord("!"), ord("!") + 256)] + ["!!"]


def add_tiny_tokenizer(w, cfg, pre: str = "qwen2") -> None:
    """Write :data:`VOCAB` as a byte-level BPE tokenizer (``pre``: the pre-tokenizer's name) into GGUF writer ``w``
    (also used by tests/test_gguf_head_dim.py and tests/test_gguf_qwen2_is_served_like_transformers.py)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(VOCAB)
    w.add_token_types([gguf.TokenType.NORMAL] * len(VOCAB))
    w.add_token_merges(["! !"])
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)


def _write_gguf(hf, path):
    cfg = hf.config
    w = gguf_writer_for(cfg, path, "llama")
    w.add_rope_dimension_count(cfg.head_dim)
    add_tiny_tokenizer(w, cfg, pre="smollm")  # (the bundled model's pre-tokenizer: a Llama-architecture BPE)
    w.add_tensor("rope_freqs.weight", _llama_cpp_rope_factors(cfg))
    permute = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}
    write_tensors_and_close(w, hf, GGUF_NAMES,
                            lambda module, a: _llama_cpp_permute(a, permute[module]) if module in permute else a)


def write_tensors_and_close(w, hf, names, transform):
    """Write ``hf``'s weights under llama.cpp's names (``names``: HF module -> GGUF name; the tied lm_head is
    left out), each layer tensor through ``transform(module, array)`` (the converter's own rewrites), then the
    file."""
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        a = t.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", a)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", a)
        else:
            parts = name.split(".")
            module = ".".join(parts[3:-1])
            w.add_tensor(f"blk.{parts[2]}.{names[module]}.{parts[-1]}", transform(module, a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _teacher_forced_logits(llm, prompt):
    runner = llm.engine.model_runner
    args = runner.model.args
    cache = KVCache(args.num_layers, 40, 16, args.num_kv_heads, args.head_dim, torch.float32, torch.device("cpu"))
    saved, runner.kv_cache = runner.kv_cache, cache
    try:
        kv = KVCacheManager(BlockPool(40), 16)
        req = Request("tf", list(prompt), SamplingParams(temperature=0, max_tokens=1), arrival_time=0.0)
        assert kv.allocate_slots(req, len(prompt))
        return runner.logits_for(ScheduledBatch([ScheduledSeq(req, len(prompt), 0)]))["tf"]
    finally:
        runner.kv_cache = saved


def assert_served_like_transformers(llm, hf, vocab_size: int, new_tokens: int = 8) -> None:
    """``llm`` serves ``hf``'s tiny checkpoint as transformers does: a 12-token random prompt's greedy
    continuation is transformers' own, and the teacher-forced logits of the whole sequence are within 1e-4 of
    transformers' (relative to the largest).  One definition for the GGUF tests that write such a checkpoint."""
    prompt = torch.randint(3, vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    with torch.inference_mode():
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0].tolist()
        ref = hf(torch.tensor([greedy])).logits[0].float()
    assert prompt + list(out[0].outputs[0].token_ids) == greedy
    got = _teacher_forced_logits(llm, greedy)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"


def test_a_llama3_gguf_is_served_with_its_rope_scaling(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2, rope_parameters=dict(ROPE))
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
    path = tmp_path / "tiny-llama3.gguf"
    _write_gguf(hf, path)

    prompt = torch.randint(3, config.vocab_size, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    llm = LLM(str(path), dtype="float32", max_model_len=256, num_gpu_blocks_override=32)
    got = _teacher_forced_logits(llm, prompt)
    rel = (got - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}: the GGUF's rope_freqs (Llama 3 RoPE scaling) was lost"


def test_a_conversion_parses_the_file_once_for_its_own_reads(tmp_path, monkeypatch):
    """The loader reads a GGUF's architecture, head width and RoPE factors from one parse of the file: a parse
    reads every metadata field, the bundled model's tokenizer is most of them, and three parses of our own (beside
    transformers' own) cost seconds each.  The oracle counts the readers built from minivllm's own frames."""
    import sys

    from minivllm.model.loader import convert_gguf

    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    real, callers = gguf.GGUFReader, []

    def counting(*args, **kwargs):
        callers.append(sys._getframe(1).f_globals.get("__name__", ""))
        return real(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2, rope_parameters=dict(ROPE))
    path = tmp_path / "tiny.gguf"
    _write_gguf(transformers.LlamaForCausalLM(config).eval(), path)
    out = convert_gguf(path)
    assert (out / "model.safetensors").exists() and json.loads((out / "config.json").read_text())["rope_freq_factors"]
    ours = [name for name in callers if name.startswith("minivllm")]
    assert ours == ["minivllm.model.loader"], callers
