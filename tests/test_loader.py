"""The loader's memory-saving paths against what transformers would have built.

The loader reads configs with transformers' generic config class (not the
model-specific one, whose import drags in torch._dynamo), copies checkpoint
tensors straight into stacked q/k/v and gate/up projections, and leaves a tied
embedding table as a map of the file.  Each shortcut is checked against the
long way round: ``AutoConfig`` and HF's own rotary embedding for the config,
HF's module weights for the stacking, and ``/proc/self/maps`` for the map.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from minivllm.model.llama import LlamaForServing, ModelArgs, RotaryEmbedding, _rotate
from minivllm.model.loader import load_model, read_config

transformers = pytest.importorskip("transformers")

COMMON = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, intermediate_size=192,
              vocab_size=300, num_hidden_layers=2, max_position_embeddings=512)


def _save(path, config, cls=transformers.LlamaForCausalLM):
    torch.manual_seed(3)
    cls(config).save_pretrained(str(path))
    return path


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                         "rope_theta": 500000.0},
                                  # YaRN (Qwen2.5 / Qwen3 long-context configs) also scales cos and sin by its
                                  # attention factor, which neither of the others has (it is 1 for them)
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                   "rope_theta": 10000.0}])
def test_generic_config_reads_like_autoconfig(tmp_path, rope):
    kwargs = dict(COMMON, rope_parameters=rope) if rope else dict(COMMON)
    folder = _save(tmp_path, transformers.LlamaConfig(**kwargs))
    light, auto = read_config(folder), transformers.AutoConfig.from_pretrained(str(folder))
    assert type(light) is not type(auto)  # the shortcut was taken
    assert light.rope_parameters["rope_type"] == (rope or {}).get("rope_type", "default")
    assert ModelArgs.from_hf_config(light) == ModelArgs.from_hf_config(auto)
    ours = RotaryEmbedding(light, 16, 512)
    # HF's own rotary module is the oracle for the frequencies (and Llama 3's scaling of them)
    hf_rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(auto)
    positions = torch.arange(512)[None]
    cos, sin = hf_rope(torch.zeros(1, 512, 16), positions)
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin[0], rtol=1e-5, atol=1e-5)


# Scaling schemes whose tables transformers recomputes from the sequence's length as it runs: one fixed table
# must equal HF's for every sequence the engine lets through, the longest included.
@pytest.mark.parametrize("rope", [{"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
                                  {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                   "original_max_position_embeddings": 128, "rope_theta": 10000.0}])
def test_rope_tables_equal_transformers_over_every_servable_length(rope):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = transformers.LlamaConfig(**dict(COMMON, rope_parameters=rope))
    args = ModelArgs.from_hf_config(config)
    servable = args.max_position_embeddings
    ours = RotaryEmbedding(config, args.head_dim, servable)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, servable, args.head_dim), torch.arange(servable)[None])
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.sin, sin[0], rtol=1e-5, atol=1e-5)


def test_longrope_with_phi3_style_top_level_original_length_bounds_the_servable_length(tmp_path):
    """Phi-3's layout: ``rope_scaling`` without the original length, which sits at the top level of config.json.
    transformers switches to the long factors past that top-level value, though the config's ``rope_parameters``
    read 512 (max_position_embeddings) until its RoPE initialiser first ran."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    raw = dict(COMMON, model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0,
               original_max_position_embeddings=128,
               rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    args = ModelArgs.from_hf_config(read_config(tmp_path))
    servable = args.max_position_embeddings
    assert servable == 128
    config = read_config(tmp_path)
    ours = RotaryEmbedding(config, args.head_dim, servable)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, servable, args.head_dim), torch.arange(servable)[None])
    torch.testing.assert_close(ours.cos, cos[0], rtol=1e-5, atol=1e-5)
    # one position further and transformers' table is the long factors' (so the bound is not merely cautious)
    cos, _ = LlamaRotaryEmbedding(config)(torch.zeros(1, servable + 1, args.head_dim), torch.arange(servable + 1)[None])
    assert not torch.allclose(RotaryEmbedding(config, args.head_dim, servable + 1).cos, cos[0], atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_is_bit_for_bit_the_rotate_half_formula(dtype):
    """The serving rotation (halves flipped, sign folded into sin, q and k as one tensor of heads) vs HF's own
    ``apply_rotary_pos_emb`` written out on q and k separately: equal to the last bit, not merely close."""
    from transformers.models.llama.modeling_llama import rotate_half

    rope = RotaryEmbedding(transformers.LlamaConfig(**COMMON), 16, 512)
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 512, (37,), generator=g)
    q, k = torch.randn(37, 6, 16, generator=g).to(dtype), torch.randn(37, 2, 16, generator=g).to(dtype)
    cos, signed_sin = rope(positions)
    both = _rotate(torch.cat([q, k], dim=1), cos, signed_sin)
    sin = rope.sin[positions].unsqueeze(1)
    for x, got in ((q, both[:, :6]), (k, both[:, 6:])):
        want = (x.float() * cos + rotate_half(x).float() * sin).to(dtype)
        assert torch.equal(got, want)


def test_incomplete_config_goes_through_autoconfig(tmp_path):
    folder = _save(tmp_path, transformers.LlamaConfig(**COMMON))
    raw = json.loads((folder / "config.json").read_text())
    del raw["rms_norm_eps"]  # left to LlamaConfig's default
    (folder / "config.json").write_text(json.dumps(raw))
    config = read_config(folder)
    assert type(config).__name__ == "LlamaConfig" and config.rms_norm_eps == 1e-6


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_stacked_projections_hold_the_checkpoint_rows(tmp_path, kind):
    if kind == "llama":
        config, cls = transformers.LlamaConfig(**COMMON), transformers.LlamaForCausalLM
    else:
        config, cls = transformers.Qwen2Config(**COMMON), transformers.Qwen2ForCausalLM
    folder = _save(tmp_path, config, cls)
    hf = cls.from_pretrained(str(folder))
    ours = load_model(str(folder)).model
    for hf_layer, layer in zip(hf.model.layers, ours.model.layers):
        a, m = hf_layer.self_attn, hf_layer.mlp
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([m.gate_proj.weight, m.up_proj.weight]))
        if kind == "qwen2":
            assert torch.equal(layer.self_attn.qkv_proj.bias, torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))


def test_a_checkpoint_missing_part_of_a_stack_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _save(tmp_path, transformers.LlamaConfig(**COMMON))
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.self_attn.v_proj.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"qkv_proj.weight\[2\]"):
        load_model(str(folder))


def test_a_checkpoint_of_the_wrong_shape_is_refused(tmp_path):
    folder = _save(tmp_path, transformers.LlamaConfig(**COMMON))
    raw = json.loads((folder / "config.json").read_text())
    raw["intermediate_size"] = 200
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="shape"):
        load_model(str(folder))


@pytest.mark.parametrize("tied", [False, True])
def test_every_checkpoint_tensor_has_one_slot(tied):
    config = transformers.LlamaConfig(tie_word_embeddings=tied, **COMMON)
    hf_names = set(transformers.LlamaForCausalLM(config).state_dict()) - ({"lm_head.weight"} if tied else set())
    slots = LlamaForServing(ModelArgs.from_hf_config(config), config).weight_slots()
    assert len(slots) == len(hf_names)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_serving_the_default_model_imports_no_model_classes_and_maps_the_embedding(default_model_dir):
    code = """
import sys
from minivllm import LLM
llm = LLM(dtype="float32", max_model_len=256, num_gpu_blocks_override=16, linear_backend="onednn")
print(llm.generate(["hi"], use_tqdm=False)[0].outputs[0].token_ids[:1] != [])
ptr = llm.engine.model_runner.model.model.embed_tokens.weight.data_ptr()
backing = None
for line in open("/proc/self/maps"):
    fields = line.split()
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    if lo <= ptr < hi:
        backing = fields[5] if len(fields) > 5 else ""
print("torch._dynamo" in sys.modules, "transformers.models.llama.configuration_llama" in sys.modules)
print(backing)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    generated, imports, backing = out.stdout.strip().splitlines()[-3:]
    assert generated == "True"
    assert imports == "False False", "loading imported transformers' model classes (150 MB of torch._dynamo)"
    assert backing.endswith("model.safetensors"), f"the tied embedding is not a map of the file: {backing!r}"


def test_generic_tokenizer_encodes_like_autotokenizer(default_model_dir):
    from minivllm.model.loader import load_tokenizer

    ours, auto = load_tokenizer(default_model_dir), transformers.AutoTokenizer.from_pretrained(str(default_model_dir))
    texts = ["Hello, world!", "  paged attention\tblocks\n\nüñí 日本語 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        assert ours(text)["input_ids"] == auto(text)["input_ids"]
        ids = auto(text)["input_ids"]
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "What is a KV cache?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert (ours.eos_token_id, ours.pad_token_id, ours.bos_token_id) == (auto.eos_token_id, auto.pad_token_id, auto.bos_token_id)


def test_a_checkpoint_with_saved_rotary_inv_freq_buffers_loads_and_serves_like_transformers(tmp_path):
    """transformers before 4.31 saved each layer's ``rotary_emb.inv_freq`` buffer with the weights, so
    checkpoints of that era carry one tensor per layer that is no weight: the frequencies follow from the
    config.  The loader skips them; treated as unexpected tensors they made the whole checkpoint refused.
    Oracle: transformers' greedy tokens for the same weights (read before the buffers were added)."""
    from safetensors.torch import load_file, save_file

    from minivllm import LLM
    from minivllm.sampling_params import SamplingParams
    from tests.paged_cases import make_tiny_llama

    make_tiny_llama(tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    weights = tmp_path / "model.safetensors"
    state = load_file(str(weights))
    for layer in range(hf.config.num_hidden_layers):
        state[f"model.layers.{layer}.self_attn.rotary_emb.inv_freq"] = torch.rand(16)  # any values: ignored
    save_file(state, str(weights), metadata={"format": "pt"})

    prompt = [5, 9, 2, 33, 17, 8, 40]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, num_gpu_blocks_override=16)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want


def test_a_tied_bfloat16_checkpoint_served_in_float32_on_onednn_keeps_a_float32_embedding(tmp_path):
    """With ``linear_backend="onednn"`` the tied embedding becomes a map of the file -- only when the file holds
    it in the serving dtype.  Most hub checkpoints are stored in bfloat16; mapped anyway, the lookup would feed
    bfloat16 rows into a float32 model, whose first RMSNorm then rounds to bfloat16 (mutant: the dtype check
    dropped; the tokens of a short greedy run still agree, the logits do not).  Oracle: transformers' logits
    and greedy tokens for the same checkpoint read in float32."""
    from tests.test_gguf_rope_freqs import _teacher_forced_logits
    from minivllm import LLM
    from minivllm.model.backends import onednn_linear_works
    from minivllm.sampling_params import SamplingParams

    if not onednn_linear_works():
        pytest.skip("this torch has no working oneDNN linear")
    config = transformers.LlamaConfig(tie_word_embeddings=True, **COMMON)
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(str(tmp_path))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    prompt = [5, 9, 2, 33, 17, 8, 40]
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=64, num_gpu_blocks_override=16, linear_backend="onednn")
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    got = _teacher_forced_logits(llm, prompt)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want


def _conversion(folder, marker: str):
    folder.mkdir()
    (folder / "model.safetensors").write_text(marker)
    (folder / "config.json").write_text("{}")
    return folder


def test_a_finished_conversion_moves_into_place_once_and_leaves_no_copy_behind(tmp_path):
    """Two processes converting one GGUF: the first rename wins, and the loser's folder (half a gigabyte with the
    default model) is removed, not left beside it.  A folder without weights at the target is no conversion."""
    from minivllm.model.loader import _move_into_place

    out = tmp_path / "model"
    _move_into_place(_conversion(tmp_path / "model.tmp1", "first"), out)
    assert (out / "model.safetensors").read_text() == "first"
    _move_into_place(_conversion(tmp_path / "model.tmp2", "second"), out)  # the other process finished later
    assert (out / "model.safetensors").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

    (out / "model.safetensors").unlink()  # what is left when weights are missing: not a finished conversion
    _move_into_place(_conversion(tmp_path / "model.tmp3", "third"), out)
    assert (out / "model.safetensors").read_text() == "third"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_conversion_killed_part_way_leaves_no_folder_behind_for_long(tmp_path):
    """A ``.tmp<pid>`` folder whose process is gone is removed at the next load; one whose process is alive (another
    conversion at work) is kept.  By hand: a finished child's pid is dead, this test's own pid is alive."""
    if os.name != "posix":
        pytest.skip("the liveness test is POSIX's")
    from minivllm.model.loader import _remove_abandoned

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)
    out = tmp_path / "model"
    for pid in (dead, os.getpid()):
        (tmp_path / f"model.tmp{pid}").mkdir()
        (tmp_path / f"model.tmp{pid}" / "model.safetensors").write_text("half")
    (tmp_path / "model.tmpx").mkdir()  # not a pid: not ours to judge
    _remove_abandoned(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"model.tmp{os.getpid()}", "model.tmpx"])
