"""Bugs a hunt in the streaming API found, each pinned by a test that failed on the code before its fix.

``LLM.stream`` and ``LLM.generate`` whose request another caller aborted end at once, with an error: once the
request has left the engine no output can come for it, so its reader has nothing to wait for (the oracle is
the request's own state).  A streamed request that fails on its last token reports that token in its deltas.
"""

import pytest

from minivllm import LLM, SamplingParams

from test_llm_callers import _llm  # noqa: E402  (tests/ is on sys.path): a simulated LLM with no EOS

LONG = SamplingParams(max_tokens=80, ignore_eos=True, output_kind="delta")


def test_a_stream_aborted_by_another_caller_raises_without_running_other_callers_requests_to_their_end():
    """The reader of an aborted stream used to step the engine until *every* request in it had finished (its
    pump stopped only on an empty engine): it ran another stream's 80 tokens before it said the request was
    aborted, and under a steady load from other callers -- never an empty engine -- it never said so at all."""
    llm = _llm()
    mine = llm.stream({"prompt_token_ids": [1, 2, 3]}, LONG)
    other = llm.stream({"prompt_token_ids": [4, 5, 6]}, LONG)
    next(mine), next(other)
    assert llm.engine.abort_request(mine.request_id)  # another caller gives up on it
    with pytest.raises(RuntimeError, match="aborted"):
        next(mine)
    assert other.request_id in llm.engine.requests  # not run to its end on mine's behalf
    outs = list(other)
    assert outs[-1].finished and sum(len(o.outputs[0].token_ids) for o in outs) == 79  # and it loses nothing
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_generate_whose_requests_another_caller_aborted_raises_while_other_requests_still_run():
    """The same wait in ``generate``: its request aborted, it stepped everyone else's work to the end first."""
    llm = _llm()
    other = llm.stream({"prompt_token_ids": [4, 5, 6]}, LONG)
    next(other)
    add = llm.engine.add_request

    def add_then_abort(*a, **k):  # another caller aborts the request as soon as it is in
        rid = add(*a, **k)
        llm.engine.abort_request(rid)
        return rid

    llm.engine.add_request = add_then_abort
    with pytest.raises(RuntimeError, match="aborted"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert other.request_id in llm.engine.requests
    assert not llm._router._boxes.keys() - {other.request_id}


def test_a_streamed_request_that_fails_to_decode_reports_its_last_token_in_its_deltas(tokenizer):
    """A token the tokenizer cannot decode ends the request with ``"error"``; that token is one of the request's
    tokens (the cumulative output lists it), but its step's output carried no ``delta_token_ids``, so a delta
    client's concatenated token ids came up one short of the request's, and a cumulative one's deltas disagreed
    with its own ``token_ids``.  Oracle: the tokens the executor was scripted to sample, up to the bad one."""
    from tests.test_more_mutants import ScriptedExecutor
    from tests.test_text_path_mutants import _BrokenTokenizer

    ids = tokenizer.encode(" one two three four five")
    bad = ids[3]
    assert bad not in ids[:3]
    for kind in ("delta", "cumulative"):
        ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts={"req-0": ids})
        llm = LLM(executor=ex, tokenizer=_BrokenTokenizer(tokenizer, bad), num_gpu_blocks_override=64, max_model_len=64)
        outs = list(llm.stream({"prompt_token_ids": [19556, 905]},
                               SamplingParams(max_tokens=len(ids), ignore_eos=True, output_kind=kind)))
        last = outs[-1].outputs[0]
        assert last.finish_reason == "error", kind
        assert sum((o.outputs[0].delta_token_ids for o in outs), []) == ids[:4], kind
        sent = sum((o.outputs[0].token_ids for o in outs), []) if kind == "delta" else last.token_ids
        assert sent == ids[:4], kind
