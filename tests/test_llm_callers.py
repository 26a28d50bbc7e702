"""Many callers sharing one ``LLM``: each gets exactly its own outputs, or an error, never a silent end.

``LLM.generate`` and ``LLM.stream`` share the engine through a router (one step lock, one mailbox per request).
Each test below pins a way a caller used to lose outputs, end quietly, or leave requests behind; the oracle is
the request's own contract (its tokens, a finished final output, an empty engine and a full pool afterwards).
"""

import gc
import threading

import pytest

from minivllm import LLM, SamplingParams
from minivllm.sim import SimulatedExecutor
from tests.invariants import steps


# LLM's router: a step run by another consumer between ``add_request`` and the mailbox loses no output.

def _llm_with_a_step_right_after_each_add():
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    llm.engine.eos_token_ids = set()
    add = llm.engine.add_request

    def add_then_another_consumer_pumps(*a, **k):
        rid = add(*a, **k)
        # the GIL switching to another consumer's pump right here (with the fix it waits for the mailbox)
        t = threading.Thread(target=llm._router.pump, args=([],), daemon=True)
        t.start()
        t.join(0.3)
        return rid

    llm.engine.add_request = add_then_another_consumer_pumps
    return llm


def test_generate_gets_an_output_stepped_by_another_consumer_before_its_mailbox_opened():
    llm = _llm_with_a_step_right_after_each_add()
    [out] = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == 1


def test_stream_gets_its_first_delta_stepped_by_another_consumer_before_its_mailbox_opened():
    llm = _llm_with_a_step_right_after_each_add()
    outs = list(llm.stream({"prompt_token_ids": [1, 2, 3]},
                           SamplingParams(max_tokens=3, ignore_eos=True, output_kind="delta")))
    assert outs and outs[-1].finished
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 3

# A stream whose request ends without its final output (the engine closed, a server took the engine) raises.

LONG = SamplingParams(max_tokens=40, ignore_eos=True, output_kind="delta")


def _llm():
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    llm.engine.eos_token_ids = set()
    return llm


def test_close_from_another_thread_ends_an_open_stream_with_an_error():
    llm = _llm()
    stream = llm.stream({"prompt_token_ids": [1, 2, 3]}, LONG)
    first = next(stream)
    assert not first.finished
    closer = threading.Thread(target=llm.close)
    closer.start()
    closer.join()
    with pytest.raises(RuntimeError, match="closed"):
        list(stream)  # it used to end quietly, as if complete, with no finished output
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_close_then_next_raises_naming_the_close():
    llm = _llm()
    stream = llm.stream({"prompt_token_ids": [1, 2, 3]}, LONG)
    next(stream)
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(stream)


def test_a_stream_whose_request_a_server_stepped_to_its_end_raises_the_server_error():
    llm = _llm()
    stream = llm.stream({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True))
    next(stream)

    class Loop:  # a server's engine loop (AsyncEngine): it claims the engine and steps it, keeping the outputs
        is_running = True

    llm.engine.claim_driver(Loop())
    for _ in steps(llm.engine):
        pass
    with pytest.raises(RuntimeError, match="served"):
        next(stream)

# Ctrl-C while ``generate`` is still adding its batch leaves none of the batch in the engine.

def test_keyboard_interrupt_while_adding_leaves_nothing_behind():
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    engine = llm.engine
    add, calls = engine.add_request, []

    def interrupted_at_the_third(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # lands while the third prompt is processed
        return add(*a, **k)

    engine.add_request = interrupted_at_the_third
    with pytest.raises(KeyboardInterrupt):
        llm.generate([{"prompt_token_ids": [1, 2]}] * 5, SamplingParams(max_tokens=10), use_tqdm=False)
    with pytest.raises(KeyboardInterrupt):
        calls.clear()
        calls.extend([1, 1])
        next(llm.stream({"prompt_token_ids": [1, 2]}))
    assert not engine.requests and not engine.has_unfinished_requests()  # the first two used to stay, owned by no one
    assert not llm._router._boxes

# An abort that re-enters the engine from inside its own step (the cycle collector finalizing an abandoned
# ``LLM.stream`` at an allocation inside ``step``) waits for the step to end: no KeyError, no leaked blocks.

class CollectsInStep(SimulatedExecutor):
    def execute(self, batch):
        gc.collect()  # an automatic collection can run at any allocation, this one inside step 4
        return super().execute(batch)


def test_a_stream_freed_by_the_cycle_collector_inside_a_step_does_not_break_the_step():
    llm = LLM(executor=CollectsInStep(), tokenizer=None, num_gpu_blocks_override=64, block_size=4, max_model_len=96)
    llm.engine.eos_token_ids = set()

    class Holder:
        pass

    holder = Holder()
    holder.me = holder  # a cycle: only the collector frees the half-read stream it holds
    holder.stream = llm.stream({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=20, ignore_eos=True))
    next(holder.stream)
    del holder
    [out] = llm.generate({"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert out.finished and len(out.outputs[0].token_ids) == 5  # another caller's step used to raise KeyError
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_stream_refuses_bad_input_when_called_not_at_its_first_next():
    """``LLM.stream`` checks its request when called, as ``generate`` does: a generator function's body used to
    wait for the first ``next``, so the ``ValueError`` surfaced wherever the caller first read the stream."""
    llm = _llm()
    for prompt, params in (({"prompt_token_ids": []}, None), ({"prompt_token_ids": [1, 2]}, "greedy"),
                           ({"prompt_token_ids": [1] * 500}, None)):
        with pytest.raises(ValueError):
            llm.stream(prompt, params)  # no next(): the call itself refuses
    assert not llm.engine.requests and not llm._router._boxes


def test_a_stream_closed_or_dropped_unfinished_aborts_its_request():
    llm = _llm()
    stream = llm.stream({"prompt_token_ids": [1, 2, 3]}, LONG)
    assert stream.request_id in llm.engine.requests  # added by the call, before any next()
    next(stream)
    stream.close()
    assert list(stream) == []  # a closed stream is ended
    dropped = llm.stream({"prompt_token_ids": [4, 5]}, LONG)
    rid = dropped.request_id
    del dropped  # never read: freeing it aborts it
    assert rid not in llm.engine.requests and not llm.engine.has_unfinished_requests()
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks and not llm._router._boxes
    with llm.stream({"prompt_token_ids": [6]}, SamplingParams(max_tokens=3, ignore_eos=True)) as s:
        outs = list(s)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3

# The router's pump runs at most one step a call; True says "stepped (or output waits)", not "output waits".

def test_pump_runs_one_step_and_may_bring_the_caller_nothing():
    """Oracle: the request's own contract -- a final-only request of 8 tokens has no output before its end."""
    llm = LLM(executor=SimulatedExecutor(), tokenizer=None, num_gpu_blocks_override=64, max_model_len=96)
    params = SamplingParams(max_tokens=8, ignore_eos=True, output_kind="final_only")
    rid = llm._router.add({"prompt_token_ids": [5] * 10}, params)
    steps_before = len(llm.engine.step_log)
    assert llm._router.pump([rid]) is True
    assert len(llm.engine.step_log) == steps_before + 1  # one step, not "until output waits"
    assert llm._router.take(rid) == []  # ... which brought this request nothing yet
    pumps = 1
    while not (outs := llm._router.take(rid)):
        assert llm._router.pump([rid])
        pumps += 1
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
    assert pumps == 8  # the prefill step samples the first token, then one decode step per further token
    llm._router.close([rid])
