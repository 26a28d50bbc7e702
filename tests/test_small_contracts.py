"""Small contracts an audit found broken, each pinned by a hand-written expectation."""

from __future__ import annotations

import pytest

from minivllm.bench.results import write_result
from minivllm.labs.widgets import colour_index, request_colour


def test_write_result_refuses_a_doc_that_would_replace_its_own_keys(tmp_path):
    """``write_result`` adds ``command`` (how to rerun) and ``machine`` (where it ran); a benchmark that put its
    own ``machine`` (``platform.machine()``, say) in the doc used to replace the machine facts silently."""
    with pytest.raises(ValueError, match="machine"):
        write_result(tmp_path / "r.json", {"machine": "x86_64", "value": 1}, "python -m minivllm.bench x", [])
    write_result(tmp_path / "ok.json", {"arch": "x86_64"}, "python -m minivllm.bench x", ["--flag"])
    import json

    doc = json.loads((tmp_path / "ok.json").read_text())
    assert doc["command"] == "python -m minivllm.bench x --flag" and "cpus" in doc["machine"] and doc["arch"] == "x86_64"


def test_a_result_rewrite_cut_off_half_way_leaves_the_file_before_it(tmp_path, monkeypatch):
    """``sim_accuracy`` rewrites its result (and profile) after each workload so that the time box that ends a GPU
    run keeps them; ``timeout`` kills it at any moment, a rewrite included.  Written in place, the file was
    truncated by ``open(path, "w")`` and left half-written: the checkpoint before it was lost too.  Oracle: the
    first write, read back after a second one is cut off half-way through its text."""
    import json

    from minivllm.bench import results

    path = tmp_path / "r.json"
    write_result(path, {"workloads": {"a": 1}}, "python -m minivllm.bench x", [])
    first = json.loads(path.read_text())

    def killed_half_way(obj, fh, **kw):
        fh.write(json.dumps(obj)[:20])
        fh.flush()
        raise KeyboardInterrupt  # stands for the SIGTERM: nothing after this line runs

    monkeypatch.setattr(results.json, "dump", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        write_result(path, {"workloads": {"a": 1, "b": 2}}, "python -m minivllm.bench x", [])
    monkeypatch.undo()
    assert json.loads(path.read_text()) == first
    # a link (like --out /dev/stdout) is written through, not replaced by a file of its own name
    link = tmp_path / "link.json"
    link.symlink_to(path)
    write_result(link, {"workloads": {}}, "python -m minivllm.bench x", [])
    assert link.is_symlink() and json.loads(path.read_text())["workloads"] == {}

def test_a_request_keeps_its_letter_colour_whatever_its_prefix():
    """The README figure names requests "req A", "req B", "req C": a trailing lone letter is the request's letter,
    so B and C get the colours B and C get everywhere else (before, both hashed to the same colour)."""
    assert [colour_index(n) for n in ("A", "req A", "req B", "req C", "x_b", "r7")] == [0, 0, 1, 2, 1, 7]
    assert len({request_colour(n) for n in ("req A", "req B", "req C")}) == 3


def test_a_cpu_profile_runs_in_the_simulator_with_the_engines_cpu_pool(capsys):
    """The README's flow, ``sim calibrate`` then ``sim run --hardware my-machine.json``: a CPU profile has no
    device memory, and the run used to stop with "no memory_bytes".  Its pool is now the real engine's CPU
    default (1 GiB), so the simulated engine has the blocks ``LLM()`` would have here."""
    from minivllm.kv.kv_cache import DEFAULT_CPU_KV_BYTES
    from minivllm.sim.presets import model_preset
    from minivllm.sim.roofline import RooflineExecutor
    from minivllm.sim.run import main

    assert main(["--hardware", "cpu-2core", "--model", "smollm2-135m", "--num-requests", "5"]) == 0
    shape = model_preset("smollm2-135m")
    blocks = DEFAULT_CPU_KV_BYTES // RooflineExecutor(shape, None, block_size=16).kv_bytes_per_block
    assert f"KV blocks {blocks} " in capsys.readouterr().out


def test_sim_run_takes_a_profiles_spec_and_date_from_one_read(tmp_path, monkeypatch, capsys):
    """``sim run --hardware PROFILE`` prints the profile's date beside the simulated hardware's name.  It read the
    file twice (once for the spec, once for the date), so a profile rewritten between the reads (a calibration
    finishing beside the run) was reported with the other file's date.  Oracle: the first file's own name and
    date, written here by hand; the file is replaced with another right after its first read."""
    import json

    from minivllm.sim import presets
    from minivllm.sim.run import main

    doc = json.loads(open(presets.profile_path("cpu-2core"), encoding="utf-8").read())
    first = {**doc, "date_utc": "2026-01-01T00:00:00Z", "hardware": {**doc["hardware"], "name": "first-host"}}
    second = {**doc, "date_utc": "2026-02-02T00:00:00Z", "hardware": {**doc["hardware"], "name": "second-host"}}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(first))
    real, reads = presets.load_profile, []

    def load_then_replace(name):
        reads.append(name)
        loaded = real(name)
        path.write_text(json.dumps(second))  # the file changes under the run after each read
        return loaded

    monkeypatch.setattr(presets, "load_profile", load_then_replace)
    assert main(["--hardware", str(path), "--model", "smollm2-135m", "--num-requests", "3"]) == 0
    out = capsys.readouterr().out
    assert "on first-host |" in out and "2026-01-01T00:00:00Z" in out and "2026-02-02" not in out
    assert len(reads) == 1


def test_sim_run_notes_a_profiles_date_only_for_a_profile(capsys):
    """The note under ``sim run``'s headline ("the profile describes the host and engine it was measured on, DATE")
    is for a calibration profile, a snapshot of one host; a datasheet preset has no date and no host to re-check.
    ``hardware_and_profile`` tells the two apart by its second value, None for a preset: a preset given any other
    value (an empty profile) printed the note with "an unrecorded date" and no test noticed.  Oracle: the committed
    profile file's own date, read here as JSON."""
    import json

    from minivllm.sim import presets
    from minivllm.sim.run import main

    assert main(["--hardware", "h100", "--model", "smollm2-135m", "--num-requests", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("== simulated: smollm2-135m on h100 |")
    assert "the profile describes" not in out and "calibrate --check" not in out
    date = json.loads(open(presets.profile_path("cpu-2core"), encoding="utf-8").read())["date_utc"]
    assert main(["--hardware", "cpu-2core", "--model", "smollm2-135m", "--num-requests", "3"]) == 0
    out = capsys.readouterr().out
    assert f"measured on, {date};" in out and "calibrate --check cpu-2core" in out


def test_a_checker_hint_follows_the_symptom_when_the_case_can_diagnose_it():
    """One case catches several bugs; ``diagnose`` picks the hint for the one the answer shows, and a case
    without a diagnosis for that answer falls back to its own hint."""
    from minivllm.labs.checkers import Case, run_checks

    case = Case("sign", lambda f: f(3), 3, hint="the usual mistake",
                diagnose=lambda got: "negative: drop the minus" if got == -3 else None)
    negative = run_checks("t", lambda x: -x, [case], verbose=False)
    other = run_checks("t", lambda x: x + 1, [case], verbose=False)
    assert not negative and "  hint: negative: drop the minus" in negative.lines
    assert not other and "  hint: the usual mistake" in other.lines
    assert run_checks("t", lambda x: x, [case], verbose=False)


def test_every_seam_of_the_engine_and_the_facade_is_a_protocol_from_interfaces():
    """The architecture's rule, checked: what a caller may replace is typed by a Protocol of
    minivllm/interfaces.py (a reader finds every contract in one file), and the real objects satisfy them."""
    import typing

    from minivllm import LLM, LLMEngine
    from minivllm.interfaces import Tokenizer
    from minivllm.model.loader import load_tokenizer, resolve_model_dir

    seams = ("executor", "tokenizer", "admission_policy", "preemption_policy", "prefix_cache", "preemption_cost_model")
    for cls in (LLMEngine, LLM):
        hints = typing.get_type_hints(cls.__init__)
        for name in seams:
            kinds = [a for a in typing.get_args(hints[name]) if a not in (type(None), str)]
            assert kinds, (cls.__name__, name, hints[name])
            for kind in kinds:
                assert getattr(kind, "_is_protocol", False) and kind.__module__ == "minivllm.interfaces", \
                    (cls.__name__, name, kind)
    assert isinstance(load_tokenizer(resolve_model_dir(None)), Tokenizer)


def test_lab6_deadline_checker_names_where_two_start_orders_part():
    from minivllm.labs.check_lab06 import _first_difference

    assert "start 2: yours started bulk-0, the engine chat-1" in _first_difference(
        (("chat-0", "bulk-0", "chat-1"), 63), (("chat-0", "chat-1", "bulk-0"), 63))
    assert "62 requests finished, not 63" in _first_difference((("a",), 62), (("a",), 63))
    assert _first_difference((("a",), 63), (("a",), 63)) is None and _first_difference("junk", (("a",), 63)) is None


def test_stats_has_exactly_the_keys_its_typed_definition_names():
    """``EngineStats`` is the one definition of what ``stats()`` holds: a key added, renamed or dropped on one
    side only fails here (with and without a prefix cache, whose keys are the optional ones)."""
    from minivllm import EngineConfig, LLMEngine, SamplingParams
    from minivllm.metrics.engine_stats import EngineStats, TenantStats
    from minivllm.sim import SimulatedExecutor

    for prefix in (False, True):
        engine = LLMEngine(EngineConfig(device="cpu", num_gpu_blocks_override=16, enable_prefix_caching=prefix),
                           executor=SimulatedExecutor(), model_max_len=64, eos_token_ids=set())
        engine.add_request({"prompt_token_ids": [5] * 20}, SamplingParams(max_tokens=3, ignore_eos=True))
        engine.step()
        stats = engine.stats()
        required, optional = EngineStats.__required_keys__, EngineStats.__optional_keys__
        assert set(stats) == (required | optional if prefix else required)
        assert set(stats["per_tenant"]["default"]) == set(TenantStats.__annotations__)


def test_a_checker_names_the_keys_a_long_dict_answer_gets_wrong():
    """A failed case prints expected and got cut at 300 characters, which can cut off the one wrong field of a
    long dict (lab 8's metrics); a ``differs`` line names it.  Short dicts print whole and need no such line."""
    from minivllm.labs.checkers import Case, run_checks

    want = {f"field_{i:02d}": float(i) for i in range(30)}
    got = dict(want, field_29=-1.0, extra=0)
    del got["field_03"]
    result = run_checks("t", lambda: got, [Case("c", lambda f: f(), want)], verbose=False)
    assert not result and len(repr(want)) > 300
    assert "  differs:  'field_03' missing; 'field_29': expected 29.0, got -1.0; 'extra' not expected" in result.lines
    short = run_checks("t", lambda: {"a": 2}, [Case("c", lambda f: f(), {"a": 1})], verbose=False)
    assert not short and not any(line.startswith("  differs") for line in short.lines)
    # a short answer to a long expected dict: the expected line is the one cut, so the missing keys need naming
    few = run_checks("t", lambda: {"field_00": 0.0}, [Case("c", lambda f: f(), want)], verbose=False)
    assert len(repr({"field_00": 0.0})) <= 300
    assert any(line.startswith("  differs:  'field_01' missing;") and "'field_29' missing" in line for line in few.lines)
    # a list field one item short (lab 8's ITLs) is a difference, though every item it has is right
    gaps = dict(want, field_07=[0.1, 0.2, 0.3])
    short_list = run_checks("t", lambda: dict(gaps, field_07=[0.1, 0.2]), [Case("c", lambda f: f(), gaps)], verbose=False)
    assert "  differs:  'field_07': expected [0.1, 0.2, 0.3], got [0.1, 0.2]" in short_list.lines, short_list.lines


def test_a_diagnosis_that_cannot_read_the_answer_falls_back_to_the_hint():
    """A learner's answer can be anything; a case's diagnose must never turn a failed case into a crash."""
    from minivllm.labs.checkers import Case, run_checks

    case = Case("c", lambda f: f(), 1, hint="the plain hint", diagnose=lambda got: got[0][5])
    result = run_checks("t", lambda: 0, [case], verbose=False)
    assert not result and "  hint: the plain hint" in result.lines


def test_percentile_rules_against_their_definitions():
    """nearest_rank: the smallest sample with at least q% of the samples at or below it (brute force, exact
    arithmetic: 7% of 100 samples is 7 of them, not 8); interpolated: numpy's default linear method."""
    from fractions import Fraction

    import numpy as np

    from minivllm.metrics.stats import interpolated, nearest_rank

    for n in (1, 2, 3, 7, 10, 99, 100, 101, 150, 201, 1000):
        values = [(7 * i) % n for i in range(n)]  # a shuffled 0..n-1
        for q in (0, 1, 5, 7, 33.3, 50, 90, 95, 99, 99.9, 100):
            brute = min(v for v in values if Fraction(sum(x <= v for x in values), n) * 100 >= Fraction(str(q)))
            assert nearest_rank(values, q) == brute, (n, q)
            assert interpolated(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12), (n, q)
    assert nearest_rank([], 50, None) is None and interpolated([], 50, 0.0) == 0.0


def test_the_engine_sizes_and_prices_from_what_an_executor_says_it_is():
    """An executor's optional protocols (minivllm.interfaces): a SimulatedDevice's block size in bytes sizes
    the pool and its link prices a swap; one that says nothing gets the engine's defaults; PricesRecompute
    supplies the auto mode's cost model.  The oracle is the arithmetic the protocols document."""
    from dataclasses import dataclass

    from minivllm import EngineConfig, LLMEngine
    from minivllm.config import PCIE4_X16_BYTES_PER_S
    from minivllm.engine.llm_engine import SIM_BYTES_PER_TOKEN
    from minivllm.interfaces import PricesRecompute, SimulatedDevice, VirtualClock, implements
    from minivllm.sched.scheduler import PreemptionCosts
    from minivllm.sim import SimulatedExecutor

    class Bare:  # an Executor and nothing more
        def __init__(self):
            self.inner = SimulatedExecutor()

        def execute(self, batch):
            return self.inner.execute(batch)

        def now(self):
            return self.inner.now()

    @dataclass
    class Priced(SimulatedExecutor):
        def preemption_cost_model(self, chunk: int):
            return PreemptionCosts(self.kv_bytes_per_block, self.swap_bytes_per_s, float(chunk))

    def engine(executor):
        cfg = EngineConfig(kv_cache_memory_bytes=1 << 22, block_size=16, preemption_mode="auto", device="cpu",
                           max_num_batched_tokens=96)
        return LLMEngine(cfg, executor=executor, model_max_len=256)

    device = SimulatedExecutor(kv_bytes_per_block=1 << 16, swap_bytes_per_s=7e9)
    assert implements(device, SimulatedDevice) and not implements(Bare(), SimulatedDevice)
    sized = engine(device)
    assert sized.pool.num_blocks == (1 << 22) // (1 << 16)
    assert (sized.scheduler.costs.bytes_per_block, sized.scheduler.costs.swap_bytes_per_s) == (1 << 16, 7e9)
    bare = engine(Bare())
    assert bare.pool.num_blocks == (1 << 22) // (16 * SIM_BYTES_PER_TOKEN)
    assert bare.scheduler.costs.swap_bytes_per_s == PCIE4_X16_BYTES_PER_S
    priced = Priced(kv_bytes_per_block=1 << 16)
    assert implements(priced, PricesRecompute)
    assert engine(priced).scheduler.costs.prefill_tokens_per_s == 96.0  # the model built from the token budget

    class Forwarding:  # a wrapper that forwards what it lacks (as calibrate's RecordingExecutor does)
        def __init__(self, inner):
            self.inner = inner

        def execute(self, batch):
            return self.inner.execute(batch)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    wrapped = Forwarding(device)  # counts as what it wraps, on every Python (isinstance would not on 3.12+)
    assert implements(wrapped, SimulatedDevice) and implements(wrapped, VirtualClock)
    assert engine(wrapped).pool.num_blocks == (1 << 22) // (1 << 16)
    assert not implements(Forwarding(Bare()), VirtualClock)


def test_a_batch_builder_replaces_step_2_and_its_answer_is_checked_at_the_boundary():
    """The BatchBuilder seam (minivllm.interfaces): a builder that answers as the scheduler's own step 2 does
    (lab 4's fallback, engine_build_batch) schedules every step the same; a wrong answer is a ValueError that
    names it, and the engine, given its own step 2 back, drains with no block leaked."""
    import pytest

    from minivllm import SamplingParams
    from minivllm.labs.check_lab04 import WithLimits, engine_build_batch, install_batch_builder
    from minivllm.labs.workloads import random_requests, run_engine, sim_engine

    from invariants import assert_no_leak, drain

    def engine(**kw):
        return sim_engine(num_blocks=96, block_size=8, max_num_seqs=6, max_num_batched_tokens=40, model_max_len=512,
                          long_prefill_token_threshold=24, **kw)

    reqs = random_requests(12, seed=3, prompt_range=(3, 150), output_range=(2, 20))
    own, built = engine(), engine(batch_builder=engine_build_batch)
    assert run_engine(own, reqs).keys() == run_engine(built, reqs).keys() == {f"r{i}" for i in range(12)}
    assert [e["seqs"] for e in own.step_log] == [e["seqs"] for e in built.step_log]

    def twice(running, budget, threshold):
        return [(running[0], 1), (running[0], 1)]

    def empty_row(running, budget, threshold):
        return [(running[0], 0)]

    def greedy(running, budget, threshold):
        return [(r, r.num_uncomputed_tokens) for r in running]

    stranger = engine()
    stranger.add_request({"prompt_token_ids": [5] * 4}, None, "x")
    stranger.step()  # admitted: a running request, of another engine

    def foreign(running, budget, threshold):
        return [(stranger.scheduler.running[0], 1)]

    for builder, says in ((twice, "appears twice"), (empty_row, "0 tokens"), (greedy, "over the budget of 40"),
                          (foreign, "not a running request"), (WithLimits(greedy, budget=8), "over the budget of 8")):
        eng = engine(batch_builder=builder)
        for i, (prompt, n) in enumerate(reqs[:4]):
            eng.add_request({"prompt_token_ids": prompt}, None, f"r{i}")
        with pytest.raises(ValueError, match=says):
            eng.step()
        install_batch_builder(eng, engine_build_batch)  # the engine's own answer from here on
        assert len(drain(eng)) == 4
        assert_no_leak(eng)

    # a step that fails in step 2 hands nothing over: a request admission turned away in it is reported next step
    from minivllm.config import TenantConfig

    from invariants import tiny_engine

    eng = tiny_engine(num_blocks=60, scheduling_policy="caps", tenants={"bulk": TenantConfig(max_running=1, over_cap="reject")})
    install_batch_builder(eng, engine_build_batch)
    eng.add_request({"prompt_token_ids": [7] * 8}, SamplingParams(max_tokens=10, ignore_eos=True), "b0", tenant="bulk")
    eng.step()
    eng.add_request({"prompt_token_ids": [7] * 8}, SamplingParams(max_tokens=4, ignore_eos=True), "b1", tenant="bulk")
    install_batch_builder(eng, twice)
    with pytest.raises(ValueError, match="appears twice"):
        eng.step()  # (b1 is rejected by its cap in step 1 of this step)
    install_batch_builder(eng, engine_build_batch)
    outs = {o.request_id: o for o in eng.step()}
    assert outs["b1"].finished and outs["b1"].outputs[0].finish_reason == "rejected"
    assert drain(eng)["b0"].outputs[0].finish_reason == "length"
    assert_no_leak(eng)


def test_a_wrong_object_for_a_seam_is_refused_when_the_engine_is_built():
    """Each seam is checked against its protocol's members when the engine is built (a ValueError naming what
    is missing), not discovered as an AttributeError inside a later step; a class passed for an instance is
    named as such.  Every object the course plugs in passes: the engine's own and the learner's assembled ones."""
    import pytest

    from minivllm.interfaces import PrefixCache, check_seam, seam_members
    from minivllm.kv.block_pool import BlockPool
    from minivllm.kv.prefix.hash_index import HashIndex
    from minivllm.kv.prefix.learner import LearnerHashCache
    from minivllm.kv.prefix.radix import RadixCache
    from minivllm.labs.workloads import sim_engine
    from minivllm.sched.fairness import FCFSAdmission

    class OrderOnly:
        def order(self, waiting, running):
            return list(waiting)

    class NoOrder:
        def rank(self, req):
            return 0

    sim_engine(admission_policy=OrderOnly())  # the whole required contract: accepted
    with pytest.raises(ValueError, match="admission_policy=NoOrder does not implement AdmissionPolicy .*it has no order"):
        sim_engine(admission_policy=NoOrder())
    with pytest.raises(ValueError, match="got the class FCFSAdmission itself"):
        sim_engine(admission_policy=FCFSAdmission)
    with pytest.raises(ValueError, match="batch_builder=int .*no __call__"):
        sim_engine(batch_builder=3)
    from minivllm.labs.check_lab04 import install_batch_builder

    engine = sim_engine()
    with pytest.raises(ValueError, match="batch_builder=int .*no __call__"):  # lab 4's swap on a built engine too
        install_batch_builder(engine, 3)
    assert engine.scheduler.batch_builder is None  # and the engine keeps its own step 2
    pool = BlockPool(8)
    for cache in (HashIndex(pool, 16), RadixCache(pool, 16), LearnerHashCache(pool, 16, None, None, None)):
        check_seam("prefix_cache", cache, PrefixCache)
    assert {"match", "insert", "evict", "reset", "stats"} <= set(seam_members(PrefixCache))


def test_an_executor_wrapper_is_put_in_when_the_engine_is_built():
    """A measuring layer (calibrate's ``RecordingExecutor``) is given to the engine at construction, so it also
    wraps the model runner the engine builds for itself, and nobody replaces the executor of a built engine.
    Oracle: the step log -- the recorder saw exactly the batches the engine logged, in order.  A wrapper that
    returns None, or something that is not an executor, is refused when the engine is built."""
    import pytest

    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.sampling_params import SamplingParams
    from minivllm.sim.calibrate import RecordingExecutor
    from minivllm.sim.executor import SimulatedExecutor
    from tests.invariants import steps

    def build(wrapper):
        cfg = EngineConfig(max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks_override=64, device="cpu")
        return LLMEngine(cfg, executor=SimulatedExecutor(), model_max_len=1024, eos_token_ids=set(),
                         executor_wrapper=wrapper)

    engine = build(RecordingExecutor)
    assert isinstance(engine.executor, RecordingExecutor) and isinstance(engine.executor.inner, SimulatedExecutor)
    for i, n in enumerate((100, 30, 7)):
        engine.add_request(list(range(10, 10 + n)), SamplingParams(max_tokens=5, temperature=0.0), f"r{i}")
    for _ in steps(engine):
        pass
    logged = [[(s, n) for _, s, n in rec.seqs] for rec in engine.step_log if rec.seq_ids]
    recorded = [[(s, n) for s, n, _ in seqs] for seqs, _ in engine.executor.batches]
    assert recorded == logged and len(logged) == 7  # 137 prompt tokens under a 64-token budget, then decodes
    with pytest.raises(ValueError, match="executor_wrapper returned None"):
        build(lambda inner: None)
    with pytest.raises(ValueError, match="executor_wrapper's result=str does not implement Executor"):
        build(lambda inner: "not an executor")


def test_serve_freezes_its_start_up_heap_once_the_engine_is_built(monkeypatch, capsys):
    """``minivllm serve`` owns its process, so once the engine and the app are built it freezes everything alive
    out of the cyclic garbage collector (:mod:`minivllm.engine.startup`: a full collection then skips the
    model's objects).  Oracle: the collector's own lists -- the engine built before the freeze is in none of its
    generations until it is unfrozen.  (The model and uvicorn are stand-ins: nothing loads, nothing listens.)"""
    import gc

    import uvicorn

    import minivllm
    from minivllm.cli import main

    from invariants import tiny_engine  # noqa: E402  (tests/ is on sys.path)

    built = []

    class StandIn:
        def __init__(self, model, **options):
            self.engine = tiny_engine()
            built.append(self.engine)

        def close(self):
            pass

    monkeypatch.setattr(minivllm, "LLM", StandIn)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *args, **kwargs: None)
    assert gc.get_freeze_count() == 0
    try:
        assert main(["serve", "--port", "8011"]) == 0
        assert gc.get_freeze_count() > 1000
        assert not any(obj is built[0] for obj in gc.get_objects()), "the engine is still in a collected generation"
        assert "start-up objects frozen out of the garbage collector" in capsys.readouterr().err
    finally:
        gc.unfreeze()
    assert any(obj is built[0] for obj in gc.get_objects())


@pytest.mark.parametrize("vocab", [10, 5, 0, True])
def test_a_vocabulary_the_fake_tokens_cannot_draw_from_is_refused_where_it_is_configured(vocab):
    """The simulator's "sampled" tokens skip ids 0-9 (EOS/BOS/pad): with 10 ids or fewer the old code divided by
    zero at the first sampled token (vocab 10) or produced ids outside the vocabulary (vocab 5 gave ids >= 10).
    Each configuration point now says so by name, before a step runs."""
    from minivllm.sim.executor import SimulatedExecutor
    from minivllm.sim.replay import ReplayExecutor
    from minivllm.sim.roofline import ModelShape

    for make in (lambda: SimulatedExecutor(vocab_size=vocab), lambda: ReplayExecutor(times=[], vocab_size=vocab),
                 lambda: ModelShape(name="tiny", num_layers=1, hidden_size=8, intermediate_size=8, num_heads=2, num_kv_heads=1,
                                    head_dim=4, vocab_size=vocab)):
        with pytest.raises(ValueError, match="vocab_size"):
            make()


def test_the_smallest_vocabulary_allowed_still_gives_tokens_inside_it():
    from minivllm.sim.roofline import fake_token

    assert {fake_token(f"r{i}", p, 11) for i in range(20) for p in range(20)} == {10}  # by hand: ids 10 .. 10


def _bool_refusals():
    from dataclasses import replace

    from minivllm.server.door import DoorRule
    from minivllm.sim.fleet import ChatMix
    from minivllm.sim.presets import hardware_preset
    from minivllm.sim.router import PrefixAffinityRouter

    h100 = hardware_preset("h100")
    return {
        "door max_waiting": lambda v: DoorRule(max_waiting=v),
        "door min_free_blocks": lambda v: DoorRule(max_waiting=4, min_free_blocks=v),
        "router spill_factor": lambda v: PrefixAffinityRouter(2, spill_factor=v),
        "chat mix rate": lambda v: ChatMix(rate=v),
        "chat mix turns": lambda v: ChatMix(turns=v),
        "hardware attention roof": lambda v: replace(h100, attention_flops=v),
    }


@pytest.mark.parametrize("where", sorted(_bool_refusals()))
def test_a_bool_is_not_a_number_at_any_boundary(where):
    """``True`` is an ``int`` to Python: these checks took it as 1 (a one-deep door, a spill factor of 1, one
    turn, ...), unlike every other boundary, which shares :func:`minivllm.argtypes.is_int` / ``is_real``.
    The same call with a real 1 (or 2) passes: the refusal is of the type, not the value."""
    make = _bool_refusals()[where]
    with pytest.raises(ValueError):
        make(True)
    make(2 if where != "door min_free_blocks" else 1)


@pytest.mark.parametrize("make", [
    lambda: __import__("minivllm.config", fromlist=["TenantConfig"]).TenantConfig(weight=10**400),
    lambda: __import__("minivllm.config", fromlist=["EngineConfig"]).EngineConfig(wfq_prefill_weight=10**400),
    lambda: __import__("minivllm.config", fromlist=["EngineConfig"]).EngineConfig(stall_timeout_s=10**400),
    lambda: __import__("minivllm.config", fromlist=["EngineConfig"]).EngineConfig(swap_bandwidth_gbps=10**400),
    lambda: __import__("minivllm.config", fromlist=["EngineConfig"]).EngineConfig(prefill_tokens_per_s=10**400),
], ids=["tenant weight", "wfq_prefill_weight", "stall_timeout_s", "swap_bandwidth_gbps", "prefill_tokens_per_s"])
def test_an_int_no_float_holds_is_refused_when_the_config_is_built(make):
    """``10**400 < float("inf")`` is True in Python, so these finite-looking checks took an int past float's range,
    and the first use of it as a float (a WFQ share, a watchdog deadline, the swap cost model) raised
    OverflowError mid-run or when the engine was built."""
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("field", ["weight", "stall_timeout_s", "wfq_decode_weight"])
def test_a_config_refusal_names_its_field_even_for_an_int_too_long_to_write(field):
    """Python refuses to write an int of more than 4,300 digits in decimal (its own ValueError, naming nothing):
    quoted with ``repr``, the refusal lost the field's name."""
    from minivllm.config import EngineConfig, TenantConfig

    make = TenantConfig if field == "weight" else EngineConfig
    with pytest.raises(ValueError, match=field):
        make(**{field: 10**5000})
