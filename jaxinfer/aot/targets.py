"""Abstract compile targets: an accelerator topology this machine does not have.

1. `get_target("h100")`, `"h100x8"` (8 H100 SXM on one host), `"v5e:1x1"`, `"v6e:2x2"`,
   `"v5e:2x4"`, `"v5p:2x2x1"`, `"v4:2x2x1"`: the devices of
   `jax.experimental.topologies.get_topology_desc` for it - for the GPU from XLA's own H100 SXM
   target description (`h100_sxm.txtpb` beside this file), for the TPU from libtpu - plus the
   HBM one device has (the GPU spec's `device_memory_size`; on TPU what its compiler allows).
2. Deviceless compiles need JAX on the CPU platform (`JAX_PLATFORMS=cpu`, set before JAX starts:
   the CUDA plugin then registers its compiler without looking for a driver, and libtpu does not
   probe for a TPU) and the plugins (`pip install -e '.[aot]'`); a target whose plugin is missing
   is refused saying which to install.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Any

import jax

from jaxinfer import params as params_lib

SPEC_DIR = os.path.dirname(os.path.abspath(__file__))
H100_SPEC = os.path.join(SPEC_DIR, "h100_sxm.txtpb")
# HBM a program may use on one TPU device, by the topology's device_kind: what libtpu 0.0.42.1's
# compiler reports as "available HBM" when a program exceeds it (GiB; measured 2026-11-25).
TPU_HBM = {
    "TPU v4": int(15.25 * 2**30),  # per TensorCore (a v4 topology lists cores)
    "TPU v5 lite": int(15.75 * 2**30),
    "TPU v5": int(95.74 * 2**30),  # v5p
    "TPU v6 lite": int(31.25 * 2**30),
}
_TPU = re.compile(r"^(v4|v5e|v5p|v6e):(\d+)x(\d+)(?:x(\d+))?$")
_GPU = re.compile(r"^h100(?:x(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Target:
    """One abstract topology: its devices (not attached to this machine) and their HBM."""

    name: str
    platform: str  # "gpu" | "tpu"
    devices: tuple[Any, ...]
    hbm_bytes: int  # per device

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind

    @property
    def num_devices(self) -> int:
        return len(self.devices)


def get_target(name: str) -> Target:
    """The target `name` names (see the module docstring); ValueError for an unknown name."""
    return _target(name.strip().lower())


@functools.cache
def _target(name: str) -> Target:
    gpu, tpu = _GPU.match(name), _TPU.match(name)
    if gpu:
        count = int(gpu.group(1) or 1)
        spec = h100_spec()
        devices = _topology(
            "cuda",
            "the CUDA plugin: pip install -e '.[aot]'",
            target_config=spec,
            topology=f"1x{count}x1",
        )
        hbm = int(re.search(r"device_memory_size:\s*(\d+)", spec).group(1))
        return Target(name, "gpu", devices, hbm)
    if tpu:
        dims = [int(d) for d in tpu.groups()[1:] if d is not None]
        bounds = (*dims, 1)[:3] if len(dims) == 2 else tuple(dims)
        devices = _topology(
            "tpu",
            "libtpu: pip install -e '.[aot]'",
            topology_name=name,
            chips_per_host_bounds=bounds,
        )
        kind = devices[0].device_kind
        if kind not in TPU_HBM:
            raise ValueError(f"target {name!r}: no HBM size known for device kind {kind!r}")
        return Target(name, "tpu", devices, TPU_HBM[kind])
    raise ValueError(
        f"unknown target {name!r}: use 'h100', 'h100xN' (N H100s on one host) or a TPU slice "
        f"'v5e:1x1', 'v6e:2x2', 'v5e:2x4', 'v5p:2x2x1', 'v4:2x2x1'"
    )


def h100_spec() -> str:
    """XLA's H100 SXM `GpuTargetConfigProto` text (`h100_sxm.txtpb`)."""
    with open(H100_SPEC) as f:
        return f.read()


def _topology(platform: str, install: str, **kwargs: Any) -> tuple[Any, ...]:
    from jax.experimental import topologies

    # NOTE: several processes (pytest -n 2) may load libtpu; without this they fight over its lock
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if jax.default_backend() != "cpu":
        raise RuntimeError(
            f"deviceless compiles need JAX on the CPU platform: set JAX_PLATFORMS=cpu before JAX "
            f"starts (it runs on {jax.default_backend()!r})"
        )
    if "topology_name" in kwargs:
        name = kwargs.pop("topology_name")
        call = functools.partial(topologies.get_topology_desc, name, platform)
    else:
        call = functools.partial(topologies.get_topology_desc, platform=platform)
    try:
        topo = call(**kwargs)
    except (NotImplementedError, RuntimeError) as e:
        raise RuntimeError(f"no {platform} compiler here ({e}); install {install}") from e
    return tuple(topo.devices)


def available(platform: str) -> str | None:
    """None when `platform`'s ("gpu" | "tpu") deviceless compiler works here, else why not."""
    try:
        get_target("h100" if platform == "gpu" else "v5e:1x1")
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def bytes_per_device(tree: Any) -> int:
    """Bytes of one device's shard of every (sharded) `jax.ShapeDtypeStruct` in `tree`: the
    largest shard where they differ."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += params_lib.array_bytes(shape, x.dtype)
    return total
