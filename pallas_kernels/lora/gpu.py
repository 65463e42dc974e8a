"""Multi-LoRA shrink + slot mask + expand + add as one Pallas GPU kernel (Triton lowering).

`lora_apply(x, a, b, slots, y)` computes, for each token t with slot s_t (0: no adapter),
`y[t] + (x[t] @ A[s_t]) @ B[s_t]` for every part of an input group in one launch (the layout of
`jaxinfer.lora.device`: A `[in, P, N, R]`, B `[Q, N, R, *out]`, y in B's out layout).

1. Trace-time views (free reshapes): y as `[T, H, Q, C]` (qkv: `[T, Hkv, G+2, D]`; gate_up:
   `[T, 1, 2, F]`; o / down: `[T, 1, 1, E]`), A as `[in, P, N*R]`, B as `[Q, N*R, H, C]`.
   Expand part q reads shrink part `max(q - (Q - P), 0)`: qkv's G query parts all read part 0
   (q's A), K part 1, V part 2; gate_up part q reads part q.
2. Grid `(token blocks, H*Q, column blocks)`: a program owns `block_t` tokens and `block_c`
   columns of one (H, Q) part. It recomputes its tokens' shrink for every slot at once (`[block_t,
   in] @ [in, N*R]`, f32, a loop over `block_k` input columns; redundant across the column
   blocks, cheap: N*R is at most a few hundred columns), zeroes the columns of slots other than
   each token's own (`(col // R) == s_t - 1`: slot 0 keeps none), expands with `[N*R, block_c]`
   of B and stores the f32 delta tile.
3. With `gate_act` (the gated MLP's down projection) x is the `[T, 2, F]` gate_up output and
   the shrink reads `gate_act(gate) * up` itself, so the base down product keeps the activation
   fused in (no hidden-activation buffer just for the kernel).
4. Where the base product is a GEMM (more than one token) the kernel returns the f32 delta and
   `y + delta` is left to XLA, which fuses it into y's consumer together with a split-K GEMM's
   reduction (a kernel reading y needs y reduced first: one more launch per group). A one-token
   base product is a row reduction without split-K: there y is aliased to the output and the
   kernel adds in place (the sum then has a single producer, where XLA would materialize a
   `y + delta` read by two consumers, e.g. gate_up's by the down product and down's kernel).
   Deviceless H100 (`tests/test_aot.py::test_h100_lora_kernels_per_layer`): 4 extra launches
   per layer at 1 and at 64 tokens; one rule for both token counts gave 5 at one of them.

NOTE: Triton's dot wants every dim >= 16 and power-of-two blocks: the token, slot*rank and column
ranges are padded to such blocks by clamping their indices to the last valid row/column (padded
rows and columns recompute and store the last real one's value, never touch memory outside the
arrays; padded slot*rank columns are masked to zero). The input dim is never padded (it is a
sum): `supported()` asks for `in % 16 == 0`.

Legend: T tokens, P shrink parts, Q expand parts, N slots, R rank, H x C the columns of one part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_BLOCK_K = 256


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def _block_k(in_dim: int) -> int:
    """The largest power of two <= MAX_BLOCK_K dividing `in_dim`."""
    return min(MAX_BLOCK_K, in_dim & -in_dim)


def supported(in_dim: int) -> str | None:
    """None when the kernel runs for an input dim of `in_dim`, else why not."""
    if _block_k(in_dim) < 16:
        return f"LoRA kernel: input dim {in_dim} is not a multiple of 16"
    return None


def _kernel(
    slots_ref,  # i32[T]
    x_ref,  # [T, in], or [T, 2, in] with `gate_act` (gate, up)
    a_ref,  # [in, P, NR]
    b_ref,  # [Q, NR, H, C]
    *refs,  # (o_ref f32[T, H, Q, C]: the delta) or (y_ref, o_ref [T, H, Q, C] aliased): y + delta
    block_t: int,
    block_k: int,
    block_c: int,
    rank: int,
    gate_act: Callable | None,
):
    o_ref = refs[-1]
    t, _, q_parts, c_dim = o_ref.shape
    in_dim, p_parts, nr = a_ref.shape
    nr_pad = _pow2_at_least(nr)
    i, m, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h, q = m // q_parts, m % q_parts
    p = jnp.maximum(q - (q_parts - p_parts), 0)

    def span(start, size: int, limit: int):  # indices start.., clamped into range if needed
        idx = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
        return idx if limit % size == 0 else jnp.minimum(idx, limit - 1)

    rows = span(i * block_t, block_t, t)  # i32[BT]
    lanes = span(0, nr_pad, nr)  # i32[NRp]
    cols = span(c * block_c, block_c, c_dim)  # i32[BC]

    def shrink(k, acc):
        ks = k * block_k + jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)
        if gate_act is None:
            xk = x_ref[rows[:, None], ks[None, :]]  # [BT, BK]
        else:  # the gated MLP's hidden activations, from its gate and up halves
            gate, up = (x_ref[rows[:, None], j, ks[None, :]] for j in (0, 1))
            xk = (gate_act(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(up.dtype)
        ak = a_ref[ks[:, None], p, lanes[None, :]]  # [BK, NRp]
        return acc + jax.lax.dot(xk, ak, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, in_dim // block_k, shrink, jnp.zeros((block_t, nr_pad), jnp.float32))
    slot_of_lane = jax.lax.broadcasted_iota(jnp.int32, (nr_pad,), 0) // rank  # NRp >= NR: >= N
    keep = slots_ref[rows][:, None] - 1 == slot_of_lane[None, :]
    s = jnp.where(keep, acc, 0.0).astype(b_ref.dtype)
    bk = b_ref[q, lanes[:, None], h, cols[None, :]]  # [NRp, BC]
    delta = jax.lax.dot(s, bk, preferred_element_type=jnp.float32)  # [BT, BC]
    tile = (rows[:, None], h, q, cols[None, :])
    if len(refs) == 2:
        delta = refs[0][tile].astype(jnp.float32) + delta
    o_ref[tile] = delta.astype(o_ref.dtype)


def lora_apply(
    x: jax.Array,
    a: jax.Array,
    b: jax.Array,
    slots: jax.Array,
    y: jax.Array,
    *,
    gate_act: Callable | None = None,
    interpret: bool = False,
) -> jax.Array:
    """y [T, ...] (B's out layout) plus each token's adapter product; see the module docstring.

    x [T, in]; a [in, P, N, R]; b [Q, N, R, *out] (out: [O], or qkv's [Hkv, D] with y
    [T, Hkv, Q, D]); slots i32[T] (0: no adapter, k: slot k-1 of the stacks). `gate_act`: x is
    a gated MLP's `[T, 2, in]` (gate, up) and the shrink reads `gate_act(gate) * up` (computed in
    the kernel: the hidden activations then stay fused into the base down product)."""
    t, in_dim = x.shape[0], x.shape[-1]
    _, p_parts, n, r = a.shape
    q_parts = b.shape[0]
    h, c_dim = b.shape[3:] if b.ndim == 5 else (1, b.shape[-1])
    reason = supported(in_dim)
    if reason is not None:
        raise ValueError(reason)
    a3 = a.reshape(in_dim, p_parts, n * r)
    b4 = b.reshape(q_parts, n * r, h, c_dim)
    block_t = min(64, _pow2_at_least(t))
    block_c = min(256 if block_t <= 16 else 128, _pow2_at_least(c_dim))
    grid = (pl.cdiv(t, block_t), h * q_parts, pl.cdiv(c_dim, block_c))
    nr_pad = _pow2_at_least(n * r)
    size = lambda v: v.size * v.dtype.itemsize  # noqa: E731
    cost = pl.CostEstimate(
        flops=2 * grid[0] * block_t * nr_pad * (in_dim * grid[1] * grid[2] + h * q_parts * c_dim),
        transcendentals=0,
        bytes_accessed=size(x) + size(a) + size(b) + y.size * 4 + size(slots),
    )
    in_place = t == 1  # NOTE: step 4 of the module docstring
    shape = (t, h, q_parts, c_dim)
    out = pl.pallas_call(
        functools.partial(
            _kernel,
            block_t=block_t,
            block_k=_block_k(in_dim),
            block_c=block_c,
            rank=r,
            gate_act=gate_act,
        ),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct(shape, y.dtype if in_place else jnp.float32),
        input_output_aliases={4: 0} if in_place else {},
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        cost_estimate=cost,
        interpret=interpret,
        name="lora_shrink_expand",
    )(slots.astype(jnp.int32), x, a3, b4, *((y.reshape(shape),) if in_place else ()))
    if in_place:
        return out.reshape(y.shape)
    return (y.astype(jnp.float32) + out.reshape(y.shape)).astype(y.dtype)
