"""Engine input/output-path mutants (prompt length checks, output metrics, EOS ids, KV sizing) the suite let through.

Each test names the planted change it kills and its oracle.  Nothing runs a model: the engine runs on the
scripted simulated executor of ``test_more_mutants`` (the output tokens are chosen by the test), and the
oracles are counts and clock readings worked out by hand from the simulator's published step costs.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from minivllm import LLM, EngineConfig, SamplingParams
from minivllm.engine.llm_engine import LLMEngine
from minivllm.model.runner import kv_layout
from tests.test_more_mutants import ScriptedExecutor, run


def test_a_prompt_one_token_short_of_max_model_len_runs_and_gets_exactly_one_token(tokenizer):
    """Kills: the prompt-length refusal moved one token early (``>= max_model_len - 1``).  A prompt of
    ``max_model_len - 1`` tokens leaves room for one output token, which is what ``check_prompt_fits`` promises
    ("no room for even one output token" is the only reason to refuse); refusing it turns a servable request into
    a ``ValueError`` (a 400 at the server).  Oracle: hand count -- 15 prompt tokens in a 16-token model leave one
    position, so the request ends with ``"length"`` after exactly one token, however many it asked for."""
    script = tokenizer.encode(" a b c")
    outs = run(tokenizer, {"r": script}, SamplingParams(max_tokens=10, ignore_eos=True), range(100, 115),
               max_model_len=16)
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.token_ids) == ("length", script[:1])
    with pytest.raises(ValueError, match="no room for even one output token"):
        run(tokenizer, {"r": script}, SamplingParams(max_tokens=10, ignore_eos=True), range(100, 116),
            max_model_len=16)


def test_every_eos_id_a_model_config_lists_is_an_eos_id():
    """Kills: only the first of a config's ``eos_token_id`` list taken as EOS.  Llama-3-style checkpoints list
    several (``[128001, 128008, 128009]``: end of text, end of message, end of turn) and a chat reply ends on the
    *last* of them; with only the first one known, the engine generated past the turn's end up to ``max_tokens``.
    Oracle: HF ``generate``'s rule, that every id listed in the config's ``eos_token_id`` is an EOS, plus the
    tokenizer's own ``eos_token_id``."""
    loaded = SimpleNamespace(hf_config=SimpleNamespace(eos_token_id=[128001, 128008, 128009]))
    engine = SimpleNamespace(tokenizer=SimpleNamespace(eos_token_id=7), loaded=loaded)
    assert LLMEngine._eos_ids(engine) == {7, 128001, 128008, 128009}
    loaded.hf_config.eos_token_id = 5
    assert LLMEngine._eos_ids(engine) == {7, 5}


@pytest.mark.parametrize("dtype, element", [("bfloat16", 2), ("float16", 2), ("float32", 4)])
def test_the_kv_pool_is_sized_in_the_dtype_the_engine_serves_in(dtype, element):
    """Kills: a model's KV blocks priced in float32 whatever the engine's ``dtype`` (the weights' default type
    rather than the cache's).  A bf16 engine then got half the blocks its KV budget buys: half the concurrent
    requests, earlier preemption, a smaller pool in ``stats()``.  Oracle: hand count -- K and V, 2 layers, 16-token
    blocks, 3 KV heads of 64 dims at ``element`` bytes each, and a budget of exactly 10 such blocks."""
    per_block = 2 * 2 * 16 * 3 * 64 * element
    model = SimpleNamespace(args=SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=64))
    config = EngineConfig(dtype=dtype, device="cpu", block_size=16, kv_cache_memory_bytes=10 * per_block)
    layout = kv_layout(model, config)
    assert (layout.bytes_per_block, layout.num_blocks) == (per_block, 10)


def test_a_model_engines_pool_takes_num_gpu_blocks_override_over_its_budget():
    """Kills: a model engine's pool sized from the KV budget even when ``num_gpu_blocks_override`` is set (the
    simulated engine honours it, so no simulator test sees this; the HF-parity preemption test does, in about four
    minutes of model runs, and this is the quick check).  The option is how a caller pins the pool -- vLLM's name
    and meaning -- to reproduce a preemption or a lab's numbers on another machine.  Oracle: the option's value,
    7, against a budget that would buy 10 blocks."""
    per_block = 2 * 2 * 16 * 3 * 64 * 4
    model = SimpleNamespace(args=SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=64))
    config = EngineConfig(dtype="float32", device="cpu", block_size=16, kv_cache_memory_bytes=10 * per_block,
                          num_gpu_blocks_override=7)
    assert kv_layout(model, config).num_blocks == 7


def test_llm_chat_passes_add_generation_prompt_to_the_template(tokenizer):
    """Kills: ``LLM.chat`` dropping its ``add_generation_prompt`` argument on the way to ``chat_prompt`` (so the
    template always opened an assistant turn).  A caller passes False to continue or score the conversation as
    it stands; the existing test asks ``chat_prompt`` directly and never ``chat``.  Oracle: HF's
    ``apply_chat_template(tokenize=True)`` with the same flag -- the prompt ids each output reports, for a list of
    two conversations (the list form goes through the same argument)."""
    llm = LLM(executor=ScriptedExecutor(vocab_size=len(tokenizer), scripts={}), tokenizer=tokenizer,
              num_gpu_blocks_override=64, max_model_len=256)
    llm.engine.executor.scripts = {f"req-{i}": [tokenizer.encode(" x")[0]] for i in range(4)}
    conversations = [[{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue"}],
                     [{"role": "user", "content": "And a fruit?"}]]
    for flag in (True, False):
        want = [tokenizer.apply_chat_template(c, add_generation_prompt=flag, tokenize=True) for c in conversations]
        want = [list(w["input_ids"] if hasattr(w, "keys") else w) for w in want]
        outs = llm.chat(conversations, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False,
                        add_generation_prompt=flag)
        assert [list(o.prompt_token_ids) for o in outs] == want, flag


def test_stop_strings_given_as_a_list_survive_replace_and_llm_generate(tokenizer):
    """Kills: ``stop`` accepted only as a list or a string, not a tuple.  ``SamplingParams`` stores a list as a
    tuple (it is frozen), so ``dataclasses.replace`` -- the documented way to derive params, and what
    ``LLM.generate`` does to make every request final-only -- re-validated that tuple and refused it: any
    ``generate`` with ``stop=[...]`` raised ``ValueError``.  Oracle: ``str.find`` on the tokenizer's decode of the
    scripted tokens (vLLM cuts the text before the earliest stop string, ``finish_reason`` "stop")."""
    params = SamplingParams(stop=["@@", " three"], max_tokens=8, ignore_eos=True)
    assert replace(params, max_tokens=3).stop_strings == ("@@", " three")
    assert SamplingParams(stop=("@@",)).stop_strings == ("@@",)
    ids = tokenizer.encode(" one two three four")
    full = tokenizer.decode(ids)
    llm = LLM(executor=ScriptedExecutor(vocab_size=len(tokenizer), scripts={"req-0": ids}), tokenizer=tokenizer,
              num_gpu_blocks_override=64, max_model_len=256)
    [out] = llm.generate({"prompt_token_ids": [19556, 905]}, params, use_tqdm=False)
    done = out.outputs[0]
    assert (done.finish_reason, done.stop_reason, done.text) == ("stop", " three", full[: full.find(" three")])


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_an_n_group_has_no_finished_time_until_its_last_sample_ends(tokenizer, kind):
    """A real bug, fixed with this test (found while arguing that the fold's choice of *which* sample's metrics a
    group output carries is free).  When one sample of an ``n > 1`` group stopped while another ran on, the
    group's output for that step carried the stopped sample's ``finished_time`` (and so an ``e2e_latency``) with
    ``finished`` still False; an ``n == 1`` output never has a finished time before it finishes.  Oracle: that
    definition and a hand count on 1 s steps -- r#0 runs four tokens (1 s .. 4 s), r#1 stops on its second at
    3 s, so the group is unfinished at 1, 2 and 3 s and finished at 4 s."""
    a, b = tokenizer.encode(" c d e f"), tokenizer.encode(" a b")
    outs = run(tokenizer, {"r#0": a, "r#1": b},
               SamplingParams(n=2, max_tokens=4, ignore_eos=True, stop_token_ids=[b[1]], output_kind=kind),
               fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)
    assert [o.finished for o in outs] == [False, False, False, True]
    assert [(o.metrics.finished_time, o.metrics.e2e_latency) for o in outs] == [(None, None)] * 3 + [(4.0, 4.0)]
