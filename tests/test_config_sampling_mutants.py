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
from minivllm.argtypes import comma_list, fraction, nonnegative_float, nonnegative_int, port, positive_rate
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


def _generate_stubbed(monkeypatch, argv: list[str]) -> dict:
    """Run ``minivllm generate`` with the engine stubbed: it records the model, the engine options and the
    sampling params it was given, then stops (``_Reached``).  The stub stays in place for the rest of the test
    (``serve`` builds its engine through it too), filling the same dict."""
    seen = {}

    def fake_llm(model, **options):
        seen["model"], seen["options"] = model, options
        raise _Reached

    real_params = minivllm.SamplingParams

    def record_params(**kw):
        seen["params"] = real_params(**kw)
        return seen["params"]

    monkeypatch.setattr(minivllm, "LLM", fake_llm)
    monkeypatch.setattr(minivllm, "SamplingParams", record_params)
    with pytest.raises(_Reached):
        cli_main(argv)
    return seen


def test_cli_flags_reach_the_engine_as_typed(monkeypatch, capsys):
    """Kills: ``--seed`` dropped by ``generate``, ``--top-k`` parsed as a float (a valid value then refused),
    ``--max-model-len`` dropped by ``serve`` and ``--max-num-seqs 0`` let past argparse.  Oracle: the flags
    typed.  The engine is a stub that records what it was given and stops there."""
    seen = _generate_stubbed(monkeypatch, ["generate", "hi", "--seed", "42", "--top-k", "5", "--temperature", "0.7"])
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


# -- a second pass: edges accepted, defaults as documented, every flag wired -------------------------------------

def test_sampling_defaults_are_the_documented_ones():
    """Kills: ``max_tokens`` defaulting to 17 and ``output_kind`` to ``"delta"`` (nothing else noticed either).
    Oracle: the module docstring ("defaults follow vLLM's ``SamplingParams``: temperature=1.0, top_p=1.0 ...
    max_tokens=16"), vLLM's defaults for the rest (n=1, min_p=0, no seed, eos honoured, special tokens skipped,
    the stop string left out), and ``OUTPUT_KINDS``' "``cumulative`` (default)"."""
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.min_p, p.seed, p.max_tokens) == (1, 1.0, 1.0, 0.0, None, 16)
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output) == (False, True, False)
    assert p.output_kind == "cumulative" and p.stop_strings == () and p.stop_token_ids == ()


def test_sampling_bounds_accept_their_edges_and_name_the_field_just_past_them():
    """Kills: ``n=128`` refused (the README: "``n`` is capped at 128"), a seed of 2**63 accepted and a negative
    ``min_p`` accepted.  Oracle: the documented ranges -- seed in [0, 2**63) as the error says, ``min_p`` in
    [0, 1] as in vLLM -- each value at the edge accepted, the one just past it a ``ValueError`` naming the field."""
    edge = SamplingParams(n=128, min_p=1.0, seed=2**63 - 1, top_k=0, stop_token_ids=[0])
    assert (edge.n, edge.seed) == (128, 2**63 - 1)
    for field_name, bad in (("n", 129), ("seed", 2**63), ("min_p", -0.01)):
        with pytest.raises(ValueError, match=field_name):
            SamplingParams(**{field_name: bad})


@pytest.mark.parametrize("field_name,bad", [("seed", -1), ("seed", 2**63), ("preemption_protect_after", -1),
                                            ("stall_timeout_s", float("inf"))])
def test_engine_options_just_past_their_range_are_refused_by_name(field_name, bad):
    """Kills: the engine seed's lower and upper bounds dropped (``torch.manual_seed(-1)`` takes it, silently a
    different seed), ``preemption_protect_after=-1`` accepted (every request protected: anti-thrash off in
    disguise) and an infinite stall timeout accepted.  Oracle: the ranges the errors state -- seed in [0, 2**63),
    a count >= 0, a finite number of seconds (``None`` is the documented "no watchdog")."""
    with pytest.raises(ValueError, match=field_name):
        EngineConfig(device="cpu", **{field_name: bad})


def test_engine_options_at_their_edges_are_accepted_with_the_documented_defaults():
    """Kills: a stall timeout of 0 refused (the class docstring: 0 fails a deadlock at once; ``minivllm serve
    --stall-timeout-s 0`` passes argparse), and the defaults the README states changed: the watchdog's 10 s,
    ``preemption_protect_after`` (3), ``preemption_mode`` ``"recompute"`` (default), prefix caching off
    ("minivllm's is off"), chunked prefill on (the docs' budget of 2,048 applies with it)."""
    EngineConfig(device="cpu", seed=0, stall_timeout_s=0, preemption_protect_after=0)
    EngineConfig(device="cpu", seed=2**63 - 1, stall_timeout_s=None)
    cfg = EngineConfig(device="cpu")
    assert (cfg.stall_timeout_s, cfg.preemption_protect_after, cfg.preemption_mode) == (10.0, 3, "recompute")
    assert (cfg.enable_prefix_caching, cfg.enable_chunked_prefill) == (False, True)


def test_max_model_len_may_reach_the_models_positions_and_not_one_past():
    """Kills: one position past the model accepted (``>`` moved by one).  Oracle: the README ("``max_model_len``
    beyond the model's trained positions is refused, not silently extended"): 8,192 of 8,192 is fine, 8,193 not."""
    assert EngineConfig(device="cpu", max_model_len=8192).resolve(8192).max_model_len == 8192
    with pytest.raises(ValueError, match="max_model_len=8193"):
        EngineConfig(device="cpu", max_model_len=8193).resolve(8192)


def test_nonnegative_argument_types_take_zero():
    """Kills: ``nonnegative_float`` refusing 0 (``minivllm bench serve --temperature 0``, greedy and the flag's own
    default, was refused when typed).  Oracle: the docstring, "a finite number >= 0"; just below and a non-finite
    value are still errors."""
    assert nonnegative_float("0") == 0.0 and nonnegative_int("0") == 0
    for bad in ("-0.5", "inf", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            nonnegative_float(bad)
    assert port("0") == 0  # the docstring's "0: any free port"
    with pytest.raises(argparse.ArgumentTypeError):
        port("-1")


def test_every_generate_flag_reaches_the_engine_or_the_sampling_params(monkeypatch):
    """Kills: each of ``generate``'s flags dropped on its way (``--top-p``, ``--max-tokens``, ``--temperature``,
    ``--dtype``, ``--block-size``, ``--max-num-batched-tokens``, ``--attention-backend``, ``--linear-backend``):
    the flag parsed, then the engine's default used.  Oracle: the values typed.  The engine is a stub."""
    seen = _generate_stubbed(monkeypatch, [
        "generate", "hi", "--model", "m", "--max-tokens", "7", "--temperature", "0.5", "--top-p", "0.9",
        "--dtype", "float16", "--block-size", "32", "--max-num-batched-tokens", "512",
        "--attention-backend", "torch", "--linear-backend", "torch"])
    p = seen["params"]
    assert (p.max_tokens, p.temperature, p.top_p) == (7, 0.5, 0.9)
    assert seen["model"] == "m"
    assert seen["options"] == {"dtype": "float16", "block_size": 32, "max_num_batched_tokens": 512,
                               "attention_backend": "torch", "linear_backend": "torch"}


class _Engine:
    """Just enough of an engine for ``generate`` to hand it its first prompt."""

    def __init__(self, seen):
        self.seen = seen

    def add_request(self, source, params):
        self.seen["source"] = source
        raise _Reached


class _LLM:
    tokenizer = object()

    def __init__(self, seen):
        self.engine = _Engine(seen)

    def chat_prompt(self, conversation):
        return {"chat": conversation}


@pytest.mark.parametrize("flags,source", [([], {"chat": [{"role": "user", "content": "hi"}]}), (["--no-chat"], "hi")])
def test_generate_sends_the_chat_template_unless_no_chat(monkeypatch, flags, source):
    """Kills: ``--no-chat`` read the wrong way round.  Oracle: its help, "send prompts raw, without the chat
    template": with it the prompt string itself is sent, without it the one-message conversation."""
    seen = {}
    monkeypatch.setattr(minivllm, "LLM", lambda model, **options: _LLM(seen))
    with pytest.raises(_Reached):
        cli_main(["generate", "hi", *flags])
    assert seen["source"] == source


def test_every_serve_flag_reaches_the_engine_options(monkeypatch):
    """Kills: each engine flag of ``minivllm serve`` dropped from the options it builds (``--preemption-mode``,
    ``--num-gpu-blocks-override``, ``--dtype``, the backends, ``--stall-timeout-s``, ``--scheduling-policy``,
    ``--max-num-batched-tokens``, ``--enable-prefix-caching``) and ``--stall-timeout-s off`` passed on as ``inf``
    instead of the engine's ``None`` (which ``EngineConfig`` refuses).  Oracle: the flags typed, and the README's
    "``--stall-timeout-s SECONDS``, or ``off``; ``None`` in Python"; no flag at all leaves every engine default."""
    pytest.importorskip("uvicorn")
    from minivllm.cli import _parser, serve_options

    monkeypatch.delenv("MINIVLLM_API_KEYS", raising=False)
    argv = ["serve", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", "--max-model-len", "512",
            "--block-size", "32", "--enable-prefix-caching", "--preemption-mode", "swap",
            "--num-gpu-blocks-override", "100", "--dtype", "float32", "--attention-backend", "torch",
            "--linear-backend", "torch", "--stall-timeout-s", "off", "--scheduling-policy", "wfq"]
    options, _ = serve_options(_parser().parse_args(argv))
    assert options == {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 512, "block_size": 32,
                       "enable_prefix_caching": True, "preemption_mode": "swap", "num_gpu_blocks_override": 100,
                       "dtype": "float32", "attention_backend": "torch", "linear_backend": "torch",
                       "stall_timeout_s": None, "scheduling_policy": "wfq"}
    EngineConfig(device="cpu", **options)  # what serve builds is an engine config
    assert serve_options(_parser().parse_args(["serve", "--stall-timeout-s", "2.5"]))[0] == {"stall_timeout_s": 2.5}
    assert serve_options(_parser().parse_args(["serve"]))[0] == {}


def test_a_rate_that_is_not_a_number_is_refused():
    """Kills: ``positive_rate`` testing ``x <= 0`` (NaN is neither, so ``--request-rate nan`` was taken).  Oracle:
    its docstring, "a rate > 0; inf allowed" -- NaN is not > 0."""
    assert positive_rate("inf") == float("inf")
    with pytest.raises(argparse.ArgumentTypeError):
        positive_rate("nan")


def test_serve_hands_both_door_flags_to_the_door(monkeypatch):
    """Kills: ``--min-free-blocks`` parsed, checked, then dropped when the door is built (no request ever shed for
    lack of KV), and ``--max-request-bytes`` dropped on the way to the app.  Oracle: the flags typed; the model and
    the app are stubs, stopped where the door is handed over."""
    pytest.importorskip("uvicorn")
    import minivllm.server

    seen = {}

    def fake_build_app(engine, names, api_keys, door=None, max_body_bytes="auto"):
        seen["door"], seen["body"] = door, max_body_bytes
        raise _Reached

    monkeypatch.delenv("MINIVLLM_API_KEYS", raising=False)
    monkeypatch.setattr(minivllm, "LLM", lambda model, **options: _LLM(seen))
    monkeypatch.setattr(minivllm.server, "build_app", fake_build_app)
    with pytest.raises(_Reached):
        cli_main(["serve", "--max-waiting-requests", "5", "--min-free-blocks", "3", "--max-request-bytes", "4096"])
    assert (seen["door"].max_waiting, seen["door"].min_free_blocks) == (5, 3)
    assert seen["body"] == 4096


def test_llm_takes_the_prefix_cache_kind_by_name_and_refuses_extra_sampling_params():
    """Kills: ``LLM(prefix_cache="hash")`` dropped on the way to the config (the README: ``prefix_cache=
    "radix"|"hash"`` is an engine option), and more sampling params than prompts accepted, the extra ones silently
    ignored (vLLM: the two lists must be the same length).  The simulated executor: no model loads."""
    from minivllm import LLM
    from minivllm.sim import SimulatedExecutor

    llm = LLM(executor=SimulatedExecutor(), prefix_cache="hash", enable_prefix_caching=True)
    assert llm.engine.config.prefix_cache == "hash"
    ok = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], [ok, ok], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_without_chunking_a_prefill_cap_of_exactly_max_model_len_is_accepted():
    """Kills: the cap refused when it equals ``max_model_len``.  Oracle: the rule as its error states it, "must be 0
    or >= max_model_len" (a cap of max_model_len never splits a prompt, all of which are shorter)."""
    cfg = EngineConfig(device="cpu", enable_chunked_prefill=False, long_prefill_token_threshold=1024,
                       max_num_batched_tokens=1024).resolve(1024)
    assert cfg.long_prefill_token_threshold == 1024
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(device="cpu", enable_chunked_prefill=False, long_prefill_token_threshold=1023,
                     max_num_batched_tokens=1024).resolve(1024)
def test_over_cap_is_wait_or_reject_and_auto_dtype_is_fp32_on_cpu():
    """Kills: ``TenantConfig.over_cap`` left unchecked (``"drop"`` was taken and behaved as ``"wait"``) and
    ``dtype="auto"`` resolved to bf16 on a CPU.  Oracle: the TenantConfig docstring (``"wait"`` (default) or
    ``"reject"``) and ``parse_dtype``'s "``auto`` is fp32 on CPU (exact, and CPU half matmuls are slow)"."""
    assert TenantConfig().over_cap == "wait" and TenantConfig(over_cap="reject").over_cap == "reject"
    with pytest.raises(ValueError, match="over_cap"):
        TenantConfig(over_cap="drop")
    assert EngineConfig(device="cpu").dtype == torch.float32
    assert EngineConfig(device="cpu", dtype="bf16").dtype == torch.bfloat16


def test_dtype_names_mean_what_torch_means_and_only_cpu_or_cuda_devices_are_taken():
    """Kills: ``dtype="half"`` read as bf16 (torch's own ``torch.half`` is float16) and a device torch knows but
    minivllm cannot run on (``"meta"``: no data) let through.  Oracle: ``torch.half``/``torch.float`` and
    ``parse_device``'s "use 'cpu', 'cuda' or 'auto'"."""
    for name, want in (("half", torch.half), ("float", torch.float), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert EngineConfig(device="cpu", dtype=name).dtype == want, name
    with pytest.raises(ValueError, match="device"):
        EngineConfig(device="meta")
