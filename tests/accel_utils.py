"""Abstract accelerators for deviceless compiles (issue 30): XLA compiles for a device it does not
have, through the TPU (libtpu) and CUDA plugins, with JAX on the CPU platform.

1. `tpu_device(name)`: one chip of a TPU topology ("v5e", "v6e"), from
   `topologies.get_topology_desc(f"{name}:1x1", "tpu", chips_per_host_bounds=(1, 1, 1))`;
   `ALLOW_MULTIPLE_LIBTPU_LOAD=1` so pytest workers (and other processes) share libtpu.
2. `h100_device()`: one H100 SXM, from `get_topology_desc(platform="cuda", target_config=...,
   topology="1x1x1")` with XLA's spec `jaxinfer/aot_targets/h100_sxm.txtpb`.
3. Both skip the calling test when their plugin is absent (a venv without the `aot` extra).
Compile for one with `jax.jit(f).lower(*shape_dtype_structs_with_its_sharding).compile()`.
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import pytest

H100_SPEC = pathlib.Path(__file__).resolve().parent.parent / "jaxinfer/aot_targets/h100_sxm.txtpb"


@functools.cache
def _tpu(name: str):
    from jax.experimental import topologies

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        topo = topologies.get_topology_desc(f"{name}:1x1", "tpu", chips_per_host_bounds=(1, 1, 1))
    except Exception as e:  # no libtpu, or one that does not know the chip
        return f"no TPU {name} topology: {e}"
    return topo.devices[0]


@functools.cache
def _h100():
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(
            platform="cuda", target_config=H100_SPEC.read_text(), topology="1x1x1"
        )
    except Exception as e:  # no CUDA plugin
        return f"no H100 topology: {e}"
    return topo.devices[0]


def _or_skip(device):
    if isinstance(device, str):
        pytest.skip(device.splitlines()[0][:200])
    return device


def tpu_device(name: str = "v5e"):
    """One chip of TPU `name` ("v5e", "v6e"); skips the test without libtpu."""
    return _or_skip(_tpu(name))


def h100_device():
    """One abstract H100 SXM; skips the test without the CUDA plugin."""
    return _or_skip(_h100())


def on(device, x):
    """`x` (arrays / ShapeDtypeStructs, pytrees) as ShapeDtypeStructs placed on `device`."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), x)
