"""HTTP errors of the OpenAI-compatible API (`http_server.py`): every failure is an OpenAI error
object `{"error": {"message", "type", "param", "code"}}`, never text/plain.

1. `HTTPError(status, message, param)` is raised by the handlers; `http_error(e)` maps the front
   end's errors (`serving/errors.py`) onto it: InvalidArgument 400 (its `field` is the `param`),
   QueueFull 429, Unavailable 503, anything else 500.
2. `install_handlers(app, respond)` renders every error the app can raise through `respond`
   (the server's error response, which also counts it in the metrics): our HTTPError,
   Starlette's 404 / 405 (unknown route, wrong method), FastAPI's body validation (a 400 naming
   the field from pydantic's location) and any unexpected exception (500, logged with its
   traceback).
3. `BodyLimit` (ASGI middleware) refuses a body over the front end's `max_request_bytes` with a
   413 naming the endpoint's prompt field: a Content-Length over the cap before any of the body
   is read, a chunked body as soon as the bytes read pass it.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving import validation
from serving.errors import InvalidArgument, QueueFull, Unavailable

logger = logging.getLogger(__name__)

# The gRPC status name of each HTTP status: the label of the shared "rejected" metric.
GRPC_NAMES = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "UNIMPLEMENTED",
    413: "RESOURCE_EXHAUSTED",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}

Respond = Callable[..., JSONResponse]  # respond(HTTPError, headers=None)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def http_error(e: Exception) -> HTTPError:
    """The HTTP error of a front-end error (a ValueError: bad input, naming the API field)."""
    if isinstance(e, ValueError):
        field = e.field if isinstance(e, InvalidArgument) else None
        return HTTPError(400, str(e), field or param_of(str(e)))
    if isinstance(e, QueueFull):
        return HTTPError(429, str(e))
    if isinstance(e, Unavailable):
        return HTTPError(503, str(e))
    return HTTPError(500, str(e))


def install_handlers(app: FastAPI, respond: Respond) -> None:
    """Every error `app` raises answered as an error object through `respond` (step 2)."""

    @app.exception_handler(HTTPError)
    async def on_error(request: Request, e: HTTPError) -> JSONResponse:
        return respond(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_exception(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404:
            message = f"{request.method} {request.url.path}: no such route ({message})"
        elif e.status_code == 405:
            message = f"{request.method} {request.url.path}: method not allowed"
        return respond(HTTPError(e.status_code, message), headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return respond(validation_error(e.errors(), None))

    @app.exception_handler(Exception)
    async def on_exception(request: Request, e: Exception) -> JSONResponse:
        logger.exception("%s %s failed", request.method, request.url.path)
        return respond(HTTPError(500, f"internal error: {type(e).__name__}: {e}"))


BODY_FIELDS = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}


class BodyLimit:
    """ASGI middleware: a request body over `limit()` bytes is a 413 naming the endpoint's
    prompt field (step 3); `respond` renders it when nothing of the body was read."""

    def __init__(self, app: Any, limit: Callable[[], int], respond: Respond) -> None:
        self.app, self.limit, self.respond = app, limit, respond

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit()
        param = BODY_FIELDS.get(scope.get("path", ""))
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            e = too_large(f"of {int(length)} bytes ", limit, param)
            await self.respond(e)(scope, receive, send)
            return None
        read = 0

        async def counted() -> dict:
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise too_large("", limit, param)
            return message

        return await self.app(scope, counted, send)


def too_large(size: str, limit: int, param: str | None) -> HTTPError:
    return HTTPError(413, f"the request body {size}exceeds --max-request-bytes={limit}", param)


def validation_error(errors: list[dict[str, Any]], body: Any) -> HTTPError:
    """A 400 naming the field of pydantic's first error ("messages[0].content", "top_k")."""
    err = errors[0]
    loc = [p for p in err.get("loc", ()) if p != "body"]
    field = loc_path(body, loc, missing=err.get("type") == "missing") if body else None
    if field is None:
        field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    message = f"{field}: {err.get('msg', 'invalid')}" if field else str(err.get("msg"))
    if err.get("type") == "extra_forbidden":  # NOTE: never ignored silently (README: API)
        message = (
            f"{field} is not a field this server knows: unknown request fields are refused, "
            f"not ignored (see the README's list of supported and refused fields)"
        )
    return HTTPError(400, message, field or None)


def loc_path(body: Any, loc: list[Any], *, missing: bool) -> str:
    """The path of a pydantic error location in the body it was read from: keys and indexes
    that exist in the body; the union member tags pydantic adds ("str", "list[int]",
    "function-after[...]") are skipped; a missing field is named."""
    path, node = "", body
    for i, p in enumerate(loc):
        if isinstance(node, dict) and isinstance(p, str) and p in node:
            path, node = (f"{path}.{p}" if path else p), node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            path, node = f"{path}[{p}]", node[p]
        elif missing and i == len(loc) - 1 and isinstance(node, dict) and isinstance(p, str):
            path = f"{path}.{p}" if path else p
    return path


def param_of(message: str) -> str | None:
    """The field a message starts with ("prompt[1] is empty" -> "prompt[1]"), or None."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if re.fullmatch(r"[A-Za-z_][\w.]*(\[\d+\])*(\.[\w.]+)*", head) else None


async def parse_body(request: Request, cls: type[BaseModel]) -> Any:
    """The request's JSON body parsed as `cls`; a 400 naming what is wrong (not JSON, not an
    object, a lone surrogate, a field's type or value, nesting too deep)."""
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise HTTPError(400, f"the request body is not valid JSON: {e}"[:500]) from None
    if not isinstance(body, dict):
        raise HTTPError(400, "the request body must be a JSON object")
    bad = validation.bad_text(body)
    if bad is not None:
        raise HTTPError(400, f"{bad} is not valid UTF-8 text (a lone surrogate)", bad)
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(), body) from None
    except RecursionError:
        raise HTTPError(400, "the request body is nested too deeply") from None
