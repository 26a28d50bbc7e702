"""The oneDNN projection path (``linear_backend="onednn"``) against ``F.linear`` and HF transformers.

oneDNN sums in a different order than the default BLAS, so the checks are
"close" for single matmuls and "token-identical" for greedy generation, the
contract every backend keeps.  Tiny random-weight models cover the branches the
bundled model does not take: an untied vocabulary projection (Llama, Mistral),
q/k/v biases with tied embeddings (Qwen2) and per-head q/k norms before RoPE (Qwen3).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.config import EngineConfig
from minivllm.model.backends import onednn_linear_works, resolve_linear_backend
from minivllm.model.llama import linear, onednn_weight

pytestmark = pytest.mark.skipif(not onednn_linear_works(), reason="this torch has no usable oneDNN linear")


@pytest.mark.parametrize("rows", [0, 1, 3, 32, 300])
def test_packed_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    for bias in (None, b):
        torch.testing.assert_close(linear(x, onednn_weight(w), bias), torch.nn.functional.linear(x, w, bias),
                                   rtol=1e-5, atol=1e-4)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))  # a plain weight is plain F.linear


def test_backend_choice_and_bad_values():
    assert resolve_linear_backend("auto", "cpu", torch.float32) == "onednn"
    assert resolve_linear_backend("auto", "cpu", torch.bfloat16) == "torch"
    assert resolve_linear_backend("torch", "cpu", torch.float32) == "torch"
    with pytest.raises(ValueError, match="float32"):
        resolve_linear_backend("onednn", "cpu", torch.bfloat16)
    with pytest.raises(ValueError, match="linear_backend"):
        EngineConfig(linear_backend="mkl")


def _tiny(path, kind: str) -> str:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(1)
    common = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=192,
                  vocab_size=300, num_hidden_layers=2, max_position_embeddings=256)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **common))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(tie_word_embeddings=False, **common))
    elif kind == "qwen3":  # q and k normalised per head before RoPE, so they are rotated one at a time
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(tie_word_embeddings=True, head_dim=16, **common))
        with torch.no_grad():  # the norms start at ones: make their weights count
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1, 0.5)
                layer.self_attn.k_norm.weight.normal_(1, 0.5)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(tie_word_embeddings=True, **common))
        with torch.no_grad():  # random init leaves the q/k/v biases at zero: make them count
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(str(path))
    return str(path)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_tokens_identical_to_hf(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    from minivllm import LLM, SamplingParams

    path = _tiny(tmp_path / kind, kind)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 60)), [7]]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False)
            expected.append(out[0, len(p):].tolist())
    llm = LLM(path, dtype="float32", linear_backend="onednn", max_model_len=128)
    assert llm.engine.model_runner.model.model.layers[0].mlp.gate_up_proj.weight.is_mkldnn
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
