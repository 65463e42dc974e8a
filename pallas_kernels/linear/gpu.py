"""Weight-only dequantizing matmul as one Pallas GPU kernel (Triton lowering), for few token rows.

`quantized_matmul(x, data, scale, offset)` computes `x @ dequantize(data, scale, offset)`:
x [T, K] (bf16 / f16 / f32) times a weight stored as int8 codes (`jaxinfer.quantization`'s
int8 layout, scales [G, N]) or uint4 codes (int4: scales and offsets [G, N], value = code *
scale + offset), G groups of K / G consecutive input channels, -> [T, N] of x's dtype. The
weight is read from HBM in its stored bits and never written back converted: XLA's own
formulation materializes a float copy of the weight (or a weight-sized f32 partial product)
before its GEMM, which on a decode step (weight bytes bound) costs more than the product itself.

1. Trace-time views: an int4 weight (`uint4[K, N]`, packed two per byte by XLA along N, the first
   of each pair in the low nibble) is bitcast to `uint8[K, N/2]` (free: the same bytes); int8
   stays `int8[K, N]`.
2. Grid `(column blocks, token blocks)`: a program owns `block_n` output columns of `block_t`
   token rows (padded to Triton's 16 by clamping the row index, like `pallas_kernels.lora.gpu`).
   It walks K in tiles of `block_k` input channels (a divisor of the group size, so one tile
   has one scale row): loads the code tile, converts it to x's dtype in registers (int4: the low
   and high nibbles as two tiles, the even and odd output columns), multiplies with x's tile on
   the tensor cores (f32 accumulate), scales that partial product by the tile's group scales and
   adds x's tile row sums times the group offsets (int4: `sum_k x_k (u_k s + o) = s (x . u) + o
   sum_k x_k`).
3. The f32 sum is stored in x's dtype (int4: even and odd columns by strided stores).

NOTE: for few rows only (`MAX_ROWS`: decode and short chunks). Every token block reads the whole
weight again, so a prefill of many rows is left to XLA's dequantize + GEMM (compute bound there:
the converted weight is a small share of its time). `supported()` names what the kernel refuses.

Legend: T token rows, K input channels (contracted), N output channels, G scale groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 64  # token rows the kernel takes (one token block: every row block rereads W)
MAX_BLOCK_K = 128
MIN_PROGRAMS = 128  # column blocks wanted for a decode GEMV (an H100 has 132 SMs)
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint4))


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def _block_k(k: int, groups: int) -> int:
    """The largest power of two <= MAX_BLOCK_K dividing the group size K / G."""
    g = k // groups
    return min(MAX_BLOCK_K, g & -g)


def _block_n(n: int, int4: bool) -> int:
    """Output columns per program: the largest of 128 .. 16 leaving >= MIN_PROGRAMS programs (int4
    at least 32: each nibble half is a dot operand of >= 16 columns)."""
    for b in (128, 64, 32):
        if -(-n // b) >= MIN_PROGRAMS:
            return b
    return 32 if int4 else 16


def supported(t: int, k: int, n: int, groups: int, dtype: jnp.dtype) -> str | None:
    """None when the kernel takes x [t, k] times codes of `dtype` [k, n] with `groups` scale
    groups, else why not."""
    dtype = jnp.dtype(dtype)
    if dtype not in CODE_DTYPES:
        return f"quantized matmul kernel: codes {dtype} are not int8 or uint4"
    if t > MAX_ROWS:
        return f"quantized matmul kernel: {t} rows > {MAX_ROWS}"
    if groups < 1 or k % groups:
        return f"quantized matmul kernel: {groups} groups do not split {k} input channels"
    if _block_k(k, groups) < 16:
        return f"quantized matmul kernel: group size {k // groups} is not a multiple of 16"
    if dtype == jnp.uint4 and n % 2:
        return f"quantized matmul kernel: int4 needs an even output width, got {n}"
    return None


def _kernel(
    x_ref,  # [T, K]
    q_ref,  # i8[K, N] | u8[K, N/2] (int4 pairs)
    s_ref,  # [G, N] f32 | f16
    *rest,  # (o_ref [G, N],)? then out_ref [T, N]
    block_t: int,
    block_k: int,
    block_n: int,
    int4: bool,
    dot_dtype: jnp.dtype,
):
    o_ref, out_ref = rest if int4 else (None, rest[0])
    t, k_dim = x_ref.shape
    n_dim = out_ref.shape[1]
    group = k_dim // s_ref.shape[0]
    j, i = pl.program_id(0), pl.program_id(1)
    width = block_n // 2 if int4 else block_n  # code columns a program reads
    code_cols = n_dim // 2 if int4 else n_dim

    def span(start, size: int, limit: int):  # indices start.., clamped into range if needed
        idx = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
        return idx if limit % size == 0 else jnp.minimum(idx, limit - 1)

    rows = span(i * block_t, block_t, t)  # i32[BT]
    cc = span(j * width, width, code_cols)  # i32[W]: code columns
    # The output columns each accumulator holds: int4 even (low nibbles) and odd (high) ones.
    outs = (2 * cc, 2 * cc + 1) if int4 else (cc,)

    def step(kt, accs):
        ks = kt * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        g = kt * block_k // group
        xk = x_ref[rows[:, None], ks[None, :]].astype(dot_dtype)  # [BT, BK]
        codes = q_ref[ks[:, None], cc[None, :]]  # [BK, W]
        if int4:
            b = codes.astype(jnp.int32)
            tiles = ((b & 15).astype(xk.dtype), (b >> 4).astype(xk.dtype))
            xsum = jnp.sum(xk.astype(jnp.float32), axis=1)[:, None]  # [BT, 1]
        else:
            tiles = (codes.astype(xk.dtype),)
        new = []
        for acc, tile, cols in zip(accs, tiles, outs):
            part = jax.lax.dot(xk, tile, preferred_element_type=jnp.float32)  # [BT, W]
            part = part * s_ref[g, cols].astype(jnp.float32)[None, :]
            if int4:
                part = part + xsum * o_ref[g, cols].astype(jnp.float32)[None, :]
            new.append(acc + part)
        return tuple(new)

    zero = jnp.zeros((block_t, width), jnp.float32)
    accs = jax.lax.fori_loop(0, k_dim // block_k, step, (zero,) * len(outs))
    for acc, cols in zip(accs, outs):
        out_ref[rows[:, None], cols[None, :]] = acc.astype(out_ref.dtype)


def quantized_matmul(
    x: jax.Array,
    data: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """x [T, K] @ the weight `data` [K, N] (int8 or uint4 codes) with `scale` [G, N] (and `offset`
    [G, N] for uint4) -> [T, N] in x's dtype; see the module docstring."""
    t, k_dim = x.shape
    n_dim = data.shape[1]
    groups = scale.shape[0]
    reason = supported(t, k_dim, n_dim, groups, data.dtype)
    if reason is not None:
        raise ValueError(reason)
    int4 = jnp.dtype(data.dtype) == jnp.uint4
    if int4 != (offset is not None):
        raise ValueError("quantized matmul kernel: uint4 codes need offsets, int8 codes none")
    if int4:  # NOTE: the bytes XLA stores; the first of each pair in the low nibble
        data = jax.lax.bitcast_convert_type(data.reshape(k_dim, n_dim // 2, 2), jnp.uint8)
    block_t = _pow2_at_least(t)
    block_n = _block_n(n_dim, int4)
    grid = (pl.cdiv(n_dim, block_n), pl.cdiv(t, block_t))
    operands = (x, data, scale) + ((offset,) if int4 else ())
    size = lambda v: v.size * v.dtype.itemsize  # noqa: E731
    cost = pl.CostEstimate(
        flops=2 * t * k_dim * n_dim,
        transcendentals=0,
        bytes_accessed=sum(size(v) for v in operands) + t * n_dim * x.dtype.itemsize,
    )
    return pl.pallas_call(
        functools.partial(
            _kernel,
            block_t=block_t,
            block_k=_block_k(k_dim, groups),
            block_n=block_n,
            int4=int4,
            # NOTE: XLA:CPU runs no bf16 x bf16 -> f32 dot: interpreted, the operands are widened
            # (exactly: their products are exact in f32, summed in f32 as on the tensor cores).
            dot_dtype=jnp.float32 if interpret else x.dtype,
        ),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((t, n_dim), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
        cost_estimate=cost,
        interpret=interpret,
        name="int4_matmul" if int4 else "int8_matmul",
    )(*operands)
