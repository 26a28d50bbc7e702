"""What ``LLM.generate`` and ``LLM.chat`` promise a caller, pinned from a mutation pass over the offline entry points.

Each test names the planted one-line bug it kills, which every other test let through.  Nothing runs a model:
the engine runs on the simulated executor with the bundled tokenizer.  The oracles are independent of the code
under test: the prompts and token counts a test sent, the tokenizer's own chat template, and the engine's own
count of what it holds (its requests, the pool's free blocks).
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sim import SimulatedExecutor


def _llm(tokenizer):
    llm = LLM(executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
              num_gpu_blocks_override=64, max_model_len=128)
    llm.engine.inputs.vocab_size = len(tokenizer)
    return llm


def test_outputs_come_back_in_the_order_of_the_prompts_not_the_order_they_finished(tokenizer):
    """Kills: returning the outputs in the order they finished.  The first prompt asks for six tokens, the
    second for two, so the second finishes first; a caller zips outputs with its prompts, so outputs[i] must
    be prompt i's.  Oracle: the prompts and token counts the test sent."""
    llm = _llm(tokenizer)
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    lengths = [6, 2, 4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths


def test_chat_takes_a_list_of_conversations_and_templates_each(tokenizer):
    """Kills: ``chat`` treating a list of conversations as one conversation.  Oracle: the tokenizer's own chat
    template applied to each conversation, in order."""
    convs = [[{"role": "user", "content": "Where are the maps?"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "When do you open?"}]]
    outs = _llm(tokenizer).chat(convs, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    want = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True) for c in convs]
    assert [o.prompt_token_ids for o in outs] == [list(w["input_ids"] if hasattr(w, "keys") else w) for w in want]


def test_a_stream_on_a_served_engine_is_refused_at_the_call_and_adds_nothing(tokenizer):
    """Kills: ``stream`` adding its request before asking whether a server's loop steps the engine.  That loop
    would take the request's outputs, so the call is refused (``LLM.stream``'s docs: the request is checked by
    this call), and the refused request must not stay in the engine holding blocks until the stream object is
    collected.  Oracle: the engine's own ``has_unfinished_requests`` and the pool's free-block count."""

    class RunningLoop:  # what a server's loop looks like to the engine: it claims the engine and runs
        is_running = True

    llm = _llm(tokenizer)
    free = llm.engine.pool.num_free
    loop = RunningLoop()
    llm.engine.claim_driver(loop)
    try:
        with pytest.raises(RuntimeError, match="served by a running server"):
            llm.stream("hello", SamplingParams(max_tokens=4))
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.pool.num_free == free
    finally:
        llm.engine.release_driver(loop)
