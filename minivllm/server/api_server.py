"""An OpenAI-compatible HTTP server for minivllm (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both
non-streaming and SSE streaming: ``data: {...}`` chunks, then ``data: [DONE]``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, vLLM names:
see :mod:`minivllm.metrics.prometheus`).  The official ``openai`` client works
against it unchanged.

Behaviour worth knowing:

* **Errors** have OpenAI's body, ``{"error": {"message", "type", "param",
  "code"}}``.  Bad input (malformed JSON, wrong types, values the engine's
  ``SamplingParams`` or ``add_request`` refuse, an oversize prompt) is a 400,
  an unknown model a 404, a missing or wrong API key a 401 -- never a 5xx
  (except during shutdown, below).  A body larger than any servable request needs
  is a 413 before it is parsed (:func:`default_max_body_bytes`).
* **Tenants.** API keys map to tenants (``--api-keys-file keys.json`` with
  ``{"key": "tenant"}``, or ``MINIVLLM_API_KEYS`` holding the same JSON or
  ``key=tenant,key2=tenant2``).  With no keys configured everyone is tenant
  ``"default"``; with keys, a request without a valid ``Authorization: Bearer``
  key gets 401.  The tenant is the request's prefix-cache namespace (the
  engine keys cached blocks by ``(tenant, cache_salt)``), so tenants do not
  share cached blocks and cannot probe each other's prompts by timing (unless
  the engine is built with ``share_prefix_cache_across_tenants``: then every
  tenant's unsalted prompts share one space, and only a salt keeps one apart).  A
  tenant's scheduling settings (``TenantConfig``: weight, caps, class) come
  from ``--tenants-file tenants.json`` (:func:`load_tenants`), read with
  ``--scheduling-policy``; a client's own ``priority`` field is refused.
* **``cache_salt``** (vLLM's extra field) is *accepted but scoped*: the server
  passes ``json.dumps([tenant, cache_salt])`` to the engine, so a client's
  salt can only split its own tenant's space further and can never name
  another tenant's namespace (not even with ``share_prefix_cache_across_tenants``).
  As in vLLM, ``"cache_salt": ""`` is a 400 naming the field, not a quiet "no salt":
  a client leaves the field out to use its tenant's shared space.
* **Overload.** A request the engine turns away (``preemption_mode="reject"``, or a
  tenant at its cap with ``TenantConfig(over_cap="reject")``: ``finish_reason == "rejected"``) is a 429 with ``Retry-After`` (whole seconds,
  from the engine's ``retry_after_s``).  A streamed request answers only once
  its first output exists, so a rejection is a 429 before any byte of a stream.
* **Disconnects.** A client that goes away (streaming or not) has its
  request aborted; its KV blocks go back before the next engine step.
* **Shutdown** aborts in-flight requests (streams end with an error event and
  ``[DONE]``; waiting non-streamed requests get 503) and stops the loop thread.
  From its start every new completion request with a valid key is a 503
  ``shutting_down`` before it is read (the key is checked first: a missing or
  wrong one is still a 401), bad input included: a 400 (or the door's 429) from a
  replica that is leaving would judge a request another replica may serve.
  Whoever runs uvicorn calls ``app.state.async_engine.begin_shutdown()`` when
  the server is told to exit (``minivllm serve`` in ``handle_exit``,
  ``BackgroundServer.stop``): uvicorn alone waits for open requests first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import math
import os
import re
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from minivllm.argtypes import is_int
from minivllm.config import TenantConfig
from minivllm.engine.input_processor import check_cache_salt, check_prompt_fits, output_room
from minivllm.metrics.prometheus import CONTENT_TYPE, EngineMetrics
from minivllm.outputs import RequestOutput
from minivllm.sampling_params import SamplingParams, brief_repr
from minivllm.server.async_engine import AsyncEngine, EngineDead, EngineShutdown, RequestStream
from minivllm.server.door import DoorRule, door_snapshot
from minivllm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)

log = logging.getLogger("minivllm.server")

DEFAULT_TENANT = "default"


# -- errors ---------------------------------------------------------------------------


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | int | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code, self.headers = status, message, type_, param, code, headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _api_error_response(exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)


# the request fields an engine error may start with: every SamplingParams field (so a new one is named too) and the
# prompt's
_PARAM_NAMES = ({f.name for f in dataclasses.fields(SamplingParams) if not f.name.startswith("_")}
                | {"prompt", "prompt_token_ids", "messages", "cache_salt"})


def _bad_value(exc: Exception, prompt_field: str = "prompt") -> APIError:
    """A ``ValueError`` from the engine as a 400, naming the parameter when the message starts with it
    (a message about the prompt names ``prompt_field``: a chat request has ``messages``, no ``prompt``)."""
    msg = str(exc) or type(exc).__name__
    first = msg.split(" ", 1)[0].strip("'\":,")
    param = first if first in _PARAM_NAMES else ("prompt" if "prompt" in msg else None)
    if param in ("prompt", "prompt_token_ids"):
        param = prompt_field
    return APIError(400, msg, "invalid_request_error", param, "invalid_value")


_TYPE_TAG = re.compile(r"^(int|float|str|bool|bytes|none|[\w-]*\[.*\])$")


def _deepest_of_its_union(errors: list[dict]) -> dict:
    """The error to quote: the first, unless it is one member's error about a field that is a union, and another
    member of the same union went deeper -- then that member's first deepest error; between members equally deep,
    the one whose first failing entry comes latest (it accepted every entry before it).

    Why: ``prompt``, ``stop`` and a message's ``content`` take a string or a list, and pydantic lists the string
    member's "should be a valid string" first even when the value is a list, so a content part without its
    ``type`` was answered as if list content were refused.  The member that looked inside the list knows which
    entry is wrong.  A value no member could even start on (``"prompt": 5``) gives every member's error at the
    same depth, so the first is kept.  In ``"prompt": ["a", 5]`` the token-id member fails first at entry 0 and the
    string member at entry 1: the strings are what the caller meant, and entry 1 is the one to fix.  Members are
    compared by their *first* failure, not their last: pydantic reports every bad entry of a member, and in
    ``[1, 2, "a", 3]`` the string member also fails at entry 3, a good token id.
    """
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    tag = next((i for i, p in enumerate(loc) if _TYPE_TAG.match(str(p))), None)
    if tag is None:
        return first
    members: dict = {}  # union member tag -> its errors, in pydantic's order (entry by entry)
    for e in errors:
        where = tuple(e.get("loc", ()))
        if where[:tag] == loc[:tag] and len(where) > tag:
            members.setdefault(where[tag], []).append(e)

    def depth(e: dict) -> int:
        return len(e.get("loc", ()))

    def reach(errs: list[dict]) -> tuple:  # how deep the member got, then how far along before it first failed
        return max(map(depth, errs)), tuple(p if isinstance(p, int) else -1 for p in errs[0]["loc"][tag + 1:])

    errs = max(members.values(), key=reach)  # max keeps the first member of equal reach
    deepest = max(map(depth, errs))
    return next(e for e in errs if depth(e) == deepest)


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    if not errors:
        return "invalid request", None
    e = _deepest_of_its_union(errors)
    # drop pydantic's union-member tags ("int", "list[int]", "function-after[...]") from the location
    loc = [str(p) for p in e.get("loc", ()) if p != "body" and not _TYPE_TAG.match(str(p))]
    where = ".".join(loc)
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('msg', '')}", None
    msg = e.get("msg", "invalid")
    if "input" in e and e.get("type") != "missing":
        msg += f", got {brief_repr(e['input'])}"
    return (f"{where}: {msg}" if where else msg), (loc[0] if loc else None)


# -- API keys -> tenants ------------------------------------------------------------------


def load_api_keys(path: str | None = None, env: str | None = None) -> dict[str, str]:
    """``{key: tenant}`` from a JSON file, else from ``$MINIVLLM_API_KEYS`` (JSON or ``k=t,k2=t2``); {} if neither."""
    raw = None
    if path:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    elif env is not None or os.environ.get("MINIVLLM_API_KEYS"):
        raw = env if env is not None else os.environ["MINIVLLM_API_KEYS"]
    if (not raw or not raw.strip()) and path:  # asked for key authentication and got none: not an open server
        raise ValueError(f"API keys file {path!r} holds no keys (leave the option out to serve without keys)")
    if not raw or not raw.strip():
        return {}
    raw = raw.strip()
    if raw.startswith("{"):
        try:
            keys = json.loads(raw)
        except json.JSONDecodeError as exc:  # name the source: the decoder's message alone does not say which file
            raise ValueError(f"API keys {path or '$MINIVLLM_API_KEYS'!r} are not valid JSON: {exc}") from None
    else:
        keys = {}
        for part in raw.split(","):
            key, sep, tenant = part.strip().partition("=")
            if not sep:
                raise ValueError(f"API keys {path or '$MINIVLLM_API_KEYS'!r}: entries are key=tenant (or the whole "
                                 f"file a JSON object), got {part.strip()!r}")
            keys[key.strip()] = tenant.strip()
    if not isinstance(keys, dict) or not all(isinstance(k, str) and k and isinstance(t, str) and t for k, t in keys.items()):
        raise ValueError("API keys must map non-empty key strings to non-empty tenant names")
    if not keys and path:
        raise ValueError(f"API keys file {path!r} holds no keys (leave the option out to serve without keys)")
    return keys


def load_tenants(path: str, api_keys: dict[str, str]) -> dict[str, TenantConfig]:
    """``{tenant: TenantConfig}`` from a JSON file ``{"alice": {"weight": 2, "max_running": 4}, "*": {...}}``.

    Each object holds :class:`~minivllm.config.TenantConfig`'s fields; ``"*"`` sets every tenant not listed.  The
    names are checked against ``api_keys`` because over HTTP a request's tenant comes only from its key: a name no key
    maps to (a typo, or anything but ``default`` on a server without keys) would hold settings no request ever meets,
    and a cap meant to protect the others would bind nobody -- silently.
    """
    with open(path, encoding="utf-8") as f:
        try:
            raw = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tenants file {path!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f'tenants file {path!r} must be a non-empty JSON object {{"tenant": {{"weight": 2, ...}}}}')
    known = set(api_keys.values()) or {"default"}
    fields = [f.name for f in dataclasses.fields(TenantConfig)]
    allowed = set(fields)
    tenants = {}
    for name, settings in raw.items():
        if name != "*" and name not in known:
            raise ValueError(f"tenants file {path!r} names tenant {name!r}, which no API key maps to "
                             f"(tenants: {', '.join(sorted(known))}; '*' sets every tenant not listed)")
        if not isinstance(settings, dict):
            raise ValueError(f"tenants file {path!r}: {name!r} must map to an object of TenantConfig fields, "
                             f"got {type(settings).__name__}")
        unknown = sorted(set(settings) - allowed)
        if unknown:
            raise ValueError(f"tenants file {path!r}: {name!r} has unknown field(s) {', '.join(unknown)} "
                             f"(TenantConfig's fields: {', '.join(fields)})")
        try:
            tenants[name] = TenantConfig(**settings)
        except ValueError as exc:
            raise ValueError(f"tenants file {path!r}: {name!r}: {exc}") from None
    return tenants


class _AuthMiddleware:
    """Pure ASGI: ``/v1/*`` needs a configured key (when any are); sets ``request.state.tenant``."""

    def __init__(self, app, api_keys: dict[str, str]) -> None:
        self.app = app
        self.keys = [(k.encode(), t) for k, t in api_keys.items()]

    def tenant_for(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        if not self.keys:
            return DEFAULT_TENANT
        auth = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        scheme, _, key = auth.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not key.strip():
            return None
        key, found = key.strip(), None
        for k, tenant in self.keys:  # compare against every key in constant time each
            if hmac.compare_digest(k, key):
                found = tenant
        return found

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path", "").startswith("/v1/"):
            tenant = self.tenant_for(scope.get("headers", []))
            if tenant is None:
                # RFC 9110 section 11.6.1: a 401 MUST carry a challenge (RFC 6750 section 3: Bearer's), or a
                # client cannot tell which credentials to send
                resp = error_response(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                                      "authentication_error", None, "invalid_api_key",
                                      {"WWW-Authenticate": 'Bearer realm="minivllm"'})
                await resp(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)


# -- streaming response that notices a disconnect at any time -------------------------


class SSEResponse(Response):
    """``text/event-stream`` from an async iterator of ``data: ...`` strings.

    Unlike Starlette's ``StreamingResponse`` under ASGI 2.4 (which notices a
    gone client only on its next write), this one listens for
    ``http.disconnect`` the whole time, so a client that leaves while its
    request waits in the queue is aborted at once.  The request stream is
    closed (aborting the request if unfinished) however the response ends.
    """

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], stream: RequestStream) -> None:
        # like StreamingResponse: no body attribute, so no Content-Length header
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.body_iter = body
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        async def listen() -> None:
            while True:
                if (await receive())["type"] == "http.disconnect":
                    return

        async def write() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iter:
                await send({"type": "http.response.body", "body": chunk.encode("utf-8"), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            async with anyio.create_task_group() as tg:
                async def run(fn) -> None:
                    await fn()
                    tg.cancel_scope.cancel()

                tg.start_soon(run, write)
                await run(listen)
        except Exception:  # noqa: BLE001 - the client went away mid-write (OSError and friends)
            pass
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await self.body_iter.aclose()  # type: ignore[attr-defined]
                except Exception:  # noqa: BLE001
                    pass
            self.stream.close()


async def _until_disconnect(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro):
    """Await ``coro`` unless the client disconnects first (then cancel it and raise ``_ClientGone``).

    Why watch: until its first output (streamed) or its last (not streamed) nothing is written to the client, so no
    failed write can reveal that it left; unwatched, its request would keep its place and KV blocks to the end.
    """
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    raise _ClientGone()


class _ClientGone(Exception):
    pass


# -- the server ---------------------------------------------------------------------------


def _finish_reason(out: RequestOutput) -> str | None:
    return next((o.finish_reason for o in out.outputs if o.finish_reason), None)


def _usage(out: RequestOutput) -> dict:
    prompt = len(out.prompt_token_ids)
    completion = sum(len(o.token_ids) for o in out.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(out.num_cached_tokens or 0)},
    }


# Bytes of JSON one character of prompt text may take: a character outside the Basic Multilingual Plane written as
# two ``\uXXXX`` escapes (the ``openai`` client escapes everything outside ASCII).
_JSON_BYTES_PER_CHAR = 12
# Room for a body's other fields: sampling parameters, up to MAX_STOP_STRINGS stop strings, a chat's roles.
_BODY_FIELDS_BYTES = 1 << 20


def default_max_body_bytes(engine) -> int | None:
    """The largest request body a request that could run on ``engine`` needs, or None when unknown.

    Why a limit: a body is parsed whole, holding the GIL (json's C parser), into a Python object per token id or
    message -- a 90 MB body of token ids froze every stream (and the engine loop) for 3 s and took 870 MB, only
    to be refused for its length.  The bound never refuses a request that fits: a prompt of more characters than
    the engine's :meth:`~minivllm.engine.input_processor.InputProcessor.max_fitting_chars` is refused anyway,
    each character costs at most ``_JSON_BYTES_PER_CHAR`` bytes, and a list of fitting token ids is far shorter.
    A tokenizer without a vocabulary to read gives no bound (None: no limit, as before).
    """
    chars = engine.inputs.max_fitting_chars()
    return _BODY_FIELDS_BYTES + _JSON_BYTES_PER_CHAR * chars if chars else None


# A body up to this size is parsed on the event loop (microseconds); a larger one on a worker thread, where the
# per-message validators let the loop run between them (a 17 MB conversation held every stream for 2 s).
_PARSE_ON_LOOP_BYTES = 64 * 1024


def _validated(body: bytes, model_cls):
    """``body`` parsed and validated as ``model_cls``, or the 400 in OpenAI's shape."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", "invalid_request_error", None, "invalid_json")
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply", "invalid_request_error", None,
                       "invalid_json")
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_request_error", None, "invalid_json")
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        msg, param = _validation_message(exc.errors(include_url=False))
        raise APIError(400, msg, "invalid_request_error", param, "invalid_type")


def _retry_after(out: RequestOutput) -> str:
    return retry_after_header(out.retry_after_s)


def retry_after_header(seconds) -> str:
    """RFC 9110 section 10.2.3: ``Retry-After`` is whole seconds, so a hint is rounded *up* (a client honouring a
    rounded-down value retries before the server said it could be served), and at least 1; no usable hint: 1."""
    ok = isinstance(seconds, (int, float)) and math.isfinite(seconds)
    return str(max(1, math.ceil(seconds))) if ok else "1"


def _sse(obj: Any) -> str:
    """One SSE event.  Text stays UTF-8 (``ensure_ascii=False``), but the three characters JSON leaves raw that
    Python's ``str.splitlines`` (so httpx's ``aiter_lines``) breaks a line at -- U+2028, U+2029, U+0085 -- are
    escaped: a generated one would otherwise cut the ``data:`` line in two for such a client."""
    data = json.dumps(obj, separators=(',', ':'), ensure_ascii=False)
    if "\u2028" in data or "\u2029" in data or "\x85" in data:
        data = data.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").replace("\x85", "\\u0085")
    return f"data: {data}\n\n"


class OpenAIServer:
    """The request handlers; :func:`build_app` wires them into a FastAPI app."""

    def __init__(self, async_engine: AsyncEngine, model_names: list[str], max_model_len: int | None = None,
                 door: DoorRule | None = None, max_body_bytes: int | None = None) -> None:
        self.engine = async_engine
        self.max_body_bytes = max_body_bytes  # None: no limit (see default_max_body_bytes)
        self.model_names = list(model_names)
        self.max_model_len = max_model_len
        self.door = door  # load shedding before the queue (--max-waiting-requests); None: everyone queues
        self.tokenizer = getattr(async_engine.engine, "tokenizer", None)
        self._created = int(time.time())  # the models' ``created``: when this server began serving them

    # -- helpers --------------------------------------------------------------
    def _check_open(self) -> None:
        """A 503 ``shutting_down`` once shutdown has begun, asked before a request is read and again before it
        is submitted (shutdown may begin while its prompt is tokenized).

        Why before every other check: a draining server answers every new request alike, as ``/health`` and
        the engine do, so a client or load balancer goes to another replica.  Judged first, a prompt over
        *this* replica's ``max_model_len`` or a tenant over its KV cap here was a 400 ("never retry") from a
        server that is leaving, and the door's 429 said "come back here".
        """
        if self.engine.shutting_down:
            raise APIError(503, "the server is shutting down", "service_unavailable", None, "shutting_down")

    def _check_model(self, name: str | None) -> str:
        if name is None or name == "":
            return self.model_names[0]
        if name not in self.model_names:
            raise APIError(404, f"the model {brief_repr(name)} does not exist; this server serves {self.model_names}",
                           "invalid_request_error", "model", "model_not_found")
        return name

    async def _read_body(self, request: Request) -> bytes:
        """The body, or a 413 as soon as it is known to be over ``max_body_bytes`` (its ``Content-Length``, else
        the bytes received so far): never held or parsed whole, which is the cost the limit is there to avoid."""
        limit = self.max_body_bytes
        if limit is None:
            return await request.body()
        declared = request.headers.get("content-length", "")
        size = int(declared) if declared.isdigit() else 0
        chunks: list[bytes] = []
        if size <= limit:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    break
                chunks.append(chunk)
        if size > limit:
            raise APIError(413, f"the request body has {size} bytes or more; this server takes at most {limit} "
                                f"(what a prompt that fits max_model_len={self.max_model_len} can need)",
                           "invalid_request_error", None, "request_too_large")
        return b"".join(chunks)

    async def _parse(self, request: Request, model_cls):
        """The request body as ``model_cls``, or a 400 in OpenAI's shape.

        Read here rather than declared as the endpoint's body parameter: FastAPI validates a body parameter before
        the handler runs, so bad input would get its 400 before :meth:`_check_open` could answer 503.
        """
        body = await self._read_body(request)
        if len(body) > _PARSE_ON_LOOP_BYTES:
            req = await asyncio.to_thread(_validated, body, model_cls)
        else:
            req = _validated(body, model_cls)
        bad = req.unsupported()
        if bad:
            raise APIError(400, f"{bad} is not supported by minivllm", "invalid_request_error", bad, "unsupported")
        best_of = getattr(req, "best_of", None)  # completions only; above 1 is refused as unsupported just above
        if best_of is not None and req.n is not None and best_of < req.n:  # OpenAI: best_of is "at least n"
            raise APIError(400, f"best_of must be at least n, got best_of={best_of} and n={req.n}",
                           "invalid_request_error", "best_of", "invalid_value")
        if req.stream_options is not None and not req.stream:  # as vLLM and OpenAI answer
            raise APIError(400, "stream_options can only be given when stream is true", "invalid_request_error",
                           "stream_options", "invalid_value")
        return req

    @staticmethod
    def _sampling_params(req, max_tokens: int | None, max_tokens_field: str = "max_tokens") -> SamplingParams:
        """The engine's parameters for ``req``; ``max_tokens`` came from ``max_tokens_field`` (chat's
        ``max_completion_tokens`` wins over ``max_tokens``), which an error about it names."""
        kw: dict[str, Any] = {"max_tokens": max_tokens}
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = float(v)
        for name in ("n", "top_k", "seed", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            v = getattr(req, name)
            if v is not None:
                kw[name] = v
        if req.stop is not None:
            kw["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if req.stop_token_ids is not None:
            kw["stop_token_ids"] = list(req.stop_token_ids)
        try:
            return SamplingParams(**kw)
        except ValueError as exc:
            err = _bad_value(exc)
            if err.param == "max_tokens" and max_tokens_field != "max_tokens":  # SamplingParams' rule, the client's name
                err = APIError(400, err.message.replace("max_tokens", max_tokens_field, 1), err.type,
                               max_tokens_field, err.code)
            raise err

    @staticmethod
    def _with_salt(prompt: dict, tenant: str, salt: str | None) -> dict:
        """``prompt`` with the client's salt scoped to its tenant.  The engine's rule is asked about the client's
        own salt here: the scoped string is never empty, so the engine could not refuse ``""`` (vLLM's 400)."""
        if salt is not None:
            try:
                check_cache_salt(salt)
            except ValueError as exc:
                raise _bad_value(exc) from None
            prompt["cache_salt"] = json.dumps([tenant, salt])  # scoped to the caller's own tenant
        return prompt

    def _check_room(self, num_prompt_tokens: int, max_tokens: int | None, field: str,
                    prompt_field: str = "prompt") -> None:
        """A prompt plus an explicit ``max_tokens`` past the context is a 400, as OpenAI and vLLM answer.

        The engine itself clamps ``max_tokens`` to the room left (``LLM.generate`` callers get what fits);
        a client that asked for N tokens over HTTP is told instead of quietly getting fewer.  A completion
        request without ``max_tokens`` asks for OpenAI's default of 16, which is checked the same way; a chat
        request without ``max_tokens`` (or ``max_completion_tokens``) may fill the context.

        A prompt alone too long is refused here too (the engine would refuse it with the same words), because
        this runs *before* the door: checked only by the engine, behind the door, such a prompt got the door's
        429 while the queue was full, and a client honouring ``Retry-After`` retried a request that can never run.
        """
        limit = self.max_model_len
        if limit:
            try:
                check_prompt_fits(num_prompt_tokens, limit)
            except ValueError as exc:
                raise APIError(400, str(exc), "invalid_request_error", prompt_field, "invalid_value") from None
        if max_tokens is None or not limit or num_prompt_tokens + max_tokens <= limit:
            return
        raise APIError(400, f"{field} is too large: {max_tokens}. This model's maximum context length is {limit} "
                            f"tokens and your request has {num_prompt_tokens} input tokens "
                            f"({max_tokens} > {limit} - {num_prompt_tokens})",
                       "invalid_request_error", field, "invalid_value")

    async def _submit(self, prompt, params: SamplingParams, tenant: str, prefix: str,
                      prompt_field: str = "prompt") -> tuple[str, RequestStream]:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        self._check_open()
        # a request that could never run is a 400 whatever the load: checked before the door, whose 429 would
        # have its client retry it (the engine asks the same when it adds the request)
        engine, num_prompt = self.engine.engine, len(prompt["prompt_token_ids"])
        if self.max_model_len:
            total = num_prompt + output_room(num_prompt, params.max_tokens, self.max_model_len)
            why = engine.never_runs(total, tenant)
            if why is not None:
                raise APIError(400, f"this request {why}", "invalid_request_error", None, "invalid_value")
        if self.door is not None and self.door.closed(door_snapshot(engine, self.engine.waiting_or_posted())):
            retry = retry_after_header(self.door.retry_after_s)
            metrics = self.engine.metrics
            if metrics is not None:  # the engine never sees this request: only here can an operator's alert count it
                metrics.shed.labels(metrics.model_name, tenant).inc()
            raise APIError(429, "the server's queue is full; retry after the Retry-After header's seconds",
                           "rate_limit_error", None, "queue_full", {"Retry-After": retry})
        try:  # through the door: counted as posted until the engine thread queues it (waiting_or_posted)
            stream = await self.engine.add_request(prompt, params, request_id, tenant=tenant)
        except ValueError as exc:
            raise _bad_value(exc, prompt_field)
        except EngineShutdown as exc:  # shutdown began after _check_open, before the engine thread added it
            raise APIError(503, str(exc), "service_unavailable", None, "shutting_down")
        except EngineDead as exc:
            raise APIError(503, str(exc), "service_unavailable", None, "engine_dead")
        return request_id, stream

    async def _first_or_final(self, request: Request, stream: RequestStream, until_final: bool) -> RequestOutput:
        async def collect() -> RequestOutput:
            out = await stream.get()
            while until_final and not out.finished:
                out = await stream.get()
            return out

        try:
            out = await _unless_disconnected(request, collect())
        except (EngineShutdown, EngineDead) as exc:
            raise APIError(503, str(exc), "service_unavailable", None, "unavailable")
        if out.finished and _finish_reason(out) == "rejected":
            raise APIError(429, "rejected by admission control (KV cache full, or your tenant is over its cap); "
                           "retry after the Retry-After header's seconds", "rate_limit_error", None,
                           "rate_limit_exceeded", {"Retry-After": _retry_after(out)})
        # any sample, not the first one that finished: with n > 1 a failed sample among good ones was a 200
        # whose choice said "error", a finish reason the OpenAI API does not have (a stream ends with its error
        # event whichever sample failed)
        if out.finished and any(o.finish_reason == "error" for o in out.outputs):
            raise APIError(500, f"the request failed inside the engine: {out.error or 'no reason given'}",
                           "internal_error", None, "engine_error")
        return out

    async def _run(self, request: Request, prompt, params: SamplingParams, tenant: str, prefix: str,
                   stream_mode: bool, make_body, prompt_field: str = "prompt"):
        """Submit; non-streaming: wait for the final output; streaming: wait for the first, then stream."""
        request_id, stream = await self._submit(prompt, params, tenant, prefix, prompt_field)
        handed_over = False
        try:
            try:
                out = await self._first_or_final(request, stream, until_final=not stream_mode)
            except _ClientGone:
                return Response(status_code=499)
            if not stream_mode:
                return JSONResponse(make_body(request_id, out))
            handed_over = True
            return SSEResponse(make_body(request_id, out, stream), stream)
        finally:
            if not handed_over:
                stream.close()

    # -- endpoints ------------------------------------------------------------------
    async def completions(self, request: Request):
        self._check_open()
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        model = self._check_model(req.model)
        tenant = request.state.tenant
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "batched prompts (a list of several prompts) are not supported; send one per request",
                               "invalid_request_error", "prompt", "unsupported")
            p = p[0]
        if isinstance(p, str):  # tokenized here, on a worker thread: a 4 MB prompt must not stall every stream
            try:
                p = (await asyncio.to_thread(self.engine.engine.inputs.encode, p))[1]
            except ValueError as exc:
                raise _bad_value(exc)
        prompt = self._with_salt({"prompt_token_ids": list(p)}, tenant, req.cache_salt)
        params = self._sampling_params(req, req.max_tokens)
        self._check_room(len(p), req.max_tokens, "max_tokens")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def body(request_id: str, out: RequestOutput, stream: RequestStream | None = None):
            if stream is None:
                return {
                    "id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": o.index, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                                for o in sorted(out.outputs, key=lambda o: o.index)],
                    "usage": _usage(out),
                }
            return self._stream_completion(request_id, model, created, out, stream, include_usage)

        return await self._run(request, prompt, params, tenant, "cmpl", bool(req.stream), body)

    async def chat_completions(self, request: Request):
        self._check_open()
        req: ChatCompletionRequest = await self._parse(request, ChatCompletionRequest)
        model = self._check_model(req.model)
        tenant = request.state.tenant
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so no chat template", "invalid_request_error", "messages")
        conversation = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                if any(part.type != "text" for part in content):
                    raise APIError(400, "only text content parts are supported", "invalid_request_error", "messages", "unsupported")
                content = [{"type": "text", "text": part.text or ""} for part in content]  # joined by encode_chat
            conversation.append({"role": m.role, "content": content or ""})
        try:
            ids = await asyncio.to_thread(self.engine.engine.inputs.encode_chat, conversation,
                                          bool(req.add_generation_prompt))
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_request_error", "messages", "invalid_value")
        prompt = self._with_salt({"prompt_token_ids": ids}, tenant, req.cache_salt)
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(req, field)
        params = self._sampling_params(req, max_tokens, field)
        self._check_room(len(ids), max_tokens, field, "messages")
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = int(time.time())

        def body(request_id: str, out: RequestOutput, stream: RequestStream | None = None):
            if stream is None:
                return {
                    "id": request_id, "object": "chat.completion", "created": created, "model": model,
                    "choices": [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                                 "logprobs": None, "finish_reason": o.finish_reason}
                                for o in sorted(out.outputs, key=lambda o: o.index)],
                    "usage": _usage(out),
                }
            return self._stream_chat(request_id, model, created, out, stream, include_usage)

        return await self._run(request, prompt, params, tenant, "chatcmpl", bool(req.stream), body, "messages")

    # -- streaming bodies -------------------------------------------------------------
    async def _outputs(self, first: RequestOutput, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        yield first
        while not first.finished and not stream.finished:
            yield await stream.get()

    async def _stream_chat(self, rid, model, created, first, stream, include_usage) -> AsyncIterator[str]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        for i in range(max(1, len(first.outputs))):  # OpenAI opens each choice with the role
            yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}], **extra})

        def choice(o) -> dict:
            return {"index": o.index, "delta": {"content": o.delta_text} if o.delta_text else {},
                    "logprobs": None, "finish_reason": o.finish_reason}

        async for chunk in self._stream_choices(base, extra, first, stream, include_usage, choice):
            yield chunk

    async def _stream_completion(self, rid, model, created, first, stream, include_usage) -> AsyncIterator[str]:
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}

        def choice(o) -> dict:
            return {"index": o.index, "text": o.delta_text, "logprobs": None, "finish_reason": o.finish_reason}

        async for chunk in self._stream_choices(base, extra, first, stream, include_usage, choice):
            yield chunk

    async def _stream_choices(self, base, extra, first, stream, include_usage, choice) -> AsyncIterator[str]:
        """The SSE body both endpoints share: one chunk per choice that changed, usage, ``[DONE]``.

        ``choice(completion)`` shapes one choice the endpoint's way (chat deltas or completion text).
        A choice that finished is never sent again; a shutdown ends the stream with an error event, and so does a
        request the engine failed once its stream had begun (its 200 is sent): the event carries the reason the
        non-streamed request's 500 gives, where a bare ``finish_reason: "error"`` chunk told the client nothing
        (the ``openai`` client raises ``APIError`` on the event, as it does on the 500).
        """
        done: set[int] = set()
        last, failed = first, None  # failed: the engine's reason, once a choice finished with "error"
        try:
            async for out in self._outputs(first, stream):
                last = out
                for o in out.outputs:
                    if o.index in done or not (o.delta_text or o.finish_reason):
                        continue
                    if o.finish_reason:
                        done.add(o.index)
                        if o.finish_reason == "error" and failed is None:
                            failed = out.error or "no reason given"
                    yield _sse({**base, "choices": [choice(o)], **extra})
        except (EngineShutdown, EngineDead) as exc:
            yield _sse({"error": {"message": str(exc), "type": "service_unavailable", "param": None, "code": 503}})
            yield "data: [DONE]\n\n"
            return
        if failed is not None:
            yield _sse({"error": {"message": f"the request failed inside the engine: {failed}",
                                  "type": "internal_error", "param": None, "code": "engine_error"}})
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            yield _sse({**base, "choices": [], "usage": _usage(last)})
        yield "data: [DONE]\n\n"

    async def models(self, request: Request):
        return ModelList(data=[self._card(name) for name in self.model_names]).model_dump()

    async def model(self, request: Request):
        """``GET /v1/models/{model}`` (the client's ``models.retrieve``): its card, or 404 as for a request."""
        if not request.path_params["model"]:  # "/v1/models/": the list, as without the slash
            return await self.models(request)
        name = self._check_model(request.path_params["model"])
        return self._card(name).model_dump()

    def _card(self, name: str) -> ModelCard:
        """A model's card, ``created`` when this server started serving it: the same on every call, as OpenAI's
        is (it was the time of the call, so a client caching cards saw each one change)."""
        return ModelCard(id=name, max_model_len=self.max_model_len, created=self._created)

    async def metrics(self, request: Request):
        m = self.engine.metrics
        if m is None:
            return Response(b"", media_type=CONTENT_TYPE)
        try:
            # read whether or not the loop runs (``AsyncEngine.stats`` reads a stopped loop's engine directly): a loop
            # that failed, or whose engine was closed, aborted its requests after its last sync, and skipping the read
            # then served their running count and KV blocks for ever
            m.sync(await asyncio.wait_for(self.engine.stats(), timeout=5.0))
        except Exception:  # noqa: BLE001 - serve the last values rather than fail a scrape
            pass
        return Response(m.render(), media_type=CONTENT_TYPE)

    async def health(self, request: Request):
        if self.engine.is_running and not self.engine.shutting_down:
            return JSONResponse({"status": "ok"})
        return error_response(503, "the engine loop is not running", "service_unavailable", None, "unhealthy")


def build_app(
    engine,
    model_names: list[str] | str | None = None,
    api_keys: dict[str, str] | None = None,
    metrics: EngineMetrics | None = None,
    door: DoorRule | None = None,
    max_body_bytes: int | None | str = "auto",
) -> FastAPI:
    """A FastAPI app serving ``engine`` (an :class:`~minivllm.engine.llm_engine.LLMEngine`).

    ``max_body_bytes``: a larger request body is a 413 before it is parsed; ``"auto"`` is
    :func:`default_max_body_bytes` (what the largest servable request needs), None no limit.

    The app's lifespan starts the engine loop thread and, on shutdown, aborts
    what is in flight and stops it.  ``app.state.async_engine`` and
    ``app.state.metrics`` are there for tests and for the CLI.
    """
    if model_names is None:
        model_names = [_default_model_name(engine)]
    elif isinstance(model_names, str):
        model_names = [model_names]
    if not model_names:
        raise ValueError("at least one served model name is needed")
    if max_body_bytes == "auto":
        max_body_bytes = default_max_body_bytes(engine)
    elif max_body_bytes is not None and (not is_int(max_body_bytes)
                                         or max_body_bytes < 1):
        raise ValueError(f"max_body_bytes must be a positive int, 'auto' or None, got {max_body_bytes!r}")
    metrics = metrics if metrics is not None else EngineMetrics(model_names[0])
    async_engine = AsyncEngine(engine, metrics)
    handlers = OpenAIServer(async_engine, model_names, getattr(getattr(engine, "config", None), "max_model_len", None),
                            door, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)

    app = FastAPI(title="minivllm", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.handlers = handlers

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(list(exc.errors()))
        return error_response(400, msg, "invalid_request_error", param, "invalid_type")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None, exc.status_code,
                              getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, exc: ClientDisconnect):
        # The client left while still sending its body: a client's choice, not a server error (no 500, no
        # traceback in the log); nothing was submitted, so there is nothing to abort.  499, as elsewhere.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error serving %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error", None, 500)

    app.add_api_route("/v1/completions", handlers.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", handlers.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", handlers.models, methods=["GET"])
    app.add_api_route("/v1/models/{model:path}", handlers.model, methods=["GET"])
    app.add_api_route("/metrics", handlers.metrics, methods=["GET"])
    app.add_api_route("/health", handlers.health, methods=["GET"])
    app.add_middleware(_AuthMiddleware, api_keys=dict(api_keys or {}))
    return app


def _default_model_name(engine) -> str:
    model = getattr(getattr(engine, "config", None), "model", None)
    if not model:
        return "SmolLM2-135M-Instruct"
    return os.path.basename(str(model).rstrip("/\\")) or str(model)
