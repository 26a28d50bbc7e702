"""The order of the sampling filters, pinned where it changes which tokens can come out.

``filter_logits`` documents top-k, then top-p, then min-p, each on the distribution the one before left,
renormalised (transformers' order, and vLLM v0's; vLLM v1 runs min-p first, straight after temperature).  The
frequency tests in ``test_sampler.py`` use cases where every order keeps the same tokens, so a sampler that
ran the filters in another order passed them.  Oracle: distributions of powers of two, filtered by hand, far
from every boundary (float32 rounding cannot move a token across one).  No model is loaded.
"""

from __future__ import annotations

import math

import torch

from minivllm.model.sampler import filter_logits, sample
from minivllm.sampling_params import SamplingParams


def _kept(probs: list[float], p: SamplingParams) -> list[int]:
    """Tokens the sampler may draw for a row whose probabilities at temperature 1 are ``probs``."""
    logits = torch.tensor([[math.log(q) for q in probs]])
    out = filter_logits(logits, torch.tensor([p.top_k]), torch.tensor([p.top_p]), torch.tensor([p.min_p]))
    return torch.isfinite(out[0]).nonzero().flatten().tolist()


def test_top_p_reads_the_distribution_top_k_left_renormalised():
    """probs 0.5, 0.25, 0.125, 0.125 with top_k=2 and top_p=0.6: top-k keeps 0.5 and 0.25, renormalised to 2/3
    and 1/3; the nucleus of those is the first token alone (2/3 >= 0.6).  Top-p on the full distribution
    first (mass 0.5 < 0.6 before the second token) would keep two."""
    assert _kept([0.5, 0.25, 0.125, 0.125], SamplingParams(top_k=2, top_p=0.6)) == [0]


def test_min_p_comes_after_top_p_so_it_cannot_shrink_the_nucleus():
    """probs 0.5, 0.25 and four of 0.0625 with top_p=0.6, min_p=0.2: the nucleus is the first two tokens (mass
    0.5 before the second, 0.75 before the third); min-p then keeps both (1/3 >= 0.2 * 2/3).  min-p first (vLLM
    v1's order) keeps the same two, renormalised to 2/3 and 1/3, and top-p would then cut the second."""
    params = SamplingParams(top_p=0.6, min_p=0.2)
    probs = [0.5, 0.25] + [0.0625] * 4
    assert _kept(probs, params) == [0, 1]
    # and through sample(): both tokens are drawn, at about 2/3 and 1/3 (4,000 draws: 5 sigma is 0.037)
    n = 4000
    logits = torch.tensor([[math.log(q) for q in probs]] * n)
    tokens = sample(logits, [params] * n, [None] * n, torch.Generator().manual_seed(0))
    counts = torch.bincount(torch.tensor(tokens), minlength=len(probs)).tolist()
    assert counts[2:] == [0] * 4
    assert abs(counts[1] / n - 1 / 3) < 0.04, counts
