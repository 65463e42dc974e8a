"""Dense products with few token rows for XLA:CPU: a C++ kernel called through the XLA FFI.

A decode step streams every weight of the model once; XLA:CPU runs the model's small
matrix-vector products at ~15-20 GB/s on one core, where the machine reads ~30 GB/s with both
(BENCHMARKS.md). `cpu_kernel.cc` reads each weight front to back, split over the cores of XLA's
intra-op pool.

1. `KERNEL` (`pallas_kernels.cpu_build`) compiles `cpu_kernel.cc` on first use and registers it for
   the "cpu" platform; `available()` / `unavailable_reason()` say whether that worked (the kernel
   needs AVX2 + FMA, or AVX-512 F/BW/VL: 8- or 16-lane vectors, picked by this CPU's flags).
2. `linear(x, *weights)` -> one `x @ w` per weight, all in one call (weights sharing one input are
   streamed back to back: q and the fused k/v projections). `transposed=True` takes weights
   stored `[N, K]` (a tied embedding as LM head). float32 weights, or int8 weights with group-wise
   f32 scales (`scales=`, `quantization="int8"`: a quarter of the bytes to stream, widened in
   registers), or `[K, N]` uint4 codes (N even, XLA's packed layout: an eighth of the bytes, the
   nibbles unpacked in registers; `quantization="int4"`'s offsets are the caller's, see
   `jaxinfer.layers.dense`) with scales the same way; or, with `offsets=`, int4's own layout
   (uint4 codes, f16 scales and offsets as stored, groups of a multiple of `QBLOCK`) as integer
   products on x quantized to 15 bits per `QBLOCK` channels (`cpu_kernel_int4.h`), offsets
   included, the codes [K, N] or (`tiled=True`) in the tile order of `reference.tile_int4`, which
   streams each part of a weight front to back (`int4_path()`: AVX-512 VNNI where the CPU has
   it, else AVX2; the same bits): one scale per output column and group of K / G
   input rows, G = 1 being one scale per output column; G > 1 needs groups of a multiple of
   `GROUP_MULTIPLE` rows (`groups_fit`). Any shapes, but it pays off only for few rows
   (`MAX_ROWS`; `MAX_ROWS_INT4` for the integer products, `MAX_ROWS_HEAD` for a quantized LM
   head): `jaxinfer.layers.dense` picks it for those and XLA's dot otherwise. `reference.linear`
   is the same product in pure JAX (the oracle) and holds the checks both share
   (`reference.check_inputs`, `offsets_fit`, `tiles_fit`); this file adds the kernel's own (group
   sizes).
3. `lanes()`: the vector width of this machine's build (16 with AVX-512, 8 with AVX2);
   `float_pays()`: whether float32 weights beat XLA's dot here (AVX-512 only: on AVX2 (Zen 3)
   XLA's dot streams f32 faster, BENCHMARKS.md "AVX2 kernel"; int8 / int4 weights take the kernel
   on both, XLA:CPU converting the whole weight before its dot).
4. Each call is cut into the same parts whether or not pool threads help (so results do not depend
   on it); whether they help is measured per size class of call (`cpu_kernel_threads.h`): on busy
   cores a preempted helper stalls the call and the caller alone is faster.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_build import CppKernel
from pallas_kernels.linear.reference import (
    MAX_WEIGHTS,
    QBLOCK,
    TILE_N,
    check_inputs,
    check_offsets,
    offsets_fit,
    tiles_fit,
)

__all__ = [
    "GROUP_MULTIPLE",
    "KERNEL",
    "MAX_ROWS",
    "MAX_ROWS_HEAD",
    "MAX_ROWS_INT4",
    "MAX_WEIGHTS",
    "QBLOCK",
    "TILE_N",
    "available",
    "dequantize",
    "float_pays",
    "groups_fit",
    "int4_path",
    "lanes",
    "library",
    "linear",
    "offsets_fit",
    "tiles_fit",
    "unavailable_reason",
]

KERNEL = CppKernel(
    Path(__file__).with_name("cpu_kernel.cc"),
    "JaxinferCpuLinear",
    "jaxinfer_cpu_linear",
    more=(("JaxinferCpuDequantize", "jaxinfer_cpu_dequantize"),),
)
DEQUANTIZE_TARGET = "jaxinfer_cpu_dequantize"
library, unavailable_reason, available = KERNEL.library, KERNEL.unavailable_reason, KERNEL.available
# Token rows up to which the kernel beats XLA:CPU's dot on the model's shapes (BENCHMARKS.md,
# scripts/bench_linear.py: 1 row 1.4x, 2 rows 1.9x, 8 rows 1.4x; at 16 rows XLA is faster).
MAX_ROWS = 8
# The same for int4's integer products (`offsets=`): XLA:CPU's dequantizing dot of 9-16 rows took
# 4x the kernel's time on SmolLM2's shapes, the two are even at 32 rows and XLA is 3x faster at 128
# (BENCHMARKS.md "int4 decode step, tiled").
MAX_ROWS_INT4 = 32
# The same for a quantized tied embedding as LM head (int8 `[V, E]`, `transposed=True`): XLA:CPU's
# product of SmolLM2's [49152, 576] Q8_0 head took 107-172 ms at 1-16 rows (per-group products
# or a dequantized copy), the kernel 2.8 ms at 1 row, 17 at 8, 41 at 16, 93 at 32 (BENCHMARKS.md
# "int4 decode step, tiled").
MAX_ROWS_HEAD = 32
# With G > 1 scale groups, the group size K / G must be a multiple of this (one AVX-512 vector,
# two AVX2 ones).
GROUP_MULTIPLE = 16


def lanes() -> int:
    """f32 lanes per vector of this machine's build (16: AVX-512, 8: AVX2); builds it first."""
    fn = library().JaxinferCpuLinearLanes
    fn.restype = ctypes.c_int
    return fn()


def int4_path() -> str:
    """Which code int4's integer products run in this process: "avx512-vnni" (vpdpbusd, on CPUs
    with AVX-512 VNNI + VBMI) or "avx2" (vpmaddubsw; also where the environment sets
    JAXINFER_CPU_INT4_AVX2, to compare the two). Both give the same bits."""
    fn = library().JaxinferCpuLinearInt4Vnni
    fn.restype = ctypes.c_int
    return "avx512-vnni" if fn() else "avx2"


def float_pays() -> bool:
    """Whether float32 weights should take the kernel (AVX-512 builds) rather than XLA's dot."""
    return lanes() == 16


def groups_fit(k: int, groups: int) -> bool:
    """Whether int8 scales in `groups` groups over K = `k` input rows fit the kernel."""
    if groups == 1:
        return True
    return (
        groups > 1 and k % groups == 0 and k // groups > 0 and (k // groups) % GROUP_MULTIPLE == 0
    )


@functools.partial(jax.jit, static_argnames=("transposed", "tiled"))
def linear(
    x: jax.Array,
    *weights: jax.Array,
    transposed: bool = False,
    scales: tuple[jax.Array, ...] | None = None,
    offsets: tuple[jax.Array, ...] | None = None,
    tiled: bool = False,
) -> tuple[jax.Array, ...]:
    """x f32[T, K]; each weight f32[K, N_i] (or [N_i, K] when `transposed`) -> (f32[T, N_i], ...).

    With `scales` the weights are int8 (or uint4 codes, not transposed, N_i even) with group-wise
    scales, one f32 array per weight: f32[G, N_i]
    for a [K, N_i] weight, f32 (or f16, widened in the kernel) [N_i, G] for a transposed [N_i, K]
    one, G >= 1 dividing K, group size
    g = K // G (a multiple of `GROUP_MULTIPLE` when G > 1); G may differ between weights.
        y[t, n] = sum_k x[t, k] * w[k, n] * scales[i][k // g, n]      ([K, N_i])
        y[t, n] = sum_k x[t, k] * w[n, k] * scales[i][n, k // g]      (transposed)
    G = 1 is one scale per output column (`x @ (w * scale)`).

    With `offsets` (int4's own layout: uint4 codes [K, N_i], f16 scales and offsets [G, N_i], K and
    K / G multiples of `QBLOCK`, `offsets_fit`) the product is `x @ (codes * scale + offset)` on
    integers: x quantized to 15 bits per block of `QBLOCK` input channels (`reference.quantize_x`),
        y[t, n] = sum_b isum[t, b, n] * scale[g, n] * xd[t, b] + offset[g, n] * xsum[t, b]
    (isum the block's sum of codes * xq, g its group): `reference.linear_offsets` exactly, the
    float product within the activations' rounding. `tiled=True`: the codes are in the tile order
    of `reference.tile_int4` (every N_i a multiple of `TILE_N`), the same products.
    """
    if offsets is not None:
        return _linear_offsets(x, weights, scales, offsets, tiled)
    if tiled:
        raise ValueError("tiled int4 codes take the integer products only (offsets=)")
    check_inputs(x, weights, transposed, scales)
    for i, w in enumerate(weights):
        if w.dtype == jnp.uint4 and w.shape[1] % 2:
            raise ValueError(f"uint4 weight {i} of shape {w.shape}: the kernel needs N even")
    int8 = scales is not None
    k = x.shape[1]
    for i, s in enumerate(scales or ()):
        groups = s.shape[1] if transposed else s.shape[0]
        if not groups_fit(k, groups):
            raise ValueError(
                f"scales {i}: group size K/G = {k}/{groups} = {k // groups} is not a positive "
                f"multiple of {GROUP_MULTIPLE} (needed when G > 1); use G = 1 or XLA's dot"
            )
    outs = [
        jax.ShapeDtypeStruct((x.shape[0], w.shape[0] if transposed else w.shape[1]), jnp.float32)
        for w in weights
    ]
    library()
    args = (*weights, *scales) if int8 else weights
    return tuple(
        jax.ffi.ffi_call(KERNEL.target, outs)(
            x, *args, transposed=transposed, int8=int8, offsets=False, tiled=False
        )
    )


def _linear_offsets(x, weights, scales, offsets, tiled) -> tuple[jax.Array, ...]:
    check_offsets(x, weights, scales, offsets)
    for i, w in enumerate(weights):
        if tiled and not tiles_fit(*w.shape):
            raise ValueError(
                f"tiled weight {i} of shape {w.shape}: N must be a multiple of {TILE_N} "
                f"and K of {QBLOCK}"
            )
    library()
    outs = [jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in weights]
    call = jax.ffi.ffi_call(KERNEL.target, outs)
    args = (*weights, *scales, *offsets)
    return tuple(call(x, *args, transposed=False, int8=True, offsets=True, tiled=tiled))


@functools.partial(jax.jit, static_argnames=("tiled",))
def dequantize(
    x: jax.Array, codes: jax.Array, scales: jax.Array, offsets: jax.Array, tiled: bool = False
) -> jax.Array:
    """int4's own layout as f32 [K, N]: `codes * scales + offsets` per group (uint4 codes [K, N],
    in `reference.tile_int4`'s order when `tiled`; f16 scales and offsets [G, N], `offsets_fit`),
    the same values as `reference.dequantize_offsets` (a product, then a sum). For products of more
    rows than the kernel's (prefill), which XLA's dot then takes as a float weight: XLA:CPU's own
    conversion of uint4 codes (untiled first) ran at ~1 ns a code. x f32[T, K] is not read; it
    ties the conversion to the layer that uses it (`jaxinfer.layers._tie`)."""
    check_offsets(x, (codes,), (scales,), (offsets,))
    if tiled and not tiles_fit(*codes.shape):
        raise ValueError(
            f"tiled codes of shape {codes.shape}: N must be a multiple of {TILE_N} "
            f"and K of {QBLOCK}"
        )
    library()
    out = jax.ShapeDtypeStruct(codes.shape, jnp.float32)
    return jax.ffi.ffi_call(DEQUANTIZE_TARGET, out)(x, codes, scales, offsets, tiled=tiled)
