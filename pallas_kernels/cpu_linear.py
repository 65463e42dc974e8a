"""Dense products with few token rows for XLA:CPU: a C++ kernel called through the XLA FFI.

A decode step streams every weight of the model once; XLA:CPU runs the model's small
matrix-vector products at ~15-20 GB/s on one core, where the machine reads ~30 GB/s with both
(BENCHMARKS.md). `cpu_linear.cc` reads each weight front to back, split over the cores of XLA's
intra-op pool.

1. `KERNEL` (`pallas_kernels.cpu_build`) compiles `cpu_linear.cc` on first use and registers it for
   the "cpu" platform; `available()` / `unavailable_reason()` say whether that worked (the kernel
   needs AVX-512 F/BW/VL).
2. `linear(x, *weights)` -> one `x @ w` per weight, all in one call (weights sharing one input are
   streamed back to back: q and the fused k/v projections). `transposed=True` takes weights
   stored `[N, K]` (a tied embedding as LM head). float32 weights, or int8 weights with group-wise
   f32 scales (`scales=`, `quantization="int8"`: a quarter of the bytes to stream, widened in
   registers): one scale per output column and group of K / G input rows, G = 1 being one scale per
   output column; G > 1 needs groups of a multiple of `GROUP_MULTIPLE` rows (`groups_fit`). Any
   shapes, but it pays off only for few rows (`MAX_ROWS`): `jaxinfer.layers.dense` picks it for
   those and XLA's dot otherwise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_build import CppKernel

KERNEL = CppKernel(
    Path(__file__).with_name("cpu_linear.cc"), "JaxinferCpuLinear", "jaxinfer_cpu_linear"
)
library, unavailable_reason, available = KERNEL.library, KERNEL.unavailable_reason, KERNEL.available
# Token rows up to which the kernel beats XLA:CPU's dot on the model's shapes (BENCHMARKS.md,
# scripts/bench_linear.py: 1 row 1.4x, 2 rows 1.9x, 8 rows 1.4x; at 16 rows XLA is faster).
MAX_ROWS = 8
MAX_WEIGHTS = 8
# With G > 1 scale groups, the group size K / G must be a multiple of this (one 16-lane vector).
GROUP_MULTIPLE = 16


def groups_fit(k: int, groups: int) -> bool:
    """Whether int8 scales in `groups` groups over K = `k` input rows fit the kernel."""
    if groups == 1:
        return True
    return (
        groups > 1 and k % groups == 0 and k // groups > 0 and (k // groups) % GROUP_MULTIPLE == 0
    )


@functools.partial(jax.jit, static_argnames=("transposed",))
def linear(
    x: jax.Array,
    *weights: jax.Array,
    transposed: bool = False,
    scales: tuple[jax.Array, ...] | None = None,
) -> tuple[jax.Array, ...]:
    """x f32[T, K]; each weight f32[K, N_i] (or [N_i, K] when `transposed`) -> (f32[T, N_i], ...).

    With `scales` the weights are int8 with group-wise scales, one f32 array per weight: f32[G, N_i]
    for a [K, N_i] weight, f32[N_i, G] for a transposed [N_i, K] one, G >= 1 dividing K, group size
    g = K // G (a multiple of `GROUP_MULTIPLE` when G > 1); G may differ between weights.
        y[t, n] = sum_k x[t, k] * w[k, n] * scales[i][k // g, n]      ([K, N_i])
        y[t, n] = sum_k x[t, k] * w[n, k] * scales[i][n, k // g]      (transposed)
    G = 1 is one scale per output column (`x @ (w * scale)`).
    """
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"linear takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, K], got shape {x.shape}")
    if x.dtype != jnp.float32:
        raise ValueError(f"the CPU linear kernel takes float32 x only, got {x.dtype}")
    int8 = scales is not None
    want = jnp.int8 if int8 else jnp.float32
    if int8 and len(scales) != len(weights):
        raise ValueError(
            f"{len(weights)} int8 weights need as many scale arrays, got {len(scales)}"
        )
    for i, w in enumerate(weights):
        if w.dtype != want:
            raise ValueError(
                f"the CPU linear kernel takes {jnp.dtype(want).name} weight {i} "
                f"{'(scales given)' if int8 else '(no scales given)'}, got {w.dtype}"
            )
    k = x.shape[1]
    outs = []
    for i, w in enumerate(weights):
        w_k, n = (w.shape[-1], w.shape[0]) if transposed else (w.shape[0], w.shape[-1])
        if w.ndim != 2 or w_k != k:
            raise ValueError(
                f"weight {i} of shape {w.shape} does not fit x of shape {x.shape} "
                f"(transposed={transposed})"
            )
        if int8:
            _check_scales(i, scales[i], k, n, transposed)
        outs.append(jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    library()
    args = (*weights, *scales) if int8 else weights
    return tuple(jax.ffi.ffi_call(KERNEL.target, outs)(x, *args, transposed=transposed, int8=int8))


def _check_scales(i: int, s: jax.Array, k: int, n: int, transposed: bool) -> None:
    want = f"[{n}, G]" if transposed else f"[G, {n}]"
    groups = (s.shape[1] if transposed else s.shape[0]) if s.ndim == 2 else 0
    n_got = (s.shape[0] if transposed else s.shape[1]) if s.ndim == 2 else None
    if s.dtype != jnp.float32 or n_got != n or groups < 1 or k % groups:
        raise ValueError(
            f"scales {i} must be f32{want} with G dividing K={k} "
            f"(transposed={transposed}), got {s.dtype}{list(s.shape)}"
        )
    if not groups_fit(k, groups):
        raise ValueError(
            f"scales {i}: group size K/G = {k}/{groups} = {k // groups} is not a positive multiple "
            f"of {GROUP_MULTIPLE} (needed when G > 1); use G = 1 or XLA's dot"
        )
