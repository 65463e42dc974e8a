"""The front end's side of the engine core: how it starts one in a process of its own and talks
to it (pyzmq sockets, msgpack frames of the typed messages of `jaxinfer.engine.types`, one per
step each way). Imports no JAX: the front-end process never loads it.

1. `CoreSpec` says how the engine-core process builds its core (`factory(**kwargs)`, run there)
   and the loop's `LoopOptions`.
2. `ProcessCoreClient.start(on_message)` spawns the engine-core process (the only one that
   touches the devices; its entry is `core_loop.core_process_main`), binds two ipc sockets, and
   runs a receiver thread that hands each message, decoded into its type, to the front end.
   The process preloads jemalloc where the machine has it (`jaxinfer.engine.allocator`).
   `send(msg)` encodes and sends one. Either side's death is detected: the receiver reports
   `Broken(exited=True)` within 0.2 s of the process exiting unasked (the front end then exits);
   the core process exits within 0.1 s of its parent's death (`core_loop.core_process_main`).
3. `core_loop.ThreadCoreClient` is the same interface over a thread of this process (it holds
   an `EngineCore`, so it lives on the core's side).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jaxinfer.engine import allocator
from jaxinfer.engine.types import Broken, Message, Shutdown, decode_message, encode

if TYPE_CHECKING:
    from jaxinfer.engine.core import EngineCore

logger = logging.getLogger(__name__)

OnMessage = Callable[[Message], None]
_ENVIRON_LOCK = threading.Lock()


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    """`os.environ` with `extra` set while a child process starts, then as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclasses.dataclass
class LoopOptions:
    warmup: bool = True
    max_step_failures: int = 3
    trace_dir: str | None = None  # jax profiler trace of the first `trace_steps` busy steps
    trace_steps: int = 0
    profile_port: int | None = None  # jax.profiler server in the core's process (live capture)
    kv_events: str | None = None  # vLLM's --kv-events-config JSON (jaxinfer/engine/kv_events.py)


@dataclasses.dataclass
class CoreSpec:
    """How the engine-core process builds its core: `factory(**kwargs) -> EngineCore`.

    `factory` must be importable by name (a module-level function): the process is spawned.
    """

    factory: Callable[..., EngineCore]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: LoopOptions = dataclasses.field(default_factory=LoopOptions)
    log_level: int = logging.INFO


class ProcessCoreClient:
    """The core loop in a spawned process of its own (see the module docstring)."""

    def __init__(self, spec: CoreSpec) -> None:
        self.spec = spec
        self.options = spec.options
        self.process: Any = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, on_message: OnMessage) -> None:
        import multiprocessing

        import zmq

        from jaxinfer.engine.core_loop import core_process_main  # NOTE: imports no JAX

        self._dir = tempfile.mkdtemp(prefix="jaxinfer-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)  # front end -> core
        self._out.bind(in_addr)
        self._in = self._ctx.socket(zmq.PULL)  # core -> front end
        self._in.bind(out_addr)
        self.process = multiprocessing.get_context("spawn").Process(
            target=core_process_main,
            args=(self.spec, in_addr, out_addr, os.getpid()),
            name="jaxinfer-engine-core",
            daemon=True,
        )
        extra = allocator.core_env()  # NOTE: the spawned process inherits the environment
        with _ENVIRON_LOCK, _environ(extra):
            self.process.start()
        logger.info(
            "engine core process %d started%s",
            self.process.pid,
            f" ({allocator.ENV}: LD_PRELOAD={extra['LD_PRELOAD']})" if extra else "",
        )
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
                w = msgpack.unpackb(self._in.recv(), raw=False, strict_map_key=False)
                on_message(decode_message(w))
            elif not self.process.is_alive():
                if poller.poll(0):  # its last words first
                    continue
                if not self._stopping.is_set():
                    code = self.process.exitcode
                    logger.error("the engine core process exited (code %s)", code)
                    why = f"the engine core process exited (code {code})"
                    on_message(Broken(why=why, exited=True))
                return

    def send(self, msg: Message | Sequence) -> None:
        import msgpack

        data = msgpack.packb(encode(msg), use_bin_type=True)
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
                self._out.send(msgpack.packb(Shutdown(), use_bin_type=True), zmq.NOBLOCK)
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


__all__ = ["CoreSpec", "LoopOptions", "OnMessage", "ProcessCoreClient"]
