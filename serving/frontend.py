"""`FrontEnd`: the protocol-neutral front end of one engine core. The gRPC server (`server.py`)
and the OpenAI-compatible HTTP API (`http_server.py`) are thin peers over one `FrontEnd`, in one
process and on one event loop; neither knows the other.

1. `FrontEnd(engine)` runs the engine's core on a thread of this process (warmed up there when
   `warmup`); `FrontEnd(model=..., core=..., max_num_seqs=...)` drives a core client (the core
   in its own process: `scripts/serve.py`). Protocol servers `attach` themselves.
2. `start()` (idempotent) starts the core and waits until its model is loaded (a model that
   cannot load raises RuntimeError: no port is bound), compiles the chat template, serves
   Prometheus `/metrics` and logs the load; the peers then bind their ports. When the core says
   ready (warmup done), every peer is told to serve (`set_serving(True)`) and `wait_ready()`
   returns; "broken" tells them to stop serving.
3. A request: the peer calls `check_admission()` before parsing (a cheap refusal; bodies over
   `max_request_bytes` are refused before they are read), tokenizes with `tokenize` /
   `tokenize_chat` (off the event loop; text over `max_prompt_chars` is refused first, untokenized;
   long texts are encoded without holding the GIL), then `submit(ids, sp, priority, fields=...)`:
   the one request check (`validation.check_request`) and the admission bound, then the engine loop
   (`engine_loop.py`). It reads the returned stream with `Stream.next_batch()` until every sample
   has finished, and calls `cancel(stream)` when it leaves early (client gone, deadline).
4. `shutdown(grace)` (SIGTERM / SIGINT with `install_signal_handlers`): new requests
   Unavailable, peers told to stop serving, in-flight streams finish for up to `grace` seconds,
   whatever is left is aborted (finish reason abort), then the peers and the core stop.
5. The engine core's process exits unasked (killed, crashed): in-flight streams fail with "the
   engine failed: the engine core process exited (code -9)", then `shutdown(0)` stops the peers
   and `exit_code` is 1 (`scripts/serve.py` exits with it, well within 2 s of the death).

Errors (`serving/errors.py`) each protocol maps to its own code: InvalidArgument, QueueFull,
Unavailable, RequestFailed. Admission is bounded: at most `max_num_seqs + max_queue` sequences (a
request counts `n`) are in flight.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hmac
import logging
import signal
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from jaxinfer.engine.core_client import LoopOptions
from jaxinfer.engine.limits import EngineLimits
from jaxinfer.engine.types import EngineInfo
from jaxinfer.lora.request import LoRARequest
from jaxinfer.sampling_params import FieldError, SamplingParams
from jaxinfer.vision.inputs import ImageInput
from jaxinfer.vision.processor import ImageError, load_image, vision_spec, with_images
from serving.engine_loop import EngineLoop, Stream
from serving.errors import InvalidArgument, QueueFull, Unavailable
from serving.images import ImageFetcher
from serving.metrics import ServerMetrics
from serving.validation import GRPC, Fields, check_request

if TYPE_CHECKING:
    from jaxinfer.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy names
MIN_PIECE_CHARS = 16  # the character cap assumes at least this many characters per token
MIN_REQUEST_BYTES = 4 << 20  # the default body cap's floor (gRPC's own default message cap)
REQUEST_BYTES_PER_TOKEN = 128  # the default body cap per max_model_len token


def default_max_request_bytes(max_model_len: int | None) -> int:
    """`--max-request-bytes`' default: 128 bytes per token of context (~8x a prompt's text or
    JSON token ids), at least 4 MiB."""
    return max(MIN_REQUEST_BYTES, REQUEST_BYTES_PER_TOKEN * (max_model_len or 0))


def longest_piece(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest piece (a token never stands for more text)."""
    longest = MIN_PIECE_CHARS
    for i in range(tokenizer.vocab_size):
        try:
            longest = max(longest, len(tokenizer.id_to_piece(i)))
        except ValueError:  # an id without a vocabulary entry
            continue
    return longest


def _text_chars(value: Any) -> int:
    """Characters of every string in a chat (contents, parts, names), counted before rendering."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v) for v in value)
    return 0


class Peer(Protocol):
    """A protocol server over a `FrontEnd` (gRPC, HTTP)."""

    async def set_serving(self, serving: bool) -> None:
        """Ready (True), or broken / shutting down (False: `FrontEnd.draining` says which)."""

    async def stop(self) -> None:
        """Stops listening (after the drain)."""


class FrontEnd:
    """The front end of one engine core (see the module docstring).

    Args:
      engine: an in-process engine; its core then runs on a thread of this process (warmed up
        there when `warmup`). Or, instead:
      model, core, max_num_seqs: the served model's name/config/tokenizer (no params needed), a
        not yet started core client (`ProcessCoreClient`: the core in its own process), and the
        core's batch size.
      metrics_port: Prometheus `/metrics` HTTP port (0: a free one; None: no metrics server).
      max_queue: sequences admitted beyond `max_num_seqs` before QueueFull.
      grace_period: seconds `shutdown()` lets in-flight streams finish.
      trace_dir, trace_steps: (with `engine`) a JAX profiler trace of the first busy steps.
      log_interval: seconds between load log lines (only while there is load).
      max_request_bytes: the largest request body (HTTP) / message (gRPC) read; None: the
        default for the model's context (`default_max_request_bytes`).
    """

    def __init__(
        self,
        engine: LLMEngine | None = None,
        *,
        model: Any = None,
        core: Any = None,
        max_num_seqs: int | None = None,
        metrics_port: int | None = None,
        max_queue: int = 256,
        warmup: bool = True,
        grace_period: float = 30.0,
        trace_dir: str | None = None,
        trace_steps: int = 0,
        log_interval: float = 1.0,
        max_request_bytes: int | None = None,
        scheduling_policy: str = "fcfs",
        api_key: str | None = None,
        limit_mm_per_prompt: dict[str, int] | None = None,
        media: Any = None,  # image URL rules (`MediaConnector`): see `serving.images`
    ) -> None:
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {scheduling_policy!r}"
            )
        self.scheduling_policy = scheduling_policy
        self.api_key = api_key  # both peers require it as a Bearer token when set
        self.loras: Any = None  # serving.lora_adapters.LoRAAdapters with --enable-lora
        if engine is not None:  # the core on a thread of this process (it has imported JAX)
            from jaxinfer.engine.core_loop import ThreadCoreClient

            model, max_num_seqs = engine.model, engine.config.max_num_seqs
            core = ThreadCoreClient(
                engine.core,
                LoopOptions(warmup=warmup, trace_dir=trace_dir, trace_steps=trace_steps),
            )
        if model is None or core is None or max_num_seqs is None:
            raise ValueError("FrontEnd needs an engine, or model + core + max_num_seqs")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_request_bytes is not None and max_request_bytes <= 0:
            raise ValueError(f"max_request_bytes must be > 0, got {max_request_bytes}")
        self._max_request_bytes = max_request_bytes
        self._piece_chars = MIN_PIECE_CHARS
        self.engine, self.model, self.tokenizer = engine, model, model.tokenizer
        self.metrics, self.metrics_port = ServerMetrics(model.name), metrics_port
        self.max_queue, self.max_in_flight = max_queue, max_num_seqs + max_queue
        self.grace_period, self.log_interval = grace_period, log_interval
        self.engine_loop = EngineLoop(
            core, self.tokenizer, self.metrics, eos_token_ids=model.eos_token_ids
        )
        self.vocab_size = model.cfg.vocab_size
        # A vision-language model's image spec (None: it takes no images) and per-prompt limits.
        self.vision = vision_spec(getattr(model, "path", ""), getattr(model, "hf_config", {}) or {})
        self.limit_mm_per_prompt, self.images = dict(limit_mm_per_prompt or {}), ImageFetcher(media)
        if self.tokenizer is not None:
            self.vocab_size = min(self.vocab_size, self.tokenizer.vocab_size)
        self.peers: list[Peer] = []
        self.draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._stopped = asyncio.Event()
        self._shutdown_task: asyncio.Task | None = None
        self._tasks: list[asyncio.Task] = []
        self.exit_code = 0  # 1 once the engine core's process died under us

    @property
    def info(self) -> EngineInfo | None:
        """The core's facts (capacity, limits, mesh, backends): None until it has loaded."""
        return self.engine_loop.info

    @property
    def trace_dir(self) -> str | None:
        """Where on-demand profiler traces go (`--trace-dir`); None: profiling is off and
        `/start_profile` / `/stop_profile` do not exist."""
        options = getattr(self.engine_loop.client, "options", None)
        return None if options is None else options.trace_dir

    def profile(self, start: bool) -> None:
        """Starts (`start`) or stops a profiler trace of the engine core into `trace_dir`; the
        core writes it off its engine thread and logs the path."""
        if self.trace_dir is None:
            raise RuntimeError("profiling is off (start the server with --trace-dir)")
        self.engine_loop.profile(start)

    def unload_lora(self, name: str) -> Any:
        """Unloads a served adapter (`/v1/unload_lora_adapter`): new requests naming it are
        refused at once; the core frees its slot once the requests running under it end. Returns
        its `LoRARequest`; LoRAError naming `lora_name` when no adapter has that name."""
        lora = self.loras.remove(name)
        self.engine_loop.remove_lora(lora.lora_int_id)
        return lora

    @property
    def compiled_programs(self) -> int:
        return self.engine_loop.compiled_programs

    @property
    def in_flight(self) -> int:
        return self.engine_loop.in_flight

    @property
    def broken(self) -> str | None:
        return self.engine_loop.broken

    @property
    def ready(self) -> bool:
        """Warmed up and admitting (not broken, not shutting down)."""
        return self.engine_loop.running and not self.draining

    def attach(self, peer: Peer) -> None:
        """Adds a protocol server: told when to serve, stopped by `shutdown`."""
        self.peers.append(peer)

    async def start(self) -> None:
        """Starts the core and waits until its model is loaded (the first call; later calls wait
        for the same start). Raises RuntimeError if the core fails to start."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._started)

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
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
            self._piece_chars = await asyncio.to_thread(longest_piece, self.tokenizer)
        if self.metrics_port is not None:
            self.metrics_port = self.metrics.start_http(self.metrics_port)
            logger.info("metrics on :%d/metrics", self.metrics_port)
        self._tasks.append(self._loop.create_task(self._log_load()))

    def _on_ready(self, programs: int) -> None:
        assert self._loop is not None
        self.metrics.ready.set(1)

        async def serving() -> None:
            await self._tell_peers(True)  # ignored by a peer once shutting down
            self._ready.set()

        self._tasks.append(self._loop.create_task(serving()))

    def _on_broken(self, why: str, exited: bool) -> None:
        assert self._loop is not None
        self.metrics.ready.set(0)
        self._tasks.append(self._loop.create_task(self._tell_peers(False)))
        started = self._started is not None and self._started.done()
        if exited and started:  # before that, `start()` raises instead
            logger.error("the engine core is gone (%s): shutting down, exit code 1", why)
            self.exit_code = 1
            self.request_shutdown(0)

    async def _tell_peers(self, serving: bool) -> None:
        for peer in self.peers:
            await peer.set_serving(serving)

    async def wait_ready(self, timeout: float | None = None) -> None:
        """Waits until warmup is done and the peers serve (raises RuntimeError if it failed)."""
        assert self._started is not None, "call start() first"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.is_set():
            if self.broken is not None:
                raise RuntimeError(f"the engine did not start: {self.broken}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready in time")
            await asyncio.sleep(0.05)

    def request_shutdown(self, grace: float | None = None) -> asyncio.Task:
        """Starts `shutdown` once (later calls return the same task); call on the event loop."""
        if self._shutdown_task is None:
            loop = asyncio.get_running_loop()
            self._shutdown_task = loop.create_task(self._shutdown(grace))
        return self._shutdown_task

    def install_signal_handlers(self) -> None:
        """SIGTERM / SIGINT: graceful shutdown; a second signal aborts what is still running."""
        assert self._loop is not None, "call start() first"

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
        """Stops admitting, lets in-flight streams finish for `grace` s, aborts the rest, stops
        the peers and the core. Idempotent: a second call waits for the first to complete."""
        await self.request_shutdown(grace)

    async def _shutdown(self, grace: float | None) -> None:
        grace = self.grace_period if grace is None else grace
        self.draining = True
        self.metrics.ready.set(0)
        await self._tell_peers(False)
        left = self.in_flight
        if left:
            logger.info("draining %d in-flight sequences (up to %.0fs)", left, grace)
        if not await self.engine_loop.wait_idle(grace):
            logger.warning("grace period over: aborting %d sequences", self.in_flight)
            self.engine_loop.abort_all()
            await self.engine_loop.wait_idle(5.0)
        for peer in reversed(self.peers):
            await peer.stop()
        for task in self._tasks:
            task.cancel()
        await asyncio.to_thread(self.engine_loop.stop)
        self.metrics.stop_http()
        logger.info("server stopped")
        self._stopped.set()

    async def wait_for_termination(self) -> None:
        await self._stopped.wait()

    def check_admission(self, n: int = 1) -> None:
        """Raises Unavailable / QueueFull when a request of `n` sequences cannot be admitted now
        (each peer calls it before parsing; `submit` again before admitting)."""
        if self.draining:
            raise Unavailable("the server is shutting down")
        if not self.engine_loop.running:
            raise Unavailable(self.broken or "the server is warming up (compiling); retry shortly")
        if self.in_flight + n > self.max_in_flight:
            raise QueueFull(
                f"the server is full ({self.in_flight} sequences in flight, at most "
                f"{self.max_in_flight}); retry later"
            )

    def limits(self) -> EngineLimits:
        """The engine's prompt limits, the vocabulary capped at the tokenizer's."""
        limits = self.engine_loop.limits
        if limits is None:
            raise Unavailable("the engine is not running")
        return dataclasses.replace(limits, vocab_size=min(limits.vocab_size, self.vocab_size))

    def room(self, prompt_len: int) -> int:
        """The most tokens a prompt of `prompt_len` tokens can generate (context and KV cache)."""
        limits = self.limits()
        return min(
            limits.max_model_len - prompt_len,
            limits.num_pages * limits.page_size - prompt_len + 1,
        )

    async def tokenize(
        self, text: str, *, field: str, add_special_tokens: bool = True
    ) -> list[int]:
        """Token ids of a text, tokenized off the event loop (InvalidArgument naming `field`)."""
        self._need_tokenizer(field)
        if not text:
            raise InvalidArgument(f"{field} is empty", field)
        self._check_chars(len(text), field)
        return await asyncio.to_thread(
            self.tokenizer.encode, text, add_special_tokens=add_special_tokens
        )

    async def tokenize_chat(
        self, messages: list[dict[str, Any]], *, field: str, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of a chat rendered with the checkpoint's template plus the generation prompt
        (unless `add_generation_prompt=False` is among `template_kwargs`), off the event loop
        (InvalidArgument naming `field`)."""
        self._need_tokenizer(field)
        self._check_chars(_text_chars(messages), field)

        def render() -> list[int]:
            try:
                return self.tokenizer.encode_chat(
                    messages, **{"add_generation_prompt": True, **template_kwargs}
                )
            except ValueError as e:  # TokenizerError: no template, or the template raised
                raise InvalidArgument(f"{field}: {e}", field) from None

        return await asyncio.to_thread(render)

    async def tokenize_images(
        self,
        prompt: str | list[int] | list[dict[str, Any]],
        images: list[tuple[str, Any]],
        *,
        field: str,
        add_special_tokens: bool = True,
        **template_kwargs: Any,
    ) -> tuple[list[int], list[ImageInput]]:
        """Token ids and `ImageInput`s of a prompt with images ((field, data URL or encoded
        bytes) each): text (one placeholder per image), token ids already holding each image's
        soft-token run, or chat messages (rendered with `template_kwargs`, see `serving.images`);
        images decoded and resized off the event loop. InvalidArgument naming the image's field
        (or `field`)."""
        text_like = isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict))
        if text_like:
            self._need_tokenizer(field)
            self._check_chars(
                len(prompt) if isinstance(prompt, str) else _text_chars(prompt), field
            )
        limit = self.limit_mm_per_prompt.get("image")
        if limit is not None and len(images) > limit:
            where = images[limit][0]
            raise InvalidArgument(
                f"{where}: {len(images)} images exceed --limit-mm-per-prompt image={limit}", where
            )
        images = await self.images.fetch(images)  # URLs -> bytes, off the loop

        def render() -> tuple[list[int], list[ImageInput]]:
            text, special = prompt, add_special_tokens
            try:
                if text_like and not isinstance(prompt, str):
                    text, special = self.tokenizer.apply_chat_template(
                        prompt, **{"add_generation_prompt": True, **template_kwargs}
                    ), False  # fmt: skip
                return with_images(
                    text,
                    [load_image(data, where) for where, data in images],
                    self.vision,
                    lambda t: self.tokenizer.encode(t, add_special_tokens=special),
                    field=field,
                )
            except ImageError as e:
                raise InvalidArgument(str(e), e.field) from None
            except ValueError as e:  # TokenizerError: no template, or the template raised
                raise InvalidArgument(f"{field}: {e}", field) from None

        return await asyncio.to_thread(render)

    @property
    def max_request_bytes(self) -> int:
        """The largest request body / gRPC message read (`--max-request-bytes`)."""
        if self._max_request_bytes is not None:
            return self._max_request_bytes
        limits = self.engine_loop.limits
        return default_max_request_bytes(limits.max_model_len if limits else None)

    @property
    def max_prompt_chars(self) -> int:
        """The most characters of prompt text tokenized: more cannot fit `max_model_len` tokens
        even if every token were the vocabulary's longest piece (x2 for normalizers)."""
        return self.limits().max_model_len * self._piece_chars * 2

    def _check_chars(self, chars: int, field: str) -> None:
        """The character cap, before any tokenizing (InvalidArgument naming `field`)."""
        cap = self.max_prompt_chars
        if chars > cap:
            raise InvalidArgument(
                f"{field}: {chars} characters cannot fit max_model_len="
                f"{self.limits().max_model_len} tokens (at most {cap} characters are tokenized)",
                field,
            )

    def _need_tokenizer(self, field: str) -> None:
        if self.tokenizer is None:
            raise InvalidArgument(
                f"{field}: the server runs with --skip-tokenizer-init (no tokenizer); "
                f"send token_ids"
            )

    def prepare(self, ids: Sequence[int], sp: SamplingParams, fields: Fields) -> list[int]:
        """The prompt ids the engine gets (`SamplingParams.prepare_prompt`: truncation, bad words
        tokenized); InvalidArgument naming the field as `fields` spells it."""
        try:
            return sp.prepare_prompt(list(ids), self.tokenizer)
        except FieldError as e:
            raise fields.error(e) from None

    def authorized(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header / `authorization` metadata value passes `api_key`
        (`Bearer KEY`; always, without a key). Compared in constant time."""
        if self.api_key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        )

    def submit(
        self,
        ids: Sequence[int],
        sp: SamplingParams,
        priority: int,
        *,
        fields: Fields = GRPC,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: Sequence[ImageInput] = (),
    ) -> Stream:
        """Checks a tokenized request against the engine's limits and admits it (event loop): the
        one request check of both protocols (`validation.check_request`, after `prepare`);
        `fields` spells the request's fields as its protocol does (the prompt field included);
        `cache_salt` keeps its prefix-cache pages among requests with the same salt.

        Raises InvalidArgument, QueueFull, Unavailable.
        """
        n_ids = len(ids)
        ids = self.prepare(ids, sp, fields)
        if mm_inputs and len(ids) != n_ids:
            raise InvalidArgument(
                "truncate_prompt_tokens cannot cut a prompt with images", "truncate_prompt_tokens"
            )
        check_request(
            ids,
            sp,
            priority,
            self.limits(),
            fields,
            has_tokenizer=self.tokenizer is not None,
            max_in_flight=self.max_in_flight,
            priority_scheduling=self.scheduling_policy == "priority",
            cache_salt=cache_salt,
        )
        self.check_admission(sp.n)
        stream = self.engine_loop.submit(
            ids, sp, priority, cache_salt=cache_salt, lora_request=lora_request,
            mm_inputs=tuple(mm_inputs),
        )  # fmt: skip
        stream.fields = fields
        if lora_request is not None:
            self.metrics.lora_requests.labels(lora_request.lora_name).inc()
        return stream

    def lora_request(self, name: str, field: str = "lora_name") -> LoRARequest:
        """The loaded LoRA adapter `name`; InvalidArgument naming `field` when it is unknown or
        the server runs without --enable-lora."""
        if self.loras is None:
            raise InvalidArgument(f"{field} needs a server started with --enable-lora", field)
        lora = self.loras.resolve(name)
        if lora is None:
            loaded = ", ".join(sorted(self.loras.by_name)) or "none"
            raise InvalidArgument(
                f"{field} {name!r} is not a loaded LoRA adapter (loaded: {loaded})", field
            )
        return lora

    def cancel(self, stream: Stream) -> None:
        """The reader went away (client cancelled, deadline): abort; the next step frees pages."""
        self.engine_loop.cancel(stream)

    def fail(self, stream: Stream, message: str) -> None:
        """A peer could not translate this request's output: it fails alone."""
        self.engine_loop.fail_request(stream, message)

    async def _log_load(self) -> None:
        """One line per `log_interval` while there is load; keeps the throughput gauge current."""
        window: collections.deque[tuple[float, int]] = collections.deque(maxlen=6)
        while True:
            await asyncio.sleep(self.log_interval)
            usable = self.info.capacity.num_pages if self.info is not None else 0
            snap = self.engine_loop.snapshot()
            now = time.perf_counter()
            window.append((now, snap["generated"]))
            (t0, g0), (t1, g1) = window[0], window[-1]
            rate = (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0
            self.metrics.throughput.set(rate)
            recent = g1 - (window[-2][1] if len(window) > 1 else g1)
            if snap["in_flight"] or snap["running"] or snap["waiting"] or recent:
                logger.info(
                    "running %d, waiting %d, in flight %d/%d | %.1f tok/s | KV %d/%d pages "
                    "(%.0f%%) | prefix hit %.0f%%",
                    snap["running"],
                    snap["waiting"],
                    snap["in_flight"],
                    self.max_in_flight,
                    rate,
                    snap["pages_used"],
                    usable,
                    100 * snap["pages_used"] / max(usable, 1),
                    100 * self.metrics.hit_rate,
                )
