"""The ASGI layer in front of the routes: authentication, body limits, strict JSON, draining.

Everything here answers before FastAPI parses anything, in the error shape of the API the
path belongs to (OpenAI's, or Anthropic's under /v1/messages):

- 401 ``invalid_api_key`` without ``Authorization: Bearer <key>`` (or Anthropic's
  ``x-api-key: <key>``) when a key is configured
  (every route but ``GET /health`` and CORS preflights; compared in constant time, on the raw
  ASGI path the router also uses, so no rebuilt URL or Host header can route around it);
- 431 ``headers_too_large`` for a request line and headers over the limit (the HTTP parser
  itself stops heads, slow drips included, at 16 times that size);
- 413 ``body_too_large`` for a body over the limit, declared or streamed;
- 400 for a body that is not strict JSON: ``NaN``/``Infinity``, invalid UTF-8, lone
  surrogates (``"\\ud800"``), nesting deeper than ``MAX_JSON_DEPTH``, or a non-object;
- 503 ``server_draining`` for new completions once SIGTERM started the drain.

Example (a drained gate refuses new work, ``/health`` and metrics stay readable):
    >>> gate = Gate()
    >>> gate.admits("POST"), gate.start_drain(), gate.admits("POST"), gate.admits("GET")
    (True, True, False, True)
    >>> gate.start_drain()  # already draining: the caller should not start a second drain
    False
    >>> check_json(b'{"a": [1, "x"]}'), check_json(b'{"t": NaN}')
    (None, 'request body is not valid JSON: NaN is not allowed')
"""

from __future__ import annotations

import hmac
import json
import threading
from typing import Any, Awaitable, Callable

from kvserve.server.http.errors import dialect_error, error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_JSON_DEPTH = 32  # our schemas nest 4 deep; deeper only costs the parser and validator
PUBLIC_PATHS = frozenset({"/health"})  # load balancers probe it without a key


class Gate:
    """Admission of new completions; ``start_drain`` closes it (once, thread-safe)."""

    def __init__(self) -> None:
        self._draining = threading.Event()
        self._lock = threading.Lock()
        self._aborts: dict[int, Callable[[], None]] = {}  # live HTTP requests -> their abort
        self._next = 0

    def track(self, abort: Callable[[], None]) -> int:
        """Remember a live request's abort until ``untrack``; returns its handle."""
        with self._lock:
            self._next += 1
            self._aborts[self._next] = abort
            return self._next

    def untrack(self, handle: int) -> None:
        with self._lock:
            self._aborts.pop(handle, None)

    def abort_all(self) -> int:
        """Abort every live request (the drain ran out of time); they end with a finish reason."""
        with self._lock:
            aborts = list(self._aborts.values())
        for abort in aborts:
            abort()
        return len(aborts)

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def start_drain(self) -> bool:
        """Close admission; True only for the call that closed it."""
        with self._lock:
            if self._draining.is_set():
                return False
            self._draining.set()
            return True

    def admits(self, method: str) -> bool:
        """New work arrives by POST; reads (health, metrics, models) stay open while draining."""
        return not (self.draining and method == "POST")


class _BadJSON(ValueError):
    pass


def _reject_constant(name: str) -> float:
    raise _BadJSON(f"{name} is not allowed")


def check_json(body: bytes) -> str | None:
    """Why ``body`` is not a strict JSON object within our limits, or None when it is."""
    try:
        value = json.loads(body, parse_constant=_reject_constant)
    except _BadJSON as exc:
        return f"request body is not valid JSON: {exc}"
    except (ValueError, RecursionError):  # syntax, invalid UTF-8, nesting past Python's limit
        return "request body is not valid JSON"
    if not isinstance(value, dict):
        return "request body must be a JSON object"
    return _check_values(value)


def _check_values(root: dict) -> str | None:
    """Depth and UTF-8 encodability of every string, walked without recursion."""
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"request body nests deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(value, dict):
            stack.extend((k, depth) for k in value)
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, str) and not _encodable(value):
            return "request body contains a lone UTF-16 surrogate (invalid Unicode)"
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _head_size(scope: Scope) -> int:
    """Bytes of the request line and headers, as they came (``name: value\r\n`` each)."""
    line = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value
    return None


def bearer_matches(authorization: bytes | None, key: bytes) -> bool:
    """Constant-time check of ``Authorization: Bearer <key>`` (the scheme is case-insensitive).

    >>> bearer_matches(b"Bearer sk-12345678", b"sk-12345678"), bearer_matches(b"bearer x", b"sk-12345678")
    (True, False)
    """
    if not authorization:
        return False
    scheme, _, token = authorization.strip().partition(b" ")
    # compare_digest runs in time independent of where the bytes differ.
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def key_matches(header: bytes | None, key: bytes) -> bool:
    """Constant-time check of Anthropic's ``x-api-key: <key>`` header.

    >>> key_matches(b"sk-12345678", b"sk-12345678"), key_matches(None, b"sk-12345678")
    (True, False)
    """
    return bool(header) and hmac.compare_digest(header.strip(), key)


async def send_error(send: Send, path: str, status: int, message: str, *, code: str | None = None,
                     headers: dict[str, str] | None = None) -> None:
    """The error in the shape of the API dialect ``path`` belongs to (OpenAI's by default)."""
    shape = dialect_error(path)
    body = shape(status, message, None) if shape else error_body(message, status=status, code=code)
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


class GuardMiddleware:
    """Wraps the FastAPI app; see the module docstring for what it answers itself."""

    def __init__(self, app: ASGIApp, *, gate: Gate, max_body_bytes: int, max_header_bytes: int = 16 << 10,
                 api_key: str | None = None):
        self.app, self.gate, self.max_body_bytes = app, gate, max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        method, path = scope["method"], scope["path"]
        if _head_size(scope) > self.max_header_bytes:
            return await send_error(send, path, 431, f"request headers exceed {self.max_header_bytes} bytes",
                                    code="headers_too_large", headers={"Connection": "close"})
        public = path in PUBLIC_PATHS and method in ("GET", "HEAD")
        # OPTIONS is a browser's CORS preflight, which never carries credentials.
        if self.key is not None and not public and method != "OPTIONS" \
                and not bearer_matches(_header(scope, b"authorization"), self.key) \
                and not key_matches(_header(scope, b"x-api-key"), self.key):
            return await send_error(send, path, 401, "missing or invalid API key (Authorization: Bearer ...)",
                                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if not self.gate.admits(method):
            return await send_error(send, path, 503, "the server is shutting down", code="server_draining",
                                    headers={"Retry-After": "5", "Connection": "close"})
        if method not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        if body:  # an empty body is left to the route: FastAPI names the missing field
            problem = check_json(body)
            if problem is not None:
                return await send_error(send, path, 400, problem, code="invalid_json")
            # The body is a JSON object whatever the client labelled it (curl's -d says
            # form-urlencoded); tell FastAPI so, rather than refuse a valid request.
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413 (declared or streamed too large)."""
        declared = _header(scope, b"content-length")
        too_large = f"request body exceeds {self.max_body_bytes} bytes"
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await send_error(send, scope["path"], 413, too_large, code="body_too_large",
                             headers={"Connection": "close"})
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await send_error(send, scope["path"], 413, too_large, code="body_too_large",
                                 headers={"Connection": "close"})
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the buffered body over once, then the real one's messages
    (the disconnect that non-streaming handlers poll for)."""
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _cors_base() -> type:
    from starlette.middleware.cors import CORSMiddleware

    return CORSMiddleware


class OpenAICORSMiddleware(_cors_base()):
    """Starlette's CORS, with a refused preflight (foreign origin, method or header) answered
    400 in the OpenAI error shape instead of plain text, and without any allow-origin header."""

    def preflight_response(self, request_headers):
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        from starlette.responses import JSONResponse

        message = response.body.decode(errors="replace") or "CORS preflight refused"
        return JSONResponse(error_body(message, status=400, code="cors_refused"), status_code=400)
