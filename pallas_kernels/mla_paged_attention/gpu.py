"""Ragged paged MLA as a Pallas GPU kernel (Triton lowering); the reference's signature.

Flow of `mla_ragged_paged_attention`:
  1. Trace-time checks (`reference.check_inputs`, plus Triton's: power-of-two latent width L,
     rope width R and page_size). Block sizes come from the ragged kernels' table
     (`ragged_paged_attention.block_sizes`, keyed by the row width L + R, with G = H query heads
     sharing the one latent "KV head").
  2. q splits into its latent part `[T, 1, H_pad, L]` and rope part `[T, 1, H_pad, R]` (heads
     padded to a power of two with zero heads); sequences split into a decode and a prefill class
     and each class's work table gathers q into `[W, 1, rows, L|R]` blocks (rows = block_q x H_pad:
     every head of a token reads the same cached rows, so one program serves all of them).
  3. One `pallas_call` per class, grid `(W,)`. A program walks its sequence's key range (causal end,
     sliding-window start rounded down to a page) in blocks of `pages_per_block` pages: page ids from
     scalar loads of the page table, then two row gathers of the cache, `kv[slot, :L]` (latent, also
     the value) and `kv[slot, L:]` (rope key). Scores are `q_lat . c_lat + q_rope . k_rope` (two
     dots, f32 accumulate), soft-cap, causal / length / window mask, online softmax, `p @ c_lat`.
  4. Output blocks `[W, 1, rows, L]` are gathered back to token order; padding tokens get zeros.

NOTE: masked values are zeroed and masked probabilities are exactly 0, so NaN-filled unused pages
never reach the output; page ids are clamped into range before they address memory.

Legend: rows = query rows of a block (token-major, then head), K = keys of a KV block, L = latent
width (kv_lora_rank), R = rope key width (qk_rope_head_dim).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import paged_common as pc
from pallas_kernels.mla_paged_attention.reference import (
    check_inputs,
    kv_cache_shape,
    update_kv_cache,
)
from pallas_kernels.ragged_paged_attention import block_sizes as bs

__all__ = ["kv_cache_shape", "mla_ragged_paged_attention", "update_kv_cache"]


def _kernel(
    work_seq_ref,  # i32[W]
    work_qblk_ref,  # i32[W]
    kv_lens_ref,  # i32[S]
    cu_q_lens_ref,  # i32[S+1]
    pages_ref,  # i32[S * pages_per_row]
    q_lat_ref,  # [rows, L]
    q_rope_ref,  # [rows, R]
    kv_ref,  # [P * page_size, L + R] the cache, one row per slot
    o_ref,  # [rows, L]
    *,
    block_q: int,
    group: int,
    lat: int,
    rope: int,
    page_size: int,
    pages_per_block: int,
    pages_per_row: int,
    num_pages: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    w = pl.program_id(0)
    s = work_seq_ref[w]

    @pl.when(s >= 0)
    def _():
        rows = q_lat_ref.shape[0]
        block_k = pages_per_block * page_size
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
        num_blocks = pc.num_kv_blocks(key_end, page_lo, page_size=page_size, block_k=block_k)

        q_pos = first_pos + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) // group  # i32[rows]
        q_lat, q_rope = q_lat_ref[...], q_rope_ref[...]
        m0 = jnp.full((rows,), pc.MASK_VALUE, jnp.float32)
        l0 = jnp.zeros((rows,), jnp.float32)
        acc0 = jnp.zeros((rows, lat), jnp.float32)
        offs = jax.lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # i32[K]
        dims = (((1,), (1,)), ((), ()))

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
            c_lat = kv_ref[slot, pl.ds(0, lat)]  # [K, L]
            k_rope = kv_ref[slot, pl.ds(lat, rope)]  # [K, R]
            c_lat = jnp.where((k_pos < key_end)[:, None], c_lat, jnp.zeros_like(c_lat))
            k_rope = jnp.where((k_pos < key_end)[:, None], k_rope, jnp.zeros_like(k_rope))
            sc = jax.lax.dot_general(
                q_lat, c_lat, dims, preferred_element_type=jnp.float32
            ) + jax.lax.dot_general(q_rope, k_rope, dims, preferred_element_type=jnp.float32)
            sc = pc.apply_soft_cap(sc * sm_scale, soft_cap)  # [rows, K]
            mask = pc.causal_mask(q_pos, k_pos, key_end, sliding_window)

            def pv(p):  # [rows, L]
                return jax.lax.dot_general(
                    p.astype(c_lat.dtype),
                    c_lat,
                    (((1,), (0,)), ((), ())),
                    preferred_element_type=jnp.float32,
                )

            return pc.online_softmax_step(*carry, sc, mask, pv)

        _, l, acc = jax.lax.fori_loop(0, num_blocks, body, (m0, l0, acc0))
        o_ref[...] = pc.normalize(acc, l).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "kv_lora_rank",
        "sliding_window",
        "soft_cap",
        "interpret",
        "blocks",
    ),
)
def mla_ragged_paged_attention(
    q: jax.Array,  # [T, H, L + R]
    kv_cache: jax.Array,  # [P, page_size, L + R]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[1]
    *,
    sm_scale: float,
    kv_lora_rank: int,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    interpret: pc.Interpret = False,
    blocks: bs.KernelBlocks | None = None,
) -> jax.Array:  # [T, H, L]
    """Ragged paged MLA on GPU; the same contract as `reference.mla_ragged_paged_attention`.

    Args:
      interpret: run the kernel in Pallas interpret mode (CPU).
      blocks: block sizes overriding the table (tests, tuning).
    Returns:
      [T, H, L] in q's dtype (latent space; the caller applies W_uv); zeros for padding tokens.
    """
    check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_lora_rank)
    t, h, c = q.shape
    lat, rope = kv_lora_rank, c - kv_lora_rank
    num_pages, page_size, _ = kv_cache.shape
    for name, n in (("kv_lora_rank", lat), ("qk_rope_head_dim", rope), ("page_size", page_size)):
        if n & (n - 1):
            raise ValueError(f"the GPU MLA kernel needs a power-of-two {name}, got {n}")
    if blocks is None:
        blocks = bs.get_block_sizes(
            "gpu",
            head_dim=c,
            page_size=page_size,
            dtype=kv_cache.dtype,
            group=h,
            pages_per_seq=page_indices.shape[1],
            pow2=True,
        )
    gp = bs.next_pow2(h)
    s_max = page_indices.shape[0]

    with jax.named_scope("mla_layout"):
        qg = pc.pad_heads(q.reshape(t, 1, h, c), gp)
        kv_rows = kv_cache.reshape(num_pages * page_size, c)  # free: one row per slot
        pages_per_row, pages_flat = pc.flat_page_table(page_indices, blocks.pages_per_block)
    out = jnp.zeros((t, 1, gp, lat), q.dtype)
    for cls in bs.query_classes(t, s_max, blocks):
        rows = cls.block_q * gp
        with jax.named_scope("mla_work_table"):
            seq, qblk = bs.work_table(cu_q_lens, num_seqs, cls)
            q_blocks = bs.gather_query_blocks(qg, cu_q_lens, seq, qblk, cls.block_q)
        kernel = functools.partial(
            _kernel,
            block_q=cls.block_q,
            group=gp,
            lat=lat,
            rope=rope,
            page_size=page_size,
            pages_per_block=blocks.pages_per_block,
            pages_per_row=pages_per_row,
            num_pages=num_pages,
            sm_scale=sm_scale,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
        )
        whole = pl.BlockSpec()
        reach = min(cls.num_work * page_indices.shape[1], num_pages)
        cost = pc.attention_cost(
            programs=cls.num_work,
            rows=rows,
            keys=page_indices.shape[1] * page_size,
            score_width=c,
            value_width=lat,
            cache_bytes=pc.nbytes(kv_cache) * reach // num_pages,
            io_bytes=pc.nbytes(q_blocks) * (2 * lat + rope) // c + pc.nbytes(pages_flat),
        )
        out_blocks = pl.pallas_call(
            kernel,
            cost_estimate=cost,
            grid=(cls.num_work,),
            in_specs=[
                whole,
                whole,
                whole,
                whole,
                whole,
                pl.BlockSpec((None, None, rows, lat), lambda w: (w, 0, 0, 0)),
                pl.BlockSpec((None, None, rows, rope), lambda w: (w, 0, 0, 0)),
                whole,
            ],
            out_specs=pl.BlockSpec((None, None, rows, lat), lambda w: (w, 0, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((cls.num_work, 1, rows, lat), q.dtype),
            compiler_params=plgpu.CompilerParams(
                num_warps=blocks.num_warps, num_stages=blocks.num_stages
            ),
            interpret=interpret,
            name=f"mla_ragged_paged_attention_bq{cls.block_q}",
        )(
            seq,
            qblk,
            kv_lens,
            cu_q_lens,
            pages_flat,
            q_blocks[..., :lat],
            q_blocks[..., lat:],
            kv_rows,
        )
        with jax.named_scope("mla_unblock"):
            out_c, mine = bs.scatter_query_blocks(out_blocks, cu_q_lens, num_seqs, cls, t)
        out = jnp.where(mine[:, None, None, None], out_c, out)
    return out[:, 0, :h]
