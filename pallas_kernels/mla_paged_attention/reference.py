"""Pure-JAX ragged paged multi-head latent attention (MLA): the oracle of the MLA kernels.

DeepSeek-V2/V3 attention with `W_uk` applied to the query and `W_uv` to the output (the model does
both), so attention runs in the latent space: every query head attends to ONE shared key per
token, the cached row `c = [latent (kv_lora_rank) | rope key (qk_rope_head_dim)]`, and the value is
that row's latent part. It is multi-query attention with key width L + R and value width L.

Ragged batch vocabulary as in `ragged_paged_attention.reference`: one token axis `T` holds every
sequence's new query tokens; sequence `s` owns `cu_q_lens[s] : cu_q_lens[s+1]` and has `kv_lens[s]`
tokens in the cache after this step's write.

KV cache layout (per layer): `[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`, one row per
token shared by all heads: (L + R) x dtype bytes per token and layer, nothing per head.

Flow of `mla_ragged_paged_attention`:
  1. Map each query token to its sequence and absolute position (padding tokens produce zeros).
  2. Walk the real tokens in blocks of `paged_common.QUERY_BLOCK` (`walk_query_blocks`, as the
     ragged reference): a block of one sequence gathers its pages once per KV block, a block
     spanning sequences (decodes) gathers per token.
  3. Scores `q . c` over the full row (latent and rope parts at once), optional soft-cap, causal +
     length + sliding-window mask, online softmax; values are the rows' first L columns. Masked
     rows are zeroed before use, so NaN-filled unused pages cannot leak.

Einsum legend: q = query token of the block, h = query head, c = cached row width (L + R),
l = latent width (L), b = key position within the KV block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import paged_common as pc


def kv_cache_shape(
    num_pages: int, page_size: int, kv_lora_rank: int, qk_rope_head_dim: int
) -> tuple[int, ...]:
    """One row of latent + rope key per token slot, shared by every head."""
    return (num_pages, page_size, kv_lora_rank + qk_rope_head_dim)


def update_kv_cache(
    kv_cache: jax.Array,  # [P, page_size, L + R]
    latent: jax.Array,  # [T, L + R] normed latent, then the roped key
    slot_mapping: jax.Array,  # i32[T] flat slot page*page_size + offset; < 0 for padding tokens
) -> jax.Array:
    """Writes the step's rows into their slots (padding tokens are dropped).

    NOTE: the same (page, offset) scatter and barrier as the ragged kernels' write, for the same
    reason: a flattened view or a fused update made XLA:CPU copy the whole cache every step.
    """
    num_pages, page_size, _ = kv_cache.shape
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # padding -> dropped
    new_cache = kv_cache.at[page, slot_mapping % page_size].set(
        latent.astype(kv_cache.dtype), mode="drop"
    )
    return jax.lax.optimization_barrier(new_cache)


def check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_lora_rank) -> None:
    """Trace-time shape and dtype checks shared by every MLA backend."""
    if q.ndim != 3 or kv_cache.ndim != 3:
        raise ValueError(
            f"q must be [T, H, L+R] and kv_cache [P, page, L+R]; got {q.shape}, {kv_cache.shape}"
        )
    if q.shape[2] != kv_cache.shape[2]:
        raise ValueError(f"row width differs: q has {q.shape[2]}, kv_cache has {kv_cache.shape[2]}")
    if not 0 < kv_lora_rank < q.shape[2]:
        raise ValueError(f"kv_lora_rank={kv_lora_rank} must be in (0, {q.shape[2]})")
    if page_indices.ndim != 2:
        raise ValueError(
            f"page_indices must be [num_seqs, pages_per_seq], got {page_indices.shape}"
        )
    s = page_indices.shape[0]
    if kv_lens.shape != (s,) or cu_q_lens.shape != (s + 1,) or num_seqs.shape != (1,):
        raise ValueError(
            f"kv_lens {kv_lens.shape}, cu_q_lens {cu_q_lens.shape}, num_seqs {num_seqs.shape} do not "
            f"match {s} sequences (want ({s},), ({s + 1},), (1,))"
        )
    for name, x in (
        ("kv_lens", kv_lens),
        ("page_indices", page_indices),
        ("cu_q_lens", cu_q_lens),
        ("num_seqs", num_seqs),
    ):
        if x.dtype != jnp.int32:
            raise ValueError(f"{name} must be int32, got {x.dtype}")


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "kv_lora_rank", "sliding_window", "soft_cap", "interpret")
)
def mla_ragged_paged_attention(
    q: jax.Array,  # [T, H, L + R]  absorbed query: [q_nope @ W_uk | roped q_rope]
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
    interpret: pc.Interpret = False,  # accepted for signature parity with the kernels
) -> jax.Array:  # [T, H, L] attention output in the latent space (W_uv not applied)
    del interpret
    check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs, kv_lora_rank)
    t_len, h, c = q.shape
    lat = kv_lora_rank
    _, page_size, _ = kv_cache.shape
    pages_per_seq = page_indices.shape[1]
    bq = min(pc.QUERY_BLOCK, t_len)
    t_pad = -(-t_len // bq) * bq

    with jax.named_scope("mla_positions"):
        seq, valid, kv_len, q_pos, n_real = pc.token_positions(cu_q_lens, kv_lens, num_seqs, t_pad)

    qs = jnp.pad(q.astype(jnp.float32) * sm_scale, ((0, t_pad - t_len), (0, 0), (0, 0)))
    m0 = jnp.full((bq, h), -jnp.inf, jnp.float32)
    l0 = jnp.zeros((bq, h), jnp.float32)
    acc0 = jnp.zeros((bq, h, lat), jnp.float32)

    def gather(ids, keys):  # ids i32[..., pages] -> rows f32[..., keys, L + R]
        # NOTE: mode="fill", as in the ragged reference (a clip-mode gather copied the cache).
        rows = jnp.take(kv_cache, ids, axis=0, mode="fill", fill_value=0)
        return rows.reshape(*ids.shape[:-1], keys, c).astype(jnp.float32)

    def dense_block(qb, sb, vb, pb, lb):
        """All valid tokens of the block belong to sequence sb[0]: gather its pages once."""
        bp = pc.dense_pages_per_block(bq, page_size, pages_per_seq)
        keys = bp * page_size
        pages = jnp.pad(page_indices[sb[0]], (0, -pages_per_seq % bp))

        def body(b, carry):
            with jax.named_scope("mla_dense_block"):
                rows = gather(jax.lax.dynamic_slice_in_dim(pages, b * bp, bp), keys)  # [B, C]
                k_pos = b * keys + jnp.arange(keys, dtype=jnp.int32)
                rows = jnp.where((k_pos < lb.max())[:, None], rows, 0.0)  # unused slots may be NaN
                s = pc.apply_soft_cap(jnp.einsum("qhc,bc->qhb", qb, rows), soft_cap)
                return pc.reference_softmax_step(
                    *carry,
                    s,
                    pc.reference_key_mask(k_pos, vb, lb, pb, sliding_window),
                    lambda p: jnp.einsum("qhb,bl->qhl", p, rows[:, :lat]),
                )

        return jax.lax.fori_loop(0, -(-lb.max() // keys), body, (m0, l0, acc0))

    def token_block(qb, sb, vb, pb, lb):
        """Tokens of several sequences (e.g. a run of decodes): each gathers its own pages."""
        bp = pc.token_pages_per_block(page_size, pages_per_seq)
        keys = bp * page_size
        pages = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % bp)))[sb]  # i32[Q, cols]

        def body(b, carry):
            with jax.named_scope("mla_token_block"):
                rows = gather(jax.lax.dynamic_slice_in_dim(pages, b * bp, bp, axis=1), keys)
                k_pos = b * keys + jnp.arange(keys, dtype=jnp.int32)
                mask = pc.reference_key_mask(k_pos, vb, lb, pb, sliding_window)
                rows = jnp.where(mask[:, :, None], rows, 0.0)  # [Q, B, C]
                s = pc.apply_soft_cap(jnp.einsum("qhc,qbc->qhb", qb, rows), soft_cap)
                return pc.reference_softmax_step(
                    *carry, s, mask, lambda p: jnp.einsum("qhb,qbl->qhl", p, rows[..., :lat])
                )

        return jax.lax.fori_loop(0, -(-lb.max() // keys), body, (m0, l0, acc0))

    out = pc.walk_query_blocks(
        (qs, seq, valid, q_pos, kv_len),
        dense_block,
        token_block,
        jnp.zeros((t_pad, h, lat), jnp.float32),
        n_real,
        bq,
    )
    return out[:t_len].astype(q.dtype)
