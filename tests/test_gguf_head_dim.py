"""A GGUF whose head_dim is not hidden/heads must load with its own head_dim.

transformers' GGUF config mapping does not read ``qwen3.attention.key_length``
(llama.cpp's name for head_dim), so it rebuilt a Qwen3 with its config class's
default head_dim (128) and the q/k/v tensors failed to fit: such a file was
refused.  Qwen3-0.6B itself has head_dim 128 != 1024/16, so the default only
hid the gap for checkpoints that happen to use 128.  The oracle is the HF model
the GGUF is written from: a tiny random Qwen3 with head_dim 24 (hidden/heads is
16, and neither is 128), written the way ``convert_hf_to_gguf.py`` writes a
Qwen3 (no q/k permutation, key/value_length set), then served and compared
logit for logit and token for token.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from tests.test_gguf_rope_freqs import (VOCAB, add_tiny_tokenizer, assert_served_like_transformers, gguf_writer_for,
                                       write_tensors_and_close)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.down_proj": "ffn_down",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
def _write_qwen3_gguf(hf, path, value_length=None):
    cfg = hf.config
    w = gguf_writer_for(cfg, path, "qwen3")
    w.add_key_length(cfg.head_dim)
    w.add_value_length(value_length or cfg.head_dim)
    add_tiny_tokenizer(w, cfg)
    def own_v_width(module, a):  # V heads of their own width, as such a file has
        if value_length and module == "self_attn.v_proj":
            return a[: cfg.num_key_value_heads * value_length]
        if value_length and module == "self_attn.o_proj":
            return a[:, : cfg.num_attention_heads * value_length].copy()
        return a

    write_tensors_and_close(w, hf, GGUF_NAMES, own_v_width)


def _tiny_qwen3():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 10000.0})
    hf = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
    return hf


def test_a_qwen3_gguf_with_its_own_head_dim_is_served_like_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    hf = _tiny_qwen3()
    path = tmp_path / "tiny-qwen3.gguf"
    _write_qwen3_gguf(hf, path)

    llm = LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=16)
    assert llm.engine.model_runner.model.args.head_dim == 24
    assert_served_like_transformers(llm, hf, len(VOCAB))

def test_v_heads_of_another_width_than_k_heads_are_refused_by_name(tmp_path, monkeypatch):
    """One head_dim serves q, k and v here (and in transformers' Llama/Qwen): V heads of another width fit
    neither, and the refusal should name the reason (before, a shape error deep inside transformers)."""
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-qwen3.gguf"
    _write_qwen3_gguf(_tiny_qwen3(), path, value_length=16)
    with pytest.raises(ValueError, match=r"value_length=16 differs from key_length=24"):
        LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=16)
