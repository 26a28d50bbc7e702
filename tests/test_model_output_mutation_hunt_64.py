"""Tests from a mutation pass over the model loader, the model, the sampler and the output processor.

Each test kills one planted bug that every existing test let through, and says which.  The oracles are
independent of the code under test: a request's own ``torch.Generator`` stream and the inverse CDF walked in
double precision, transformers' model on the same checkpoint, and the tokenizer's own ``decode``.
"""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.model.sampler import sample
from minivllm.sampling_params import SamplingParams


def _inverse_cdf(logits: list[float], temperature: float, u: float) -> int:
    """The token a uniform ``u`` picks from ``softmax(logits / temperature)``, walked in double precision."""
    weights = [math.exp(x / temperature) for x in logits]
    target, mass = u * sum(weights), 0.0
    for token, w in enumerate(weights):
        mass += w
        if mass > target:
            return token
    return len(weights) - 1


def test_a_seeded_request_takes_the_next_uniform_of_its_generator_at_every_step():
    """A seeded request keeps one generator for its whole life, so its k-th token is drawn with the k-th uniform
    of that seed's stream.  Mutant killed: the row's generator re-seeded from its seed at every step
    (``torch.Generator().manual_seed(gen.initial_seed())``), which draws the *first* uniform again each time: the
    first token is right, every later one is that same token.  Oracle: a fresh generator with the same seed,
    read six times, and the inverse CDF in plain Python."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(8)) * 0.5  # flat: most u pick new tokens
    params, temperature = [SamplingParams(temperature=0.9, seed=5)], 0.9
    gen = torch.Generator().manual_seed(5)
    got = [sample(logits, params, [gen], torch.Generator().manual_seed(0))[0] for _ in range(6)]
    stream = torch.Generator().manual_seed(5)
    want = [_inverse_cdf(logits[0].double().tolist(), temperature, torch.rand(1, generator=stream).item())
            for _ in range(6)]
    assert got == want
    assert len(set(want)) > 1  # the case tells the steps apart


def test_the_largest_uniform_never_draws_past_the_vocabulary_when_the_float32_total_is_below_one(monkeypatch):
    """The draw scales ``u`` by the cumulative sum's own last value.  In float32 that sum often ends a rounding
    step *below* 1 (0.99999994 for the logits here), and ``torch.rand`` returns up to ``1 - 2**-24``, the same
    number: a target of ``u * 1`` capped just below 1 equals the last cumulative value, and the search then
    answers one past the last token -- token id 6 of a 6-token vocabulary.  Mutant killed: ``total =
    torch.ones_like(cdf[:, -1:])`` (a softmax "sums to one").  Oracle: the inverse CDF in double precision,
    which at the top of the uniform is the last token."""
    import minivllm.model.sampler as sampler

    logits = torch.tensor([[3.1, -0.6, -4.4, 1.1, -2.2, -2.8]])
    assert logits.softmax(-1).cumsum(-1)[0, -1].item() < 1.0  # the case is real in float32
    u = 1.0 - 2.0**-24  # the largest value torch.rand returns
    full = torch.full
    monkeypatch.setattr(sampler.torch, "rand", lambda *shape, **kw: full(shape, u, dtype=kw.get("dtype")))
    for seeded in (None, torch.Generator().manual_seed(1)):
        got = sample(logits, [SamplingParams(temperature=1.0)], [seeded], torch.Generator())
        assert got == [_inverse_cdf(logits[0].double().tolist(), 1.0, u)] == [5], seeded


def test_a_qwen2_config_naming_attention_bias_keeps_o_proj_without_a_bias(tmp_path):
    """Qwen2 puts biases on q, k and v and never on o_proj, whatever its config says: transformers' Qwen2 ignores
    an ``attention_bias`` key, which some exported configs carry.  Mutant killed: ``o_bias`` taken from
    ``attention_bias`` for Qwen2 too (the ``arch != "qwen2"`` guard dropped): the serving model then waits for an
    o_proj bias the checkpoint has not got and the load is refused.  Oracle: transformers' Qwen2 model on the
    same files."""
    transformers = pytest.importorskip("transformers")
    from minivllm.model.loader import load_model
    from tests.test_model_edges import CHUNKS, SMALL, TOKENS, _assert_same, _hf_logits, _paged_logits, _save

    folder = _save(tmp_path, transformers.Qwen2Config(attention_bias=True, **SMALL), transformers.Qwen2ForCausalLM,
                   biases=True)
    net = load_model(str(folder)).model
    attn = net.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    _assert_same(_paged_logits(net, TOKENS, CHUNKS), _hf_logits(folder, transformers.Qwen2ForCausalLM, TOKENS))


def test_a_config_without_num_key_value_heads_is_multi_head_attention(tmp_path):
    """Older hub Llama configs (before grouped-query attention) have no ``num_key_value_heads``: every query head
    has its own K/V head, as transformers' LlamaConfig defaults it.  The generic config the loader prefers has no
    such default, so it must come from :meth:`ModelArgs.from_hf_config`.  Mutant killed: the fallback ``or heads``
    turned into ``or 1`` (one shared K/V head): the K/V projections' shapes no longer fit the checkpoint.  Oracle:
    transformers' model on the same files."""
    import json

    transformers = pytest.importorskip("transformers")
    from minivllm.model.loader import load_model
    from tests.test_model_edges import CHUNKS, SMALL, TOKENS, _assert_same, _hf_logits, _paged_logits, _save

    config = transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": SMALL["num_attention_heads"]})
    folder = _save(tmp_path, config, transformers.LlamaForCausalLM)
    raw = json.loads((folder / "config.json").read_text())
    del raw["num_key_value_heads"]
    (folder / "config.json").write_text(json.dumps(raw))
    net = load_model(str(folder)).model
    assert net.args.num_kv_heads == SMALL["num_attention_heads"]
    _assert_same(_paged_logits(net, TOKENS, CHUNKS), _hf_logits(folder, transformers.LlamaForCausalLM, TOKENS))


def test_a_projection_stored_transposed_is_refused_by_name(tmp_path):
    """A checkpoint that stores a projection as ``[in, out]`` (GPT-2's Conv1D layout) has the right number of
    values in the wrong shape.  The loader must refuse it saying which tensor and which shapes, as it does for any
    other misfit.  Mutant killed: the check compares ``numel()`` instead of the shape, so the tensor reaches
    ``copy_``, which fails with a bare broadcasting RuntimeError that names no tensor.  Oracle: the shapes written
    into the file by hand."""
    from safetensors.torch import load_file, save_file

    transformers = pytest.importorskip("transformers")
    from minivllm.model.loader import load_model
    from tests.test_model_edges import SMALL, _save

    folder = _save(tmp_path, transformers.LlamaConfig(**SMALL), transformers.LlamaForCausalLM)
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    assert state[name].shape == (96, 64)
    state[name] = state[name].t().contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"up_proj\.weight: checkpoint shape \(64, 96\), model expects \(96, 64\)"):
        load_model(str(folder))
