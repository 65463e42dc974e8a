"""The GPU kernel's decode-only path: every live sequence of the step decodes one token.

A pure-decode step needs none of the ragged machinery of `gpu.py` (query classes, work tables,
the query-block gather and scatter, the class select): token t is sequence t. Flow of
`decode_attention`:
  1. q `[T, Hq, D]` becomes `[T, Hkv, R, D]`: the G query heads of a KV head are the rows of one
     tile, padded with zero rows to R = max(G_pad, 16) (Triton's dot needs 16 rows); XLA fuses
     the pad into the producer of q (the rope fusion after the QKV product).
  2. One `pallas_call`, grid `(T * splits, Hkv)`. The split count is static:
     `decode_programs // (T * Hkv)` rounded down to a power of two (flash-decoding when few sequences leave SMs idle; 1 from 64
     sequences of 8 KV heads on an H100), at most the KV blocks a sequence can have. Program
     (t * splits + j, h) walks split j of sequence t's KV blocks (`block_sizes.split_range`) with
     the inner loop every GPU program shares (`gpu.attend`); programs of padding sequences
     (t >= num_seqs) write zeros.
  3. One split: the kernel writes the output [T, Hq, D] in q's dtype, only the G real rows of
     each tile (`store_heads`: a masked store, so no slice of a padded output follows). Several:
     each split writes its f32 output normalized over its own keys and its log-sum-exp, and one
     more launch merges them into [T, Hq, D]
     (`combine`, grid (T, Hkv): an online max over the splits; no scatter: every sequence has
     the same static number of splits). XLA's own reduction of the same merge took 4 kernels.

NOTE: the caller guarantees that live sequence s holds exactly token s (`cu_q_lens[s] = s`);
`jaxinfer.attention` takes this path only for a one-token step or a step marked decode-only.
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

MIN_ROWS = 16  # Triton's dot needs every dimension >= 16


def num_splits(blocks: bs.KernelBlocks, num_tokens: int, num_kv_heads: int, max_blocks: int) -> int:
    """Static KV splits per sequence (step 2 of the module docstring): a power of two (Triton's
    block shapes in the combine)."""
    n = max(1, min(blocks.decode_programs // (num_tokens * num_kv_heads), max_blocks))
    return 1 << (n.bit_length() - 1)


def _kernel(
    num_seqs_ref,  # i32[1]
    kv_lens_ref,  # i32[S]
    pages_ref,  # i32[S * pages_per_row]
    q_ref,  # [R, D]
    sinks_ref,  # f32[R] or None
    kv_ref,  # [P * page_size, 2*Hkv, D]
    exp_ref,  # i8[P * page_size, 2*Hkv] or None
    o_ref,  # one split: the whole [T, Hq, D] output; several: this split's f32[R, D]
    lse_ref=None,  # f32[R] with several splits
    *,
    splits: int,
    group: int,
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

    @pl.when(live)
    def _():
        rows = q_ref.shape[0]
        block_k = pages_per_block * page_size
        first_pos, key_end, page_lo = pc.key_range(
            kv_lens_ref[s], 1, 0, 1, page_size=page_size, sliding_window=sliding_window
        )
        num_blocks = pc.num_kv_blocks(key_end, page_lo, page_size=page_size, block_k=block_k)
        lo, hi = bs.split_range(num_blocks, split, splits)
        m, l, acc = attend(
            q_ref[...],
            jnp.full((rows,), first_pos, jnp.int32),
            key_end,
            s,
            page_lo,
            lo,
            hi,
            split == 0,
            h,
            pages_ref,
            sinks_ref,
            kv_ref,
            exp_ref,
            page_size=page_size,
            pages_per_block=pages_per_block,
            pages_per_row=pages_per_row,
            num_pages=num_pages,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        _emit(o_ref, lse_ref, s, h, m, l, acc, group)

    @pl.when(jnp.logical_not(live))
    def _():
        _emit_padding(o_ref, lse_ref, s, h, q_ref.shape, group)


def _emit(o_ref, lse_ref, s, h, m, l, acc, group: int) -> None:
    """Stores a program's result: its G heads of the whole output (one split), or its split's
    normalized f32 output and log-sum-exp (several)."""
    out = pc.normalize(acc, l)
    if lse_ref is None:
        store_heads(o_ref, s, h, out, group)
    else:
        o_ref[...] = out
        lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), pc.MASK_VALUE)


def _emit_padding(o_ref, lse_ref, s, h, shape, group: int) -> None:
    """A padding sequence's program: zeros (an empty split: lse MASK, weight 0 in `combine`)."""
    if lse_ref is None:
        store_heads(o_ref, s, h, jnp.zeros(shape, jnp.float32), group)
    else:
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
        lse_ref[...] = jnp.full(lse_ref.shape, pc.MASK_VALUE, jnp.float32)


def store_heads(o_ref, t, h, val, group: int) -> None:
    """Writes the first `group` rows of `val` [R, D] (KV head h's query heads; the rest are the
    tile's zero padding) into token t's heads [h * group, (h + 1) * group) of the whole output
    `o_ref` [T, Hq, D]: a masked store, so no slice of a padded output follows the kernel (XLA
    ran one as a kernel of its own before the o_proj product)."""
    rows = val.shape[0]
    mask = jax.lax.broadcasted_iota(jnp.int32, val.shape, 0) < group
    plgpu.store(o_ref.at[t, pl.ds(h * group, rows), :], val.astype(o_ref.dtype), mask=mask)


def _combine_kernel(o_ref, lse_ref, out_ref, *, splits: int, group: int):
    """The flash-decoding merge of one (sequence, KV head): out = sum_j exp(lse_j - M) o_j /
    sum_j exp(lse_j - M), M = max_j lse_j, as an online max over the splits (an empty split or a
    padding sequence has lse = MASK and weighs 0, or gives 0)."""
    rows, d = o_ref.shape[1:]

    def body(j, carry):
        m, den, num = carry
        lse = lse_ref[j]  # f32[R]
        m_new = jnp.maximum(m, lse)
        scale, w = jnp.exp(m - m_new), jnp.exp(lse - m_new)
        return m_new, scale * den + w, scale[:, None] * num + w[:, None] * o_ref[j]

    init = (
        jnp.full((rows,), pc.MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )
    _, den, num = jax.lax.fori_loop(0, splits, body, init)
    store_heads(out_ref, pl.program_id(0), pl.program_id(1), num / den[:, None], group)


def combine(
    out: jax.Array, lse: jax.Array, group: int, dtype, *, interpret: pc.Interpret
) -> jax.Array:
    """f32[T, splits, Hkv, R, D] split outputs and f32[T, splits, Hkv, R] log-sum-exps -> the
    [T, Hkv * group, D] output in `dtype` (the first `group` rows of each KV head's tile): one
    launch (`_combine_kernel`), grid (T, Hkv)."""
    t, splits, hkv, rows, d = out.shape
    return pl.pallas_call(
        functools.partial(_combine_kernel, splits=splits, group=group),
        grid=(t, hkv),
        in_specs=[
            pl.BlockSpec((None, splits, None, rows, d), lambda i, h: (i, 0, h, 0, 0)),
            pl.BlockSpec((None, splits, None, rows), lambda i, h: (i, 0, h, 0)),
        ],
        out_specs=pl.BlockSpec(),
        out_shape=jax.ShapeDtypeStruct((t, hkv * group, d), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        interpret=interpret,
        name="ragged_paged_attention_combine",
    )(out, lse)


def decode_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_rows: jax.Array,  # [P * page_size, 2*Hkv, D]
    exp_rows: jax.Array | None,  # i8[P * page_size, 2*Hkv]: an fp8 cache's exponents
    kv_lens: jax.Array,  # i32[S], S >= T
    pages_flat: jax.Array,  # i32[S * pages_per_row]
    num_seqs: jax.Array,  # i32[1]
    sinks: jax.Array | None,  # f32[Hq]
    *,
    blocks: bs.KernelBlocks,
    pages_per_row: int,
    page_size: int,
    num_pages: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    interpret: pc.Interpret,
) -> jax.Array:  # [T, Hq, D]; zeros for padding tokens
    t, hq, d = q.shape
    hkv = kv_rows.shape[1] // 2
    g = hq // hkv
    rows = max(bs.next_pow2(g), MIN_ROWS)
    max_blocks = -(-(pages_per_row - blocks.pages_per_block) // blocks.pages_per_block)
    splits = num_splits(blocks, t, hkv, max_blocks)
    with jax.named_scope("rpa_layout"):
        qg = pc.pad_heads(q.reshape(t, hkv, g, d), rows)  # [T, Hkv, R, D]
        sinks_rows = None
        if sinks is not None:
            sinks_rows = jnp.pad(sinks.astype(jnp.float32).reshape(hkv, g), ((0, 0), (0, rows - g)))
    whole = pl.BlockSpec()
    q_spec = pl.BlockSpec((None, None, rows, d), lambda w, h: (w // splits, h, 0, 0))
    sinks_spec = None if sinks is None else pl.BlockSpec((None, rows), lambda w, h: (h, 0))
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((t, hq, d), q.dtype)
        out_spec = whole
    else:
        out_shape = (
            jax.ShapeDtypeStruct((t, splits, hkv, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((t, splits, hkv, rows), jnp.float32),
        )
        out_spec = (
            pl.BlockSpec(
                (None, None, None, rows, d), lambda w, h: (w // splits, w % splits, h, 0, 0)
            ),
            pl.BlockSpec((None, None, None, rows), lambda w, h: (w // splits, w % splits, h, 0)),
        )
    pages_per_seq = pages_per_row - blocks.pages_per_block
    cost = pc.attention_cost(
        programs=t * splits * hkv,
        rows=rows,
        keys=pages_per_seq * page_size // splits,
        score_width=d,
        value_width=d,
        cache_bytes=pc.nbytes(kv_rows, exp_rows) * min(t * pages_per_seq, num_pages) // num_pages,
        io_bytes=2 * pc.nbytes(qg) + pc.nbytes(kv_lens, pages_flat),
    )
    kernel = functools.partial(
        _kernel,
        splits=splits,
        group=g,
        page_size=page_size,
        pages_per_block=blocks.pages_per_block,
        pages_per_row=pages_per_row,
        num_pages=num_pages,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    out = pl.pallas_call(
        kernel,
        cost_estimate=cost,
        grid=(t * splits, hkv),
        in_specs=[
            whole,
            whole,
            whole,
            q_spec,
            sinks_spec,
            whole,
            None if exp_rows is None else whole,
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(
            num_warps=blocks.num_warps, num_stages=blocks.num_stages
        ),
        interpret=interpret,
        name=f"ragged_paged_attention_decode{'_split_k' if splits > 1 else ''}",
    )(num_seqs, kv_lens, pages_flat, qg, sinks_rows, kv_rows, exp_rows)
    if splits > 1:
        with jax.named_scope("rpa_combine_splits"):
            out = combine(*out, g, q.dtype, interpret=interpret)
    return out
