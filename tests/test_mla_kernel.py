"""Ragged paged MLA: the reference against a naive numpy loop, the GPU kernel against the reference.

1. The reference equals a per-token numpy softmax over the sequence's cached rows (decodes,
   prefill chunks, a mixed batch, sliding window, soft-cap), with unused pages NaN-filled.
2. The GPU/Triton kernel in Pallas interpret mode equals the reference on the same batches
   (f32 and bf16), with small blocks so the shapes span several query and KV blocks.
3. The kernel lowers to Triton for a production-sized call (DeepSeek-V3 widths) without hardware.
4. The latent write is exact; the cache holds (L + R) values per token; bad shapes raise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla_paged_attention import (
    KERNELS,
    gpu,
    kv_cache_shape,
    reference,
    update_kv_cache,
)
from pallas_kernels.ragged_paged_attention import block_sizes

LAT, ROPE, HEADS, PAGE, PAGES_PER_SEQ, NUM_PAGES = 32, 16, 4, 4, 8, 40
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 2e-2}
SMALL_BLOCKS = block_sizes.KernelBlocks(block_q=2, decode_block_q=1, pages_per_block=2)

SCENARIOS = {  # (q_lens, kv_lens) per sequence, decodes first
    "decode": ([1, 1, 1], [9, 3, 30]),
    "prefill": ([13], [13]),
    "mixed": ([1, 1, 7, 5], [20, 2, 11, 5]),
}


def make_batch(
    q_lens,
    kv_lens,
    *,
    heads=HEADS,
    lat=LAT,
    rope=ROPE,
    num_tokens=32,
    max_seqs=6,
    seed=0,
    dtype=jnp.float32,
):
    rng = np.random.default_rng(seed)
    c = lat + rope
    cache = np.full((NUM_PAGES, PAGE, c), np.nan, np.float32)
    pages = rng.permutation(NUM_PAGES)
    page_indices = np.zeros((max_seqs, PAGES_PER_SEQ), np.int32)
    used = 0
    for s, n in enumerate(kv_lens):
        k = -(-n // PAGE)
        page_indices[s, :k] = pages[used : used + k]
        for j in range(n):
            cache[page_indices[s, j // PAGE], j % PAGE] = rng.standard_normal(c)
        used += k
    page_indices[len(kv_lens) :] = pages[-1]  # padded rows point at a NaN page
    q = rng.standard_normal((num_tokens, heads, c)).astype(np.float32)
    cu = np.full(max_seqs + 1, sum(q_lens), np.int32)
    cu[0] = 0
    cu[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    kv = np.zeros(max_seqs, np.int32)
    kv[: len(kv_lens)] = kv_lens
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(cache, dtype),
        jnp.asarray(kv),
        jnp.asarray(page_indices),
        jnp.asarray(cu),
        jnp.asarray([len(q_lens)], np.int32),
    )
    return args


def naive(
    q,
    cache,
    kv_lens,
    page_indices,
    cu,
    num_seqs,
    *,
    sm_scale,
    kv_lora_rank,
    sliding_window=None,
    soft_cap=None,
):
    q, cache = np.asarray(q, np.float32), np.asarray(cache, np.float32)
    out = np.zeros((q.shape[0], q.shape[1], kv_lora_rank), np.float32)
    page = cache.shape[1]
    for s in range(int(num_seqs[0])):
        kv_len = int(kv_lens[s])
        rows = np.stack([cache[page_indices[s, j // page], j % page] for j in range(kv_len)])
        q_len = int(cu[s + 1] - cu[s])
        for i in range(q_len):
            pos = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            keys = rows[lo : pos + 1]
            sc = q[cu[s] + i] @ keys.T * sm_scale  # [H, keys]
            if soft_cap is not None:
                sc = soft_cap * np.tanh(sc / soft_cap)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[cu[s] + i] = (p / p.sum(-1, keepdims=True)) @ keys[:, :kv_lora_rank]
    return out


def _err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


FEATURES = {"plain": {}, "window": dict(sliding_window=5), "soft_cap": dict(soft_cap=2.0)}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_reference_matches_naive(scenario, feature):
    args = make_batch(*SCENARIOS[scenario])
    kw = dict(sm_scale=0.15, kv_lora_rank=LAT, **FEATURES[feature])
    got = np.asarray(reference.mla_ragged_paged_attention(*args, **kw))
    want = naive(*args, **kw)
    assert np.isfinite(got).all()
    assert _err(got, want) <= 1e-5
    n_real = int(args[4][int(args[5][0])])
    assert not got[n_real:].any()  # padding tokens get zeros


@pytest.mark.parametrize("feature", ["plain", "window"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_gpu_kernel_matches_reference(scenario, feature):
    args = make_batch(*SCENARIOS[scenario], seed=3)
    kw = dict(sm_scale=0.15, kv_lora_rank=LAT, **FEATURES[feature])
    want = reference.mla_ragged_paged_attention(*args, **kw)
    got = gpu.mla_ragged_paged_attention(*args, interpret=True, blocks=SMALL_BLOCKS, **kw)
    assert np.isfinite(np.asarray(got)).all()
    assert _err(got, want) <= TOL[jnp.dtype(jnp.float32)]


def test_gpu_kernel_bf16_and_odd_head_count():
    args = make_batch(*SCENARIOS["mixed"], heads=3, seed=5, dtype=jnp.bfloat16)
    kw = dict(sm_scale=0.15, kv_lora_rank=LAT, soft_cap=3.0)
    want = reference.mla_ragged_paged_attention(*args, **kw)
    got = gpu.mla_ragged_paged_attention(*args, interpret=True, blocks=SMALL_BLOCKS, **kw)
    assert got.dtype == jnp.bfloat16 and got.shape == (32, 3, LAT)
    assert _err(got, want) <= TOL[jnp.dtype(jnp.bfloat16)]


def test_gpu_kernel_lowers_to_triton():
    """DeepSeek-V3 widths (L=512, R=64, 16 local heads), bf16, the table's block sizes."""
    args = make_batch(
        [1, 1, 1, 30],
        [32, 17, 30, 30],
        heads=16,
        lat=512,
        rope=64,
        num_tokens=64,
        max_seqs=8,
        dtype=jnp.bfloat16,
    )
    lowered = (
        KERNELS["gpu"]
        .trace(*args, sm_scale=0.1, kv_lora_rank=512)
        .lower(lowering_platforms=("cuda",))
    )
    assert lowered.as_text().count("triton") >= 2  # a decode-class and a prefill-class call


def test_cache_shape_and_exact_write():
    assert kv_cache_shape(7, 16, 512, 64) == (7, 16, 576)  # (L + R) values per token, no heads
    rng = np.random.default_rng(0)
    cache = np.full((3, PAGE, LAT + ROPE), np.nan, np.float32)
    rows = rng.standard_normal((5, LAT + ROPE)).astype(np.float32)
    slots = np.array([0, 5, -1, 11, 6], np.int32)
    got = np.asarray(update_kv_cache(jnp.asarray(cache), jnp.asarray(rows), jnp.asarray(slots)))
    want = cache.copy()
    for i, slot in enumerate(slots):
        if slot >= 0:
            want[slot // PAGE, slot % PAGE] = rows[i]
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_bad_shapes_raise(backend):
    q, cache, *meta = make_batch(*SCENARIOS["decode"])
    fn = KERNELS[backend]
    with pytest.raises(ValueError, match="row width"):
        fn(q[..., :-1], cache, *meta, sm_scale=0.1, kv_lora_rank=LAT)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        fn(q, cache, *meta, sm_scale=0.1, kv_lora_rank=LAT + ROPE)
    with pytest.raises(ValueError, match="int32"):
        fn(q, cache, meta[0].astype(jnp.int16), *meta[1:], sm_scale=0.1, kv_lora_rank=LAT)


def test_gpu_rejects_non_power_of_two_widths():
    args = make_batch(*SCENARIOS["decode"], lat=24, rope=8)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        gpu.mla_ragged_paged_attention(*args, sm_scale=0.1, kv_lora_rank=24, interpret=True)


def test_reference_is_jittable_inside_a_program():
    args = make_batch(*SCENARIOS["mixed"])
    f = jax.jit(lambda *a: reference.mla_ragged_paged_attention(*a, sm_scale=0.1, kv_lora_rank=LAT))
    assert f(*args).shape == (32, HEADS, LAT)
