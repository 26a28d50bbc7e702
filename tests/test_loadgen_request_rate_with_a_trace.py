"""What ``--request-rate`` does to a ``--trace`` is what its help says.

Why: the help said "inf: all at once", but with a trace ``inf`` (the default, and an explicit ``inf`` alike) keeps
the trace's own timestamps -- only ``--rates inf`` sends a trace all at once -- so a reader who typed
``--request-rate inf`` to burst a trace got the trace's pacing instead.  Oracle: a hand-made trace of four
requests one second apart, whose times at 2 req/s are 0, 0.5, 1 and 1.5 s.
"""

import io
import json

from minivllm.bench import loadgen as lg


def _arrivals(monkeypatch, tmp_path, extra: list[str]) -> list[float]:
    plans = []

    async def fake_run_load(base_url, plan, tenants, model, *args, **kwargs):
        plans.append([p.arrival for p in plan])
        results = [lg.RequestResult(p.index, p.tenant, p.arrival, p.prompt_len, p.max_tokens) for p in plan]
        return lg.RunResult(float("nan"), 1.0, results)

    monkeypatch.setattr(lg, "run_load", fake_run_load)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 10 + s, "prompt_len": 4}) for s in range(4)))
    args = lg._parser().parse_args(["--trace", str(trace), "--model", "m", "--no-progress", *extra])
    lg.run_benchmark(args, out=io.StringIO())
    return plans[0]


def test_request_rate_help_says_what_inf_and_a_rate_do_to_a_trace(monkeypatch, tmp_path):
    assert _arrivals(monkeypatch, tmp_path, []) == [0.0, 1.0, 2.0, 3.0]
    assert _arrivals(monkeypatch, tmp_path, ["--request-rate", "inf"]) == [0.0, 1.0, 2.0, 3.0]
    assert _arrivals(monkeypatch, tmp_path, ["--request-rate", "2"]) == [0.0, 0.5, 1.0, 1.5]
    assert _arrivals(monkeypatch, tmp_path, ["--rates", "inf"]) == [0.0] * 4
    help_text = next(a.help for a in lg._parser()._actions if "--request-rate" in a.option_strings)
    assert "--trace" in help_text and "timestamps" in help_text and "rescale" in help_text
