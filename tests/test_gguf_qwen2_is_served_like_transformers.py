"""A Qwen2 GGUF (Qwen2 / Qwen2.5, the most common small GGUFs after Llama) converts and serves like transformers.

The converter accepts the GGUF architectures it can rebuild -- llama, qwen2 and qwen3 -- and refuses the rest by
name.  The Llama and Qwen3 paths have their own GGUF tests (``test_gguf_rope_freqs``, ``test_gguf_head_dim``);
Qwen2 differs from both (biases on q, k and v, none on o; no q/k norms), and dropping it from the accepted set
refused every such file with no test noticing.  Oracle: the tiny random HF Qwen2 the GGUF is written from (the way
``convert_hf_to_gguf.py`` writes one: no q/k permutation), logit for logit and token for token.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM
from tests.test_gguf_head_dim import GGUF_NAMES
from tests.test_gguf_rope_freqs import (VOCAB, add_tiny_tokenizer, assert_served_like_transformers, gguf_writer_for,
                                       write_tensors_and_close)

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


def test_a_qwen2_gguf_with_qkv_biases_is_served_like_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                                      bos_token_id=1, eos_token_id=2,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # biases of visible size, so a model that dropped them would not pass
            p.normal_(0, 0.3) if p.dim() > 1 else p.copy_(1 + 0.1 * torch.randn_like(p))
    path = tmp_path / "tiny-qwen2.gguf"
    w = gguf_writer_for(config, path, "qwen2")
    add_tiny_tokenizer(w, config)
    write_tensors_and_close(w, hf, GGUF_NAMES, lambda module, a: a)

    llm = LLM(str(path), dtype="float32", max_model_len=128, num_gpu_blocks_override=16)
    assert llm.engine.model_runner.model.args.architecture == "qwen2"
    assert_served_like_transformers(llm, hf, len(VOCAB))
