"""Tests written from a manual mutation pass over metrics, output processing, detokenization, sampling and the door.

Each test pins one behaviour a planted bug changed without any other test noticing.  The oracles are independent
of the code under test: the tokenizer's own ``decode`` of the whole sequence, hand-computed distributions and
latencies, vLLM's published bucket list, and prometheus_client's text parser.  Nothing here runs a model: the
engine runs on a scripted :class:`~minivllm.sim.SimulatedExecutor` that "samples" the tokens a test chose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from minivllm import LLM, EngineConfig, LLMEngine, SamplingParams
from minivllm.metrics.prometheus import EngineMetrics, metrics_from_step_log
from minivllm.metrics.scrape import label_values, metric_samples, metric_value
from minivllm.metrics.step_log import StepRecord
from minivllm.model.sampler import filter_logits
from minivllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from minivllm.server.door import DoorRule, door_snapshot
from minivllm.sim import SimulatedExecutor
from tests.invariants import steps

EOS = 2  # the bundled tokenizer's <|im_end|>


@dataclass
class ScriptedExecutor(SimulatedExecutor):
    """The simulated executor, but request ``rid`` samples ``scripts[rid][i]`` as its i-th output token."""

    scripts: dict = field(default_factory=dict)

    def execute(self, batch):
        out = super().execute(batch)
        for s in batch.seqs:
            rid = s.request.request_id
            if rid in out:
                out[rid] = self.scripts[rid][len(s.request.output_token_ids)]
        return out


def run(tokenizer, scripts, params, prompt=(19556, 905), *, max_model_len=256, decode_with=None, **timing):
    """Every output the engine reports for request ``"r"`` (or group ``"r"``), step by step.

    ``decode_with``: the tokenizer the engine decodes with, if not ``tokenizer`` (a broken one); ``timing``: the
    scripted executor's step-time constants (``fixed_overhead_s=1.0`` and zeros give a 1 s step clock)."""
    ex = ScriptedExecutor(vocab_size=len(tokenizer), scripts=scripts, **timing)
    llm = LLM(executor=ex, tokenizer=tokenizer if decode_with is None else decode_with, num_gpu_blocks_override=64,
              max_model_len=max_model_len)
    llm.engine.inputs.vocab_size = len(tokenizer)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": list(prompt)}, params, request_id="r")
    outs = []
    for new in steps(engine):
        outs += [o for o in new if o.request_id == "r"]
    return outs


# -- detokenization ---------------------------------------------------------------------------------------

TEXT = "Hello world 😀 done x😀😀y, café 日本語"


def test_streamed_deltas_add_up_to_the_full_decode_and_never_show_half_a_character(tokenizer):
    """Kills: dropping the ``endswith("\\ufffd")`` check (an emoji split over byte tokens streams U+FFFD), and a
    read offset left one token behind (each delta repeats the previous token's text).  Oracle: the tokenizer's
    decode of the whole output.  A client concatenates deltas; a repeated or garbled piece is visible to users."""
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)  # the case is real: split characters
    outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True, output_kind="delta"))
    deltas = [o.outputs[0].delta_text for o in outs]
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert [o.outputs[0].delta_token_ids for o in outs] == [[i] for i in ids]


def test_a_prompt_that_ends_mid_character_streams_that_character_once_completed(tokenizer):
    """A prompt sent as token ids can stop inside a character (an emoji's first bytes); the first output tokens
    complete it.  That character must reach the client: measured from the prompt's U+FFFD placeholder, the
    completed character is no longer than the placeholder and used to be dropped.  Oracle: the tokenizer's decode
    of prompt + output, less the prompt's complete characters; every cut of ``TEXT`` inside a character."""
    ids = tokenizer.encode(TEXT)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert len(cuts) >= 3  # the case is real: the emoji and the CJK characters span several tokens
    for k in cuts:
        outs = run(tokenizer, {"r": ids[k:]}, SamplingParams(max_tokens=len(ids) - k, ignore_eos=True,
                                                               output_kind="delta"), prompt=ids[:k])
        deltas = [o.outputs[0].delta_text for o in outs]
        expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:k]).rstrip("\ufffd")):]
        assert "".join(deltas) == expected, (k, deltas)
        assert all("\ufffd" not in d for d in deltas), (k, deltas)
    # a prompt whose last character *is* U+FFFD is complete: none of it is output again
    prompt, out = tokenizer.encode("odd \ufffd"), tokenizer.encode(" then 😀")
    outs = run(tokenizer, {"r": out}, SamplingParams(max_tokens=len(out), ignore_eos=True), prompt=prompt)
    assert outs[-1].outputs[0].text == tokenizer.decode(prompt + out)[len(tokenizer.decode(prompt)):] == " then 😀"


def test_cumulative_outputs_carry_all_tokens_and_the_decoded_prefix(tokenizer):
    """Kills: a cumulative output that lists only this step's token ids.  Every cumulative output must hold
    all token ids so far and text that is a prefix of (and at the end equal to) the full decode."""
    ids = tokenizer.encode(TEXT)
    outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True))
    full = tokenizer.decode(ids)
    for k, o in enumerate(outs, start=1):
        assert o.outputs[0].token_ids == ids[:k]
        assert full.startswith(o.outputs[0].text)
    assert outs[-1].outputs[0].text == full
    assert (outs[-1].outputs[0].finish_reason, outs[-1].outputs[0].stop_reason) == ("length", None)


def test_delta_outputs_carry_this_steps_token_time(tokenizer):
    """Kills: a delta output that reports the request's *first* token time instead of this step's.  A
    streaming client computes its inter-token latency from these times."""
    ids = tokenizer.encode("one two three four five")
    p = dict(max_tokens=len(ids), ignore_eos=True)
    deltas = run(tokenizer, {"r": ids}, SamplingParams(**p, output_kind="delta"))
    cumulative = run(tokenizer, {"r": ids}, SamplingParams(**p))
    times = cumulative[-1].metrics.token_times
    assert len(set(times)) == len(ids)  # each token at its own (virtual) time
    assert [t for o in deltas for t in o.metrics.token_times] == times


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_special_tokens(tokenizer, skip):
    """Kills: the detokenizer always skipping special tokens.  A chat client that asks for
    ``skip_special_tokens=False`` (to see ``<|im_start|>`` turns) must get them.  Oracle: the tokenizer's decode."""
    ids = tokenizer.encode("a") + [1] + tokenizer.encode(" b c")
    outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=skip))
    assert outs[-1].outputs[0].text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in outs[-1].outputs[0].text) is not skip


# -- stop strings --------------------------------------------------------------------------------------------

STOP_TEXT = "abc END xyz tail tail"  # tokens: abc | ' END' | ' xy' | 'z' | ...: the stop ' xyz' spans two tokens


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", ["delta", "cumulative"])
def test_a_stop_string_across_tokens_is_cut_exactly_and_never_leaks_early(tokenizer, include, kind):
    """Kills: ``include_stop_str_in_output`` inverted; holding back one character too few (the stop's first
    character streams out before the stop is known, and a client cannot take it back); and searching from one
    character too late (a stop of the longest length completed by a one-character token is missed).
    Oracle: ``str.find`` on the tokenizer's decode of the whole script."""
    ids = tokenizer.encode(STOP_TEXT)
    full = tokenizer.decode(ids)
    at = full.find(" xyz")
    want = full[: at + 4] if include else full[:at]
    params = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=[" xyz", "Q"],
                            include_stop_str_in_output=include, output_kind=kind)
    outs = run(tokenizer, {"r": ids}, params)
    last = outs[-1].outputs[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", " xyz")
    assert "".join(o.outputs[0].delta_text for o in outs) == want
    if kind == "cumulative":
        assert last.text == want
        assert all(want.startswith(o.outputs[0].text) for o in outs)
    assert len(last.token_ids if kind == "cumulative" else [t for o in outs for t in o.outputs[0].token_ids]) == 4


@pytest.mark.parametrize("stops", [["ND", " E"], [" E", "ND"]])
def test_one_token_completing_two_stops_cuts_at_the_earlier_in_the_text(tokenizer, stops):
    """The token ' END' completes both stops; the text is cut at the one that starts first in the text, whatever
    their order in the list (cut at the first listed, "abc E" would still hold the stop " E").  Oracle:
    the smallest ``str.find`` over the stops on the decode of the whole script."""
    ids = tokenizer.encode(STOP_TEXT)
    full = tokenizer.decode(ids)
    want = full[:min(full.find(x) for x in stops)]
    outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stops))
    c = outs[-1].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == (want, "stop", " E") and want == "abc"


def test_final_only_still_honours_stop_strings(tokenizer):
    """Kills: deferring detokenization for every ``final_only`` request (stop strings are then never seen
    and the request runs to ``max_tokens``).  ``LLM.generate`` uses final_only."""
    ids = tokenizer.encode(STOP_TEXT)
    outs = run(tokenizer, {"r": ids}, SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=" xyz",
                                                     output_kind="final_only"))
    assert len(outs) == 1
    c = outs[0].outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason, len(c.token_ids)) == ("abc END", "stop", " xyz", 4)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", ["delta", "cumulative", "final_only"])
@pytest.mark.parametrize("by", ["stop_token_ids", "eos"])
def test_the_stop_token_is_in_the_ids_but_its_text_only_when_asked(tokenizer, include, kind, by):
    """vLLM v1's rule (``include_stop_str_in_output`` governs stop tokens as it governs stop strings): the token
    that stopped a request is the last of its token ids, and its text is left out unless asked for.  EOS is
    decoded with ``skip_special_tokens=False`` so that its text ("<|im_end|>") would show if it leaked.
    Oracle: the tokenizer's decode of the scripted tokens, with and without the last one."""
    words = tokenizer.encode(" one two three four")
    stop = EOS if by == "eos" else words[2]
    script = words[:2] + [stop] + words[3:]
    extra = {"stop_token_ids": [stop], "ignore_eos": True} if by == "stop_token_ids" else {}
    params = SamplingParams(max_tokens=len(script), include_stop_str_in_output=include, output_kind=kind,
                            skip_special_tokens=False, **extra)
    outs = run(tokenizer, {"r": script}, params)
    last = outs[-1].outputs[0]
    ids = [t for o in outs for t in o.outputs[0].token_ids] if kind == "delta" else last.token_ids
    assert ids == script[:3] and last.finish_reason == "stop"
    want = tokenizer.decode(script[: 3 if include else 2], skip_special_tokens=False)
    assert ("".join(o.outputs[0].delta_text for o in outs) if kind == "delta" else last.text) == want
    assert (want.endswith("<|im_end|>") if by == "eos" else want.endswith(" three")) == include


# -- finish reasons -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["cumulative", "final_only"])
def test_finish_reasons_eos_stop_token_and_length(tokenizer, kind):
    """Kills: EOS reported with ``stop_reason`` = the EOS id (vLLM: None), 'length' reported as 'stop', the
    length check one token late, and EOS honoured despite ``ignore_eos``.  Hand-written expectations."""
    words = tokenizer.encode(" a b c d e f")
    script = words[:3] + [EOS] + words[3:]

    def final(**kw):
        return run(tokenizer, {"r": script}, SamplingParams(output_kind=kind, **kw))[-1].outputs[0]

    eos = final(max_tokens=10)
    assert (eos.finish_reason, eos.stop_reason, eos.token_ids) == ("stop", None, script[:4])
    assert eos.text == tokenizer.decode(words[:3])
    tok = final(max_tokens=10, ignore_eos=True, stop_token_ids=[words[4]])
    assert (tok.finish_reason, tok.stop_reason, tok.token_ids) == ("stop", words[4], script[:6])
    length = final(max_tokens=3)
    assert (length.finish_reason, length.stop_reason, length.token_ids) == ("length", None, script[:3])
    past = final(max_tokens=5, ignore_eos=True)
    assert (past.finish_reason, past.token_ids) == ("length", script[:5])


@pytest.mark.parametrize("kind", ["cumulative", "final_only"])
def test_ignore_eos_holds_with_stop_strings_too(tokenizer, kind):
    """Kills: EOS honoured despite ``ignore_eos`` when the request also has stop strings (the stop check then runs
    on every token, EOS included).  vLLM: ``ignore_eos`` never stops on EOS; a stop string that never appears
    leaves the request to run to ``max_tokens``."""
    words = tokenizer.encode(" a b c d e f")
    script = words[:3] + [EOS] + words[3:]
    out = run(tokenizer, {"r": script}, SamplingParams(max_tokens=6, ignore_eos=True, stop=["zzz"],
                                                        output_kind=kind))[-1].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.token_ids) == ("length", None, script[:6])


# -- n > 1 ----------------------------------------------------------------------------------------------------

def test_streaming_n_samples_report_each_piece_once_and_finish_together(tokenizer):
    """Kills: a folded ``delta`` group that repeats an unchanged sample's last text, a group that drops the
    changed samples' deltas, and a group reported finished when its first sample finishes.  Oracle: each
    sample's scripted tokens decoded by the tokenizer."""
    a, b = tokenizer.encode(" short one"), tokenizer.encode(" a much longer second sample")
    outs = run(tokenizer, {"r#0": a, "r#1": b},
               SamplingParams(n=2, max_tokens=len(b), ignore_eos=True, stop_token_ids=[a[-1]], output_kind="delta"))
    text = {0: "", 1: ""}
    for o in outs[:-1]:
        assert not o.finished
    for o in outs:
        for c in o.outputs:
            assert c.text == c.delta_text and c.token_ids == c.delta_token_ids
            text[c.index] += c.delta_text
    assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["stop", "length"]
    assert text == {0: tokenizer.decode(a[:-1]), 1: tokenizer.decode(b)}  # a's stop token: in its ids, not its text


def test_seeded_n_samples_get_distinct_reproducible_streams(tokenizer):
    """Kills: every sample of a seeded ``n > 1`` request seeded alike (n identical "samples").  A seed must
    make the request reproducible, not make its samples copies of each other."""
    def gens(seed):
        llm = LLM(executor=SimulatedExecutor(vocab_size=len(tokenizer)), tokenizer=tokenizer,
                  num_gpu_blocks_override=64, max_model_len=256)
        llm.engine.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(n=3, seed=seed), request_id="g")
        return [torch.rand(4, generator=llm.engine.requests[f"g#{i}"].generator).tolist() for i in range(3)]

    first = gens(7)
    assert first == gens(7)
    assert len({tuple(x) for x in first}) == 3


# -- the sampler's filters --------------------------------------------------------------------------------------

def _kept(probs, top_k=-1, top_p=1.0, min_p=0.0):
    logits = torch.tensor([[math.log(p) for p in probs]])
    out = filter_logits(logits, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float32),
                        torch.tensor([min_p], dtype=torch.float32))
    return [i for i, x in enumerate(out[0].tolist()) if x != float("-inf")]


def test_top_k_keeps_exactly_k():
    """Kills: the k-th value read one place off (top_k=2 keeping 3 tokens).  Hand-computed: distinct values."""
    probs = [0.4, 0.3, 0.2, 0.1]
    assert _kept(probs, top_k=1) == [0]
    assert _kept(probs, top_k=2) == [0, 1]
    assert _kept(probs, top_k=3) == [0, 1, 2]


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    """Kills: nucleus mass counted *including* the token itself (keeps one token too few).  Hand-computed:
    0.5 < 0.7, 0.5 + 0.3 >= 0.7, so the nucleus is the first two tokens."""
    assert _kept([0.5, 0.3, 0.2], top_p=0.7) == [0, 1]
    assert _kept([0.5, 0.3, 0.2], top_p=0.4) == [0]



def test_top_p_of_one_keeps_every_token_even_when_the_mass_rounds_to_one():
    """Kills: the nucleus cut applied at ``top_p`` 1.0 too.  Beside a token of probability 1 - 3e-13 the mass
    before each tail token rounds to exactly 1.0 in float32, so ``mass >= top_p`` holds there; top_p 1.0 means
    "no nucleus" (the documented default), so the tail stays sampleable.  min_p 1e-20 only makes the filters run."""
    logits = torch.tensor([[0.0, -30.0, -30.0, -30.0]])
    probs = torch.softmax(logits, dim=-1)
    assert (probs.cumsum(-1) - probs)[0, 1:].tolist() == [1.0, 1.0, 1.0]  # the trap is armed
    out = filter_logits(logits, torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([1e-20]))
    assert torch.isfinite(out).all(), out

def test_min_p_is_relative_to_the_most_likely_token():
    """Kills: min_p scaled by the total probability (an absolute threshold) instead of the top token's.
    Hand-computed: 0.2 * 0.5 = 0.1, so 0.15 stays and 0.05 goes."""
    assert _kept([0.5, 0.3, 0.15, 0.05], min_p=0.2) == [0, 1, 2]


# -- sampling parameter boundaries ------------------------------------------------------------------------------

def test_sampling_params_boundaries():
    """Kills: each validation bound moved by one (top_p 0 accepted, top_k -2 accepted, min_p 1 refused, seed
    2**63 accepted, temperature at the greedy epsilon treated as greedy, n=128 refused).  Documented ranges."""
    for bad in (dict(top_p=0.0), dict(top_k=-2), dict(seed=2**63), dict(n=129), dict(min_p=1.0000001)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    SamplingParams(min_p=1.0)
    SamplingParams(seed=2**63 - 1)
    SamplingParams(n=128)
    SamplingParams(top_k=0)
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


# -- metrics -----------------------------------------------------------------------------------------------------

def _out(rid, n_tokens, times, finished=False, reason=None, arrival=1.0, scheduled=1.5):
    c = CompletionOutput(0, "", list(range(n_tokens)), reason, None, "", [n_tokens - 1])
    m = RequestMetrics(arrival, scheduled, times[0], list(times), times[-1] if finished else None)
    return RequestOutput(rid, None, [9] * 7, [c], finished, m)


def test_cumulative_counters_survive_snapshots_arriving_out_of_order():
    """The engine loop syncs after each step and a ``/metrics`` scrape syncs too, from another thread, with a
    snapshot read earlier: an older snapshot applied after a newer one must not make the next one count the gap
    twice.  Oracle: the engine's own cumulative values (a counter ends at the highest one it was shown)."""
    m = EngineMetrics("mm")
    base = LLMEngine(EngineConfig(device="cpu", num_gpu_blocks_override=8), executor=SimulatedExecutor(),
                     model_max_len=64, eos_token_ids=set()).stats()
    for queries, hits in ((150, 40), (100, 30), (200, 60), (200, 60)):  # the second is the scrape's stale read
        m.sync({**base, "prefix_cache_queries": queries, "prefix_cache_hits": hits, "recomputed_tokens": queries // 10})
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:prefix_cache_queries_total") == 200
    assert metric_value(s, "vllm:prefix_cache_hits_total") == 60
    assert metric_value(s, "vllm:num_recomputed_tokens_total") == 20


def test_latency_histograms_from_hand_computed_timestamps():
    """Kills: TTFT observed from the queue time (or from first scheduling instead of arrival), ITL from
    non-adjacent tokens, queue time observed as e2e latency.  Hand-computed: arrival 1.0, scheduled 1.5, tokens
    at 2.0, 2.25 and 3.0."""
    m = EngineMetrics("mm")
    m.track("a", "alice")
    m.observe_output(_out("a", 1, [2.0]))
    m.observe_output(_out("a", 2, [2.0, 2.25]))
    m.observe_output(_out("a", 3, [2.0, 2.25, 3.0], finished=True, reason="length"))
    s = metric_samples(m.render().decode())
    v = lambda name, **kw: metric_value(s, name, **kw)  # noqa: E731
    assert v("vllm:time_to_first_token_seconds_sum", tenant="alice") == pytest.approx(1.0)
    assert v("vllm:time_to_first_token_seconds_count") == 1
    assert v("vllm:inter_token_latency_seconds_sum", tenant="alice") == pytest.approx(1.0)
    assert v("vllm:inter_token_latency_seconds_count") == 2
    assert v("vllm:inter_token_latency_seconds_bucket", le="0.3") == 1  # the 0.25 gap, not the 0.75 one
    assert v("vllm:inter_token_latency_seconds_bucket", le="0.2") == 0
    assert v("vllm:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert v("vllm:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert v("vllm:request_success_total", finished_reason="length", tenant="alice") == 1
    assert v("vllm:prompt_tokens_total", tenant="alice") == 7 and v("vllm:generation_tokens_total") == 3


def test_histogram_buckets_are_vllms():
    """Kills: a bucket bound changed (dashboards' ``histogram_quantile`` and vLLM-written alerts compare
    ``le`` values).  Oracle: the bounds copied from vLLM's vllm/v1/metrics/loggers.py, read back from the
    exposition with prometheus_client's parser."""
    vllm_ttft = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
    vllm_itl = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0]
    m = EngineMetrics("mm")
    m.ttft.labels("mm", "t").observe(0.04)
    m.itl.labels("mm", "t").observe(0.04)
    s = metric_samples(m.render().decode())

    def bounds(name):
        return sorted(float(dict(ls)["le"]) for (n, ls) in s if n == name)

    assert bounds("vllm:time_to_first_token_seconds_bucket") == vllm_ttft + [math.inf]
    assert bounds("vllm:inter_token_latency_seconds_bucket") == vllm_itl + [math.inf]
    assert metric_value(s, "vllm:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert metric_value(s, "vllm:time_to_first_token_seconds_bucket", le="0.02") == 0


def test_abort_and_sample_ids_are_labelled_like_vllm():
    """Kills: an abort counted under ``finished_reason="aborted"`` (vLLM and the engine say ``abort``), and a
    sample id ``parent#i`` mapped to the wrong part of the id (its tenant becomes "unknown")."""
    m = EngineMetrics("mm")
    m.track("p#x", "bob")  # a user id may itself contain '#'
    assert m.tenant_of("p#x#3") == "bob"
    assert m.tenant_of("nobody#1") == "unknown"
    m.observe_abort("p#x")
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:request_success_total", finished_reason="abort", tenant="bob") == 1


class _FakeEngine:
    def __init__(self):
        self.step_log, self.requests, self._stats = [], {}, {}

    def stats(self):
        return dict(self._stats)


def _rec(step, time=0.0, seqs=(), preempted=(), rejected=(), free=10, running=0, waiting=0):
    ids, starts, ns = (tuple(x) for x in zip(*seqs)) if seqs else ((), (), ())
    return StepRecord(step, time, ids, starts, ns, sum(ns), tuple(preempted), 0, 0, tuple(rejected), (), free, free,
                      running, waiting)


def _zero_stats() -> dict:
    """Every key an engine's stats() always has (EngineStats), at zero: a fake engine's starting point."""
    from minivllm.metrics.engine_stats import EngineStats

    return {**{k: 0 for k in EngineStats.__required_keys__}, "kv_cache_usage": 0.0, "per_tenant": {}}


def test_observe_step_counts_each_step_once_and_counters_by_delta():
    """Kills: a step observed twice (a second ``observe_step`` with no new step) counted twice; cumulative
    engine counters added whole instead of by their increase; a gauge read from the wrong stats key; and
    a swap preemption labelled ``recompute`` (or a recompute one ``swap``)."""
    e, m = _FakeEngine(), EngineMetrics("mm")
    m.track("a", "alice")
    e.step_log.append(_rec(0, seqs=[("a", 0, 5)], preempted=["a"]))
    e._stats = {**_zero_stats(), "num_running": 3, "num_waiting": 1, "prefix_cache_queries": 10, "num_swap_preemptions": 1}
    m.observe_step(e)
    m.observe_step(e)  # same step again (an idle poll): nothing new
    e.step_log.append(_rec(1, seqs=[("a", 5, 1)], preempted=["a"]))
    e._stats.update(prefix_cache_queries=25, num_recompute_preemptions=1)
    m.observe_step(e)
    s = metric_samples(m.render().decode())
    assert metric_value(s, "vllm:iteration_tokens_total_count") == 2
    assert metric_value(s, "vllm:iteration_tokens_total_sum") == 6
    assert metric_value(s, "vllm:prefix_cache_queries_total") == 25
    assert metric_value(s, "vllm:num_requests_running") == 3 and metric_value(s, "vllm:num_requests_waiting") == 1
    assert metric_value(s, "vllm:num_preemptions_total", mode="swap", tenant="alice") == 1
    assert metric_value(s, "vllm:num_preemptions_total", mode="recompute", tenant="alice") == 1
    assert metric_value(s, "vllm:num_preemptions_total", tenant="unknown") == 0


def test_metrics_from_step_log_on_a_hand_written_log():
    """Kills: ITL measured from arrival instead of the previous token, TTFT overwritten by later tokens, and
    rejections counted as preemptions.  Hand-computed: prompt of 4 arriving at 0.5; a 2-token prefill chunk at
    1.0 (no token), the rest at 1.5 (first token), decodes at 2.5 and 3.0; "b" rejected."""
    log = [
        _rec(0, 1.0, [("a", 0, 2)]),
        _rec(1, 1.5, [("a", 2, 2)], rejected=["b"]),
        _rec(2, 2.5, [("a", 4, 1)]),
        _rec(3, 3.0, [("a", 5, 1)], free=7, running=1),
    ]
    got = metrics_from_step_log(log, {"a": 4}, {"a": 0.5}, num_blocks=10)
    assert got["ttft"] == {"a": pytest.approx(1.0)}
    assert got["itl"] == [pytest.approx(1.0), pytest.approx(0.5)]
    assert (got["preemptions"], got["generation_tokens"]) == (0, 3)
    assert (got["used_blocks"], got["free_blocks"], got["running"]) == (3, 7, 1)


def test_metric_value_needs_every_label_asked_for():
    """Kills: ``metric_value`` matching samples that share *any* asked-for label (PromQL's ``{a="x",b="y"}``
    needs both).  Oracle: prometheus_client's parser on a hand-written page."""
    page = (
        "# TYPE t counter\n"
        't_total{model_name="a",tenant="x"} 1\n'
        't_total{model_name="a",tenant="y"} 2\n'
        't_total{model_name="b",tenant="x"} 4\n'
    )
    s = metric_samples(page)
    assert metric_value(s, "t_total") == 7
    assert metric_value(s, "t_total", model_name="a", tenant="x") == 1
    assert metric_value(s, "t_total", model_name="b", tenant="y") == 0


def test_label_values_come_out_sorted():
    """Kills: ``label_values`` returning a set's iteration order (it varies with the process's hash seed, so a
    two-value check passes by luck half the time).  Twenty tenants make a lucky order impossible in practice."""
    names = [f"t{i:02d}" for i in range(20)]
    page = "# TYPE t counter\n" + "".join(f't_total{{tenant="{n}"}} 1\n' for n in reversed(names))
    assert label_values(metric_samples(page), "t_total", "tenant") == names


# -- the door ----------------------------------------------------------------------------------------------------

def test_door_boundaries():
    """Kills: the queue limit compared with ``>`` (one request too many admitted), memory pressure counted
    with an empty queue, and the free-block floor compared with ``<=``.  The documented rule: closed when
    waiting >= max_waiting, or waiting > 0 and available < min_free_blocks."""
    rule = DoorRule(max_waiting=2, min_free_blocks=4)
    assert rule.closed({"num_waiting": 2, "available_blocks": 100})
    assert not rule.closed({"num_waiting": 1, "available_blocks": 100})
    assert not rule.closed({"num_waiting": 0, "available_blocks": 0})
    assert not rule.closed({"num_waiting": 1, "available_blocks": 4})
    assert rule.closed({"num_waiting": 1, "available_blocks": 3})
    with pytest.raises(ValueError):
        DoorRule(1, retry_after_s=0)


def test_door_snapshot_counts_pending_requests():
    """Kills: the snapshot ignoring requests that passed the door but are not queued yet (a burst all gets in):
    the server's count of them (queue plus posted) replaces the scheduler's queue alone."""
    engine = SimpleNamespace(kv=SimpleNamespace(num_available_blocks=9), scheduler=SimpleNamespace(waiting=[1, 2]))
    assert door_snapshot(engine, num_waiting=5) == {"num_waiting": 5, "available_blocks": 9}
    assert door_snapshot(engine) == {"num_waiting": 2, "available_blocks": 9}
