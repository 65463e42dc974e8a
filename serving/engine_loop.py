"""`EngineLoop`: the serving front end's half of the engine: requests out to the engine core,
token outputs back in, detokenized and fanned out to per-request asyncio queues.

The engine core (scheduler + runner + device) runs in a process of its own
(`ProcessCoreClient`, what `scripts/serve.py` uses) or on a thread of this one
(`ThreadCoreClient`: multi-host leaders, tests); this module does not care which.

1. `start(loop)` starts the core. It loads the model ("loaded": capacity and limits), compiles
   every program (when asked) and says "ready"; the front end then admits requests (`on_ready`).
2. `submit` (event loop) splits a request into its samples, opens their detokenizers and stop
   matchers (`OutputProcessor`) and sends them to the core in one message.
3. Each "step" message of the core (one per engine step) is handled on the event loop: its token
   outputs become text deltas, stop strings found in the text finish their samples in the core,
   each delta goes on its request's `asyncio.Queue`, token timings and load gauges are recorded,
   and a request is retired when all its samples have finished.
4. Admission is bounded: at most `max_num_seqs + max_queue` sequences (a request counts `n`) are
   in flight; beyond that `submit` raises `QueueFull` (RESOURCE_EXHAUSTED).
5. `cancel` aborts the request in the core; its next step frees the pages.

Failures. An exception raised by one request's handling here fails that request alone with
INTERNAL and aborts it in the core. A step that raises in the core loses the requests it
scheduled: exactly those fail with INTERNAL (the core aborts them); the rest carry on. When the
core is broken (warmup failed, too many consecutive failing steps, its process died) every
request fails and the server stops serving.

NOTE: all request bookkeeping lives on the event loop thread; core messages arrive on a receiver
thread and are posted to the loop with `call_soon_threadsafe`.
NOTE: engine request ids are the server's own ("r17"), never the client's, which need not be
unique; with n > 1 the engine names samples "r17#i", hence no "#" in our ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import grpc

from jaxinfer.engine.output import OutputProcessor, RequestDelta
from jaxinfer.engine.types import (
    EngineLimits,
    Message,
    request_to_wire,
    split_samples,
    wire_outputs,
)
from jaxinfer.sampling_params import SamplingParams
from jaxinfer.tokenizer import Tokenizer
from serving.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """More sequences in flight than the server admits."""


class EngineUnavailable(Exception):
    """The engine is not running (warming up, stopped or broken)."""


@dataclasses.dataclass
class Failure:
    """Put on a request's queue instead of a delta: end the RPC with this status."""

    code: grpc.StatusCode
    message: str


@dataclasses.dataclass
class Stream:
    engine_id: str
    n: int
    arrival: float
    queue: asyncio.Queue
    children: list[str] = dataclasses.field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False
    first: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> first token time
    last: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> last token time


class EngineLoop:
    """Front end of one engine core (see the module docstring).

    Args:
      client: a `ProcessCoreClient` or `ThreadCoreClient` (not started).
      tokenizer: detokenizes outputs (None: token ids only, text stays empty).
      max_num_seqs: the core's batch size (admission bound with `max_queue`).
      eos_token_ids: ids that end a sample (None: the tokenizer's; none without a tokenizer).
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Tokenizer | None,
        metrics: ServerMetrics,
        *,
        max_num_seqs: int,
        max_queue: int = 256,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.client, self.metrics = client, metrics
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_queue = max_queue
        self.max_in_flight = max_num_seqs + max_queue
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_ready: Callable[[int], None] | None = None
        self.on_broken: Callable[[str], None] | None = None
        self.running = False  # warmed up and serving
        self.broken: str | None = None
        self.info: dict[str, Any] = {}  # the core's "ready" facts
        self.limits: EngineLimits | None = None
        self.compiled_programs = 0
        self.outputs = OutputProcessor(tokenizer)
        self._streams: dict[str, Stream] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._generated = 0  # tokens generated, for the throughput window
        self._stats: dict[str, int] = {"running": 0, "waiting": 0, "pages_used": 0}
        self._stopped = False
        self._loaded = asyncio.Event()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.client.start(self._from_core)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def snapshot(self) -> dict[str, int]:
        return {
            "running": self._stats.get("running", 0),
            "waiting": self._stats.get("waiting", 0),
            "pages_used": self._stats.get("pages_used", 0),
            "in_flight": self._in_flight,
            "generated": self._generated,
        }

    def submit(self, ids: list[int], sampling: SamplingParams, priority: int) -> Stream:
        """Admits a request (event loop thread); raises QueueFull, EngineUnavailable."""
        if self.broken is not None:
            raise EngineUnavailable(f"the engine failed: {self.broken}")
        if not self.running:
            raise EngineUnavailable("the engine is not running")
        if sampling.n > self.max_in_flight:
            raise ValueError(
                f"sampling.n={sampling.n} exceeds what the server admits at once "
                f"({self.max_in_flight} sequences: max_num_seqs + max_queue)"
            )
        if self._in_flight + sampling.n > self.max_in_flight:
            raise QueueFull(
                f"the server is full ({self._in_flight} sequences in flight, at most "
                f"{self.max_in_flight}); retry later"
            )
        engine_id = f"r{next(self._ids)}"
        core_reqs, specs = split_samples(
            engine_id, ids, sampling, eos_token_ids=self.eos_token_ids, priority=priority
        )
        stream = Stream(
            engine_id,
            sampling.n,
            time.perf_counter(),
            asyncio.Queue(),
            children=[r.request_id for r in core_reqs],
            remaining=sampling.n,
        )
        self.outputs.add(engine_id, specs)
        self.client.send(["add", [request_to_wire(r) for r in core_reqs]])
        self._streams[engine_id] = stream
        self._in_flight += sampling.n
        self._idle.clear()
        self.metrics.in_flight.set(self._in_flight)
        return stream

    def cancel(self, stream: Stream) -> None:
        """The client went away (cancelled, deadline): abort it; the next step frees its pages."""
        if stream.engine_id in self._streams and not stream.cancelled:
            stream.cancelled = True
            self._send(["abort", stream.children])

    def abort_all(self) -> None:
        """Server-side abort of every request (shutdown): they finish with ABORTED."""
        ids = [c for s in self._streams.values() for c in s.children]
        if ids:
            self._send(["abort", ids])

    async def wait_idle(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def fail_request(self, stream: Stream, message: str) -> None:
        """One request's own processing raised: INTERNAL for it, everyone else carries on."""
        self._fail([stream.engine_id], grpc.StatusCode.INTERNAL, message)

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the core (call off the event loop: it joins a thread or a process)."""
        self._stopped = True
        self.client.stop(timeout)

    def _send(self, msg: Message) -> None:
        if self.broken is None and not self._stopped:
            self.client.send(msg)

    def _from_core(self, msg: Message) -> None:
        """Called on the receiver (or core) thread: hand the message to the event loop."""
        now = time.perf_counter()
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(self._on_message, msg, now)

    def _on_message(self, msg: Message, now: float) -> None:
        kind = msg[0]
        if kind == "step":
            self._on_step(msg, now)
        elif kind == "ready":
            self._on_ready(msg[1])
        elif kind == "loaded":
            self._on_loaded(msg[1])
        elif kind == "broken":
            self._on_broken(msg[1])
        else:
            logger.error("unknown message from the engine core: %r", kind)

    async def wait_loaded(self) -> None:
        """Waits until the core has its model on the devices (raises RuntimeError if it failed)."""
        await self._loaded.wait()
        if self.broken is not None:
            raise RuntimeError(f"the engine did not start: {self.broken}")

    def _on_loaded(self, info: dict[str, Any]) -> None:
        self.info = info
        self.limits = info["limits"]
        self.metrics.pages_total.set(info["capacity"]["num_pages"])
        self._loaded.set()

    def _on_ready(self, info: dict[str, Any]) -> None:
        self.info = info
        self.limits = info["limits"]
        self.compiled_programs = int(info.get("compiled_programs", 0))
        logger.info("engine core ready: %d programs compiled", self.compiled_programs)
        self.metrics.compiled_programs.set(self.compiled_programs)
        self.metrics.pages_total.set(info["capacity"]["num_pages"])
        self.running = True
        if self.on_ready is not None:
            self.on_ready(self.compiled_programs)

    def _on_broken(self, why: str) -> None:
        if self.broken is not None:
            return
        logger.error("engine broken: %s; failing every request", why)
        self.broken, self.running = why, False
        self._loaded.set()
        self._fail(list(self._streams), grpc.StatusCode.INTERNAL, f"the engine failed: {why}")
        if self.on_broken is not None:
            self.on_broken(why)

    def _on_step(self, msg: Message, now: float) -> None:
        outputs, lost, error, stats = wire_outputs(msg), msg[2], msg[3], msg[4]
        self._stats = stats
        m = self.metrics
        m.running.set(stats["running"])
        m.waiting.set(stats["waiting"])
        m.pages_used.set(stats["pages_used"])
        m.compiled_programs.set(stats.get("compiled_programs", self.compiled_programs))
        if "step_s" in stats:
            m.step_time.observe(stats["step_s"])
        m.observe_spec(stats)
        if lost:
            if error and error.startswith("engine step failed"):
                m.step_failures.inc()
            self._fail(
                self.outputs.parents_of(lost),
                grpc.StatusCode.INTERNAL,
                error or "the engine lost this request",
            )
        deltas, stopped = self.outputs.process(outputs)
        if stopped:
            self._send(["finish", [[cid, stop] for cid, stop in stopped]])
        self._dispatch(deltas, now)

    def _retire(self, stream: Stream) -> None:
        if self._streams.pop(stream.engine_id, None) is not None:
            self._in_flight -= stream.n
            self.metrics.in_flight.set(self._in_flight)
            if not self._streams:
                self._idle.set()

    def _fail(self, engine_ids: list[str], code: grpc.StatusCode, message: str) -> None:
        aborts = []
        for engine_id in engine_ids:
            stream = self._streams.get(engine_id)
            if stream is None:
                continue
            stream.queue.put_nowait(Failure(code, message))
            for _ in range(stream.remaining):
                self.metrics.requests.labels("error").inc()
            aborts += self.outputs.drop(engine_id)
            self._retire(stream)
        if aborts:
            self._send(["abort", aborts])

    def _dispatch(self, deltas: list[RequestDelta], now: float) -> None:
        for d in deltas:
            stream = self._streams.get(d.request_id)
            if stream is None:
                continue  # failed or retired already
            try:
                self._record(stream, d, now)
                stream.queue.put_nowait(d)
                if d.finished:
                    stream.remaining -= 1
                    if stream.remaining == 0:
                        self._retire(stream)
            except Exception as e:  # noqa: BLE001 - one request's failure must not stop the rest
                logger.exception("request %s failed while dispatching", d.request_id)
                self.fail_request(stream, f"internal error: {type(e).__name__}: {e}")

    def _record(self, stream: Stream, d: RequestDelta, now: float) -> None:
        m, i = self.metrics, d.index
        if d.new_token_ids:
            self._generated += len(d.new_token_ids)
            m.generation_tokens.inc(len(d.new_token_ids))
            if i not in stream.first:
                stream.first[i] = now
                m.ttft.observe(now - stream.arrival)
            else:
                gap = (now - stream.last[i]) / len(d.new_token_ids)
                for _ in d.new_token_ids:
                    m.itl.observe(gap)
            stream.last[i] = now
        if d.finished:
            m.e2e.observe(now - stream.arrival)
            reason = (
                "cancelled" if stream.cancelled and d.finish_reason == "abort" else d.finish_reason
            )
            usage = d.usage
            m.observe_finish(
                reason or "abort",
                usage.prompt_tokens if usage else 0,
                usage.cached_prompt_tokens if usage else 0,
            )
