"""`GenerateServer`: the `jaxinfer.v1.GenerateService` gRPC server (grpc.aio), a thin peer over a
`FrontEnd` (`frontend.py`: engine loop, admission, limits, lifecycle, metrics); `protocol.py`
maps protos to and from the engine's types.

1. `start()` starts the front end (its core) if no peer has, then binds the port with health
   NOT_SERVING and serves health checks, reflection, `Tokenize` and `GetModelInfo` at once; when
   the front end says ready, health turns SERVING and `Generate` is admitted.
2. `Generate` parses the raw request bytes, validates them, tokenizes through the front end (off
   the event loop), submits, and streams the request's `Stream.next_batch()`es: one
   `GenerateResponse` per step, or one for every delta waiting when the client reads slower than
   the engine steps. `GenerateOnce` folds the same deltas into one message. With a
   `reasoning_parser` (`--reasoning-parser`), a chat (`messages`) request's `<think>` output goes
   to `reasoning_text`, the answer to `text`, and its structured output applies to the answer
   (`serving.reasoning`); `messages.enable_thinking` false turns that off.
3. Client cancellation or an expired deadline cancels the handler; its `finally` cancels the
   request in the front end, which frees its pages at the next step.
4. `shutdown(grace)` is the front end's: health NOT_SERVING, new requests UNAVAILABLE, in-flight
   streams finish for up to `grace` seconds, the rest are aborted (finish_reason ABORTED), then
   this server and the engine core stop.

Status codes: INVALID_ARGUMENT (message names the field), RESOURCE_EXHAUSTED (queue full, or a
message over the front end's `max_request_bytes`),
UNAVAILABLE (warming up, shutting down, engine broken), INTERNAL (this request failed; others
carry on), CANCELLED / DEADLINE_EXCEEDED (set by gRPC itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving import protocol, reasoning, validation
from serving.engine_loop import Stream
from serving.errors import InvalidArgument, QueueFull, RequestFailed, Unavailable
from serving.frontend import FrontEnd
from serving.protos.jaxinfer.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from jaxinfer.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name[
    "GenerateService"
].full_name  # jaxinfer.v1.GenerateService
RPC_SLACK = 128  # concurrent RPCs allowed beyond the sequences admitted
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GenerateServer:
    """The gRPC peer of a `FrontEnd`.

    Args:
      engine: an in-process engine: the server builds its own `FrontEnd(engine,
        **frontend_options)`. Or `frontend`: one shared with other peers (`OpenAIServer`).
        Or `model`, `core`, `max_num_seqs` among `frontend_options` (see `FrontEnd`).
      host, port: where to listen (`port=0` picks a free port; `start()` returns it).
      frontend_options: `FrontEnd`'s keyword arguments (metrics_port, max_queue, warmup,
        grace_period, trace_dir, trace_steps, log_interval; model, core, max_num_seqs).
    """

    def __init__(
        self,
        engine: LLMEngine | None = None,
        *,
        frontend: FrontEnd | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        reasoning_parser: str | None = None,
        **frontend_options: Any,
    ) -> None:
        if frontend is None:
            frontend = FrontEnd(engine, **frontend_options)
        elif engine is not None or frontend_options:
            raise ValueError("GenerateServer takes a frontend, or what to build one from")
        self.frontend = frontend
        self.host, self.port = host, port
        self.reasoning_parser = reasoning_parser
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        frontend.attach(self)

    @property
    def model_info(self) -> pb.ModelInfo:
        """What GetModelInfo answers; the engine's numbers once the core has loaded."""
        fe = self.frontend
        model, cfg, info = fe.model, fe.model.cfg, fe.info
        arch = cfg.model_type
        archs = (model.hf_config or {}).get("architectures") or []
        if archs:
            arch = f"{arch} ({archs[0]})"
        msg = pb.ModelInfo(
            name=model.name,
            architecture=arch,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(model.eos_token_ids),
            has_chat_template=bool(fe.tokenizer and fe.tokenizer.chat_template is not None),
        )
        if info is not None:
            cap = info.capacity
            msg.dtype = info.dtype
            msg.max_model_len = cap.max_model_len
            msg.mesh_shape.update(info.mesh_shape)
            msg.page_size = info.page_size
            msg.capacity.CopyFrom(
                pb.Capacity(
                    num_pages=cap.num_pages,
                    max_tokens=cap.max_tokens,
                    max_num_seqs=info.max_num_seqs,
                    max_num_batched_tokens=info.max_num_batched_tokens,
                    max_queue=fe.max_queue,
                )
            )
            msg.attention_backend = info.attention_backend
            msg.linear_backend = info.linear_backend
        return msg

    async def start(self) -> int:
        """Starts the front end (if no peer has), then listens; returns the bound port. Raises
        RuntimeError if the engine core fails to start."""
        await self.frontend.start()
        # NOTE: SO_REUSEPORT off, so a second server on a busy port fails instead of sharing it.
        # NOTE: gRPC itself bounds concurrent RPCs (RESOURCE_EXHAUSTED beyond), so requests still
        # being parsed and tokenized cannot pile up either; the slack covers health checks,
        # Tokenize and GetModelInfo.
        # NOTE: a message over the front end's body cap is RESOURCE_EXHAUSTED before it is parsed.
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", self.frontend.max_request_bytes),
            ],
            maximum_concurrent_rpcs=self.frontend.max_in_flight + RPC_SLACK,
        )
        server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        await self.set_serving(self.frontend.ready)
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        await server.start()
        self._server = server
        logger.info("gRPC %s listening on %s:%d", SERVICE_NAME, self.host, self.port)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Health SERVING / NOT_SERVING (for good once the front end drains)."""
        if self.frontend.draining:
            await self.health.enter_graceful_shutdown()
            return
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING if serving else _NOT_SERVING)

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(1.0)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """The front end's `wait_ready`: warmup done and health SERVING."""
        await self.frontend.wait_ready(timeout)

    async def shutdown(self, grace: float | None = None) -> None:
        """The front end's graceful `shutdown` (every peer, then the core)."""
        await self.frontend.shutdown(grace)

    def _handlers(self) -> grpc.GenericRpcHandler:
        # NOTE: no request deserializer: handlers parse the bytes themselves (see protocol.parse).
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._generate, response_serializer=pb.GenerateResponse.SerializeToString
            ),
            "GenerateOnce": grpc.unary_unary_rpc_method_handler(
                self._generate_once, response_serializer=pb.GenerateResponse.SerializeToString
            ),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self._tokenize, response_serializer=pb.TokenizeResponse.SerializeToString
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._get_model_info, response_serializer=pb.ModelInfo.SerializeToString
            ),
            "StartProfile": grpc.unary_unary_rpc_method_handler(
                self._start_profile, response_serializer=pb.ProfileResponse.SerializeToString
            ),
            "StopProfile": grpc.unary_unary_rpc_method_handler(
                self._stop_profile, response_serializer=pb.ProfileResponse.SerializeToString
            ),
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
    ) -> None:
        self.frontend.metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        """With `--api-key`: `authorization: Bearer KEY` metadata, else UNAUTHENTICATED (the
        health and reflection services stay open)."""
        if self.frontend.api_key is None:
            return
        auth = dict(context.invocation_metadata() or ()).get("authorization")
        if not self.frontend.authorized(auth):
            await self._reject(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid or missing API key (send metadata authorization: Bearer KEY)",
            )

    async def _encode(
        self, req: Any, *, add_special_tokens: bool = True
    ) -> tuple[str, list[int], list]:
        """(field, token ids, `ImageInput`s) of a request's `input` oneof (and a
        GenerateRequest's `images` or `image_urls`), tokenized by the front end."""
        field, value = protocol.prompt_input(req)
        kwargs = {}
        if field == "messages" and req.messages.HasField("enable_thinking"):
            kwargs["enable_thinking"] = req.messages.enable_thinking
        urls = list(getattr(req, "image_urls", ()))
        if urls and req.images:
            raise InvalidArgument("image_urls: give images or image_urls, not both", "image_urls")
        if getattr(req, "images", None) or urls:
            images = [(f"images[{k}]", data) for k, data in enumerate(req.images)]
            images += [(f"image_urls[{k}]", url) for k, url in enumerate(urls)]
            ids, mm = await self.frontend.tokenize_images(
                value, images, field=field, add_special_tokens=add_special_tokens, **kwargs
            )
            return field, ids, mm
        if field == "messages":
            return field, await self.frontend.tokenize_chat(value, field=field, **kwargs), []
        if isinstance(value, str):
            ids = await self.frontend.tokenize(
                value, field=field, add_special_tokens=add_special_tokens
            )
            return field, ids, []
        return field, value, []

    async def _admit(
        self, data: bytes, context: grpc.aio.ServicerContext, *, once: bool
    ) -> tuple[pb.GenerateRequest, Stream, bool]:
        """Parses, validates, tokenizes and submits a request; aborts the RPC when it cannot.
        The flag: its output's reasoning is split off (`serving.reasoning`)."""
        await self._authorize(context)
        code, message = grpc.StatusCode.INVALID_ARGUMENT, ""
        try:
            self.frontend.check_admission()
            req = protocol.parse(pb.GenerateRequest, data)
            if len(req.request_id) > validation.MAX_REQUEST_ID_LEN:
                raise InvalidArgument(
                    f"request_id is longer than {validation.MAX_REQUEST_ID_LEN} characters",
                    "request_id",
                )
            sp = protocol.sampling_params(req.sampling, req)
            if once and sp.n != 1:
                raise InvalidArgument(
                    f"sampling.n must be 1 for GenerateOnce (got {sp.n}); stream with Generate"
                )
            field, ids, mm_inputs = await self._encode(req)
            fields = validation.GRPC.with_(prompt=field)
            thinking = field == "messages" and self.reasoning_parser is not None
            if thinking and req.messages.HasField("enable_thinking"):
                thinking = req.messages.enable_thinking
            if thinking and sp.structured_outputs is not None:
                so, ours = reasoning.after_reasoning(sp.structured_outputs, self.reasoning_parser)
                sp = dataclasses.replace(sp, structured_outputs=so)
                renames = (("structured_outputs.grammar", validation.GRPC(ours)),)
                fields = validation.GRPC.with_(prompt=field, renames=renames)
            salt = req.cache_salt if req.HasField("cache_salt") else None
            lora = self.frontend.lora_request(req.lora_name) if req.HasField("lora_name") else None
            stream = self.frontend.submit(
                ids, sp, req.priority, fields=fields, cache_salt=salt, lora_request=lora,
                mm_inputs=mm_inputs,
            )  # fmt: skip
            return req, stream, thinking
        except ValueError as e:  # InvalidArgument, naming the field
            message = str(e)
        except QueueFull as e:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except Unavailable as e:
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        except Exception as e:  # noqa: BLE001
            logger.exception("admitting a request failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
        await self._reject(context, code, message)
        raise AssertionError("unreachable: context.abort raises")

    async def _responses(
        self,
        req: pb.GenerateRequest,
        stream: Stream,
        context: grpc.aio.ServicerContext,
        thinking: bool = False,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's responses until every sample has finished (`thinking`: each sample's
        reasoning split into `reasoning_text`); cancels it if left early."""
        unfinished = stream.n
        splitters: dict[int, reasoning.ReasoningParser] = {}
        try:
            while unfinished:
                try:
                    item = await stream.next_batch()
                except RequestFailed as e:
                    await context.abort(grpc.StatusCode.INTERNAL, str(e))
                except InvalidArgument as e:  # the core refused it (a grammar too expensive)
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
                try:
                    msg = protocol.response(item, req.request_id)
                    if thinking:
                        parser = splitters.get(item.index)
                        if parser is None:
                            parser = reasoning.REASONING_PARSERS[self.reasoning_parser]()
                            splitters[item.index] = parser
                        think, msg.text = parser.stream(item.new_text)
                        if item.finished:
                            more, rest = parser.finish()
                            think, msg.text = think + more, msg.text + rest
                        msg.reasoning_text = think
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    logger.exception("building a response for %s failed", stream.engine_id)
                    why = f"internal error: {type(e).__name__}: {e}"
                    self.frontend.fail(stream, why)
                    await context.abort(grpc.StatusCode.INTERNAL, why)
                unfinished -= bool(item.finished)
                yield msg
        finally:
            if unfinished:  # cancelled, deadline, failure, or the server stopping
                self.frontend.cancel(stream)

    async def _generate(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        req, stream, thinking = await self._admit(data, context, once=False)
        responses = self._responses(req, stream, context, thinking)
        async with contextlib.aclosing(responses) as responses:
            async for msg in responses:
                yield msg

    async def _generate_once(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        req, stream, thinking = await self._admit(data, context, once=True)
        total = pb.GenerateResponse(request_id=req.request_id)
        responses = self._responses(req, stream, context, thinking)
        async with contextlib.aclosing(responses) as responses:
            async for msg in responses:
                protocol.merge(total, msg)
        return total

    async def _tokenize(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        await self._authorize(context)
        tokenizer = self.frontend.tokenizer
        try:
            req = protocol.parse(pb.TokenizeRequest, data)
            add = req.add_special_tokens if req.HasField("add_special_tokens") else True
            if tokenizer is None:
                raise InvalidArgument(
                    "Tokenize needs a tokenizer; the server runs with --skip-tokenizer-init"
                )
            _, ids, _ = await self._encode(req, add_special_tokens=add)
            pieces = [tokenizer.id_to_piece(i) for i in ids]
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Exception as e:  # noqa: BLE001 - an error status, never gRPC's bare "Unexpected"
            logger.exception("Tokenize failed")
            why = f"internal error: {type(e).__name__}: {e}"
            await self._reject(context, grpc.StatusCode.INTERNAL, why)
        return pb.TokenizeResponse(token_ids=ids, tokens=pieces)

    async def _get_model_info(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._authorize(context)
        return self.model_info

    async def _start_profile(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._profile(True, context)

    async def _stop_profile(self, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        return await self._profile(False, context)

    async def _profile(self, start: bool, context: grpc.aio.ServicerContext) -> Any:
        """HTTP's /start_profile and /stop_profile (`FrontEnd.profile`)."""
        if self.frontend.trace_dir is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "profiling is off: start with --trace-dir"
            )
        self.frontend.profile(start)
        return pb.ProfileResponse(trace_dir=self.frontend.trace_dir)
