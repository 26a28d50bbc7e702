"""The batched sampler against a brute-force model of what each request asked for.

The oracle below computes the filtered distribution one token at a time in
plain Python (softmax, keep the top k, keep the nucleus, keep tokens above
min_p times the best, renormalising after each), independently of the
sampler's sorted, vectorised version.  Frequencies over many draws must match
it, forbidden tokens must never appear, and seeds must make rows reproducible
whatever else is in the batch.
"""

from __future__ import annotations

import math

import pytest
import torch

from minivllm.model.sampler import sample
from minivllm.sampling_params import SamplingParams

LOGITS = [2.0, 1.5, 1.5, 0.7, 0.3, 0.0, -0.4, -1.0, -1.2, -2.0, -3.0, -5.0]


def oracle(logits: list[float], p: SamplingParams) -> list[float]:
    """The distribution a request with params ``p`` samples from, token by token."""
    def normalise(weights):
        total = sum(weights)
        return [w / total for w in weights]

    probs = normalise([math.exp(x / p.temperature) for x in logits])
    if 0 < p.top_k < len(logits):
        kth = sorted(logits, reverse=True)[p.top_k - 1]
        probs = normalise([q if x >= kth else 0.0 for q, x in zip(probs, logits)])
    if p.top_p < 1.0:
        keep, mass = set(), 0.0
        for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
            if mass >= p.top_p:
                break
            keep.add(i)
            mass += probs[i]
        probs = normalise([q if i in keep else 0.0 for i, q in enumerate(probs)])
    if p.min_p > 0.0:
        best = max(probs)
        probs = normalise([q if q >= p.min_p * best else 0.0 for q in probs])
    return probs


CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),  # tokens 1 and 2 tie: both stay or both go
    SamplingParams(temperature=1.0, top_k=2),  # the tie at the 2nd value keeps 3 tokens
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=0.9, top_k=8, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, top_p=1e-50),  # 0 in float32: still the top token, never "no token"
    SamplingParams(temperature=1.0, top_k=2**63),  # beyond the vocabulary (and an int64): no filter
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_frequencies_match_the_brute_force_distribution(params):
    n = 40_000
    logits = torch.tensor([LOGITS] * n)
    gen = torch.Generator().manual_seed(7)
    tokens = sample(logits, [params] * n, [None] * n, gen)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(LOGITS)).tolist()
    for token, (count, p) in enumerate(zip(counts, oracle(LOGITS, params))):
        if p == 0.0:
            assert count == 0, f"token {token} is filtered out but was drawn {count} times"
        else:
            assert abs(count / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-4, (token, count / n, p)


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    tokens = sample(logits, params, [None] * 6, torch.Generator().manual_seed(1))
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def test_a_seeded_row_is_the_same_whatever_shares_its_batch():
    vocab = 200
    base = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=11)

    def draw(batch_size: int, position: int, seed: int = 11) -> int:
        logits = torch.randn(batch_size, vocab, generator=torch.Generator().manual_seed(batch_size))
        logits[position] = base
        params = [SamplingParams(temperature=1.0)] * batch_size
        params[position] = seeded
        gens = [None] * batch_size
        gens[position] = torch.Generator().manual_seed(seed)
        return sample(logits, params, gens, torch.Generator().manual_seed(batch_size + 100))[position]

    first = [draw(b, p) for b, p in [(1, 0), (4, 2), (9, 8)]]
    assert len(set(first)) == 1
    # and the seed matters: over several seeds the draws are not all the same token
    assert len({draw(4, 1, seed) for seed in range(12)}) > 1


def test_a_row_without_a_finite_distribution_fails_alone():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    logits[1] = float("nan")
    tokens = sample(logits, [SamplingParams(temperature=1.0)] * 3, [None] * 3, torch.Generator().manual_seed(0))
    assert tokens[1] is None and all(isinstance(t, int) and 0 <= t < 20 for t in (tokens[0], tokens[2]))


def test_a_greedy_row_without_a_finite_maximum_fails_alone_too():
    """Greedy rows skip the softmax, so they need their own check: ``argmax`` of a row with a NaN returns the
    NaN's index, and of a row of ``-inf`` returns 0 -- a confident token from garbage.  Oracle: the rows'
    own maxima, computed by hand (the finite rows' argmax is their largest entry)."""
    logits = torch.tensor([[0.0, 3.0, 1.0], [0.0, float("nan"), 1.0], [float("-inf")] * 3, [2.0, -1.0, 2.0]])
    tokens = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert tokens == [1, None, None, 0]  # (a tie goes to the first maximum, as in HF's argmax)


@pytest.mark.parametrize("u", [0.0, 1.0])
def test_the_ends_of_the_uniform_never_reach_a_forbidden_token(u, monkeypatch):
    """The inverse-CDF draw at its extremes: ``u = 0`` takes the first allowed token, and ``u = 1`` (past
    what ``torch.rand`` returns: where ``u * total`` rounds up to the total) the last allowed one, even when
    forbidden tokens sit at both ends of the vocabulary."""
    import minivllm.model.sampler as sampler

    full = torch.full
    monkeypatch.setattr(sampler.torch, "rand", lambda *shape, **kw: full(shape, u, dtype=kw.get("dtype")))
    logits = torch.tensor([[-30.0, 2.0, 1.0, 0.5, -30.0, -30.0]])
    p = SamplingParams(temperature=1.0, top_k=3)  # tokens 1, 2 and 3 allowed; 0, 4 and 5 forbidden
    probs = oracle(logits[0].tolist(), p)
    allowed = [i for i, q in enumerate(probs) if q > 0]
    assert allowed == [1, 2, 3]
    for seeded in (None, torch.Generator().manual_seed(3)):
        got = sample(logits, [p], [seeded], torch.Generator())
        assert got == [allowed[0] if u == 0.0 else allowed[-1]], (u, seeded, got)


def test_each_draw_is_the_documented_inverse_cdf_of_its_generators_uniform():
    """The module's promise, token by token: unseeded rows take their ``u`` from one ``torch.rand`` call on the
    default generator (row order), a seeded row from one call on its own generator, and the token is the first
    whose cumulative probability exceeds ``u`` times the total.  Oracle: the same uniforms drawn here from
    fresh generators with the same seeds, and the inverse CDF walked in plain Python (double precision).
    A sampler that drew from the global RNG, or read a seeded generator in another dtype, picks other tokens;
    and the engine's seed must matter, so a second default seed must change some row."""
    rows, vocab, temperature = 8, 30, 0.8
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5)) * 2
    seeds = [None, 123, None, None, 77, None, None, None]

    def draw(default_seed: int) -> list[int]:
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
        with torch.random.fork_rng():  # the global RNG set to something else (and restored): it is not read
            torch.manual_seed(default_seed)
            return sample(logits, [SamplingParams(temperature=temperature)] * rows, gens,
                          torch.Generator().manual_seed(default_seed + 1))

    def expected(default_seed: int) -> list[int]:
        shared = torch.rand(rows, 1, generator=torch.Generator().manual_seed(default_seed + 1)).flatten().tolist()
        out = []
        for r, seed in enumerate(seeds):
            u = shared[r] if seed is None else torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()
            weights = [math.exp(x / temperature) for x in logits[r].double().tolist()]
            target, mass = u * sum(weights), 0.0
            for token, w in enumerate(weights):
                mass += w
                if mass > target:
                    break
            out.append(token)
        return out

    assert draw(2024) == expected(2024)
    assert draw(2025) == expected(2025) != expected(2024)
