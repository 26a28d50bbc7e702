"""The load generator's workload format as the simulator reads it back (found by the load-generator semantics hunt).

A length distribution is re-read from its own text: ``minivllm sim run`` fills a ``--tenant`` spec's missing
``input=`` / ``output=`` from ``str(LengthDist)``, and both tools record that text in their result files.  So the
text must name the same distribution, or the same seed plans a different workload in each tool.
"""

from __future__ import annotations

import pytest

from minivllm.bench import loadgen as lg
from minivllm.sim import run as sim_run


@pytest.mark.parametrize("spec", ["lognormal:12345.67:0.5", "lognormal:100:0.41421356:300", "lognormal:64:0.5:256",
                                  "lognormal:1e+06:2", "uniform:4:9", "fixed:32"])
def test_a_length_distribution_reads_back_from_its_own_text_unchanged(spec):
    """``:g`` kept six significant digits, so ``lognormal:12345.67:0.5`` was written as ``lognormal:12345.7:0.5``:
    another median.  Oracle: the parser itself -- the text of a parsed spec parses to an equal distribution."""
    d = lg.LengthDist.parse(spec)
    assert lg.LengthDist.parse(str(d)) == d, str(d)


def test_sim_run_plans_the_load_generators_workload_for_a_fractional_lognormal_input_len():
    """The simulator promises the load generator's workload format: the same ``--tenant`` / ``--input-len`` and seed
    are the same requests.  With ``--input-len lognormal:12345.67:0.5`` the simulator planned from the rounded
    ``12345.7`` median: a prompt one token longer shifted every later draw, and the two workloads parted.
    Oracle: :func:`plan_requests` on the spec as typed, which is what ``bench serve`` sends."""
    spec = "lognormal:12345.67:0.5"
    want = lg.plan_requests([lg.parse_tenant("name=a", spec, "fixed:16")], 60, 4.0, 1.0, seed=0)
    args = sim_run._parser().parse_args(["--tenant", "name=a", "--input-len", spec, "--num-requests", "60",
                                         "--request-rate", "4", "--seed", "0"])
    got, _, _ = sim_run.build_requests(args, 49152)
    assert [(r.arrival, r.tenant, len(r.prompt_token_ids), r.max_tokens) for r in got] == [
        (p.arrival, p.tenant, p.prompt_len, p.max_tokens) for p in want]


def test_sim_run_given_only_tenant_specs_neither_names_nor_paces_itself_by_the_chat_workload():
    """``--workload`` defaulted to ``chat``, so ``sim run --tenant name=a`` (no workload named) simulated tenant
    ``a`` alone but printed and wrote "workload chat" and took chat's 200 req/s; the branch for "no workload"
    (10 req/s) could never run.  Oracle: :func:`plan_requests` for the given tenant at 10 req/s, and a report
    that names no workload whose tenants were not simulated.  A plain ``sim run`` still means ``chat``."""
    import io

    argv = ["--tenant", "name=a,input=fixed:8,output=fixed:2", "--num-requests", "30", "--model", "smollm2-135m",
            "--num-gpu-blocks-override", "64"]
    got, rate, tenants = sim_run.build_requests(sim_run._parser().parse_args(argv), 49152)
    want = lg.plan_requests([lg.parse_tenant("name=a,input=fixed:8,output=fixed:2", "uniform:32:128", "fixed:16")],
                            30, 10.0, 1.0, seed=0)
    assert rate == 10.0 and [t.name for t in tenants] == ["a"]
    assert [(r.arrival, r.tenant) for r in got] == [(p.arrival, p.tenant) for p in want]
    out = io.StringIO()
    doc = sim_run.run_sim(sim_run._parser().parse_args(argv), out=out)
    assert doc["workload"] is None and "workload chat" not in out.getvalue()
    plain = sim_run._parser().parse_args(["--num-requests", "3"])
    assert sim_run.build_requests(plain, 49152)[1] == 200.0  # chat's rate: no --tenant, no --workload
