"""Abstract accelerators for deviceless compiles (issue 30): XLA compiles for a device it does not
have, through the TPU (libtpu) and CUDA plugins, with JAX on the CPU platform.

1. `tpu_device(name)`: one chip of a TPU ("v5e", "v6e"), `jaxinfer.aot`'s `"{name}:1x1"` target.
2. `h100_device()`: one H100 SXM, `jaxinfer.aot`'s `"h100"` target (XLA's H100 spec).
3. Both skip the calling test when their plugin is absent (a venv without the `aot` extra).
Compile for one with `jax.jit(f).lower(*shape_dtype_structs_with_its_sharding).compile()`.
"""

from __future__ import annotations

import functools

import jax
import pytest

from jaxinfer.aot import targets


@functools.cache
def _device(name: str):
    try:
        return targets.get_target(name).devices[0]
    except (RuntimeError, ValueError) as e:  # no plugin, or one that does not know the chip
        return f"no {name} target: {e}"


def _or_skip(device):
    if isinstance(device, str):
        pytest.skip(device.splitlines()[0][:200])
    return device


def tpu_device(name: str = "v5e"):
    """One chip of TPU `name` ("v5e", "v6e"); skips the test without libtpu."""
    return _or_skip(_device(f"{name}:1x1"))


def h100_device():
    """One abstract H100 SXM; skips the test without the CUDA plugin."""
    return _or_skip(_device("h100"))


def on(device, x):
    """`x` (arrays / ShapeDtypeStructs, pytrees) as ShapeDtypeStructs placed on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), x)
