"""The benchmark reports say what they measured: a summary row's label is recomputed from the engine's own state.

Oracle: the output lengths of the running requests, read off the scheduler at the moment each row's timing
starts, not the bench's own bookkeeping.  The load generator's rates and the preemption bench's flags below are
checked against hand counts: the least time a run that waits out a request timeout can take, a trace's gaps.
"""

import asyncio
import inspect
import io
import json
import sys

import pytest

import minivllm.bench.host_overhead as host_overhead
from minivllm.bench import loadgen as lg


def test_sweep_labels_each_row_with_the_output_length_it_was_measured_at(monkeypatch):
    """Timing a point takes ``samples`` steps, so a point closer than that to the one before cannot be visited:
    the sequences are already past it.  The committed sweep asked for 250, 270 and 300 with 50 samples, and its
    rows "270" and "300" were measured at 300 and 350 output tokens.  The row must name the length it measured."""
    seen = []
    timed = host_overhead._time_steps

    def spy(engine, n):
        seen.append(sorted({len(r.output_token_ids) for r in engine.scheduler.running}))
        return timed(engine, n)

    monkeypatch.setattr(host_overhead, "_time_steps", spy)
    rows = host_overhead.sweep(4, [8, 10, 30], samples=5, prompt_len=16)
    assert all(len(s) == 1 for s in seen), seen  # (all four decode in lockstep: one length per row)
    assert [r["output_tokens"] for r in rows] == [s[0] for s in seen] == [8, 13, 30]
    assert [r["total_tokens"] for r in rows] == [24, 29, 46]


def test_sweep_measures_every_row_with_all_its_sequences_running(monkeypatch):
    """The prompts are prefilled a token budget at a time, so the first sequences are tens of tokens ahead of the
    last when the sweep starts counting; requests sized for the last sequence's count finished inside the last
    row's measurement (and 64 x 1024-token prompts lost sequences before the first row began).  A row of the sweep
    must be a step of ``seqs`` decodes from its first timed step to its last."""
    running = []
    timed = host_overhead._time_steps

    def spy(engine, n):
        before = len(engine.scheduler.running)
        got = timed(engine, n)
        running.append((before, len(engine.scheduler.running)))
        return got

    monkeypatch.setattr(host_overhead, "_time_steps", spy)
    host_overhead.sweep(64, [4, 40], samples=4, prompt_len=1024)
    assert running == [(64, 64), (64, 64)]


# -- the load generator ---------------------------------------------------------------------------------------


def _stream(text: str) -> bytes:
    chunk = {"choices": [{"index": 0, "text": text}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    return f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()


@pytest.mark.parametrize("limit", ["request_timeout", "timeout"])
def test_a_run_that_waits_out_a_stuck_request_lasts_until_it_gives_up(limit):
    """Two requests answered at once and one the server never answers, given up after 0.4 s (its own
    ``--request-timeout``, or the run's ``--timeout``).  The run cannot have ended before it gave up, so its
    duration is at least 0.4 s and its throughput at most 2 / 0.4 = 5 req/s.  The duration was the latest end of
    a request with an e2e, and a timed-out one has none: it read about 1 ms, and the summary 1,700 req/s."""
    httpx = pytest.importorskip("httpx")

    async def handler(request):
        if b"stuck" in request.content:
            await asyncio.sleep(30)
        return httpx.Response(200, content=_stream("a"))

    plan = [lg.PlannedRequest(i, 0.0, "a", "stuck" if i == 2 else "fast", 1, 1) for i in range(3)]
    run = asyncio.run(lg.run_load("http://test", plan, [lg.Tenant("a")], "m", progress=False,
                                  transport=httpx.MockTransport(handler), **{limit: 0.4}))
    assert [r.outcome for r in run.results] == ["ok", "ok", "timeout"]
    assert run.duration >= 0.4
    overall = lg.summarize(run)["overall"]
    assert overall["request_throughput"] <= 2 / 0.4 and overall["goodput_rps"] <= 2 / 0.4


_RUN_LOAD = inspect.signature(lg.run_load)  # (read before a test replaces it)


def _offered(monkeypatch, tmp_path, extra):
    """The summary's offered rate and the printed report of a run of a five-line trace (no server)."""
    async def fake_run_load(*args, **kwargs):
        call = _RUN_LOAD.bind(*args, **kwargs)
        call.apply_defaults()
        plan = call.arguments["plan"]
        results = [lg.RequestResult(p.index, p.tenant, p.arrival, p.prompt_len, p.max_tokens) for p in plan]
        return lg.RunResult(call.arguments["rate"], 1.0, results)

    monkeypatch.setattr(lg, "run_load", fake_run_load)
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"timestamp": 5 + 2 * k, "prompt_len": 3}) for k in range(5)))
    out = io.StringIO()
    doc = lg.run_benchmark(lg._parser().parse_args(["--trace", str(trace), "--model", "m", "--no-progress", *extra]),
                           out=out)
    return doc["runs"][0]["summary"]["rate"], out.getvalue()


def test_a_trace_replayed_at_its_own_pace_is_reported_at_its_own_rate(monkeypatch, tmp_path):
    """A trace of five requests two seconds apart is offered at 4 gaps / 8 s = 0.5 req/s when its timestamps are
    kept (the default).  Its report said "offered inf req/s", the label of ``--rates inf``, which sends the same
    five at once: two different loads, one label.  A rescaled trace keeps the rate it was asked for."""
    rate, text = _offered(monkeypatch, tmp_path, [])
    assert rate == pytest.approx(0.5) and "offered 0.5 req/s" in text
    rate, text = _offered(monkeypatch, tmp_path, ["--rates", "inf"])
    assert rate == float("inf") and "offered inf req/s" in text
    rate, _ = _offered(monkeypatch, tmp_path, ["--request-rate", "2"])
    assert rate == 2


# -- the preemption bench -------------------------------------------------------------------------------------


def test_preemption_refuses_a_kv_share_past_one_by_name(monkeypatch, capsys):
    """``--kv-share`` is a share of the blocks the whole batch needs at its peak.  A share past a float's range
    (1e308) sized the pool as ``int(inf)``: an OverflowError traceback.  Over 1 the pool holds every request and
    nothing is preempted, so the flag is refused where it is typed, naming itself."""
    from minivllm.bench import preemption

    monkeypatch.setattr(sys, "argv", ["minivllm.bench preemption", "--executor", "sim", "--requests", "4",
                                      "--kv-share", "1e308", "--modes", "reject"])
    with pytest.raises(SystemExit) as exc:
        preemption.main()
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --kv-share:" in err


# -- the replay grid ------------------------------------------------------------------------------------------


def _step(k, rows, num_decodes):
    from minivllm.metrics.step_log import StepRecord

    ids, starts, tokens = zip(*rows)
    return StepRecord(step=k, time=float(k), seq_ids=ids, seq_starts=starts, seq_tokens=tokens, num_tokens=sum(tokens),
                      preempted=(), swapped_out=0, swapped_in=0, rejected=(), failed=(), free_blocks=0,
                      available_blocks=0, running=len(rows), waiting=0, num_decodes=num_decodes)


def test_the_replay_grid_counts_a_step_as_chunked_only_when_it_continues_a_cut_prompt():
    """A hand-made log, counted by hand.  Step 1 carries the rest of A's 60-token prompt, cut at 40 in step 0
    (chunked), beside B's prompt whose first 32 tokens the prefix cache held (computed whole: not chunked).
    Step 2 decodes A and B (their rows start where their prompts ended, yet are decodes) and starts C's prompt;
    step 3 carries C's last prompt token alone (chunked, one token).  Step 5 is D's cache hit alone (not
    chunked).  The rule "a row of more than one token starting past 0" counted steps 1 and 5 and missed step 3."""
    from minivllm.bench import replay

    log = [_step(0, [("A", 0, 40)], 0),
           _step(1, [("A", 40, 20), ("B", 32, 10)], 0),
           _step(2, [("A", 60, 1), ("B", 42, 1), ("C", 0, 38)], 2),
           _step(3, [("A", 61, 1), ("B", 43, 1), ("C", 38, 1)], 2),
           _step(4, [("A", 62, 1), ("B", 44, 1), ("C", 39, 1)], 3),
           _step(5, [("D", 32, 9)], 0)]
    assert [replay.continued_prefill_steps(log[:k + 1]) for k in range(len(log))] == [0, 1, 1, 2, 2, 2]


def test_the_replay_grid_counts_no_chunked_steps_where_chunking_is_off(tmp_path):
    """``no_chunking`` computes every prompt in one step, so it has no chunked step to count; the mixed workload
    turns the prefix cache on, and its hits (prompts computed from past position 0) were counted as chunks: the
    committed 10-seed grid says 41, this stand-in model's seed 0 said 8 or 9 (its steps follow its clock).  The
    mixed ``auto`` setting, whose prompts of up to 100 tokens meet a 40-token budget, still counts some."""
    from minivllm.bench import replay
    from tests.paged_cases import make_tiny_llama

    tiny = make_tiny_llama(tmp_path)
    assert replay.run_case(tiny, "no_chunking", seed=0, shape="mixed")["chunked_prefill_steps"] == 0
    assert replay.run_case(tiny, "auto", seed=0, shape="mixed")["chunked_prefill_steps"] > 0


@pytest.mark.parametrize("name", ["", "a_file"])
def test_a_figures_path_that_names_no_directory_is_refused_before_the_run(monkeypatch, tmp_path, capsys, name):
    """``--figures ''`` ran the whole benchmark and wrote no figure, exit 0; ``--figures FILE`` ran it and then
    failed with "File exists".  Neither is a directory to write PNGs into: refused, naming the flag, with no run."""
    (tmp_path / "a_file").write_text("")
    monkeypatch.chdir(tmp_path)
    runs = []
    monkeypatch.setattr(lg, "run_benchmark", lambda args, out=None: runs.append(args))
    with pytest.raises(SystemExit) as exc:
        lg.main(["--model", "m", "--no-progress", "--figures", name])
    assert exc.value.code == 2 and runs == []
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --figures:" in err


def test_a_sweep_that_names_a_rate_twice_is_refused_before_it_runs(monkeypatch, capsys):
    """The sweep keeps one verdict per rate, so with ``--rates 1,1`` the row of a run whose p99 ITL was 500 ms
    against a 100 ms SLO printed "meets: yes" -- the other run's verdict -- under a line saying 1 req/s both meets
    the SLO and fails it.  A repeated rate is refused, naming the flag, before any run."""
    runs = []

    async def fake_run_load(*args, **kwargs):
        runs.append(args)
        return lg.RunResult(1.0, 1.0, [])

    monkeypatch.setattr(lg, "run_load", fake_run_load)
    assert lg.main(["--model", "m", "--no-progress", "--rates", "1,2,1", "--slo-itl-ms", "100"]) == 2
    err = capsys.readouterr().err
    assert "--rates" in err and "Traceback" not in err and runs == []
