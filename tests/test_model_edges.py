"""Checkpoints and attention states the bundled model never exercises, each against an independent oracle.

The default model is one shape (SmolLM2: tied embeddings, no biases, no rope scaling, block 16).  A reader who
points the engine at another hub checkpoint meets config formats and options it does not have; a reader who
changes ``block_size`` or the dtype takes the attention down other paths.  Each test below was written for a
bug found there: the oracle is HF transformers' own model on the same files, or attention written out densely
over each sequence's own keys.
"""

from __future__ import annotations

import json

import pytest
import torch

from minivllm.model.attention import AttentionMetadata, TorchAttentionBackend
from minivllm.model.cpu_attention import CpuAttentionBackend
from minivllm.model.loader import load_model

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _save(folder, config, cls, biases=False):
    """Random weights with non-trivial norms (and biases), saved where both HF and the loader read them."""
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and biases:
                p.uniform_(-0.5, 0.5)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder))
    return folder


def _paged_logits(net, tokens, chunks, block_size=4, num_blocks=64):
    """Logits for every position, fed through the serving model in ``chunks`` over a shuffled block table, so
    chunks start mid-block and a chunk of 1 takes the decode path."""
    a = net.args
    cache = [(torch.zeros(num_blocks, block_size, a.num_kv_heads, a.head_dim),
              torch.zeros(num_blocks, block_size, a.num_kv_heads, a.head_dim)) for _ in range(a.num_layers)]
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))[: -(-len(tokens) // block_size)]
    out, done = [], 0
    for q in chunks:
        pos = list(range(done, done + q))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([int(table[p // block_size]) * block_size + p % block_size for p in pos]),
            query_start_loc=torch.tensor([0, q], dtype=torch.int32), seq_lens=torch.tensor([done + q], dtype=torch.int32),
            block_tables=table[None].to(torch.int32), num_decodes=int(q == 1), query_lens=[q], context_lens=[done])
        with torch.inference_mode():
            out.append(net.logits(net(torch.tensor(tokens[done:done + q]), torch.tensor(pos), cache, meta)))
        done += q
    return torch.cat(out)


def _hf_logits(folder, cls, tokens):
    hf = cls.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0]


def _assert_same(got, want):
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-4


TOKENS = torch.randint(0, 128, (21,), generator=torch.Generator().manual_seed(2)).tolist()
CHUNKS = [9, 1, 11]


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"type": "linear", "factor": 4.0},  # the older key for the rope type (this one always loaded)
])
def test_a_transformers4_config_with_rope_scaling_loads_and_matches_hf(tmp_path, scaling):
    """Most hub Llama-3 checkpoints ship ``rope_theta`` and ``rope_scaling`` at the top level (the format before
    transformers 5).  The generic config class the loader prefers failed on Llama 3's scaling, so such a model
    was refused."""
    folder = _save(tmp_path, transformers.LlamaConfig(**SMALL), transformers.LlamaForCausalLM)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=500000.0, rope_scaling=scaling)
    (folder / "config.json").write_text(json.dumps(raw))
    net = load_model(str(folder)).model
    _assert_same(_paged_logits(net, TOKENS, CHUNKS), _hf_logits(folder, transformers.LlamaForCausalLM, TOKENS))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_covers_the_output_projection_too(tmp_path, arch):
    """HF's ``attention_bias`` puts a bias on q, k, v *and* o; the loader refused the o bias it had no slot for."""
    if arch == "llama":
        config, cls = transformers.LlamaConfig(attention_bias=True, **SMALL), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen3Config(attention_bias=True, head_dim=16, **SMALL), transformers.Qwen3ForCausalLM
    folder = _save(tmp_path, config, cls, biases=True)
    net = load_model(str(folder)).model
    assert net.model.layers[0].self_attn.o_proj.bias is not None
    _assert_same(_paged_logits(net, TOKENS, CHUNKS), _hf_logits(folder, cls, TOKENS))


def test_a_config_that_leaves_tie_word_embeddings_to_its_default_keeps_its_own_lm_head(tmp_path):
    """Older hub Llama configs omit ``tie_word_embeddings``; Llama's (and Qwen's, Mistral's) default is False.
    Such a file is complete enough for the generic config the loader prefers, which has no such attribute at
    all, so the model's own default must come from :meth:`ModelArgs.from_hf_config`: tying there would drop the
    checkpoint's ``lm_head`` and project with the embedding (mutant: ``getattr(config, "tie_word_embeddings",
    True)``).  Oracle: transformers' model on the same files."""
    config = transformers.LlamaConfig(tie_word_embeddings=False, **SMALL)
    folder = _save(tmp_path, config, transformers.LlamaForCausalLM)
    raw = json.loads((folder / "config.json").read_text())
    del raw["tie_word_embeddings"]
    (folder / "config.json").write_text(json.dumps(raw))
    net = load_model(str(folder)).model
    assert not net.args.tie_word_embeddings
    _assert_same(_paged_logits(net, TOKENS, CHUNKS), _hf_logits(folder, transformers.LlamaForCausalLM, TOKENS))


def test_a_sliding_window_bounds_the_servable_length(tmp_path):
    """Sliding-window attention is not implemented.  Full attention equals it while a sequence fits in the
    window, so the window caps the model's positions (the engine then refuses a longer ``max_model_len``);
    before, a Mistral config was served past its window with full attention, silently wrong."""
    from minivllm import LLM

    config = transformers.MistralConfig(sliding_window=8, **SMALL)
    config._attn_implementation = "eager"
    folder = _save(tmp_path, config, transformers.MistralForCausalLM)
    net = load_model(str(folder)).model
    assert net.args.max_position_embeddings == 8
    _assert_same(_paged_logits(net, TOKENS[:8], [5, 1, 2]), _hf_logits(folder, transformers.MistralForCausalLM,
                                                                        TOKENS[:8]))
    with pytest.raises(ValueError, match="max_model_len=16"):
        LLM(model=str(folder), max_model_len=16)


@pytest.mark.parametrize("config", [
    transformers.MistralConfig(sliding_window=None, **SMALL),
    transformers.Qwen2Config(sliding_window=8, use_sliding_window=False, **SMALL),
], ids=["mistral-no-window", "qwen2-window-off"])
def test_no_window_no_cap(config):
    from minivllm.model.llama import ModelArgs

    assert ModelArgs.from_hf_config(config).max_position_embeddings == 128


def _dense(q, k_cache, v_cache, blocks, length, scale):
    """One decode query against its own ``length`` keys only, in float64: no padding ever enters."""
    bs = k_cache.shape[1]
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(length)])
    k = k_cache.flatten(0, 1)[slots].double()
    v = v_cache.flatten(0, 1)[slots].double()
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    probs = (torch.einsum("hd,khd->hk", q.double(), k) * scale).softmax(-1)
    return torch.einsum("hk,khd->hd", probs, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_non_finite_value_in_another_requests_block_stays_there(dtype):
    """The torch decode path gathers whole padded block tables (padding is block 0, some other request's) and
    masks the scores.  Probability 0 times an inf in that V is NaN, so one overflow anywhere turned every
    shorter request in the batch into NaN.  The CPU backend takes this path for any dtype but fp32."""
    bs, hk, hq, d = 4, 2, 4, 8
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(16, bs, hk, d, generator=gen), torch.randn(16, bs, hk, d, generator=gen)
    v_cache[0, 1, 0, 3] = float("inf")  # block 0 is another request's; its V overflowed
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([5 * bs + 1, 8 * bs]), query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32),
        seq_lens=torch.tensor([2, 9], dtype=torch.int32), block_tables=torch.tensor([[5, 0, 0], [6, 7, 8]],
                                                                                    dtype=torch.int32),
        num_decodes=2, query_lens=[1, 1], context_lens=[1, 8])
    q = torch.randn(2, hq, d, generator=gen).to(dtype)
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    got = TorchAttentionBackend().attend(q, kc, vc, meta, d ** -0.5)
    want = _dense(q[0], kc, vc, [5], 2, d ** -0.5)
    assert torch.isfinite(got[0]).all()
    torch.testing.assert_close(got[0].double(), want, rtol=2e-2, atol=2e-2)


def test_a_block_beyond_the_c_kernels_limit_takes_the_torch_path():
    """``block_size`` need only be a power of two, but the C decode kernel holds at most 256 slots of a block:
    with 512 every decode step raised.  The backend now hands such shapes to the torch path."""
    bs, hk, hq, d = 512, 2, 4, 16
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, bs, hk, d, generator=gen), torch.randn(2, bs, hk, d, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([bs + 5]), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens=torch.tensor([6], dtype=torch.int32), block_tables=torch.tensor([[1]], dtype=torch.int32),
        num_decodes=1, query_lens=[1], context_lens=[5])
    q = torch.randn(1, hq, d, generator=gen)
    got = CpuAttentionBackend().attend(q, k_cache, v_cache, meta, d ** -0.5)
    torch.testing.assert_close(got[0].double(), _dense(q[0], k_cache, v_cache, [1], 6, d ** -0.5), rtol=1e-5,
                               atol=1e-5)
