"""Ragged paged attention as a Pallas GPU kernel (Triton lowering); the reference's signature.

Flow of `ragged_paged_attention`:
  1. Trace-time checks (`reference.check_inputs`, plus the Triton constraints: power-of-two
     head_dim and page_size). Block sizes come from `block_sizes.get_block_sizes`.
  2. Query heads are grouped under their KV head (GQA by grouping, never by copying KV): q becomes
     `[T, Hkv, G_pad, D]`, G padded to a power of two with zero heads.
  3. Sequences split into a decode class and a prefill class (`block_sizes.query_classes`); for
     each class a work table maps grid index w -> (sequence, query block), and q is gathered into
     `[W, Hkv, R, D]` blocks, R = block_q * G_pad rows (a decode block holds G_pad rows per token,
     so q_len 1 fills G_pad of them instead of one).
  4. One `pallas_call` per class, grid `(W, Hkv)`. A program reads its sequence's lengths, works
     out the key range its rows can see (causal end, sliding-window start rounded down to a page),
     and walks it in blocks of `pages_per_block` pages: the page ids come from scalar-indexed loads
     of the page table, keys and values are row gathers `kv[page * page_size + offset, 2h(+1), :]`
     (one load serves all G query heads of the KV head: they are rows of the same tile).
     Scores get the soft-cap, then the causal / length / window mask, then an online-softmax
     update (f32 statistics and accumulator; sinks seed the running max and denominator).
     With a `causal_bound` (image tokens) each row is causal up to its own bound (a `[R]` block
     per item) and the item walks keys up to its rows' largest (`block_sizes.gather_bound_blocks`).
  5. Split-K decode (flash-decoding): when `blocks.decode_programs > 0` the decode class's work
     items are KV splits (`block_sizes.split_work_table`): a sequence's KV blocks are shared out
     over up to budget // live-sequences programs, so one long decode still fills the GPU. Each
     split writes its f32 output normalized over its own keys plus the log-sum-exp of its scores
     (sinks counted once, in split 0); `block_sizes.combine_splits` merges the splits.
  6. The output blocks are gathered back to token order; padding tokens get zeros.
  7. An fp8 cache (`reference.Fp8KVCache`, `kv_cache_dtype="fp8"`) is read as float8_e4m3fn rows
     plus their int8 exponents (a second gathered ref): the values widen to q's dtype exactly, and
     the power-of-two scales go where they cost a [K] vector, not a [K, D] tile: K's on the
     scores' columns, V's on the probabilities before the PV product (both exact: x * 2**e).

NOTE: work items past a class's live blocks exit at once, and their output blocks are never read
(with split-K they are combined into a discarded extra block).
NOTE: masked values are zeroed and masked probabilities are exactly 0, so NaN-filled unused pages
and slots never reach the output; page ids are clamped into range before they address memory.

Legend: R = query rows of a block (token-major, then query head within the group), K = keys of a
KV block (`pages_per_block * page_size`), D = head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paged_common as pc
from pallas_kernels.ragged_paged_attention import block_sizes as bs
from pallas_kernels.ragged_paged_attention.reference import (
    Fp8KVCache,
    check_inputs,
    kv_cache_shape,
    update_kv_cache,
)

__all__ = ["kv_cache_shape", "ragged_paged_attention", "update_kv_cache"]


def attend(
    q,  # [R, D] the program's query rows
    q_pos,  # i32[R] their positions
    key_end,  # exclusive: no row sees a key at or past it
    s,  # the sequence
    page_lo,  # the first page a row can see (sliding window)
    lo,
    hi,  # the KV blocks [lo, hi) this program walks
    seed,  # whether the sinks' virtual key is counted here
    h,  # the KV head
    pages_ref,
    sinks_ref,
    kv_ref,
    exp_ref,
    *,
    page_size: int,
    pages_per_block: int,
    pages_per_row: int,
    num_pages: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    bound=None,  # i32[R] the rows' causal bounds (None: their positions)
):
    """(m f32[R], l f32[R], acc f32[R, D]): the online softmax of q's rows over KV blocks [lo, hi)
    of sequence s for KV head h (every kernel program's inner loop)."""
    rows, d = q.shape
    block_k = pages_per_block * page_size
    m0 = jnp.full((rows,), pc.MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((rows,), jnp.float32)
    if sinks_ref is not None:
        m0 = jnp.where(seed, sinks_ref[...].astype(jnp.float32), m0)
        l0 = jnp.where(seed, 1.0, l0)
    acc0 = jnp.zeros((rows, d), jnp.float32)
    offs = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # i32[K]

    def body(b, carry):
        k_pos, slot = pc.kv_block_slots(
            pages_ref,
            s,
            page_lo,
            b,
            offs,
            page_size=page_size,
            pages_per_block=pages_per_block,
            pages_per_row=pages_per_row,
            num_pages=num_pages,
        )
        k = kv_ref[slot, 2 * h, :]  # [K, D]
        v = kv_ref[slot, 2 * h + 1, :]
        k_scale = jnp.full((block_k,), sm_scale, jnp.float32)  # f32[K]
        v_scale = None
        if exp_ref is not None:  # fp8 values widen exactly; the row scales go on vectors
            k, v = k.astype(q.dtype), v.astype(q.dtype)
            k_scale = k_scale * pc.exp2_i8(exp_ref[slot, 2 * h])
            v_scale = pc.exp2_i8(exp_ref[slot, 2 * h + 1])  # f32[K]
        v = jnp.where((k_pos < key_end)[:, None], v, jnp.zeros_like(v))
        sc = (
            jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            * k_scale[None, :]
        )  # [R, K]
        sc = pc.apply_soft_cap(sc, soft_cap)
        mask = pc.causal_mask(q_pos, k_pos, key_end, sliding_window, bound)

        def pv(p):  # [R, D]
            if v_scale is not None:
                p = p * v_scale[None, :]
            return jax.lax.dot_general(
                p.astype(v.dtype),
                v,
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )

        return pc.online_softmax_step(*carry, sc, mask, pv)

    return jax.lax.fori_loop(lo, hi, body, (m0, l0, acc0))


def _kernel(
    work_seq_ref,  # i32[W]
    work_qblk_ref,  # i32[W]
    work_split_ref,  # i32[W] or None (no split-K): the item's split of its sequence's KV blocks
    work_nsplit_ref,  # i32[W] or None: the number of splits of the item's sequence
    work_end_ref,  # i32[W] or None (no causal_bound): the item's key end (its rows' bounds + 1)
    kv_lens_ref,  # i32[S]
    cu_q_lens_ref,  # i32[S+1]
    pages_ref,  # i32[S * pages_per_row] (page table flattened, padded by one KV block of columns)
    q_ref,  # [R, D] this work item's rows for this KV head
    bound_ref,  # i32[R] or None: the rows' causal bounds
    sinks_ref,  # f32[R] or None
    kv_ref,  # [P * page_size, 2*Hkv, D] the cache, one row per slot
    exp_ref,  # i8[P * page_size, 2*Hkv] or None: an fp8 cache's row exponents
    o_ref,  # [R, D] (f32 and normalized over the split's keys with split-K)
    lse_ref=None,  # f32[R] with split-K: log-sum-exp of the split's scores (pc.MASK_VALUE: none)
    *,
    block_q: int,
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
    s = work_seq_ref[w]

    @pl.when(s >= 0)
    def _():
        rows = q_ref.shape[0]
        block_k = pages_per_block * page_size
        # key_end is exclusive: no row sees a key past the block's last token
        first_pos, key_end, page_lo = pc.query_block_keys(
            w,
            s,
            work_qblk_ref,
            kv_lens_ref,
            cu_q_lens_ref,
            block_q=block_q,
            page_size=page_size,
            sliding_window=sliding_window,
        )
        if work_end_ref is not None:  # image rows see up to their image's end
            key_end = jnp.maximum(key_end, work_end_ref[w])
        num_blocks = pc.num_kv_blocks(key_end, page_lo, page_size=page_size, block_k=block_k)
        if work_split_ref is None:
            lo, hi, seed = 0, num_blocks, True
        else:
            split = work_split_ref[w]
            lo, hi = bs.split_range(num_blocks, split, work_nsplit_ref[w])
            seed = split == 0  # the sinks' virtual key is counted by one split only

        q_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) // group  # i32[R]
        m, l, acc = attend(
            q_ref[...],
            q_pos,
            key_end,
            s,
            page_lo,
            lo,
            hi,
            seed,
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
            bound=None if bound_ref is None else bound_ref[...],
        )
        o_ref[...] = pc.normalize(acc, l).astype(o_ref.dtype)
        if lse_ref is not None:
            lse_ref[...] = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), pc.MASK_VALUE)


def _run_class(
    q,
    kv_rows,
    exp_rows,
    kv_lens,
    pages_flat,
    cu_q_lens,
    num_seqs,
    sinks_rows,
    causal_bound,
    cls,
    *,
    blocks,
    group,
    page_size,
    pages_per_row,
    num_pages,
    sm_scale,
    sliding_window,
    soft_cap,
    interpret,
):
    """One pallas_call over one query class; returns (out [T, Hkv, Gp, D], bool[T] membership)."""
    t, hkv, gp, d = q.shape
    rows = cls.block_q * gp
    split_k = blocks.decode_programs > 0 and cls.max_q_len <= blocks.decode_block_q
    with jax.named_scope("rpa_work_table"):
        if split_k:
            num_work = max(cls.num_work, bs.split_budget(blocks, hkv))
            table = bs.split_work_table(
                cu_q_lens,
                kv_lens,
                num_seqs,
                cls,
                budget=bs.split_budget(blocks, hkv),
                num_work=num_work,
                page_size=page_size,
                block_k=blocks.pages_per_block * page_size,
                sliding_window=sliding_window,
            )
            seq, qblk = table.seq, jnp.zeros_like(table.seq)
            split_args = (table.split, table.num_splits)
        else:
            num_work = cls.num_work
            seq, qblk = bs.work_table(cu_q_lens, num_seqs, cls)
            split_args = (None, None)
        q_blocks = bs.gather_query_blocks(q, cu_q_lens, seq, qblk, cls.block_q)  # [W, Hkv, R, D]
        bound_rows = work_end = None
        if causal_bound is not None:  # i32[W, R], i32[W]
            bound_rows, work_end = bs.gather_bound_blocks(
                causal_bound, kv_lens, cu_q_lens, seq, qblk, cls.block_q, gp
            )
    kernel = functools.partial(
        _kernel,
        block_q=cls.block_q,
        group=gp,
        page_size=page_size,
        pages_per_block=blocks.pages_per_block,
        pages_per_row=pages_per_row,
        num_pages=num_pages,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
    )
    whole = pl.BlockSpec()
    split_specs = [whole, whole] if split_k else [None, None]
    q_spec = pl.BlockSpec((None, None, rows, d), lambda w, h: (w, h, 0, 0))
    sinks_spec = None if sinks_rows is None else pl.BlockSpec((None, rows), lambda w, h: (h, 0))
    out_shape = jax.ShapeDtypeStruct((num_work, hkv, rows, d), q.dtype)
    out_spec = q_spec
    if split_k:
        out_shape = (
            jax.ShapeDtypeStruct((num_work, hkv, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((num_work, hkv, rows), jnp.float32),
        )
        out_spec = (q_spec, pl.BlockSpec((None, None, rows), lambda w, h: (w, h, 0)))
    pages_per_seq = pages_per_row - blocks.pages_per_block
    reach = min(cls.num_work * pages_per_seq, num_pages)  # split-K shares a sequence's keys out
    cost = pc.attention_cost(
        programs=cls.num_work * hkv,
        rows=rows,
        keys=pages_per_seq * page_size,
        score_width=d,
        value_width=d,
        cache_bytes=pc.nbytes(kv_rows, exp_rows) * reach // num_pages,
        io_bytes=2 * pc.nbytes(q_blocks) + pc.nbytes(seq, kv_lens, cu_q_lens, pages_flat),
    )
    out_blocks = pl.pallas_call(
        kernel,
        cost_estimate=cost,
        grid=(num_work, hkv),
        in_specs=[
            whole,
            whole,
            *split_specs,
            None if work_end is None else whole,
            whole,
            whole,
            whole,
            q_spec,
            None if bound_rows is None else pl.BlockSpec((None, rows), lambda w, h: (w, 0)),
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
        name=f"ragged_paged_attention_bq{cls.block_q}{'_split_k' if split_k else ''}",
    )(
        seq,
        qblk,
        *split_args,
        work_end,
        kv_lens,
        cu_q_lens,
        pages_flat,
        q_blocks,
        bound_rows,
        sinks_rows,
        kv_rows,
        exp_rows,
    )
    if split_k:
        with jax.named_scope("rpa_combine_splits"):
            out_blocks = bs.combine_splits(*out_blocks, table.block, cls.num_work).astype(q.dtype)
    with jax.named_scope("rpa_unblock"):
        return bs.scatter_query_blocks(out_blocks, cu_q_lens, num_seqs, cls, t)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "soft_cap",
        "interpret",
        "blocks",
        "decode_only",
    ),
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array | Fp8KVCache,  # [P, page_size, 2*Hkv, D]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # f32[Hq]
    interpret: pc.Interpret = False,
    blocks: bs.KernelBlocks | None = None,
    decode_only: bool = False,
    causal_bound: jax.Array | None = None,  # i32[T] (the reference's)
) -> jax.Array:  # [T, Hq, D]
    """Ragged paged attention on GPU; the same contract as `reference.ragged_paged_attention`.

    Args:
      interpret: run the kernel in Pallas interpret mode (CPU).
      blocks: block sizes overriding the `block_sizes` table (tests, tuning).
      decode_only: every live sequence s holds exactly token s (a pure-decode step): one launch
        without query classes or work tables (`gpu_decode`); never with a `causal_bound` (a
        decode is never an image token: the runner marks no step with images decode-only).
      causal_bound: the largest key position each token may see (`reference`'s).
    Returns:
      [T, Hq, D] in q's dtype; zeros for padding tokens.
    """
    check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    t, hq, d = q.shape
    num_pages, page_size, h2, _ = kv_cache.shape
    hkv = h2 // 2
    g = hq // hkv
    for name, n in (("head_dim", d), ("page_size", page_size)):
        if n & (n - 1):
            raise ValueError(f"the GPU kernel needs a power-of-two {name}, got {n}")
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be f32[{hq}], got {sinks.shape}")
    fp8 = isinstance(kv_cache, Fp8KVCache)
    if blocks is None:  # an fp8 cache computes in q's dtype: its tiles are q's
        blocks = bs.get_block_sizes(
            "gpu",
            head_dim=d,
            page_size=page_size,
            dtype=q.dtype if fp8 else kv_cache.dtype,
            group=g,
            pages_per_seq=page_indices.shape[1],
            pow2=True,
        )
    gp = bs.next_pow2(g)
    s_max = page_indices.shape[0]

    with jax.named_scope("rpa_layout"):
        qg = pc.pad_heads(q.reshape(t, hkv, g, d), gp)
        data = kv_cache.data if fp8 else kv_cache
        kv_rows = data.reshape(num_pages * page_size, h2, d)  # free: one row per slot
        exp_rows = kv_cache.exponent.reshape(num_pages * page_size, h2) if fp8 else None
        pages_per_row, pages_flat = pc.flat_page_table(page_indices, blocks.pages_per_block)
    if decode_only and causal_bound is not None:
        raise ValueError("decode_only steps carry no causal_bound (no image tokens)")
    if decode_only:
        from pallas_kernels.ragged_paged_attention import gpu_decode

        return gpu_decode.decode_attention(
            q,
            kv_rows,
            exp_rows,
            kv_lens,
            pages_flat,
            num_seqs,
            sinks,
            blocks=blocks,
            pages_per_row=pages_per_row,
            page_size=page_size,
            num_pages=num_pages,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=interpret,
        )
    out = jnp.zeros((t, hkv, gp, d), q.dtype)
    for cls in bs.query_classes(t, s_max, blocks):
        sinks_rows = None
        if sinks is not None:
            sg = jnp.pad(sinks.astype(jnp.float32).reshape(hkv, g), ((0, 0), (0, gp - g)))
            sinks_rows = jnp.tile(sg, (1, cls.block_q))  # f32[Hkv, R]
        out_c, mine = _run_class(
            qg,
            kv_rows,
            exp_rows,
            kv_lens,
            pages_flat,
            cu_q_lens,
            num_seqs,
            sinks_rows,
            causal_bound,
            cls,
            blocks=blocks,
            group=gp,
            page_size=page_size,
            pages_per_row=pages_per_row,
            num_pages=num_pages,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=interpret,
        )
        out = jnp.where(mine[:, None, None, None], out_c, out)
    return out[:, :, :g].reshape(t, hq, d)
