"""Turning logits into the next token, per request.

Greedy rows take the argmax.  Sampled rows apply, in vLLM's order, temperature,
top-k, top-p (nucleus) and min-p, then draw from the distribution with the
request's own ``torch.Generator`` when it has a seed — so a seeded request gives
the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from typing import Sequence

import torch

from minivllm.sampling_params import SamplingParams


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask out (to -inf) the tokens a row may not sample; ``logits`` is ``[V]``, temperature applied."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # drop a token once the mass *before* it already reaches top_p; the top token always stays
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> list[int]:
    """One token per row of ``logits`` ``[R, V]`` (fp32)."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        row = apply_top_k_top_p_min_p(row, p.top_k, p.top_p, p.min_p)
        probs = torch.softmax(row, dim=-1)
        gen = generators[i] if generators[i] is not None else default_generator
        tokens[i] = int(torch.multinomial(probs.cpu(), 1, generator=gen).item())
    return tokens
