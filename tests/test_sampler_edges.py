"""Sampler edges the frequency tests cannot see: a filter's boundary value, a seeded row behind greedy rows,
temperatures below GREEDY_EPSILON, a top_k at or past the vocabulary, and the inverse-CDF draw itself."""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.model.sampler import filter_logits, sample
from minivllm.sampling_params import SamplingParams


def test_min_p_of_one_keeps_the_most_likely_tokens():
    """min_p keeps tokens *at least* min_p times as likely as the best (HF MinPLogitsWarper and vLLM drop only
    ``probs < min_p * max``), so min_p=1.0 keeps the top token (and any tied with it), never nothing."""
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, -1.0]])
    kept = filter_logits(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([1.0]))
    assert torch.isfinite(kept).tolist() == [[False, True, True, False, False]]
    tokens = sample(logits, [SamplingParams(temperature=1.0, min_p=1.0)], [None], torch.Generator().manual_seed(0))
    assert tokens[0] in (1, 2)


def test_a_seeded_row_behind_greedy_rows_draws_from_its_own_generator():
    """A seeded request gives the same token whatever shares its batch -- greedy rows included, which shift
    its index among the *sampled* rows (catches reading the generator of the wrong row)."""
    vocab = 200
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=11)

    def draw(num_greedy: int, seed: int) -> int:
        logits = torch.randn(num_greedy + 1, vocab, generator=torch.Generator().manual_seed(num_greedy))
        logits[-1] = row
        params = [SamplingParams(temperature=0.0)] * num_greedy + [seeded]
        gens = [None] * num_greedy + [torch.Generator().manual_seed(seed)]
        return sample(logits, params, gens, torch.Generator().manual_seed(100 + num_greedy))[-1]

    for seed in range(8):
        alone = draw(0, seed)
        assert draw(1, seed) == draw(3, seed) == alone, seed


def test_temperatures_below_the_greedy_epsilon_are_the_argmax():
    """Below GREEDY_EPSILON a request is greedy (as vLLM's _SAMPLING_EPS): the argmax, first index on ties --
    not a division by ~0 that overflows to inf/nan and yields no token."""
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.1, -0.3, 2.5, 2.4]])
    for t in (1e-6, 1e-40):
        params = [SamplingParams(temperature=t)] * 2
        for seed in range(10):
            assert sample(logits, params, [None, None], torch.Generator().manual_seed(seed)) == [1, 2], (t, seed)


def test_a_temperature_past_float32s_range_samples_the_uniform_limit_not_nothing():
    """``SamplingParams`` takes any finite Python float, but the sampler divides in float32, where 1e300 is ``inf``:
    a masked logit (``-inf``) then became ``-inf / inf = NaN`` and the row sampled nothing (the request failed).
    The oracle is the limit itself: as T grows, softmax(x / T) tends to the uniform distribution over the finite
    logits, so every allowed token appears and the masked one never does."""
    logits = torch.tensor([[0.0, 5.0, float("-inf"), 1.0]])
    gen = torch.Generator().manual_seed(0)
    drawn = [sample(logits, [SamplingParams(temperature=1e300)], [None], gen)[0] for _ in range(300)]
    assert None not in drawn and 2 not in drawn
    assert all(60 <= drawn.count(t) <= 140 for t in (0, 1, 3)), [drawn.count(t) for t in range(4)]


def test_top_p_at_an_exact_boundary_keeps_the_prefix_that_reaches_it():
    """Eight equal logits (probability 1/8 each, exact in float32, and so is every partial sum): the nucleus
    for ``top_p = j/8`` is exactly ``j`` tokens -- the smallest prefix whose mass *reaches* top_p, as the
    docstring says and as transformers' ``TopPLogitsWarper`` (the independent oracle) keeps.  Ties are what
    make an exact boundary common in practice (a flat distribution at a high temperature); a cut at mass
    ``> top_p`` instead of ``>= top_p`` kept one token more, which random logits never show."""
    from transformers.generation.logits_process import TopPLogitsWarper

    logits = torch.zeros(1, 8)
    for j in range(1, 8):
        top_p = j / 8
        ours = torch.isfinite(filter_logits(logits, torch.tensor([0]), torch.tensor([top_p]), torch.tensor([0.0])))
        hf = torch.isfinite(TopPLogitsWarper(top_p)(torch.zeros(1, 1, dtype=torch.long), logits.clone()))
        assert int(ours.sum()) == int(hf.sum()) == j, (top_p, int(ours.sum()), int(hf.sum()))


@pytest.mark.parametrize("top_k", [4, 5, 2**63])
def test_a_top_k_at_or_past_the_vocabulary_keeps_every_token(top_k, monkeypatch):
    """``top_k`` of V or more keeps the whole vocabulary of V.  With the uniform pinned at its top end the
    inverse-CDF draw takes the *last* allowed token, which here is the least likely one (p = 0.08): a top_k
    clamped one short of the vocabulary drops exactly that token, and frequencies cannot see a token that
    rare among the bins the frequency test checks."""
    import minivllm.model.sampler as sampler

    full = torch.full
    monkeypatch.setattr(sampler.torch, "rand", lambda *shape, **kw: full(shape, 1.0 - 2**-24, dtype=kw.get("dtype")))
    logits = torch.tensor([[1.0, 0.5, 0.0, -1.0]])
    assert sample(logits, [SamplingParams(temperature=1.0, top_k=top_k)], [None], torch.Generator()) == [3]


def test_the_draw_is_the_inverse_cdf_of_the_distribution():
    """For a fixed ``u``, the token is the first whose cumulative probability exceeds ``u`` -- recomputed here
    in float64 from the softmax, token by token, over a grid of 400 ``u`` values (those within 1e-5 of a
    cumulative boundary, where float32 may round either way, skipped) and points just either side of each
    boundary.  A uniform scaled short of 1 (never drawing the top 0.1% of the CDF, so every token loses
    0.1% of its mass to the one before it) shows here; 40,000-draw frequencies cannot resolve it."""
    import minivllm.model.sampler as sampler

    probs64 = [0.4, 0.3, 0.2, 0.05, 0.04, 0.01]
    logits = torch.tensor([[math.log(p) for p in probs64]], dtype=torch.float32)
    weights = [math.exp(x) for x in logits[0].double().tolist()]
    cdf = [sum(weights[: i + 1]) / sum(weights) for i in range(len(weights))]
    # a grid, plus points 2e-5 either side of each boundary (a draw that moves u by even 0.1% crosses one)
    grid = [(i + 0.5) / 400 for i in range(400)] + [c + d for c in cdf[:-1] for d in (-2e-5, 2e-5)] + [1.0 - 2**-24]
    checked = 0
    for u in grid:
        if any(abs(u - c) < 1e-5 for c in cdf):
            continue
        expected = next(i for i, c in enumerate(cdf) if c > u)
        for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=6)):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sampler.torch, "rand", lambda *shape, _u=u, **kw: torch.full(shape, _u, dtype=kw.get("dtype")))
                assert sample(logits, [params], [None], torch.Generator()) == [expected], (u, params.top_k)
        checked += 1
    assert checked > 400
