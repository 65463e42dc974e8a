"""`EngineLoop`: one thread stepping `LLMEngine`, fanning deltas out to per-request asyncio queues.

1. `start(loop)` starts the engine thread. Its first job is `runner.warmup()` (every program
   compiled) when asked; then `on_ready` is called on the event loop.
2. The thread steps the engine while it has work and sleeps on an event otherwise; `submit` and
   `cancel` (called on the event loop) set the event. Every request submitted before a step
   starts joins that step's batch, so concurrent streams share engine steps.
3. After each step the thread stamps the time, updates the load gauges, and hands the whole
   step's deltas to the event loop in one `loop.call_soon_threadsafe`. There `_dispatch` puts
   each delta on its request's `asyncio.Queue`, records token timings, and retires the request
   when all its samples have finished.
4. Admission is bounded: at most `max_num_seqs + max_queue` sequences (a request counts `n`) are
   in flight; beyond that `submit` raises `QueueFull` (RESOURCE_EXHAUSTED).
5. `cancel` aborts the request in the engine; the next step frees its pages (the thread is woken
   for it even when otherwise idle).

Failures. An exception raised by one request's handling on the event loop (building its
responses) fails that request alone with INTERNAL and aborts it in the engine. An exception
raised by `engine.step()` loses that step's deltas for every request it scheduled (their token
streams would now have a gap), so exactly those requests fail with INTERNAL and are aborted;
requests that were waiting carry on. The engine does its detokenization inside `step()`, so a
detokenization error is such a step failure. After `max_step_failures` consecutive failing
steps the engine is declared broken (a donated KV cache lost on the device, say): every request
fails and the server stops serving.

NOTE: all request bookkeeping (`_streams`, `_in_flight`) lives on the event loop thread; the
engine thread touches only the engine, the metrics, and `call_soon_threadsafe`.
NOTE: engine request ids are the server's own ("r17"), never the client's, which need not be
unique; with n > 1 the engine names samples "r17#i", hence no "#" in our ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from jaxinfer.engine.engine import LLMEngine, RequestDelta
from jaxinfer.sampling_params import SamplingParams
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
    remaining: int = 0
    cancelled: bool = False
    first: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> first token time
    last: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> last token time


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, *, max_queue: int = 256,
                 warmup: bool = True, trace_dir: str | None = None, trace_steps: int = 0,
                 max_step_failures: int = 3) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine, self.metrics = engine, metrics
        self.max_queue = max_queue
        self.max_in_flight = engine.config.max_num_seqs + max_queue
        self.warmup = warmup
        self.trace_dir, self.trace_steps = trace_dir, trace_steps
        self.max_step_failures = max_step_failures
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_ready: Callable[[int], None] | None = None
        self.on_broken: Callable[[str], None] | None = None
        self.running = False  # warmed up and stepping
        self.broken: str | None = None
        self.compiled_programs = 0
        self._streams: dict[str, Stream] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scheduled: list[str] = []
        self._generated = 0  # tokens generated (engine thread), for the throughput window
        self._snapshot = {"running": 0, "waiting": 0, "pages_used": 0}
        self._trace_state = "pending" if trace_dir and trace_steps > 0 else "off"
        self._traced = 0
        self._wrap_schedule()

    def _wrap_schedule(self) -> None:
        """Records which requests each step scheduled, to know whom a failing step hurts."""
        scheduler = self.engine.scheduler
        original = scheduler.schedule

        def schedule() -> Any:
            out = original()
            self._scheduled = [s.request.request_id for s in out.scheduled]
            return out

        scheduler.schedule = schedule

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def snapshot(self) -> dict[str, int]:
        return {**self._snapshot, "in_flight": self._in_flight, "generated": self._generated}

    def submit(self, ids: list[int], sampling: SamplingParams, priority: int) -> Stream:
        """Admits a request (event loop thread); raises QueueFull, EngineUnavailable, ValueError."""
        if self.broken is not None:
            raise EngineUnavailable(f"the engine failed: {self.broken}")
        if not self.running:
            raise EngineUnavailable("the engine is not running")
        if sampling.n > self.max_in_flight:
            raise ValueError(f"sampling.n={sampling.n} exceeds what the server admits at once "
                             f"({self.max_in_flight} sequences: max_num_seqs + max_queue)")
        if self._in_flight + sampling.n > self.max_in_flight:
            raise QueueFull(f"the server is full ({self._in_flight} sequences in flight, at most "
                            f"{self.max_in_flight}); retry later")
        engine_id = f"r{next(self._ids)}"
        stream = Stream(engine_id, sampling.n, time.perf_counter(), asyncio.Queue(),
                         remaining=sampling.n)
        self.engine.add_request(ids, sampling, request_id=engine_id, priority=priority)
        self._streams[engine_id] = stream
        self._in_flight += sampling.n
        self._idle.clear()
        self.metrics.in_flight.set(self._in_flight)
        self._wake.set()
        return stream

    def cancel(self, stream: Stream) -> None:
        """The client went away (cancelled, deadline): abort it; the next step frees its pages."""
        if stream.engine_id in self._streams and not stream.cancelled:
            stream.cancelled = True
            self.engine.abort(stream.engine_id)
            self._wake.set()

    def abort_all(self) -> None:
        """Server-side abort of every request (shutdown): they finish with ABORTED."""
        for engine_id in list(self._streams):
            self.engine.abort(engine_id)
        self._wake.set()

    async def wait_idle(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _retire(self, stream: Stream) -> None:
        if self._streams.pop(stream.engine_id, None) is not None:
            self._in_flight -= stream.n
            self.metrics.in_flight.set(self._in_flight)
            if not self._streams:
                self._idle.set()

    def _fail(self, engine_ids: list[str], code: grpc.StatusCode, message: str) -> None:
        for engine_id in engine_ids:
            stream = self._streams.get(engine_id)
            if stream is None:
                continue
            stream.queue.put_nowait(Failure(code, message))
            for _ in range(stream.remaining):
                self.metrics.requests.labels("error").inc()
            self.engine.abort(engine_id)
            self._retire(stream)
        self._wake.set()

    def fail_request(self, stream: Stream, message: str) -> None:
        """One request's own processing raised: INTERNAL for it, everyone else carries on."""
        self._fail([stream.engine_id], grpc.StatusCode.INTERNAL, message)

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
            reason = "cancelled" if stream.cancelled and d.finish_reason == "abort" else d.finish_reason
            usage = d.usage
            m.observe_finish(reason or "abort", usage.prompt_tokens if usage else 0,
                             usage.cached_prompt_tokens if usage else 0)

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._trace_state == "on":
            self._stop_trace()

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self.loop.call_soon_threadsafe(fn, *args)

    def _run(self) -> None:
        try:
            if self.warmup:
                start = time.perf_counter()
                self.compiled_programs = int(self.engine.runner.warmup())
                logger.info("warmup: %d programs compiled in %.1fs", self.compiled_programs,
                            time.perf_counter() - start)
            else:
                self.compiled_programs = int(getattr(self.engine.runner, "num_compiled", 0))
        except Exception as e:  # noqa: BLE001
            logger.exception("warmup failed")
            self.broken = f"warmup failed: {type(e).__name__}: {e}"
            if self.on_broken is not None:
                self._post(self.on_broken, self.broken)
            return
        self.metrics.compiled_programs.set(self.compiled_programs)
        self.metrics.pages_total.set(self.engine.allocator.num_usable_pages)
        self.running = True
        if self.on_ready is not None:
            self._post(self.on_ready, self.compiled_programs)
        failures = 0
        while not self._stop.is_set():
            self._wake.clear()
            if not self.engine.has_unfinished():
                self._wake.wait(1.0)
                continue
            ok, progressed = self._step()
            failures = 0 if ok else failures + 1
            if failures >= self.max_step_failures:
                self.broken = f"{failures} consecutive engine steps failed"
                logger.error("engine broken: %s; failing every request", self.broken)
                self.running = False
                self._post(self._fail_all, self.broken)
                if self.on_broken is not None:
                    self._post(self.on_broken, self.broken)
                return
            if not progressed:
                # Nothing scheduled and nothing emitted (e.g. only aborts of finished requests
                # were queued): back off instead of spinning.
                self._wake.wait(0.05)

    def _fail_all(self, why: str) -> None:
        self._fail(list(self._streams), grpc.StatusCode.INTERNAL, f"the engine failed: {why}")

    def _step(self) -> tuple[bool, bool]:
        """One engine step; returns (succeeded, made progress)."""
        if self._trace_state == "pending":
            self._start_trace()
        self._scheduled = []
        start = time.perf_counter()
        try:
            deltas = self.engine.step()
        except Exception as e:  # noqa: BLE001
            self.metrics.step_failures.inc()
            # NOTE: with async scheduling a failed step can also lose the one launched before it.
            lost = self.engine.failed_request_ids or self._scheduled
            victims = sorted({rid.split("#", 1)[0] for rid in lost})
            logger.exception("engine step failed; failing the %d requests it scheduled: %s",
                             len(victims), victims)
            for rid in victims:
                self.engine.abort(rid)
            self._post(self._fail, victims, grpc.StatusCode.INTERNAL,
                       f"engine step failed: {type(e).__name__}: {e}")
            return False, True
        now = time.perf_counter()
        self.metrics.step_time.observe(now - start)
        self._generated += sum(len(d.new_token_ids) for d in deltas)
        sched, alloc = self.engine.scheduler, self.engine.allocator
        used = alloc.num_usable_pages - alloc.num_free_pages
        self._snapshot = {"running": sched.num_running, "waiting": sched.num_waiting,
                          "pages_used": used}
        self.metrics.running.set(sched.num_running)
        self.metrics.waiting.set(sched.num_waiting)
        self.metrics.pages_used.set(used)
        # Without warmup, programs compile on first use: keep the gauge current.
        self.metrics.compiled_programs.set(
            getattr(self.engine.runner, "num_compiled", self.compiled_programs))
        if self._trace_state == "on" and self._scheduled:
            self._traced += 1
            if self._traced >= self.trace_steps:
                self._stop_trace()
        if deltas:
            self._post(self._dispatch, deltas, now)
        return True, bool(deltas or self._scheduled)

    def _start_trace(self) -> None:
        import jax

        try:
            jax.profiler.start_trace(self.trace_dir)
        except Exception:  # noqa: BLE001 - a profiler problem must not take the server down
            logger.exception("could not start a profiler trace in %s", self.trace_dir)
            self._trace_state = "off"
            return
        self._trace_state = "on"
        logger.info("tracing the next %d engine steps into %s", self.trace_steps, self.trace_dir)

    def _stop_trace(self) -> None:
        import jax

        self._trace_state = "done"
        try:
            jax.profiler.stop_trace()
        except Exception:  # noqa: BLE001
            logger.exception("could not stop the profiler trace")
            return
        logger.info("profiler trace of %d steps written to %s (open with: tensorboard --logdir %s)",
                    self._traced, self.trace_dir, self.trace_dir)
