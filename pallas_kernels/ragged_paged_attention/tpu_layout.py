"""The TPU kernel's KV cache layout: one that XLA's default TPU layout keeps row-major.

XLA picks a TPU array's physical layout to avoid tile padding: an array whose minor dimension is
not a multiple of 128 lanes gets its largest axis moved minor-most. The reference layout
`[P, page_size, 2*Hkv, D]` with D = 64 (SmolLM2: `bf16[P,16,6,64]`) is stored page-minor, so
every Mosaic call (which needs row-major) copied the whole cache first. This layout is row-major
under XLA's own choice for every KV-head count when D is a multiple of 64 (W whole 128-lane
tiles: every model we list), so the kernel reads it in place:

1. Values: `[P, Hkv, page_size, W]`, W = 2*D (W names D exactly, so a query of another
   head_dim is refused): the row of (page, head, slot) is K (lanes [0, D)) then V (lanes
   [D, 2D)). A program DMAs one `[page_size, W]` block per page (its KV head is a leading,
   untiled index: always aligned).
2. An fp8 cache (`Fp8KVCache`) keeps its values in that layout as float8_e4m3fn and its row
   exponents as `i32[Hkv, P, 1, E]`, E = 2*page_size rounded up to 128: K's exponents of the
   page's slots in lanes [0, page_size), V's in [page_size, 2*page_size). Heads lead so that
   XLA's scatter (the cache write) keeps the array's own layout for any KV-head count (pages
   second, `[P, Hkv, 1, E]` with Hkv = 3 was re-laid-out, a whole copy, on every write).
3. `update_kv_cache` writes a step's rows in place (the reference's quantization for fp8);
   `from_reference_cache` converts a reference-layout cache (tests, tools).

NOTE: a D that is not a multiple of 64 (toy test models; head_dim 80/96) is correct but gets
XLA's padding-avoiding layout again (a cache copy per call on a TPU), as the reference did.
NOTE: memory is padded to whole tiles: page_size rounds up to 8 rows per 32-bit word of
sublane packing (16 for bf16, 32 for fp8) and the fp8 exponents to 128 lanes per page and
head; `cache_bytes_per_row` counts both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache, quantize_kv_rows

LANES = 128


def row_width(head_dim: int) -> int:
    """W = 2*head_dim: lanes of one (slot, head) row holding K and V (W names head_dim exactly)."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return 2 * head_dim


def exponent_width(page_size: int) -> int:
    """E: lanes of one (page, head) exponent row (K's then V's), rounded up to 128."""
    return -(-2 * page_size // LANES) * LANES


def kv_cache_shape(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_pages, num_kv_heads, page_size, row_width(head_dim))


def padded_page_size(page_size: int, dtype_bytes: int) -> int:
    """Rows a page takes in memory: whole (8 x 32-bit-word) sublane tiles of its dtype."""
    rows = 8 * 4 // dtype_bytes
    return -(-page_size // rows) * rows


def cache_bytes_per_row(head_dim: int, page_size: int, dtype_bytes: int, fp8: bool) -> float:
    """Bytes per (slot, K-or-V head) row, tile padding and the fp8 exponent tiles included."""
    values = 1 if fp8 else dtype_bytes
    row = head_dim * values * padded_page_size(page_size, values) / page_size
    if fp8:
        return row + 4 * exponent_width(page_size) / (2 * page_size)
    return row


def new_kv_cache(
    shape: tuple[int, ...], dtype, kv_cache_dtype: str = "auto"
) -> jax.Array | Fp8KVCache:
    """Zeros of `shape` ([P, Hkv, page_size, W]), or for "fp8" an `Fp8KVCache` of zeros."""
    if kv_cache_dtype == "fp8":
        p, hkv, ps, _ = shape
        return Fp8KVCache(
            jnp.zeros(shape, jnp.float8_e4m3fn),
            jnp.zeros((hkv, p, 1, exponent_width(ps)), jnp.int32),
        )
    return jnp.zeros(shape, dtype)


def head_dim_of(kv_cache, q_head_dim: int) -> int:
    """Checks that `kv_cache`'s rows are those of q's head_dim; returns it."""
    if kv_cache.shape[3] != row_width(q_head_dim):
        raise ValueError(
            f"kv_cache rows of {kv_cache.shape[3]} lanes hold head_dim {kv_cache.shape[3] // 2}, "
            f"not q's head_dim {q_head_dim}"
        )
    return q_head_dim


def _rows(k: jax.Array, v: jax.Array, width: int) -> jax.Array:  # [T, Hkv, W]
    if 2 * k.shape[-1] != width:
        raise ValueError(f"K/V of head_dim {k.shape[-1]} do not fill the cache's {width}-lane rows")
    return jnp.concatenate([k, v], axis=-1)


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
        lanes = jnp.concatenate([offset, offset + page_size])[:, None]  # K's, then V's lanes
        pages = jnp.concatenate([page, page])[:, None]
        exps = jnp.concatenate([exponent[:, :, 0], exponent[:, :, 1]]).astype(jnp.int32)
        heads = jnp.arange(exps.shape[1])[None, :]
        new_cache = Fp8KVCache(
            kv_cache.data.at[page, :, offset].set(rows, mode="drop"),
            kv_cache.exponent.at[heads, pages, 0, lanes].set(exps, mode="drop"),  # [2T, Hkv]
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
        return x.reshape(p, ps, hkv, width).transpose(0, 2, 1, 3)

    if not isinstance(cache, Fp8KVCache):
        return values(cache)
    e = cache.exponent.reshape(p, ps, hkv, 2).transpose(2, 0, 3, 1).reshape(hkv, p, 1, 2 * ps)
    e = jnp.pad(e.astype(jnp.int32), ((0, 0), (0, 0), (0, 0), (0, exponent_width(ps) - 2 * ps)))
    return Fp8KVCache(values(cache.data), e)
