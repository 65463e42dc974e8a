"""Parameters declared once.

1. A model describes every weight with a `ParamSpec` (shape, dtype, logical axis names, init) in a
   pytree whose structure is the params tree itself (dataclasses of specs).
2. From that one declaration we derive: the abstract tree (`abstract`), the sharding tree for a
   mesh (`shardings`), random weights (`init_random`; `init_on_device` builds them in jitted programs
   straight into their shardings: `load_format="dummy"`), and checkpoint restore targets
   (abstract + shardings).
3. Loaders fill the same tree with arrays (`checked_array` verifies each against its spec).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import sharding as shd

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    dtype: Any
    logical_axes: tuple[str | None, ...]
    # "normal" (std = scale) | "ones" | "zeros" | "constant" (= scale) | "iota" (0, 1, ... of a 1-D
    # integer leaf: an act-order weight's identity permutation)
    init: str = "normal"
    scale: float = 0.02
    # The contraction axis of a weight that `quantization=` may store quantized (one scale per
    # output channel, see `jaxinfer.quantization`); None for weights kept in the model dtype.
    quant_axis: int | None = None

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.logical_axes):
            raise ValueError(
                f"shape {self.shape} and logical axes {self.logical_axes} differ in rank"
            )
        if self.quant_axis is not None and not 0 <= self.quant_axis < len(self.shape):
            raise ValueError(f"quant_axis {self.quant_axis} is outside shape {self.shape}")


def is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def map_specs(fn: Callable[[ParamSpec], Any], specs: Any) -> Any:
    return jax.tree.map(fn, specs, is_leaf=is_spec)


def abstract(specs: Any, mesh: jax.sharding.Mesh | None = None, rules: dict | None = None) -> Any:
    """ShapeDtypeStruct tree (with shardings when a mesh is given): restore targets, eval_shape."""
    if mesh is None:
        return map_specs(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), specs)
    return map_specs(
        lambda s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=shd.named_sharding(mesh, s.logical_axes, rules)
        ),
        specs,
    )


def shardings(specs: Any, mesh: jax.sharding.Mesh, rules: dict | None = None) -> Any:
    return map_specs(lambda s: shd.named_sharding(mesh, s.logical_axes, rules), specs)


def partition_specs(specs: Any, rules: dict | None = None) -> Any:
    """PartitionSpec tree (the `shard_map` in/out specs of a params tree)."""
    return map_specs(lambda s: shd.logical_to_spec(s.logical_axes, rules), specs)


def _init_leaf(s: ParamSpec, key: jax.Array) -> jax.Array:
    if s.init == "ones":
        return jnp.ones(s.shape, s.dtype)
    if s.init == "zeros":
        return jnp.zeros(s.shape, s.dtype)
    if s.init == "constant":
        return jnp.full(s.shape, s.scale, s.dtype)
    if s.init == "iota":
        return jnp.arange(s.shape[0], dtype=s.dtype)
    x = s.scale * jax.random.normal(key, s.shape, jnp.float32)
    if jnp.issubdtype(s.dtype, jnp.integer):  # quantized data: the int8 grid, int4 codes 0..15
        info = jnp.iinfo(s.dtype)
        mid = (int(info.max) + 1) // 2 if int(info.min) == 0 else 0
        x = jnp.clip(jnp.rint(x) + mid, max(int(info.min), -127), int(info.max))
    return x.astype(s.dtype)


def init_random(specs: Any, key: jax.Array) -> Any:
    """Random weights for tests: each leaf gets its own key folded from its path."""
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    return jax.tree.unflatten(
        treedef, [_init_leaf(s, jax.random.fold_in(key, i)) for i, s in enumerate(leaves)]
    )


OWN_PROGRAM_BYTES = 64 << 20


@functools.lru_cache(maxsize=64)
def _init_program(spec: ParamSpec, sharding: jax.sharding.Sharding) -> Callable:
    """`_init_leaf` of one leaf as a jitted program of (key, leaf index), its output in `sharding`."""
    return jax.jit(
        lambda key, i: _init_leaf(spec, jax.random.fold_in(key, i)), out_shardings=sharding
    )


def init_on_device(specs: Any, key: jax.Array, shardings: Any) -> Any:
    """`init_random`'s values, computed by jitted programs whose outputs land in `shardings` (a tree
    of `jax.sharding.Sharding` matching `specs`): no weight is materialized on the host, and each
    device computes only its own shards (JAX's partitionable threefry).

    NOTE: one program per set of devices (a pipeline stage's layers live on its devices only), and
    one per leaf of more than `OWN_PROGRAM_BYTES` f32 bytes (its index an argument: one compile per
    shape): in one program XLA:CPU kept every leaf's f32 draws live at once (35 GB of temp for the
    int8 4B Gemma 3's 4 GB of weights, BENCHMARKS.md "Quantized steps' temp memory on XLA:CPU").
    """
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    targets = treedef.flatten_up_to(shardings)
    groups: dict[tuple[int, ...], list[int]] = {}
    out: list[Any] = [None] * len(leaves)
    for i, sharding in enumerate(targets):
        if 4 * int(np.prod(leaves[i].shape)) > OWN_PROGRAM_BYTES:
            out[i] = _init_program(leaves[i], sharding)(key, i)
            continue
        groups.setdefault(tuple(sorted(d.id for d in sharding.device_set)), []).append(i)
    for idx in groups.values():

        def init(k, idx=tuple(idx)):
            return [_init_leaf(leaves[i], jax.random.fold_in(k, i)) for i in idx]

        for i, x in zip(idx, jax.jit(init, out_shardings=[targets[i] for i in idx])(key)):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


def checked_array(name: str, value: np.ndarray, spec: ParamSpec) -> np.ndarray:
    """Casts a loaded host array to the spec's dtype after checking its shape; names the tensor."""
    if tuple(value.shape) != tuple(spec.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {spec.shape}")
    return np.asarray(value).astype(spec.dtype, copy=False)


def array_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    """Bytes an array of `shape` and `dtype` takes on a device. NOTE: 4-bit types (the int4
    codes) count half a byte a value: XLA packs them two per byte (on XLA:CPU 20 [4096, 4096]
    uint4 arrays grew the process by 160 MiB, uint8 ones by 320), while JAX's `nbytes` counts
    them a byte each."""
    return -(-int(np.prod(shape, dtype=np.int64)) * jax.dtypes.itemsize_bits(dtype) // 8)


def num_bytes(tree: Any) -> int:
    """Bytes of every array (or struct) in `tree` (`array_bytes`)."""
    return sum(array_bytes(x.shape, x.dtype) for x in jax.tree.leaves(tree))
