"""vLLM's utility endpoints and `--api-key` for the OpenAI-compatible HTTP API
(`http_server.py`).

1. `install(app, server)` adds `POST /tokenize` (a prompt, or chat messages through the chat
   template: `{"count", "max_model_len", "tokens", "token_strs"}`), `POST /detokenize`
   (`{"tokens": [...]}` -> `{"prompt": text}`), `GET /version` (`{"version"}`) and
   `GET|POST /ping` (as `/health`: 200 once serving, else 503), with vLLM's names and shapes.
   Every field of their bodies is checked like a generation request's (unknown fields refused,
   errors name the field).
2. `ApiKey` (ASGI middleware): with `FrontEnd.api_key` set, every route but `/health`, `/ping`
   and `/metrics` needs `Authorization: Bearer KEY`; anything else is a 401 OpenAI error object
   (`param` "authorization"). The gRPC server checks the same key in its metadata.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from serving import http_errors, validation
from serving import openai_protocol as oai
from serving.http_errors import HTTPError, http_error

OpenAIServer = Any  # serving.http_server.OpenAIServer (not imported: it imports this module)

OPEN_PATHS = ("/health", "/ping", "/metrics")  # served without the API key


def version() -> str:
    try:
        return metadata.version("jaxinfer")
    except metadata.PackageNotFoundError:
        return "unknown"


class TokenizeRequest(BaseModel):
    """vLLM's `/tokenize` body: `prompt`, or `messages` rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[oai.ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def install(app: FastAPI, server: OpenAIServer) -> None:
    """Adds /tokenize, /detokenize, /version and /ping to `server`'s app (step 1)."""
    fe = server.frontend

    def need_tokenizer() -> Any:
        if server.tokenizer is None:
            raise HTTPError(400, "this server has no tokenizer (--skip-tokenizer-init)")
        return server.tokenizer

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        req = await http_errors.parse_body(request, TokenizeRequest)
        server._check_model(req.model)  # noqa: SLF001 - the server's own helper
        tok = need_tokenizer()
        if (req.prompt is None) == (req.messages is None):
            raise HTTPError(400, "give one of prompt or messages", "prompt")
        try:
            if req.messages is not None:
                chat = oai.ChatCompletionRequest(messages=req.messages).chat()
                kwargs = validation.chat_template_kwargs(
                    {"add_generation_prompt": req.add_generation_prompt}
                    | (req.chat_template_kwargs or {}),
                    "chat_template_kwargs",
                )
                ids = await fe.tokenize_chat(chat, field="messages", **kwargs)
            else:
                ids = (
                    await fe.tokenize(
                        req.prompt, field="prompt", add_special_tokens=req.add_special_tokens
                    )
                    if req.prompt
                    else []
                )
        except ValueError as e:
            raise http_error(e) from None
        info = fe.info
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": info.capacity.max_model_len if info is not None else None,
                "tokens": ids,
                "token_strs": [tok.token_text(t) for t in ids] if req.return_token_strs else None,
            }
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await http_errors.parse_body(request, DetokenizeRequest)
        server._check_model(req.model)  # noqa: SLF001 - the server's own helper
        tok = need_tokenizer()
        for i, t in enumerate(req.tokens):
            if not 0 <= t < fe.vocab_size:
                raise HTTPError(
                    400,
                    f"tokens[{i}] = {t} is outside the vocabulary [0, {fe.vocab_size})",
                    f"tokens[{i}]",
                )
        return JSONResponse({"prompt": tok.decode(req.tokens, skip_special_tokens=False)})

    @app.get("/version")
    async def version_() -> JSONResponse:
        return JSONResponse({"version": version()})

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        if fe.ready:
            return Response(status_code=200)
        why = fe.broken or "not ready (warming up or shutting down)"
        return JSONResponse(oai.error_body(503, why), status_code=503)


class ApiKey:
    """ASGI middleware: the Bearer key on every path but `OPEN_PATHS` (step 2)."""

    def __init__(self, app: Any, server: OpenAIServer) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        fe = self.server.frontend
        if scope["type"] != "http" or fe.api_key is None or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if fe.authorized(auth):
            return await self.app(scope, receive, send)
        e = HTTPError(401, "invalid or missing API key (send Authorization: Bearer KEY)")
        e.param = "authorization"
        await self.server._error(e, headers={"WWW-Authenticate": "Bearer"})(  # noqa: SLF001
            scope, receive, send
        )
        return None
