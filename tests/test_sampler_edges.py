"""Sampler edges the frequency tests cannot see: a filter's boundary value, a seeded row behind greedy rows,
and temperatures below GREEDY_EPSILON."""

from __future__ import annotations

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
