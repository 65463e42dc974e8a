"""Pure-JAX dense products of few token rows: the oracle of the CPU linear kernel (`cpu.py`).

`linear(x, *weights, transposed=, scales=)` has the kernel's signature and semantics
(`linear_offsets` those of its int4 integer products, `cpu.linear(..., offsets=)`):
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
QBLOCK = 32  # int4 integer products: x quantized per block of this many input channels
XMAX = 127 * 128  # to integers of at most this magnitude (15 bits)
TILE_N = 64  # tiled int4 codes: tiles of QBLOCK rows x TILE_N columns (1 KB), see `tile_int4`


def check_inputs(
    x: jax.Array,  # f32[T, K]
    weights: tuple[jax.Array, ...],  # each [K, N_i] (or [N_i, K] when transposed)
    transposed: bool,
    scales: tuple[jax.Array, ...] | None,  # f32[G, N_i] (or f32 / f16 [N_i, G]) per weight
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
    """f32 scales; f16 too for a transposed int8 weight (int4's tied embedding keeps f16)."""
    want = f"[{n}, G]" if transposed else f"[G, {n}]"
    groups = (s.shape[1] if transposed else s.shape[0]) if s.ndim == 2 else 0
    n_got = (s.shape[0] if transposed else s.shape[1]) if s.ndim == 2 else None
    dtypes = (jnp.float32, jnp.float16) if transposed else (jnp.float32,)
    if s.dtype not in dtypes or n_got != n or groups < 1 or k % groups:
        raise ValueError(
            f"scales {i} must be f32{want}{' (or f16)' if transposed else ''} with G dividing "
            f"K={k} (transposed={transposed}), got {s.dtype}{list(s.shape)}"
        )


def dequantize(w: jax.Array, scale: jax.Array, transposed: bool) -> jax.Array:
    """int8 (or uint4) w [K, N] with scales f32[G, N] (transposed: w [N, K], scales [N, G]) -> f32 values,
    each group of K / G input rows times its scale row."""
    axis = 1 if transposed else 0
    group = w.shape[axis] // scale.shape[axis]
    return w.astype(jnp.float32) * jnp.repeat(scale.astype(jnp.float32), group, axis=axis)


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


def check_offsets(
    x: jax.Array,  # f32[T, K]
    weights: tuple[jax.Array, ...],  # each uint4 [K, N_i]
    scales: tuple[jax.Array, ...],  # each f16[G_i, N_i]
    offsets: tuple[jax.Array, ...],  # each f16[G_i, N_i]
) -> None:
    """Trace-time checks of an int4 integer-product call; raises ValueError naming the problem."""
    if not 1 <= len(weights) <= MAX_WEIGHTS or not len(weights) == len(scales) == len(offsets):
        raise ValueError(
            f"linear with offsets takes 1 to {MAX_WEIGHTS} weights, each with f16 scales and "
            f"offsets: got {len(weights)} weights, {len(scales)} scales, {len(offsets)} offsets"
        )
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[1] % QBLOCK:
        raise ValueError(
            f"x must be f32[T, K] with K a multiple of {QBLOCK}, got {x.dtype}{list(x.shape)}"
        )
    k = x.shape[1]
    for i, (w, s, o) in enumerate(zip(weights, scales, offsets)):
        if w.dtype != jnp.uint4 or w.ndim != 2 or w.shape[0] != k or w.shape[1] % 2:
            raise ValueError(
                f"weight {i} must be uint4[{k}, N] with N even, got {w.dtype}{list(w.shape)}"
            )
        for name, a in (("scales", s), ("offsets", o)):
            g = a.shape[0] if a.ndim == 2 else 0
            if (
                a.dtype != jnp.float16
                or a.ndim != 2
                or a.shape[1] != w.shape[1]
                or g < 1
                or (k % g or (k // g) % QBLOCK)
            ):
                raise ValueError(
                    f"{name} {i} must be f16[G, {w.shape[1]}] with K / G a multiple of {QBLOCK} "
                    f"(K={k}), got {a.dtype}{list(a.shape)}"
                )
        if s.shape != o.shape:
            raise ValueError(
                f"offsets {i} {list(o.shape)} must have the scales' shape {list(s.shape)}"
            )


def quantize_x(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x f32[T, K] -> (xq i32[T, B, QBLOCK], xd f32[T, B], xsum f32[T, B]), B = K / QBLOCK blocks:
    xq = round(x * XMAX / max|x|) per block (0 for an all-zero block; 15 bits, the kernel holds it
    as 128 * high + low int8 parts), xd = max|x| / XMAX (x ~ xq * xd), xsum the block's sum."""
    xb = x.reshape(x.shape[0], -1, QBLOCK)
    amax = jnp.abs(xb).max(-1)
    inv = jnp.where(amax > 0, jnp.float32(XMAX) / jnp.where(amax > 0, amax, 1), 0)
    xq = jnp.round(xb * inv[..., None]).astype(jnp.int32)
    return xq, amax / jnp.float32(XMAX), xb.sum(-1)


@jax.jit
def linear_offsets(
    x: jax.Array,  # f32[T, K]
    *weights: jax.Array,  # each uint4 [K, N_i]
    scales: tuple[jax.Array, ...],  # each f16[G, N_i]
    offsets: tuple[jax.Array, ...],  # each f16[G, N_i]
) -> tuple[jax.Array, ...]:  # (f32[T, N_i], ...)
    """The kernel's int4 integer products: per block b of QBLOCK input channels (in group g),
    y[t, n] = sum_b (sum_k codes[k, n] * xq[t, k]) * scale[g, n] * xd[t, b] + offset[g, n] *
    xsum[t, b], the integer sums exact."""
    check_offsets(x, weights, scales, offsets)
    xq, xd, xsum = quantize_x(x)
    outs = []
    for w, s, o in zip(weights, scales, offsets):
        codes = w.astype(jnp.int32).reshape(xq.shape[1], QBLOCK, -1)  # [B, QBLOCK, N]
        isum = jnp.einsum("tbk,bkn->tbn", xq, codes)
        per = codes.shape[0] // s.shape[0]  # blocks per group
        sb = jnp.repeat(s.astype(jnp.float32), per, axis=0)  # [B, N]
        ob = jnp.repeat(o.astype(jnp.float32), per, axis=0)
        y = isum.astype(jnp.float32) * sb[None] * xd[..., None] + ob[None] * xsum[..., None]
        outs.append(y.sum(1))
    return tuple(outs)


def dequantize_offsets(
    codes: jax.Array,  # uint4 [K, N] (row-major, not tiled)
    scales: jax.Array,  # f16[G, N]
    offsets: jax.Array,  # f16[G, N]
) -> jax.Array:  # f32[K, N]
    """int4's own layout as f32 values, as `cpu.dequantize`: codes[k, n] * scale[k // g, n] +
    offset[k // g, n], g = K // G (a product, then a sum)."""
    group = codes.shape[0] // scales.shape[0]
    s = jnp.repeat(scales.astype(jnp.float32), group, axis=0)
    return codes.astype(jnp.float32) * s + jnp.repeat(offsets.astype(jnp.float32), group, axis=0)


def offsets_fit(k: int, groups: int) -> bool:
    """Whether int4 codes contracted over K = `k` with `groups` groups of f16 scales and offsets
    take the CPU kernel's integer products (`cpu.linear(..., offsets=)`): K and K / G multiples of
    `QBLOCK`."""
    return groups >= 1 and k % groups == 0 and k % QBLOCK == 0 and (k // groups) % QBLOCK == 0


def tiles_fit(k: int, n: int) -> bool:
    """Whether uint4 codes [K, N] can be tiled (`tile_int4`)."""
    return k > 0 and n > 0 and k % QBLOCK == 0 and n % TILE_N == 0


def tile_int4(codes: jax.Array) -> jax.Array:
    """uint4 codes [K, N] -> the same shape with the elements in the CPU kernel's tile order (its
    decode products read a part of K rows as one contiguous stream): [K / 32, N / 64, 32, 64], the
    32 rows of a block's 64-column strip (32 bytes each, two codes a byte) one after another, so
    tile (b, s) is 1 KB. Works on numpy arrays too. `untile_int4` inverts it."""
    k, n = codes.shape
    return (
        codes.reshape(k // QBLOCK, QBLOCK, n // TILE_N, TILE_N).transpose(0, 2, 1, 3).reshape(k, n)
    )


def untile_int4(codes: jax.Array) -> jax.Array:
    """The inverse of `tile_int4`: tiled codes [K, N] back in row-major [K, N] order. A uint4 JAX
    array moves as whole bytes (its code pairs bitcast to uint8, 32-byte runs); anything else
    (numpy) code by code."""
    k, n = codes.shape
    if isinstance(codes, jax.Array) and codes.dtype == jnp.uint4:
        pairs = jax.lax.bitcast_convert_type(codes.reshape(k, n // 2, 2), jnp.uint8)
        b = pairs.reshape(k // QBLOCK, n // TILE_N, QBLOCK, TILE_N // 2).transpose(0, 2, 1, 3)
        return jax.lax.bitcast_convert_type(b.reshape(k, n // 2), jnp.uint4).reshape(k, n)
    c = codes.reshape(k // QBLOCK, n // TILE_N, QBLOCK, TILE_N)
    return c.transpose(0, 2, 1, 3).reshape(k, n)
