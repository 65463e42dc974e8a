"""The residual add and the RMSNorm after it as one Pallas GPU kernel (Triton lowering).

`add_rms_norm(x, y, w)` returns `h = x + y` (in x's dtype: the new residual stream) and
`rms_norm(h) * (offset + w)` (in x's dtype), what a decoder layer computes between its blocks.
XLA:GPU keeps the add a launch of its own (the sum has two readers: the norm and the next
residual add) and, at one token, splits the norm into a reduction and an elementwise fusion:
3 launches where this kernel is 1 (issue 31).

1. Grid `(T,)`: program t loads row t of x and y (`[E]`, E a power of two), adds them in f32 and
   rounds to x's dtype (XLA's add of two bf16 arrays gives the same bits), stores h.
2. The norm reads the rounded h in f32: mean of squares, `rsqrt(mean + eps)`, times
   `offset + w`, rounded to x's dtype (`jaxinfer.layers.rms_norm`'s order of operations).

NOTE: `supported(x)` asks for a power-of-two hidden size (Triton's block shapes); callers fall
back to XLA's add and norm otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paged_common as pc


def supported(x: jax.Array) -> bool:
    """Whether `add_rms_norm` takes x [T, E]: 2-D with a power-of-two E."""
    e = x.shape[-1]
    return x.ndim == 2 and e >= 16 and e & (e - 1) == 0


def _kernel(x_ref, y_ref, w_ref, h_ref, o_ref, *, eps: float, offset: float):
    h = (x_ref[...].astype(jnp.float32) + y_ref[...].astype(jnp.float32)).astype(h_ref.dtype)
    h_ref[...] = h
    hf = h.astype(jnp.float32)
    hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf) + eps)
    o_ref[...] = (hf * (offset + w_ref[...].astype(jnp.float32))).astype(o_ref.dtype)


def add_rms_norm(
    x: jax.Array,  # [T, E]
    y: jax.Array,  # [T, E]
    weight: jax.Array,  # [E]
    eps: float,
    offset: float = 0.0,
    *,
    interpret: pc.Interpret = False,
) -> tuple[jax.Array, jax.Array]:
    """(h = x + y, rms_norm(h) * (offset + weight)), both [T, E] in x's dtype; one launch."""
    t, e = x.shape
    row = pl.BlockSpec((None, e), lambda i: (i, 0))
    out = jax.ShapeDtypeStruct((t, e), x.dtype)
    return pl.pallas_call(
        functools.partial(_kernel, eps=eps, offset=offset),
        grid=(t,),
        in_specs=[row, row, pl.BlockSpec((e,), lambda i: (0,))],
        out_specs=(row, row),
        out_shape=(out, out),
        compiler_params=plgpu.CompilerParams(num_warps=min(8, max(1, e // 512)), num_stages=1),
        interpret=interpret,
        name="add_rms_norm",
    )(x, y.astype(x.dtype), weight)
