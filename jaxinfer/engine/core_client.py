"""The engine core as a service: a loop that drives an `EngineCore` from messages, and the two
clients a front end talks to it through: on a thread of its own process, or in a process of its
own (pyzmq sockets, msgpack messages; one message per step each way).

Messages are msgpack-able lists.
  front end -> core: ["add", [CoreRequest wire...]]  ["abort", [child ids]]
                     ["finish", [[child id, stop string], ...]]  ["shutdown"]
  core -> front end: ["loaded", info]  ["ready", info]  ["broken", why]
                     ["step", [TokenOutput wire...], lost ids, error, stats]

1. `run_core_loop` says "loaded" (the model is on its devices; `info()`: capacity, limits), warms
   the core up (every program compiled), says "ready", then
   loops: take every queued message, step while there is work (blocking on the inbox when there
   is none), send one "step" message per step that produced anything.
2. A step that raises loses the requests `failed_request_ids` names: the loop aborts them in the
   core and reports them (with the error) in that step's message; everything else carries on.
   After `max_step_failures` consecutive failures the core is declared broken ("broken"), as it
   is when warmup fails.
3. `ProcessCoreClient` spawns the engine-core process (the only one that touches the devices),
   binds two ipc sockets, and runs a receiver thread that hands each message to the front end.
   Either side's death is detected: the receiver reports "broken" when the process exits
   unasked; the core process exits when its parent disappears. SIGINT/SIGTERM are ignored by the
   core process: the front end drains on them and then sends "shutdown".
4. `ThreadCoreClient` runs the same loop on a thread over queues (multi-host leaders, tests).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from jaxinfer.engine.core import CoreRequest, EngineCore, from_wire, to_wire
from jaxinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Message = list
OnMessage = Callable[[Message], None]


def request_to_wire(r: CoreRequest) -> list:
    return [
        r.request_id,
        r.prompt_token_ids,
        dataclasses.asdict(r.sampling),
        list(r.eos_token_ids),
        r.priority,
    ]


def request_from_wire(w: list) -> CoreRequest:
    sp = w[2]
    return CoreRequest(w[0], list(w[1]), SamplingParams(**sp), tuple(w[3]), w[4])


@dataclasses.dataclass
class LoopOptions:
    warmup: bool = True
    max_step_failures: int = 3
    trace_dir: str | None = None  # jax profiler trace of the first `trace_steps` busy steps
    trace_steps: int = 0
    profile_port: int | None = None  # jax.profiler server in the core's process (live capture)


class _Tracer:
    def __init__(self, trace_dir: str | None, steps: int) -> None:
        self.dir, self.left = trace_dir, steps if trace_dir else 0
        self.on = False

    def before(self) -> None:
        if self.left > 0 and not self.on:
            import jax

            try:
                jax.profiler.start_trace(self.dir)
                self.on = True
                logger.info("tracing the next %d engine steps into %s", self.left, self.dir)
            except Exception:  # noqa: BLE001 - a profiler problem must not take the core down
                logger.exception("could not start a profiler trace in %s", self.dir)
                self.left = 0

    def after(self, busy: bool) -> None:
        if self.on and busy:
            self.left -= 1
            if self.left <= 0:
                self.stop()

    def stop(self) -> None:
        if self.on:
            import jax

            self.on, self.left = False, 0
            try:
                jax.profiler.stop_trace()
                logger.info(
                    "profiler trace written to %s (open with: tensorboard --logdir %s)",
                    self.dir,
                    self.dir,
                )
            except Exception:  # noqa: BLE001
                logger.exception("could not stop the profiler trace")


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
    """Drives `core` until a "shutdown" message (see the module docstring).

    Args:
      recv: `recv(timeout)` returns the queued messages (waiting up to `timeout` seconds for the
        first one; 0: do not wait).
      send: delivers one message to the front end.
    """
    send(["loaded", core.info()])
    if options.profile_port is not None:
        import jax

        jax.profiler.start_server(options.profile_port)
    try:
        programs = core.warmup() if options.warmup else int(getattr(core.runner, "num_compiled", 0))
    except Exception as e:  # noqa: BLE001
        logger.exception("warmup failed")
        send(["broken", f"warmup failed: {type(e).__name__}: {e}"])
        return
    send(["ready", {**core.info(), "compiled_programs": programs}])
    settle_heap()
    tracer = _Tracer(options.trace_dir, options.trace_steps)
    failures, stalled = 0, False
    try:
        while True:
            # NOTE: with work, only take what is queued; stalled (work, but nothing could be
            # scheduled, e.g. every request waits for pages an abort will free): wait a little.
            timeout = (0.05 if stalled else 0.0) if core.has_unfinished() else 1.0
            for msg in recv(timeout):
                if not _handle(core, msg, send):
                    return
            if not core.has_unfinished():
                continue
            steps = core.num_steps
            tracer.before()
            start = time.perf_counter()
            try:
                outputs, lost, error = core.step(), [], None
                failures = 0
            except Exception as e:  # noqa: BLE001 - the requests it lost fail, the rest go on
                failures += 1
                lost, outputs = list(core.failed_request_ids), []
                error = f"engine step failed: {type(e).__name__}: {e}"
                logger.exception(
                    "engine step failed; failing the %d requests it scheduled: %s", len(lost), lost
                )
                for rid in lost:
                    core.abort(rid)
            busy = core.num_steps > steps
            tracer.after(busy)
            if outputs or lost:
                stats = {**core.stats(), "step_s": time.perf_counter() - start}
                send(["step", [to_wire(o) for o in outputs], lost, error, stats])
            if failures >= options.max_step_failures:
                why = f"{failures} consecutive engine steps failed"
                logger.error("engine broken: %s", why)
                send(["broken", why])
                return
            stalled = not busy and not outputs
    finally:
        tracer.stop()


def _handle(core: EngineCore, msg: Message, send: Callable[[Message], None]) -> bool:
    """Applies one front-end message; False on "shutdown"."""
    kind = msg[0]
    if kind == "add":
        for w in msg[1]:
            req = request_from_wire(w) if isinstance(w, list) else w
            try:
                core.add(req)
            except ValueError as e:  # the front end checks first; a bad one must not crash us
                send(["step", [], [req.request_id], f"rejected: {e}", core.stats()])
    elif kind == "abort":
        for rid in msg[1]:
            core.abort(rid)
    elif kind == "finish":
        for rid, stop in msg[1]:
            core.finish(rid, "stop", stop)
    elif kind == "shutdown":
        return False
    else:
        logger.error("engine core: unknown message %r", kind)
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
                on_message(["broken", f"engine core loop died: {type(e).__name__}: {e}"])

        self._thread = threading.Thread(target=run, name="engine-core", daemon=True)
        self._thread.start()

    def send(self, msg: Message) -> None:
        self._inbox.put(msg)

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(["shutdown"])
        if self._thread is not None:
            self._thread.join(timeout)


@dataclasses.dataclass
class CoreSpec:
    """How the engine-core process builds its core: `factory(**kwargs) -> EngineCore`.

    `factory` must be importable by name (a module-level function): the process is spawned.
    """

    factory: Callable[..., EngineCore]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: LoopOptions = dataclasses.field(default_factory=LoopOptions)
    log_level: int = logging.INFO


def _core_process_main(spec: CoreSpec, in_addr: str, out_addr: str, parent_pid: int) -> None:
    """Entry point of the engine-core process."""
    import msgpack
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end drains, then says "shutdown"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s"
    )
    ctx = zmq.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 5000)
    poller = zmq.Poller()
    poller.register(inbox, zmq.POLLIN)

    def send(msg: Message) -> None:
        outbox.send(msgpack.packb(msg, use_bin_type=True))

    def recv(timeout: float | None) -> list[Message]:
        msgs: list[Message] = []
        wait_ms = 0 if not timeout else int(timeout * 1000)
        while True:
            if not poller.poll(wait_ms):
                if os.getppid() != parent_pid:  # the front end died: nobody to serve
                    logger.error("front-end process %d is gone; engine core exiting", parent_pid)
                    return [["shutdown"]]
                return msgs
            msgs.append(msgpack.unpackb(inbox.recv(), raw=False, strict_map_key=False))
            wait_ms = 0

    try:
        core = spec.factory(**spec.kwargs)
    except Exception as e:  # noqa: BLE001 - reported to the front end, which exits
        logger.exception("engine core failed to start")
        send(["broken", f"engine core failed to start: {type(e).__name__}: {e}"])
    else:
        run_core_loop(core, recv, send, spec.options)
    finally:
        outbox.close()
        inbox.close(0)
        ctx.term()


class ProcessCoreClient:
    """The core loop in a spawned process of its own (see the module docstring)."""

    def __init__(self, spec: CoreSpec) -> None:
        self.spec = spec
        self.process: Any = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, on_message: OnMessage) -> None:
        import multiprocessing

        import zmq

        self._dir = tempfile.mkdtemp(prefix="jaxinfer-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)  # front end -> core
        self._out.bind(in_addr)
        self._in = self._ctx.socket(zmq.PULL)  # core -> front end
        self._in.bind(out_addr)
        self.process = multiprocessing.get_context("spawn").Process(
            target=_core_process_main,
            args=(self.spec, in_addr, out_addr, os.getpid()),
            name="jaxinfer-engine-core",
            daemon=True,
        )
        self.process.start()
        logger.info("engine core process %d started", self.process.pid)
        self._thread = threading.Thread(
            target=self._receive, args=(on_message,), name="engine-core-receiver", daemon=True
        )
        self._thread.start()

    def _receive(self, on_message: OnMessage) -> None:
        import msgpack
        import zmq

        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        while not self._stopping.is_set():
            if poller.poll(200):
                on_message(msgpack.unpackb(self._in.recv(), raw=False, strict_map_key=False))
            elif not self.process.is_alive():
                if poller.poll(0):  # its last words first
                    continue
                if not self._stopping.is_set():
                    code = self.process.exitcode
                    logger.error("the engine core process exited (code %s)", code)
                    on_message(["broken", f"the engine core process exited (code {code})"])
                return

    def send(self, msg: Message) -> None:
        import msgpack

        data = msgpack.packb(msg, use_bin_type=True)
        with self._lock:
            self._out.send(data)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        self._stopping.set()
        if self.process.is_alive():
            import msgpack
            import zmq

            # NOTE: never block: a core that is exiting (it failed to start) has no socket left,
            # and a PUSH socket without a peer would wait for one forever.
            with contextlib.suppress(Exception), self._lock:  # no peer: zmq.Again
                self._out.send(msgpack.packb(["shutdown"], use_bin_type=True), zmq.NOBLOCK)
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("engine core process did not stop in %.0fs; terminating", timeout)
                self.process.kill()
                self.process.join(5)
        if self._thread is not None:
            self._thread.join(2)
        self._out.close(0)
        self._in.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def wire_outputs(msg: Message) -> list:
    """The `TokenOutput`s of a "step" message."""
    return [from_wire(w) if isinstance(w, list) else w for w in msg[1]]


__all__ = [
    "CoreSpec",
    "LoopOptions",
    "ProcessCoreClient",
    "ThreadCoreClient",
    "request_to_wire",
    "run_core_loop",
    "wire_outputs",
]
