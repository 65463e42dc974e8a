"""Profiler traces of the engine core that read well in TensorBoard's profile plugin / xprof.

1. `instrument(core)` (the core loop calls it when profiling is possible: `--trace-dir` or
   `--profile-port`) wraps the core's scheduler and runner methods, on those instances, in
   `jax.profiler.TraceAnnotation`s named `schedule`, `update`, `prepare`, `launch` (args: the
   step's `kind` prefill / decode / mixed / idle, `tokens`, `seqs`), `sample` and `collect`.
2. `step_annotation(step_num)`: the `jax.profiler.StepTraceAnnotation("engine_step", step_num=N)`
   the loop wraps around each `EngineCore.step()`: the Overview page's steps, and the trace
   viewer's step markers. The device ops carry the model's `jax.named_scope`s
   (`layer_N/attention`, `layer_N/mlp`, `sampler`) in their op names.
3. `Profiler` captures (without JAX's Python tracer: `_options`): the first `--trace-steps` busy
   steps into `--trace-dir`, and on demand (`start()` / `stop()`, from the front end's
   `/start_profile` / `/stop_profile`). `stop()`
   hands `jax.profiler.stop_trace` (it collects and serializes the trace: seconds) to a thread of
   its own, so the engine thread goes on stepping; the path is logged once the trace is written.

NOTE: JAX is imported only by the functions that run in the engine-core process (this module is
imported by `core_loop`, which the front end imports to name the process entry).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxinfer.engine.core import EngineCore

logger = logging.getLogger(__name__)

STEP_NAME = "engine_step"


def step_kind(sched: Any) -> str:
    """prefill (no decode row), decode (only decode rows), mixed, or idle (nothing scheduled)."""
    decodes = sched.num_decodes
    if not sched.scheduled:
        return "idle"
    if decodes == 0:
        return "prefill"
    return "decode" if decodes == len(sched.scheduled) else "mixed"


def _annotated(name: str, fn: Callable, args_of: Callable | None = None) -> Callable:
    import jax

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        extra = args_of(*args) if args_of is not None and args else {}
        with jax.profiler.TraceAnnotation(name, **extra):
            return fn(*args, **kwargs)

    return wrapper


def _step_args(sched: Any) -> dict[str, Any]:
    return {
        "kind": step_kind(sched),
        "tokens": sched.num_batched_tokens,
        "seqs": len(sched.scheduled),
    }


def instrument(core: EngineCore) -> None:
    """Wraps the core's scheduler and runner methods in trace annotations (see the docstring)."""
    sched, runner = core.scheduler, core.runner
    sched.schedule = _annotated("schedule", sched.schedule)
    sched.update = _annotated("update", sched.update)
    for name, args_of in (
        ("prepare", _step_args),
        ("launch", _step_args),
        ("sample", None),
        ("collect", None),
    ):
        fn = getattr(runner, name, None)
        if fn is not None:
            setattr(runner, name, _annotated(name, fn, args_of))


def step_annotation(step_num: int) -> contextlib.AbstractContextManager:
    import jax

    return jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step_num)


class Profiler:
    """One capture at a time: `--trace-steps` busy steps from the start, or `start()`..`stop()`."""

    def __init__(self, trace_dir: str | None, steps: int = 0) -> None:
        self.dir, self.left = trace_dir, steps if trace_dir else 0
        self.on = False
        self._stopping: threading.Thread | None = None

    def before(self) -> None:
        """Before a step: starts the `--trace-steps` capture."""
        if self.left > 0 and not self.on and not self.start():
            self.left = 0

    def after(self, busy: bool) -> None:
        if self.on and busy and self.left > 0:
            self.left -= 1
            if self.left <= 0:
                self.stop()

    def start(self) -> bool:
        """Starts a capture into the trace dir; False (logged) when one runs or is being written,
        or when there is no trace dir."""
        if self.dir is None:
            logger.warning("profiler: no trace directory (--trace-dir): nothing to start")
            return False
        if self.on or (self._stopping is not None and self._stopping.is_alive()):
            logger.warning("profiler: a trace is already running or being written")
            return False
        import jax

        try:
            jax.profiler.start_trace(self.dir, profiler_options=_options())
        except Exception:  # noqa: BLE001 - a profiler problem must not take the core down
            logger.exception("could not start a profiler trace in %s", self.dir)
            return False
        self.on = True
        logger.info("profiler trace started into %s", self.dir)
        return True

    def stop(self, wait: bool = False) -> None:
        """Stops the capture; the trace is written on a thread of its own (`wait`: joined)."""
        if not self.on:
            return
        self.on, self.left = False, 0
        self._stopping = threading.Thread(target=self._write, name="profiler-stop", daemon=True)
        self._stopping.start()
        if wait:
            self._stopping.join()

    def _write(self) -> None:
        import jax

        start = time.perf_counter()
        try:
            jax.profiler.stop_trace()
        except Exception:  # noqa: BLE001
            logger.exception("could not stop the profiler trace")
            return
        logger.info(
            "profiler trace written to %s in %.1fs (open with: tensorboard --logdir %s)",
            latest_trace(self.dir) or self.dir,
            time.perf_counter() - start,
            self.dir,
        )


def _options() -> Any:
    """The capture's options: JAX's defaults without the Python tracer.

    NOTE: the Python tracer records every Python call of every thread: a capture whose steps
    compile (the first `--trace-steps` steps under `--no-warmup`, a new bucket) holds JAX's
    whole tracing and lowering, and `stop_trace` took 29.3 s to write two such steps of a
    draft-model int8 engine (1.3 s without it; tests/test_served_engine_flags.py waits for that
    trace). The annotations above name the engine's host phases instead.
    """
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    return options


def latest_trace(trace_dir: str | None) -> str | None:
    """The newest `*.xplane.pb` under `trace_dir/plugins/profile/<run>/` (None: none yet)."""
    if not trace_dir:
        return None
    root = os.path.join(trace_dir, "plugins", "profile")
    found = []
    with contextlib.suppress(OSError):
        for run in os.listdir(root):
            for name in os.listdir(os.path.join(root, run)):
                if name.endswith(".xplane.pb"):
                    path = os.path.join(root, run, name)
                    found.append((os.path.getmtime(path), path))
    return max(found)[1] if found else None


__all__ = ["STEP_NAME", "Profiler", "instrument", "latest_trace", "step_annotation", "step_kind"]
