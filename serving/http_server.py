"""`OpenAIServer`: the OpenAI-compatible HTTP API (FastAPI on uvicorn), a thin peer over a
`FrontEnd` (`frontend.py`), beside the gRPC server in the same process and on the same event loop.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both streamed as server-sent
events ending in `data: [DONE]` when `stream` is true), `GET /v1/models`, `GET /health` (200 once
warmed up, 503 before and while shutting down), `GET /metrics` (the front end's Prometheus
registry).

1. `start()` starts the front end (its core) if no peer has, binds the port and serves on the
   running event loop (uvicorn's signal handling is off: the front end's handlers drain every
   peer).
2. A request body is parsed by the pydantic models of `openai_protocol`; admission, the prompt
   checks and the submit are the front end's (`check_admission`, `submit`), and so are the chat
   template and the tokenization (`tokenize_chat`, `tokenize`: off the event loop).
3. Deltas of the request's streams (one per prompt; n samples each) come from
   `Stream.next_batch()`: a client behind the engine gets every delta waiting for it in one chunk.
4. A client that disconnects (streaming or not) cancels the handler; its `finally` cancels the
   request in the front end, which frees its pages at the next step.

Errors are OpenAI error objects: 400 (bad input, naming the field), 404 (unknown model), 413 (a
body over the front end's `max_request_bytes`, refused before it is read; `param` names the
prompt field), 429
(queue full), 503 (warming up, shutting down, engine broken), 500 (this request failed). A failure
after a stream has started is sent as a last `data: {"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from jaxinfer.engine.output import RequestDelta, Usage
from serving import chat as chat_api
from serving import http_errors, validation
from serving import openai_protocol as oai
from serving.engine_loop import Stream
from serving.errors import InvalidArgument, QueueFull, RequestFailed, Unavailable
from serving.frontend import FrontEnd
from serving.http_errors import HTTPError, http_error

logger = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (the front end's handlers drain every peer)."""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201 - uvicorn's signature
        yield


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


class OpenAIServer:
    """The HTTP peer of a `FrontEnd` (see the module docstring).

    Args:
      frontend: the front end (engine loop, admission, tokenizer, metrics, lifecycle).
      host, port: where to listen (`port=0`: a free port; `start()` returns it).
      served_model_name: the model id clients name (default: the checkpoint's name).
      chat_options: tool calling and reasoning flags (`serving.chat.ChatOptions`).
    """

    def __init__(
        self,
        frontend: FrontEnd,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        served_model_name: str | None = None,
        chat_options: chat_api.ChatOptions | None = None,
    ) -> None:
        self.frontend = frontend
        self.chat_options = chat_options or chat_api.ChatOptions()
        self.host, self.port = host, port
        self.model_name = served_model_name or frontend.model.name
        self.tokenizer = frontend.tokenizer
        self.app = self._build_app()
        self._uvicorn: _Uvicorn | None = None
        self._task: asyncio.Task | None = None
        frontend.attach(self)

    async def start(self) -> int:
        """Starts the front end (if no peer has), binds the port and serves on the running
        loop; returns the port. Raises RuntimeError if the engine core fails to start."""
        await self.frontend.start()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((self.host, self.port))
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            http_errors.BodyLimit(self.app, lambda: self.frontend.max_request_bytes, self._error),
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._uvicorn = _Uvicorn(config)
        self._task = asyncio.get_running_loop().create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._task.done():
                self._task.result()  # raises why it stopped
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        logger.info(
            "OpenAI-compatible HTTP API at http://%s:%d/v1 (model id %r)",
            self.host,
            self.port,
            self.model_name,
        )
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Nothing to do: `/health` asks the front end."""

    async def stop(self) -> None:
        if self._uvicorn is not None and self._task is not None:
            self._uvicorn.should_exit = True
            with contextlib.suppress(Exception):
                await self._task

    def _build_app(self) -> FastAPI:
        app = FastAPI(
            title="jaxinfer OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None
        )
        http_errors.install_handlers(app, self._error)

        @app.get("/health")
        async def health() -> Response:
            if self.frontend.ready:
                return Response(status_code=200)
            why = self.frontend.broken or "not ready (warming up or shutting down)"
            return JSONResponse(oai.error_body(503, why), status_code=503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(
                generate_latest(self.frontend.metrics.registry), media_type=CONTENT_TYPE_LATEST
            )

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            return JSONResponse({"object": "list", "data": [self._model_card()]})

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> JSONResponse:
            self._check_model(model_id)
            return JSONResponse(self._model_card())

        if self.frontend.trace_dir is not None:  # NOTE: as vLLM: only with a profiler dir

            @app.post("/start_profile")
            async def start_profile() -> Response:
                self.frontend.profile(True)
                return Response(status_code=200)

            @app.post("/stop_profile")
            async def stop_profile() -> Response:
                self.frontend.profile(False)
                return Response(status_code=200)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._handle(request, oai.CompletionRequest, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._handle(request, oai.ChatCompletionRequest, chat=True)

        return app

    def _model_card(self) -> dict[str, Any]:
        info = self.frontend.info
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxinfer",
            "root": self.frontend.model.name,
            "max_model_len": info.capacity.max_model_len if info is not None else None,
        }

    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.frontend.model.name):
            raise HTTPError(
                404,
                f"The model `{name}` does not exist (this server serves `{self.model_name}`)",
                "model",
            )

    def _error(self, e: HTTPError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        self.frontend.metrics.rejected.labels(
            http_errors.GRPC_NAMES.get(e.status, "INTERNAL")
        ).inc()
        return JSONResponse(
            oai.error_body(e.status, e.message, e.param), status_code=e.status, headers=headers
        )

    async def _parse(self, request: Request, cls: type[oai._Request]) -> Any:
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
            raise http_errors.validation_error(e.errors(), body) from None
        except RecursionError:
            raise HTTPError(400, "the request body is nested too deeply") from None

    async def _handle(self, request: Request, cls: type[oai._Request], *, chat: bool) -> Response:
        try:
            self.frontend.check_admission()
        except (Unavailable, QueueFull) as e:
            raise http_error(e) from None
        req = await self._parse(request, cls)
        self._check_model(req.model)
        try:
            plan = chat_api.plan(req, self.chat_options) if chat else None
        except InvalidArgument as e:
            raise http_error(e) from None
        streams, prompt_lens = await self._admit(req, plan)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        meta = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            events = (
                self._chat_events(req, plan, streams, meta, include_usage)
                if plan is not None
                else self._completion_events(req, streams, meta, include_usage)
            )
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
            )
        collect = asyncio.ensure_future(self._collect(req, streams, meta, plan))
        watch = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not collect.done():  # the client went away: its streams are aborted
                collect.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await collect
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        return JSONResponse(collect.result(), headers={"X-Request-Id": rid})

    async def _admit(
        self, req: Any, plan: chat_api.ChatPlan | None
    ) -> tuple[list[Stream], list[int]]:
        """Tokenizes, validates and submits the request's prompts (a chat's as `plan` says);
        returns their streams."""
        chat = plan is not None
        unsupported = req.unsupported()
        if unsupported:
            raise HTTPError(
                400, f"{unsupported[0]} is not supported by this server", unsupported[0].split()[0]
            )
        if self.tokenizer is None:
            raise HTTPError(400, "this server has no tokenizer")
        fe = self.frontend
        try:
            if chat:
                kwargs = validation.chat_template_kwargs(
                    plan.template_kwargs, "chat_template_kwargs"
                )
                prompts = [await fe.tokenize_chat(plan.messages, field="messages", **kwargs)]
                names = ["messages"]
            else:
                names = [name for name, _ in req.prompts()]
                prompts = [
                    p if isinstance(p, list) else await fe.tokenize(p, field=name)
                    for name, p in req.prompts()
                ]
            logprobs = _logprobs(req, chat)
            max_field = "max_tokens"
            asked = req.max_tokens
            if chat and req.max_completion_tokens is not None:
                asked, max_field = req.max_completion_tokens, "max_completion_tokens"
            streams: list[Stream] = []
            try:
                for ids, name in zip(prompts, names, strict=True):
                    max_tokens = asked
                    if max_tokens is None:  # up to the context (chat) or the OpenAI default (16)
                        room = max(fe.room(len(ids)), 1)
                        max_tokens = room if chat else min(16, room)
                    fields = oai.fields(req, prompt=name, max_tokens=max_field)
                    extra = {}
                    if plan is not None:
                        fields = fields.with_(renames=plan.renames)
                        extra["structured"] = plan.structured
                    sp = oai.sampling_params(
                        req, fields, max_tokens=max_tokens, logprobs=logprobs, **extra
                    )
                    streams.append(fe.submit(ids, sp, req.priority, fields=fields))
            except BaseException:
                for s in streams:
                    fe.cancel(s)
                raise
            return streams, [len(ids) for ids in prompts]
        except (ValueError, QueueFull, Unavailable) as e:  # InvalidArgument: naming the field
            raise http_error(e) from None

    async def _deltas(
        self, streams: list[Stream], req: Any = None
    ) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(prompt index, delta) of every sample of every stream until all have finished;
        cancels what is unfinished when left early. A failed request raises `HTTPError`."""
        unfinished = [s.n for s in streams]
        getters: dict[asyncio.Future, int] = {}
        try:
            while any(unfinished):
                try:
                    if len(streams) == 1:
                        p, item = 0, await streams[0].next_batch()
                    else:
                        for i, s in enumerate(streams):
                            if unfinished[i] and i not in getters.values():
                                getters[asyncio.ensure_future(s.next_batch())] = i
                        done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                        fut = next(iter(done))
                        p, item = getters.pop(fut), fut.result()
                except (RequestFailed, InvalidArgument) as e:  # the latter: the core refused it
                    raise http_error(e) from None
                unfinished[p] -= bool(item.finished)
                yield p, item
        finally:
            for fut in getters:
                if not fut.cancel() and not fut.cancelled():
                    fut.exception()  # a failure nobody reads now: retrieved, not warned about
            for i, s in enumerate(streams):
                if unfinished[i]:
                    self.frontend.cancel(s)

    async def _collect(
        self,
        req: Any,
        streams: list[Stream],
        meta: dict[str, Any],
        plan: chat_api.ChatPlan | None,
    ) -> dict[str, Any]:
        chat = plan is not None
        n = req.n
        choices = [{"text": "", "lps": [], "finish": None} for _ in range(n * len(streams))]
        usages: list[list[Usage | None]] = [[None] * n for _ in streams]
        async with contextlib.aclosing(self._deltas(streams, req)) as deltas:
            async for p, d in deltas:
                c = choices[p * n + d.index]
                c["text"] += d.new_text
                c["lps"] += d.logprobs or []
                if d.finished:
                    c["finish"] = d.finish_reason
                    usages[p][d.index] = d.usage
        out = []
        for i, c in enumerate(choices):
            if chat:
                lps = (
                    {"content": oai.chat_logprobs(self.tokenizer, c["lps"])}
                    if req.logprobs
                    else None
                )
                message, finish = plan.output().message(c["text"], c["finish"])
                out.append(
                    {"index": i, "message": message, "logprobs": lps, "finish_reason": finish}
                )
            else:
                lps = (
                    oai.completion_logprobs(self.tokenizer, c["lps"], 0)
                    if req.logprobs is not None
                    else None
                )
                out.append(
                    {"index": i, "text": c["text"], "logprobs": lps, "finish_reason": c["finish"]}
                )
        obj = "chat.completion" if chat else "text_completion"
        return {**meta, "object": obj, "choices": out, "usage": oai.sum_usage(usages)}

    async def _completion_events(
        self,
        req: oai.CompletionRequest,
        streams: list[Stream],
        meta: dict[str, Any],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        n = req.n
        usages: list[list[Usage | None]] = [[None] * n for _ in streams]
        offsets = [0] * (n * len(streams))
        base = {**meta, "object": "text_completion"}
        try:
            async with contextlib.aclosing(self._deltas(streams, req)) as deltas:
                async for p, d in deltas:
                    if not (d.new_text or d.finished or d.logprobs):
                        continue
                    i = p * n + d.index
                    lps = None
                    if req.logprobs is not None:
                        lps = oai.completion_logprobs(self.tokenizer, d.logprobs or [], offsets[i])
                    offsets[i] += len(d.new_text)
                    if d.finished:
                        usages[p][d.index] = d.usage
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": i,
                                    "text": d.new_text,
                                    "logprobs": lps,
                                    "finish_reason": d.finish_reason if d.finished else None,
                                }
                            ],
                            "usage": None,
                        }
                    )
            if include_usage:
                yield _sse({**base, "choices": [], "usage": oai.sum_usage(usages)})
        except HTTPError as e:
            yield _sse(oai.error_body(e.status, e.message))
        except Exception as e:  # noqa: BLE001 - the stream ends with an error, never a cut
            logger.exception("streaming a response failed")
            yield _sse(oai.error_body(500, f"internal error: {type(e).__name__}: {e}"))
        yield "data: [DONE]\n\n"

    async def _chat_events(
        self,
        req: oai.ChatCompletionRequest,
        plan: chat_api.ChatPlan,
        streams: list[Stream],
        meta: dict[str, Any],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        n = req.n
        usages: list[list[Usage | None]] = [[None] * n for _ in streams]
        base = {**meta, "object": "chat.completion.chunk"}
        outputs = [plan.output() for _ in range(n * len(streams))]
        for i in range(n * len(streams)):
            yield _sse(
                {
                    **base,
                    "choices": [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    "usage": None,
                }
            )
        try:
            async with contextlib.aclosing(self._deltas(streams, req)) as deltas:
                async for p, d in deltas:
                    if not (d.new_text or d.finished or d.logprobs):
                        continue
                    lps = None
                    if req.logprobs:
                        lps = {"content": oai.chat_logprobs(self.tokenizer, d.logprobs or [])}
                    i = p * n + d.index
                    delta, finish = outputs[i].feed(d.new_text), None
                    if d.finished:
                        usages[p][d.index] = d.usage
                        last, finish = outputs[i].close(d.finish_reason)
                        delta = chat_api.merge(delta, last)
                    if not (delta or lps or d.finished):
                        continue
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": delta,
                                    "logprobs": lps,
                                    "finish_reason": finish,
                                }
                            ],
                            "usage": None,
                        }
                    )
            if include_usage:
                yield _sse({**base, "choices": [], "usage": oai.sum_usage(usages)})
        except HTTPError as e:
            yield _sse(oai.error_body(e.status, e.message))
        except Exception as e:  # noqa: BLE001 - the stream ends with an error, never a cut
            logger.exception("streaming a response failed")
            yield _sse(oai.error_body(500, f"internal error: {type(e).__name__}: {e}"))
        yield "data: [DONE]\n\n"


def _logprobs(req: Any, chat: bool) -> int | None:
    """SamplingParams.logprobs of a request: completions' `logprobs`; chat's `top_logprobs`
    when `logprobs` is true."""
    if not chat:
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidArgument("top_logprobs needs logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


async def _until_disconnected(request: Request) -> None:
    """Returns when the client has gone away (its body is read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
