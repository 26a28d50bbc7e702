"""Tests written in a mutation pass over the load generator's client side (``minivllm/bench/loadgen.py``):
arrivals, the JSONL workload format (the simulator reads the same files), the SSE client and the request body.

Each test pins one behaviour that a small, realistic bug (a planted "mutant", named in the docstring) changed
without any other test noticing.  Expectations come from outside the code under test: a hand-written trace
file, the numbers a hand count gives, numpy on seeded arrivals, or the simulated engine behind the real HTTP
server counting what it generated for each tenant.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from minivllm.bench import loadgen as lg  # noqa: E402
from minivllm.metrics.scrape import metric_samples, metric_value  # noqa: E402
from tests.test_loadgen import _sse_body  # noqa: E402
from tests.test_server_sim import _paced_engine, _Served  # noqa: E402

# -- arrivals --------------------------------------------------------------------------------------------


def test_the_seed_reaches_the_arrival_times_not_only_the_prompts():
    """``--seed`` promises a different (but reproducible) workload per seed, arrivals included: a sweep over
    seeds is how one averages out one unlucky burst.  Oracle: over 400 seeds the first inter-arrival gap of a
    Poisson plan is a fresh Exp(rate) draw each time, so the gaps are all distinct and their mean is within a
    few standard errors (1/rate/sqrt(400) = 5%) of 1/rate; the seeds are fixed, so this is deterministic.
    Kills: the arrivals drawn from a generator seeded with a constant instead of ``[seed, 1]``."""
    rate = 4.0
    gaps = [lg.plan_requests([lg.Tenant("a")], 2, rate, seed=s)[1].arrival for s in range(400)]
    assert len(set(gaps)) == len(gaps)
    assert np.mean(gaps) == pytest.approx(1 / rate, rel=0.2)
    again = [lg.plan_requests([lg.Tenant("a")], 2, rate, seed=s)[1].arrival for s in range(3)]
    assert again == gaps[:3]  # and still reproducible per seed


# -- the workload file -------------------------------------------------------------------------------------


def test_a_lognormal_length_has_the_spread_its_sigma_names():
    """``lognormal:MEDIAN:SIGMA``: the log of a sampled length is normal with standard deviation SIGMA.  Kills:
    the sample drawn with sigma 1 whatever the spec says (the median, which the other test checks, is unchanged;
    the tail -- the long prompts that make a workload hard -- is not).  Oracle: numpy on 20,000 seeded samples."""
    rng = np.random.default_rng(3)
    for sigma in (0.25, 1.5):
        d = lg.LengthDist.parse(f"lognormal:1000:{sigma}")
        logs = np.log([d.sample(rng) for _ in range(20_000)])
        assert np.std(logs) == pytest.approx(sigma, rel=0.05)
        assert np.exp(np.median(logs)) == pytest.approx(1000, rel=0.05)


def test_a_trace_whose_first_request_is_at_time_zero_is_read(tmp_path):
    """A trace that starts at 0 is the ordinary case (the module docstring's own example, and what a shifted
    recording looks like); the format only refuses negative times.  Oracle: a hand-written JSONL file and its
    hand-computed arrivals.  Kills: ``ts < 0`` written as ``ts <= 0``, which refuses the first line."""
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "prompt_len": 4, "max_tokens": 2}\n'
                    '{"timestamp": 0.5, "prompt_len": 6, "max_tokens": 3}\n', encoding="utf-8")
    with open(path, encoding="utf-8") as fh:
        entries = lg.parse_trace(fh)
    assert [(e.timestamp, e.prompt_len, e.max_tokens) for e in entries] == [(0.0, 4, 2), (0.5, 6, 3)]


def test_a_trace_prompt_given_as_text_counts_its_words_not_its_characters():
    """A trace line may carry the prompt itself; its ``prompt_len`` is then the word count (the generator's
    one-token-per-word unit, the same one ``prompt_len`` lines use), not the length of the string.  Oracle:
    the words counted by hand.  Kills: ``len(e.prompt)`` (characters) for ``len(e.prompt.split())``."""
    entries = lg.parse_trace([json.dumps({"timestamp": 0, "prompt": "the river  flows under the old bridge",
                                          "max_tokens": 2})])
    (p,) = lg.plan_from_trace(entries, [lg.Tenant("a")])
    assert p.prompt_len == 7


def test_a_trace_replayed_at_an_infinite_rate_sends_everything_at_once():
    """A trace's timestamps are rescaled to the rate asked for; an infinite rate (``--rates 1,inf`` in bench
    serve, ``--request-rate inf`` in the simulator, which shares this planner) means every request at time 0,
    as it does for synthetic arrivals, not the trace's own timing.  Oracle: hand-written timestamps; without a
    rate they are kept as written.  Kills: the infinite-rate scale 0 written as 1 (the trace's own times)."""
    entries = lg.parse_trace([json.dumps({"timestamp": t, "prompt_len": 2}) for t in (3.0, 4.0, 7.0)])
    tenants = [lg.Tenant("a")]
    assert [p.arrival for p in lg.plan_from_trace(entries, tenants)] == [0.0, 1.0, 4.0]
    assert [p.arrival for p in lg.plan_from_trace(entries, tenants, rate=float("inf"))] == [0.0, 0.0, 0.0]


def test_a_fixed_length_with_a_second_number_is_refused_not_read_as_the_second():
    """``fixed:N`` takes one number; ``fixed:16:32`` is a typo (for ``uniform:16:32``, most likely), and reading it
    as ``fixed:32`` would silently run another workload than the one asked for.  Oracle: the documented grammar
    (``N``, ``fixed:N``, ``uniform:LO:HI``, ``lognormal:MEDIAN:SIGMA[:MAX]``).  Kills: the ``len(parts) == 2``
    check dropped from the ``fixed`` branch."""
    with pytest.raises(ValueError, match="bad length distribution"):
        lg.LengthDist.parse("fixed:16:32")
    with pytest.raises(ValueError, match="bad length distribution"):
        lg.parse_tenant("name=a,output=fixed:16:32")
    assert lg.LengthDist.parse("fixed:16") == lg.LengthDist("fixed", 16)


# -- the SSE client ----------------------------------------------------------------------------------------


def test_a_done_sentinel_with_trailing_whitespace_still_ends_the_stream():
    """The client compares the event's data to ``[DONE]`` ignoring surrounding whitespace, so a server that pads
    the line (``data: [DONE] ``, or a tab) still ends the stream cleanly rather than it being parsed as JSON and
    counted an error.  Oracle: the SSE rule that only one leading space after ``data:`` is dropped, so the
    padding reaches the client.  Kills: ``data == "[DONE]"`` for ``data.strip() == "[DONE]"``."""
    body = _sse_body(["a", "b"], usage=2, done=False) + b"data: [DONE] \n\n"

    run = asyncio.run(lg.run_load("http://test", [lg.PlannedRequest(0, 0.0, "a", "p", 1, 2)], [lg.Tenant("a")], "m",
                                  transport=httpx.MockTransport(lambda r: httpx.Response(200, content=body)),
                                  progress=False))
    (r,) = run.results
    assert (r.outcome, r.error, r.output_tokens) == ("ok", None, 2)


# -- the request body, against the real server -------------------------------------------------------------


def test_each_tenant_gets_its_max_tokens_under_its_own_key_with_a_concurrency_cap():
    """The plan's ``max_tokens`` must reach the server, and with ``--max-concurrency`` each request must still
    carry its own tenant's key: a server with per-tenant quotas attributes (and limits) work by key.  Oracle:
    the simulated engine behind the real HTTP server (no EOS, ``ignore_eos``), whose per-tenant
    ``generation_tokens_total`` must equal the hand sum of each tenant's ``max_tokens``.
    Kills: ``max_tokens`` sent as the prompt length, and the capped path sending the first tenant's key."""
    tenants = [lg.Tenant("alice", "ka"), lg.Tenant("bob", "kb")]
    plan = [lg.PlannedRequest(i, 0.0, ("alice", "bob")[i % 2], "w1 w2 w3", 3, 5 + i) for i in range(4)]
    want = {"alice": 5 + 7, "bob": 6 + 8}
    with _Served(_paced_engine(wall_factor=0.0), keys={"ka": "alice", "kb": "bob"}) as srv:
        run = asyncio.run(lg.run_load(srv.base, plan, tenants, "sim", max_concurrency=1, timeout=60,
                                      request_timeout=30, progress=False))
        assert [r.outcome for r in run.results] == ["ok"] * 4, [r.error for r in run.results]
        assert [r.output_tokens for r in run.results] == [p.max_tokens for p in plan]
        samples = metric_samples(httpx.get(srv.base + "/metrics", timeout=30).text)
        for tenant, n in want.items():
            assert metric_value(samples, "vllm:generation_tokens_total", tenant=tenant) == n


def test_a_trace_line_may_name_its_prompt_length_input_len():
    """``parse_trace`` documents ``input_len`` as another name for ``prompt_len`` (as ``output_len`` is for
    ``max_tokens``): traces exported from other tools use it.  Oracle: the hand-written line's own numbers.
    Kills: ``input_len`` dropped from the lookup (the line was then refused as having no prompt)."""
    (e,) = lg.parse_trace([json.dumps({"timestamp": 0, "input_len": 7, "output_len": 3})])
    (p,) = lg.plan_from_trace([e], [lg.Tenant("a")])
    assert (p.prompt_len, len(p.prompt.split()), p.max_tokens) == (7, 7, 3)


def test_a_prefix_group_name_may_hold_a_colon():
    """``prefix=GROUP:LEN``: the length is what follows the *last* colon, so a versioned group name
    (``app:v2``) is kept whole.  Oracle: the spec read by hand.  Kills: splitting at the first colon, which
    refused the spec (``v2:128`` is no length)."""
    t = lg.parse_tenant("name=a,prefix=app:v2:128")
    assert (t.prefix_group, t.prefix_len) == ("app:v2", 128)


def test_a_tenant_without_share_weighs_one():
    """A tenant spec without ``share=`` weighs 1 against the others' shares, so ``share=3`` beside a plain
    tenant gets three arrivals in four.  Oracle: binomial counts on 4,000 seeded arrivals: the plain tenant's
    expected 1,000 has a standard deviation of 27, so 1,000 +- 150 (5.5 sd) cannot flake, while a default
    weight of 2 (1,600 expected) lies 22 sd outside it.  Kills: a default share other than 1."""
    plain = lg.parse_tenant("name=b")
    assert plain.share == 1.0
    plan = lg.plan_requests([lg.parse_tenant("name=a,share=3"), plain], 4000, float("inf"), seed=5)
    assert abs(sum(p.tenant == "b" for p in plan) - 1000) < 150
