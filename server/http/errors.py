"""The OpenAI error contract: every client error is ``{"error": {message, type, param, code}}``.

Validation failures answer 400 (never FastAPI's default 422), unknown routes 404, a
full queue 429 with ``Retry-After``. A bug answers 500 in the same shape, without the
exception's text (which may hold addresses or request data).

Example:
    >>> error_body("bad value", param="temperature")["error"]["type"]
    'invalid_request_error'
"""

from __future__ import annotations

from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """Raised by handlers for errors a client should see."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(message: str, *, status: int = 400, param: str | None = None,
               code: str | None = None, err_type: str | None = None) -> dict:
    """``err_type`` overrides the type the status implies (a queue timeout is a 503 of type
    ``server_error``: the server failed the request, it is not shutting down)."""
    err_type = err_type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None, err_type: str | None = None) -> JSONResponse:
    body = error_body(message, status=status, param=param, code=code, err_type=err_type)
    return JSONResponse(body, status_code=status, headers=headers)


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    """First pydantic error as ``(message, param)``; ``param`` is the dotted field path."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    param = _param(first)
    # A union field (prompt: str | list[int]) fails once per branch: name them all.
    msgs = [str(e.get("msg", "invalid value")) for e in errors if _param(e) == param]
    where = f" ({param})" if param else ""
    return f"{_clip('; or '.join(dict.fromkeys(msgs[:3])))}{where}", param


# pydantic names the branch of a union in the error path (prompt.str, prompt.list[int]).
_BRANCHES = frozenset({"str", "int", "float", "bool", "list", "dict"})


# Where FastAPI found a parameter: the first element of an error's path, not part of its name.
_SOURCES = frozenset({"body", "query", "path"})


def _param(error: dict) -> str | None:
    """The dotted field path of a pydantic error, without where it came from (``body``,
    ``query``) and union branch names.

    >>> _param({"loc": ("body", "messages", 0, "content", "str")}), _param({"loc": ("query", "limit")})
    ('messages.0.content', 'limit')
    """
    loc = list(error.get("loc", ()))
    loc = [str(p) for p in (loc[1:] if loc and loc[0] in _SOURCES else loc)]
    loc = [p for p in loc if p not in _BRANCHES and "[" not in p]
    return _clip(".".join(loc)) or None  # a path may hold a client's dict key


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


# Another API dialect served under a path prefix shapes its own errors: prefix -> function
# (status, message, param) -> body, and the JSON schema of that body for /openapi.json
# (the guard uses them too). OpenAI's shape everywhere else.
ERROR_SHAPES: dict[str, Callable[[int, str, str | None], dict]] = {}
ERROR_SCHEMAS: dict[str, dict] = {}


def dialect_error(path: str) -> Callable[[int, str, str | None], dict] | None:
    """The error shape of the API dialect ``path`` belongs to; None: OpenAI's."""
    return next((shape for prefix, shape in ERROR_SHAPES.items() if path.startswith(prefix)), None)


def _respond(request: Request, status: int, message: str, *, param: str | None = None,
             code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    shape = dialect_error(request.url.path)
    if shape is not None:
        return JSONResponse(shape(status, message, param), status_code=status, headers=headers)
    return error_response(status, message, param=param, code=code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _respond(request, exc.status, exc.message, param=exc.param, code=exc.code,
                        headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _describe_validation(exc)
        return _respond(request, 400, message, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            message = "unknown route"
        return _respond(request, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):  # logged by the server; the client gets the shape
        return _respond(request, 500, "internal server error")


_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_POST_ERRORS = {"400": "invalid request", "401": "missing or invalid API key", "404": "unknown model",
                "413": "body too large", "429": "queue full (Retry-After)", "431": "headers too large",
                "503": "shutting down, or the request waited too long in the queue"}
_GET_ERRORS = {"401": "missing or invalid API key", "431": "headers too large", "503": "unhealthy or shutting down"}


def document_errors(app: FastAPI) -> None:
    """Make ``/openapi.json`` say what the server answers: the OpenAI error object with 400
    (FastAPI documents its 422, which is never sent) and the other statuses of the guards.

    >>> from fastapi import FastAPI
    >>> app = FastAPI()
    >>> _ = app.post("/x")(lambda body: None)  # noqa
    >>> document_errors(app)
    >>> sorted(app.openapi()["paths"]["/x"]["post"]["responses"])
    ['200', '400', '401', '404', '413', '429', '431', '503']
    """
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            components.pop(unused, None)
        components["ErrorResponse"] = _ERROR_SCHEMA
        openai_ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
        for url, path in schema.get("paths", {}).items():
            prefix = next((p for p in ERROR_SCHEMAS if url.startswith(p)), None)
            ref = openai_ref if prefix is None else {"application/json": {"schema": ERROR_SCHEMAS[prefix]}}
            for method, operation in path.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                # The statuses every route of the method may answer, and those a route declares.
                errors = {**(_POST_ERRORS if method == "post" else _GET_ERRORS),
                          **{s: r.get("description", "") for s, r in responses.items() if s[:1] in "45"}}
                responses.update({status: {"description": text, "content": ref} for status, text in errors.items()})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
