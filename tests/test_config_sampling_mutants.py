"""A mutation pass over configuration and sampling: the bounds, defaults and flags the other tests left loose.

Each test names the planted bug it catches.  Oracles are the documented ranges (module docstrings, vLLM's
``SamplingParams``/``EngineArgs``, OpenAI's ``seed``), hand-computed filters, and the flags typed on the command
line.  No model is loaded.
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

import minivllm
from minivllm.argtypes import comma_list, fraction, port, positive_rate
from minivllm.cli import main as cli_main
from minivllm.config import EngineConfig, TenantConfig, ThreeClassConfig
from minivllm.model.sampler import filter_logits, sample
from minivllm.sampling_params import SamplingParams


# -- sampling parameters ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(seed=1.5), dict(seed=True), dict(output_kind="streaming")])
def test_a_seed_is_an_integer_and_an_output_kind_is_one_of_three(bad):
    """Kills: the seed checked as any real (1.5 reached ``torch.Generator.manual_seed``, True seeded 1) and
    output_kind left unchecked.  Oracle: the documented types (OpenAI's ``seed`` is an integer; vLLM's three
    ``RequestOutputKind`` values)."""
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_sampling_params_cannot_change_after_validation_even_through_the_callers_list():
    """Kills: the dataclass not frozen, and ``stop`` kept as the caller's list (appending to it afterwards
    changed a request the engine already validated).  Oracle: the module's "frozen once validated"."""
    stops = ["\n\n"]
    p = SamplingParams(stop=stops)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 99
    stops.append("x")
    assert p.stop == ("\n\n",) and p.stop_strings == ("\n\n",)
    hash(p)


# -- the sampler -------------------------------------------------------------------------------------------------

def test_min_p_uses_each_rows_own_most_likely_token():
    """Kills: min_p scaled by the batch's largest probability instead of the row's.  Hand-computed: row 0 is
    [0.9, 0.1] (0.1 < 0.5 * 0.9 goes), row 1 is [0.4, 0.3, 0.3] (0.3 >= 0.5 * 0.4 stays; against row 0's 0.9
    both would go)."""
    logits = torch.log(torch.tensor([[0.9, 0.1, 1e-9], [0.4, 0.3, 0.3]]))
    out = filter_logits(logits, torch.tensor([0, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.5, 0.5]))
    assert torch.isfinite(out).tolist() == [[True, False, False], [True, True, True]]


def test_top_k_of_one_alone_samples_only_the_top_token():
    """Kills: the filters skipped when the only filter asked for is top_k=1.  Oracle: top_k=1 keeps one token,
    the most likely, so every draw at temperature 1 is the argmax."""
    logits = torch.tensor([[0.0, 0.5, 0.4, 0.3]] * 200)
    tokens = sample(logits, [SamplingParams(temperature=1.0, top_k=1)] * 200, [None] * 200, torch.Generator().manual_seed(0))
    assert set(tokens) == {1}


# -- engine configuration ----------------------------------------------------------------------------------------

def test_model_dependent_defaults_follow_vllm():
    """Kills: the no-chunking default budget as min(2048, max_model_len) (vLLM: the max, so a whole prompt
    fits), and the running set not capped by the budget with chunking on (the class docstring's
    ``min(max_num_seqs, max_num_batched_tokens)``)."""
    assert EngineConfig(device="cpu", enable_chunked_prefill=False).resolve(8192).max_num_batched_tokens == 8192
    assert EngineConfig(device="cpu", enable_chunked_prefill=False).resolve(512).max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu").resolve(8192).max_num_batched_tokens == 2048
    assert EngineConfig(device="cpu", max_num_batched_tokens=64).resolve(1024).max_num_seqs == 64
    assert EngineConfig(device="cpu", max_num_batched_tokens=1024, enable_chunked_prefill=False).resolve(1024).max_num_seqs == 256


def test_the_three_class_preset_keeps_what_the_caller_set():
    """Kills: the preset overwriting an explicit preemption mode or long-prefill threshold.  Oracle: the
    ThreeClassConfig docstring ("an explicit value of that option above 0 wins", "an explicit swap or reject is
    kept")."""
    plain = EngineConfig(device="cpu", scheduling_policy="three_class").resolve(16384)
    assert (plain.preemption_mode, plain.long_prefill_token_threshold, plain.enable_prefix_caching) == ("auto", 8192, True)
    mine = EngineConfig(device="cpu", scheduling_policy="three_class", preemption_mode="swap",
                        long_prefill_token_threshold=512).resolve(16384)
    assert (mine.preemption_mode, mine.long_prefill_token_threshold) == ("swap", 512)


def test_kv_capacity_counts_a_partial_block():
    """Kills: the blocks one max-length request needs counted by floor division.  Hand-computed: 17 tokens in
    blocks of 16 need 2 blocks, so 1 is refused and 2 is enough."""
    cfg = EngineConfig(device="cpu", max_model_len=17).resolve(64)
    with pytest.raises(ValueError, match="2 blocks"):
        cfg.check_kv_capacity(1)
    cfg.check_kv_capacity(2)


@pytest.mark.parametrize("make", [
    lambda: TenantConfig(weight=0),
    lambda: ThreeClassConfig(interactive_kv_reserve=1.0),
    lambda: ThreeClassConfig(swap_min_tokens=0),
    lambda: ThreeClassConfig(swap_min_tokens=True),
    lambda: EngineConfig(device="cpu", gpu_memory_utilization=0),
    lambda: EngineConfig(device="cpu", swap_space=1024),
    lambda: EngineConfig(device="cpu", enable_chunked_prefill=False, max_num_batched_tokens=4096,
                         tenants={"a": TenantConfig(max_tokens_per_step=100)}).resolve(4096),
], ids=["weight 0", "reserve 1", "swap_min_tokens 0", "swap_min_tokens True", "gpu util 0", "swap 1024 GiB",
        "tenant step cap below max_model_len without chunking"])
def test_config_bounds_refuse_the_value_just_outside(make):
    """Kills: each bound moved onto its edge or dropped.  Oracle: the ranges the docstrings and messages state
    (weight > 0, reserve in [0, 1), counts >= 1, utilisation in (0, 1], swap space in [0, 1024) GiB, and a
    per-step cap that a whole prompt must fit when chunking is off)."""
    with pytest.raises(ValueError):
        make()


def test_config_bounds_accept_the_value_just_inside():
    """Kills: a share of exactly 1 refused (``(0, 1]`` includes 1), and the matching edges of the test above."""
    TenantConfig(weight=1e-9, max_kv_share=1.0, max_cache_share=1.0)
    ThreeClassConfig(agent_kv_share=1.0, interactive_kv_reserve=0.0, swap_min_tokens=1)
    EngineConfig(device="cpu", gpu_memory_utilization=1.0, swap_space=0)


def test_engine_config_is_frozen():
    """Kills: EngineConfig mutable (the module's "never changes afterwards"; resolve returns a new one)."""
    cfg = EngineConfig(device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.max_num_seqs = 1


# -- argument types and the command line -------------------------------------------------------------------------

def test_argument_types_at_their_edges():
    """Kills: a rate of 0 accepted (positive_rate says > 0), a fraction of 0 accepted ((0, 1]), port 65535
    refused (TCP ports are 0-65535), a list with an empty item accepted."""
    for fn, bad in ((positive_rate, "0"), (fraction, "0"), (port, "65536"), (comma_list(int), "1,,2")):
        with pytest.raises(argparse.ArgumentTypeError):
            fn(bad)
    assert positive_rate("inf") == float("inf") and fraction("1") == 1.0 and port("65535") == 65535


class _Reached(Exception):
    pass


def test_cli_flags_reach_the_engine_as_typed(monkeypatch, capsys):
    """Kills: ``--seed`` dropped by ``generate``, ``--top-k`` parsed as a float (a valid value then refused),
    ``--max-model-len`` dropped by ``serve`` and ``--max-num-seqs 0`` let past argparse.  Oracle: the flags
    typed.  The engine is a stub that records what it was given and stops there."""
    seen = {}

    def fake_llm(model, **options):
        seen["options"] = options
        raise _Reached

    real_params = minivllm.SamplingParams

    def record_params(**kw):
        seen["params"] = real_params(**kw)
        return seen["params"]

    monkeypatch.setattr(minivllm, "LLM", fake_llm)
    monkeypatch.setattr(minivllm, "SamplingParams", record_params)
    with pytest.raises(_Reached):
        cli_main(["generate", "hi", "--seed", "42", "--top-k", "5", "--temperature", "0.7"])
    p = seen["params"]
    assert (p.seed, p.top_k, p.temperature) == (42, 5, 0.7)
    pytest.importorskip("uvicorn")
    monkeypatch.delenv("MINIVLLM_API_KEYS", raising=False)
    with pytest.raises(_Reached):
        cli_main(["serve", "--max-model-len", "1024", "--max-num-seqs", "8", "--block-size", "32"])
    assert seen["options"] == {"max_model_len": 1024, "max_num_seqs": 8, "block_size": 32}
    with pytest.raises(SystemExit) as exc:
        cli_main(["serve", "--max-num-seqs", "0"])
    assert exc.value.code == 2 and "argument --max-num-seqs" in capsys.readouterr().err
