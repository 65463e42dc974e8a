"""Weight-only quantization (`quantization="int8" | "fp8"`): the quantized leaf and its specs.

1. A weight a model declares with `ParamSpec(..., quant_axis=a)` (its contraction axis: the input
   dim of a linear weight, `embed` of the embedding) becomes, under `quantize_specs(specs, fmt)`,
   a `QArray` of two specs: `data` (the weight's shape and logical axes, stored as int8 or
   float8_e4m3fn) and `scale` (f32, one per output channel: the weight's shape and logical axes
   without axis `a`). Everything derived from the specs (abstract tree, shardings, shard_map
   specs, orbax restore targets, random init) follows, the scale sharded like the outputs it
   scales. Norms, biases and the MoE router (`quant_axis=None`) stay in the model dtype.
2. Loaders fill those leaves with `checkpoints.quantize.quantize` on the host (HF tensors, GGUF
   blocks requantized row chunk by row chunk); `quantize_params` does it on device for a float
   params tree (a float orbax checkpoint loaded with `quantization=`, random test weights).
3. The math (`jaxinfer.layers.dense`, `embed_rows`, the MoE experts) multiplies by the stored
   values and applies the scales to the product's output channels, after the contraction:
   `x @ (q * s) = (x @ q) * s` since `s` is constant along the contraction.
4. `quantization_of(params)` reads the format back from a params tree (its leaf dtypes), so the
   model's `shard_map` specs and the runner's placement derive the same tree without a flag.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from checkpoints import quantize as qlib
from jaxinfer.params import ParamSpec, is_spec

FORMATS = qlib.FORMATS
check_quantization = qlib.check_format
STORAGE = {fmt: jnp.dtype(dt) for fmt, dt in qlib.STORAGE.items()}


@struct.dataclass
class QArray:
    """A weight stored quantized: `data` (the weight's shape) times `scale` (one per output channel:
    the weight's shape without its contraction axis), broadcast back over that axis."""

    data: Any  # i8 | f8e4m3fn[weight shape]; as a spec it keeps the weight's quant_axis
    scale: Any  # f32[weight shape without the contraction axis]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        return self.data.dtype


def is_quantized(x: Any) -> bool:
    return isinstance(x, QArray)


def quantized_spec(spec: ParamSpec, fmt: str) -> QArray:
    """The (data, scale) specs of one weight declared with a `quant_axis`."""
    a = spec.quant_axis
    keep = [i for i in range(len(spec.shape)) if i != a]
    # Random init (tests, dummy weights): data uniform over the grid; scale chosen so that
    # data * scale has about the float spec's std (uniform ints in [-127, 127] have std ~73).
    data_std = 73.0 if fmt == "int8" else 1.0
    data = ParamSpec(spec.shape, STORAGE[fmt], spec.logical_axes, "normal", data_std, a)
    scale = ParamSpec(tuple(spec.shape[i] for i in keep), jnp.float32,
                      tuple(spec.logical_axes[i] for i in keep), "constant", spec.scale / data_std)
    return QArray(data=data, scale=scale)


def quantize_specs(specs: Any, fmt: str | None) -> Any:
    """The spec tree with every `quant_axis` weight as a `QArray` of specs (unchanged for None)."""
    check_quantization(fmt)
    if fmt is None:
        return specs
    return jax.tree.map(lambda s: quantized_spec(s, fmt) if _takes_quantization(s) else s,
                        specs, is_leaf=is_spec)


def _takes_quantization(spec: ParamSpec) -> bool:
    return spec.quant_axis is not None and jnp.issubdtype(spec.dtype, jnp.floating) and \
        jnp.dtype(spec.dtype) not in STORAGE.values()


def quantization_of(params: Any) -> str | None:
    """The format of a params (or spec / abstract) tree: None when no leaf is a `QArray`."""
    found = {jnp.dtype(q.data.dtype) for q in jax.tree.leaves(params, is_leaf=is_quantized)
             if is_quantized(q)}
    for fmt, dtype in STORAGE.items():
        if found == {dtype}:
            return fmt
    if found:
        raise ValueError(f"params mix quantized formats {sorted(map(str, found))}")
    return None


def quantize_params(params: Any, specs: Any, fmt: str | None) -> Any:
    """Quantizes the float leaves of `params` that `specs` (the float spec tree) marks with a
    `quant_axis`, on their devices, keeping each result on the input's sharding."""
    check_quantization(fmt)
    if fmt is None:
        return params
    target = quantize_specs(specs, fmt)

    def one(spec: ParamSpec, w: Any) -> Any:
        if not _takes_quantization(spec):
            return w
        data, scale = _quantize_jit(w, fmt, spec.quant_axis)
        return QArray(data=data, scale=scale)

    out = jax.tree.map(one, specs, params, is_leaf=is_spec)
    jax.tree.map(lambda s, x: _check_leaf(s, x), target, out, is_leaf=is_spec)
    return out


def _check_leaf(spec: ParamSpec, x: Any) -> None:
    if tuple(x.shape) != tuple(spec.shape) or jnp.dtype(x.dtype) != jnp.dtype(spec.dtype):
        raise ValueError(f"quantized leaf {x.shape} {x.dtype} != spec {spec.shape} {spec.dtype}")


def _quantize_impl(w: jax.Array, fmt: str, axis: int) -> tuple[jax.Array, jax.Array]:
    return qlib.quantize(w, fmt, axis, xp=jnp)


_quantize_jit = jax.jit(_quantize_impl, static_argnames=("fmt", "axis"))


def dequantize(q: QArray, axis: int, dtype: Any = jnp.float32) -> jax.Array:
    """`data * scale` as `dtype` (tests and the reference paths; the model never calls it)."""
    return qlib.dequantize(q.data, q.scale, axis, xp=jnp).astype(dtype)
