"""Tests from a bug hunt over the sampling parameters, the sampler and the request fields turned into floats.

``SamplingParams`` and the input processor promise that every bad value is a ``ValueError`` at the boundary,
one that names the field (``tests/test_bad_inputs.py`` holds the engine to it for a long table of cases).  A
Python int has no bound, and two things broke on a very large one:

* a float does have one: ``10**400`` is an int the checks let past ``isinstance``, and ``math.isfinite`` --
  like every conversion to a float -- raises ``OverflowError`` on it instead of answering.  Such values escaped
  as an ``OverflowError`` that a caller catching ``ValueError`` (as the docstrings tell it to) did not catch.
  Oracle: Python's own float conversion (a number ``float()`` cannot hold is no finite float);
* the decimal text does too: ``repr`` of an int of more than 4,300 digits raises, so the refusal that quotes
  the value failed while quoting it, with a message that named no field.

Then two sampler defects, each against a hand computation or the float64 definition: a valid int temperature
past int64 crashed the step of every request batched with it, and top_p's cut drifted off the definition over
a real-sized vocabulary.  One test runs a tiny random Llama (transformers' greedy tokens as the oracle); the
rest run no model, or the simulated executor.
"""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.model.sampler import filter_logits, sample
from minivllm.sim import SimulatedExecutor

HUGE = 10**400  # an int float() cannot hold: float(HUGE) raises OverflowError


def test_huge_is_past_what_a_float_holds():
    """The premise, checked independently: the value is a valid int no float can represent."""
    with pytest.raises(OverflowError):
        float(HUGE)
    assert float(10**300) < float("inf")  # (the large-but-representable value the next test still accepts)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p"])
@pytest.mark.parametrize("sign", [1, -1], ids=["huge", "minus-huge"])
def test_a_real_parameter_past_floats_range_is_a_value_error_naming_it(field, sign):
    """Was: ``OverflowError: int too large to convert to float`` from the finiteness check, not the
    ``ValueError`` the module promises.  The message names the parameter, as for ``float("inf")``."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: sign * HUGE})


def test_a_large_int_a_float_holds_is_still_a_valid_temperature():
    """The fix refuses only what no float can hold: ``10**300`` converts to a finite float and stays a valid
    (if extreme) temperature, as ``1e300`` is."""
    assert SamplingParams(temperature=10**300).temperature == 10**300


@pytest.fixture
def llm():
    return LLM(executor=SimulatedExecutor(vocab_size=1000), num_gpu_blocks_override=64, max_model_len=256)


@pytest.mark.parametrize("where", ["prompt dict", "keyword"])
def test_a_deadline_past_floats_range_is_a_value_error_and_the_engine_keeps_serving(llm, where):
    """Was: ``OverflowError`` from ``check_priority_deadline``.  A deadline is seconds on the executor's clock
    and is stored as a float, so one no float can hold is refused like ``inf``; nothing is left queued."""
    engine = llm.engine
    prompt = {"prompt_token_ids": [1, 2, 3]}
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with pytest.raises(ValueError, match="deadline"):
        if where == "prompt dict":
            llm.generate({**prompt, "deadline": HUGE}, params, use_tqdm=False)
        else:
            engine.add_request(prompt, params, deadline=HUGE)
    assert not engine.requests and not engine.has_unfinished_requests()
    assert len(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_an_arrival_time_past_floats_range_is_a_value_error(llm):
    """Was: ``OverflowError`` from ``add_request``'s finiteness check on ``arrival_time``."""
    with pytest.raises(ValueError, match="arrival_time"):
        llm.engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), arrival_time=HUGE)
    assert not llm.engine.requests


@pytest.mark.parametrize("field, value, message", [
    ("n", 10**5000, "n must be"), ("seed", 10**5000, "seed must be"), ("max_tokens", -10**5000, "max_tokens must be"),
    ("top_k", -10**5000, "top_k must be"), ("stop_token_ids", [-10**5000], "stop_token_ids must be")],
    ids=["n", "seed", "max_tokens", "top_k", "stop_token_ids"])
def test_a_refused_int_too_long_to_write_out_is_still_refused_by_name(field, value, message):
    """Was: the refusal's quote, ``repr`` of an int of over 4,300 digits, itself raised Python's "Exceeds the
    limit (4300 digits) for integer string conversion" ValueError, so the caller was never told which field
    was wrong.  Oracle: ``repr`` of such an int raises (checked here), and each field's own refusal text."""
    with pytest.raises(ValueError, match="4300"):
        repr(10**5000)
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


# -- an int temperature past int64 -------------------------------------------------------------------------------
#
# ``temperature=10**20`` passes validation (a finite float, >= 0; 1e20 is a valid temperature).  The sampler built
# its temperature tensor without a dtype, so a batch whose sampled rows all had int temperatures got an int64
# tensor, and an int past 2**63 could not be put in one: "Overflow when unpacking long long", raised inside the
# executor's step -- which fails *every* request of the batch, not only the one that asked.

LOGITS = torch.tensor([[1.0, 0.5, 0.0, -1.0]])


@pytest.mark.parametrize("temperature", [10**19, 10**30])
def test_an_int_temperature_past_int64_draws_from_the_uniform_limit(temperature):
    """At a temperature of 1e19 or more every logit here divides to within 1e-19 of 0, so all four tokens are
    equally likely (exp rounds each to exactly 1 in float32).  Oracle: the documented inverse-CDF draw, done by
    hand -- the seeded row's ``u`` (the same ``torch.rand`` call on a fresh generator of its seed) picks token
    ``floor(4 u)``."""
    for seed in range(12):
        u = torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()
        params = SamplingParams(temperature=temperature, seed=seed)
        got = sample(LOGITS, [params], [torch.Generator().manual_seed(seed)], torch.Generator())
        assert got == [int(4 * u)], (seed, u)


def test_an_int_temperature_past_int64_leaves_its_neighbours_rows_alone():
    """One batch of a greedy row, an int temperature past int64 and an ordinary int one (``temperature=2``, as
    callers write ``temperature=1``): each row gets a token, the greedy row the argmax (token 0).  The whole
    call used to raise, which is what took the neighbours down with it."""
    params = [SamplingParams(temperature=0), SamplingParams(temperature=10**20), SamplingParams(temperature=2)]
    got = sample(LOGITS.repeat(3, 1), params, [None] * 3, torch.Generator().manual_seed(0))
    assert got[0] == 0 and None not in got and all(0 <= t < 4 for t in got)


def test_the_engine_serves_a_batch_holding_such_a_temperature(tmp_path):
    """End to end on a tiny random Llama: a greedy request batched with one at ``temperature=10**20`` gets
    transformers' own greedy tokens, and the other its ``max_tokens`` tokens -- where both used to end with
    ``finish_reason == "error"`` (the step failed as a whole)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import hf_greedy

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(str(tmp_path))
    prompt = [5, 17, 42, 99, 3, 64]
    llm = LLM(model=str(tmp_path), num_gpu_blocks_override=16, max_model_len=64, preemption_mode="recompute")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    hot = SamplingParams(temperature=10**20, max_tokens=6, ignore_eos=True, seed=1)
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [greedy, hot], use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length"], [o.error for o in outs]
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, prompt, 6)
    assert len(outs[1].outputs[0].token_ids) == 6


# -- top_p over a real-sized vocabulary --------------------------------------------------------------------------
#
# The nucleus is "the smallest prefix whose mass reaches top_p".  The filter used to ask that of a float32
# cumulative sum taken from the most likely token down: over 49,152 tokens it drifts by ~1e-5, and the cut fell a
# token or two off the definition's in about one row in twelve (transformers' TopPLogitsWarper, which sums the
# tail from the least likely token up, matched the definition in every row tried).


def test_the_nucleus_of_a_vocabulary_sized_row_is_the_definitions():
    """Oracle: the definition in float64 -- the softmax of the same float32 logits, sorted, and the count of
    tokens whose mass before them is below ``top_p``.  ``top_p`` reaches the filter as :func:`sample` builds it.
    At most one of the 36 rows may differ (float32 probabilities can still round a boundary token either way),
    and by one token; the old cut differed in several rows."""
    gen = torch.Generator().manual_seed(0)
    off = []
    for row in range(12):
        logits = torch.randn(1, 49152, generator=gen) * (0.5 + 6 * torch.rand(1, generator=gen).item())
        probs = torch.softmax(logits.double(), dim=-1).sort(descending=True).values[0]
        before = probs.cumsum(0) - probs
        for top_p in (0.9, 0.95, 0.99):
            exact = int((before < top_p).sum())
            kept = filter_logits(logits, torch.tensor([0]), torch.tensor([top_p], dtype=torch.float64),
                                 torch.tensor([0.0]))
            got = int(torch.isfinite(kept).sum())
            if got != exact:
                off.append((row, top_p, got, exact))
    assert len(off) <= 1 and all(abs(got - exact) == 1 for _, _, got, exact in off), off


@pytest.mark.parametrize("vocab, top_p, nucleus", [(10, 0.6, 6), (5, 0.6, 3), (25, 0.8, 20)])
def test_a_flat_row_samples_exactly_the_tokens_whose_mass_reaches_top_p(vocab, top_p, nucleus):
    """Equal logits (a flat distribution, as a high temperature gives): each token has 1/vocab, so the nucleus
    is the first ``ceil(top_p * vocab)`` of them -- here the mass of exactly ``nucleus`` tokens *is* top_p, and
    the definition keeps no more (transformers' warper keeps the same).  Over 300 seeded draws every one of those
    tokens shows up (each is missed with probability below 1e-20) and no other.  The old cut sampled 7 tokens of
    the first row and 21 of the third; a cut that compares the tail with ``1 - top_p`` rounded from a float32 top_p samples 4 of the
    second (mutant: ``dtype=torch.float64`` of top_p in ``sample`` back to float32)."""
    logits = torch.zeros(1, vocab)
    drawn = {sample(logits, [SamplingParams(temperature=1.0, top_p=top_p, seed=s)],
                    [torch.Generator().manual_seed(s)], torch.Generator())[0] for s in range(300)}
    assert len(drawn) == nucleus, sorted(drawn)
