"""Ragged paged attention as a Pallas TPU (Mosaic) kernel; the reference's signature.

Flow of `ragged_paged_attention`:
  1. Trace-time checks (`reference.check_inputs`); block sizes from `block_sizes.get_block_sizes`.
  2. Query heads are grouped under their KV head: q becomes `[T, Hkv, G, D]`.
  3. Sequences split into a decode and a prefill class (`block_sizes.query_classes`); per class a
     work table maps grid index w -> (sequence, query block) and q is gathered into
     `[W, Hkv, R, D]` blocks (R = block_q * G rows, token-major), which BlockSpecs bring into VMEM.
  4. One `pallas_call` per class, grid `(W, Hkv)`, with the work table, lengths and the flattened
     page table scalar-prefetched into SMEM (`PrefetchScalarGridSpec`). The cache stays in HBM
     (`memory_space=pl.ANY`, the operand pinned to HBM, in the `tpu_layout` `[P, Hkv,
     page_size, W]`, read in place); a program DMAs the pages it needs, one `[page_size, W]` (K
     and V rows of its KV head) copy per page, into a two-slot VMEM buffer: while block b is
     computed, block b+1 is in flight (one DMA semaphore per slot). Only pages that hold keys the
     block's rows can see are copied (causal end; sliding-window start rounded down to a page).
  5. Per KV block: K and V are the lanes [0, D) and [D, 2D) of the slot's `[pages, page_size,
     W]`, scores get the soft-cap and the causal / length / window mask, then an online-softmax
     update (f32; sinks seed the running max and denominator). The output blocks are gathered
     back to token order. With a `causal_bound` (image tokens) each row is causal up to its own
     bound (an `i32[R, 1]` VMEM block) and the item copies pages up to its rows' largest (a
     sixth scalar-prefetched table, `block_sizes.gather_bound_blocks`).
  6. An fp8 cache (`reference.Fp8KVCache`, `kv_cache_dtype="fp8"`): each page copy brings its
     float8_e4m3fn rows and, from the exponent array `i32[Hkv, P, 1, E]` (also in HBM), the
     page's exponent row into a second two-slot buffer on the same semaphore; K and V widen to
     q's dtype (exact) for the MXU, and their rows' power-of-two scales (exact) multiply the
     scores' columns (K) and the probabilities' columns (V).

NOTE: the last KV block may cover pages past the sequence's end: those are not copied, so their
buffer rows hold stale (or, in interpret mode, NaN) data; masked values are zeroed and masked
probabilities are exactly 0, so it never reaches the output.
NOTE: every configuration in tests/test_accel_kernels.py compiles for TPU v5e and v6e (Mosaic:
tile alignment and VMEM limits checked); none has run on a TPU yet.

Legend: R = query rows of a block, K = keys of a KV block (`pages_per_block * page_size`),
D = head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import paged_common as pc
from pallas_kernels.ragged_paged_attention import block_sizes as bs
from pallas_kernels.ragged_paged_attention import tpu_layout
from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache, check_inputs
from pallas_kernels.ragged_paged_attention.tpu_layout import (
    kv_cache_shape,
    new_kv_cache,
    update_kv_cache,
)

__all__ = ["kv_cache_shape", "new_kv_cache", "ragged_paged_attention", "update_kv_cache"]


def _key_scales(exps, half: int, page_size: int, block_k: int):
    """f32[1, K]: 2**exponent of each key of a KV block, from its pages' exponent rows.

    exps: i32[pages, E] (page j's K exponents in lanes [0, page_size), V's after them); half: 0
    for K, 1 for V. Key k's exponent sits in page k // page_size at lane half * page_size +
    k % page_size: a one-hot matmul moves the lanes to the keys, a masked sum over the pages picks
    each key's own page. Exact: one nonzero term per key, integers |e| <= 127 (exact in bf16).
    """
    pages, width = exps.shape
    lane = jax.lax.broadcasted_iota(jnp.int32, (width, block_k), 0)
    key = jax.lax.broadcasted_iota(jnp.int32, (width, block_k), 1)
    pick = (lane == half * page_size + jax.lax.rem(key, page_size)).astype(jnp.float32)
    per_page = jax.lax.dot_general(
        exps.astype(jnp.float32),
        pick,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    )  # [pages, K]: every page's exponent for each key's slot
    page = jax.lax.broadcasted_iota(jnp.int32, (pages, block_k), 0)
    key = jax.lax.broadcasted_iota(jnp.int32, (pages, block_k), 1)
    own = jnp.where(page == pc.trunc_div(key, page_size), per_page, 0.0)
    return pc.exp2_i8(own.sum(axis=0, keepdims=True).astype(jnp.int32))


def _kernel(
    work_seq_ref,  # SMEM i32[W]
    work_qblk_ref,  # SMEM i32[W]
    kv_lens_ref,  # SMEM i32[S]
    cu_q_lens_ref,  # SMEM i32[S+1]
    pages_ref,  # SMEM i32[S * pages_per_row] (page table flattened, padded by one KV block)
    *rest,  # (work key ends SMEM i32[W]?), q VMEM [R, D], (bounds VMEM i32[R, 1]?), (sinks VMEM
    # f32[R, 1]?), kv HBM [P, Hkv, page_size, W], (exponents HBM i32[Hkv, P, 1, E]?), o VMEM
    # [R, D], scratch
    block_q: int,
    group: int,
    page_size: int,
    pages_per_block: int,
    pages_per_row: int,
    num_pages: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    has_sinks: bool,
    fp8: bool,
    has_bound: bool,
):
    work_end_ref, q_ref, bound_ref = rest[:3] if has_bound else (None, rest[0], None)
    rest = rest[3:] if has_bound else rest[1:]
    sinks_ref = rest[0] if has_sinks else None
    rest = rest[1:] if has_sinks else rest
    if fp8:
        kv_hbm, exp_hbm, o_ref, kv_buf, exp_buf, sems = rest
    else:
        (kv_hbm, o_ref, kv_buf, sems), exp_hbm, exp_buf = rest, None, None
    # kv_buf: VMEM [2 slots, pages_per_block, page_size, W]; exp_buf (fp8): VMEM i32[2 slots,
    # pages_per_block, 1, E]; sems: DMA semaphores (2,)
    w, h = pl.program_id(0), pl.program_id(1)
    s = work_seq_ref[w]

    @pl.when(s >= 0)
    def _():
        rows, d = q_ref.shape
        dk = q_ref.dtype
        block_k = pages_per_block * page_size
        first_pos, key_end, page_lo = pc.query_block_keys(  # key_end is exclusive
            w,
            s,
            work_qblk_ref,
            kv_lens_ref,
            cu_q_lens_ref,
            block_q=block_q,
            page_size=page_size,
            sliding_window=sliding_window,
            div=pc.trunc_div,
        )
        if work_end_ref is not None:  # image rows see up to their image's end
            key_end = jnp.maximum(key_end, work_end_ref[w])
        page_end = pc.trunc_div(
            key_end + page_size - 1, page_size
        )  # pages [page_lo, page_end) needed
        num_blocks = pc.trunc_div(page_end - page_lo + pages_per_block - 1, pages_per_block)

        def page_copies(b, slot):
            """(needed?, descriptor) for each page of KV block b, landing in buffer `slot`."""
            copies = []
            for j in range(pages_per_block):
                col = page_lo + b * pages_per_block + j
                page = jnp.clip(pages_ref[s * pages_per_row + col], 0, num_pages - 1)
                src = kv_hbm.at[page, h]  # [page_size, W]
                copies.append(
                    (col < page_end, pltpu.make_async_copy(src, kv_buf.at[slot, j], sems.at[slot]))
                )
                if fp8:
                    src = exp_hbm.at[h, page]  # i32[1, E]
                    copies.append(
                        (
                            col < page_end,
                            pltpu.make_async_copy(src, exp_buf.at[slot, j], sems.at[slot]),
                        )
                    )
            return copies

        def start(b, slot):
            for needed, copy in page_copies(b, slot):
                pl.when(needed)(copy.start)

        def wait(b, slot):
            for needed, copy in page_copies(b, slot):
                pl.when(needed)(copy.wait)

        q = q_ref[...]
        bound = None if bound_ref is None else bound_ref[...]  # i32[R, 1]
        q_pos = first_pos + pc.trunc_div(
            jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 0), group
        )
        offs = jax.lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
        offs_col = jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
        if sinks_ref is None:
            m0 = jnp.full((rows, 1), pc.MASK_VALUE, jnp.float32)
            l0 = jnp.zeros((rows, 1), jnp.float32)
        else:
            m0 = sinks_ref[...].astype(jnp.float32)
            l0 = jnp.ones((rows, 1), jnp.float32)
        acc0 = jnp.zeros((rows, d), jnp.float32)

        start(0, 0)

        def body(b, carry):
            m, l, acc = carry
            slot = jax.lax.rem(b, 2)

            @pl.when(b + 1 < num_blocks)
            def _():
                start(b + 1, 1 - slot)

            wait(b, slot)
            k = kv_buf[slot, :, :, pl.ds(0, d)].reshape(block_k, d)  # [K, D]
            v = kv_buf[slot, :, :, pl.ds(d, d)].reshape(block_k, d)
            k_scale = v_scale = None
            if fp8:  # e4m3 values are exact in q's dtype; their rows' 2**exponent scale the
                # scores' columns (K) and the probabilities' columns (V), exactly
                k = k.astype(jnp.float32).astype(dk)
                v = v.astype(jnp.float32).astype(dk)
                exps = exp_buf[slot, :, 0, :]  # i32[pages, E]
                k_scale = _key_scales(exps, 0, page_size, block_k)  # f32[1, K]
                v_scale = _key_scales(exps, 1, page_size, block_k)
            key0 = (page_lo + b * pages_per_block) * page_size
            k_pos = key0 + offs  # i32[R, K]; every key the block's rows can see was copied
            v = jnp.where(key0 + offs_col < key_end, v, jnp.zeros_like(v))
            sc = (
                jax.lax.dot_general(
                    q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )
                * sm_scale
            )  # [R, K]
            if fp8:
                sc = sc * k_scale
            sc = pc.apply_soft_cap(sc, soft_cap)
            mask = pc.causal_mask(q_pos, k_pos, key_end, sliding_window, bound)

            def pv(p):  # [R, D]
                return jax.lax.dot_general(
                    (p if v_scale is None else p * v_scale).astype(v.dtype),
                    v,
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )

            return pc.online_softmax_step(m, l, acc, sc, mask, pv)

        _, l, acc = jax.lax.fori_loop(0, num_blocks, body, (m0, l0, acc0))
        o_ref[...] = pc.normalize(acc, l).astype(o_ref.dtype)


def _run_class(
    q,
    kv_cache,
    kv_lens,
    pages_flat,
    cu_q_lens,
    num_seqs,
    sinks_rows,
    causal_bound,
    cls,
    *,
    blocks,
    pages_per_row,
    sm_scale,
    sliding_window,
    soft_cap,
    interpret,
):
    """One pallas_call over one query class; returns (out [T, Hkv, G, D], bool[T] membership)."""
    t, hkv, g, d = q.shape
    num_pages, _, page_size, width = kv_cache.shape
    fp8 = isinstance(kv_cache, Fp8KVCache)
    rows = cls.block_q * g
    q_spec = pl.BlockSpec((None, None, rows, d), lambda w, h, *_: (w, h, 0, 0))
    with jax.named_scope("rpa_work_table"):
        seq, qblk = bs.work_table(cu_q_lens, num_seqs, cls)
        q_blocks = bs.gather_query_blocks(q, cu_q_lens, seq, qblk, cls.block_q)  # [W, Hkv, R, D]
        prefetch = [seq, qblk, kv_lens, cu_q_lens, pages_flat]
        in_specs, operands = [q_spec], [q_blocks]
        if causal_bound is not None:  # i32[W, R], i32[W]
            bound_rows, work_end = bs.gather_bound_blocks(
                causal_bound, kv_lens, cu_q_lens, seq, qblk, cls.block_q, g
            )
            prefetch.append(work_end)
            in_specs.append(pl.BlockSpec((None, rows, 1), lambda w, h, *_: (w, 0, 0)))
            operands.append(bound_rows[:, :, None])
    kernel = functools.partial(
        _kernel,
        block_q=cls.block_q,
        group=g,
        page_size=page_size,
        pages_per_block=blocks.pages_per_block,
        pages_per_row=pages_per_row,
        num_pages=num_pages,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        has_sinks=sinks_rows is not None,
        fp8=fp8,
        has_bound=causal_bound is not None,
    )
    if sinks_rows is not None:
        in_specs.append(pl.BlockSpec((None, rows, 1), lambda w, h, *_: (h, 0, 0)))
        operands.append(sinks_rows)
    in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
    # NOTE: pinned to HBM (the operand's memory space, not the BlockSpec's, is what XLA sees): a
    # cache small enough for VMEM was otherwise moved there whole before the call
    hbm = functools.partial(pltpu.with_memory_space_constraint, memory_space=pltpu.HBM)
    operands.append(hbm(kv_cache.data if fp8 else kv_cache))
    scratch = [pltpu.VMEM((2, blocks.pages_per_block, page_size, width), kv_cache.dtype)]
    if fp8:
        in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
        operands.append(hbm(kv_cache.exponent))
        exp_width = kv_cache.exponent.shape[-1]
        scratch.append(pltpu.VMEM((2, blocks.pages_per_block, 1, exp_width), jnp.int32))
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    # NOTE: a work item reads at most its sequence's pages; together at most every page once per
    # query block of a sequence, and never more than the whole cache per KV head.
    reach = min(cls.num_work * (pages_per_row - blocks.pages_per_block), num_pages)
    cost = pc.attention_cost(
        programs=cls.num_work * hkv,
        rows=rows,
        keys=(pages_per_row - blocks.pages_per_block) * page_size,
        score_width=d,
        value_width=d,
        cache_bytes=pc.nbytes(kv_cache) * reach // num_pages,
        io_bytes=2 * pc.nbytes(q_blocks) + pc.nbytes(seq, qblk, kv_lens, cu_q_lens, pages_flat),
    )
    out_blocks = pl.pallas_call(
        kernel,
        cost_estimate=cost,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(cls.num_work, hkv),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct((cls.num_work, hkv, rows, d), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name=f"ragged_paged_attention_bq{cls.block_q}",
    )(*prefetch, *operands)
    with jax.named_scope("rpa_unblock"):
        return bs.scatter_query_blocks(out_blocks, cu_q_lens, num_seqs, cls, t)


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret", "blocks")
)
def ragged_paged_attention(
    q: jax.Array,  # [T, Hq, D]
    kv_cache: jax.Array | Fp8KVCache,  # [P, Hkv, page_size, W] (`tpu_layout`)
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
    causal_bound: jax.Array | None = None,  # i32[T] (the reference's)
) -> jax.Array:  # [T, Hq, D]
    """Ragged paged attention on TPU; the same contract as `reference.ragged_paged_attention`.

    Args:
      interpret: False on TPU; `pltpu.InterpretParams(...)` (or True) to interpret on CPU.
      blocks: block sizes overriding the `block_sizes` table (tests, tuning).
      causal_bound: the largest key position each token may see (`reference`'s).
    Returns:
      [T, Hq, D] in q's dtype; zeros for padding tokens.
    """
    t, hq, d = q.shape
    if kv_cache.ndim != 4:
        raise ValueError(f"kv_cache must be [P, Hkv, page_size, W], got {kv_cache.shape}")
    num_pages, hkv, page_size, _ = kv_cache.shape
    tpu_layout.head_dim_of(kv_cache, d)
    as_reference = jax.ShapeDtypeStruct((num_pages, page_size, 2 * hkv, d), kv_cache.dtype)
    check_inputs(q, as_reference, kv_lens, page_indices, cu_q_lens, num_seqs)
    g = hq // hkv
    if sinks is not None and sinks.shape != (hq,):
        raise ValueError(f"sinks must be f32[{hq}], got {sinks.shape}")
    if blocks is None:  # an fp8 cache computes in q's dtype: its tiles are q's
        blocks = bs.get_block_sizes(
            "tpu",
            head_dim=d,
            page_size=page_size,
            dtype=q.dtype if isinstance(kv_cache, Fp8KVCache) else kv_cache.dtype,
            group=g,
            pages_per_seq=page_indices.shape[1],
            pow2=False,
        )
    s_max = page_indices.shape[0]
    with jax.named_scope("rpa_layout"):
        qg = q.reshape(t, hkv, g, d)
        pages_per_row, pages_flat = pc.flat_page_table(page_indices, blocks.pages_per_block)
    out = jnp.zeros((t, hkv, g, d), q.dtype)
    for cls in bs.query_classes(t, s_max, blocks):
        sinks_rows = None
        if sinks is not None:
            sinks_rows = jnp.tile(sinks.astype(jnp.float32).reshape(hkv, g), (1, cls.block_q))
            sinks_rows = sinks_rows[:, :, None]  # f32[Hkv, R, 1]
        out_c, mine = _run_class(
            qg,
            kv_cache,
            kv_lens,
            pages_flat,
            cu_q_lens,
            num_seqs,
            sinks_rows,
            causal_bound,
            cls,
            blocks=blocks,
            pages_per_row=pages_per_row,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            interpret=interpret,
        )
        out = jnp.where(mine[:, None, None, None], out_c, out)
    return out.reshape(t, hq, d)
