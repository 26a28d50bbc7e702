"""``python -m minivllm.bench eager_step`` on the CPU: the step it times is the prompt step, and the profile
sees the model's own operators.

The oracle is the work itself: prefilling a 128-token prompt on the bundled model does the projections for
128 rows, a decode step for one, so the prompt step must take longer than a decode step of the same engine,
and its profile must count one fused QKV, one output, one gate/up and one down projection per layer (plus
the LM head once) -- the number of linear calls is fixed by the architecture, not by the timing.
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from minivllm.bench import eager_step
from minivllm.bench.eager_step import run
from minivllm.sim.presets import bundled_shape


def test_eager_step_times_the_prompt_step_and_profiles_the_model():
    # 128 prompt tokens: several times a decode step's work, so the comparison below survives a busy machine
    # (noise only adds time, so it compares the fastest of each)
    saved = []  # the checkpoints: each the result so far; the result itself is today's shape, no "unfinished"
    res = run(None, "cpu", "auto", prompt_len=128, repeats=2, gap_s=0.01, profile_steps=1, eager_decode=True,
              checkpoint=saved.append)
    assert "unfinished" not in res and [len(doc["unfinished"]) for doc in saved] == [7, 6, 5, 4, 3, 2, 1]
    assert saved[-1]["unfinished"] == ["decode_profile"] and set(saved[-1]) - {"unfinished"} < set(res)
    for key in ("back_to_back", "after_0.01s_idle", "back_to_back_gc_frozen", "decode_step"):
        s = res[key]
        assert 0 < s["min_ms"] <= s["p50_ms"] <= s["max_ms"], key
    assert res["back_to_back"]["min_ms"] > 2 * res["decode_step"]["min_ms"]
    assert res["profile"]["kernel_launches_per_step"] == 0  # no GPU: nothing is launched
    # the eager engine's decode step (the GPU's comparison with a graph; on a CPU there are no graphs to turn off)
    assert res["decode_step_eager"]["n"] > 0
    assert res["decode_step_eager"]["tensor_ops"] >= 8 * bundled_shape().num_layers
    # at least the four projections, two norms and two residual adds of every layer, each counted once
    assert res["profile"]["tensor_ops_per_step"] >= 8 * bundled_shape().num_layers
    linear = [e for e in res["profile"]["top_cpu_self"] if "linear" in e["op"] or e["op"] in ("aten::mm", "aten::addmm")]
    assert linear, res["profile"]["top_cpu_self"][:5]
    assert max(e["calls_per_step"] for e in linear) == 4 * bundled_shape().num_layers + 1
    # one decode step runs the same projections once (one row): the Python profile sees them, per step
    calls = {e["function"].split(" ")[0]: e["calls_per_step"] for e in res["decode_python"]}
    assert calls.get("linear") == 4 * bundled_shape().num_layers + 1, res["decode_python"][:5]


def test_a_time_boxed_run_keeps_the_measurements_it_finished(tmp_path, monkeypatch):
    """``tools/gpu_checks.sh`` time-boxes ``bench eager_step``; the result file used to be written only at the end,
    so a run killed after minutes of timing left nothing.  Oracle: ``run``'s docstring promise -- the file is
    rewritten after each finished measurement and names the ones still to come (a whole run's result, without
    ``unfinished``, is checked above).  The interruption: the third measurement raises
    KeyboardInterrupt (what a SIGINT does; a SIGTERM kills between writes, which are atomic)."""
    path = tmp_path / "eager.json"
    argv = ["--device", "cpu", "--prompt-len", "16", "--repeats", "2", "--gap", "0", "--profile-steps", "1",
            "--json", str(path)]
    with monkeypatch.context() as m:
        def killed(*args, **kwargs):
            raise KeyboardInterrupt

        m.setattr(eager_step, "full_collection_pause", killed)
        with pytest.raises(KeyboardInterrupt):
            eager_step.main(argv)
    doc = json.loads(path.read_text())
    for key in ("back_to_back", "after_0s_idle"):
        assert doc[key]["n"] >= 2 and 0 < doc[key]["min_ms"] <= doc[key]["max_ms"], key
    assert doc["unfinished"] == ["full_collection", "back_to_back_gc_frozen", "decode_step", "profile",
                                 "decode_profile"]
    assert doc["command"].startswith("python -m minivllm.bench eager_step") and "machine" in doc


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    """A random 2-layer Llama with 4096 positions (room for a prompt beyond the default 512-token step budget)."""
    transformers = pytest.importorskip("transformers")
    import torch

    path = tmp_path_factory.mktemp("llama_4k")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   intermediate_size=128, vocab_size=512, num_hidden_layers=2,
                                   max_position_embeddings=4096)
    transformers.LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)


def test_a_prompt_longer_than_the_default_budget_is_timed_as_one_step(monkeypatch, long_context_llama):
    """``--prompt-len 600``: the engine's step budget was the fixed 512 tokens, so chunked prefill split each prompt
    into 512 + 88 and the "prompt step" timed (and the tensor operations counted) was the first chunk's, while
    the result said ``prompt_len: 600``.  Oracle: the shape of every step the benchmark timed as a prompt step, as
    the engine recorded it -- one fresh sequence with all 600 tokens.  The measurements that do not time prompt
    steps are stand-ins (this test is about which step is timed)."""
    import minivllm.sim.calibrate as calibrate

    real_measure, timed = calibrate.measure, []

    def spy(engine, requests):
        samples, rec = real_measure(engine, requests)
        if requests[0].tenant == "p":
            timed.append([new for _, new, *_ in samples[0].seqs])
        return samples, rec

    monkeypatch.setattr(calibrate, "measure", spy)
    monkeypatch.setattr(eager_step, "full_collection_pause", lambda: {})
    monkeypatch.setattr(eager_step, "decode_step_stats", lambda engine, vocab, *a: {})
    monkeypatch.setattr(eager_step, "_profile_decode", lambda engine, acts, vocab: ({}, []))
    res = run(long_context_llama, "cpu", "auto", prompt_len=600, repeats=1, gap_s=0.0, profile_steps=1,
              eager_decode=False)
    assert res["prompt_len"] == 600 and res["back_to_back"]["n"] == 1
    assert timed and all(t == [600] for t in timed), timed


class _Stop(Exception):
    """Raised at the idle series: what ``run`` asked for is known by then, and nothing after it needs to run."""


def _idle_series_asked(monkeypatch, argv: list[str]) -> tuple[int, float]:
    """(steps, idle seconds) that ``main(argv)`` asks of its idle series; no model is loaded, no step timed."""
    import torch

    import minivllm.sim.calibrate as calibrate

    engine = SimpleNamespace(config=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32))
    calls = []

    def series(engine, prompt_len, repeats, vocab, gap_s=0.0):
        calls.append((repeats, gap_s))
        if len(calls) == 3:  # the warm-up, the back-to-back series, then the idle series
            raise _Stop
        return [1e-3] * repeats

    with monkeypatch.context() as m:
        m.setattr(calibrate, "real_engine", lambda **kwargs: engine)
        m.setattr(eager_step, "prompt_step_times", series)
        with pytest.raises(_Stop):
            eager_step.main(argv)
    return calls[2]


def _numbers(pattern: str, text: str, where: str) -> tuple[str, ...]:
    m = re.search(pattern, " ".join(text.split()))
    assert m, f"{where} no longer states {pattern!r}"
    return m.groups()


def test_the_idle_series_length_and_gap_are_the_ones_help_and_the_readme_state(monkeypatch, capsys):
    """The idle series' length (a share of ``--repeats``, with a floor) and ``--gap``'s default were stated
    nowhere, and a mutation pass changed either without a test failing.  Oracle: the numbers ``--help`` and
    benchmarks/README.md state, read from their text (both must agree), against what ``main`` asks of the
    idle series for several ``--repeats`` -- so changing the code or one text alone fails."""
    with pytest.raises(SystemExit):
        eager_step.main(["--help"])
    help_text = capsys.readouterr().out
    readme = (Path(__file__).resolve().parent.parent / "benchmarks" / "README.md").read_text(encoding="utf-8")
    stated = {
        "--help": (*_numbers(r"\(default (\d+)\); the idle series times 1/(\d+) as many, at least (\d+)",
                             help_text, "--help"),
                   *_numbers(r"each step of the idle series \(default ([\d.]+)\)", help_text, "--help")),
        "README": _numbers(r"`--repeats` times back to back \(default (\d+)\), then 1/(\d+) as many times, "
                           r"at least (\d+), each after `--gap` seconds idle \(default ([\d.]+)\)",
                           readme, "benchmarks/README.md"),
    }
    assert stated["--help"] == stated["README"], stated
    repeats, share, least = (int(x) for x in stated["README"][:3])
    gap = float(stated["README"][3])
    assert _idle_series_asked(monkeypatch, []) == (max(least, repeats // share), gap)
    for n in (1, 2, 8, 9, 10, 31, 60):
        assert _idle_series_asked(monkeypatch, ["--repeats", str(n)]) == (max(least, n // share), gap), n
    assert _idle_series_asked(monkeypatch, ["--gap", "0.25"])[1] == 0.25


def test_each_series_draws_prompts_no_earlier_series_drew():
    """With prefix caching on, a second series must still time whole prompts: each call's ids are new.

    Oracle: the step's own shape.  A prompt the cache had seen would arrive with its first blocks cached and
    carry fewer than ``prompt_len`` new tokens (16 of 64 when every call reused seed 0), which the function
    refuses.
    """
    from minivllm.sim.calibrate import real_engine

    engine = real_engine(max_num_batched_tokens=64, num_blocks=64, max_model_len=256, enable_prefix_caching=True)
    vocab = bundled_shape().vocab_size
    for _ in range(2):  # the warm-up, then a series
        assert len(eager_step.prompt_step_times(engine, 64, 2, vocab)) == 2
