"""``minivllm sim calibrate``: measure the real engine over a grid of batch shapes and fit a :class:`HardwareSpec`.

Why fit the roofline's few parameters, not a constant per shape?  Because the
simulator must predict shapes it never measured (a batch of 200 decodes, an
8K prompt).  A model with a handful of physically meaningful parameters --
overhead per step and per sequence, the FLOP/s of GEMMs and of attention,
memory bandwidth, and the extra fixed cost of a step that carries prompt
tokens -- fitted on a dozen shapes extrapolates; a lookup table does not.

The fit is least squares on *relative* error (a 30 ms decode step matters as
much as a 2 s prefill) with every parameter non-negative.  The roofline's
``max`` makes it piecewise linear: each step is compute- or memory-bound per
phase, and which one depends on the parameters.  So the fit alternates --
guess each step's regime, solve the (then linear) non-negative least squares,
re-derive the regimes -- until the regimes stop changing, keeping the best fit
seen.  On exact synthetic data it recovers the parameters that made the data
(``tests/test_sim_roofline.py`` checks this).

The roofline's corner (``roof_p``, see :mod:`minivllm.sim.roofline`) is one
discrete choice on top: :func:`fit_roof` fits every candidate and keeps the
one with the least error, so the textbook ``max`` stays unless the data say the
two limits do not overlap near the ridge point.  On the 2-core CPU they do
not, quite: 8-row decode steps took 53 ms where the sharp corner predicts 49.

What is measured is the whole engine step (scheduling + forward + sampling +
bookkeeping), because that is what the virtual clock must advance by.

A limit worth knowing: with one model, the weights read every step are a
constant, indistinguishable from the per-step overhead.  A free fit therefore
may fold the weight stream into ``step_overhead_s`` (and report memory as never
binding), which predicts the bundled model well but would not scale to a bigger
model's weights.  So the memory roof is not fitted: :func:`measure_read_bandwidth`
measures it (streaming a tensor larger than any cache) and the fit solves for
the other parameters around it.

On a GPU the engine replays decode-only steps as CUDA graphs and launches a
step with prompt tokens kernel by kernel from Python.  On the H200 that split
the measured steps in two: 2.6 ms for a graphed decode step of a 1B model, 11-17
ms for any step with a prompt chunk, hardly depending on its size.  One
overhead for all steps fitted that grid with 30% rms error (the fit pushed the
difference into an absurd GEMM rate); a separate ``eager_step_overhead_s``
for steps with prompt tokens brought it to 13%.

The CPU has the same split, smaller.  A step with a prompt chunk runs the
backend's prefill path in every layer -- gathering the chunk's K/V, building
its mask, one SDPA call per prompt -- on top of the decode kernel, a fixed cost
that the roofline's FLOPs and bytes do not see.  Without the term, steps that
carry a short prompt beside a few decodes (every chat turn of the decode-heavy
workload) were predicted 6-15% fast, and with them that workload's TTFT
(-12% / -13% at p50 in two runs; -0.2% / -3.7% with the term).  The term is therefore fitted on every
device.  Three CPU runs of ``python -m minivllm.bench sim_accuracy --clock cpu`` on
2026-11-30, each re-judged without and with it (``--resimulate``): 12 -> 14,
13 -> 14 and 12 -> 12 of 15 metrics within 10%; the grid's rms error 3.3 ->
2.8%, 5.5 -> 5.2% and 6.2 -> 5.5%; fitted 4.9, 13.4 and 11.2 ms.  (The second run's grid
also had short prompts arriving mid-run; those groups were dropped, because
arrivals in time make repeated runs schedule differently, which defeats the
per-step median.)  Not every run gains: the run committed before the allocator
change re-judges 12 -> 10, its decode-heavy TTFT p50 moving from +5% to +16%.
Between runs the real engine itself moves by up to 15% on this shared machine.
``prompt_term=False`` leaves the term out (the ablation).

The span term (:mod:`minivllm.sim.roofline`'s docstring: the longest sequence's
K/V at the rate one walk reaches, beside all K/V at the device's rate) came the
same way, from ``minivllm sim calibrate --residuals``: with one K/V rate, the
stored 2-core profile's lone decodes past 64 tokens of context ran 7-8% over
their prediction and 2-16 decodes at 65-512 tokens 7-9% under.  Re-fitted with
the term (``--refit``, no measuring), its rms error fell 6.2 -> 5.2% and its
decode bands off by more than 5% from five to one; the one-thread profile's 4.0 ->
3.9%.  Judged on held-out workloads (``sim_accuracy --resimulate`` of the six
runs kept since the engine of 5 December, each with the committed one-thread
profile), the simulator's error fell in five (rms over the 15 metrics 6.5 ->
5.5, 9.1 -> 8.7, 6.4 -> 5.3, 3.5 -> 2.7, 3.1 -> 2.2%) and held in one (9.8%).
``span_term=False`` leaves it out.

The stored samples of a profile can be re-fitted after such a change without
re-measuring (:func:`refit`, ``minivllm sim calibrate --refit PROFILE``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

from minivllm.argtypes import brief_path, is_int, is_real, output_file, positive_int
from minivllm.bench.results import cpu_identity, write_json
from minivllm.config import PCIE4_X16_BYTES_PER_S
from minivllm.engine.startup import frozen_heap
from minivllm.sim.roofline import HardwareSpec, ModelShape, StepCost, combine, roofline_time, step_cost

PARAMS = ("step_overhead_s", "seq_overhead_s", "s_per_flop", "s_per_byte", "s_per_attn_flop", "s_per_attn_byte",
          "eager_step_overhead_s", "s_per_attn_span_byte")


def nnls(A: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Non-negative least squares, ``min ||A x - b||`` with ``x >= 0`` (Lawson & Hanson's active-set method).

    Written here, in numpy, because scipy (whose ``optimize.nnls`` does this) is not a dependency of the engine.
    Columns are scaled to unit norm first: the terms here range from 1 (an
    overhead) to 1e12 (FLOPs), far beyond what an unscaled solve tolerates.
    """
    A = np.asarray(A, dtype=float)
    b = np.asarray(b, dtype=float)
    norms = np.linalg.norm(A, axis=0)
    norms[norms == 0] = 1.0
    As = A / norms
    m, n = As.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, np.abs(As).sum(axis=0).max())
    w = As.T @ (b - As @ x)
    for _ in range(max_iter or 3 * n + 10):
        if passive.all() or w[~passive].max() <= tol:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(As[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            bad = passive & (z <= tol)
            alpha = np.min(x[bad] / np.maximum(x[bad] - z[bad], 1e-300))
            x = x + alpha * (z - x)
            passive &= x > tol
        x = z
        w = As.T @ (b - As @ x)
    return x / norms


def _columns(c: StepCost, shares: tuple[float, float, float, float], prompt_term: bool,
             span_term: bool = True) -> list[float]:
    """One step's design row, [1, seqs, FLOPs, bytes, attention FLOPs, attention bytes, prompt, span bytes], each
    roof term scaled by its share of its phase (see :func:`_shares`; the span is a second memory term of
    attention, so it takes the attention memory share).  ``prompt`` is 1 for a step with a row of more than one
    token (``StepCost.eager``: a prompt chunk, but not a one-token one -- the last token of a prompt the prefix
    cache held, which a CUDA graph replays like a decode); with ``prompt_term=False`` the column is 0 and its
    parameter stays 0, and likewise the span's with ``span_term=False``."""
    dc, dm, ac, am = shares
    return [1.0, float(c.num_seqs), c.dense_flops * dc, c.dense_bytes * dm, c.attn_flops * ac, c.attn_bytes * am,
            float(prompt_term and c.eager), c.attn_span_bytes * am if span_term else 0.0]


def _shares(compute: float, memory: float, p: float | None) -> tuple[float, float]:
    """Weights ``(wc, wm)`` with ``combine(compute, memory, p) == wc * compute + wm * memory``.

    For ``p=None`` (the ``max``) the binding limit gets 1 and the other 0: the
    step's *regime*.  For a finite ``p`` they are the partial derivatives
    ``(compute / t) ** (p - 1)`` and ``(memory / t) ** (p - 1)``; a p-norm is
    homogeneous of degree one, so by Euler's theorem the time is exactly
    ``wc * compute + wm * memory``.  With the weights held fixed the model is
    linear in the seconds-per-unit parameters, which is what the fit solves.
    """
    if p is None:
        return (1.0, 0.0) if compute >= memory else (0.0, 1.0)
    t = combine(compute, memory, p)
    if t == 0.0:
        return 1.0, 1.0
    return (compute / t) ** (p - 1), (memory / t) ** (p - 1)


def _predict(theta: np.ndarray, costs: list[StepCost], p: float | None = None):
    """Each step's predicted time under ``theta``, and its shares (:func:`_shares`, dense then attention) at that
    prediction: the fit's next round holds these shares fixed, which is what makes it linear again."""
    a, s, f, by, af, aby, e, sp = theta
    pred, shares = [], []
    for c in costs:
        dc, dm, ac = f * c.dense_flops, by * c.dense_bytes, af * c.attn_flops
        am = aby * c.attn_bytes + sp * c.attn_span_bytes
        pred.append(a + s * c.num_seqs + combine(dc, dm, p) + combine(ac, am, p) + (e if c.eager else 0.0))
        shares.append(_shares(dc, dm, p) + _shares(ac, am, p))
    return np.array(pred), shares


def fit(costs: list[StepCost], times: list[float], max_rounds: int = 60,
        groups: list[int] | None = None, s_per_byte: float | None = None,
        roof_p: float | None = None, prompt_term: bool = True,
        swap_bandwidth: float = PCIE4_X16_BYTES_PER_S, span_term: bool = True) -> tuple[np.ndarray, float]:
    """Fit ``PARAMS`` (seconds per unit of each term) to measured step times; returns (theta, rms relative error).

    The fit minimises relative error.  ``groups`` (one label per step, e.g. the
    calibration group it came from) makes every group count the same in total:
    a decode group yields dozens of steps and a lone prefill a handful, and
    unweighted, the many short steps would decide the roofs the few long ones
    (which set TTFT) depend on.  The returned error is per step, unweighted.

    ``s_per_byte`` pins the dense memory roof to a measured bandwidth (see
    :func:`measure_read_bandwidth`) instead of fitting it: with one model the
    weight stream is a constant per step, which a free fit cannot tell apart
    from step overhead (module docstring).  ``roof_p`` is the roofline's
    corner (:func:`~minivllm.sim.roofline.combine`); :func:`fit_roof` chooses it.  ``prompt_term``:
    steps with a row of more than one token (``StepCost.eager``) get their own fixed cost
    (``HardwareSpec.eager_step_overhead_s``: kernel launches no CUDA graph hides on a GPU, the prefill
    path's per-layer work on a CPU); False leaves it out.
    ``swap_bandwidth`` (the profile's, measured apart): a step's block moves take ``swap_bytes / swap_bandwidth``,
    which :func:`~minivllm.sim.roofline.roofline_time` adds to the fitted terms, so the fit takes it off first.
    """
    theta, err, _ = _fit(costs, times, max_rounds, groups, s_per_byte, roof_p, prompt_term, swap_bandwidth, span_term)
    return theta, err


def _fit(costs, times, max_rounds, groups, s_per_byte, roof_p, prompt_term=True,
         swap_bandwidth=PCIE4_X16_BYTES_PER_S, span_term=True) -> tuple[np.ndarray, float, float]:
    """:func:`fit`'s work; also returns the weighted error it minimised (what :func:`fit_roof` compares)."""
    t = np.asarray(times, dtype=float)
    if len(costs) != len(t) or len(t) < len(PARAMS):
        raise ValueError(f"need at least {len(PARAMS)} measured steps with their costs, got {len(t)}")
    if not (np.isfinite(t) & (t > 0)).all():  # an inf passed "> 0" and failed inside the fit
        raise ValueError("step times must be finite and > 0")
    swap = np.array([c.swap_bytes for c in costs], dtype=float) / swap_bandwidth  # known: not fitted
    w = 1.0 / t  # relative error
    if groups is not None:
        if len(groups) != len(t):
            raise ValueError("groups needs one label per measured step")
        sizes = {g: groups.count(g) for g in set(groups)}
        w = w / np.sqrt([sizes[g] for g in groups])
    best, best_err = None, np.inf
    seen = set()
    starts = [[(1.0, 0.0, 1.0, 0.0)] * len(costs), [(0.0, 1.0, 0.0, 1.0)] * len(costs),
              [(1.0, 0.0, 1.0, 0.0) if c.num_tokens > c.num_seqs else (0.0, 1.0, 0.0, 1.0) for c in costs]]
    for shares in starts:
        for _ in range(max_rounds):
            key = tuple(np.round(np.array(shares), 6).ravel())
            if key in seen:  # back at a point already solved: converged (or cycling)
                break
            seen.add(key)
            A = np.array([_columns(c, sh, prompt_term, span_term) for c, sh in zip(costs, shares)])
            if s_per_byte is None:
                theta = nnls(A * w[:, None], (t - swap) * w)
            else:  # the bytes column is known: move it to the right-hand side, fit the others
                rest = nnls(np.delete(A, 3, axis=1) * w[:, None], (t - swap - s_per_byte * A[:, 3]) * w)
                theta = np.insert(rest, 3, s_per_byte)
            pred, shares = _predict(theta, costs, roof_p)
            pred = pred + swap
            err = float(np.sqrt(np.sum(((pred - t) * w) ** 2) / np.sum((w * t) ** 2)))  # weighted relative rms
            if err < best_err:
                best, best_err = theta, err
    pred = _predict(best, costs, roof_p)[0] + swap
    return best, float(np.sqrt(np.mean(((pred - t) / t) ** 2))), best_err


ROOF_P_CANDIDATES = (None, 8.0, 4.0, 3.0, 2.0, 1.5)


def fit_roof(costs: list[StepCost], times: list[float], groups: list[int] | None = None,
             s_per_byte: float | None = None, candidates=ROOF_P_CANDIDATES, prompt_term: bool = True,
             swap_bandwidth: float = PCIE4_X16_BYTES_PER_S, span_term: bool = True):
    """:func:`fit` for each candidate ``roof_p``; returns ``(theta, rms error, roof_p)`` of the best.

    One discrete shape parameter, chosen on the same weighted error the fit
    minimises, so a sharp corner (``None``, the textbook ``max``) wins unless
    the measurements say the limits do not overlap near the ridge.
    """
    best = None
    for p in candidates:
        theta, err, weighted = _fit(costs, times, 60, groups, s_per_byte, p, prompt_term, swap_bandwidth, span_term)
        if best is None or weighted < best[0] - 1e-9:
            best = (weighted, theta, err, p)
    return best[1], best[2], best[3]


def measure_read_bandwidth(device: str = "cpu", megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of streaming a large fp32 tensor through a reduction (best of ``repeats``), on ``device``.

    What a decode step's weight read can reach at best: the tensor is larger than
    any cache, read once per pass, with the threads torch uses for the model.
    """
    import torch

    x = torch.ones(megabytes * 2**20 // 4, device=device)
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    x.sum()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def spec_from_theta(theta, name: str, base: HardwareSpec | None = None, **extra) -> HardwareSpec:
    """A :class:`HardwareSpec` with the fitted values (a term fitted to 0 s/unit gets an effectively infinite roof;
    the span, which is an added term rather than a roof, gets None: no span)."""
    a, s, f, by, af, aby, e, sp = (float(v) for v in theta)
    inf = 1e30
    fields = dict(name=name, peak_flops=1 / f if f > 0 else inf, mem_bandwidth=1 / by if by > 0 else inf,
                  attention_flops=1 / af if af > 0 else inf, attention_bandwidth=1 / aby if aby > 0 else inf,
                  attention_span_bandwidth=1 / sp if sp > 0 else None,
                  step_overhead_s=a, seq_overhead_s=s, layer_overhead_s=0.0, eager_step_overhead_s=e)
    if base is not None:
        fields.update(memory_bytes=base.memory_bytes, swap_bandwidth=base.swap_bandwidth)
    fields.update(extra)
    return HardwareSpec(**fields)


# -- measuring the real engine ------------------------------------------------------------------


class RecordingExecutor:
    """Wraps an executor and records each batch's shape ``[(start, num_tokens, samples)]`` and block moves.

    ``clock="cpu"`` replaces the wall clock by this thread's CPU time (plus an
    offset that :meth:`advance_to` moves over idle gaps).  Why: on a machine
    shared with other busy processes, wall-clock step times measure the
    neighbours as much as the engine; the CPU time the serving thread
    consumed is what the same run would take on a quiet machine.  It is exact
    only with one compute thread (``torch.set_num_threads(1)``, which
    :func:`real_engine` sets for this mode), and it still sees cache and
    memory-bandwidth contention.
    """

    def __init__(self, inner, clock: str = "wall") -> None:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
        self.inner = inner
        self.clock_kind = clock
        self._offset = 0.0
        self.batches: list[tuple[list[tuple[int, int, bool]], int]] = []
        self.host: list[HostUsage | None] = []  # per batch, what the forward pass cost the host (see HostUsage)

    def execute(self, batch):
        self.batches.append(([(s.start, s.num_tokens, s.start + s.num_tokens == s.request.num_tokens)
                              for s in batch.seqs], len(batch.moves.swap_in) + len(batch.moves.swap_out)))
        before, cpu_before = _thread_usage(), time.thread_time()
        try:
            return self.inner.execute(batch)
        finally:
            cpu_after, after = time.thread_time(), _thread_usage()
            self.host.append(None if before is None or after is None else HostUsage(
                round(cpu_after - cpu_before, 7), after.ru_minflt - before.ru_minflt,
                after.ru_nivcsw - before.ru_nivcsw))

    def now(self) -> float:
        if self.clock_kind == "cpu":
            return time.thread_time() + self._offset
        return self.inner.now()

    def __getattr__(self, name):
        if name == "advance_to" and self.clock_kind == "cpu":
            return self._advance_to
        return getattr(self.inner, name)  # (the wall-clock runner has no advance_to: the driver sleeps)

    def _advance_to(self, t: float) -> None:
        """Idle until ``t``: on the CPU clock an idle gap costs no CPU, so the offset jumps over it."""
        now = self.now()
        if t > now:
            self._offset += t - now


@dataclass(frozen=True)
class HostUsage:
    """What one forward pass cost the serving thread: its CPU clock and ``getrusage(RUSAGE_THREAD)`` around it.

    The CPU time is read from the thread's CPU clock (``time.thread_time``), not from getrusage: Linux
    brings a running thread's getrusage times up to date only at a timer tick or a context switch, so a
    forward pass that never blocks read 0 in three steps of four (1 ms busy steps; 2.5 ms ones read
    0.5 ms at the median), which would make a host-bound step look like one that waited.

    Why keep it: on the H200 the same eager prompt step took 11 ms in one run and 30 ms in the
    next, and the wall clock alone cannot say why.  CPU time near the wall time means the host
    ran the launches slower (clocks, caches, a spinning sync); CPU time well below it means the
    thread waited (descheduled, blocked); minor page faults count fresh memory being touched
    (an allocator growing); involuntary context switches count the neighbours taking the core.
    """

    cpu_s: float
    minor_faults: int
    involuntary_switches: int


_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", None)  # Linux only; looked up once, not twice per step


def _thread_usage():
    """This thread's resource usage, or None where Linux's per-thread ``getrusage`` is missing."""
    return None if _RUSAGE_THREAD is None else resource.getrusage(_RUSAGE_THREAD)


@dataclass
class StepSample:
    """One measured step: its rows as ``(start, num_tokens, completes_prompt)`` (what :func:`step_cost` prices),
    its swapped blocks and its time -- the pair of shape and seconds the fit and ``--check`` compare."""

    seqs: list[tuple[int, int, bool]]
    swapped_blocks: int
    time_s: float
    start_s: float = 0.0  # when the step began, after the run's start (the gaps between steps are host time too)
    host: HostUsage | None = None  # the forward pass's cost to the host (recorded runs only, see HostUsage)


def real_engine(max_num_batched_tokens: int = 512, max_num_seqs: int = 32, num_blocks: int = 512,
                max_model_len: int = 4096, clock: str = "wall", **options):
    """The real engine on the bundled model (or ``model=``, an HF directory), with its executor wrapped for
    recording (see :class:`RecordingExecutor`)."""
    from minivllm.config import EngineConfig
    from minivllm.engine.llm_engine import LLMEngine

    if clock == "cpu":
        import torch

        torch.set_num_threads(1)
    cfg = EngineConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                       num_gpu_blocks_override=num_blocks, max_model_len=max_model_len, **options)
    return LLMEngine(cfg, executor_wrapper=lambda runner: RecordingExecutor(runner, clock))


def measure(engine, requests) -> tuple[list[StepSample], object]:
    """Run ``requests`` (see :func:`minivllm.sim.run.drive`) and pair every step's shape with its measured time."""
    from minivllm.sim.run import drive

    ex = engine.executor
    first = len(ex.batches)
    rec = drive(engine, requests)
    batches, host = ex.batches[first:], ex.host[first:]
    samples = [StepSample(seqs, moved, end - start, start, usage)
               for (seqs, moved), usage, start, end in zip(batches, host, rec.step_starts, rec.step_ends) if seqs]
    return samples, rec


def measure_median(engine, requests, repeats: int) -> list[StepSample]:
    """Run ``requests`` ``repeats`` times; per step, the median time (the first run's if the runs were
    scheduled differently and do not line up step by step)."""
    got, _ = measure(engine, requests)
    runs = [got] + [measure(engine, requests)[0] for _ in range(repeats - 1)]
    if all([s.seqs for s in run] == [s.seqs for s in got] for run in runs):
        got = [StepSample(s.seqs, s.swapped_blocks, statistics.median(run[i].time_s for run in runs))
               for i, s in enumerate(got)]
    return got


def _random_requests(rng, vocab: int, lengths, max_tokens: int, first_id: int = 0) -> list:
    """One ``SimRequest`` per prompt length, all arriving at 0, prompts of random token ids (no shared prefix)."""
    from minivllm.sim.run import SimRequest

    return [SimRequest(first_id + i, 0.0, "cal", [int(x) for x in rng.integers(10, vocab - 1, n)], max_tokens)
            for i, n in enumerate(lengths)]


def _mixed_group(rng, vocab: int, decoders: int, long_len: int, max_tokens: int) -> list:
    """``decoders`` short prompts that go on decoding while one ``long_len`` prompt is prefilled in chunks."""
    return _random_requests(rng, vocab, [48] * decoders, max_tokens) + _random_requests(
        rng, vocab, [long_len], 1, first_id=decoders)


def calibration_grid(vocab: int = 49152, seed: int = 0, scale: float = 1.0):
    """The grid: lone prefills of 16..1024 tokens (1024 is chunked), several prefills at once, and decode
    batches of 1..32 sequences at short and long context.  Each group is a list of ``SimRequest``
    arriving together; ``scale`` < 1 shrinks it for a quick run."""
    rng = np.random.default_rng(seed)

    def reqs(lengths, max_tokens):
        return _random_requests(rng, vocab, lengths, max_tokens)

    groups = [reqs([n], 1) for n in (16, 64, 160, 320, 512, 768, 1024)]
    groups += [reqs([64] * 4, 1), reqs([32] * 12, 1)]
    # mixed steps: decoders running while a long prompt is prefilled in budget-sized chunks beside them
    # (the shape of every held-out workload's busy steps, which lone prefills and pure decodes never show)
    for b, long_len in ((4, 1024), (12, 768)):
        groups.append(_mixed_group(rng, vocab, b, long_len, 6))
    decode_steps = max(3, int(round(8 * scale)))
    # decode batches at short, medium and long context.  The 1024-token ones give the K/V-reading term a
    # lever arm as long as the contexts the held-out workloads decode at: without them the only decodes past
    # ~400 tokens of context sat beside prompt chunks, and one CPU fit put the K/V bandwidth at 17 GB/s where
    # its neighbours found 7-8, paying for it with fixed cost (ITL p50 +10% / -14% on two workloads)
    for b, p in ((1, 32), (2, 32), (4, 32), (8, 32), (16, 32), (32, 32), (1, 384), (4, 384), (12, 384),
                 (1, 1024), (4, 1024)):
        if scale < 1 and b * p > 2048:
            continue
        groups.append(reqs([p] * b, decode_steps))
    return groups


def calibrate(engine=None, shape: ModelShape | None = None, scale: float = 1.0, name: str | None = None,
              out=None, pin_bandwidth: bool = True, repeats: int = 1) -> dict:
    """Measure the grid on the real engine, fit, and return the profile document (not yet written).

    ``repeats > 1`` runs each group of the grid that many times and keeps, per
    step, the median time.  The engine schedules a group identically every
    time, so the runs line up step by step; the median drops the odd step that
    a page fault, a garbage collection or a neighbour's burst slowed down,
    which otherwise pulls the least-squares fit (one such step in a hundred
    moved the fitted GEMM rate by several per cent on the 2-core machine).
    """
    import torch

    from minivllm.sim.presets import bundled_shape

    t_start = time.perf_counter()
    engine = engine or real_engine()
    dtype_bytes = torch.tensor([], dtype=engine.config.dtype).element_size() if isinstance(
        engine.config.dtype, torch.dtype) else 4
    shape = shape or bundled_shape().with_dtype(dtype_bytes)
    device = str(engine.config.device)
    for group in calibration_grid(shape.vocab_size, scale=0.3)[:3]:  # warm up (allocator, kernels, caches)
        measure(engine, group)
    samples: list[StepSample] = []
    labels: list[int] = []
    for k, group in enumerate(calibration_grid(shape.vocab_size, scale=scale)):
        got = measure_median(engine, group, repeats)
        samples += got
        labels += [k] * len(got)
        print(f"  group {k}: {len(group)} x {len(group[0].prompt_token_ids)} tokens -> {len(got)} steps", file=out or sys.stderr)
    read_bw = measure_read_bandwidth(device) if pin_bandwidth else None
    clock = getattr(engine.executor, "clock_kind", "wall")
    hw_name = name or default_name(device, clock)
    swap_bw = PCIE4_X16_BYTES_PER_S  # measured below when the engine has a host tier to copy to
    kv_cache = getattr(engine.executor, "kv_cache", None)
    if kv_cache is not None and getattr(kv_cache, "num_cpu_blocks", 0):
        swap_bw = kv_cache.measure_swap_bandwidth()
    doc = {
        "tool": "minivllm sim calibrate",
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device, "cpus": os.cpu_count(), "host": cpu_identity(), "clock": clock,
        "torch_threads": torch.get_num_threads(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cuda_graphs": uses_cuda_graphs(engine),
        "model": asdict(shape),
        "engine": {"block_size": engine.config.block_size, "max_num_batched_tokens": engine.config.max_num_batched_tokens,
                   "max_num_seqs": engine.config.max_num_seqs},
        "hardware": {"name": hw_name, "swap_bandwidth": swap_bw,  # a GPU's memory sizes its KV pool in sim run
                     "memory_bytes": float(torch.cuda.get_device_properties(torch.device(device)).total_memory)
                     if torch.device(device).type == "cuda" else 0.0},  # the calibrated GPU's, not GPU 0's
        "fit": {"repeats": repeats, "measured_read_bandwidth": read_bw},  # when set, the memory roof is pinned to it
        "samples": [{"seqs": s.seqs, "swapped_blocks": s.swapped_blocks, "time_s": s.time_s, "group": g}
                    for s, g in zip(samples, labels)],
    }
    refit(doc, notes=f"fitted by minivllm sim calibrate on {device}")
    doc["fit"]["seconds"] = time.perf_counter() - t_start
    return doc


def default_name(device: str, clock: str = "wall") -> str:
    """A profile's name when none is given: ``<device>-1thread-cputime`` on the CPU-time clock, else ``cpu-<N>core``
    or the GPU's name."""
    import torch

    from minivllm.config import parse_device

    dev = parse_device(device)  # a ValueError for 'tpu', or 'cuda' without a GPU (torch's AssertionError was a traceback)
    if device == "auto":
        device = dev.type
    if clock == "cpu":
        return f"{device}-1thread-cputime"
    return f"cpu-{os.cpu_count()}core" if dev.type == "cpu" else torch.cuda.get_device_name(dev)


MAX_TRUSTED_RMS = 0.15


def fit_warning(doc: dict) -> str | None:
    """Why a fresh profile should not be trusted, or None: a fit this far off was measured on a busy machine
    (or the grid does not suit the device), and every simulation that loads it inherits the error."""
    err = doc["fit"]["rms_rel_error"]
    if err <= MAX_TRUSTED_RMS:
        return None
    load = doc.get("loadavg")
    busy = f" (load average {load[0]:.1f} on {doc.get('cpus')} CPUs while measuring)" if load else ""
    return (f"the fit's rms error is {100 * err:.0f}%, above {100 * MAX_TRUSTED_RMS:.0f}%{busy}: steps this noisy "
            "make a poor profile; calibrate on a quiet machine, or with --clock cpu on a shared one")


# How far a profile's predictions may sit from the engine it describes (the median, over the check's shapes, of
# measured / predicted step time) before ``--check`` calls it stale.  The fits carry 3-9% rms error and this
# shared 2-core machine drifts by about 5% within a session; 15% is past both, and far inside what a change of
# host moves: on 2026-12-05 both profiles committed on 2026-11-30 predicted steps 1.8-1.9x longer than the
# engine took (a one-sequence decode: 48 ms predicted, 27 ms measured), and the engine of 2026-12-01, run beside
# today's (``bench ab``), was as fast as today's -- the cloud host had changed, not the code.
STALE_RATIO = 0.15


@dataclass(frozen=True)
class CheckGroup:
    """One shape ``--check`` measures: requests arriving together, and which of their steps to judge."""

    label: str
    requests: list
    decodes_only: bool = False  # judge only the steps in which every sequence computes one token

    def judged(self, samples: list[StepSample]) -> list[StepSample]:
        return [s for s in samples if all(n == 1 for _, n, _ in s.seqs)] if self.decodes_only else samples


def check_groups(vocab: int = 49152, seed: int = 1, decode_steps: int = 6) -> list[CheckGroup]:
    """The shapes ``--check`` measures again: two lone prompts, decodes of 1-8 sequences at short and medium
    context (their prompt steps not judged), and decoders beside a chunked long prompt -- each kind of step
    the grid fits, about ten seconds on the 2-core CPU, so that the check is cheap enough to run after every
    change to the engine."""
    rng = np.random.default_rng(seed)
    groups = [CheckGroup(f"prompt {n}", _random_requests(rng, vocab, [n], 1)) for n in (160, 512)]
    groups += [CheckGroup(f"decode {b}x{p}", _random_requests(rng, vocab, [p] * b, decode_steps), decodes_only=True)
               for b, p in ((1, 32), (2, 32), (4, 32), (8, 32), (1, 384), (4, 384))]
    groups.append(CheckGroup("4 decodes + prompt 1024", _mixed_group(rng, vocab, 4, 1024, decode_steps)))
    return groups


def predicted_step_s(doc: dict, steps) -> list[float]:
    """The time ``sim run`` predicts with profile ``doc`` (:func:`~minivllm.sim.presets.profile_spec`, on the
    profile's model and block size) for each of ``steps``, given as ``(seqs, swapped_blocks)`` pairs: the
    prediction that a check, a drift measurement or a residual compares measured steps with."""
    from minivllm.sim.presets import profile_spec

    shape, spec = ModelShape.from_dict(doc.get("model")), profile_spec(doc)
    block = (doc.get("engine") or {}).get("block_size", 16)
    return [roofline_time(step_cost(shape, [tuple(x) for x in seqs], swapped, block), shape, spec).total
            for seqs, swapped in steps]


def judge(doc: dict, measured: list[tuple[str, list[StepSample]]]) -> dict:
    """Each group's measured steps against the profile's predictions for the same shapes, and the verdict.

    A group's ratio is the median over its steps of measured / predicted time; the profile's is the median of
    the groups' ratios, so that each kind of step counts once however many steps it has (eight decodes
    would otherwise outvote one prompt).  Why judge predictions and not the profile's recorded times: the
    predictions are what ``sim run --hardware PROFILE`` uses, and a fit may be off for shapes it was fitted on.
    """
    rows = []
    for label, samples in measured:
        if not samples:
            raise ValueError(f"check group {label!r} has no step to judge (a decode group whose requests never decoded?)")
        pred = predicted_step_s(doc, [(s.seqs, s.swapped_blocks) for s in samples])
        rows.append({"group": label, "steps": len(samples),
                     "measured_ms_p50": 1e3 * statistics.median(s.time_s for s in samples),
                     "predicted_ms_p50": 1e3 * statistics.median(pred),
                     "ratio": statistics.median(s.time_s / p for s, p in zip(samples, pred))})
    ratio = statistics.median(r["ratio"] for r in rows)
    return {"profile": doc["hardware"].get("name"), "calibrated": doc.get("date_utc"), "clock": doc.get("clock", "wall"),
            "calibrated_on": doc.get("host"), "this_host": cpu_identity(),
            "groups": rows, "ratio": ratio, "stale": abs(ratio - 1) > STALE_RATIO}


def check(doc: dict, engine, repeats: int = 3, groups: list[CheckGroup] | None = None) -> dict:
    """Measure :func:`check_groups` (or ``groups``) on ``engine`` and :func:`judge` ``doc`` by them.

    A profile is a snapshot of one engine on one machine: another machine (a learner's laptop, the next
    day's cloud host, which on this course's 2-core VM has run the same code up to 2.6x faster) or a later change
    to the engine's speed leaves it predicting something else, and ``sim run`` has no way to notice.  The
    check re-measures a few shapes and says whether the profile still describes this engine here, in
    seconds rather than the minutes a re-calibration takes.
    """
    import torch

    groups = groups or check_groups(ModelShape.from_dict(doc.get("model")).vocab_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(check_threads(doc))  # as the profile was measured, for the measuring only
    try:
        measure(engine, groups[0].requests)  # warm up (allocator, kernels, caches), as calibrate does
        measured = [(g.label, g.judged(measure_median(engine, g.requests, repeats))) for g in groups]
    finally:
        torch.set_num_threads(threads)  # a notebook or test that checks a profile goes on as it was
    return judge(doc, measured)


def check_threads(doc: dict) -> int:
    """The torch threads a profile was measured with: one on the CPU clock (a thread's CPU time counts only its
    own work), else the recorded count capped at this machine's cores, else this process's count."""
    import torch

    if doc.get("clock", "wall") == "cpu":
        return 1
    if doc.get("torch_threads"):
        return max(1, min(int(doc["torch_threads"]), os.cpu_count() or 1))
    return torch.get_num_threads()


def format_check(result: dict, path: str) -> str:
    """The check's table and verdict; a stale verdict names the command that re-calibrates the profile at ``path``
    under its own name and clock."""
    lines = [f"{'group':<26} {'steps':>5} {'measured p50':>13} {'predicted p50':>14} {'measured/predicted':>19}"]
    for r in result["groups"]:
        lines.append(f"{r['group']:<26} {r['steps']:>5} {r['measured_ms_p50']:>10.1f} ms {r['predicted_ms_p50']:>11.1f} ms "
                     f"{r['ratio']:>19.3f}")
    verdict = (f"stale (beyond +-{100 * STALE_RATIO:.0f}%): re-calibrate with minivllm sim calibrate --out {path} "
               f"--name '{result['profile']}'{' --clock cpu' if result['clock'] == 'cpu' else ''}" if result["stale"]
               else f"current (within +-{100 * STALE_RATIO:.0f}%)")
    lines.append(f"{result['profile']} (calibrated {result['calibrated'] or 'on an unrecorded date'}): this engine's steps take x{result['ratio']:.3f} "
                 f"the profile's predictions (median of {len(result['groups'])} shapes): {verdict}")
    if result["stale"] and result["clock"] == "wall":
        # Wall time counts what any other process (or the VM's neighbours) takes of the cores: in the minutes after
        # a calibration on this 2-core VM, two wall-clock checks read x1.174 and x1.272 (decodes 21-29 ms, nothing
        # of ours running beside them), and ten minutes later x0.963 (decodes 18-21 ms, as calibrated).  The
        # CPU-time profile read x1.039 and x0.964 over the same minutes: the steadier witness.
        lines.append("(a wall-clock profile: a busy moment reads slow too; run the check again when the machine is "
                     "quiet before re-calibrating, or check a --clock cpu profile)")
    was = result.get("calibrated_on") or "a host the profile did not record (profiles before 2026-12-06)"
    lines.append(f"calibrated on {was}; this host: {result['this_host']}")
    return "\n".join(lines)


def check_engine(doc: dict):
    """The real engine a profile was calibrated on, rebuilt from what the profile recorded: its device, clock and
    batch limits (:func:`check` runs it with the profile's torch threads).  Only the bundled model can be rebuilt.

    This process's torch threads are left as they were: building a CPU-clock engine sets one thread, which a
    notebook would otherwise keep for every cell after the check."""
    import torch

    from minivllm.sim.presets import profile_spec

    model = (doc.get("model") or {}).get("name")
    if model != "smollm2-135m":
        raise ValueError(f"--check re-measures the bundled model (smollm2-135m); this profile was fitted on {model!r}")
    # What :func:`judge` will read, read now: a profile that ``sim run`` cannot use is refused before the engine is
    # built and measured, not after (a hardware block without its roofs cost 40 s of measuring, then an error).
    ModelShape.from_dict(doc.get("model"))
    profile_spec(doc)
    eng = doc.get("engine") or {}
    threads = torch.get_num_threads()
    try:
        return real_engine(max_num_batched_tokens=eng.get("max_num_batched_tokens", 512),
                           max_num_seqs=eng.get("max_num_seqs", 32), block_size=eng.get("block_size", 16),
                           device=doc.get("device", "auto"), clock=doc.get("clock", "wall"))
    finally:
        torch.set_num_threads(threads)


def uses_cuda_graphs(engine) -> bool:
    """Does the engine replay decode steps as CUDA graphs (a GPU, a graph-safe backend, not enforce_eager)?"""
    return getattr(getattr(engine, "model_runner", None), "graphs", None) is not None


def refit(doc: dict, notes: str | None = None, span_term: bool = True) -> dict:
    """Fit the profile ``doc``'s stored samples (again) and update its hardware, fit and predictions in place.

    The measurements are the expensive part and the model the part that changes; re-fitting a stored
    profile lets a GPU calibration (15 minutes of a lent machine) be re-used by a later version of
    the cost model on any machine: ``minivllm sim calibrate --refit PROFILE``.  ``span_term=False`` fits the
    cost model without its span term (one K/V rate: the ablation lab 9 plots).
    """
    shape = ModelShape.from_dict(doc.get("model"))
    samples = doc["samples"]
    costs = [step_cost(shape, [tuple(x) for x in s["seqs"]], s.get("swapped_blocks", 0), doc["engine"]["block_size"])
             for s in samples]
    times = [s["time_s"] for s in samples]
    groups = [s["group"] for s in samples] if all("group" in s for s in samples) else None
    read_bw = doc["fit"].get("measured_read_bandwidth")
    hw = doc["hardware"]
    swap_bw = hw.get("swap_bandwidth", PCIE4_X16_BYTES_PER_S)
    theta, err, roof_p = fit_roof(costs, times, groups=groups, s_per_byte=1 / read_bw if read_bw else None,
                                  swap_bandwidth=swap_bw, span_term=span_term)
    spec = spec_from_theta(theta, hw["name"], swap_bandwidth=swap_bw, roof_p=roof_p,
                           memory_bytes=hw.get("memory_bytes", 0.0), notes=notes or hw.get("notes", ""))
    pred = [roofline_time(c, shape, spec).total for c in costs]
    doc["hardware"] = spec.to_dict()
    doc["fit"].update(params=dict(zip(PARAMS, map(float, theta))), steps=len(samples), rms_rel_error=err,
                      max_abs_rel_error=float(max(abs(p - t) / t for p, t in zip(pred, times))))
    for s, p in zip(samples, pred):
        s["pred_s"] = p
    return doc


def format_profile(doc: dict) -> str:
    hw, f = doc["hardware"], doc["fit"]

    def rate(x, unit):
        return "not binding" if x is None or x >= 1e29 else f"{x / 1e9:.1f} {unit}"

    eager = hw.get("eager_step_overhead_s", 0.0)
    eager = f" (+{eager * 1e3:.2f} ms for a step with prompt tokens)" if eager else ""
    span = hw.get("attention_span_bandwidth")  # absent or None: a profile without the span term
    span = f", longest sequence {rate(span, 'GB/s')}" if span is not None else ""
    return (f"{hw['name']}: step overhead {hw['step_overhead_s'] * 1e3:.2f} ms{eager} + {hw['seq_overhead_s'] * 1e3:.3f} ms/seq | "
            f"GEMM {rate(hw['peak_flops'], 'GFLOP/s')} | attention {rate(hw['attention_flops'], 'GFLOP/s')} | "
            f"memory {rate(hw['mem_bandwidth'], 'GB/s')} (attention {rate(hw.get('attention_bandwidth'), 'GB/s')}{span}) | "
            f"roof corner {'max' if hw.get('roof_p') is None else 'p=%g' % hw['roof_p']} | fit on {f['steps']} steps: rms rel error "
            f"{100 * f['rms_rel_error']:.1f}%, max {100 * f['max_abs_rel_error']:.1f}% ({f.get('seconds', 0):.0f} s)")


SEQ_BANDS = (1, 4, 16)  # sequences in a step: 1, 2-4, 5-16, 17+
CONTEXT_BANDS = (64, 512, 2048)  # the longest context a sequence of the step starts from: 0-64, ..., 2049+


def _band(x: int, edges: tuple[int, ...], low: int) -> tuple[int, str]:
    """The band of ``edges`` that holds ``x`` (``low`` the smallest value there can be): its place and label."""
    for i, top in enumerate(edges):
        if x <= top:
            return i, (str(top) if low == top else f"{low}-{top}")
        low = top + 1
    return len(edges), f"{low}+"


def residuals(doc: dict) -> list[dict]:
    """Where the profile's cost model misses its own calibration: each stored step's measured time over the time
    ``sim run`` predicts for it (:func:`~minivllm.sim.presets.profile_spec`), gathered by kind of step
    (:attr:`~minivllm.sim.roofline.StepCost.kind`), number of sequences and longest context.

    Why: a fit's rms error is one number for 100-odd steps; a simulation inherits the error of the shapes *it*
    runs.  On the 2-core CPU, for instance, the roofline's one K/V-reading rate over-predicts decodes of several
    sequences at 65-512 tokens of context and under-predicts single-sequence ones and those past 512 -- which is
    where a workload of long prompts decodes.  Measures nothing: it reads the profile's samples.
    """
    from minivllm.sim.presets import profile_spec

    samples = doc.get("samples")
    if not isinstance(samples, list) or not samples or not isinstance(doc.get("engine"), dict):
        raise ValueError("a profile with stored samples and its engine is needed (a datasheet preset has none)")
    _check_stored_samples(doc)
    shape, spec, block = ModelShape.from_dict(doc.get("model")), profile_spec(doc), doc["engine"]["block_size"]
    rows: dict[tuple, list[float]] = {}
    for s in samples:
        seqs = [tuple(x) for x in s["seqs"]]
        cost = step_cost(shape, seqs, s.get("swapped_blocks", 0), block)
        pred = roofline_time(cost, shape, spec).total
        key = (cost.kind, _band(len(seqs), SEQ_BANDS, 1), _band(max(x[0] for x in seqs), CONTEXT_BANDS, 0))
        rows.setdefault(key, []).append(s["time_s"] / pred)
    return [{"kind": kind, "seqs": seqs[1], "context": ctx[1], "steps": len(r), "real_over_pred_p50": statistics.median(r),
             "real_over_pred_min": min(r), "real_over_pred_max": max(r)}
            for (kind, seqs, ctx), r in sorted(rows.items())]  # the bands in their order, by their places


def _check_stored_samples(doc: dict) -> None:
    """Refuse a profile whose engine block size or stored steps are not what :func:`calibrate` writes.

    ``--residuals`` and ``--refit`` read a file that may have been edited by hand or cut short: a step without
    its ``seqs``, a time that is text, an engine without its block size was a ``KeyError`` or ``TypeError``
    traceback from deep inside the cost model; this names the step instead.
    """
    block = doc["engine"].get("block_size")
    if not is_int(block) or block < 1:
        raise ValueError(f"the profile's engine block_size must be a positive integer, got {block!r}")

    def count(x) -> bool:
        return is_int(x) and x >= 0

    for k, s in enumerate(doc["samples"]):
        seqs, t = (s.get("seqs"), s.get("time_s")) if isinstance(s, dict) else (None, None)
        if (not isinstance(seqs, list)
                or not all(isinstance(q, list) and len(q) == 3 and count(q[0]) and count(q[1]) for q in seqs)
                or not is_real(t) or not t > 0
                or not count(s.get("swapped_blocks", 0))):
            raise ValueError(f"stored step {k} is not {{'seqs': [[start, tokens, samples], ...], 'time_s': seconds "
                             f"> 0, 'swapped_blocks': n}}: {str(s)[:200]}")


def format_residuals(rows: list[dict], name: str) -> str:
    lines = [f"{name}: each calibration step's measured time / the time sim run predicts for it "
             f"(> 1: the model is too fast there)",
             f"{'kind':<7} {'seqs':>5} {'context':>9} {'steps':>5} {'p50':>6} {'min':>6} {'max':>6}"]
    for r in rows:
        flag = "  <- off by more than 5%" if abs(r["real_over_pred_p50"] - 1) > 0.05 else ""
        lines.append(f"{r['kind']:<7} {r['seqs']:>5} {r['context']:>9} {r['steps']:>5} "
                     f"{r['real_over_pred_p50']:>6.3f} {r['real_over_pred_min']:>6.3f} {r['real_over_pred_max']:>6.3f}{flag}")
    return "\n".join(lines)


REPEATS = 3
"""``--repeats``' default: runs of each group of the grid (``--check``'s too); a job that measures nothing refuses
any other value rather than drop it."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="minivllm sim calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=output_file, default=None, help="profile JSON to write (default: minivllm/sim/profiles/<name>.json in a source checkout, "
                    "./<name>.json in an installed package; it must not exist yet unless --force: the committed "
                    "profiles are what the tests load); with --check, the check's result JSON (groups, ratio, "
                    "verdict, both hosts, the command)")
    ap.add_argument("--force", action="store_true", help="let the default --out replace an existing profile")
    ap.add_argument("--name", default=None, help="profile / hardware name (default: cpu-<N>core, <device>-1thread-cputime "
                    "with --clock cpu, or the GPU's name)")
    ap.add_argument("--quick", action="store_true", help="a smaller grid (about a third of the time)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time steps by this thread's CPU time, one torch thread (for a machine shared with "
                         "other busy processes)")
    ap.add_argument("--fit-bandwidth", action="store_true",
                    help="fit the memory roof too, instead of pinning it to a measured streaming-read bandwidth")
    ap.add_argument("--repeats", type=positive_int, default=REPEATS,
                    help=f"run each group of the grid this many times and keep each step's median time (default {REPEATS})")
    ap.add_argument("--check", default=None, metavar="PROFILE",
                    help="fit nothing: re-measure a few shapes on the engine PROFILE describes and say whether its "
                         "predictions still hold (exit 0), or it is stale (exit 1)")
    ap.add_argument("--residuals", default=None, metavar="PROFILE",
                    help="measure nothing: where PROFILE's cost model misses its own calibration steps, by kind of "
                         "step, sequences and context (median measured / predicted)")
    ap.add_argument("--refit", default=None, metavar="PROFILE",
                    help="measure nothing: re-fit this profile's stored samples with the current cost model "
                         "(written back to PROFILE unless --out)")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line a --check --out file records
    try:
        return _main(args)
    except (ValueError, OSError) as exc:  # a bad --refit file, an unknown --device, an unwritable --out
        print(f"minivllm sim calibrate: error: {exc}", file=sys.stderr)
        return 2


def _refit_doc(path: str) -> dict:
    """The profile at ``path`` for :func:`refit`, checked first: a file that is no profile is a ValueError."""
    from minivllm.sim.presets import load_profile

    if not os.path.isfile(path):
        raise ValueError(f"--refit {brief_path(path)}: no such file")
    doc = load_profile(path)
    missing = [k for k in ("model", "samples", "engine", "fit") if not isinstance(doc.get(k), (dict, list))]
    if missing:
        raise ValueError(f"--refit {brief_path(path)}: a profile with stored samples needs {', '.join(missing)}")
    if not isinstance(doc["samples"], list) or not all(isinstance(doc[k], dict) for k in ("model", "engine", "fit")):
        raise ValueError(f"--refit {brief_path(path)}: samples must be a list, and model, engine and fit objects")
    try:
        _check_stored_samples(doc)
    except ValueError as exc:
        raise ValueError(f"--refit {brief_path(path)}: {exc}") from None
    return doc


def _in_checkout() -> bool:
    """Is this package a source checkout (``pip install -e``) rather than an installed copy?"""
    from minivllm.sim.presets import PROFILE_DIR

    return os.path.isfile(os.path.join(PROFILE_DIR, os.pardir, os.pardir, os.pardir, "pyproject.toml"))


def default_out(name: str) -> str:
    """Where a new profile goes without ``--out``: beside the committed ones in a source checkout (so
    ``--hardware NAME`` finds it), else the current directory -- never into an installed package's folder,
    which pip neither tracks nor removes (``--hardware PATH`` reads it from there)."""
    from minivllm.sim.presets import PROFILE_DIR

    file = f"{name.replace(' ', '_').lower()}.json"
    return os.path.join(PROFILE_DIR, file) if _in_checkout() else os.path.abspath(file)


def _measuring_flags_given(args) -> list[str]:
    """The flags given that say how to measure or what to call a new profile: a job that measures nothing new
    (``--residuals``, ``--refit``) or measures as a profile says (``--check``) refuses them rather than drop them
    silently."""
    return [flag for flag, given in (("--name", args.name), ("--force", args.force), ("--quick", args.quick),
                                     ("--fit-bandwidth", args.fit_bandwidth), ("--clock", args.clock != "wall"),
                                     ("--device", args.device != "auto")) if given]


def _main(args) -> int:
    jobs = [flag for flag, given in (("--check", args.check), ("--refit", args.refit), ("--residuals", args.residuals))
            if given]
    if len(jobs) > 1:
        raise ValueError(f"{' and '.join(jobs)} are {('two', 'three')[len(jobs) - 2]} different jobs: pass one")
    if args.residuals:
        from minivllm.sim.presets import load_profile

        ignored = [flag for flag, given in (("--out", args.out),) if given] + _measuring_flags_given(args) + [
            flag for flag, given in (("--repeats", args.repeats != REPEATS),) if given]
        if ignored:
            raise ValueError(f"--residuals reads a profile and writes nothing: drop {', '.join(ignored)}")
        doc = load_profile(args.residuals)
        print(format_residuals(residuals(doc), args.residuals))
        return 0
    if args.check:
        from minivllm.sim.presets import profile_path, load_profile

        ignored = _measuring_flags_given(args)
        if ignored:  # the profile says how it was measured; a flag that --check would drop is refused, not dropped
            raise ValueError(f"--check measures as the profile was measured and fits nothing: drop {', '.join(ignored)}")
        doc = load_profile(args.check)
        engine = check_engine(doc)
        start = time.perf_counter()
        with frozen_heap():
            result = check(doc, engine, repeats=args.repeats)
        result["seconds"] = time.perf_counter() - start  # the measuring, without the model's load
        path = profile_path(args.check)
        print(format_check(result, path))
        if args.out:  # the verdict as evidence: the numbers, this host and the command, beside the profile's date
            from minivllm.bench.results import write_result

            write_result(args.out, {"benchmark": "sim calibrate --check", "checked": args.check,
                                    **result}, "minivllm sim calibrate", args.argv)
            print(f"wrote {args.out}")
        return 1 if result["stale"] else 0
    if args.refit:
        ignored = _measuring_flags_given(args) + [flag for flag, given in (("--repeats", args.repeats != REPEATS),)
                                                  if given]
        if ignored:  # (taken, they changed nothing: the refit pins the bandwidth the profile measured, keeps its name)
            raise ValueError(f"--refit fits the profile's stored steps again and measures nothing: "
                             f"drop {', '.join(ignored)}")
        doc = refit(_refit_doc(args.refit))
        path = args.out or args.refit
        # whole or not at all: without --out this replaces the profile whose stored steps are the costly part, and
        # a write cut short (a full disk, a kill) left half of it
        write_json(path, doc)
        print(format_profile(doc))
        print(f"wrote {path}")
        return 0
    if args.out is None and not args.force:  # refuse before minutes of measuring, not after
        path = default_out(args.name or default_name(args.device, args.clock))
        if os.path.exists(path):
            why = " (profiles there are committed and loaded by the tests)" if _in_checkout() else ""
            raise ValueError(f"{path} exists{why}: pass --out PATH for your own profile, or --force to replace it")
    engine = real_engine(device=args.device, clock=args.clock)
    with frozen_heap():  # measured as `minivllm serve` runs it: see minivllm.engine.startup
        doc = calibrate(engine, scale=0.4 if args.quick else 1.0, name=args.name,
                        pin_bandwidth=not args.fit_bandwidth, repeats=args.repeats)
    path = args.out or default_out(doc["hardware"]["name"])
    write_json(path, doc)  # (its folder made first; whole or not at all, as --refit's)
    print(format_profile(doc))
    print(f"wrote {path}")
    warning = fit_warning(doc)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
