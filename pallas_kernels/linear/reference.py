"""Pure-JAX dense products of few token rows: the oracle of the CPU linear kernel (`cpu.py`).

`linear(x, *weights, transposed=, scales=)` has the kernel's signature and semantics:
  1. `check_inputs` validates the call (shared by every backend; the kernel adds its own limits:
     group sizes a multiple of `cpu.GROUP_MULTIPLE`).
  2. Each weight is widened to float32; an int8 weight is multiplied by its group-wise scales
     repeated over each group of K / G input rows (`dequantize`).
  3. One f32 product per weight at full precision: `x @ w` ([K, N_i]) or `x @ w.T` ([N_i, K]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MAX_WEIGHTS = 8  # weights per call (one FFI call streams them back to back)


def check_inputs(
    x: jax.Array,  # f32[T, K]
    weights: tuple[jax.Array, ...],  # each [K, N_i] (or [N_i, K] when transposed)
    transposed: bool,
    scales: tuple[jax.Array, ...] | None,  # f32[G, N_i] (or [N_i, G]) per int8 / uint4 weight
) -> None:
    """Trace-time shape and dtype checks of one call; raises ValueError naming the problem."""
    if not 1 <= len(weights) <= MAX_WEIGHTS:
        raise ValueError(f"linear takes 1 to {MAX_WEIGHTS} weights, got {len(weights)}")
    if x.ndim != 2:
        raise ValueError(f"x must be [T, K], got shape {x.shape}")
    if x.dtype != jnp.float32:
        raise ValueError(f"the CPU linear kernel takes float32 x only, got {x.dtype}")
    int8 = scales is not None
    want = (
        (jnp.int8, jnp.uint4)
        if int8 and not transposed
        else (jnp.int8,)
        if int8
        else (jnp.float32,)
    )
    if int8 and len(scales) != len(weights):
        raise ValueError(
            f"{len(weights)} int8 weights need as many scale arrays, got {len(scales)}"
        )
    for i, w in enumerate(weights):
        if w.dtype not in want:
            raise ValueError(
                f"the CPU linear kernel takes {' or '.join(jnp.dtype(d).name for d in want)} "
                f"weight {i} {'(scales given)' if int8 else '(no scales given)'}"
                f"{', transposed' if transposed else ''}, got {w.dtype}"
            )
    k = x.shape[1]
    for i, w in enumerate(weights):
        w_k, n = (w.shape[-1], w.shape[0]) if transposed else (w.shape[0], w.shape[-1])
        if w.ndim != 2 or w_k != k:
            raise ValueError(
                f"weight {i} of shape {w.shape} does not fit x of shape {x.shape} "
                f"(transposed={transposed})"
            )
        if int8:
            _check_scales(i, scales[i], k, n, transposed)


def _check_scales(i: int, s: jax.Array, k: int, n: int, transposed: bool) -> None:
    want = f"[{n}, G]" if transposed else f"[G, {n}]"
    groups = (s.shape[1] if transposed else s.shape[0]) if s.ndim == 2 else 0
    n_got = (s.shape[0] if transposed else s.shape[1]) if s.ndim == 2 else None
    if s.dtype != jnp.float32 or n_got != n or groups < 1 or k % groups:
        raise ValueError(
            f"scales {i} must be f32{want} with G dividing K={k} "
            f"(transposed={transposed}), got {s.dtype}{list(s.shape)}"
        )


def dequantize(w: jax.Array, scale: jax.Array, transposed: bool) -> jax.Array:
    """int8 (or uint4) w [K, N] with scales f32[G, N] (transposed: w [N, K], scales [N, G]) -> f32 values,
    each group of K / G input rows times its scale row."""
    axis = 1 if transposed else 0
    group = w.shape[axis] // scale.shape[axis]
    return w.astype(jnp.float32) * jnp.repeat(scale, group, axis=axis)


@functools.partial(jax.jit, static_argnames=("transposed",))
def linear(
    x: jax.Array,  # f32[T, K]
    *weights: jax.Array,  # each f32 / int8 / uint4 [K, N_i] (or f32 / int8 [N_i, K] transposed)
    transposed: bool = False,
    scales: tuple[jax.Array, ...] | None = None,  # f32[G, N_i] (or [N_i, G]) per weight
) -> tuple[jax.Array, ...]:  # (f32[T, N_i], ...)
    """x times each weight, as `cpu.linear`:
    y[t, n] = sum_k x[t, k] * w[k, n] * scales[i][k // g, n]  ([K, N_i]; transposed: w[n, k] and
    scales[i][n, k // g]), g = K // G; without scales the weights are float32 and unscaled."""
    check_inputs(x, weights, transposed, scales)
    outs = []
    for i, w in enumerate(weights):
        wf = w if scales is None else dequantize(w, scales[i], transposed)
        spec = "tk,nk->tn" if transposed else "tk,kn->tn"
        outs.append(jnp.einsum(spec, x, wf, precision=jax.lax.Precision.HIGHEST))
    return tuple(outs)
