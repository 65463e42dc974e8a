"""The TPU KV write kernel (`tpu_write`, Pallas interpret mode on CPU) against XLA's write of the
same layout (`tpu_layout.update_kv_cache`): bit for bit, over a cache of random bits (NaNs
included, one NaN pattern), f32 / bf16 / fp8 caches, head_dim 64 and 128, page sizes 16, 32 and
4 (a page smaller than a tile: the chunk is the page). The tokens cross page boundaries, include
padding (slot -1), span four grid blocks (13 tokens, blocks of 4: fewer unrolled merges than the
default 8, a cheaper interpret run) and share tiles within a block and across blocks. Its Mosaic
compiles for v5e / v6e: tests/test_accel_kernels.py and tests/test_aot.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_common import interpret_mode
from pallas_kernels.ragged_paged_attention import tpu_layout, tpu_write
from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache

# 13 tokens: a prefill run across a page boundary (14..17), padding, slots 40, 41 and 44 in one
# tile (token 6 in the second block, 8 and 9 in the third), a lone slot, the cache's last slot.
SLOTS = [13, 14, 15, 16, -1, 17, 40, 90, 41, 44, -1, 3, 95]
CASES = [
    ("float32", 64, 16),
    ("bfloat16", 128, 32),
    ("fp8", 64, 16),
    ("fp8", 128, 4),
]


def _random_bits(rng, shape, dtype):
    nbytes = int(np.prod(shape)) * jnp.dtype(dtype).itemsize
    x = jnp.asarray(rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape))
    # NOTE: one NaN bit pattern: XLA:CPU's scatter drops NaN payloads (the kernel keeps them)
    return jnp.where(jnp.isnan(x), jnp.nan, x)


@pytest.mark.parametrize("dtype,head_dim,page_size", CASES)
def test_kernel_write_is_xlas_write(dtype, head_dim, page_size):
    rng = np.random.default_rng(0)
    fp8, hkv = dtype == "fp8", 3
    num_pages = 96 // page_size
    shape = tpu_layout.kv_cache_shape(num_pages, page_size, hkv, head_dim)
    model = jnp.float32 if dtype == "float32" else jnp.bfloat16
    empty = tpu_layout.new_kv_cache(shape, model, "fp8" if fp8 else "auto")
    cache = jax.tree.map(lambda x: _random_bits(rng, x.shape, x.dtype), empty)
    if fp8:  # exponents in the written range, so both writes see the same valid cache
        cache = Fp8KVCache(
            cache.data, jnp.asarray(rng.integers(-8, 8, empty.exponent.shape, dtype=np.int32))
        )
    t = len(SLOTS)
    k = jnp.asarray(rng.standard_normal((t, hkv, head_dim)) * 3, model)
    v = jnp.asarray(rng.standard_normal((t, hkv, head_dim)), model)
    slots = jnp.asarray(SLOTS, jnp.int32)
    want = tpu_layout.update_kv_cache(cache, k, v, slots)

    @jax.jit
    def write(c, k, v, s):
        return tpu_write.update_kv_cache(
            c, k, v, s, interpret=interpret_mode("tpu", "cpu"), block=4
        )

    got = write(cache, k, v, slots)
    assert type(got) is type(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
