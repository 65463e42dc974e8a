"""Pure-JAX ragged paged attention: the oracle every kernel backend is tested against.

Inputs follow the vLLM / Pallas vocabulary. One token axis `T` holds the ragged concatenation of
every sequence's new query tokens (decodes first, then prefill chunks); sequence `s` owns tokens
`cu_q_lens[s] : cu_q_lens[s+1]` and has `kv_lens[s]` tokens in the cache *after* this step's write,
so its query tokens sit at positions `kv_lens[s] - q_len_s ... kv_lens[s] - 1`.

KV cache layout: `[num_pages, page_size, 2 * num_kv_heads, head_dim]`, K of head h at index 2h and
V at 2h + 1 (interleaved on the heads axis). With `kv_cache_dtype="fp8"` the cache is an
`Fp8KVCache`: that layout in float8_e4m3fn plus an int8 exponent per (slot, K-or-V head) row
(`new_kv_cache`, written by `update_kv_cache`, read back by the gather in step 2).

Flow of `ragged_paged_attention`:
  1. Map each query token to its sequence and absolute position (tokens past the last sequence are
     padding and produce zeros).
  2. Walk the real tokens in blocks of `paged_common.QUERY_BLOCK`. A block whose tokens all belong to one
     sequence (the body of a prefill chunk) gathers that sequence's pages once per KV block; a
     block spanning several sequences (a run of decodes) gathers, per token, its own pages.
     Either way the KV loop runs only as many blocks as the block's longest sequence needs
     (`paged_common.walk_query_blocks`, the loop both references share).
  3. Scores by einsum with query heads grouped under their KV head (GQA by broadcasting), optional
     logit soft-cap, causal + length + sliding-window mask (causal up to `causal_bound` where
     given: an image token sees its whole image), then an online-softmax update. Masked
     values are replaced before use, so NaN-filled unused pages cannot leak.
  4. Attention sinks, when given, start the running max/denominator as one extra virtual key.

Einsum legend: q = query token of the block, k = KV head, g = query head within its KV group,
d = head_dim, b = key position within the current KV block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_common as pc


def kv_cache_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_pages, page_size, 2 * num_kv_heads, head_dim)


FP8_MAX = 448.0  # largest finite float8_e4m3fn


@functools.partial(
    jax.tree_util.register_dataclass, data_fields=["data", "exponent"], meta_fields=[]
)
@dataclasses.dataclass(frozen=True)
class Fp8KVCache:
    """A paged KV cache stored as float8_e4m3fn (`kv_cache_dtype="fp8"`), same layout as a float
    cache plus one power-of-two scale per (slot, K-or-V head) row: row value = data * 2**exponent.

    Writing a row picks the smallest exponent that brings its absolute max under `FP8_MAX`, so the
    row uses e4m3's whole range (a power of two rescales exactly: only the rounding to e4m3's 3
    mantissa bits is lost), and one scale byte per row of head_dim bytes keeps the cache at
    (D + 1) / (2 * D) of bf16's bytes.
    """

    data: jax.Array  # f8e4m3fn[P, page_size, 2*Hkv, D]
    exponent: jax.Array  # i8[P, page_size, 2*Hkv]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> jnp.dtype:
        return self.data.dtype


def new_kv_cache(
    shape: tuple[int, ...], dtype, kv_cache_dtype: str = "auto"
) -> jax.Array | Fp8KVCache:
    """An empty cache of `shape` ([P, page_size, 2*Hkv, D]): zeros of `dtype`, or for "fp8" an
    `Fp8KVCache` of zeros."""
    if kv_cache_dtype == "fp8":
        return Fp8KVCache(jnp.zeros(shape, jnp.float8_e4m3fn), jnp.zeros(shape[:3], jnp.int8))
    if kv_cache_dtype != "auto":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported; choose 'auto' or 'fp8'"
        )
    return jnp.zeros(shape, dtype)


def quantize_kv_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (f8e4m3fn [..., D], i8 [...]): each row's power-of-two scale and values."""
    xf = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(xf), axis=-1)
    # absmax / FP8_MAX = m * 2**e with m in [0.5, 1): |x| / 2**e <= m * FP8_MAX < FP8_MAX.
    _, e = jnp.frexp(absmax / FP8_MAX)
    e = jnp.where(absmax > 0, jnp.clip(e, -126, 127), 0)
    data = jnp.ldexp(xf, -e[..., None]).astype(jnp.float8_e4m3fn)
    return data, e.astype(jnp.int8)


def dequantize_kv_rows(data: jax.Array, exponent: jax.Array) -> jax.Array:
    """f32 values of fp8 rows `data` [..., D] with their exponents [...]."""
    return jnp.ldexp(data.astype(jnp.float32), exponent.astype(jnp.int32)[..., None])


def update_kv_cache(
    kv_cache: jax.Array | Fp8KVCache,  # [P, page_size, 2*Hkv, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T] flat slot page*page_size + offset; < 0 for padding tokens
) -> jax.Array | Fp8KVCache:
    """Writes the step's new K/V into their slots (padding tokens are dropped); an fp8 cache gets
    each new (token, head) row quantized with its own power-of-two scale.

    NOTE: scatter on the 4-D cache with (page, offset) indices. Scattering into a flattened
    [slots, ...] view made XLA:CPU duplicate the update and copy the whole cache every step.
    """
    num_pages, page_size, h2, d = kv_cache.shape
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], h2, d)
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # padding -> dropped
    offset = slot_mapping % page_size
    if isinstance(kv_cache, Fp8KVCache):
        data, exponent = quantize_kv_rows(kv)
        new_cache = Fp8KVCache(
            kv_cache.data.at[page, offset].set(data, mode="drop"),
            kv_cache.exponent.at[page, offset].set(exponent, mode="drop"),
        )
    else:
        new_cache = kv_cache.at[page, offset].set(kv.astype(kv_cache.dtype), mode="drop")
    # NOTE: the barrier keeps XLA from fusing (duplicating) this update into the attention's page
    # gather, which forced a copy of the whole cache every step.
    return jax.lax.optimization_barrier(new_cache)


def check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    """Trace-time shape and dtype checks shared by every backend."""
    if q.ndim != 3 or kv_cache.ndim != 4:
        raise ValueError(
            f"q must be [T, Hq, D] and kv_cache [P, page, 2*Hkv, D]; got {q.shape}, {kv_cache.shape}"
        )
    t, hq, d = q.shape
    _, _, h2, dk = kv_cache.shape
    if dk != d:
        raise ValueError(f"head_dim differs: q has {d}, kv_cache has {dk}")
    if h2 % 2 or hq % (h2 // 2):
        raise ValueError(f"{hq} query heads are not a multiple of {h2 // 2} KV heads")
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


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap", "interpret"))
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
    interpret: pc.Interpret = False,  # accepted for signature parity with the kernels
    causal_bound: jax.Array | None = None,  # i32[T]
) -> jax.Array:  # [T, Hq, D]
    """`causal_bound`: the largest key position each query token may see (default: its own
    position; an image token of a bidirectional-image model: its image's last position, which
    this step must write); the sliding window still counts back from the token's own position."""
    del interpret
    check_inputs(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs)
    t_len, hq, d = q.shape
    _, page_size, h2, _ = kv_cache.shape
    hkv = h2 // 2
    g = hq // hkv
    pages_per_seq = page_indices.shape[1]
    bq = min(pc.QUERY_BLOCK, t_len)
    t_pad = -(-t_len // bq) * bq

    with jax.named_scope("rpa_positions"):
        seq, valid, kv_len, q_pos, n_real = pc.token_positions(cu_q_lens, kv_lens, num_seqs, t_pad)
        bound = q_pos if causal_bound is None else jnp.pad(causal_bound, (0, t_pad - t_len))

    qg = q.astype(jnp.float32).reshape(t_len, hkv, g, d) * sm_scale
    qg = jnp.pad(qg, ((0, t_pad - t_len), (0, 0), (0, 0), (0, 0)))
    if sinks is None:
        m0 = jnp.full((bq, hkv, g), -jnp.inf, jnp.float32)
        l0 = jnp.zeros((bq, hkv, g), jnp.float32)
    else:
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, g), (bq, hkv, g))
        l0 = jnp.ones((bq, hkv, g), jnp.float32)
    acc0 = jnp.zeros((bq, hkv, g, d), jnp.float32)

    def gather(ids, keys):  # ids i32[..., pages] -> K, V f32[..., keys, Hkv, D]
        # NOTE: mode="fill" (out-of-range page ids read zeros, masked anyway); with "clip" XLA:CPU
        # copied the whole cache before the in-place write (tests/test_compiled_step.py).
        if isinstance(kv_cache, Fp8KVCache):
            kv = dequantize_kv_rows(
                jnp.take(kv_cache.data, ids, axis=0, mode="fill", fill_value=0),
                jnp.take(kv_cache.exponent, ids, axis=0, mode="fill", fill_value=0),
            )
        else:
            kv = jnp.take(kv_cache, ids, axis=0, mode="fill", fill_value=0)
        kv = kv.reshape(*ids.shape[:-1], keys, hkv, 2, d).astype(jnp.float32)
        return kv[..., 0, :], kv[..., 1, :]

    def dense_block(qb, sb, vb, pb, lb, cb):
        """All valid tokens of the block belong to sequence sb[0]: gather its pages once."""
        # Also for a lone decode token: 4x fewer loop trips than TOKEN_KV_BLOCK saved ~2.5 ms of a
        # ~43 ms single-stream SmolLM2 decode step on XLA:CPU (30 layers, ~200-token context).
        bp = pc.dense_pages_per_block(bq, page_size, pages_per_seq)
        keys = bp * page_size
        pages = jnp.pad(page_indices[sb[0]], (0, -pages_per_seq % bp))

        def body(b, carry):
            with jax.named_scope("rpa_dense_block"):
                k, v = gather(jax.lax.dynamic_slice_in_dim(pages, b * bp, bp), keys)  # [B, Hkv, D]
                k_pos = b * keys + jnp.arange(keys, dtype=jnp.int32)
                v = jnp.where((k_pos < lb.max())[:, None, None], v, 0.0)  # unused slots may be NaN
                s = pc.apply_soft_cap(jnp.einsum("qkgd,bkd->qkgb", qb, k), soft_cap)
                return pc.reference_softmax_step(
                    *carry,
                    s,
                    pc.reference_key_mask(k_pos, vb, lb, pb, sliding_window, cb),
                    lambda p: jnp.einsum("qkgb,bkd->qkgd", p, v),
                )

        return jax.lax.fori_loop(0, -(-lb.max() // keys), body, (m0, l0, acc0))

    def token_block(qb, sb, vb, pb, lb, cb):
        """Tokens of several sequences (e.g. a run of decodes): each gathers its own pages."""
        bp = pc.token_pages_per_block(page_size, pages_per_seq)
        keys = bp * page_size
        pages = jnp.pad(page_indices, ((0, 0), (0, -pages_per_seq % bp)))[sb]  # i32[Q, cols]

        def body(b, carry):
            with jax.named_scope("rpa_token_block"):
                ids = jax.lax.dynamic_slice_in_dim(pages, b * bp, bp, axis=1)
                k, v = gather(ids, keys)  # [Q, B, Hkv, D]
                k_pos = b * keys + jnp.arange(keys, dtype=jnp.int32)
                mask = pc.reference_key_mask(k_pos, vb, lb, pb, sliding_window, cb)
                v = jnp.where(mask[:, :, None, None], v, 0.0)
                s = pc.apply_soft_cap(jnp.einsum("qkgd,qbkd->qkgb", qb, k), soft_cap)
                return pc.reference_softmax_step(
                    *carry, s, mask, lambda p: jnp.einsum("qkgb,qbkd->qkgd", p, v)
                )

        return jax.lax.fori_loop(0, -(-lb.max() // keys), body, (m0, l0, acc0))

    out = pc.walk_query_blocks(
        (qg, seq, valid, q_pos, kv_len, bound),
        dense_block,
        token_block,
        jnp.zeros((t_pad, hkv, g, d), jnp.float32),
        n_real,
        bq,
    )
    return out[:t_len].reshape(t_len, hq, d).astype(q.dtype)


def check_values(q, kv_cache, kv_lens, page_indices, cu_q_lens, num_seqs) -> None:
    """Host-side value checks of one step's attention metadata (numpy; raises ValueError).

    `q` and `kv_cache` are only read for their shapes (arrays or `jax.ShapeDtypeStruct`s). Checks:
    0 <= num_seqs <= S; cu_q_lens starts at 0, never decreases and ends within the T query tokens;
    every live sequence has q_len <= kv_len <= pages_per_seq * page_size; and the page ids of the
    pages a live sequence uses are in [0, num_pages). Padded page-table entries are not checked.
    """
    t = q.shape[0]
    num_pages, page_size = kv_cache.shape[:2]
    kv_lens, page_indices = np.asarray(kv_lens), np.asarray(page_indices)
    cu, n = np.asarray(cu_q_lens), int(np.asarray(num_seqs)[0])
    s_max, pages_per_seq = page_indices.shape
    if not 0 <= n <= s_max:
        raise ValueError(f"num_seqs={n} is outside [0, {s_max}]")
    if cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] > t:
        raise ValueError(f"cu_q_lens must start at 0, never decrease and end <= {t}: {cu.tolist()}")
    q_lens = np.diff(cu)[:n]
    for s in range(n):
        if not q_lens[s] <= kv_lens[s] <= pages_per_seq * page_size:
            raise ValueError(
                f"sequence {s}: need q_len ({q_lens[s]}) <= kv_len ({kv_lens[s]}) <= "
                f"pages_per_seq * page_size ({pages_per_seq * page_size})"
            )
        num_used = -(-int(kv_lens[s]) // page_size)
        used = page_indices[s, :num_used]
        if np.any((used < 0) | (used >= num_pages)):
            raise ValueError(f"sequence {s}: page ids {used.tolist()} not all in [0, {num_pages})")
