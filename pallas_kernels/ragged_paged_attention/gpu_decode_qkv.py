"""The GPU decode-only path from the fused QKV product: RoPE, the KV write and attention in one launch.

`gpu_decode.decode_attention` reads q after RoPE and a cache the step's K/V were written into;
XLA runs those as launches of their own (the KV-write scatter with k's RoPE, q's RoPE + pad).
`qkv_decode_attention` takes the QKV product `[T, Hkv, G+2, D]` as it leaves the GEMM (bias and
LoRA added) and the step's `[T, D]` cos/sin rows (`expand_rope`, once per step), so a decoder
layer launches attention once (twice with split-K: the merge, `gpu_decode.combine`). Flow of
program `(t * splits + j, h)` (the grid and splits of `gpu_decode`; token t is sequence t):
  1. Loads KV head h's G query rows (zero-padded to R >= 16 rows) and its K and V rows from token
     t's QKV row, rotates q and k: `x * cos + rot(x) * sin` in f32, rounded to the cache dtype,
     where `rot(x) = x @ P` is the rotate-half permutation with signs (a dot with a +-1 matrix:
     Triton has no concatenation of halves; exact for 16-bit inputs).
  2. Split 0 of a live token with a slot stores the rotated K and V rows into the cache (the
     cache is aliased to the output: written in place, nothing else copied).
  3. Attends over the cached keys before the new one (`key_end = kv_len - 1`: no program reads
     the slot being written), then split 0 folds the new key in from registers (one more online
     softmax step), so the result equals the write-then-attend of `jaxinfer.attention`.
  4. Stores as `gpu_decode` does (its G heads, or the split's f32 output and log-sum-exp).

NOTE: the caller (`jaxinfer.attention.attention_qkv`) sends only steps `gpu_decode` serves, a
16-bit cache of qkv's dtype (no fp8) and a model without QK-norm (the rotation must follow it).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paged_common as pc
from pallas_kernels.ragged_paged_attention import block_sizes as bs
from pallas_kernels.ragged_paged_attention.gpu import attend
from pallas_kernels.ragged_paged_attention.gpu_decode import (
    MIN_ROWS,
    _emit,
    _emit_padding,
    combine,
    num_splits,
)


def expand_rope(cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin f32[T, D/2] -> f32[T, D] each (halves repeated), the kernel's per-column factors."""
    return jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([sin, sin], axis=-1)


def _rotate(x, cos, sin):
    """RoPE of the rows of x [R, D] (step 1 of the module docstring), f32."""
    d = x.shape[1]
    half = d // 2
    i = jax.lax.broadcasted_iota(jnp.int32, (d, d), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (d, d), 1)
    sign = jnp.where(j < half, -1.0, 1.0)
    perm = jnp.where((i == j + half) | (i == j - half), sign, 0.0).astype(x.dtype)
    rot = jax.lax.dot_general(x, perm, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return x.astype(jnp.float32) * cos[None, :] + rot * sin[None, :]


def _kernel(
    num_seqs_ref,  # i32[1]
    kv_lens_ref,  # i32[S]
    pages_ref,  # i32[S * pages_per_row]
    slots_ref,  # i32[T]: each token's cache row (< 0: padding)
    qkv_ref,  # [T, Hkv * (G+2), D]
    cos_ref,  # f32[T, D]
    sin_ref,  # f32[T, D]
    sinks_ref,  # f32[R] or None
    kv_ref,  # [P * page_size, 2*Hkv, D] (aliased to kv_out_ref)
    o_ref,
    lse_ref,  # None with one split
    kv_out_ref,
    *,
    splits: int,
    group: int,
    rows: int,
    page_size: int,
    pages_per_block: int,
    pages_per_row: int,
    num_pages: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    w, h = pl.program_id(0), pl.program_id(1)
    s, split = w // splits, w % splits
    live = s < num_seqs_ref[0]
    d = qkv_ref.shape[2]

    @pl.when(live)
    def _():
        cos, sin = cos_ref[s, :], sin_ref[s, :]
        base = h * (group + 2)
        row_q = jax.lax.broadcasted_iota(jnp.int32, (rows, d), 0)
        q = plgpu.load(qkv_ref.at[s, pl.ds(base, rows), :], mask=row_q < group, other=0.0)
        q = _rotate(q, cos, sin).astype(kv_ref.dtype)
        row_kv = jax.lax.broadcasted_iota(jnp.int32, (MIN_ROWS, d), 0)
        kv = plgpu.load(qkv_ref.at[s, pl.ds(base + group, MIN_ROWS), :], mask=row_kv < 2, other=0.0)
        kv = jnp.where(row_kv == 0, _rotate(kv, cos, sin), kv.astype(jnp.float32))
        kv = kv.astype(kv_ref.dtype)  # row 0: k after RoPE, row 1: v
        slot = slots_ref[s]

        @pl.when((split == 0) & (slot >= 0))
        def _():
            plgpu.store(kv_out_ref.at[slot, pl.ds(2 * h, MIN_ROWS), :], kv, mask=row_kv < 2)

        block_k = pages_per_block * page_size
        first_pos, key_end, page_lo = pc.key_range(
            kv_lens_ref[s], 1, 0, 1, page_size=page_size, sliding_window=sliding_window
        )
        cached_end = key_end - 1  # the new key comes from registers (step 3)
        num_blocks = pc.num_kv_blocks(cached_end, page_lo, page_size=page_size, block_k=block_k)
        lo, hi = bs.split_range(num_blocks, split, splits)
        m, l, acc = attend(
            q,
            jnp.full((rows,), first_pos, jnp.int32),
            cached_end,
            s,
            page_lo,
            lo,
            hi,
            split == 0,
            h,
            pages_ref,
            sinks_ref,
            kv_ref,
            None,
            page_size=page_size,
            pages_per_block=pages_per_block,
            pages_per_row=pages_per_row,
            num_pages=num_pages,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        kvf = kv.astype(jnp.float32)
        k_new = jnp.sum(jnp.where(row_kv == 0, kvf, 0.0), axis=0)  # f32[D]
        v_new = jnp.sum(jnp.where(row_kv == 1, kvf, 0.0), axis=0)
        score = pc.apply_soft_cap(
            jnp.sum(q.astype(jnp.float32) * k_new[None, :], axis=1) * sm_scale, soft_cap
        )  # f32[R]
        m_new = jnp.maximum(m, score)
        alpha, p = jnp.exp(m - m_new), jnp.exp(score - m_new)
        p_v = p.astype(kv.dtype).astype(jnp.float32)  # as the cached keys' p @ v rounds p
        first = split == 0
        m = jnp.where(first, m_new, m)
        l = jnp.where(first, alpha * l + p, l)
        acc = jnp.where(first, alpha[:, None] * acc + p_v[:, None] * v_new[None, :], acc)
        _emit(o_ref, lse_ref, s, h, m, l, acc, group)

    @pl.when(jnp.logical_not(live))
    def _():
        _emit_padding(o_ref, lse_ref, s, h, (rows, d), group)


def qkv_decode_attention(
    qkv: jax.Array,  # [T, Hkv, G+2, D]: the QKV product, before RoPE
    cos: jax.Array,  # f32[T, D] (`expand_rope`)
    sin: jax.Array,  # f32[T, D]
    kv_cache: jax.Array,  # [P, page_size, 2*Hkv, D] in qkv's dtype
    slot_mapping: jax.Array,  # i32[T]
    kv_lens: jax.Array,  # i32[S], S >= T
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    num_seqs: jax.Array,  # i32[1]
    sinks: jax.Array | None = None,  # f32[Hq]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: pc.Interpret = False,
    blocks: bs.KernelBlocks | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(out [T, Hq, D] in qkv's dtype, zeros for padding tokens; the cache with the step's K/V
    written): `jaxinfer.attention.attention` of the rotated q/k/v on a decode-only step."""
    t, hkv, g2, d = qkv.shape
    g = g2 - 2
    num_pages, page_size, h2, _ = kv_cache.shape
    if blocks is None:
        blocks = bs.get_block_sizes(
            "gpu",
            head_dim=d,
            page_size=page_size,
            dtype=kv_cache.dtype,
            group=g,
            pages_per_seq=page_indices.shape[1],
            pow2=True,
        )
    rows = max(bs.next_pow2(g), MIN_ROWS)
    with jax.named_scope("rpa_layout"):
        kv_rows = kv_cache.reshape(num_pages * page_size, h2, d)  # free: one row per slot
        pages_per_row, pages_flat = pc.flat_page_table(page_indices, blocks.pages_per_block)
        sinks_rows = None
        if sinks is not None:
            sinks_rows = jnp.pad(sinks.astype(jnp.float32).reshape(hkv, g), ((0, 0), (0, rows - g)))
    max_blocks = -(-(pages_per_row - blocks.pages_per_block) // blocks.pages_per_block)
    splits = num_splits(blocks, t, hkv, max_blocks)
    whole = pl.BlockSpec()
    kv_shape = jax.ShapeDtypeStruct(kv_rows.shape, kv_rows.dtype)
    if splits == 1:
        out_shape = (jax.ShapeDtypeStruct((t, hkv * g, d), qkv.dtype), None, kv_shape)
        out_spec = (whole, None, whole)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((t, splits, hkv, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((t, splits, hkv, rows), jnp.float32),
            kv_shape,
        )
        out_spec = (
            pl.BlockSpec(
                (None, None, None, rows, d), lambda w, h: (w // splits, w % splits, h, 0, 0)
            ),
            pl.BlockSpec((None, None, None, rows), lambda w, h: (w // splits, w % splits, h, 0)),
            whole,
        )
    pages_per_seq = pages_per_row - blocks.pages_per_block
    cost = pc.attention_cost(
        programs=t * splits * hkv,
        rows=rows,
        keys=pages_per_seq * page_size // splits,
        score_width=d,
        value_width=d,
        cache_bytes=pc.nbytes(kv_rows) * min(t * pages_per_seq, num_pages) // num_pages,
        io_bytes=2 * pc.nbytes(qkv) + pc.nbytes(kv_lens, pages_flat),
    )
    kernel = functools.partial(
        _kernel,
        splits=splits,
        group=g,
        rows=rows,
        page_size=page_size,
        pages_per_block=blocks.pages_per_block,
        pages_per_row=pages_per_row,
        num_pages=num_pages,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    args = (num_seqs, kv_lens, pages_flat, slot_mapping, qkv.reshape(t, hkv * g2, d), cos, sin)
    sinks_spec = None if sinks is None else pl.BlockSpec((None, rows), lambda w, h: (h, 0))
    out, lse, kv_rows = pl.pallas_call(
        kernel,
        cost_estimate=cost,
        grid=(t * splits, hkv),
        in_specs=[whole] * len(args) + [sinks_spec, whole],
        out_specs=out_spec,
        out_shape=out_shape,
        # NOTE: the cache is the last input leaf (sinks=None adds none) and the last output
        input_output_aliases={len(args) + (sinks is not None): 1 + (splits > 1)},
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name=f"ragged_paged_attention_decode_qkv{'_split_k' if splits > 1 else ''}",
    )(*args, sinks_rows, kv_rows)
    if splits > 1:
        with jax.named_scope("rpa_combine_splits"):
            out = combine(out, lse, g, qkv.dtype, interpret=interpret)
    return out, kv_rows.reshape(kv_cache.shape)
