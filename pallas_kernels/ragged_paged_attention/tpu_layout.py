"""The TPU kernel's KV cache layout: one that XLA's default TPU layout keeps row-major.

XLA picks a TPU array's physical layout to avoid tile padding: an array whose minor dimension is
not a multiple of 128 lanes gets its largest axis moved minor-most. The reference layout
`[P, page_size, 2*Hkv, D]` with D = 64 (SmolLM2: `bf16[P,16,6,64]`) is stored page-minor, so
every Mosaic call (which needs row-major) copied the whole cache first. This layout is row-major
under XLA's own choice for every head_dim and KV-head count, so the kernel reads it in place:

1. Values: `[P, Hkv, page_size, W]`, W = 2*D rounded up to 128 lanes: the row of (page, head,
   slot) is K (lanes [0, D)), V (lanes [D, 2D)), zero padding. A program DMAs one
   `[page_size, W]` block per page (its KV head is a leading, untiled index: always aligned).
2. An fp8 cache (`Fp8KVCache`) keeps its values in that layout as float8_e4m3fn and its row
   exponents as `i32[P, Hkv, 1, E]`, E = 2*page_size rounded up to 128: K's exponents of the
   page's slots in lanes [0, page_size), V's in [page_size, 2*page_size) (one (1, 128) tile per
   page and head; int8 exponents in a minor dimension under 128 would be stored page-minor too).
3. `update_kv_cache` writes a step's rows in place (the reference's quantization for fp8);
   `from_reference_cache` converts a reference-layout cache (tests, tools).

NOTE: padding only where D is not a multiple of 64 (the values) and page_size < 64 (the fp8
exponents: 512 bytes per page and KV head); `cache_bytes_per_row` counts both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache, quantize_kv_rows

LANES = 128


def row_width(head_dim: int) -> int:
    """W: lanes of one (slot, head) row holding K and V, rounded up to whole 128-lane tiles."""
    return -(-2 * head_dim // LANES) * LANES


def exponent_width(page_size: int) -> int:
    """E: lanes of one (page, head) exponent row (K's then V's), rounded up to 128."""
    return -(-2 * page_size // LANES) * LANES


def kv_cache_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_pages, num_kv_heads, page_size, row_width(head_dim))


def cache_bytes_per_row(head_dim: int, page_size: int, dtype_bytes: int, fp8: bool) -> float:
    """Bytes per (slot, K-or-V head) row, padding and the fp8 exponent tiles included."""
    if fp8:
        return row_width(head_dim) / 2 + 4 * exponent_width(page_size) / (2 * page_size)
    return row_width(head_dim) * dtype_bytes / 2


def new_kv_cache(
    shape: tuple[int, ...], dtype, kv_cache_dtype: str = "auto"
) -> jax.Array | Fp8KVCache:
    """Zeros of `shape` ([P, Hkv, page_size, W]), or for "fp8" an `Fp8KVCache` of zeros."""
    if kv_cache_dtype == "fp8":
        p, hkv, ps, _ = shape
        return Fp8KVCache(
            jnp.zeros(shape, jnp.float8_e4m3fn),
            jnp.zeros((p, hkv, 1, exponent_width(ps)), jnp.int32),
        )
    return jnp.zeros(shape, dtype)


def head_dim_of(kv_cache, q_head_dim: int) -> int:
    """Checks that `kv_cache`'s rows fit q's head_dim; returns it."""
    if kv_cache.shape[3] != row_width(q_head_dim):
        raise ValueError(
            f"kv_cache rows of {kv_cache.shape[3]} lanes do not hold head_dim {q_head_dim} "
            f"(want {row_width(q_head_dim)})"
        )
    return q_head_dim


def _rows(k: jax.Array, v: jax.Array, width: int) -> jax.Array:  # [T, Hkv, W]
    kv = jnp.concatenate([k, v], axis=-1)
    return jnp.pad(kv, ((0, 0), (0, 0), (0, width - kv.shape[-1])))


def update_kv_cache(
    kv_cache: jax.Array | Fp8KVCache,  # [P, Hkv, page_size, W]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T] page*page_size + offset; < 0 for padding tokens
) -> jax.Array | Fp8KVCache:
    """`reference.update_kv_cache` for this layout: the same values (and fp8 rounding)."""
    num_pages, _, page_size, width = kv_cache.shape
    page = jnp.where(slot_mapping < 0, num_pages, slot_mapping // page_size)  # padding: dropped
    offset = slot_mapping % page_size
    if isinstance(kv_cache, Fp8KVCache):
        data, exponent = quantize_kv_rows(jnp.stack([k, v], axis=2))  # [T, Hkv, 2, D], [T, Hkv, 2]
        rows = _rows(data[:, :, 0], data[:, :, 1], width)
        lanes = jnp.concatenate([offset, offset + page_size])  # K's, then V's exponent lanes
        pages = jnp.concatenate([page, page])
        exps = jnp.concatenate([exponent[:, :, 0], exponent[:, :, 1]]).astype(jnp.int32)
        new_cache = Fp8KVCache(
            kv_cache.data.at[page, :, offset].set(rows, mode="drop"),
            kv_cache.exponent.at[pages, :, jnp.zeros_like(lanes), lanes].set(exps, mode="drop"),
        )
    else:
        rows = _rows(k, v, width).astype(kv_cache.dtype)
        new_cache = kv_cache.at[page, :, offset].set(rows, mode="drop")
    # NOTE: as in the reference: keeps XLA from fusing the write into a reader (a cache copy).
    return jax.lax.optimization_barrier(new_cache)


def from_reference_cache(cache: jax.Array | Fp8KVCache) -> jax.Array | Fp8KVCache:
    """A reference-layout cache `[P, page_size, 2*Hkv, D]` in this layout (same values)."""
    p, ps, h2, d = cache.shape
    hkv, width = h2 // 2, row_width(d)

    def values(x):  # [P, ps, 2*Hkv, D] -> [P, Hkv, ps, W]
        x = x.reshape(p, ps, hkv, 2 * d).transpose(0, 2, 1, 3)
        return jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, width - 2 * d)))

    if not isinstance(cache, Fp8KVCache):
        return values(cache)
    e = cache.exponent.reshape(p, ps, hkv, 2).transpose(0, 2, 3, 1).reshape(p, hkv, 1, 2 * ps)
    e = jnp.pad(e.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, exponent_width(ps) - 2 * ps)))
    return Fp8KVCache(values(cache.data), e)
