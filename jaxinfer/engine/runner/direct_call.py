"""A warmed program called through its loaded executable, without JAX's per-call checks.

A `Compiled` call spends ~1 us of host time per argument before anything runs: the arguments'
pytree flattened, each leaf's signature built and compared, layouts checked, numpy leaves
moved. A decode step of the default model takes ~470 arrays (its ~420 weight leaves among them)
and runs every few milliseconds on the engine's own thread, which on a small CPU host shares its
cores with the step itself (BENCHMARKS.md "Host time in the CPU decode step": 1.6-1.9 ms of that
thread's CPU a token in the call). `DirectCall` runs the same executable on one device the way
JAX's own Python path does (`ExecuteReplicated`), less what a repeated call of one signature
does not need:

1. It is made from a program's arguments just before that program's first checked call
   (`DirectCall.of`) and used only after that call succeeded: the first call checked the
   argument types and layouts. It records each argument's pytree structure and its leaves'
   shapes and dtypes.
2. A later call flattens its arguments (the first one, the weights, only when it is another
   object than last time: the runner's weights are immutable pytrees, replaced whole), compares
   structure, shapes and dtypes with the recorded ones (any difference: `None`, and the caller
   makes the checked call, which refuses or recompiles as before), moves numpy leaves to the
   device in one call each and runs the executable; donated arguments are donated as before.
3. `of` returns None where this jax's `Compiled` lacks what it uses (private attributes: the
   caller keeps the checked call), or the program is not a plain one-device executable (effects,
   host callbacks, mutable arrays, several devices), or `JAXINFER_DIRECT_CALL=0`.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

try:  # NOTE: private jax; without it every call stays checked
    from jax._src import core as _core
    from jax._src import dispatch as _dispatch
    from jax._src.lib import xla_client as _xc
except ImportError:  # pragma: no cover - another jax
    _core = _dispatch = _xc = None


# NOTE: read per call, so a benchmark can alternate both paths in one process
ENABLED = os.environ.get("JAXINFER_DIRECT_CALL", "1") != "0" and _xc is not None


def enabled() -> bool:
    return ENABLED


class DirectCall:
    """One program's unchecked call on one device (see the module docstring)."""

    def __init__(self, program: Any, executable: Any, device: Any, specs: list) -> None:
        params = program._params
        self._run = executable.xla_executable.execute_sharded
        self._handlers = executable.out_handler.handlers
        self._name = f"direct {executable.name}"
        self._consts = list(params.const_args)
        self._kept = sorted(executable.kept_var_idx)
        self._out_tree = params.out_tree
        self._device = device
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self._specs = specs  # per argument: (treedef, ((shape, dtype, is numpy), ...))
        self._avals: dict[tuple, Any] = {}
        self._first: tuple[Any, list] | None = None  # (the first argument, its leaves)

    @classmethod
    def of(cls, program: Any, args: tuple) -> DirectCall | None:
        """The direct call of `program` for calls like `program(*args)` (None: not possible)."""
        if not enabled():
            return None
        try:
            params = program._params
            executable = program._executable.unsafe_call
            if (
                type(executable).__name__ != "ExecuteReplicated"
                or params.is_high
                or executable.ordered_effects
                or executable.has_unordered_effects
                or executable.has_host_callbacks
                or executable.mut is not None
                or getattr(executable, "pgle_profiler", None) is not None
                or len(executable._local_devices) != 1
                or jax.tree.structure((args, {})) != params.in_tree
            ):
                return None
            # NOTE: the compiled types: a numpy leaf the checked call converts (float64 under
            # x64 off) is not moved as it is; such a program keeps the checked call
            compiled = iter(jax.tree.leaves(program.in_avals))
            specs = []
            for arg in args:
                leaves, treedef = jax.tree.flatten(arg)
                spec = []
                for x in leaves:
                    aval = next(compiled)
                    if not isinstance(x, jax.Array | np.ndarray) or (x.shape, x.dtype) != (
                        aval.shape,
                        aval.dtype,
                    ):
                        return None  # NOTE: Python scalars too: the checked call
                    spec.append((x.shape, x.dtype, isinstance(x, np.ndarray)))
                specs.append((treedef, tuple(spec)))
            return cls(program, executable, executable._local_devices[0], specs)
        except (AttributeError, StopIteration):
            return None

    def __call__(self, args: tuple) -> Any:
        """The program's results, or None when `args` differ from the recorded call's."""
        if not ENABLED or len(args) != len(self._specs) or _dispatch.needs_check_special():
            return None
        flat: list = list(self._consts)
        for i, (arg, (treedef, spec)) in enumerate(zip(args, self._specs, strict=True)):
            if i == 0 and self._first is not None and self._first[0] is arg:
                flat += self._first[1]
                continue
            leaves, tree = jax.tree.flatten(arg)
            if tree != treedef:
                return None
            for j, (x, (shape, dtype, host)) in enumerate(zip(leaves, spec, strict=True)):
                if (
                    not isinstance(x, np.ndarray if host else jax.Array)
                    or x.shape != shape
                    or x.dtype != dtype
                ):
                    return None
                if host:
                    leaves[j] = self._put(x)
            if i == 0:
                self._first = (arg, leaves)
            flat += leaves
        with jax.profiler.TraceAnnotation(self._name):  # NOTE: the jit's host span in a trace
            results = self._run([flat[k] for k in self._kept])
            out = results.consume_with_handlers(self._handlers)
        return jax.tree.unflatten(self._out_tree, out)

    def _put(self, x: np.ndarray) -> jax.Array:
        key = (x.shape, x.dtype)
        aval = self._avals.get(key)
        if aval is None:
            aval = self._avals[key] = _core.ShapedArray(x.shape, x.dtype)
        return _xc.batched_device_put(aval, self._sharding, [x], [self._device], True)


__all__ = ["DirectCall", "enabled"]
