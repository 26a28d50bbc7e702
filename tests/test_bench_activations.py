"""``minivllm.bench.activations``: the activation meter against a brute-force oracle, and the bundled model.

The oracle is an independent model of what must be alive: a random program of tensor operations (new
tensors, copies, views, in-place updates, concatenations, dropped references) run once under the meter and
once as plain bookkeeping -- each handle names the storage it reads through, a storage is live while some
handle names it, and only storages created inside the meter count.  Three planted bugs (never subtracting a
freed storage, counting a view of a counted storage again, counting views of tensors that existed before)
must each disagree with it.  On the real model the peak must grow exactly linearly with the tokens of the
step and match the count of what the decoder layer keeps alive (``analytic_bytes_per_token``).
"""

import json
import random

import pytest
import torch

from minivllm.bench.activations import (
    ActivationMeter,
    analytic_bytes_per_token,
    budget_room,
    fit_line,
)

F32 = 4


def test_meter_counts_a_hand_built_sequence():
    before = torch.ones(250)  # exists before the meter: never counts, nor do its views or in-place updates
    with ActivationMeter() as m:
        a = torch.ones(1000)            # +4000 -> 4000
        b = a * 2                       # +4000 -> 8000
        v = b.view(10, 100)             # a view: +0
        c = v.t().contiguous()          # a copy: +4000 -> 12000
        w = before.view(5, 50)          # a view of an old tensor: +0
        before.add_(1)                  # in place on an old tensor: +0
        del a                           # -4000 -> 8000
        d = torch.empty(500, dtype=torch.float64)  # +4000 -> 12000
        b.add_(1)                       # in place: +0
        del b                           # v still holds b's storage: 12000
        del v                           # now it goes: -4000 -> 8000
        e = torch.cat([c.flatten(), d.float()])   # temp d.float() +2000, cat +6000 -> 16000; temp freed -> 14000
        live_inside = m.live
    assert (m.peak, live_inside, m.num_storages) == (16000, 14000, 6)
    assert m.allocated == 4000 * 4 + 2000 + 6000
    assert w.shape == (5, 50) and c.shape == (100, 10) and e.numel() == 1500


def _program(seed: int, steps: int = 60):
    """A random sequence of tensor operations, as ``(kind, args)`` tuples."""
    rng = random.Random(seed)
    ops = []
    handles = 3  # three tensors made before the meter
    for _ in range(steps):
        kind = rng.choice(["new", "new", "copy", "view", "inplace", "drop", "drop", "cat"])
        if kind in ("copy", "view", "inplace", "drop") and handles == 0:
            kind = "new"
        if kind == "new":
            ops.append(("new", rng.randint(1, 400)))
            handles += 1
        elif kind == "cat":
            if handles == 0:
                continue
            ops.append(("cat", rng.randrange(handles), rng.randrange(handles)))
            handles += 1
        elif kind == "drop":
            ops.append(("drop", rng.randrange(handles)))
            handles -= 1
        else:
            ops.append((kind, rng.randrange(handles)))
            handles += kind != "inplace"
    return ops


def _run(program, meter_cls) -> tuple[list[int], int, list[int]]:
    """Run ``program`` under ``meter_cls`` and, independently, as bookkeeping; ``(live after each op, peak)``
    for both: ``(meter_live, meter_peak, oracle_live)`` with the oracle's peak = max(oracle_live)."""
    tensors = [torch.zeros(7), torch.zeros(11), torch.zeros(13)]
    label = [("old", 0), ("old", 1), ("old", 2)]  # the storage each handle reads through
    size = {}  # storage label -> bytes, for storages created inside the meter
    counter = 0
    meter_live, oracle_live = [], []
    with meter_cls() as m:
        for op in program:
            if op[0] == "new":
                tensors.append(torch.zeros(op[1]))
                counter += 1
                label.append(("new", counter))
                size[label[-1]] = op[1] * F32
            elif op[0] == "copy":
                t = tensors[op[1]] * 1.5
                tensors.append(t)
                counter += 1
                label.append(("new", counter))
                size[label[-1]] = t.numel() * F32
                del t
            elif op[0] == "view":
                src = tensors[op[1]]
                tensors.append(src[: max(1, src.numel() // 2)])
                label.append(label[op[1]])
                del src
            elif op[0] == "inplace":
                tensors[op[1]].mul_(2)
            elif op[0] == "drop":
                tensors.pop(op[1])
                label.pop(op[1])
            elif op[0] == "cat":
                t = torch.cat([tensors[op[1]], tensors[op[2]]])
                tensors.append(t)
                counter += 1
                label.append(("new", counter))
                size[label[-1]] = t.numel() * F32
                del t
            meter_live.append(m.live)
            oracle_live.append(sum(size[k] for k in set(label) if k in size))
    return meter_live, m.peak, oracle_live


@pytest.mark.parametrize("seed", range(12))
def test_meter_agrees_with_brute_force_bookkeeping(seed):
    meter_live, peak, oracle_live = _run(_program(seed), ActivationMeter)
    assert meter_live == oracle_live
    assert peak == max(oracle_live)


class _NeverFrees(ActivationMeter):
    def _release(self, key, nbytes):  # planted bug: a freed storage stays live
        self._tracked.pop(key, None)


class _CountsViewsAgain(ActivationMeter):
    def _is_new(self, storage, input_storages):  # planted bug: every output counts, views included
        return True


class _CountsOldViews(ActivationMeter):
    def _is_new(self, storage, input_storages):  # planted bug: views of tensors made before the meter count
        return id(storage) not in self._tracked


@pytest.mark.parametrize("bug", [_NeverFrees, _CountsViewsAgain, _CountsOldViews], ids=lambda c: c.__name__)
def test_planted_bugs_disagree_with_the_oracle(bug):
    wrong = 0
    for seed in range(12):
        meter_live, peak, oracle_live = _run(_program(seed), bug)
        wrong += meter_live != oracle_live or peak != max(oracle_live)
    assert wrong >= 6, f"{bug.__name__} went unnoticed on {12 - wrong} of 12 programs"


def test_fit_line_and_the_budget_arithmetic():
    slope, fixed = fit_line({16: 16 * 300 + 50, 64: 64 * 300 + 50, 1000: 1000 * 300 + 50})
    assert slope == pytest.approx(300) and fixed == pytest.approx(50)
    from minivllm.sim.presets import hardware_preset, model_preset

    big, h100 = model_preset("llama-3-8b"), hardware_preset("h100")
    assert analytic_bytes_per_token(big) == (3 * 4096 + 4 * 14336) * 2 + 2 * 128 * 4  # cos/sin rows stay fp32
    lo, hi = budget_room(big, h100, 0.8), budget_room(big, h100, 0.95)
    # weights + KV + room = the whole device (81,559 MiB as the card reports it), at any share; 15 points of
    # share = 15 % of it
    for r in (lo, hi):
        assert r["weights_bytes"] + r["kv_bytes"] + r["room_bytes"] == pytest.approx(81_559 * 2**20, abs=2)
    assert lo["room_bytes"] - hi["room_bytes"] == pytest.approx(0.15 * 81_559 * 2**20, abs=2)
    assert lo["budget_tokens"] == lo["room_bytes"] // analytic_bytes_per_token(big)


@pytest.mark.slow
def test_bench_measures_the_bundled_model(tmp_path):
    """The peak of one prefill forward is linear in its tokens, through the origin, and equals the count of what
    the decoder keeps alive at its widest point (tolerance 2 %; it is exact on the engine as written)."""
    from minivllm.bench.activations import main, run
    from minivllm.sim.presets import bundled_shape

    res = run((16, 48, 160))
    peaks = {int(n): p for n, p in res["peak_bytes"].items()}
    assert list(peaks) == [16, 48, 160] and peaks[16] < peaks[48] < peaks[160]
    per_token = analytic_bytes_per_token(bundled_shape())
    assert res["analytic_bytes_per_token"] == per_token
    assert res["bytes_per_token"] == pytest.approx(per_token, rel=0.02)
    assert abs(res["fixed_bytes"]) < 0.02 * peaks[16]
    for n, p in peaks.items():  # and not with the number of layers: far below one layer's width x 30 layers
        assert p < 2 * n * per_token
    out = tmp_path / "act.json"
    assert main(["--tokens", "16", "32", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "activations" and set(doc["peak_bytes"]) == {"16", "32"}


@pytest.mark.parametrize("arch,dtype,intermediate", [
    ("llama", torch.bfloat16, 1024),  # the MLP is widest; RoPE's cos/sin rows are fp32 even in a bf16 model
    ("llama", torch.bfloat16, 96),    # RoPE is widest: _rotate works in fp32 (five fp32 tensors)
    ("llama", torch.float32, 96),     # RoPE is widest in fp32 too when the MLP is narrow (four: no upcast)
    ("qwen3", torch.float32, 96),     # Qwen3 rotates q alone, after its per-head norm
])
def test_analytic_count_equals_the_meter_whichever_point_of_the_layer_is_widest(tmp_path, arch, dtype, intermediate):
    """The count is what the lab and ``budget_room`` apply to models nobody ran, so it must hold beyond the
    bundled fp32 model: it once counted only the MLP point, with cos/sin in the model's dtype, and came out 20 %
    low for SmolLM2 in bf16 (16,000 B/token against 20,096 measured; bf16 is the GPU default) and 6 % low for
    Qwen3-0.6B widths in fp32.  Oracle: the meter on the real engine, one prefill forward of a random model."""
    from minivllm.bench.activations import make_engine, prefill_peaks
    from minivllm.sim.roofline import ModelShape

    transformers = pytest.importorskip("transformers")
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[arch]
    cfg = cls[0](hidden_size=64, intermediate_size=intermediate, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=256,
                 tie_word_embeddings=True)
    torch.manual_seed(0)
    cls[1](cfg).to(dtype).save_pretrained(str(tmp_path))
    engine = make_engine(48, dtype=str(dtype).removeprefix("torch."), model=str(tmp_path))
    peaks = prefill_peaks(engine, (16, 48))
    shape = ModelShape.from_hf_config(cfg.to_dict(), dtype_bytes=dtype.itemsize)
    per_token = analytic_bytes_per_token(shape, **({"qk_norm": True} if arch == "qwen3" else {}))
    assert {n: p / n for n, p in peaks.items()} == {16: per_token, 48: per_token}


# -- a mutation pass over the benchmark's report (what a user reads off the JSON and the command line) ----------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from tests.paged_cases import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_act_report"))


def test_token_counts_in_any_order_size_the_engine_for_the_largest(tiny_llama):
    """Kills: the engine sized for the last count typed (``--tokens 48 16``: 16), which split the 48-token prompt
    across steps.  Oracle: the peaks of the sorted sweep, each ``N`` x the per-token count of the random model
    (exact on this engine, see the test above)."""
    from minivllm.bench.activations import run

    res = run((48, 16), model=tiny_llama)
    peaks = {int(n): p for n, p in res["peak_bytes"].items()}
    assert list(peaks) == [16, 48] and peaks[48] * 16 == peaks[16] * 48
    # and the shares the docs quote from this file ("KV share 0.80 -> 0.95", docs/seed_coverage.md B10)
    assert [r["kv_share"] for r in res["llama-3-8b_on_h100 (analytic)"]] == [0.8, 0.9, 0.95]


def test_a_prompt_split_across_steps_is_refused_not_reported_as_one_forward(tiny_llama):
    """``prefill_peaks`` promises one forward of ``N`` tokens: with a budget of 16, a 32-token prompt is two
    16-token forwards, whose first half's peak would be reported under 32.  Oracle: the docstring ("a forward
    that saw fewer tokens raises")."""
    from minivllm.bench.activations import make_engine, prefill_peaks

    with pytest.raises(RuntimeError, match="one forward of 32 tokens"):
        prefill_peaks(make_engine(16, model=tiny_llama), [32])


def test_cli_default_sweep_is_the_one_the_usage_line_documents(monkeypatch):
    """Oracle: the module docstring's usage line, ``[--tokens 16 64 256 1024 2048]``."""
    import re

    from minivllm.bench import activations

    documented = [int(x) for x in re.search(r"\[--tokens ([\d ]+)\]", activations.__doc__).group(1).split()]
    seen = {}

    def fake_run(tokens, *a, **k):
        seen["tokens"] = list(tokens)
        return {"peak_bytes": {}, "bytes_per_token": 0.0, "fixed_bytes": 0.0, "llama-3-8b_on_h100 (analytic)": []}

    monkeypatch.setattr(activations, "run", fake_run)
    assert activations.main([]) == 0
    assert seen["tokens"] == documented == [16, 64, 256, 1024, 2048]


def test_a_closed_meter_ignores_tensors_freed_after_it_closed():
    """``__exit__`` promises "nothing is counted once the meter is closed": a tensor made in one block and freed in
    the next must not be subtracted from the next block's count (it drove ``live`` to -4000 and hid a 40-byte
    peak).  Oracle: by hand, the second block creates 10 fp32 values and frees nothing it made."""
    from minivllm.bench.activations import ActivationMeter

    m = ActivationMeter()
    with m:
        kept = torch.ones(1000)
    with m:
        del kept
        y = torch.ones(10)
    assert (m.live, m.peak) == (40, 40)
    del y
