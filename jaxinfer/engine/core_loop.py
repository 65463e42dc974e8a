"""The engine-core side of the front end <-> core split: the loop that drives an `EngineCore`
from messages (`jaxinfer.engine.types`: typed, one per step each way), the entry point of the
engine-core process, and `ThreadCoreClient` (the loop on a thread of this process).

1. `run_core_loop` says `Loaded` (the model is on its devices; `info()`: capacity, limits),
   warms the core up (every program compiled), says `Ready`, then loops: take every queued
   message, step while there is work (blocking on the inbox when there is none), send one
   `StepResult` per step that produced anything.
2. A step that raises does not fail the requests it held: a `FaultIsolator`
   (`jaxinfer.engine.isolation`) recovers the core (every running request preempted: it
   recomputes), re-validates the suspects, then bisects them with probe steps that admit only
   some of them; each culprit (a request the step fails with, without the others) is aborted and
   reported lost with the step's error; everyone else carries on with unchanged outputs.
   `max_step_failures` unexplained failures (no culprit, or no step working while isolating)
   with no successful step between them declare the core broken (`Broken`, logged), as a failed
   warmup does.
3. `core_process_main` is the spawned process's entry (`core_client.ProcessCoreClient` starts
   it): it builds the core from its `CoreSpec` (JAX is imported there, never by the front end),
   then runs the loop over two zmq sockets with msgpack frames. A watchdog thread exits the
   process within 0.1 s of its parent's death (mid-step and mid-load too); SIGINT/SIGTERM are
   ignored (the front end drains on them, then says `Shutdown`).
   With `LoopOptions.kv_events`, a `KVEventPublisher` (`kv_events.py`) publishes what the prefix
   cache stored and evicted after each step (queued for its own thread: never blocks the step).
4. `ThreadCoreClient` runs the same loop on a daemon thread over queues (multi-host leaders,
   tests); messages stay Python objects.

NOTE: this module imports no JAX itself (the front end imports it to name the process entry).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.compile_cache import active_dir, cache_counts
from jaxinfer.engine import tracing
from jaxinfer.engine.core_client import CoreSpec, LoopOptions, OnMessage
from jaxinfer.engine.isolation import FaultIsolator
from jaxinfer.engine.kv_events import KVEventPublisher, KVEventsConfig
from jaxinfer.engine.tracing import Profiler
from jaxinfer.engine.types import (
    Abort,
    AddRequests,
    Broken,
    Finish,
    Loaded,
    Message,
    Ready,
    RemoveLoRA,
    Shutdown,
    StartProfile,
    StepResult,
    StopProfile,
    decode_message,
    encode,
    request_of,
)

if TYPE_CHECKING:
    from jaxinfer.engine.core import EngineCore

logger = logging.getLogger(__name__)


# Net new container objects that start a young-generation collection in the core (CPython's
# default is 700): a step holds a few per scheduled sequence (its schedule entry, update and
# output, their token lists) until the step ends, so with the default a 256-sequence step starts
# collections that walk every one of them; with this many, a step's objects are freed by
# reference counting before a collection starts (BENCHMARKS.md "Host overhead", third pass).
GC_YOUNG_THRESHOLD = 50_000


def settle_heap() -> None:
    """Prepares the collector for serving: one full collection, then every object alive now is
    moved out of the cyclic collector's generations (`gc.freeze`): what loading and compiling
    left behind (JAX's and the params' Python trees, traced programs) lives as long as the core,
    and every full collection would walk it again. The young generation's threshold becomes
    `GC_YOUNG_THRESHOLD`. Called once the core is loaded and warmed up (and by
    `scripts/bench_host.py`, which measures the core as served)."""
    gc.collect()
    gc.freeze()
    _space_young_collections()


def _space_young_collections() -> tuple[int, int, int]:
    """Raises the young generation's threshold to `GC_YOUNG_THRESHOLD` (never lowers it);
    returns the thresholds before."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], GC_YOUNG_THRESHOLD), *before[1:])
    return before


@contextlib.contextmanager
def spaced_young_collections() -> Iterator[None]:
    """`GC_YOUNG_THRESHOLD` for the young generation while the block runs, then the caller's
    thresholds again: the offline `LLM.generate` steps the engine in the user's own process, so
    it neither freezes that heap nor keeps the setting (`settle_heap` does both, for the core
    process)."""
    before = _space_young_collections()
    try:
        yield
    finally:
        gc.set_threshold(*before)


def run_core_loop(
    core: EngineCore,
    recv: Callable[[float | None], list[Message]],
    send: Callable[[Message], None],
    options: LoopOptions,
) -> None:
    """Drives `core` until a `Shutdown` message (see the module docstring).

    Args:
      recv: `recv(timeout)` returns the queued messages (waiting up to `timeout` seconds for the
        first one; 0: do not wait).
      send: delivers one message to the front end.
    """
    send(Loaded(info=core.info()))
    if options.profile_port is not None:
        import jax

        jax.profiler.start_server(options.profile_port)
    before = cache_counts()
    try:
        programs = core.warmup() if options.warmup else int(core.runner.num_compiled)
    except Exception as e:  # noqa: BLE001
        logger.exception("warmup failed")
        _stay_broken(f"warmup failed: {type(e).__name__}: {e}", recv, send)
        return
    after = cache_counts()
    loaded = after["executables"] - before["executables"]
    info = core.info()._replace(
        compiled_programs=programs,
        cached_programs=after["hits"] - before["hits"] + loaded,
        compilation_cache=active_dir(),
        loaded_programs=loaded,
    )
    send(Ready(info=info))
    settle_heap()
    profiler = Profiler(options.trace_dir, options.trace_steps)
    profiling = options.trace_dir is not None or options.profile_port is not None
    if profiling:
        tracing.instrument(core)
    events = _kv_events(core, options.kv_events)
    isolator, stalled = FaultIsolator(core, options.max_step_failures), False
    try:
        while True:
            # NOTE: with work, only take what is queued; stalled (work, but nothing could be
            # scheduled, e.g. every request waits for pages an abort will free): wait a little.
            timeout = (0.05 if stalled else 0.0) if core.has_unfinished() else 1.0
            for msg in recv(timeout):
                if not _handle(core, msg, send, profiler):
                    return
            if not core.has_unfinished():
                continue
            steps = core.num_steps
            profiler.before()
            start = time.perf_counter()
            failed: list[tuple[list[str], str]] = []
            try:
                if profiling:
                    with tracing.step_annotation(steps):
                        outputs, ok = core.step(), True
                else:
                    outputs, ok = core.step(), True
            except Exception as e:  # noqa: BLE001 - isolated: its culprits fail, the rest go on
                outputs, ok = [], False
                if isolator.isolating:  # a probe: the first failure's traceback is logged
                    logger.warning(
                        "engine step failed while isolating: %s: %s", type(e).__name__, e
                    )
                else:
                    logger.exception("engine step failed")
                failed = isolator.failed(f"{type(e).__name__}: {e}")
            busy = core.num_steps > steps
            if ok:
                isolator.succeeded(busy)
            profiler.after(busy)
            for lost, _ in failed:
                for rid in lost:
                    core.abort(rid)
            for rid, why in core.take_rejected():  # before outputs that may finish them
                send(StepResult(lost=[rid], error=why, stats=core.stats(), bad_argument=True))
            if events is not None:
                events.publish()
            if outputs:
                stats = core.stats()._replace(step_s=time.perf_counter() - start)
                send(StepResult(outputs=outputs, stats=stats))
            for lost, error in failed:
                send(StepResult(lost=lost, error=error, stats=core.stats()))
            if isolator.broken is not None:
                logger.error("engine broken: %s", isolator.broken)
                _stay_broken(isolator.broken, recv, send)
                return
            stalled = not busy and not outputs
    finally:
        profiler.stop(wait=True)
        if events is not None:
            events.close()


def _kv_events(core: EngineCore, config: str | None) -> KVEventPublisher | None:
    """The KV-event publisher of `--kv-events-config` (None when off)."""
    if not config:
        return None
    cfg = KVEventsConfig.parse(config)
    return KVEventPublisher(cfg, core.allocators) if cfg.active else None


def _stay_broken(
    why: str, recv: Callable[[float | None], list[Message]], send: Callable[[Message], None]
) -> None:
    """Reports `Broken` and stays up, refusing work, until `Shutdown`: the front end keeps
    serving health NOT_SERVING and UNAVAILABLE / 503 (and exits only if this process dies)."""
    send(Broken(why=why))
    while True:
        for msg in recv(1.0):
            try:
                msg = decode_message(msg)
            except ValueError:
                continue
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, AddRequests):
                lost = [request_of(w).request_id for w in msg.requests]
                send(StepResult(lost=lost, error=f"engine broken: {why}"))


def _handle(
    core: EngineCore,
    msg: Message | Sequence,
    send: Callable[[Message], None],
    profiler: Profiler | None = None,
) -> bool:
    """Applies one front-end message; False on `Shutdown`."""
    try:
        msg = decode_message(msg)
    except ValueError:
        logger.error("engine core: unknown message %r", msg[0])
        return True
    if isinstance(msg, AddRequests):
        for w in msg.requests:
            req = request_of(w)
            try:
                core.add(req)
            except ValueError as e:  # the front end checks first; a bad one must not crash us
                send(
                    StepResult(
                        lost=[req.request_id], error=str(e), stats=core.stats(), bad_argument=True
                    )
                )
    elif isinstance(msg, Abort):
        for rid in msg.request_ids:
            core.abort(rid)
    elif isinstance(msg, Finish):
        for rid, stop in msg.stops:
            core.finish(rid, "stop", stop)
    elif isinstance(msg, Shutdown):
        return False
    elif isinstance(msg, RemoveLoRA):
        freed = core.remove_lora(msg.lora_int_id)
        when = "freed" if freed else "freed once the requests running under it end"
        logger.info("engine core: LoRA adapter %d unloaded, its slot %s", msg.lora_int_id, when)
    elif isinstance(msg, StartProfile) and profiler is not None:
        profiler.start()
    elif isinstance(msg, StopProfile) and profiler is not None:
        profiler.stop()
    else:
        logger.error("engine core: unexpected message %r", msg.tag)
    return True


class ThreadCoreClient:
    """The core loop on a daemon thread of this process (messages stay Python objects)."""

    def __init__(self, core: EngineCore, options: LoopOptions | None = None) -> None:
        self.core, self.options = core, options or LoopOptions()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_message: OnMessage) -> None:
        def recv(timeout: float | None) -> list[Message]:
            msgs = []
            try:
                msgs.append(
                    self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
                )
                while True:
                    msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

        def run() -> None:
            try:
                run_core_loop(self.core, recv, on_message, self.options)
            except Exception as e:  # noqa: BLE001
                logger.exception("engine core loop died")
                on_message(Broken(why=f"engine core loop died: {type(e).__name__}: {e}"))

        self._thread = threading.Thread(target=run, name="engine-core", daemon=True)
        self._thread.start()

    def send(self, msg: Message) -> None:
        self._inbox.put(msg)

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout)


def _exit_with_parent(parent_pid: int, ipc_dir: str, interval: float = 0.1) -> None:
    """Watchdog thread of the engine-core process: when the front end is gone (killed, crashed)
    nobody can be served, so the process exits within `interval` s, mid-step or mid-load too."""
    while os.getppid() == parent_pid:
        time.sleep(interval)
    logger.error("front-end process %d is gone; engine core exiting", parent_pid)
    shutil.rmtree(ipc_dir, ignore_errors=True)  # the front end's socket directory
    os._exit(1)  # NOTE: no zmq linger, no JAX teardown: the process's resources go with it


def core_process_main(spec: CoreSpec, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Entry point of the engine-core process."""
    import msgpack
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end drains, then says "shutdown"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s"
    )
    ipc_dir = os.path.dirname(in_addr.removeprefix("ipc://"))
    threading.Thread(
        target=_exit_with_parent, args=(parent_pid, ipc_dir), name="parent-watchdog", daemon=True
    ).start()
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 5000)  # last words reach a live front end on Shutdown
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)

    def send(msg: Message) -> None:
        outbox.send(msgpack.packb(encode(msg), use_bin_type=True))

    def recv(timeout: float | None) -> list[Any]:
        msgs: list[Any] = []
        wait_ms = 0 if not timeout else int(timeout * 1000)
        while poller.poll(wait_ms):
            msgs.append(msgpack.unpackb(inbox.recv(), raw=False, strict_map_key=False))
            wait_ms = 0
        return msgs

    try:
        core = spec.factory(**spec.kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the front end, which exits
        logger.exception("engine core failed to start")
        send(Broken(why=f"engine core failed to start: {type(e).__name__}: {e}"))
    else:
        run_core_loop(core, recv, send, spec.options)
    finally:
        outbox.close()
        inbox.close(0)
        ctx.term()


__all__ = [
    "GC_YOUNG_THRESHOLD",
    "ThreadCoreClient",
    "core_process_main",
    "run_core_loop",
    "settle_heap",
    "spaced_young_collections",
]
