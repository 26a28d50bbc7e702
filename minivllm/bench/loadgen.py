"""``minivllm bench serve --base-url URL`` — an open-loop load generator for OpenAI-compatible servers.

It speaks only the OpenAI HTTP API (streaming ``/v1/completions`` or
``/v1/chat/completions``, parsed as server-sent events with httpx), so the same
command measures ``minivllm serve``, vLLM or SGLang.

* **Arrivals** are open loop: Poisson at ``--request-rate`` (req/s), or gamma
  with ``--burstiness`` as the shape (1 = Poisson, < 1 burstier, > 1 smoother;
  vLLM's convention), or the timestamps of a ``--trace`` JSONL file (one request
  a line: ``{"timestamp": s, "tenant": "alice", "prompt": "..." | "prompt_len": n,
  "max_tokens": m}``).  A request is sent at its arrival time whether or not
  earlier ones have finished (``--max-concurrency`` caps requests in flight).
* **Tenants** (``--tenant name=alice,key=KEY,share=2,input=uniform:32:128,output=fixed:16,prefix=sys:256``,
  repeatable): a share of the arrivals, prompt and output length distributions
  (``fixed:N`` / ``N``, ``uniform:LO:HI``, ``lognormal:MEDIAN:SIGMA[:MAX]``), a
  shared-prefix group (tenants and requests of a group share one system prompt
  of that many tokens) and an API key, so tenants map onto the server's.
  Prompts are made of common English words (about one token each); the report
  uses the server's own token counts (``usage``).  Everything is seeded.
* **Measured per request**: TTFT, every inter-token gap (ITL, one per streamed
  chunk after the first), end-to-end latency, tokens, HTTP status; a 429 is a
  reject (its ``Retry-After`` kept), other failures are errors.
* **Report**: p50/p90/p99 of TTFT, ITL and e2e per tenant and overall,
  throughput, and goodput under ``--slo-ttft-ms`` / ``--slo-itl-ms``; ``--out``
  writes JSON, ``--figures DIR`` latency CDFs, ITL over time and (with
  ``--rates 1,2,4``) goodput and p99 ITL vs rate, plus the highest rate that
  meets the SLO.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Iterable, Iterator

import numpy as np

from minivllm.argtypes import (fraction, is_int, is_real, nonnegative_float, nonnegative_int, output_file, positive_float,
                               positive_int, positive_rate, refuse_unread)
from minivllm.bench.results import write_result
from minivllm.metrics.stats import interpolated, meets_slo

# Common English words; with a leading space each is a single token for most BPE vocabularies
# (SmolLM2, Llama, Qwen), so ``n`` words make a prompt of about ``n`` tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his her they this which are have had one "
    "not but all were when there can been has more if will would who so out up into them some could "
    "time two first then like now people other than only its over also new after way many these just "
    "work day may most any back where year much good well should long city part world still under last "
    "water state made between life both few house place while school end found same number another "
    "small each high own great old right large point land group hand power light night line game room "
    "river head body money story order music form name book road field paper market sound table garden"
).split()

OUTCOMES = ("ok", "rejected", "error", "timeout", "unsent")


# -- workload ------------------------------------------------------------------------------


# No model serves a million-token prompt, and a plan writes every prompt out as words: a length above this is
# a typo (or a lognormal tail) that would only hang the planner, so specs are refused and samples capped here.
MAX_LENGTH = 1_000_000


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution: ``fixed:N`` (or ``N``), ``uniform:LO:HI``, ``lognormal:MEDIAN:SIGMA[:MAX]``.

    Lengths are at most :data:`MAX_LENGTH`; a lognormal sample is capped at MAX (and at ``MAX_LENGTH``).
    """

    kind: str
    a: float
    b: float = 0.0
    hi: int | None = None

    @classmethod
    def parse(cls, spec: str | int) -> "LengthDist":
        s = str(spec).strip()
        parts = s.split(":")
        try:
            if len(parts) == 1 or (parts[0] == "fixed" and len(parts) == 2):
                n = int(parts[-1])
                if not 1 <= n <= MAX_LENGTH:
                    raise ValueError
                return cls("fixed", n)
            if parts[0] == "uniform" and len(parts) == 3:
                lo, hi = int(parts[1]), int(parts[2])
                if not 1 <= lo <= hi <= MAX_LENGTH:
                    raise ValueError
                return cls("uniform", lo, hi)
            if parts[0] == "lognormal" and len(parts) in (3, 4):
                median, sigma = float(parts[1]), float(parts[2])
                hi = int(parts[3]) if len(parts) == 4 else None
                # nan/inf would pass the comparisons and fail only when sampled (an int() of nan or inf)
                if not (1 <= median <= MAX_LENGTH and 0 <= sigma < math.inf) or (hi is not None and hi < 1):
                    raise ValueError
                return cls("lognormal", median, sigma, hi)
        except ValueError:
            pass
        raise ValueError(f"bad length distribution {spec!r}: use N, fixed:N, uniform:LO:HI or lognormal:MEDIAN:SIGMA[:MAX], "
                         f"lengths from 1 to {MAX_LENGTH:,}")

    def sample(self, rng: np.random.Generator) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(rng.integers(int(self.a), int(self.b) + 1))
        top = MAX_LENGTH if self.hi is None else min(self.hi, MAX_LENGTH)
        e = self.b * rng.standard_normal()
        if e > math.log(top / self.a) + 1.0:  # far past the cap (exp could overflow a float): the cap
            return top
        return min(max(1, int(round(self.a * math.exp(e)))), top)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{int(self.a)}"
        if self.kind == "uniform":
            return f"uniform:{int(self.a)}:{int(self.b)}"
        return f"lognormal:{_exact(self.a)}:{_exact(self.b)}" + (f":{self.hi}" if self.hi is not None else "")


def _exact(x: float) -> str:
    """``x`` as short as ``:g`` writes it when that reads back as ``x``, else in full: the spec is parsed again
    (``sim run`` fills a tenant's missing lengths from it, a result file records it), and ``:g``'s six digits made
    ``lognormal:12345.67:0.5`` come back as ``12345.7``, a different distribution and so a different workload."""
    s = f"{x:g}"
    return s if float(s) == x else repr(x)


@dataclass
class Tenant:
    name: str
    api_key: str | None = None
    share: float = 1.0
    input_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 64))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 16))
    prefix_group: str | None = None
    prefix_len: int = 0

    def describe(self) -> dict:
        return {"name": self.name, "api_key": "***" if self.api_key else None, "share": self.share,
                "input_len": str(self.input_len), "output_len": str(self.output_len),
                "prefix_group": self.prefix_group, "prefix_len": self.prefix_len}


def parse_tenant(spec: str, default_input: str = "fixed:64", default_output: str = "fixed:16",
                 default_key: str | None = None) -> Tenant:
    """``name=alice,key=KEY,share=2,input=uniform:32:128,output=fixed:16,prefix=GROUP:LEN``."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        k, sep, v = part.partition("=")
        k = k.strip()
        if not sep or k not in ("name", "key", "share", "input", "output", "prefix"):
            raise ValueError(f"bad tenant field {part!r} in {spec!r} (fields: name, key, share, input, output, prefix)")
        if k in fields:  # the second one would silently win
            raise ValueError(f"tenant field {k!r} given twice in {spec!r}")
        fields[k] = v.strip()
    if not fields.get("name"):
        raise ValueError(f"tenant {spec!r} needs name=...")
    try:
        share = float(fields.get("share", 1.0))
    except ValueError:
        share = math.nan  # refused just below, with the tenant named (float()'s own message names neither)
    if not share > 0 or not math.isfinite(share):
        raise ValueError(f"tenant {fields['name']!r}: share must be a number > 0, got {fields.get('share')!r}")
    group, plen = None, 0
    if "prefix" in fields:
        g, sep, n = fields["prefix"].rpartition(":")
        if not sep or not g or not n.isdigit() or int(n) < 1:
            raise ValueError(f"tenant {fields['name']!r}: prefix must be GROUP:LEN, got {fields['prefix']!r}")
        group, plen = g, int(n)
    return Tenant(fields["name"], fields.get("key", default_key), share, LengthDist.parse(fields.get("input", default_input)),
                  LengthDist.parse(fields.get("output", default_output)), group, plen)


@dataclass
class PlannedRequest:
    index: int
    arrival: float  # seconds after the start of the run
    tenant: str
    prompt: str
    prompt_len: int  # intended prompt tokens (approximate: words)
    max_tokens: int


def words_text(rng: np.random.Generator, n: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n))


def prefix_text(group: str, n: int, seed: int) -> str:
    """The shared system prompt of a prefix group: the same text for every tenant and request of the group."""
    rng = np.random.default_rng([seed, zlib.crc32(group.encode())])
    return words_text(rng, n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, rng: np.random.Generator | None = None) -> np.ndarray:
    """``n`` arrival times (s) of a gamma renewal process with mean rate ``rate`` and shape ``burstiness``.

    Inter-arrival gaps are Gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate,
    coefficient of variation 1/sqrt(burstiness), so burstiness 1 is Poisson.  The first
    request arrives at 0; ``rate=inf`` sends everything at once.
    """
    if n <= 0:
        return np.zeros(0)
    if not rate > 0:
        raise ValueError("rate must be > 0")
    if not burstiness > 0:
        raise ValueError("burstiness must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    rng = rng if rng is not None else np.random.default_rng(0)
    rb = rate * burstiness  # (which can overflow to inf, a scale of 0: every arrival at once)
    scale = 1.0 / rb if math.isfinite(rb) and rb > 0 else 1.0 / rate / burstiness
    if not math.isfinite(scale):  # a product that underflows: 1/0 raised, or an infinite scale drew NaN gaps
        raise ValueError(f"rate {rate:g} x burstiness {burstiness:g} is too small: the gap scale overflows a float")
    gaps = rng.gamma(burstiness, scale, n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def plan_requests(tenants: list[Tenant], n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[PlannedRequest]:
    """The synthetic workload: arrivals, a tenant per arrival by share, prompt and output lengths; seeded."""
    if not tenants:
        raise ValueError("no tenants")
    rng = np.random.default_rng(seed)
    times = arrival_times(n, rate, burstiness, np.random.default_rng([seed, 1]))
    shares = np.array([t.share for t in tenants], dtype=float)
    with np.errstate(over="ignore"):  # finite shares can still sum to inf (1e308 + 1e308)
        if not math.isfinite(shares.sum()):
            shares = shares / shares.max()
    who = rng.choice(len(tenants), size=n, p=shares / shares.sum())
    out = []
    for i in range(n):
        t = tenants[int(who[i])]
        k = t.input_len.sample(rng)
        prompt = words_text(rng, k)
        if t.prefix_len:
            prompt = prefix_text(t.prefix_group or t.name, t.prefix_len, seed) + "\n" + prompt
        out.append(PlannedRequest(i, float(times[i]), t.name, prompt, k + t.prefix_len, t.output_len.sample(rng)))
    return out


@dataclass
class TraceEntry:
    timestamp: float
    tenant: str | None = None
    prompt: str | None = None
    prompt_len: int | None = None
    max_tokens: int | None = None


def parse_trace(lines: Iterable[str]) -> list[TraceEntry]:
    """JSONL: ``timestamp`` (or ``arrival`` / ``time``, seconds), optional ``tenant``, ``prompt`` or
    ``prompt_len`` (or ``input_len``), ``max_tokens`` (or ``output_len``).  Blank lines and ``#``
    comments are skipped; entries are returned sorted by time, shifted to start at 0."""
    out: list[TraceEntry] = []
    for no, line in enumerate(lines, 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        try:
            obj = json.loads(s)
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace line {no}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"trace line {no}: expected an object")
        ts = next((obj[k] for k in ("timestamp", "arrival", "time") if k in obj), None)
        if not is_real(ts) or ts < 0:
            raise ValueError(f"trace line {no}: needs a non-negative number 'timestamp'")
        prompt = obj.get("prompt")
        plen = obj.get("prompt_len", obj.get("input_len"))
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise ValueError(f"trace line {no}: 'prompt' must be a non-empty string")
        if plen is not None and (not is_int(plen) or not 1 <= plen <= MAX_LENGTH):
            raise ValueError(f"trace line {no}: 'prompt_len' must be an integer from 1 to {MAX_LENGTH:,}")
        if prompt is None and plen is None:
            raise ValueError(f"trace line {no}: needs 'prompt' or 'prompt_len'")
        mt = obj.get("max_tokens", obj.get("output_len"))
        if mt is not None and (not is_int(mt) or mt < 1):
            raise ValueError(f"trace line {no}: 'max_tokens' must be a positive integer")
        tenant = obj.get("tenant")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"trace line {no}: 'tenant' must be a non-empty string")
        out.append(TraceEntry(float(ts), tenant, prompt, plen, mt))
    if not out:
        raise ValueError("the trace has no requests")
    out.sort(key=lambda e: e.timestamp)
    t0 = out[0].timestamp
    for e in out:
        e.timestamp -= t0
    return out


def mean_arrival_rate(times) -> float:
    """Arrivals per second over a schedule's span, ``(n - 1) / (last - first)``: the first arrival opens the span,
    so each later one adds a gap.  A trace's own pace, what :func:`plan_from_trace` scales to a rate asked for,
    and what a report prints as the rate a trace offered.  inf when every arrival shares one instant (one alone
    included): the schedule sends everything at once, as ``--rates inf`` does."""
    first, last = min(times), max(times)
    return (len(times) - 1) / (last - first) if last > first else math.inf


def plan_from_trace(entries: list[TraceEntry], tenants: list[Tenant], rate: float | None = None,
                    seed: int = 0) -> list[PlannedRequest]:
    """Requests from a parsed trace; with ``rate``, timestamps are scaled so the mean rate is ``rate``.

    An entry's own ``prompt`` is sent as written, without its tenant's ``prefix=`` text: a replay must send the
    prompts the trace recorded.  Only a ``prompt_len`` entry, whose words are made up here, gets the prefix.
    """
    by_name = {t.name: t for t in tenants}
    scale = 1.0
    span = entries[-1].timestamp
    if rate is not None and len(entries) > 1 and span > 0:
        scale = mean_arrival_rate([e.timestamp for e in entries]) / rate if not math.isinf(rate) else 0.0
    rng = np.random.default_rng(seed)
    out = []
    for i, e in enumerate(entries):
        name = e.tenant or tenants[0].name
        if name not in by_name:
            raise ValueError(f"trace tenant {name!r} is not declared (add --tenant name={name},key=...)")
        t = by_name[name]
        if e.prompt is not None:
            prompt, plen = e.prompt, len(e.prompt.split())
        else:
            prompt, plen = words_text(rng, e.prompt_len), e.prompt_len
            if t.prefix_len:
                prompt = prefix_text(t.prefix_group or t.name, t.prefix_len, seed) + "\n" + prompt
                plen += t.prefix_len
        mt = e.max_tokens if e.max_tokens is not None else t.output_len.sample(rng)
        out.append(PlannedRequest(i, e.timestamp * scale, name, prompt, plen, mt))
    return out


# -- SSE -----------------------------------------------------------------------------------


async def sse_lines(chunks):
    """The lines of an SSE body from its text chunks, split where SSE splits them: at CR LF, LF or CR only.

    httpx's ``aiter_lines`` splits like ``str.splitlines``, which also breaks at U+2028, U+2029 and U+0085; a
    server may send those raw inside a JSON string (the SSE spec lets it), and the ``data:`` line would come
    out in two unparseable halves.
    """
    buf = ""
    async for chunk in chunks:
        buf += chunk
        if "\r" in buf:  # CR LF, or a lone CR, ends a line like LF (a CR at the very end may start a CR LF)
            keep_cr = buf.endswith("\r")
            body = buf[:-1] if keep_cr else buf
            buf = body.replace("\r\n", "\n").replace("\r", "\n") + ("\r" if keep_cr else "")
        *lines, buf = buf.split("\n")
        for line in lines:
            yield line
    if buf:
        yield buf.rstrip("\r")


class SSEDecoder:
    """Incremental server-sent-events decoder (the WHATWG rules that matter here).

    Feed it lines without their terminators; it returns an event's data (its
    ``data:`` lines joined by newlines) at the blank line that ends the event.
    Comment lines (``:``) and other fields (``event:``, ``id:``, ``retry:``) are skipped.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def feed(self, line: str) -> str | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        return None

    def flush(self) -> str | None:
        """Data of an event left unterminated at end of stream, if any."""
        return self.feed("")


def iter_sse(lines: Iterable[str]) -> Iterator[str]:
    dec = SSEDecoder()
    for line in lines:
        data = dec.feed(line)
        if data is not None:
            yield data
    data = dec.flush()
    if data is not None:
        yield data


# -- the client ----------------------------------------------------------------------------


@dataclass
class RequestResult:
    index: int
    tenant: str
    arrival: float  # scheduled, s after start
    prompt_len: int
    max_tokens: int
    outcome: str = "unsent"
    status: int | None = None
    start: float | None = None  # sent, s after start
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int | None = None
    retry_after: float | None = None
    error: str | None = None
    gave_up: float | None = None  # a request timed out: when the client stopped waiting, s after start

    @property
    def token_times(self) -> list[float]:
        """When each chunk arrived (s after start of the run)."""
        if self.ttft is None or self.start is None:
            return []
        t = self.start + self.ttft
        out = [t]
        for g in self.itl:
            t += g
            out.append(t)
        return out


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return None


async def send_request(client, endpoint: str, model: str, req: PlannedRequest, res: RequestResult, t0: float,
                       api_key: str | None, request_timeout: float, ignore_eos: bool = True,
                       temperature: float = 0.0) -> None:
    """Send one streaming request and fill ``res``; never raises except on cancellation."""
    chat = endpoint == "chat"
    url = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": model, "max_tokens": req.max_tokens, "stream": True, "temperature": temperature,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    res.start, res.outcome = start - t0, "timeout"  # until it finishes one way or another

    async def exchange() -> None:  # the whole request, under one deadline (asyncio.wait_for: Python 3.10 too)
        last = start
        usage = None
        async with client.stream("POST", url, json=body, headers=headers) as r:
            res.status = r.status_code
            if r.status_code != 200:
                text = (await r.aread()).decode("utf-8", "replace")
                if r.status_code == 429:
                    res.outcome = "rejected"
                    res.retry_after = _retry_after(r.headers.get("retry-after"))
                else:
                    res.outcome = "error"
                res.error = f"HTTP {r.status_code}: {text[:200]}"
                res.e2e = time.perf_counter() - start
                return
            dec = SSEDecoder()
            done = False
            async for line in sse_lines(r.aiter_text()):
                data = dec.feed(line)
                if data is None:
                    continue
                if data.strip() == "[DONE]":
                    done = True
                    break
                try:
                    obj = json.loads(data)
                except json.JSONDecodeError:
                    res.outcome, res.error = "error", f"bad SSE data: {data[:100]!r}"
                    return
                if "error" in obj:
                    res.outcome, res.error = "error", f"stream error: {json.dumps(obj['error'])[:200]}"
                    return
                if obj.get("usage"):
                    usage = obj["usage"]
                for ch in obj.get("choices") or []:
                    text = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if text:
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
            res.e2e = time.perf_counter() - start
            if not done:
                res.outcome, res.error = "error", "stream ended without [DONE]"
                return
        res.output_tokens = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else res.chunks
        if usage and "prompt_tokens" in usage:
            res.prompt_tokens = int(usage["prompt_tokens"])
        res.outcome = "ok"

    try:
        await asyncio.wait_for(exchange(), request_timeout)
    except (TimeoutError, asyncio.TimeoutError):
        res.outcome, res.error = "timeout", f"no answer within --request-timeout {request_timeout:g}s"
        res.gave_up = time.perf_counter() - t0
    except asyncio.CancelledError:
        res.outcome, res.error = "timeout", "cancelled at the overall --timeout"
        raise
    except Exception as exc:  # noqa: BLE001 - httpx errors, connection resets: count, go on
        res.outcome, res.error = "error", f"{type(exc).__name__}: {exc}"[:200]
        res.e2e = time.perf_counter() - start


@dataclass
class RunResult:
    rate: float
    duration: float
    results: list[RequestResult]


async def run_load(base_url: str, plan: list[PlannedRequest], tenants: list[Tenant], model: str,
                   endpoint: str = "completions", max_concurrency: int | None = None, timeout: float = 600.0,
                   request_timeout: float = 120.0, progress: bool = True, ignore_eos: bool = True,
                   temperature: float = 0.0, rate: float = float("nan"), desc: str = "requests",
                   transport=None) -> RunResult:
    """Send ``plan`` open loop and record every request; everything stops at ``timeout`` seconds.

    ``transport`` (an httpx transport) is for tests."""
    import httpx
    from tqdm.auto import tqdm

    keys = {t.name: t.api_key for t in tenants}
    results = [RequestResult(p.index, p.tenant, p.arrival, p.prompt_len, p.max_tokens) for p in plan]
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or max(1, len(plan)), max_keepalive_connections=64)
    to = httpx.Timeout(request_timeout, connect=min(10.0, request_timeout), pool=None)
    bar = tqdm(total=len(plan), desc=desc, unit="req", disable=not progress, file=sys.stderr, leave=False)
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=to, limits=limits, trust_env=False,
                                 transport=transport) as client:
        t0 = time.perf_counter()

        async def fire(p: PlannedRequest, res: RequestResult) -> None:
            try:
                if sem is None:
                    await send_request(client, endpoint, model, p, res, t0, keys.get(p.tenant), request_timeout,
                                       ignore_eos, temperature)
                else:
                    async with sem:
                        await send_request(client, endpoint, model, p, res, t0, keys.get(p.tenant), request_timeout,
                                           ignore_eos, temperature)
            except asyncio.CancelledError:
                if res.outcome == "unsent":
                    res.outcome, res.error = "timeout", "waited for a --max-concurrency slot past --timeout"
                raise
            finally:
                bar.update(1)

        async def everything() -> None:
            for p, res in zip(plan, results):
                delay = t0 + p.arrival - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(fire(p, res)))
            await asyncio.gather(*tasks)

        main = asyncio.create_task(everything())
        stopped = []  # when the overall --timeout ended the run, if it did
        try:
            await asyncio.wait_for(asyncio.shield(main), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            stopped.append(time.perf_counter() - t0)
            main.cancel()
            for t in tasks:
                t.cancel()
            await asyncio.gather(main, *tasks, return_exceptions=True)
        # The run lasts until its last request is done with: answered or refused (start + e2e), given up on
        # (``gave_up``: a timed-out request has no e2e, and the latest e2e alone ended a run at its last answer,
        # long before the request it still waited on gave up -- two answers in 1 ms beside a request timing out
        # after 1 s read as 1,700 req/s), or cut by the overall --timeout.  Not the moment this line runs: the
        # tasks' teardown after the last answer is no part of the load.
        ends = [r.start + r.e2e for r in results if r.start is not None and r.e2e is not None]
        ends += [r.gave_up for r in results if r.gave_up is not None] + stopped
        duration = max(ends) if ends else time.perf_counter() - t0
    bar.close()
    return RunResult(rate, duration, results)


# -- statistics ----------------------------------------------------------------------------


percentile = interpolated  # vLLM's serving benchmark reports numpy's default percentile; so do these tables


def request_itl(r: RequestResult, stat: str = "p99") -> float | None:
    """A request's own ITL figure for its SLO check: ``p99`` (of its gaps), ``max`` or ``mean``; None with < 2 chunks."""
    if not r.itl:
        return None
    if stat == "max":
        return max(r.itl)
    if stat == "mean":
        return sum(r.itl) / len(r.itl)
    return percentile(r.itl, 99)


def is_good(r: RequestResult, slo_ttft: float | None, slo_itl: float | None, itl_stat: str = "p99") -> bool:
    """Served, and within both SLOs (seconds; None = no constraint).  A request with one chunk has no gap to miss."""
    return r.outcome == "ok" and meets_slo(r.ttft, request_itl(r, itl_stat), slo_ttft, slo_itl)


def _pcts(xs: list[float], scale: float = 1.0) -> dict:
    return {f"p{p}": (percentile(xs, p) * scale if xs else None) for p in (50, 90, 99)} | {
        "mean": (sum(xs) / len(xs) * scale if xs else None), "n": len(xs)}


def summarize_group(results: list[RequestResult], duration: float, slo_ttft: float | None = None,
                    slo_itl: float | None = None, itl_stat: str = "p99") -> dict:
    ok = [r for r in results if r.outcome == "ok"]
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    good = sum(is_good(r, slo_ttft, slo_itl, itl_stat) for r in results)
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    ra = [r.retry_after for r in results if r.outcome == "rejected" and r.retry_after is not None]
    waits = [r.start - r.arrival for r in results if r.start is not None]
    dur = duration if duration > 0 else float("nan")
    return {
        # sent: had a send time.  Not "all but unsent": a request still waiting for a --max-concurrency slot at
        # the overall --timeout ends as a timeout, though it never left the client.
        "requests": len(results), "sent": sum(r.start is not None for r in results), **counts,
        "ttft_ms": _pcts(ttft, 1000), "itl_ms": _pcts(itl, 1000), "e2e_s": _pcts(e2e),
        "client_wait_ms_p99": percentile(waits, 99) * 1000 if waits else None,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
        "request_throughput": len(ok) / dur, "output_throughput": out_tokens / dur,
        "good": good, "goodput_fraction": good / len(results) if results else None, "goodput_rps": good / dur,
        "retry_after_s_mean": sum(ra) / len(ra) if ra else None,
    }


def summarize(run: RunResult, slo_ttft: float | None = None, slo_itl: float | None = None, itl_stat: str = "p99") -> dict:
    tenants = sorted({r.tenant for r in run.results})
    return {
        "rate": run.rate, "duration_s": run.duration,
        "overall": summarize_group(run.results, run.duration, slo_ttft, slo_itl, itl_stat),
        "tenants": {t: summarize_group([r for r in run.results if r.tenant == t], run.duration, slo_ttft, slo_itl, itl_stat)
                    for t in tenants},
    }


def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def format_table(summary: dict, slo_text: str = "") -> str:
    head = (f"{'tenant':<10} {'sent':>4} {'ok':>4} {'429':>4} {'err':>4} | {'TTFT ms p50/p90/p99':>20} | "
            f"{'ITL ms p50/p90/p99':>20} | {'e2e s p50/p90/p99':>18} | {'req/s':>6} {'tok/s':>7} | {'good':>5} {'good/s':>6}")
    lines = [head, "-" * len(head)]
    rows = list(summary["tenants"].items())
    if len(rows) > 1:  # (one tenant's row is the overall one; told apart by position: a tenant may be named "overall")
        rows.append(("overall", summary["overall"]))
    for k, (name, s) in enumerate(rows):
        if k == len(summary["tenants"]):
            lines.append("-" * len(head))
        t, i, e = s["ttft_ms"], s["itl_ms"], s["e2e_s"]
        lines.append(
            f"{name[:10]:<10} {s['sent']:>4} {s['ok']:>4} {s['rejected']:>4} {s['error'] + s['timeout']:>4} | "
            f"{_f(t['p50']) + '/' + _f(t['p90']) + '/' + _f(t['p99']):>20} | "
            f"{_f(i['p50']) + '/' + _f(i['p90']) + '/' + _f(i['p99']):>20} | "
            f"{_f(e['p50'], '{:.2f}') + '/' + _f(e['p90'], '{:.2f}') + '/' + _f(e['p99'], '{:.2f}'):>18} | "
            f"{_f(s['request_throughput'], '{:.2f}'):>6} {_f(s['output_throughput'], '{:.1f}'):>7} | "
            f"{_f(100 * s['goodput_fraction'] if s['goodput_fraction'] is not None else None, '{:.0f}%'):>5} "
            f"{_f(s['goodput_rps'], '{:.2f}'):>6}")
    o = summary["overall"]
    rate = summary["rate"]
    lines.append(f"offered {_f(rate, '{:g}')} req/s | {summary['duration_s']:.1f} s | {o['output_tokens']} output tokens"
                 + (f" | rejects {o['rejected']} (Retry-After mean {o['retry_after_s_mean']:.1f} s)" if o["rejected"]
                    and o["retry_after_s_mean"] is not None else f" | rejects {o['rejected']}")
                 + (f" | errors {o['error']}" if o["error"] else "") + (f" | timeouts {o['timeout']}" if o["timeout"] else "")
                 + (f" | unsent {o['unsent']}" if o["unsent"] else "")
                 + (f" | client wait p99 {o['client_wait_ms_p99']:.0f} ms" if (o["client_wait_ms_p99"] or 0) >= 1 else "")
                 + (f" | {slo_text}" if slo_text else ""))
    return "\n".join(lines)


def meets(summary: dict, criterion: str, slo_ttft: float | None, slo_itl: float | None, min_goodput: float) -> bool:
    o = summary["overall"]
    if criterion == "goodput":
        return (o["goodput_fraction"] or 0.0) >= min_goodput
    if slo_itl is None:
        raise ValueError("the itl sweep criterion needs --slo-itl-ms")
    p99 = o["itl_ms"]["p99"]
    ok = p99 is not None and p99 <= slo_itl * 1000 and o["ok"] > 0
    if slo_ttft is not None:
        t = o["ttft_ms"]["p99"]
        ok = ok and t is not None and t <= slo_ttft * 1000
    return ok


def sweep_verdict(summaries: list[dict], criterion: str, slo_ttft: float | None, slo_itl: float | None,
                  min_goodput: float) -> dict:
    """The highest swept rate meeting the criterion, and where the curve crosses it above that rate.

    ``crossing_rate`` interpolates linearly between that rate and the next (failing) one, on p99
    ITL and p99 TTFT (with ``slo_ttft``; the lower crossing) for the ``itl`` criterion and on the
    goodput fraction for ``goodput``; None where no line crosses (the next rate failed otherwise).  Lower rates that
    fail anyway are listed in ``failing_below``: latency should not fall as load rises, so they
    point at noise (a shared machine) or too few requests per rate.
    """
    rows = sorted(summaries, key=lambda s: s["rate"])
    passes = [meets(s, criterion, slo_ttft, slo_itl, min_goodput) for s in rows]
    idx = max((i for i, ok in enumerate(passes) if ok), default=None)
    best, crossing, first_fail = None, None, None
    if idx is None:
        first_fail = rows[0]["rate"] if rows else None
    else:
        best = rows[idx]["rate"]
        if idx + 1 < len(rows):
            a, b = rows[idx], rows[idx + 1]
            first_fail = b["rate"]
            if criterion == "goodput":
                lines = [("goodput_fraction", None, min_goodput)]
            else:
                lines = [("itl_ms", "p99", slo_itl * 1000)] + ([("ttft_ms", "p99", slo_ttft * 1000)] if slo_ttft else [])
            fracs = []
            for key, sub, target in lines:  # each SLO's straight line between the two rates; the first one to break
                ya, yb = a["overall"][key], b["overall"][key]
                if sub is not None:
                    ya, yb = ya[sub], yb[sub]
                frac = (target - ya) / (yb - ya) if ya is not None and yb is not None and yb != ya else None
                if frac is not None and 0 <= frac <= 1:
                    fracs.append(frac)
            if fracs and math.isfinite(b["rate"]):
                crossing = a["rate"] + min(fracs) * (b["rate"] - a["rate"])
    failing_below = [s["rate"] for s, ok in zip(rows[:idx or 0], passes) if not ok]
    return {"criterion": criterion, "passes": dict(zip([s["rate"] for s in rows], passes)),
            "max_rate_meeting_slo": best, "first_failing_rate": first_fail, "crossing_rate": crossing,
            "failing_below": failing_below}


# -- figures -------------------------------------------------------------------------------


def _cdf(ax, xs, label):
    if xs:
        v = np.sort(np.asarray(xs, dtype=float))
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label, drawstyle="steps-post")


def write_figures(runs: list[RunResult], summaries: list[dict], directory: str, slo_ttft: float | None,
                  slo_itl: float | None, verdict: dict | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    paths = []
    # 1. latency CDFs: per tenant for one run, per rate (all tenants) for a sweep
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    groups: list[tuple[str, list[RequestResult]]] = []
    if len(runs) == 1:
        tenants = sorted({r.tenant for r in runs[0].results})
        groups = [(t, [r for r in runs[0].results if r.tenant == t and r.outcome == "ok"]) for t in tenants]
        if len(tenants) > 1:
            groups.append(("all", [r for r in runs[0].results if r.outcome == "ok"]))
    else:
        groups = [(f"{run.rate:g} req/s", [r for r in run.results if r.outcome == "ok"]) for run in runs]
    for label, rs in groups:
        _cdf(axes[0], [r.ttft * 1000 for r in rs if r.ttft is not None], label)
        _cdf(axes[1], [g * 1000 for r in rs for g in r.itl], label)
        _cdf(axes[2], [r.e2e for r in rs if r.e2e is not None], label)
    for ax, title, slo in zip(axes, ("TTFT (ms)", "ITL (ms)", "end-to-end (s)"),
                              (slo_ttft and slo_ttft * 1000, slo_itl and slo_itl * 1000, None)):
        ax.set_title(title)
        ax.set_ylabel("fraction of requests" if title != "ITL (ms)" else "fraction of gaps")
        ax.grid(alpha=0.3)
        if slo:
            ax.axvline(slo, color="red", ls="--", lw=1, label="SLO")
        ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(directory, "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    # 2. ITL over time: every gap at the time its token arrived, coloured by tenant; one panel per run
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs) + 0.6), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        for t in sorted({r.tenant for r in run.results}):
            xs, ys = [], []
            for r in run.results:
                if r.tenant == t and r.outcome == "ok":
                    tt = r.token_times
                    xs += tt[1:]
                    ys += [g * 1000 for g in r.itl]
            ax.scatter(xs, ys, s=6, alpha=0.6, label=t)
        if slo_itl:
            ax.axhline(slo_itl * 1000, color="red", ls="--", lw=1, label="SLO")
        ax.set_ylabel("ITL (ms)")
        ax.set_title(f"offered {run.rate:g} req/s", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    paths.append(os.path.join(directory, "itl_over_time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    # 3. goodput and p99 ITL vs offered rate (sweeps)
    if len(summaries) > 1:
        rows = sorted(summaries, key=lambda s: s["rate"])
        rates = [s["rate"] for s in rows]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        a1.plot(rates, [s["overall"]["request_throughput"] for s in rows], "o-", label="throughput (req/s)")
        a1.plot(rates, [s["overall"]["goodput_rps"] for s in rows], "s-", label="goodput (req/s)")
        a1.plot(rates, rates, ":", color="gray", label="offered")
        a1.set_xlabel("offered rate (req/s)")
        a1.set_ylabel("req/s")
        a1.legend(fontsize=8)
        a1.grid(alpha=0.3)
        a2.plot(rates, [s["overall"]["itl_ms"]["p99"] for s in rows], "o-", label="p99 ITL")
        a2.plot(rates, [s["overall"]["ttft_ms"]["p99"] for s in rows], "s-", label="p99 TTFT")
        if slo_itl:
            a2.axhline(slo_itl * 1000, color="red", ls="--", lw=1, label="ITL SLO")
        if verdict and verdict.get("crossing_rate"):
            a2.axvline(verdict["crossing_rate"], color="gray", ls=":", lw=1, label="crossing")
        a2.set_xlabel("offered rate (req/s)")
        a2.set_ylabel("ms")
        finite = [r for r in rates if math.isfinite(r)]
        if finite and max(finite) / min(finite) >= 8:
            for ax in (a1, a2):
                ax.set_xscale("log", base=2)
        a2.set_yscale("log")
        a2.legend(fontsize=8)
        a2.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(os.path.join(directory, "goodput_vs_rate.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


# -- command line --------------------------------------------------------------------------


def check_burstiness_shapes(burstiness: float | None, trace: bool, infinite_rate: bool) -> None:
    """Refuse a ``--burstiness`` given where it shapes nothing (``bench serve`` and ``sim run`` alike): a trace
    keeps its own gaps and an infinite rate has none, and with either the flag was dropped in silence (its default
    was a number, so a shape given could not be told from none; None now means "not given")."""
    if burstiness is not None and (trace or infinite_rate):
        raise ValueError(f"--burstiness shapes the gaps of a finite rate's arrivals; "
                         f"{'a trace keeps its own timestamps' if trace else 'an infinite rate sends all at once'}"
                         f": drop it")


NUM_REQUESTS = 64  # --num-requests' default, for a generated workload
# the defaults of flags that one mode reads (None in the parser, so that one given elsewhere can be told apart)
SWEEP_CRITERION, MIN_GOODPUT, SLO_ITL_STAT = "itl", 0.9, "p99"


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="minivllm bench serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    ap.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                    help="key for tenants without key= (default $OPENAI_API_KEY)")
    ap.add_argument("--tenant", action="append", default=[], metavar="SPEC",
                    help="name=N[,key=K][,share=S][,input=DIST][,output=DIST][,prefix=GROUP:LEN]; repeatable")
    ap.add_argument("--input-len", default="uniform:32:128", help="prompt tokens (beyond any shared prefix) for tenants without input=")
    ap.add_argument("--output-len", default="fixed:16", help="max_tokens for tenants without output=")
    # (None when not given, so that one given beside --trace, which sends all its lines, can be told apart and refused)
    ap.add_argument("--num-requests", type=positive_int, default=None,
                    help=f"requests per run (per rate when sweeping; default {NUM_REQUESTS}); a --trace sends all its "
                         "lines instead")
    # one or the other: beside --rates, a --request-rate was dropped in silence
    rate = ap.add_mutually_exclusive_group()
    rate.add_argument("--request-rate", type=positive_rate, default=float("inf"), help="mean arrival rate, req/s (inf: all at once; with --trace, inf -- the default -- "
                           "keeps the trace's own timestamps and a finite rate rescales them)")
    rate.add_argument("--rates", default=None, help="sweep: comma-separated rates, e.g. 0.5,1,2,4 (instead of --request-rate)")
    ap.add_argument("--burstiness", type=positive_float, default=None,
                    help="gamma shape of the inter-arrival gaps of a finite rate (default 1: Poisson); a --trace keeps "
                         "its own gaps")
    ap.add_argument("--trace", default=None, help="JSONL trace (timestamp, tenant, prompt|prompt_len, max_tokens)")
    ap.add_argument("--max-concurrency", type=positive_int, default=None, help="cap on requests in flight (default: none)")
    ap.add_argument("--timeout", type=positive_float, default=600.0, help="hard limit for one run, s")
    ap.add_argument("--request-timeout", type=positive_float, default=120.0, help="limit per request, s")
    ap.add_argument("--temperature", type=nonnegative_float, default=0.0,
                    help="sampling temperature sent with each request (a finite number >= 0; 0 is greedy)")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="ask for exactly max_tokens (vLLM/SGLang/minivllm extra field)")
    ap.add_argument("--seed", type=nonnegative_int, default=0)  # (numpy's generators take no negative seed)
    ap.add_argument("--slo-ttft-ms", type=positive_float, default=None)
    ap.add_argument("--slo-itl-ms", type=positive_float, default=None)
    ap.add_argument("--slo-itl-stat", choices=("p99", "max", "mean"), default=None,
                    help=f"with --slo-itl-ms: a request meets the ITL SLO if this statistic of its own gaps does "
                         f"(default {SLO_ITL_STAT})")
    ap.add_argument("--sweep-criterion", choices=("itl", "goodput"), default=None,
                    help=f"a sweep's (--rates A,B,...) verdict; itl: overall p99 ITL (and p99 TTFT if given) within "
                         f"the SLO (needs --slo-itl-ms); goodput: fraction >= --min-goodput (default {SWEEP_CRITERION})")
    ap.add_argument("--min-goodput", type=fraction, default=None,
                    help=f"--sweep-criterion goodput: the fraction of requests within the SLOs a rate must reach "
                         f"(default {MIN_GOODPUT})")
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")
    ap.add_argument("--no-requests-in-json", action="store_true", help="leave the per-request records out of --out")
    ap.add_argument("--figures", default=None, help="write PNG figures into this directory")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _model_name(base_url: str, api_key: str | None, timeout: float) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = base_url.rstrip("/") + "/v1/models"
    try:  # an unreachable or odd server is a one-line error, not an httpx traceback
        r = httpx.get(url, headers=headers, timeout=timeout, trust_env=False)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"could not ask {url} for the model name ({type(exc).__name__}: {exc}); "
                         "is the server up? (or pass --model)") from None


def run_benchmark(args: argparse.Namespace, out=sys.stdout) -> dict:
    """Everything ``main`` does, returning the JSON document."""
    tenants = [parse_tenant(s, args.input_len, args.output_len, args.api_key) for s in args.tenant] or [
        Tenant("default", args.api_key, 1.0, LengthDist.parse(args.input_len), LengthDist.parse(args.output_len))]
    if len({t.name for t in tenants}) != len(tenants):
        raise ValueError("tenant names must be distinct")
    try:
        rates = [float(x) for x in args.rates.split(",")] if args.rates else [args.request_rate]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
    if any(not r > 0 for r in rates):
        raise ValueError("rates must be > 0")
    if len(set(rates)) != len(rates):  # the verdict is kept per rate: a repeat's row showed the other run's verdict
        raise ValueError(f"--rates names a rate twice, got {args.rates!r}; each rate of a sweep is run once")
    check_burstiness_shapes(args.burstiness, bool(args.trace), all(math.isinf(r) for r in rates))
    burst = 1.0 if args.burstiness is None else args.burstiness
    num_requests = NUM_REQUESTS if args.num_requests is None else args.num_requests
    criterion = SWEEP_CRITERION if args.sweep_criterion is None else args.sweep_criterion
    min_goodput = MIN_GOODPUT if args.min_goodput is None else args.min_goodput
    itl_stat = SLO_ITL_STAT if args.slo_itl_stat is None else args.slo_itl_stat
    slo_ttft = args.slo_ttft_ms / 1000 if args.slo_ttft_ms is not None else None
    slo_itl = args.slo_itl_ms / 1000 if args.slo_itl_ms is not None else None
    trace = None
    if args.trace:
        with open(args.trace, encoding="utf-8") as fh:
            trace = parse_trace(fh)
    model = args.model or _model_name(args.base_url, next((t.api_key for t in tenants if t.api_key), None),
                                      min(30.0, args.request_timeout))
    slo_text = ", ".join(x for x in (f"TTFT <= {args.slo_ttft_ms:g} ms" if slo_ttft else "",
                                     f"{itl_stat} ITL <= {args.slo_itl_ms:g} ms" if slo_itl else "") if x)
    slo_text = f"SLO {slo_text}" if slo_text else ""
    load_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    runs, summaries = [], []
    for rate in rates:
        if trace is not None:
            own_pace = args.rates is None and math.isinf(rate)
            plan = plan_from_trace(trace, tenants, None if own_pace else rate, args.seed)
            if own_pace:  # offered at the trace's own mean rate (as plan_from_trace scales one), not "inf" -- the
                # label of ``--rates inf``, which sends the same trace all at once
                rate = mean_arrival_rate([p.arrival for p in plan])
        else:
            plan = plan_requests(tenants, num_requests, rate, burst, args.seed)
        run = asyncio.run(run_load(args.base_url, plan, tenants, model, args.endpoint, args.max_concurrency,
                                   args.timeout, args.request_timeout, not args.no_progress, args.ignore_eos,
                                   args.temperature, rate, desc=f"{rate:g} req/s"))
        s = summarize(run, slo_ttft, slo_itl, itl_stat)
        runs.append(run)
        summaries.append(s)
        print(f"\n== {args.base_url} | model {model} | {args.endpoint} | {len(plan)} requests | offered {rate:g} req/s"
              f"{'' if burst == 1 or trace or math.isinf(rate) else f' (gamma, burstiness {burst:g})'}"
              f"{' | trace ' + args.trace if trace else ''}", file=out)
        print(format_table(s, slo_text), file=out, flush=True)
    verdict = None
    if len(rates) > 1 and (slo_itl is not None or criterion == "goodput"):
        verdict = sweep_verdict(summaries, criterion, slo_ttft, slo_itl, min_goodput)
        rows = sorted(summaries, key=lambda s: s["rate"])
        print("\nrate sweep", file=out)
        print(f"{'rate':>6} {'ok':>4} {'429':>4} {'req/s':>6} {'tok/s':>7} {'p99 TTFT ms':>11} {'p99 ITL ms':>10} "
              f"{'goodput':>7}  meets", file=out)
        for s in rows:
            o = s["overall"]
            print(f"{s['rate']:>6g} {o['ok']:>4} {o['rejected']:>4} {_f(o['request_throughput'], '{:.2f}'):>6} "
                  f"{_f(o['output_throughput'], '{:.1f}'):>7} {_f(o['ttft_ms']['p99']):>11} {_f(o['itl_ms']['p99']):>10} "
                  f"{_f(100 * o['goodput_fraction'] if o['goodput_fraction'] is not None else None, '{:.0f}%'):>7}  "
                  f"{'yes' if verdict['passes'][s['rate']] else 'no'}", file=out)
        what = (f"p99 ITL <= {args.slo_itl_ms:g} ms" + (f" and p99 TTFT <= {args.slo_ttft_ms:g} ms" if slo_ttft else "")
                if criterion == "itl" else f"goodput >= {100 * min_goodput:g}% ({slo_text})")
        line = f"max rate meeting {what}: {_f(verdict['max_rate_meeting_slo'], '{:g}')} req/s"
        if verdict["first_failing_rate"] is not None:
            line += f"; fails at {verdict['first_failing_rate']:g} req/s"
        if verdict["crossing_rate"] is not None:
            line += f"; crossing (linear interpolation) ~ {verdict['crossing_rate']:.2f} req/s"
        if verdict["failing_below"]:
            line += (f"; not monotone: {', '.join(f'{r:g}' for r in verdict['failing_below'])} req/s failed too"
                     " (noise? more --num-requests per rate)")
        print(line, file=out, flush=True)
    doc = {
        "tool": "minivllm bench serve",
        "config": {"base_url": args.base_url, "model": model, "endpoint": args.endpoint, "num_requests": None if args.trace else num_requests,
                   "rates": rates, "burstiness": burst, "trace": args.trace, "seed": args.seed,
                   "max_concurrency": args.max_concurrency, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
                   "slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms, "slo_itl_stat": itl_stat,
                   "sweep_criterion": criterion, "min_goodput": min_goodput,
                   "tenants": [t.describe() for t in tenants]},
        "client_host": {"cpus": os.cpu_count(), "loadavg_at_start": load_start,
                        "loadavg_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
                        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "runs": [{"summary": s, **({} if args.no_requests_in_json else {"requests": [asdict(r) for r in run.results]})}
                 for s, run in zip(summaries, runs)],
        "sweep": verdict,
    }
    if args.out:
        write_result(args.out, doc, "minivllm bench serve", getattr(args, "argv", None))
        print(f"wrote {args.out}", file=out)
    if args.figures:
        for p in write_figures(runs, summaries, args.figures, slo_ttft, slo_itl, verdict):
            print(f"wrote {p}", file=out)
    return doc


def _refuse_flags_not_read(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse the flags that only a sweep, an ITL SLO or ``--out`` reads, given without it (see
    :func:`~minivllm.argtypes.refuse_unread`).  A sweep is ``--rates`` with two rates or more: one rate has no
    verdict, the only reader of ``--sweep-criterion`` and ``--min-goodput``."""
    if args.rates is None or len(args.rates.split(",")) < 2:
        refuse_unread(parser, args, ("sweep_criterion", "min_goodput"), "without a sweep (--rates A,B,...)")
    if args.sweep_criterion == "itl" and args.slo_itl_ms is None:  # no verdict is drawn: nothing to judge ITL by
        refuse_unread(parser, args, ("sweep_criterion",), "without --slo-itl-ms (the SLO the itl criterion judges)")
    if (args.sweep_criterion or SWEEP_CRITERION) != "goodput":
        which = args.sweep_criterion or f"{SWEEP_CRITERION} (the default)"
        refuse_unread(parser, args, ("min_goodput",), f"under --sweep-criterion {which}: only goodput reads it")
    if args.slo_itl_ms is None:
        refuse_unread(parser, args, ("slo_itl_stat",), "without --slo-itl-ms (the bound that statistic is held to)")
    if args.out is None:
        refuse_unread(parser, args, ("no_requests_in_json",), "without --out (it trims the JSON --out writes)")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # The figures are written last: an empty name skipped them in silence, and a file's name failed with "File
    # exists" only after the whole run.  Both are refused before it.
    if args.figures is not None and (not args.figures.strip() or (os.path.exists(args.figures)
                                                                   and not os.path.isdir(args.figures))):
        parser.error(f"argument --figures: expected a directory, got {args.figures!r}")
    if args.figures and importlib.util.find_spec("matplotlib") is None:  # say so now, not after the whole run
        parser.error("--figures needs matplotlib, which the labs extra installs: pip install 'minivllm[labs]'")
    if args.trace and args.num_requests is not None:  # (as --burstiness: a count given must count something)
        parser.error("argument --num-requests: sizes a generated workload, and a --trace sends all its lines: drop it")
    _refuse_flags_not_read(parser, args)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line a result file records
    try:
        run_benchmark(args)
    except (ValueError, OSError) as exc:  # OSError: a --trace that cannot be read, an --out that cannot be written
        print(f"minivllm bench serve: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
