"""Weight-only quantization (`quantization="int8" | "fp8" | "int4"`): the quantized leaf and its
specs (format names and their options: `checkpoints.quantize`).

1. A weight a model declares with `ParamSpec(..., quant_axis=a)` (its contraction axis: the input
   dim of a linear weight, `embed` of the embedding) becomes, under `quantize_specs(specs, fmt)`,
   a `QArray` of two specs: `data` (the weight's shape and logical axes, stored as int8 or
   float8_e4m3fn) and `scale` (`qlib.SCALE_DTYPE`: f32, f16 under int4; the weight's shape with
   axis `a` cut to G groups, G =
   `checkpoints.quantize.num_groups(K, fmt)`: int8 one scale per 128 input channels, fp8 G = 1,
   one per output channel). Grouped scales are for weights contracted over their first axis (the
   linear weights) or their last (the embedding, also the tied LM head); the MoE experts' stacked
   weights keep G = 1 (their ragged grouped product has no per-group form). Everything derived
   from the specs (abstract tree, shardings, shard_map specs, orbax restore targets, random init)
   follows: the scale is sharded like the weight (a G = 1 axis replicated). "int4" adds `offset`
   (f16 like its scales, the scale's shape and axes; value = code * scale + offset) to the linear
   weights. "-act" formats (an act-order GPTQ checkpoint's own layout, `qlib.act_order`) add
   `perm` (i32[K], laid out like the input channels) to each linear weight: its rows are stored
   sorted by scale group, row i reading x's channel perm[i]. int4's linear weights' `data` is
   `uint4` (XLA packs it two per byte on CPU, GPU and TPU: measured, `jnp.int4` /
   `uint4` arrays take K * N / 2 bytes on XLA:CPU, and its dequantizing dot ran 1.6x faster than
   unpacking uint8 pairs by hand); the embedding (contracted over its last axis) is int8 there. Norms, biases and the
   MoE router (`quant_axis=None`) stay in the model dtype.
2. Loaders fill those leaves with `checkpoints.quantize.quantize` on the host (HF tensors, GGUF
   blocks requantized row chunk by row chunk); `quantize_params` does it on device for a float
   params tree (a float orbax checkpoint loaded with `quantization=`, random test weights).
3. The math (`jaxinfer.layers.dense`, `embed_rows`, the MoE experts) multiplies by the stored
   values (f16 scales and offsets widened to f32 where they are used); one scale per output
   channel (G = 1) multiplies the product's outputs after the
   contraction (`x @ (q * s) = (x @ q) * s`, `s` constant along it). Grouped scales: the compiled
   CPU kernel applies each group's scales to that group's partial sums; XLA's path scales the
   converted weight into the dot's operand (a fusion on GPU, see `layers._xla_dense`).
4. `quantization_of(params)` reads the format back from a params tree (its leaf dtypes), so the
   model's `shard_map` specs and the runner's placement derive the same tree without a flag.
5. A CPU runner (`linear_backend="cpu"`, one device) puts int4 codes in the CPU kernel's tiles
   (`tile_for_cpu`, `QArray.tiled`, static): same shape and dtype, the elements of each 32-row
   block's 64-column strip contiguous, so the decode products read each weight as one stream;
   the kernel also writes them out untiled as f32 for steps of more rows (prefill:
   `layers._dequantized_dense`); anything else that reads the codes takes `codes(q)` (XLA's
   products of a bfloat16 model untile them).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from checkpoints import quantize as qlib
from jaxinfer import sharding as shd
from jaxinfer.params import ParamSpec, is_spec
from pallas_kernels.linear import reference as linear_ref

FORMATS = qlib.FORMATS
check_quantization = qlib.check_format
STORAGE = {fmt: jnp.dtype(dt) for fmt, dt in qlib.STORAGE.items()}


@struct.dataclass
class QArray:
    """A weight stored quantized: `data` (the weight's shape) times `scale` (the weight's shape with
    its contraction axis cut to G groups), each group's scale broadcast over its input channels,
    plus `offset` (int4: same shape as the scale; None otherwise); `perm` (act-order: the input
    channel of each stored row). `tiled` (static): int4 codes whose [K, N] view holds its elements
    in the CPU kernel's tile order (`tile_for_cpu`)."""

    data: Any  # i8 | f8e4m3fn | u4[weight shape]; as a spec it keeps the weight's quant_axis
    scale: Any  # f32 | f16 (int4)[weight shape with the contraction axis of size G]
    offset: Any = None  # f16[like scale] for uint4 codes, else None
    # i32[K]: act-order weights ("-act" formats, GPTQ's desc_act) store their input rows sorted by
    # scale group; stored row i multiplies x's channel perm[i] (`jaxinfer.layers.dense` gathers x
    # through it). None otherwise.
    perm: Any = None
    tiled: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        return self.data.dtype


def is_quantized(x: Any) -> bool:
    return isinstance(x, QArray)


def num_groups(spec: ParamSpec, fmt: str) -> int:
    """G for one float weight spec: `qlib.num_groups` for weights contracted over their first or
    last axis, 1 for the others (the stacked MoE experts)."""
    a = spec.quant_axis
    if a not in (0, len(spec.shape) - 1) or len(spec.shape) < 2:
        return 1
    return qlib.num_groups(spec.shape[a], fmt)


def leaf_format(spec: ParamSpec, fmt: str) -> str:
    """The base format of one weight under `fmt`: int4 keeps the vocabulary-sized weights (the
    embedding, the LM head, tied or not) in int8, as GGUF files (Q8_0 / Q6_K) and GPTQ / AWQ
    checkpoints (16 bits) keep them wider than the layers, and the stacked MoE experts too
    (contracted over an inner axis: their ragged grouped product has no offset term)."""
    base = qlib.base_format(fmt)
    if base == "int4" and ("vocab" in spec.logical_axes or spec.quant_axis != 0):
        return "int8"
    return base


def quantized_spec(spec: ParamSpec, fmt: str) -> QArray:
    """The (data, scale[, offset]) specs of one weight declared with a `quant_axis`."""
    a = spec.quant_axis
    groups = num_groups(spec, fmt)
    base = leaf_format(spec, fmt)
    # Random init (tests, dummy weights): data spread over the grid; scale chosen so that
    # data * scale has about the float spec's std (uniform ints in [-127, 127] have std ~73).
    data_std = {"int8": 73.0, "int4": 4.0}.get(base, 1.0)
    data = ParamSpec(spec.shape, STORAGE[base], spec.logical_axes, "normal", data_std, a)
    shape = spec.shape[:a] + (groups,) + spec.shape[a + 1 :]
    # NOTE: a single group is replicated (a size-1 axis splits over nothing); G groups split like
    # the input channels they scale, so a sharded contraction axis needs G divisible by its shards.
    axes = (
        spec.logical_axes[:a]
        + ((spec.logical_axes[a] if groups > 1 else None),)
        + spec.logical_axes[a + 1 :]
    )
    scale_dtype = jnp.dtype(qlib.SCALE_DTYPE[qlib.base_format(fmt)])
    scale = ParamSpec(shape, scale_dtype, axes, "constant", spec.scale / data_std)
    perm = None
    linear = a == 0 and "vocab" not in spec.logical_axes
    if qlib.act_order(fmt) and base == qlib.base_format(fmt) and linear and groups > 1:
        # NOTE: laid out like the input channels it permutes (a linear weight's axis 0)
        perm = ParamSpec((spec.shape[0],), jnp.int32, (spec.logical_axes[0],), "iota")
    if base != "int4":
        return QArray(data=data, scale=scale, perm=perm)
    mid = -qlib.INT4_MID * spec.scale / data_std
    return QArray(
        data=data,
        scale=scale,
        offset=ParamSpec(shape, scale_dtype, axes, "constant", mid),
        perm=perm,
    )


def quantize_specs(specs: Any, fmt: str | None) -> Any:
    """The spec tree with every `quant_axis` weight as a `QArray` of specs (unchanged for None)."""
    check_quantization(fmt)
    if fmt is None:
        return specs
    return jax.tree.map(
        lambda s: quantized_spec(s, fmt) if _takes_quantization(s) else s, specs, is_leaf=is_spec
    )


def _takes_quantization(spec: ParamSpec) -> bool:
    return (
        spec.quant_axis is not None
        and jnp.issubdtype(spec.dtype, jnp.floating)
        and jnp.dtype(spec.dtype) not in STORAGE.values()
    )


def quantization_of(params: Any) -> str | None:
    """The format of a params (or spec / abstract) tree: None when no leaf is a `QArray`; int4 and
    int8 name their group size when it is not the default (see `group_size_of`)."""
    leaves = [q for q in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(q)]
    found = {jnp.dtype(q.data.dtype) for q in leaves}
    act = any(q.perm is not None for q in leaves)
    if STORAGE["int4"] in found and found <= {STORAGE["int4"], STORAGE["int8"]}:
        return qlib.format_name("int4", group_size_of(leaves, "int4"), act)
    for fmt, dtype in STORAGE.items():
        if found == {dtype}:
            if fmt == "int8":
                return qlib.format_name(fmt, group_size_of(leaves, fmt), act)
            return fmt
    if found:
        raise ValueError(f"params mix quantized formats {sorted(map(str, found))}")
    return None


def group_size_of(leaves: list[QArray], fmt: str) -> int | None:
    """The group size a format name must carry to give `leaves` their scale groups: the format's
    default when it does, else the first of `qlib.GROUP_CHOICES` that does (leaves of one group
    constrain nothing: MoE experts, small K)."""
    grouped = []
    for q in leaves:
        for k, g in zip(tuple(q.data.shape), tuple(q.scale.shape)):
            if g != k and g > 1:
                grouped.append((k, g))
    for size in (qlib.GROUP_SIZE[fmt], *qlib.GROUP_CHOICES):
        name = qlib.format_name(fmt, size)
        if all(qlib.num_groups(k, name) == g for k, g in grouped):
            return size
    raise ValueError(f"{fmt} leaves with scale groups {grouped[:4]} fit no group size")


def check_group_splits(specs: Any, mesh: jax.sharding.Mesh, rules: dict | None = None) -> None:
    """Raises a ValueError naming the first quantized weight of `specs` whose scale groups do not
    split over the mesh shards of the input channels they scale (e.g. int8 o_proj of a 576-wide
    attention: 9 groups of 64, which tensor=2 cannot split)."""
    sizes = dict(mesh.shape)
    for path, q in jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_quantized)[0]:
        if not is_quantized(q):
            continue
        if q.perm is not None:
            names = _axis_names(shd.logical_to_spec(q.perm.logical_axes, rules)[0])
            if math.prod(sizes.get(a, 1) for a in names) > 1:
                raise ValueError(
                    f"quantization: act-order weight {jax.tree_util.keystr(path)} has its input "
                    f"channels split over mesh axes {names}: its permutation of them mixes the "
                    "shards (GPTQ desc_act); serve it on a mesh that does not split them (one "
                    "device, or data / pipeline axes), or use a checkpoint without act-order"
                )
        for n, axes in zip(q.scale.shape, shd.logical_to_spec(q.scale.logical_axes, rules)):
            names = _axis_names(axes)
            shards = math.prod(sizes.get(a, 1) for a in names)
            if n % shards:
                raise ValueError(
                    f"quantization: weight {jax.tree_util.keystr(path)} has {n} scale groups along "
                    f"its input channels, which do not split over mesh axes {names} of size "
                    f"{shards}; use a mesh whose size there divides {n} (int8 and int4 keep one "
                    f"scale per {qlib.GROUP_SIZE['int8']} input channels, or per -g<n>)"
                )


def _axis_names(axes: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def quantize_params(params: Any, specs: Any, fmt: str | None) -> Any:
    """Quantizes the float leaves of `params` that `specs` (the float spec tree) marks with a
    `quant_axis`, on their devices, keeping each result on the input's sharding."""
    check_quantization(fmt)
    if fmt is None:
        return params
    if qlib.act_order(fmt):
        raise ValueError(
            f"quantization={fmt!r}: -act is an act-order GPTQ checkpoint's own layout; float "
            "weights quantize without it"
        )
    target = quantize_specs(specs, fmt)

    def one(spec: ParamSpec, w: Any) -> Any:
        if not _takes_quantization(spec):
            return w
        groups, base = num_groups(spec, fmt), leaf_format(spec, fmt)
        return QArray(*_quantize_jit(w, fmt, spec.quant_axis, groups, base))

    out = jax.tree.map(one, specs, params, is_leaf=is_spec)
    jax.tree.map(lambda s, x: _check_leaf(s, x), target, out, is_leaf=is_spec)
    return out


def quantize_leaf(spec: ParamSpec, w: Any, fmt: str, xp: Any = None) -> tuple[Any, ...]:
    """(data, scale[, offset]) of one float weight `w` of `spec` under `fmt` (numpy on the host
    by default; `xp=jnp` traces)."""
    return _quantize_impl(
        w, fmt, spec.quant_axis, num_groups(spec, fmt), leaf_format(spec, fmt), xp
    )


def _check_leaf(spec: ParamSpec, x: Any) -> None:
    if tuple(x.shape) != tuple(spec.shape) or jnp.dtype(x.dtype) != jnp.dtype(spec.dtype):
        raise ValueError(f"quantized leaf {x.shape} {x.dtype} != spec {spec.shape} {spec.dtype}")


def _quantize_impl(
    w: Any, fmt: str, axis: int, groups: int, base: str | None = None, xp: Any = jnp
) -> tuple[Any, ...]:
    xp = np if xp is None else xp
    if (base or qlib.base_format(fmt)) == "int4":
        symmetric = qlib.parse_format(fmt)[2]
        return qlib.quantize4(w, axis, groups, symmetric, xp=xp)
    scale_dtype = qlib.SCALE_DTYPE[qlib.base_format(fmt)]
    return qlib.quantize(
        w, "int8" if base == "int8" else fmt, axis, groups, xp=xp, scale_dtype=scale_dtype
    )


_quantize_jit = jax.jit(_quantize_impl, static_argnames=("fmt", "axis", "groups", "base", "xp"))


def dequantize(q: QArray, axis: int, dtype: Any = jnp.float32) -> jax.Array:
    """`data * scale (+ offset)` as `dtype`, act-order rows put back in input-channel order (tests
    and the reference paths; the model never calls it)."""
    w = qlib.dequantize(codes(q), q.scale, axis, xp=jnp, offset=q.offset).astype(dtype)
    if q.perm is None:
        return w
    return jnp.take(w, jnp.argsort(q.perm), axis=axis)


def codes(q: QArray) -> Any:
    """`q.data` in the weight's own element order (tiled int4 codes untiled)."""
    if not q.tiled:
        return q.data
    return linear_ref.untile_int4(q.data.reshape(q.shape[0], -1)).reshape(q.shape)


def tile_for_cpu(params: Any) -> Any:
    """`params` with every int4 linear weight (uint4 codes with f16 scales and offsets,
    contracted over axis 0) whose [K, N] view fits `linear_ref.tiles_fit` and whose groups fit
    the integer products (`linear_ref.offsets_fit`) in the CPU kernel's tile order (`linear_ref.tile_int4`, `QArray.tiled`): its
    decode products then stream each weight front to back. For one device's params only (tiles
    do not split over shards); the runner calls it for `linear_backend="cpu"`."""

    def one(q: Any) -> Any:
        if not (is_quantized(q) and not q.tiled and q.offset is not None):
            return q
        if jnp.dtype(q.data.dtype) != STORAGE["int4"] or q.scale.dtype != jnp.float16:
            return q
        k, n, g = q.shape[0], q.data.size // q.shape[0], q.scale.shape[0]
        if not (linear_ref.tiles_fit(k, n) and linear_ref.offsets_fit(k, g)):
            return q
        data = _tile_jit(q.data.reshape(k, n)).reshape(q.shape)
        return q.replace(data=data, tiled=True)

    return jax.tree.map(one, params, is_leaf=is_quantized)


@jax.jit
def _tile_jit(codes2d: jax.Array) -> jax.Array:
    # NOTE: moved as uint8 (one code a byte), then packed again as uint4.
    return linear_ref.tile_int4(codes2d.astype(jnp.uint8)).astype(codes2d.dtype)
