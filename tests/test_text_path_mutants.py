"""Tests from a second hand mutation pass over the text path: stop handling, hold-back and ``n > 1`` fan-in.

Each test pins one behaviour a planted bug changed without any other test noticing (the mutant it kills is
named in its docstring).  As in ``test_more_mutants``, nothing runs a model: the engine runs on a scripted
simulated executor, and the oracles are independent of the code under test -- the tokenizer's own ``decode``
of the scripted tokens, ``str.find`` on that decode, and vLLM's stop rules written out by hand.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from tests.invariants import steps
from tests.test_more_mutants import EOS, STOP_TEXT, ScriptedExecutor, run


def test_a_stop_string_completed_by_the_last_allowed_token_still_stops_and_cuts(tokenizer):
    """Kills: the length check made before the stop-string check.  When the ``max_tokens``-th token completes a
    stop string the request must finish as vLLM's does -- ``"stop"`` with the string as ``stop_reason`` and the
    text cut before it -- not as ``"length"`` with the stop string left in the text.  Oracle: ``str.find`` on
    the decode of the scripted tokens (' xyz' is completed by the fourth token, 'z')."""
    ids = tokenizer.encode(STOP_TEXT)
    full = tokenizer.decode(ids[:4])
    assert full.endswith(" xyz")
    for kind in ("cumulative", "delta", "final_only"):
        outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=4, ignore_eos=True, stop=" xyz", output_kind=kind))
        last = outs[-1].outputs[0]
        text = "".join(o.outputs[0].delta_text for o in outs) if kind == "delta" else last.text
        assert (last.finish_reason, last.stop_reason, text) == ("stop", " xyz", full[: full.find(" xyz")]), kind


def test_eos_listed_in_stop_token_ids_still_reports_no_stop_reason(tokenizer):
    """Kills: the stop-token check made before the EOS check.  vLLM checks EOS first, so an EOS that the caller
    also listed in ``stop_token_ids`` (as OpenAI clients often do) ends the request with ``stop_reason`` None,
    exactly as an unlisted EOS does; with ``ignore_eos`` the listed EOS is an ordinary stop token again and
    reports its id."""
    words = tokenizer.encode(" a b c d")
    script = words[:2] + [EOS] + words[2:]
    for ignore_eos, reason in ((False, None), (True, EOS)):
        last = run(tokenizer, {"r": script}, SamplingParams(max_tokens=6, stop_token_ids=[EOS, words[3]],
                                                            ignore_eos=ignore_eos))[-1].outputs[0]
        assert (last.finish_reason, last.stop_reason, last.token_ids) == ("stop", reason, script[:3])


def test_streamed_text_is_held_back_by_exactly_the_longest_stop_less_one(tokenizer):
    """Kills: holding back one character more than needed.  A suffix of ``len(stop) - 1`` characters is all
    that can still turn into a stop string; holding more delays text a streaming client could already show.
    Oracle: at step ``k`` the cumulative text is the decode of the first ``k`` tokens less exactly that many
    characters (ASCII words, so no token ends mid-character), and at the end it is the whole decode."""
    ids = tokenizer.encode(" one two three four five six")
    stops = ["@@@@", "#"]  # never in the text; the longest has 4 characters, so 3 are held
    outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stops))
    for k, o in enumerate(outs[:-1], start=1):
        full = tokenizer.decode(ids[:k])
        assert o.outputs[0].text == full[: max(0, len(full) - 3)], k
    assert outs[-1].outputs[0].text == tokenizer.decode(ids)


def test_a_cumulative_group_carries_only_this_steps_deltas(tokenizer):
    """Kills: a folded cumulative ``n > 1`` output that keeps a sample's last ``delta_text`` after the step it
    was new in.  ``LLM.stream`` (cumulative by default) documents ``delta_text`` as the new text: a sample that
    finished earlier, or got no token this step, must carry none, or a client appending deltas repeats it.
    Oracle: each sample's scripted tokens decoded by the tokenizer, built from the deltas alone."""
    a, b = tokenizer.encode(" short one"), tokenizer.encode(" a much longer second sample")
    outs = run(tokenizer, {"r#0": a, "r#1": b},
               SamplingParams(n=2, max_tokens=len(b), ignore_eos=True, stop_token_ids=[a[-1]]))
    text, ids = {0: "", 1: ""}, {0: [], 1: []}
    for o in outs:
        for c in o.outputs:
            text[c.index] += c.delta_text
            ids[c.index] += c.delta_token_ids
    assert text == {0: tokenizer.decode(a[:-1]), 1: tokenizer.decode(b)}
    assert ids == {0: a, 1: b}
    assert [c.text for c in outs[-1].outputs] == [text[0], text[1]]


@pytest.mark.parametrize("max_model_len, max_tokens, room", [(16, 100, 6), (16, None, 6), (40, None, 30)])
def test_max_tokens_is_capped_by_the_room_left_in_max_model_len(tokenizer, max_model_len, max_tokens, room):
    """Kills: ``max_tokens`` taken as the caller gave it, not capped at ``max_model_len - len(prompt)``; and
    ``max_tokens=None`` read as some fixed default (``SamplingParams``' 16) rather than vLLM's "as many as fit".

    A request must stop with ``"length"`` when prompt plus output fill the model's length, never run past it
    (the positions beyond ``max_model_len`` do not exist).  Hand-computed for a 10-token prompt: a 16-token model
    has room for exactly 6 output tokens, whatever ``max_tokens`` says; a 40-token model for 30 when the caller
    sets no limit (more than a default of 16 would allow)."""
    words = tokenizer.encode(" " + " ".join("abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"))
    assert len(words) > 30
    outs = run(tokenizer, {"r": words}, SamplingParams(max_tokens=max_tokens, ignore_eos=True), range(100, 110),
               max_model_len=max_model_len)
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.token_ids) == ("length", words[:room])


def test_an_n_group_finishes_when_its_last_sample_does(tokenizer):
    """Kills: a finished group's ``finished_time`` taken from its first sample.  The client's request ends
    when its last sample does, so its e2e latency runs to there.  Hand count on 1 s steps: r#0 (the leader)
    prefills in the step [0, 1] and stops on its second token at 2 s; r#1 shares that prefill, gets its first
    token at 2 s and its fourth at 5 s.  (r#0's finish would say 2 s.)"""
    a, b = tokenizer.encode(" a b"), tokenizer.encode(" c d e f")
    outs = run(tokenizer, {"r#0": a, "r#1": b}, SamplingParams(n=2, max_tokens=4, ignore_eos=True, stop_token_ids=[a[1]]),
               fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)
    last = outs[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["stop", "length"]
    assert (last.metrics.finished_time, last.metrics.e2e_latency) == (5.0, 5.0)


class _BrokenTokenizer:
    """The real tokenizer, except that decoding any text that contains token ``bad`` raises."""

    def __init__(self, tokenizer, bad):
        self._tok, self._bad = tokenizer, bad

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __len__(self):
        return len(self._tok)

    def decode(self, ids, **kw):
        if self._bad in ids:
            raise RuntimeError(f"cannot decode token {self._bad}")
        return self._tok.decode(ids, **kw)


def test_a_request_that_fails_to_decode_reports_the_same_text_whatever_its_output_kind(tokenizer):
    """Kills: a final-only request's catch-up decode restarting from its first token when it is retried.  A
    request whose token cannot be decoded finishes with ``"error"`` and the text decoded before it, whether it
    streamed or not (the output kind changes only what is reported on the way).  A ``final_only`` request
    decodes at its end; when that fails, its error output must not decode the whole output again (which fails
    again and loses all its text).  Oracle: the tokenizer's decode of the tokens before the bad one."""
    ids = tokenizer.encode(" one two three four five")
    bad = ids[3]
    assert bad not in ids[:3]
    for kind in ("cumulative", "delta", "final_only"):
        outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True, output_kind=kind),
                   decode_with=_BrokenTokenizer(tokenizer, bad))
        last = outs[-1].outputs[0]
        text = "".join(o.outputs[0].delta_text for o in outs) if kind == "delta" else last.text
        assert (last.finish_reason, text) == ("error", tokenizer.decode(ids[:3])), kind


def test_an_aborted_sample_keeps_the_time_it_was_aborted_at_when_its_group_is_reported(tokenizer):
    """Kills: ``finish`` overwriting an aborted sample's ``finished_time`` with the time of the step that
    reports it (``if req.finished_time is None or req.status is not FINISHED_ABORTED`` made ``if True``).  An
    aborted sample of an ``n > 1`` group is reported one step after the abort; its end is the abort, and the
    group's ``finished_time`` (its client's e2e latency) is when its last sample really ended -- not one step
    later, which would charge the engine for a step the sample never ran.

    Hand count on 1 s steps: group ``r`` (n=2) and request ``x`` arrive at 0 and prefill in [0, 1].  r#0
    stops on its second token at 2 s; x keeps the clock moving (8 tokens).  After the step ending at 3 s the
    caller aborts r#1, so r#1 ends at 3 s; the next step (x alone) ends at 4 s and reports the group.  The
    group finished at 3 s (the mutant says 4)."""
    a = tokenizer.encode(" a b")
    long = tokenizer.encode(" c d e f g h i j k l")
    ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts={"r#0": a, "r#1": long, "x": long},
                          fixed_overhead_s=1.0, per_token_s=0.0, per_context_token_s=0.0)
    llm = LLM(executor=ex, tokenizer=tokenizer, num_gpu_blocks_override=64, max_model_len=64)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [19556, 905]}, SamplingParams(
        n=2, max_tokens=8, ignore_eos=True, stop_token_ids=[a[1]]), request_id="r", arrival_time=0.0)
    engine.add_request({"prompt_token_ids": [19556, 905]}, SamplingParams(max_tokens=8, ignore_eos=True),
                       request_id="x", arrival_time=0.0)
    outs = []
    while engine.executor.now() < 3.0:
        outs += engine.step()
    assert engine.executor.now() == 3.0
    assert engine.abort_request("r#1")
    for new in steps(engine):
        outs += new
    group = [o for o in outs if o.request_id == "r" and o.finished]
    assert len(group) == 1
    assert [c.finish_reason for c in group[0].outputs] == ["stop", "abort"]
    assert (group[0].metrics.finished_time, group[0].metrics.e2e_latency) == (3.0, 3.0)


def test_text_shorter_than_the_hold_back_shows_nothing_yet(tokenizer):
    """Kills: the held-back branch of ``_make_output`` leaving ``visible`` negative when the text is shorter than
    the hold (the longest stop less one).  A cumulative output then shows ``text[:visible]`` -- the text less
    its *last* few characters, not none of it -- and here that is the space that starts the stop string, which
    the final output cuts away again: a client would see text that is later taken back.  Oracle: the decode
    of the first ``k`` tokens less the 3 held characters, as in the test above, and ``str.find`` for the cut."""
    ids = tokenizer.encode(" a b c d")
    assert tokenizer.decode(ids[:1]) == " a"  # two characters, fewer than the three held
    outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=[" a b"]))
    assert [o.outputs[0].text for o in outs] == ["", ""]
    assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("stop", " a b")


def test_a_group_with_a_failed_sample_reports_why_even_when_another_sample_got_a_token(tokenizer):
    """Kills: the group's ``error`` taken from the output whose metrics it carries.  In the step where sample 0
    fails to decode, sample 1 gets a token, so the group's output is built on sample 1's (no error); the
    group must still say why its sample 0 ended with ``"error"`` (``RequestOutput.error``: the server sends it
    to the client), in that step and in the group's last output.  Hand-worked: sample 0 fails on its third
    token, whose decode raises; sample 1 runs to ``max_tokens``."""
    a, b = tokenizer.encode(" one two three four"), tokenizer.encode(" five six seven eight")
    bad = a[2]
    assert bad not in a[:2] and bad not in b
    outs = run(tokenizer, {"r#0": a, "r#1": b}, SamplingParams(n=2, max_tokens=len(b), ignore_eos=True),
               decode_with=_BrokenTokenizer(tokenizer, bad))
    failed_at = next(k for k, o in enumerate(outs) if o.outputs[0].finish_reason == "error")
    assert outs[failed_at].outputs[1].delta_token_ids  # the case is real: sample 1 got a token in that step
    for o in outs[failed_at:]:
        assert o.error is not None and f"cannot decode token {bad}" in o.error
    last = outs[-1]
    assert last.finished and [c.finish_reason for c in last.outputs] == ["error", "length"]
    assert last.outputs[0].text == tokenizer.decode(a[:2]) and last.outputs[1].text == tokenizer.decode(b)


def test_an_aborted_final_only_sample_reports_the_text_of_its_tokens(tokenizer):
    """Kills: ``final_output`` skipping the catch-up decode.  A ``final_only`` request decodes nothing until it
    ends; a sample aborted mid-run ends outside ``emit``, and its last output (in its group's, which the caller
    still gets) must carry the text of the tokens it did generate, not an empty string beside a list of token
    ids.  Oracle: the tokenizer's decode of the token ids that output reports."""
    a, b = tokenizer.encode(" a b c d e f g h"), tokenizer.encode(" one two three four five six seven eight")
    ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts={"r#0": a, "r#1": b})
    engine = LLM(executor=ex, tokenizer=tokenizer, num_gpu_blocks_override=64, max_model_len=64).engine
    engine.add_request({"prompt_token_ids": [19556, 905]}, SamplingParams(
        n=2, max_tokens=8, ignore_eos=True, output_kind="final_only"), request_id="r")
    outs = []
    while len(engine.requests["r#1"].output_token_ids) < 3:
        outs += engine.step()
    assert engine.abort_request("r#1")
    for new in steps(engine):
        outs += new
    assert [o.finished for o in outs][-1] and sum(o.finished for o in outs) == 1
    aborted = [o.outputs[1] for o in outs if o.outputs[1].finish_reason == "abort"]
    assert aborted and all(c.text == tokenizer.decode(c.token_ids) for c in aborted)
    s0, s1 = outs[-1].outputs
    assert (s0.finish_reason, s1.finish_reason) == ("length", "abort")
    assert len(s1.token_ids) >= 3 and s1.token_ids == b[: len(s1.token_ids)]
    assert s1.text == tokenizer.decode(s1.token_ids) and s0.text == tokenizer.decode(a)


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_every_group_output_lists_its_samples_by_their_own_index(tokenizer, kind):
    """Kills: a group's not-yet-reported samples listed with index 0.  The leader prefills alone, so the
    group's first output comes before its other samples have a token; their slots must still say which sample
    they are (OpenAI's ``choices[i].index == i``; a client keys its streams by it and would append sample 2's
    first text to sample 0's).  Hand-worked: three samples, indices 0, 1, 2 in every output."""
    s = {f"r#{i}": tokenizer.encode(f" sample {i} says hello") for i in range(3)}
    outs = run(tokenizer, s, SamplingParams(n=3, max_tokens=4, ignore_eos=True, output_kind=kind))
    assert not all(c.token_ids for c in outs[0].outputs)  # the case is real: some sample had no token yet
    assert all([c.index for c in o.outputs] == [0, 1, 2] for o in outs)


def test_a_final_only_group_reports_when_each_sample_finishes_and_is_finished_only_at_the_last(tokenizer):
    """``final_only`` with ``n > 1`` (``SamplingParams``' docs): one output each time one of its samples
    finishes, ``finished`` only on the last -- each such output carries the finishing sample's own token times,
    which the metrics read.  With ``n = 2`` and sample 0 stopping on its second token: two outputs, the first
    unfinished and holding sample 0's finished completion, the second finished.  Oracle: the docs, and the same
    group run with ``cumulative`` output, whose last output must list the same completions (ids, text, finish
    reasons).  Kills: a group that surfaces outputs on steps where no sample finished, or none before the end."""
    a, b = tokenizer.encode(" a b c d"), tokenizer.encode(" one two three four")

    def run_kind(kind):
        ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts={"g#0": a, "g#1": b})
        engine = LLM(executor=ex, tokenizer=tokenizer, num_gpu_blocks_override=64, max_model_len=64).engine
        engine.add_request({"prompt_token_ids": [19556, 905]}, SamplingParams(
            n=2, max_tokens=4, ignore_eos=True, stop_token_ids=[a[1]], output_kind=kind), request_id="g")
        return [o for new in steps(engine) for o in new]

    outs = run_kind("final_only")
    assert [o.finished for o in outs] == [False, True]
    assert [c.finish_reason for c in outs[0].outputs] == ["stop", None]
    last = run_kind("cumulative")[-1]
    got = [(c.index, c.token_ids, c.text, c.finish_reason) for c in outs[-1].outputs]
    assert got == [(c.index, c.token_ids, c.text, c.finish_reason) for c in last.outputs]
    assert got[0][1:] == (a[:2], tokenizer.decode(a[:1]), "stop") and got[1][3] == "length"
