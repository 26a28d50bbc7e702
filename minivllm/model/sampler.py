"""Turning logits into the next token, for the whole batch at once, on the logits' device.

Greedy rows take the argmax.  Sampled rows apply temperature, top-k, top-p
(nucleus) and min-p, in that order -- transformers' order and vLLM v0's; vLLM v1
runs min-p first, straight after temperature, which can keep fewer tokens when
min-p and top-p both cut (min-p's survivors, renormalised, fill the nucleus
sooner) -- then draw one token.  Everything is a tensor
operation over all sampled rows together, so a GPU step does not wait on a
Python loop, and the batch crosses to the host once, as the final token ids.

The draw is by *inverse CDF*: one uniform ``u`` per row, and the token is the
first ``i`` whose cumulative probability exceeds ``u`` times the row's total.
Token ``i`` owns an interval of width ``p_i``, so it is drawn with probability
exactly ``p_i``, and a token filtered to probability 0 owns no interval at all.
vLLM draws with the *exponential race* instead (``argmax_i p_i / E_i``, ``E_i``
Exp(1) noise): no cumulative sum, which suits a GPU, but one random exponential
per vocabulary entry per row.  On a CPU that is ~1 ms per row per step for a
49k vocabulary (31.8 ms for a batch of 32, about a third of a decode step),
where a cumulative sum and a binary search take 0.05 ms; the
``--sampled-too`` run of ``python -m minivllm.bench offline`` measures it.

A request with a ``seed`` draws its ``u`` from its own CPU ``torch.Generator``
(then copies it over): the same seed gives the same tokens whatever else
shares the batch, and on a GPU as on a CPU up to the rounding of the
cumulative sum.  Unseeded rows draw theirs in one call from the executor's
generator on the device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from minivllm.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to ``-inf`` every logit a row may not sample; ``logits`` ``[R, V]`` (temperature applied).

    Per row: keep the ``top_k`` largest (ties at the k-th value kept; ``top_k``
    of 0 or V keeps all), then the smallest prefix of those whose probability
    mass reaches ``top_p`` (the top token always stays), then the tokens at
    least ``min_p`` times as likely as the most likely one.  Each filter sees
    the distribution the previous one left, renormalised.  Works in sorted
    order, one sort per batch.
    """
    vocab = logits.shape[-1]
    ordered, order = torch.sort(logits, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    kth = ordered.gather(1, (k - 1).unsqueeze(1))
    drop = ordered < kth
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    # "mass before i reaches top_p" is asked as "mass from i on, summed smallest first, is at most 1 - top_p"
    # (transformers' and vLLM's form): float32 sums from the top end drift by ~1e-5 over a 49k vocabulary, and
    # the cut moved a token or two off the exact one in about one row in eight at top_p=0.99
    tail = probs.flip(-1).cumsum(-1).flip(-1)
    nucleus_cut = (tail <= (1.0 - top_p).to(probs.dtype).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    nucleus_cut[:, 0] = False  # the top token always stays: its tail is the whole mass, ~1 give or take rounding
    drop |= nucleus_cut
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    return torch.full_like(logits, float("-inf")).scatter(1, order, ordered.masked_fill(drop, float("-inf")))


_FLOAT32_MAX = torch.finfo(torch.float32).max


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> list[int | None]:
    """One token per row of ``logits`` ``[R, V]`` (fp32); ``None`` for a row with no finite distribution.

    ``generators[i]`` is row ``i``'s own (CPU) generator or None; the others
    share ``default_generator``, which must live on ``logits``' device.  A
    greedy row is judged by its maximum, which ``max`` computes anyway: a NaN
    anywhere in the row makes it NaN, and a row of ``-inf`` has none finite.
    """
    best, tokens = torch.max(logits, dim=-1)  # the first index of the maximum, as argmax
    tokens = torch.where(torch.isfinite(best), tokens, -1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        chosen = [params[i] for i in rows]
        # float32 holds no temperature past ~3.4e38 (1e300 would be inf, and a masked -inf / inf a NaN): capped
        # there, a huge temperature gives its limit, uniform over the allowed tokens.  The dtype is named: from
        # ints alone (temperature=10**20 is valid) torch builds an int64 tensor, which 2**63 and up overflow
        temps = torch.tensor([min(p.temperature, _FLOAT32_MAX) for p in chosen], device=device, dtype=torch.float32)
        scaled = logits[rows] / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0 for p in chosen):
            scaled = filter_logits(
                scaled,
                # a top_k beyond the vocabulary keeps everything; clamped so 2**63 cannot overflow an int64
                torch.tensor([min(p.top_k, logits.shape[-1]) for p in chosen], device=device),
                # float64, so that 1 - top_p is rounded once (1 - float32(0.6) is not float32(0.4): a tie lost)
                torch.tensor([p.top_p for p in chosen], device=device, dtype=torch.float64),
                torch.tensor([p.min_p for p in chosen], device=device, dtype=torch.float32),
            )
        probs = torch.softmax(scaled, dim=-1)
        cdf = probs.cumsum(dim=-1)
        u = torch.rand(len(rows), 1, generator=default_generator, device=device, dtype=cdf.dtype)
        for j, i in enumerate(rows):
            if generators[i] is not None:  # a seeded request: its own stream, device-independent
                u[j] = torch.rand(1, generator=generators[i], dtype=cdf.dtype).to(device)
        total = cdf[:, -1:]
        # The target must stay below the total, so that the first cumulative value past it belongs to a token of
        # positive probability.  torch.rand's float32 u is at most 1 - 2^-24, and that times any normal total
        # rounds below it; the cap keeps this true for a generator that ever returned 1.0.  O(rows), not O(vocab).
        target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
        choice = torch.searchsorted(cdf, target, right=True).squeeze(1)
        bad = ~torch.isfinite(probs).all(dim=-1) | (probs.sum(dim=-1) <= 0)
        tokens[rows] = torch.where(bad, -1, choice)
    return [t if t >= 0 else None for t in tokens.tolist()]  # the batch's one device-to-host copy
