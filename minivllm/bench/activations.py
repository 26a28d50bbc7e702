"""``python -m minivllm.bench activations`` -- activation memory of one forward pass against the token budget.

A serving engine splits device memory three ways: weights, the KV cache, and
the *activations* of the step being computed (the intermediate tensors of a
forward pass).  KV memory is held for a request's whole life; activation memory
only while a step runs -- but it must be free when the biggest step runs, and
the biggest step is set by the token budget (``max_num_batched_tokens``).  So a
larger KV share leaves room for a smaller budget.  This benchmark measures the
activation side on the real model:

1. :class:`ActivationMeter` -- the peak bytes of tensors created during a piece
   of code and still alive, counted per storage when an operation creates it
   and subtracted when it is freed.  It sees every tensor operation (a
   ``TorchDispatchMode``, like :class:`minivllm.bench.eager_step.OpCounter`), so
   the count is exact and deterministic: it does not depend on the caching
   allocator, the device or the number of threads.  Scratch memory a kernel
   allocates internally (a fused attention kernel's tiles) is not a tensor the
   model sees and is not counted;
2. :func:`prefill_peaks` -- that peak for one prefill forward of ``N`` tokens,
   for each ``N`` of a sweep;
3. :func:`analytic_bytes_per_token` -- the same number from the model's shape
   (what the decoder layer keeps alive at its widest point), to compare with the
   measurement and to apply to models this machine cannot run;
4. :func:`budget_room` -- what a KV share leaves for activations on a preset GPU,
   in bytes and in tokens of budget.

    python -m minivllm.bench activations [--tokens 16 64 256 1024 2048] [--json out.json]
"""

from __future__ import annotations

import argparse
import platform
import time
import weakref
from collections.abc import Iterable

from minivllm.argtypes import output_file, positive_int
from minivllm.bench.results import write_result


class ActivationMeter:
    """Live and peak bytes of the tensor storages created while it is active.

    An operation's output counts when its storage is new: not the storage of
    one of the operation's inputs (a view, an in-place update, an ``out=``
    argument) and not one already counted.  A ``weakref.finalize`` on the
    storage subtracts its bytes when the last tensor using it is freed, so
    ``live`` follows Python's reference counting exactly and ``peak`` is its
    maximum.  Tensors that existed before (weights, the KV cache, the inputs)
    never count.  Use as ``with ActivationMeter() as m: ...; m.peak``.
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                meter._record(args, kwargs, out)
                return out

        self._mode = _Mode()
        self._tracked: dict[int, weakref.finalize] = {}
        self.live = self.peak = self.num_storages = self.allocated = 0

    # -- what counts (tests plant bugs by overriding these two) ------------------------
    def _is_new(self, storage, input_storages: set[int]) -> bool:
        """A storage no input of the operation owns, and not counted yet."""
        key = id(storage)
        return key not in input_storages and key not in self._tracked

    def _release(self, key: int, nbytes: int) -> None:
        """The storage's last tensor is gone: its bytes are no longer live."""
        self.live -= nbytes
        self._tracked.pop(key, None)

    # -- the bookkeeping ----------------------------------------------------------------
    @staticmethod
    def _storages(tree) -> list:
        import torch
        from torch.utils._pytree import tree_flatten

        # strided tensors only: an mkldnn (oneDNN-packed) weight has no storage Python can see
        return [t.untyped_storage() for t in tree_flatten(tree)[0]
                if isinstance(t, torch.Tensor) and t.layout == torch.strided]

    def _record(self, args, kwargs, out) -> None:
        inputs = {id(s) for s in self._storages((args, kwargs))}
        for storage in self._storages(out):
            if not self._is_new(storage, inputs):
                continue
            nbytes, key = storage.nbytes(), id(storage)
            self._tracked[key] = weakref.finalize(storage, self._release, key, nbytes)
            self.num_storages += 1
            self.allocated += nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def __enter__(self) -> "ActivationMeter":
        self.live = self.peak = self.num_storages = self.allocated = 0
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self.live_at_exit = self.live  # what the code handed back (its outputs) or left alive
        for fin in list(self._tracked.values()):
            fin.detach()  # nothing is counted once the meter is closed
        self._tracked.clear()


def make_engine(max_tokens: int, device: str = "cpu", dtype: str = "auto", model: str | None = None, **options):
    """The real engine on the bundled model (or ``model``), sized for one prompt of ``max_tokens`` in a single step.

    Why this size: one sequence (``max_num_seqs=1``), so a forward's rows are that one prompt's; a pool of the
    prompt's blocks plus two instead of the CPU default's 1 GiB -- one block past the prompt so that
    ``max_model_len`` leaves room for the one sampled token (without it the prompt is refused), one of slack.
    """
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine

    blocks = -(-max_tokens // 16) + 2
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, max_num_batched_tokens=max_tokens,
                                  max_num_seqs=1, num_gpu_blocks_override=blocks, max_model_len=16 * blocks,
                                  **options))


def prefill_peaks(engine, token_counts: Iterable[int]) -> dict[int, int]:
    """``{N: peak activation bytes}`` of the forward that prefills one fresh ``N``-token prompt.

    Each prompt starts with a token no other prompt starts with, so the prefix
    cache never shortens it; each must fit in one step (``max_num_batched_tokens``
    >= N): a forward that saw fewer tokens raises.
    """
    from minivllm.bench.eager_step import per_forward
    from minivllm.sampling_params import SamplingParams

    vocab = engine.model_runner.model.args.vocab_size
    peaks = {}
    for k, n in enumerate(token_counts):
        ids = [(k * 1009 + 7919 * i) % (vocab - 20) + 10 for i in range(n)]

        def one_prompt(ids=ids, request_id=f"activations-{k}-{n}"):
            engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, ignore_eos=True), request_id)
            while engine.has_unfinished_requests():
                engine.step()

        forwards = per_forward(engine, one_prompt, ActivationMeter)
        if [t for t, _ in forwards] != [n]:
            raise RuntimeError(f"expected one forward of {n} tokens, got {[t for t, _ in forwards]}")
        peaks[n] = forwards[0][1].peak
    return peaks


def fit_line(peaks: dict[int, int]) -> tuple[float, float]:
    """``(bytes per token, fixed bytes)``: the least-squares line through the measured peaks."""
    xs, ys = list(peaks), list(peaks.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def analytic_bytes_per_token(shape, qk_norm: bool = False) -> int:
    """Peak activation bytes per token of this engine's decoder (``minivllm/model/llama.py``), from the shape.

    A layer has two candidates for its widest point; the peak is the larger:

    * the MLP's ``silu(gate) * up``: alive are the layer's input (the caller
      still holds it), the residual sum after attention, the normed MLP input,
      the fused gate|up output (``2 x intermediate``), ``silu(gate)`` and the
      product (``intermediate`` each) -- ``3 h + 4 I`` elements a token;
    * RoPE's ``x * cos + swapped * sin``, which ``_rotate`` computes in fp32
      whatever the model's dtype: alive are the layer's input, its normed
      input, the fused q|k|v output, then the fp32 upcast of the rotated
      heads (a new tensor unless the model is fp32 already), their half-swapped
      copy, the two products and the sum -- four or five fp32 tensors the width
      of the rotated heads (q and k together; with Qwen3's ``qk_norm`` q alone,
      after its norm's output).  In bf16 this is SmolLM2's widest point (20,096
      B against the MLP's 16,256), and with Qwen3's wide heads in any dtype.

    Both add the step's RoPE cos and sin rows (``2 x head_dim``), kept for every
    layer and held in fp32 whatever the model's dtype (``RotaryEmbedding``'s
    tables are not cast).  Layers run one after the other, so the peak does not
    grow with the number of layers.  Compare ``ModelShape.act_elems_per_token_layer``:
    the activation *traffic* of one layer's GEMMs (each reads its input, writes
    its output), not what is alive at once.  Not counted: the attention
    backend's own tensors (a CPU bf16 step runs the fp32 reference attention,
    whose copies can be wider still).
    """
    h, i, d, b = shape.hidden_size, shape.intermediate_size, shape.head_dim, shape.dtype_bytes
    hq, hk = shape.num_heads, shape.num_kv_heads
    tables = 2 * d * 4  # cos and sin rows, fp32
    mlp = (3 * h + 4 * i) * b + tables
    fp32_tensors = 4 if b == 4 else 5  # x.float() of an fp32 tensor is the tensor itself
    rotated = hq * d if qk_norm else (hq + hk) * d
    held = (2 * h + (hq + 2 * hk) * d + (hq * d if qk_norm else 0)) * b
    rope = held + tables + fp32_tensors * 4 * rotated
    return max(mlp, rope)


def budget_room(shape, hw, kv_share: float) -> dict:
    """What ``kv_share`` of ``hw``'s memory (``gpu_memory_utilization``) leaves for activations, analytically.

    KV gets ``kv_share x memory - weights`` (the simulator's sizing rule,
    :func:`minivllm.sim.run.kv_pool_bytes`); what remains of the device is the
    room for a step's activations, and dividing it by
    :func:`analytic_bytes_per_token` gives the largest token budget that fits.
    """
    from minivllm.sim.run import kv_pool_bytes

    if not hw.memory_bytes:
        raise ValueError(f"budget_room needs a device with its own memory; {hw.name!r} has none (a CPU profile)")
    kv = kv_pool_bytes(shape, hw, kv_share)
    weights = shape.num_params * shape.dtype_bytes
    room = int(hw.memory_bytes) - weights - kv
    per_token = analytic_bytes_per_token(shape)
    return {"kv_share": kv_share, "weights_bytes": weights, "kv_bytes": kv, "kv_tokens": kv // shape.kv_bytes_per_token,
            "room_bytes": room, "act_bytes_per_token": per_token, "budget_tokens": room // per_token}


def run(token_counts: Iterable[int] = (16, 64, 256, 1024, 2048), device: str = "cpu", dtype: str = "auto",
        model: str | None = None, shares: Iterable[float] = (0.8, 0.9, 0.95)) -> dict:
    """The measured sweep and its line, the analytic count beside it, and Llama-3-8B's budget room on an H100.

    Why an analytic row for a model this machine cannot run: the analytic count is the one the tests hold
    equal to the meter on models that do run here, so it is what carries the measurement to a serving-size
    model and GPU.
    """
    from minivllm.sim.presets import bundled_shape, hardware_preset, model_preset

    counts = sorted(set(token_counts))
    t0 = time.perf_counter()
    engine = make_engine(counts[-1], device, dtype, model)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    peaks = prefill_peaks(engine, counts)
    slope, fixed = fit_line(peaks) if len(peaks) > 1 else (peaks[counts[0]] / counts[0], 0.0)
    dtype_bytes = engine.model_runner.model.model.embed_tokens.weight.element_size()
    shape = bundled_shape().with_dtype(dtype_bytes) if model is None else None
    out = {"benchmark": "activations", "device": str(engine.config.device), "dtype": str(engine.config.dtype),
           "arch": platform.machine(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_s": load_s, "measure_s": time.perf_counter() - t0,
           "peak_bytes": {str(n): p for n, p in peaks.items()}, "bytes_per_token": slope, "fixed_bytes": fixed}
    if shape is not None:
        out["analytic_bytes_per_token"] = analytic_bytes_per_token(shape)
        out["act_elems_per_token_layer"] = shape.act_elems_per_token_layer
    big, hw = model_preset("llama-3-8b"), hardware_preset("h100")
    out["llama-3-8b_on_h100 (analytic)"] = [budget_room(big, hw, s) for s in shares]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minivllm.bench activations", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=positive_int, nargs="+", default=[16, 64, 256, 1024, 2048])
    ap.add_argument("--model", default=None, help="an HF model directory (default: the bundled model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", type=output_file, default=None)
    a = ap.parse_args(argv)
    res = run(a.tokens, a.device, a.dtype, a.model)
    for n, p in res["peak_bytes"].items():
        print(f"{int(n):6d} tokens: peak activations {p / 2**20:8.2f} MiB ({p / int(n):8.0f} B/token)")
    print(f"fit: {res['bytes_per_token']:.0f} B/token + {res['fixed_bytes']:.0f} B"
          + (f"; analytic {res['analytic_bytes_per_token']} B/token" if "analytic_bytes_per_token" in res else ""))
    for r in res["llama-3-8b_on_h100 (analytic)"]:
        print(f"llama-3-8b on h100, KV share {r['kv_share']:.2f}: KV {r['kv_bytes'] / 2**30:5.1f} GiB, room "
              f"{r['room_bytes'] / 2**30:5.2f} GiB = {r['budget_tokens']} tokens of budget")
    if a.json:
        write_result(a.json, res, "python -m minivllm.bench activations", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
