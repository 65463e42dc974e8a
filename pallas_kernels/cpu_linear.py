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
   stored `[N, K]` (a tied embedding as LM head). float32 weights, or int8 weights with one f32
   scale per output column (`scales=`, `quantization="int8"`: a quarter of the bytes to stream,
   widened in registers). Any shapes, but it pays off only for few rows (`MAX_ROWS`):
   `jaxinfer.layers.dense` picks it for those and XLA's dot otherwise.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_build import CppKernel

KERNEL = CppKernel(Path(__file__).with_name("cpu_linear.cc"), "JaxinferCpuLinear",
                   "jaxinfer_cpu_linear")
library, unavailable_reason, available = KERNEL.library, KERNEL.unavailable_reason, KERNEL.available
# Token rows up to which the kernel beats XLA:CPU's dot on the model's shapes (BENCHMARKS.md,
# scripts/bench_linear.py: 1 row 1.4x, 2 rows 1.9x, 8 rows 1.4x; at 16 rows XLA is faster).
MAX_ROWS = 8
MAX_WEIGHTS = 8


@functools.partial(jax.jit, static_argnames=("transposed",))
def linear(x: jax.Array, *weights: jax.Array, transposed: bool = False,
           scales: tuple[jax.Array, ...] | None = None) -> tuple[jax.Array, ...]:
    """x f32[T, K]; each weight f32[K, N_i] (or [N_i, K] when `transposed`) -> (f32[T, N_i], ...).

    With `scales` (one f32[N_i] per weight) the weights are int8 and output column n of weight i
    is multiplied by `scales[i][n]` (`x @ (w * scale)` for per-output-channel quantized weights).
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
        raise ValueError(f"{len(weights)} int8 weights need as many scale vectors, got {len(scales)}")
    for i, w in enumerate(weights):
        if w.dtype != want:
            raise ValueError(f"the CPU linear kernel takes {jnp.dtype(want).name} weight {i} "
                             f"{'(scales given)' if int8 else '(no scales given)'}, got {w.dtype}")
    k = x.shape[1]
    outs = []
    for i, w in enumerate(weights):
        w_k, n = ((w.shape[-1], w.shape[0]) if transposed else (w.shape[0], w.shape[-1]))
        if w.ndim != 2 or w_k != k:
            raise ValueError(f"weight {i} of shape {w.shape} does not fit x of shape {x.shape} "
                             f"(transposed={transposed})")
        if int8 and (scales[i].shape != (n,) or scales[i].dtype != jnp.float32):
            raise ValueError(f"scales {i} must be f32[{n}], got {scales[i].dtype}{list(scales[i].shape)}")
        outs.append(jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32))
    library()
    args = (*weights, *scales) if int8 else weights
    return tuple(jax.ffi.ffi_call(KERNEL.target, outs)(x, *args, transposed=transposed, int8=int8))
