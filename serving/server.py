"""`GenerateServer`: the `jaxinfer.v1.GenerateService` gRPC server (grpc.aio), the front end of
one engine core (in its own process, or on a thread of this one).

A thin translation layer (see `engine_loop.py` for the front end's half of the engine and
`protocol.py` for the proto <-> engine mapping):

1. `start()` binds the port with health NOT_SERVING, starts serving health checks, reflection,
   `Tokenize` and `GetModelInfo` at once, and starts the engine core, which compiles every
   program; when it says ready, health turns SERVING and `Generate` is admitted.
2. `Generate` parses the raw request bytes, validates them, tokenizes off the event loop, submits
   to the engine loop and streams the request's deltas from its queue: one `GenerateResponse`
   per step, or one for every delta waiting when the client reads slower than the engine steps.
   `GenerateOnce` folds the same deltas into one message.
3. Client cancellation or an expired deadline cancels the handler; its `finally` aborts the
   request in the engine, which frees its pages at the next step.
4. `shutdown(grace)` (SIGTERM / SIGINT in `scripts/serve.py`): health NOT_SERVING, new requests
   UNAVAILABLE, in-flight streams finish for up to `grace` seconds; whatever is left is aborted
   (streams end with finish_reason ABORTED), then the server and the engine core stop.

Status codes: INVALID_ARGUMENT (message names the field), RESOURCE_EXHAUSTED (queue full),
UNAVAILABLE (warming up, shutting down, engine broken), INTERNAL (this request failed; others
carry on), CANCELLED / DEADLINE_EXCEEDED (set by gRPC itself).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from jaxinfer.engine.core_client import LoopOptions
from jaxinfer.engine.core_loop import ThreadCoreClient
from jaxinfer.engine.types import EngineLimits
from jaxinfer.sampling_params import SamplingParams
from serving import protocol
from serving.engine_loop import EngineLoop, EngineUnavailable, Failure, QueueFull, Stream
from serving.metrics import ServerMetrics
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
    """The gRPC front end of one engine.

    Args:
      engine: an in-process engine; its core then runs on a thread of this process (warmed up
        there when `warmup`). Or, instead:
      model, core, max_num_seqs: the served model's name/config/tokenizer (no params needed), a
        not yet started core client (`ProcessCoreClient`: the core in its own process), and the
        core's batch size.
      host, port: where to listen (`port=0` picks a free port; `start()` returns it).
      metrics_port: Prometheus `/metrics` HTTP port (0: a free one; None: no metrics server).
      max_queue: sequences admitted beyond `max_num_seqs` before RESOURCE_EXHAUSTED.
      grace_period: seconds `shutdown()` lets in-flight streams finish.
      trace_dir, trace_steps: (with `engine`) a JAX profiler trace of the first busy steps.
      log_interval: seconds between load log lines (only while there is load).
      http_port: also serve the OpenAI-compatible HTTP API (`serving.http_server`) over the same
        engine on this port (0: a free one; None: no HTTP API); `http_host` defaults to `host`.
      served_model_name: the model id HTTP clients name (default: the checkpoint's name).
    """

    def __init__(
        self,
        engine: LLMEngine | None = None,
        *,
        model: Any = None,
        core: Any = None,
        max_num_seqs: int | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        max_queue: int = 256,
        warmup: bool = True,
        grace_period: float = 30.0,
        trace_dir: str | None = None,
        trace_steps: int = 0,
        log_interval: float = 1.0,
        http_port: int | None = None,
        http_host: str | None = None,
        served_model_name: str | None = None,
    ) -> None:
        if engine is not None:  # the core on a thread of this process
            model, max_num_seqs = engine.model, engine.config.max_num_seqs
            core = ThreadCoreClient(
                engine.core,
                LoopOptions(warmup=warmup, trace_dir=trace_dir, trace_steps=trace_steps),
            )
        if model is None or core is None or max_num_seqs is None:
            raise ValueError("GenerateServer needs an engine, or model + core + max_num_seqs")
        self.engine, self.model, self.tokenizer = engine, model, model.tokenizer
        self.host, self.port, self.metrics_port = host, port, metrics_port
        self.grace_period, self.log_interval = grace_period, log_interval
        self.max_queue = max_queue
        self.http_host, self.http_port = http_host or host, http_port
        self.served_model_name = served_model_name
        self.http: Any = None  # the OpenAIServer, once started
        self.metrics = ServerMetrics()
        self.engine_loop = EngineLoop(
            core,
            self.tokenizer,
            self.metrics,
            max_num_seqs=max_num_seqs,
            max_queue=max_queue,
            eos_token_ids=model.eos_token_ids,
        )
        self.vocab_size = model.cfg.vocab_size
        if self.tokenizer is not None:
            self.vocab_size = min(self.vocab_size, self.tokenizer.vocab_size)
        self.model_info = self._model_info()
        self.health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Event | None = None
        self._draining = False
        self._shutdown_task: asyncio.Task | None = None
        self._stopped: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []

    def _model_info(self) -> pb.ModelInfo:
        """What GetModelInfo answers; the engine's numbers are filled in once the core is ready."""
        cfg, info = self.model.cfg, self.engine_loop.info
        arch = cfg.model_type
        archs = (self.model.hf_config or {}).get("architectures") or []
        if archs:
            arch = f"{arch} ({archs[0]})"
        msg = pb.ModelInfo(
            name=self.model.name,
            architecture=arch,
            vocab_size=cfg.vocab_size,
            eos_token_ids=list(self.model.eos_token_ids),
            has_chat_template=bool(self.tokenizer and self.tokenizer.chat_template is not None),
        )
        if info:
            cap = info["capacity"]
            msg.dtype = info["dtype"]
            msg.max_model_len = cap["max_model_len"]
            msg.mesh_shape.update(info["mesh_shape"])
            msg.page_size = info["page_size"]
            msg.capacity.CopyFrom(
                pb.Capacity(
                    num_pages=cap["num_pages"],
                    max_tokens=cap["max_tokens"],
                    max_num_seqs=info["max_num_seqs"],
                    max_num_batched_tokens=info["max_num_batched_tokens"],
                    max_queue=self.max_queue,
                )
            )
            msg.attention_backend = info["attention_backend"]
            msg.linear_backend = info["linear_backend"]
        return msg

    @property
    def ready(self) -> bool:
        return self.engine_loop.running and not self._draining

    async def start(self) -> int:
        """Starts the engine core, and once its model is loaded listens (health NOT_SERVING until
        its warmup is done); returns the bound port. Raises RuntimeError if the core fails to
        start."""
        self._loop = asyncio.get_running_loop()
        self._ready, self._stopped = asyncio.Event(), asyncio.Event()
        self.engine_loop.on_ready = self._on_ready
        self.engine_loop.on_broken = self._on_broken
        self.engine_loop.start(self._loop)
        try:
            await self.engine_loop.wait_loaded()  # a model that cannot load: no port is bound
        except RuntimeError:
            await asyncio.to_thread(self.engine_loop.stop)
            raise
        if self.tokenizer is not None:
            self.tokenizer.warm()  # chat template compiled before the first chat request
        # NOTE: SO_REUSEPORT off, so a second server on a busy port fails instead of sharing it.
        # NOTE: gRPC itself bounds concurrent RPCs (RESOURCE_EXHAUSTED beyond), so requests still
        # being parsed and tokenized cannot pile up either; the slack covers health checks,
        # Tokenize and GetModelInfo.
        server = grpc.aio.server(
            options=[("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=self.engine_loop.max_in_flight + RPC_SLACK,
        )
        server.add_generic_rpc_handlers((self._handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _NOT_SERVING)
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        await server.start()
        self._server = server
        if self.http_port is not None:
            from serving.http_server import OpenAIServer

            self.http = OpenAIServer(
                self,
                host=self.http_host,
                port=self.http_port,
                served_model_name=self.served_model_name,
            )
            self.http_port = await self.http.start()
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(self.metrics_port)
        self._tasks.append(self._loop.create_task(self._log_load()))
        logger.info(
            "gRPC %s listening on %s:%d%s",
            SERVICE_NAME,
            self.host,
            self.port,
            f", metrics on :{self.metrics_port}/metrics" if self.metrics_port else "",
        )
        return self.port

    def _on_ready(self, programs: int) -> None:
        assert self._loop is not None and self._ready is not None
        self.model_info = self._model_info()
        self.metrics.ready.set(1)

        async def serving() -> None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, _SERVING)  # ignored once shutting down
            self._ready.set()

        self._tasks.append(self._loop.create_task(serving()))

    def _on_broken(self, why: str) -> None:
        assert self._loop is not None
        self.metrics.ready.set(0)

        async def not_serving() -> None:
            for name in ("", SERVICE_NAME):
                await self.health.set(name, _NOT_SERVING)

        self._tasks.append(self._loop.create_task(not_serving()))

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until warmup is done and health is SERVING (raises RuntimeError if it failed)."""
        assert self._ready is not None, "call start() first"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self.engine_loop.broken is not None:
                raise RuntimeError(f"the engine did not start: {self.engine_loop.broken}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready in time")
            await asyncio.sleep(0.05)

    def request_shutdown(self, grace: float | None = None) -> asyncio.Task:
        """Starts `shutdown` once (later calls return the same task); call on the event loop."""
        assert self._loop is not None
        if self._shutdown_task is None:
            self._shutdown_task = self._loop.create_task(self._shutdown(grace))
        return self._shutdown_task

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT: graceful shutdown; a second signal aborts what is still running."""
        assert self._loop is not None

        def on_signal(sig: signal.Signals) -> None:
            if self._shutdown_task is None:
                logger.info("%s: shutting down (grace period %.0fs)", sig.name, self.grace_period)
                self.request_shutdown()
            else:
                logger.warning("%s again: aborting in-flight requests now", sig.name)
                self.engine_loop.abort_all()

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, on_signal, sig)

    async def shutdown(self, grace: float | None = None) -> None:
        """Stops admitting, lets in-flight streams finish for `grace` s, aborts the rest, stops.

        Idempotent: a second call waits for the first shutdown to complete.
        """
        await self.request_shutdown(grace)

    async def _shutdown(self, grace: float | None) -> None:
        grace = self.grace_period if grace is None else grace
        self._draining = True
        await self.health.enter_graceful_shutdown()
        self.metrics.ready.set(0)
        left = self.engine_loop.in_flight
        if left:
            logger.info("draining %d in-flight sequences (up to %.0fs)", left, grace)
        if not await self.engine_loop.wait_idle(grace):
            logger.warning("grace period over: aborting %d sequences", self.engine_loop.in_flight)
            self.engine_loop.abort_all()
            await self.engine_loop.wait_idle(5.0)
        if self.http is not None:
            await self.http.stop()
        if self._server is not None:
            await self._server.stop(1.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.to_thread(self.engine_loop.stop)
        self.metrics.stop_http()
        logger.info("server stopped")
        if self._stopped is not None:
            self._stopped.set()

    async def wait_for_termination(self) -> None:
        assert self._stopped is not None, "call start() first"
        await self._stopped.wait()

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
        }
        return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)

    async def _reject(
        self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
    ) -> None:
        self.metrics.rejected.labels(code.name).inc()
        await context.abort(code, message)

    def check_admission(self) -> None:
        """Raises EngineUnavailable / QueueFull when no request can be admitted now (checked
        before any parsing; both protocols call it)."""
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        if not self.engine_loop.running:
            raise EngineUnavailable(
                self.engine_loop.broken or "the server is warming up (compiling); retry shortly"
            )
        if self.engine_loop.in_flight >= self.engine_loop.max_in_flight:
            raise QueueFull(
                f"the server is full ({self.engine_loop.in_flight} sequences in "
                f"flight, at most {self.engine_loop.max_in_flight}); retry later"
            )

    def submit(
        self,
        ids: list[int],
        sp: SamplingParams,
        priority: int,
        *,
        field: str,
        max_tokens_field: str = "sampling.max_tokens",
    ) -> Stream:
        """Checks a tokenized prompt against the engine's limits and admits it (event loop).

        Raises InvalidArgument (naming `field` / `max_tokens_field`), QueueFull, EngineUnavailable.
        """
        if self.tokenizer is None and sp.stop:
            prefix = max_tokens_field.rpartition(".")[0]  # "sampling" (gRPC) or "" (HTTP)
            raise protocol.InvalidArgument(
                f"{prefix + '.' if prefix else ''}stop: stop strings need a tokenizer and the "
                f"server runs with --skip-tokenizer-init; use stop_token_ids"
            )
        limits = self.limits()
        protocol.check_prompt(ids, field, sp, limits, max_tokens_field=max_tokens_field)
        if self._draining:
            raise EngineUnavailable("the server is shutting down")
        return self.engine_loop.submit(ids, sp, priority)

    def limits(self) -> EngineLimits:
        """The engine's prompt limits, the vocabulary capped at the tokenizer's."""
        limits = self.engine_loop.limits
        if limits is None:
            raise EngineUnavailable("the engine is not running")
        return dataclasses.replace(limits, vocab_size=min(limits.vocab_size, self.vocab_size))

    async def _admit(
        self, data: bytes, context: grpc.aio.ServicerContext, *, once: bool
    ) -> tuple[pb.GenerateRequest, Stream]:
        """Parses, validates, tokenizes and submits a request; aborts the RPC when it cannot."""
        code, message = grpc.StatusCode.INVALID_ARGUMENT, ""
        try:
            self.check_admission()
            req = protocol.parse(pb.GenerateRequest, data)
            if len(req.request_id) > protocol.MAX_REQUEST_ID_LEN:
                raise protocol.InvalidArgument(
                    f"request_id is longer than {protocol.MAX_REQUEST_ID_LEN} characters"
                )
            sp = protocol.sampling_params(req.sampling)
            if once and sp.n != 1:
                raise protocol.InvalidArgument(
                    f"sampling.n must be 1 for GenerateOnce (got {sp.n}); stream with Generate"
                )
            ids = await asyncio.to_thread(protocol.encode_input, self.tokenizer, req)
            return req, self.submit(ids, sp, req.priority, field=protocol.prompt_field(req))
        except ValueError as e:  # InvalidArgument, and the engine's own checks
            message = protocol.proto_field_names(str(e))
        except QueueFull as e:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except EngineUnavailable as e:
            code, message = grpc.StatusCode.UNAVAILABLE, str(e)
        except Exception as e:  # noqa: BLE001
            logger.exception("admitting a request failed")
            code, message = grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}"
        await self._reject(context, code, message)
        raise AssertionError("unreachable: context.abort raises")

    async def _responses(
        self, req: pb.GenerateRequest, stream: Stream, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The request's responses until every sample has finished; aborts it if left early."""
        unfinished = stream.n
        try:
            while unfinished:
                item = await stream.queue.get()
                if isinstance(item, Failure):
                    await context.abort(item.code, item.message)
                # A client behind the engine gets the deltas waiting for it in one message.
                while not item.finished and not stream.queue.empty():
                    nxt = stream.queue._queue[0]  # noqa: SLF001 - peek: a Failure is not merged
                    if isinstance(nxt, Failure) or nxt.index != item.index:
                        break
                    item.merge(stream.queue.get_nowait())
                try:
                    msg = protocol.response(item, req.request_id)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    logger.exception("building a response for %s failed", stream.engine_id)
                    why = f"internal error: {type(e).__name__}: {e}"
                    self.engine_loop.fail_request(stream, why)
                    await context.abort(grpc.StatusCode.INTERNAL, why)
                unfinished -= bool(item.finished)
                yield msg
        finally:
            if unfinished:  # cancelled, deadline, failure, or the server stopping
                self.engine_loop.cancel(stream)

    async def _generate(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        req, stream = await self._admit(data, context, once=False)
        async with contextlib.aclosing(self._responses(req, stream, context)) as responses:
            async for msg in responses:
                yield msg

    async def _generate_once(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> pb.GenerateResponse:
        req, stream = await self._admit(data, context, once=True)
        total = pb.GenerateResponse(request_id=req.request_id)
        async with contextlib.aclosing(self._responses(req, stream, context)) as responses:
            async for msg in responses:
                protocol.merge(total, msg)
        return total

    async def _tokenize(
        self, data: bytes, context: grpc.aio.ServicerContext
    ) -> pb.TokenizeResponse:
        try:
            req = protocol.parse(pb.TokenizeRequest, data)
            add = req.add_special_tokens if req.HasField("add_special_tokens") else True
            if self.tokenizer is None:
                raise protocol.InvalidArgument(
                    "Tokenize needs a tokenizer; the server runs with --skip-tokenizer-init"
                )
            ids = await asyncio.to_thread(
                protocol.encode_input, self.tokenizer, req, add_special_tokens=add
            )
            pieces = [self.tokenizer.id_to_piece(i) for i in ids]
        except ValueError as e:
            await self._reject(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return pb.TokenizeResponse(token_ids=ids, tokens=pieces)

    async def _get_model_info(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        return self.model_info

    async def _log_load(self) -> None:
        """One line per `log_interval` while there is load; keeps the throughput gauge current."""
        window: collections.deque[tuple[float, int]] = collections.deque(maxlen=6)
        while True:
            await asyncio.sleep(self.log_interval)
            usable = self.engine_loop.info.get("capacity", {}).get("num_pages", 0)
            snap = self.engine_loop.snapshot()
            now = time.perf_counter()
            window.append((now, snap["generated"]))
            (t0, g0), (t1, g1) = window[0], window[-1]
            rate = (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0
            self.metrics.throughput.set(rate)
            recent = g1 - (window[-2][1] if len(window) > 1 else g1)
            if snap["in_flight"] or snap["running"] or snap["waiting"] or recent:
                hit = self.metrics.hit_rate
                logger.info(
                    "running %d, waiting %d, in flight %d/%d | %.1f tok/s | KV %d/%d pages "
                    "(%.0f%%) | prefix hit %.0f%%",
                    snap["running"],
                    snap["waiting"],
                    snap["in_flight"],
                    self.engine_loop.max_in_flight,
                    rate,
                    snap["pages_used"],
                    usable,
                    100 * snap["pages_used"] / max(usable, 1),
                    100 * hit,
                )
