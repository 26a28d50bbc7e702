"""Reading a /metrics page back (``minivllm/metrics/scrape.py``): a sample is found by its whole name.

The oracle is the exposition text itself, written out by hand as a server would send it, and
prometheus_client's own parser, which the helpers sit on: it names every sample (``_bucket``, ``_count``,
``_sum``, a counter's ``_total``), so a sum "of the samples called ``name``" is a hand count over those lines.
"""

from __future__ import annotations

from minivllm.metrics.scrape import label_values, metric_samples, metric_value

# vLLM's per-step token histogram is called ``..._total``, and its samples extend that name: asking for the
# family's name asks for no sample at all, and must not sum its buckets, count and sum together.
PAGE = """\
# HELP vllm:iteration_tokens_total Tokens per engine step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{le="1.0",model_name="m"} 1.0
vllm:iteration_tokens_total_bucket{le="+Inf",model_name="m"} 3.0
vllm:iteration_tokens_total_count{model_name="m"} 3.0
vllm:iteration_tokens_total_sum{model_name="m"} 70.0
# HELP vllm:num_requests_running Requests in the running batch.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
"""


def test_a_sample_is_matched_by_its_whole_name_not_a_prefix():
    samples = metric_samples(PAGE)
    assert metric_value(samples, "vllm:iteration_tokens_total") == 0  # the family's name: no sample has it
    assert metric_value(samples, "vllm:iteration_tokens_total_count") == 3.0
    assert metric_value(samples, "vllm:iteration_tokens_total_sum", model_name="m") == 70.0
    assert metric_value(samples, "vllm:iteration_tokens_total_bucket", le="+Inf") == 3.0
    assert metric_value(samples, "vllm:num_requests") == 0
    assert metric_value(samples, "vllm:num_requests_running") == 2.0
    assert label_values(samples, "vllm:iteration_tokens_total_bucket", "le") == ["+Inf", "1.0"]
