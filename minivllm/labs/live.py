"""ITL under load, live: open-loop load on the engine's virtual clock, and a picture that updates as it runs.

Why a virtual clock?  On a 2-core laptop the bundled model serves a handful of
requests per second; the interesting part of a latency/rate curve (the knee,
the queue exploding) needs hundreds of requests on a GPU-sized machine.  The
real :class:`~minivllm.engine.llm_engine.LLMEngine` on a
:class:`~minivllm.sim.executor.SimulatedExecutor` makes every scheduling,
admission and preemption decision for real and only models the forward pass,
so a minute of GPU serving replays in a second, reproducibly.

Three pieces, each usable alone:

* :func:`ramp_arrivals` -- a seeded open-loop workload whose Poisson rate steps
  up (or stays flat), the shape that shows when an alarm fires;
* :func:`run_sim_load` -- the arrival loop: add each request when the clock
  reaches it, step, record every token's time, and take a :class:`Sample` (a
  "scrape": queue depth, KV usage, utilisation, windowed TTFT/ITL percentiles)
  every ``every_s`` virtual seconds, calling ``on_sample`` so a caller can redraw;
* :class:`LiveLoad` -- the widget: an ITL histogram, TTFT percentiles, queue
  depth and KV usage drawn on a :class:`~matplotlib.figure.Figure` it owns and
  shown as PNG bytes in an ``ipywidgets.Image`` that is replaced in place after
  every sample (pyplot redraws garble under JupyterLab's comms; see
  :class:`~minivllm.labs.widgets.PictureWidget`).  Without a live kernel the
  final picture is the static output.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from minivllm.arrival import MADE_UP_IDS
from minivllm.metrics.stats import nearest_rank
from minivllm.sampling_params import SamplingParams

# -- workload ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimArrival:
    """One request of a simulated load: when, whose, how long in and out (token ids are made up at add time)."""

    time: float
    request_id: str
    tenant: str
    prompt_len: int
    max_tokens: int


def ramp_arrivals(rates: Sequence[float], seconds_each: float, *, prompt=(64, 512), output=(32, 256),
                  tenants: Sequence[str] = ("default",), seed: int = 0) -> list[SimArrival]:
    """Poisson arrivals at ``rates[0]`` req/s for ``seconds_each`` s, then ``rates[1]``, ... (seeded).

    A single rate is a flat load; an increasing list is the ramp an autoscaler
    must notice.  Prompt and output lengths are uniform in the given ranges.
    """
    if seconds_each <= 0 or not rates or any(not (r > 0) for r in rates):
        raise ValueError("ramp_arrivals needs rates > 0 and seconds_each > 0")
    if not tenants:
        raise ValueError("ramp_arrivals needs at least one tenant in tenants")
    for name, (lo, hi) in (("prompt", prompt), ("output", output)):
        if not 1 <= lo <= hi:
            raise ValueError(f"ramp_arrivals needs {name}=(lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
    rng = random.Random(seed)
    out: list[SimArrival] = []
    for k, rate in enumerate(rates):
        t, end = k * seconds_each, (k + 1) * seconds_each
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            i = len(out)
            out.append(SimArrival(round(t, 6), f"r{i}", tenants[i % len(tenants)], rng.randint(*prompt),
                                  rng.randint(*output)))
    return out


# -- the arrival loop ----------------------------------------------------------------------------


_pct = nearest_rank  # NaN for no values: a window without samples is "no data", not 0


def prompt_ids(seed: int) -> Callable[[int], list[int]]:
    """``take(n)``: the next ``n`` of the ids :func:`~minivllm.arrival.made_up_ids` draws from ``random.Random(seed)``.

    Drawn in bulk because a sweep's prompts are millions of ids (lab 8's whole-GPU knee sweep: 1.8 M), and one
    ``randrange`` call each was a tenth of its run.  The same ids: ``randrange`` takes the top bits of one 32-bit
    word of the generator per try and retries past the range (:meth:`random.Random._randbelow`); a
    ``getrandbits(32 * m)`` holds the next ``m`` words, first word lowest.  Words drawn past the last id taken
    are never used: the generator is this function's own.
    """
    rng = random.Random(seed)
    lo, hi = MADE_UP_IDS
    shift = 32 - (hi - lo).bit_length()
    ids: list[int] = []
    at = 0

    def take(n: int) -> list[int]:
        nonlocal ids, at
        while len(ids) - at < n:
            m = max(4096, 2 * n)
            words = np.frombuffer(rng.getrandbits(32 * m).to_bytes(4 * m, "little"), dtype="<u4") >> shift
            ids = ids[at:] + (words[words < hi - lo] + lo).tolist()
            at = 0
        at += n
        return ids[at - n:at]

    return take


@dataclass(frozen=True)
class Sample:
    """One scrape, every ``every_s`` virtual seconds: what a dashboard (or an autoscaler) would see."""

    time: float
    running: int
    waiting: int  # queue depth
    kv_usage: float  # 0..1, device blocks in use
    # each step's tokens / token budget (capped at 1), weighted by the step's time in the window, idle time
    # counting 0: what "GPU utilisation" tracks
    utilisation: float
    busy: float  # fraction of the window the engine was stepping
    ttft_p90: float  # of requests whose first token came in this window (NaN: none)
    itl_p99: float  # of the gaps that ended in this window (NaN: none)
    tokens_per_s: float  # output tokens / window
    arrived: int  # requests that arrived in the window


@dataclass
class SimRun:
    """Everything one :func:`run_sim_load` measured (times in seconds on the virtual clock)."""

    arrivals: list[SimArrival]
    ttft: dict[str, float] = field(default_factory=dict)
    itls: dict[str, list[float]] = field(default_factory=dict)
    e2e: dict[str, float] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    duration: float = 0.0

    def all_itls(self) -> list[float]:
        return [g for gaps in self.itls.values() for g in gaps]

    def summary(self) -> dict:
        """p50/p90/p99 of TTFT and ITL (ms), p50/p99 of e2e (s), served requests and output tokens per second."""
        itl, ttft, e2e = self.all_itls(), list(self.ttft.values()), list(self.e2e.values())
        # a request's tokens are its first one and one per gap after it; a request failed before its first
        # token (a stall, an error) has an empty entry in ``itls`` and no TTFT: it produced nothing
        tokens = sum(len(self.itls.get(r, ())) + 1 for r in self.ttft)
        return {
            "served": len(self.e2e), "rejected": len(self.rejected),
            **{f"ttft_p{q}_ms": 1000 * _pct(ttft, q) for q in (50, 90, 99)},
            **{f"itl_p{q}_ms": 1000 * _pct(itl, q) for q in (50, 90, 99)},
            **{f"e2e_p{q}_s": _pct(e2e, q) for q in (50, 99)},
            "tokens_per_s": tokens / self.duration if self.duration > 0 else 0.0,
            "preemptions": self.stats.get("num_preemptions", 0),
        }


def run_sim_load(engine, arrivals: Sequence[SimArrival], *, every_s: float | None = 1.0,
                 on_sample: Callable[[SimRun], None] | None = None, max_steps: int = 500_000,
                 seed: int = 0) -> SimRun:
    """Serve ``arrivals`` open loop on ``engine`` (a simulated-executor engine) and scrape it every ``every_s``.

    Open loop: a request is added when the virtual clock reaches its arrival
    time whether or not earlier ones have finished (an idle engine's clock jumps
    ahead).  Token times come from the engine's own ``RequestOutput.metrics``,
    so TTFT and ITL here are exactly what its Prometheus histograms observe.

    ``run.samples`` holds one sample per whole window of ``every_s``; the last,
    partial window is scraped too only when ``on_sample`` is given, because a live
    picture must show how the run ended, while a table of rates per window would
    put a short window's rate beside whole ones.

    ``every_s=None`` scrapes nothing: a sweep that reads only :meth:`SimRun.summary` needs no windows, so each
    request reports once, when it finishes (a ``final_only`` output carries all its token times), not once per
    step.  The TTFTs, gaps and e2e latencies are the same in a run that ends (one cut off at ``max_steps`` leaves
    no record of the requests still running); at lab 8's 256 seats building a streaming output for every running
    request on every step was half the run's time.
    """
    if every_s is None:
        if on_sample is not None:
            raise ValueError("run_sim_load needs every_s to call on_sample: without scrapes there is no sample")
    elif not every_s > 0:  # a zero or negative window never advances the next scrape: the loop would never end
        raise ValueError(f"run_sim_load needs every_s > 0 or None, got {every_s}")
    ex = engine.executor
    budget = engine.config.max_num_batched_tokens
    draw_prompt = prompt_ids(seed)
    run = SimRun(list(arrivals))
    pending = sorted(arrivals, key=lambda a: a.time)
    t0 = pending[0].time if pending else ex.clock
    ex.clock = max(ex.clock, t0)
    scraping = every_s is not None
    next_scrape = ex.clock + every_s if scraping else math.inf
    output_kind = "delta" if scraping else "final_only"
    i = 0
    win_first: list[float] = []
    win_gaps: list[float] = []
    win_tokens = 0
    win_busy = win_comp = 0.0
    win_start = ex.clock
    arrival_times = [a.time for a in pending]
    counted = 0  # arrivals up to the last scrape (counted by their arrival time, not by when the loop added them)
    last_token_time: dict[str, float] = {}  # per request still running: its latest token's time

    def scrape(now: float) -> None:
        nonlocal win_tokens, win_busy, win_comp, win_start, counted
        s = engine.stats()
        length = now - win_start  # every_s, except the last (partial) window
        arrived = bisect.bisect_right(arrival_times, now) - counted
        run.samples.append(Sample(
            time=now - t0, running=s["num_running"], waiting=s["num_waiting"], kv_usage=s["kv_cache_usage"],
            utilisation=win_comp / length if length > 0 else 0.0,
            busy=min(1.0, win_busy / length) if length > 0 else 0.0,
            ttft_p90=_pct(win_first, 90), itl_p99=_pct(win_gaps, 99),
            tokens_per_s=win_tokens / length if length > 0 else 0.0, arrived=arrived))
        win_first.clear()
        win_gaps.clear()
        win_tokens = 0
        win_busy = win_comp = 0.0
        win_start, counted = now, counted + arrived
        if on_sample is not None:
            on_sample(run)

    for _ in range(max_steps):
        busy = engine.has_unfinished_requests()
        if not busy and i >= len(pending):
            break
        if not busy and ex.clock < pending[i].time:
            while next_scrape <= pending[i].time:  # idle windows still get scraped (flat lines, not gaps)
                scrape(next_scrape)
                next_scrape += every_s
            ex.clock = pending[i].time
        while i < len(pending) and pending[i].time <= ex.clock:
            a = pending[i]
            i += 1
            # delta outputs for the scrapes: each step's output carries only that step's token times (a cumulative
            # one would copy every earlier time again, every step -- quadratic in the output length)
            engine.add_request({"prompt_token_ids": draw_prompt(a.prompt_len)},
                               SamplingParams(max_tokens=a.max_tokens, ignore_eos=True, output_kind=output_kind),
                               a.request_id, tenant=a.tenant, arrival_time=a.time)
        if not engine.has_unfinished_requests():
            continue
        before = ex.clock
        outputs = engine.step()
        share = min(1.0, engine.step_log[-1].num_tokens / budget)
        # the step's time goes to the windows it spans; its tokens come out at its end, so the windows that
        # closed while it ran are scraped before its outputs are counted
        while ex.clock > next_scrape:
            part = max(0.0, next_scrape - before)
            win_busy += part
            win_comp += part * share
            before = max(before, next_scrape)
            scrape(next_scrape)
            next_scrape += every_s
        win_busy += ex.clock - before
        win_comp += (ex.clock - before) * share
        for out in outputs:
            m = out.metrics
            if out.finished and out.outputs[0].finish_reason == "rejected":
                run.rejected.append(out.request_id)
                continue
            prev = last_token_time.get(out.request_id)
            if prev is None and m.token_times:
                run.ttft[out.request_id] = m.ttft
                if scraping:
                    win_first.append(m.ttft)
            times = m.token_times if prev is None else [prev, *m.token_times]  # this step's tokens
            gaps = [b - a for a, b in zip(times, times[1:])]
            run.itls.setdefault(out.request_id, []).extend(gaps)
            if scraping:  # (without scrapes no window reads them)
                win_gaps.extend(gaps)
            if times:
                prev = times[-1]
            win_tokens += len(m.token_times)
            if prev is not None:
                last_token_time[out.request_id] = prev
            if out.finished:
                last_token_time.pop(out.request_id, None)
                if m.e2e_latency is not None and out.request_id in run.ttft:  # served: it got a token at least
                    run.e2e[out.request_id] = m.e2e_latency
        while ex.clock >= next_scrape:
            scrape(next_scrape)
            next_scrape += every_s
    run.stats = engine.stats()
    run.duration = ex.clock - t0
    if on_sample is not None and (not run.samples or run.samples[-1].time < run.duration):
        scrape(ex.clock)
    return run


# -- the picture ----------------------------------------------------------------------------------


def draw_live(run: SimRun, fig, *, itl_slo_ms: float | None = None, ttft_slo_s: float | None = None,
              num_seqs: int | None = None, title: str = "") -> None:
    """Four panels on ``fig``: ITL histogram, TTFT percentiles over time, queue depth, KV usage."""
    fig.clear()
    ax_h, ax_t, ax_q, ax_k = fig.subplots(1, 4)
    itl_ms = [1000 * g for g in run.all_itls()]
    if itl_ms:
        hi = max(max(itl_ms), itl_slo_ms or 0) * 1.05
        # an array, not the list: matplotlib inspects a list element by element before it bins it, a quarter
        # of a second per redraw at lab 8's 50,000 gaps (and the ramp redraws five times); the bins are the same
        ax_h.hist(np.asarray(itl_ms), bins=40, range=(0, hi), color="#4e79a7")
        ax_h.set_yscale("log")
    if itl_slo_ms:
        ax_h.axvline(itl_slo_ms, color="#d62728", ls="--", lw=1)
    p99 = _pct(itl_ms, 99)
    ax_h.set_title(f"ITL histogram (p99 {p99:.0f} ms)" if itl_ms else "ITL histogram", fontsize=9)
    ax_h.set_xlabel("inter-token latency (ms)", fontsize=8)
    xs = [s.time for s in run.samples]
    ax_t.plot(xs, [s.ttft_p90 for s in run.samples], "-", color="#f28e2b", label="p90 (window)")
    ttfts = sorted(run.ttft.values())
    for q, style in ((50, ":"), (99, "--")):
        ax_t.axhline(_pct(ttfts, q), color="#59a14f", ls=style, lw=1, label=f"p{q} so far") if ttfts else None
    if ttft_slo_s:
        ax_t.axhline(ttft_slo_s, color="#d62728", ls="--", lw=1, label="SLO")
    ax_t.set_title("TTFT (s)", fontsize=9)
    ax_t.legend(fontsize=6, loc="upper left")
    ax_q.plot(xs, [s.waiting for s in run.samples], "-", color="#e15759", label="waiting")
    ax_q.plot(xs, [s.running for s in run.samples], "-", color="#76b7b2", label="running")
    if num_seqs:
        ax_q.axhline(num_seqs, color="#888888", ls=":", lw=1)
    ax_q.set_title("queue depth", fontsize=9)
    ax_q.legend(fontsize=6, loc="upper left")
    ax_k.plot(xs, [100 * s.kv_usage for s in run.samples], "-", color="#b07aa1", label="KV usage")
    ax_k.plot(xs, [100 * s.utilisation for s in run.samples], "-", color="#9c755f", label="utilisation")
    ax_k.set_ylim(0, 105)
    ax_k.set_title("KV usage / utilisation (%)", fontsize=9)
    ax_k.legend(fontsize=6, loc="lower right")
    for ax in (ax_t, ax_q, ax_k):
        ax.set_xlabel("time (s, virtual)", fontsize=8)
    for ax in (ax_h, ax_t, ax_q, ax_k):
        ax.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.99, top=0.80, bottom=0.2, wspace=0.35)


class LiveLoad:
    """Run :func:`run_sim_load` and redraw :func:`draw_live` after every scrape, in place.

    ``make_engine()`` builds a fresh simulated engine (so :meth:`run` can be
    clicked again); ``arrivals`` is the load.  In Jupyter, :meth:`show` puts a
    "run" button over an ``ipywidgets.Image`` and :meth:`run` replaces the
    image's bytes after every ``redraw_every`` scrapes; without a live kernel
    the picture after the run is the static output.
    """

    def __init__(self, make_engine: Callable[[], object], arrivals: Sequence[SimArrival], *, every_s: float = 0.5,
                 redraw_every: int = 2, itl_slo_ms: float | None = None, ttft_slo_s: float | None = None,
                 figsize=(12, 2.8), title: str = "") -> None:
        from matplotlib.figure import Figure

        self.make_engine = make_engine
        self.arrivals = list(arrivals)
        self.every_s, self.redraw_every = every_s, max(1, redraw_every)
        self.itl_slo_ms, self.ttft_slo_s, self.title = itl_slo_ms, ttft_slo_s, title
        self.fig = Figure(figsize=figsize)
        self.result: SimRun | None = None
        self.widget = None
        self._image = None
        self._label = None
        self.num_redraws = 0

    def png(self, run: SimRun | None = None) -> bytes:
        from minivllm.labs.widgets import figure_png

        run = run if run is not None else (self.result or SimRun([]))
        draw_live(run, self.fig, itl_slo_ms=self.itl_slo_ms, ttft_slo_s=self.ttft_slo_s, title=self.title)
        return figure_png(self.fig)

    def line(self) -> str:
        if self.result is None:
            return "not run yet"
        s = self.result.summary()
        return (f"{s['served']} served in {self.result.duration:.1f} s: TTFT p50/p99 {s['ttft_p50_ms']:.0f}/"
                f"{s['ttft_p99_ms']:.0f} ms, ITL p50/p99 {s['itl_p50_ms']:.0f}/{s['itl_p99_ms']:.0f} ms, "
                f"{s['tokens_per_s']:.0f} tokens/s, {s['preemptions']} preemptions")

    def run(self) -> SimRun:
        """Run the whole load once on a fresh engine, redrawing the live image (if shown) as it goes."""
        def on_sample(run: SimRun) -> None:
            if self._image is not None and len(run.samples) % self.redraw_every == 0:
                self._image.value = self.png(run)
                self.num_redraws += 1

        self.result = run_sim_load(self.make_engine(), self.arrivals, every_s=self.every_s, on_sample=on_sample)
        if self._image is not None:
            self._image.value = self.png()
            self._label.value = self.line()
        return self.result

    def rerun(self) -> str:
        """The "run again" button: :meth:`run`, then the line under the picture says how the run went -- or,
        where it raised (a ``make_engine`` that fails, a drawing that does), what went wrong, which a callback's
        exception would otherwise show only in the kernel's log (:func:`~minivllm.labs.widgets.attempt`)."""
        from minivllm.labs.widgets import attempt

        def again() -> str:
            self.run()
            return self.line()

        text = attempt("run again", again)
        if self._label is not None:
            self._label.value = text
        return text

    def show(self, run: bool = True):
        """Display the widget (or, without ipywidgets, the static picture) and, by default, run the load."""
        from IPython.display import Image, display

        try:
            import ipywidgets as w
        except ImportError:
            if run:
                self.run()
            display(Image(data=self.png()))
            print(self.line())
            return None
        # with run=True the first redraw replaces the picture a moment later: an empty one is not drawn first
        self._image = w.Image(value=b"" if run else self.png(), format="png")
        self._label = w.Label(value=self.line())
        button = w.Button(description="run again")
        button.on_click(lambda _: self.rerun())
        self.widget = _LiveBox([button, self._image, self._label], self)
        handle = display(self.widget, display_id=True)
        if run:
            self.run()
            if handle is not None:  # re-send the bundle: a saved notebook keeps the final picture, not the empty one
                handle.update(self.widget)
        print(self.line())
        return None


try:
    import ipywidgets as _w

    class _LiveBox(_w.VBox):
        """The widget's static fallback (no live kernel) is the latest picture plus one stable caption."""

        def __init__(self, children, owner: LiveLoad):
            super().__init__(children)
            self._owner = owner

        def _repr_mimebundle_(self, **kwargs):
            import base64

            bundle = super()._repr_mimebundle_(**kwargs)
            if isinstance(bundle, tuple):
                bundle = bundle[0]
            bundle = dict(bundle or {})
            if self._owner._image.value:  # (empty until the run's first redraw)
                bundle["image/png"] = base64.b64encode(self._owner._image.value).decode("ascii")
            bundle["text/plain"] = "[live ITL under load: run this notebook in Jupyter to watch it update]"
            return bundle
except ImportError:  # pragma: no cover
    _LiveBox = None  # type: ignore[assignment]
