"""The platform that kernels are picked and compiled for: the target, which is not always JAX's
default backend (an ahead-of-time compile on a CPU machine for an H100 or a TPU).

1. `platform()` is the target platform ("cpu" | "gpu" | "tpu"): the device of the innermost
   `use_target(device)`, else JAX's default backend. Every kernel choice and interpret-mode
   decision asks it instead of `jax.default_backend()`.
2. `use_target(device)` (what `jaxinfer.aot` wraps a runner's construction, lowering and
   compilation in) names a device of the target topology, e.g. an H100 of
   `jax.experimental.topologies.get_topology_desc`; `device()` returns it (None outside), so
   per-device numbers (the GPU's SM count) come from the target too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax

_TARGET: contextvars.ContextVar[Any] = contextvars.ContextVar("pallas_kernels_target", default=None)
_PLATFORMS = {"cuda": "gpu", "rocm": "gpu"}


def device() -> Any:
    """The device of the innermost `use_target` (None outside one)."""
    return _TARGET.get()


def platform() -> str:
    """The target platform: "cpu", "gpu" or "tpu" (see the module docstring)."""
    dev = _TARGET.get()
    name = dev.platform if dev is not None else jax.default_backend()
    return _PLATFORMS.get(name, name)


@contextlib.contextmanager
def use_target(dev: Any) -> Iterator[None]:
    """Picks kernels and interpret modes for `dev`'s platform inside the block."""
    token = _TARGET.set(dev)
    try:
        yield
    finally:
        _TARGET.reset(token)
