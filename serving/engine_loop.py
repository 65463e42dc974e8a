"""`EngineLoop`: the front end's half of the engine: requests out to the engine core, token
outputs back in, detokenized and fanned out to per-request `Stream`s. `FrontEnd` (`frontend.py`)
owns it and does admission; this module only talks to the core.

The engine core (scheduler + runner + device) runs in a process of its own
(`ProcessCoreClient`, what `scripts/serve.py` uses) or on a thread of this one
(`ThreadCoreClient`: multi-host leaders, tests); this module does not care which.

1. `start(loop)` starts the core. It loads the model ("loaded": capacity and limits), compiles
   every program (when asked) and says "ready" (`on_ready`); "broken" calls `on_broken`.
2. `submit` (event loop; the request already admitted) splits a request into its samples, opens
   their detokenizers and stop matchers (`OutputProcessor`) and sends them to the core in one
   message.
3. Each "step" message of the core (one per engine step) is handled on the event loop: its token
   outputs become text deltas, stop strings found in the text finish their samples in the core,
   each delta goes on its request's stream, token timings and load gauges are recorded, and a
   request is retired when all its samples have finished.
4. A reader takes `Stream.next_batch()`: every delta of one sample waiting for it, merged.
5. `cancel` aborts the request in the core; its next step frees the pages.

Failures. An exception raised by one request's handling here fails that request alone
(`RequestFailed` from its stream) and aborts it in the core. A step that raises in the core is
isolated there (`jaxinfer/engine/isolation.py`): only the request(s) that make it raise are lost
and fail; the rest carry on. A request the core refuses for what it sent (`bad_argument`: a
grammar too expensive) fails with InvalidArgument in its protocol's spelling. When the
core is broken (warmup failed, too many consecutive failing steps, its process died) every
request fails and the front end stops serving; when its process is gone (`core_exited`) the front
end shuts down and exits non-zero (`FrontEnd.exit_code`).

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
import re
import time
from collections.abc import Callable
from typing import Any

from jaxinfer.engine.limits import EngineLimits
from jaxinfer.engine.output import OutputProcessor, RequestDelta
from jaxinfer.engine.types import (
    Abort,
    AddRequests,
    Broken,
    EngineInfo,
    EngineStats,
    Finish,
    Loaded,
    Message,
    Ready,
    RemoveLoRA,
    StartProfile,
    StepResult,
    StopProfile,
    split_samples,
    wire_outputs,
)
from jaxinfer.lora.request import LoRARequest
from jaxinfer.sampling_params import FieldError, SamplingParams
from jaxinfer.tokenizer import Tokenizer
from serving.errors import InvalidArgument, RequestFailed
from serving.metrics import ServerMetrics
from serving.validation import GRPC, Fields

logger = logging.getLogger(__name__)

_FIELD = re.compile(r"[A-Za-z_][\w.\[\]]*")  # "structured_outputs.regex", "prompt[3]"


@dataclasses.dataclass
class Failure:
    """Put on a request's queue instead of a delta: the request failed with this message
    (`bad_argument`: the core refused what the client sent; the message names the field)."""

    message: str
    bad_argument: bool = False


@dataclasses.dataclass
class Stream:
    """One request's deltas, in the order the engine produced them (all its samples)."""

    engine_id: str
    n: int
    arrival: float
    queue: asyncio.Queue
    children: list[str] = dataclasses.field(default_factory=list)
    remaining: int = 0
    cancelled: bool = False
    first: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> first token time
    last: dict[int, float] = dataclasses.field(default_factory=dict)  # sample -> last token time
    held: RequestDelta | Failure | None = None  # taken from the queue, not merged: read next
    fields: Fields = GRPC  # how the request's protocol spells a field the core refuses
    prompt_ids: list[int] = dataclasses.field(default_factory=list)  # what the engine got

    async def next_batch(self) -> RequestDelta:
        """The next delta, merged with every later delta of the same sample already waiting (a
        reader behind the engine gets them in one piece); stops before a failure or another
        sample's delta. Raises RequestFailed when the request failed (InvalidArgument when the
        core refused it for what the client sent)."""
        item, self.held = self.held or await self.queue.get(), None
        if isinstance(item, Failure):
            self._raise(item)
        while not item.finished and not self.queue.empty():
            nxt = self.queue.get_nowait()
            if isinstance(nxt, Failure) or nxt.index != item.index:
                self.held = nxt
                break
            item.merge(nxt)
        return item

    async def wait_first_output(self) -> None:
        """Waits until the request has its first delta or has failed, taking nothing from it
        (`next_batch` reads it next): a failure raises as `next_batch` will."""
        if self.held is None:
            self.held = await self.queue.get()
        if isinstance(self.held, Failure):
            self._raise(self.held)

    def _raise(self, failure: Failure) -> None:
        if not failure.bad_argument:
            raise RequestFailed(failure.message)
        named = _FIELD.match(failure.message)  # the core names the field as this package does
        if named is None:
            raise InvalidArgument(failure.message)
        raise self.fields.error(FieldError(named[0], failure.message[named.end() :]))


class EngineLoop:
    """Front end of one engine core (see the module docstring).

    Args:
      client: a `ProcessCoreClient` or `ThreadCoreClient` (not started).
      tokenizer: detokenizes outputs (None: token ids only, text stays empty).
      eos_token_ids: ids that end a sample (None: the tokenizer's; none without a tokenizer).
    """

    def __init__(
        self,
        client: Any,
        tokenizer: Tokenizer | None,
        metrics: ServerMetrics,
        *,
        eos_token_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.client, self.metrics = client, metrics
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else ()
        self.eos_token_ids = tuple(eos_token_ids)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_ready: Callable[[int], None] | None = None
        self.on_broken: Callable[[str, bool], None] | None = None  # (why, core exited)
        self.running = False  # warmed up and serving
        self.broken: str | None = None
        self.core_exited = False  # the core's process is gone: nothing will be served again
        self.info: EngineInfo | None = None  # the core's facts ("loaded", then "ready")
        self.limits: EngineLimits | None = None
        self.compiled_programs = 0
        self.outputs = OutputProcessor(tokenizer)
        self._streams: dict[str, Stream] = {}
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._ids = itertools.count()
        self._generated = 0  # tokens generated, for the throughput window
        self._stats = EngineStats()
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
            "running": self._stats.running,
            "waiting": self._stats.waiting,
            "pages_used": self._stats.pages_used,
            "in_flight": self._in_flight,
            "generated": self._generated,
        }

    def submit(
        self,
        ids: list[int],
        sampling: SamplingParams,
        priority: int,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        mm_inputs: tuple = (),
    ) -> Stream:
        """Sends an admitted request (`FrontEnd.submit`) to the core (event loop thread)."""
        engine_id = f"r{next(self._ids)}"
        core_reqs, specs = split_samples(
            engine_id,
            ids,
            sampling,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            cache_salt=cache_salt,
            lora_request=lora_request,
            mm_inputs=mm_inputs,
        )
        stream = Stream(
            engine_id,
            sampling.n,
            time.perf_counter(),
            asyncio.Queue(),
            children=[r.request_id for r in core_reqs],
            remaining=sampling.n,
            prompt_ids=ids,
        )
        self.outputs.add(engine_id, specs)
        self.client.send(AddRequests(requests=core_reqs))
        self._streams[engine_id] = stream
        self._in_flight += sampling.n
        self._idle.clear()
        self.metrics.in_flight.set(self._in_flight)
        return stream

    def cancel(self, stream: Stream) -> None:
        """The client went away (cancelled, deadline): abort it; the next step frees its pages."""
        if stream.engine_id in self._streams and not stream.cancelled:
            stream.cancelled = True
            self._send(Abort(request_ids=stream.children))

    def profile(self, start: bool) -> None:
        """Starts / stops a profiler trace in the core (it logs where the trace went)."""
        self._send(StartProfile() if start else StopProfile())

    def remove_lora(self, lora_int_id: int) -> None:
        """Tells the core an adapter was unloaded: it frees the adapter's slot (once the requests
        running under it end)."""
        self._send(RemoveLoRA(lora_int_id=lora_int_id))

    def abort_all(self) -> None:
        """Server-side abort of every request (shutdown): they finish with ABORTED."""
        ids = [c for s in self._streams.values() for c in s.children]
        if ids:
            self._send(Abort(request_ids=ids))

    async def wait_idle(self, timeout: float | None) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def fail_request(self, stream: Stream, message: str) -> None:
        """One request's own processing raised: it fails alone, everyone else carries on."""
        self._fail([stream.engine_id], message)

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
        if isinstance(msg, StepResult):
            self._on_step(msg, now)
        elif isinstance(msg, Ready):
            self._on_ready(msg.info)
        elif isinstance(msg, Loaded):
            self._on_loaded(msg.info)
        elif isinstance(msg, Broken):
            self._on_broken(msg.why, msg.exited)
        else:
            logger.error("unexpected message from the engine core: %r", msg)

    async def wait_loaded(self) -> None:
        """Waits until the core has its model on the devices (raises RuntimeError if it failed)."""
        await self._loaded.wait()
        if self.broken is not None:
            raise RuntimeError(f"the engine did not start: {self.broken}")

    def _on_loaded(self, info: EngineInfo) -> None:
        self.info, self.limits = info, info.limits
        self.metrics.pages_total.set(info.capacity.num_pages)
        self._loaded.set()

    def _on_ready(self, info: EngineInfo) -> None:
        self.info, self.limits = info, info.limits
        self.compiled_programs = info.compiled_programs
        logger.info("engine core ready: %d programs compiled", self.compiled_programs)
        self.metrics.compiled_programs.set(self.compiled_programs)
        self.metrics.pages_total.set(info.capacity.num_pages)
        self.running = True
        if self.on_ready is not None:
            self.on_ready(self.compiled_programs)

    def _on_broken(self, why: str, exited: bool = False) -> None:
        if self.broken is not None and (self.core_exited or not exited):
            return
        if self.broken is None:
            logger.error("engine broken: %s; failing every request", why)
            self.broken, self.running = why, False
        self.core_exited = exited
        self._loaded.set()
        self._fail(list(self._streams), f"the engine failed: {why}")
        if self.on_broken is not None:
            self.on_broken(why, exited)

    def _on_step(self, msg: StepResult, now: float) -> None:
        outputs, lost, error, stats = wire_outputs(msg), msg.lost, msg.error, msg.stats
        self._stats = stats
        m = self.metrics
        m.observe_load(stats)
        m.compiled_programs.set(stats.compiled_programs or self.compiled_programs)
        if stats.step_s is not None:
            m.step_time.observe(stats.step_s)
        m.observe_spec(stats)
        if lost:
            if error and error.startswith("engine step failed"):
                m.step_failures.inc()
            self._fail(
                self.outputs.parents_of(lost),
                error or "the engine lost this request",
                bad_argument=msg.bad_argument,
            )
        deltas, stopped = self.outputs.process(outputs)
        if stopped:
            self._send(Finish(stops=[(cid, stop) for cid, stop in stopped]))
        self._dispatch(deltas, now)

    def _retire(self, stream: Stream) -> None:
        if self._streams.pop(stream.engine_id, None) is not None:
            self._in_flight -= stream.n
            self.metrics.in_flight.set(self._in_flight)
            if not self._streams:
                self._idle.set()

    def _fail(self, engine_ids: list[str], message: str, *, bad_argument: bool = False) -> None:
        aborts = []
        for engine_id in engine_ids:
            stream = self._streams.get(engine_id)
            if stream is None:
                continue
            stream.queue.put_nowait(Failure(message, bad_argument))
            for _ in range(stream.remaining):
                self.metrics.requests.labels("error").inc()
            aborts += self.outputs.drop(engine_id)
            self._retire(stream)
        if aborts:
            self._send(Abort(request_ids=aborts))

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

    def _record_phases(self, stream: Stream, d: RequestDelta, now: float) -> None:
        """vLLM's queue / prefill / decode times of a finished sample (`serving/vllm_metrics.py`):
        the queue time is the core's; the front end's arrival stands for the core's (one ipc
        hop apart). A sample that never got a token (aborted while waiting) has no phases."""
        v, first = self.metrics.vllm, stream.first.get(d.index)
        queue_s = d.usage.queue_s if d.usage is not None else None
        if queue_s is None or first is None:
            return
        v.queue.observe(queue_s)
        v.prefill.observe(max(0.0, first - stream.arrival - queue_s))
        v.decode.observe(stream.last[d.index] - first)

    def _record(self, stream: Stream, d: RequestDelta, now: float) -> None:
        m, v, i = self.metrics, self.metrics.vllm, d.index
        if d.new_token_ids:
            self._generated += len(d.new_token_ids)
            m.generation_tokens.inc(len(d.new_token_ids))
            v.generation_tokens.inc(len(d.new_token_ids))
            if i not in stream.first:
                stream.first[i] = now
                m.ttft.observe(now - stream.arrival)
                v.ttft.observe(now - stream.arrival)
            else:
                gap = (now - stream.last[i]) / len(d.new_token_ids)
                for _ in d.new_token_ids:
                    m.itl.observe(gap)
                    v.itl.observe(gap)
            stream.last[i] = now
        if d.finished:
            m.e2e.observe(now - stream.arrival)
            v.e2e.observe(now - stream.arrival)
            self._record_phases(stream, d, now)
            reason = (
                "cancelled" if stream.cancelled and d.finish_reason == "abort" else d.finish_reason
            )
            usage = d.usage
            m.observe_finish(
                reason or "abort",
                usage.prompt_tokens if usage else 0,
                usage.cached_prompt_tokens if usage else 0,
            )
