"""`OpenAIServer`: the OpenAI-compatible HTTP API (FastAPI on uvicorn), a thin peer over a
`FrontEnd` (`frontend.py`), beside the gRPC server in the same process and on the same event loop.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both streamed as server-sent
events ending in `data: [DONE]` when `stream` is true), `GET /v1/models`, `GET /health` (200 once
warmed up, 503 before and while shutting down), `GET /metrics` (the front end's Prometheus
registry); vLLM's `/tokenize`, `/detokenize`, `/version`, `/ping` and `--api-key`
(`http_extras.py`).

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

Errors are OpenAI error objects: 400 (bad input, naming the field; an unknown field too), 401
(`--api-key` set and not sent), 404 (unknown model or route), 405 (wrong method), 413 (a
body over the front end's `max_request_bytes`, refused before it is read; `param` names the
prompt field), 429
(queue full), 503 (warming up, shutting down, engine broken), 500 (this request failed). A failure
after a stream has started is sent as a last `data: {"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

from jaxinfer.engine.output import RequestDelta, Usage
from jaxinfer.lora.request import LoRARequest
from serving import chat as chat_api
from serving import http_errors, http_extras, http_lora, http_waits, validation
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
        self.chat_options = dataclasses.replace(
            chat_options or chat_api.ChatOptions(),
            image_placeholder=frontend.vision.boi_token if frontend.vision else None,
        )
        self.host, self.port = host, port
        self.model_name = served_model_name or frontend.model.name
        frontend.metrics.vllm.bind(self.model_name)  # vLLM's `model_name` label
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
        http_extras.install(app, self)
        app.add_middleware(http_extras.ApiKey, server=self)

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
            cards = [self._model_card()] + [self._model_card(a) for a in self._loras()]
            return JSONResponse({"object": "list", "data": cards})

        @app.get("/v1/models/{model_id:path}")
        async def model(model_id: str) -> JSONResponse:
            return JSONResponse(self._model_card(self._check_model(model_id)))

        http_lora.install(app, self)

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

    def _model_card(self, lora: LoRARequest | None = None) -> dict[str, Any]:
        info = self.frontend.info
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "jaxinfer",
            "root": self.frontend.model.name,
            "max_model_len": info.capacity.max_model_len if info is not None else None,
        }
        if lora is not None:  # vLLM's adapter card: the base model is its parent
            card.update(id=lora.lora_name, root=lora.lora_path, parent=self.model_name)
        return card

    def _loras(self) -> list[LoRARequest]:
        return list(self.frontend.loras.by_name.values()) if self.frontend.loras else []

    def _check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter `name` is (None: the base model); 404 naming `model` if unknown."""
        lora = self.frontend.loras.resolve(name) if self.frontend.loras else None
        if lora is not None:
            return lora
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

    async def _handle(self, request: Request, cls: type[oai._Request], *, chat: bool) -> Response:
        try:
            self.frontend.check_admission()
        except (Unavailable, QueueFull) as e:
            raise http_error(e) from None
        req = await http_errors.parse_body(request, cls)
        lora = self._check_model(req.model)
        try:
            plan = chat_api.plan(req, self.chat_options) if chat else None
        except InvalidArgument as e:
            raise http_error(e) from None
        streams, prompt_lens = await self._admit(req, plan, lora)
        rid = req.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        meta = {"id": rid, "created": int(time.time()), "model": req.model or self.model_name}
        if req.stream:
            refused = await self._first_outputs(request, streams)
            if refused is not None:
                return refused
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
        collect = await http_waits.unless_gone(request, self._collect(req, streams, meta, plan))
        if collect is None:  # the client went away: its streams are aborted
            return Response(status_code=499)
        return JSONResponse(collect.result(), headers={"X-Request-Id": rid})

    async def _first_outputs(self, request: Request, streams: list[Stream]) -> Response | None:
        """None once every prompt has its first output or failed in the engine (the stream's
        error event); else the answer instead: 400 for a request the engine refused for what the
        client sent (a grammar failing its first mask: never a 200 with an error inside, as the
        status goes out with the first chunk), 499 when the client went away first."""
        first = await http_waits.unless_gone(
            request, asyncio.gather(*(s.wait_first_output() for s in streams))
        )
        if first is not None and not isinstance(first.exception(), InvalidArgument):
            return None  # NOTE: an exception of another kind is raised again by `_deltas`
        for s in streams:
            self.frontend.cancel(s)
        if first is None:
            return Response(status_code=499)
        return self._error(http_error(first.exception()))

    async def _admit(
        self, req: Any, plan: chat_api.ChatPlan | None, lora: LoRARequest | None = None
    ) -> tuple[list[Stream], list[int]]:
        """Tokenizes, validates and submits the request's prompts (a chat's as `plan` says);
        returns their streams."""
        chat = plan is not None
        unsupported = req.unsupported()
        if unsupported:
            raise HTTPError(400, unsupported[0], unsupported[0].split()[0])
        if self.tokenizer is None:
            raise HTTPError(400, "this server has no tokenizer")
        fe = self.frontend
        mm_inputs: list = []
        try:
            if chat:
                kwargs = validation.chat_template_kwargs(
                    {"add_generation_prompt": req.add_generation_prompt} | plan.template_kwargs,
                    "chat_template_kwargs",
                )
                if plan.images:
                    ids, mm_inputs = await fe.tokenize_images(
                        plan.messages, plan.images, field="messages", **kwargs
                    )
                    prompts = [ids]
                else:
                    prompts = [await fe.tokenize_chat(plan.messages, field="messages", **kwargs)]
                names = ["messages"]
            else:
                names = [name for name, _ in req.prompts()]
                special = req.add_special_tokens is not False
                prompts = [
                    p
                    if isinstance(p, list)
                    else await fe.tokenize(p, field=name, add_special_tokens=special)
                    for name, p in req.prompts()
                ]
            logprobs = oai.logprobs_width(req, chat)
            max_field = "max_tokens"
            asked = req.max_tokens
            echo_only = not chat and req.echo and asked == 0
            if echo_only:  # lm-evaluation-harness's loglikelihood: the prompt's logprobs alone
                asked = 1  # NOTE: the one token sampled is dropped from the response
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
                        req,
                        fields,
                        max_tokens=max_tokens,
                        logprobs=logprobs,
                        prompt_logprobs=oai.prompt_logprobs_width(req, chat),
                        **extra,
                    )
                    if plan is not None and plan.keep_special_tokens:
                        sp = dataclasses.replace(sp, skip_special_tokens=False)
                    streams.append(
                        fe.submit(
                            ids,
                            sp,
                            req.priority,
                            fields=fields,
                            cache_salt=req.cache_salt,
                            lora_request=lora,
                            mm_inputs=mm_inputs,
                        )
                    )
            except BaseException:
                for s in streams:
                    fe.cancel(s)
                raise
            return streams, [len(s.prompt_ids) for s in streams]
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
        choices = [
            {"text": "", "lps": [], "finish": None, "plps": None} for _ in range(n * len(streams))
        ]
        usages: list[list[Usage | None]] = [[None] * n for _ in streams]
        async with contextlib.aclosing(self._deltas(streams, req)) as deltas:
            async for p, d in deltas:
                c = choices[p * n + d.index]
                c["text"] += d.new_text
                c["lps"] += d.logprobs or []
                c["plps"] = d.prompt_logprobs or c["plps"]
                if d.finished:
                    c["finish"] = d.finish_reason
                    usages[p][d.index] = d.usage
        tok = None if req.return_tokens_as_token_ids else self.tokenizer
        out = []
        for i, c in enumerate(choices):
            plps = oai.prompt_logprobs(tok, c["plps"]) if req.prompt_logprobs is not None else None
            if chat:
                lps = {"content": oai.chat_logprobs(tok, c["lps"])} if req.logprobs else None
                message, finish = plan.output().message(c["text"], c["finish"])
                choice = {"index": i, "message": message, "logprobs": lps}
                out.append({**choice, "finish_reason": finish, "prompt_logprobs": plps})
                continue
            text, lps = c["text"], None
            if req.logprobs is not None:
                lps = oai.completion_logprobs(tok, c["lps"], 0)
            if req.echo:
                text, lps = self._echoed(req, i // n, streams[i // n], c["plps"], text, lps)
            choice = {"index": i, "text": text, "logprobs": lps, "finish_reason": c["finish"]}
            out.append({**choice, "prompt_logprobs": plps})
        obj = "chat.completion" if chat else "text_completion"
        return {**meta, "object": obj, "choices": out, "usage": _usage(req, usages)}

    def _echoed(
        self,
        req: oai.CompletionRequest,
        p: int,
        stream: Stream,
        plps: list | None,
        text: str,
        lps: dict[str, Any] | None,
    ) -> tuple[str, dict[str, Any] | None]:
        """(text, logprobs) of a completion choice with `echo`: the prompt (its text as sent,
        else its tokens decoded) and, with `logprobs`, its logprobs, then the output's (none
        with `max_tokens=0`, whose one sampled token is dropped)."""
        ids, given = stream.prompt_ids, req.prompts()[p][1]
        prompt = given if isinstance(given, str) and req.truncate_prompt_tokens is None else None
        if prompt is None:
            prompt = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""
        if req.max_tokens == 0:
            text, lps = "", None
        if req.logprobs is None:
            return prompt + text, None
        tok = None if req.return_tokens_as_token_ids else self.tokenizer
        head = oai.echo_logprobs(tok, ids, plps or [])
        if lps is not None:
            lps = {**lps, "text_offset": [o + len(prompt) for o in lps["text_offset"]]}
        return prompt + text, oai.joined_logprobs(head, lps)

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
        echoed = [not req.echo] * (n * len(streams))
        tok = None if req.return_tokens_as_token_ids else self.tokenizer
        base = {**meta, "object": "text_completion"}
        try:
            async with contextlib.aclosing(self._deltas(streams, req)) as deltas:
                async for p, d in deltas:
                    if not (d.new_text or d.finished or d.logprobs or d.prompt_logprobs):
                        continue
                    i = p * n + d.index
                    lps = None
                    if req.logprobs is not None:
                        lps = oai.completion_logprobs(tok, d.logprobs or [], offsets[i])
                    offsets[i] += len(d.new_text)
                    text = d.new_text
                    if not echoed[i]:  # the prompt comes first, on the sample's first chunk
                        echoed[i] = True
                        text, lps = self._echoed(req, p, streams[p], d.prompt_logprobs, text, lps)
                        offsets[i] = len(text)
                    elif req.echo and req.max_tokens == 0:
                        text, lps = "", None
                    if d.finished:
                        usages[p][d.index] = d.usage
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {
                                    "index": i,
                                    "text": text,
                                    "logprobs": lps,
                                    "finish_reason": d.finish_reason if d.finished else None,
                                }
                            ],
                            "usage": None,
                        }
                    )
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(req, usages)})
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


def _usage(req: Any, usages: list[list[Usage | None]]) -> dict[str, Any]:
    """The response's usage; `echo` with `max_tokens=0` generated nothing it returns."""
    out = oai.sum_usage(usages)
    if getattr(req, "echo", False) and req.max_tokens == 0:
        out.update(completion_tokens=0, total_tokens=out["prompt_tokens"])
    return out
