"""The fp8 KV cache (`kv_cache_dtype="fp8"`).

1. The write: each (token, K-or-V head) row stored as float8_e4m3fn with a power-of-two scale
   (int8 exponent) that brings its absolute max under 448; round trip within e4m3's precision,
   zero rows stay zero, padding tokens are dropped.
2. Attention: the reference over an fp8 cache equals the reference over the float cache holding
   the same (dequantized) values; the compiled CPU kernel, the GPU kernel (its decode program
   with and without split-K, and its prefill program) and the TPU kernel (interpret mode) equal
   the reference on fp8 caches, f32 and bf16 queries; both lower for their platform.
3. A backend not listed as reading it is refused naming the field (today every backend reads
   it), as is a pipeline mesh; bad values are refused.
4. The engine: an fp8 cache holds ~2x the tokens of bf16 (~4x of f32) in the same memory, says
   so in its capacity log line, and generates the float cache's greedy tokens on a tiny model.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import attention
from jaxinfer.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from pallas_kernels.paged_common import interpret_mode
from pallas_kernels.ragged_paged_attention import KERNELS, block_sizes, cpu, reference, tpu_layout
from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache
from pallas_kernels.ragged_paged_attention.tpu_layout import from_reference_cache
from tests.test_kernels import BASE, SCENARIOS, SMALL_BLOCKS, Shape, make_batch, tol

P, PS, H, D, HQ = 16, 4, 2, 64, 8


def _filled(rng, dtype_kv: str):
    t = 12
    k = jnp.asarray(rng.standard_normal((t, H, D)) * 3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, H, D)), jnp.float32)
    k = k.at[3, 1].set(0.0)  # an all-zero row
    slots = jnp.asarray(
        np.r_[np.arange(0, 7), np.arange(20, 24), -1], jnp.int32
    )  # one padding token
    cache = attention.new_kv_cache((P, PS, 2 * H, D), jnp.float32, dtype_kv)
    if dtype_kv == "auto":
        cache = jnp.full((P, PS, 2 * H, D), jnp.nan, jnp.float32)
    return reference.update_kv_cache(cache, k, v, slots), k, v, slots


def test_write_round_trip():
    cache, k, v, slots = _filled(np.random.default_rng(0), "fp8")
    assert isinstance(cache, Fp8KVCache)
    assert cache.data.dtype == jnp.float8_e4m3fn and cache.exponent.dtype == jnp.int8
    kv = jnp.stack([k, v], axis=2).reshape(k.shape[0], 2 * H, D)
    for t in range(11):
        page, off = int(slots[t]) // PS, int(slots[t]) % PS
        rows = np.asarray(
            reference.dequantize_kv_rows(cache.data[page, off], cache.exponent[page, off])
        )
        want = np.asarray(kv[t])
        np.testing.assert_allclose(rows, want, rtol=2.0**-4, atol=2.0**-9 * np.abs(want).max())
        scaled = np.abs(np.asarray(cache.data[page, off], np.float32)).max(axis=-1)
        live = np.abs(want).max(axis=-1) > 0
        assert np.all(scaled[live] > 448 / 2 - 16) and np.all(scaled <= 448)  # the range is used
    assert int(cache.exponent[0, 3, 2]) == 0 and not np.any(
        np.asarray(cache.data[0, 3, 2], np.float32)
    )
    untouched = np.asarray(
        cache.data[5:], np.float32
    )  # slot 23 is page 5; the padding token wrote nothing
    assert not np.any(untouched[1:])


def _attend(backend, cache, q):
    kv_lens = jnp.array([7, 4], jnp.int32)
    pages = jnp.array([[0, 1, 2, 3], [5, 6, 7, 8]], jnp.int32)
    cu = jnp.array([0, 7, 11], jnp.int32)
    return attention.KERNELS[backend](
        q, cache, kv_lens, pages, cu, jnp.array([2], jnp.int32), sm_scale=D**-0.5
    )


def test_attention_reads_fp8_like_the_float_values():
    rng = np.random.default_rng(1)
    cache, *_ = _filled(rng, "fp8")
    q = jnp.asarray(rng.standard_normal((12, HQ, D)), jnp.float32)
    values = reference.dequantize_kv_rows(cache.data, cache.exponent)
    want = np.asarray(_attend("reference", values, q))
    got = np.asarray(_attend("reference", cache, q))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    if cpu.available():
        ours = np.asarray(_attend("cpu", cache, q))
        np.testing.assert_allclose(ours, want, rtol=0, atol=1e-5 * np.abs(want).max())
        bf16 = np.asarray(_attend("cpu", cache, q.astype(jnp.bfloat16)), np.float32)
        np.testing.assert_allclose(bf16, want, rtol=0, atol=2e-2 * np.abs(want).max())
    float_cache, *_ = _filled(np.random.default_rng(1), "auto")
    exact = np.asarray(_attend("reference", float_cache, q))
    # NOTE: e4m3 keeps 3 mantissa bits: each K and V value is rounded by up to 2^-4 of itself
    # (the row's power-of-two scale keeps it in the normal range), which moves the output by up
    # to 2^-4 of |V| directly and more through the softmax weights the rounded K shift; measured
    # 0.075 of the output's max (2026-11-25), so 0.1 bounds fp8's rounding and nothing larger.
    assert 0 < np.abs(got - exact).max() <= 0.1 * np.abs(exact).max()


KERNEL_CASES = {  # name -> (backend, blocks): the GPU decode program with and without split-K
    "gpu_split_k": ("gpu", SMALL_BLOCKS),
    "gpu": ("gpu", block_sizes.KernelBlocks(block_q=2, decode_block_q=1, pages_per_block=2)),
    "tpu": ("tpu", SMALL_BLOCKS),
}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="interpret mode on a CPU platform")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernels_read_fp8_like_the_reference(case, dtype):
    """Decodes and prefill chunks in one batch (both of a kernel's programs) over a NaN-poisoned
    cache quantized to fp8: the kernel == the reference over the dequantized values."""
    backend, blocks = KERNEL_CASES[case]
    args = make_batch(BASE, *SCENARIOS["mixed"], seed=5, dtype=dtype)
    data, exponent = reference.quantize_kv_rows(args[1])
    fp8 = Fp8KVCache(data, exponent)
    values = reference.dequantize_kv_rows(data, exponent)
    kw = dict(sm_scale=0.125, soft_cap=20.0)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(
            reference.ragged_paged_attention(args[0], values, *args[2:], **kw), np.float32
        )
    interpret = interpret_mode(backend)
    if backend == "tpu":
        fp8 = from_reference_cache(fp8)
    got = KERNELS[backend](args[0], fp8, *args[2:], interpret=interpret, blocks=blocks, **kw)
    assert got.dtype == dtype
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all()
    bound = tol(dtype)
    assert np.linalg.norm(got - want) <= bound * np.linalg.norm(want)
    assert np.max(np.abs(got - want)) <= bound * np.max(np.abs(want))


@pytest.mark.parametrize(
    "backend,platform,marker", [("gpu", "cuda", "triton"), ("tpu", "tpu", "tpu_custom_call")]
)
def test_kernels_lower_fp8_for_their_platform(backend, platform, marker):
    """Triton / Mosaic lowering of an 8B-shaped call on an fp8 cache with the table's blocks."""
    shape = Shape(
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        pages_per_seq=16,
        num_pages=64,
        num_tokens=64,
        max_seqs=8,
    )
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype)
        for a in make_batch(shape, [1, 1, 1, 30], [40, 17, 200, 64], dtype=jnp.bfloat16)
    ]
    args[1] = jax.eval_shape(
        from_reference_cache if backend == "tpu" else lambda c: c,
        Fp8KVCache(
            jax.ShapeDtypeStruct(args[1].shape, jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct(args[1].shape[:3], jnp.int8),
        ),
    )
    if backend == "gpu":  # NOTE: Triton lowering reads the target GPU from the abstract mesh
        device = jax.sharding.AbstractDevice(
            device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda"
        )
        mesh = jax.sharding.AbstractMesh(
            (1,), ("x",), (jax.sharding.AxisType.Explicit,), abstract_device=device
        )
        with jax.sharding.use_abstract_mesh(mesh):
            lowered = (
                KERNELS[backend].trace(*args, sm_scale=0.088).lower(lowering_platforms=(platform,))
            )
    else:
        lowered = (
            KERNELS[backend].trace(*args, sm_scale=0.088).lower(lowering_platforms=(platform,))
        )
    assert lowered.as_text().count(marker) >= 2  # a decode-class and a prefill-class call


def test_unreadable_backends_and_bad_values_are_named(monkeypatch):
    for backend in attention.KERNELS:
        attention.check_kv_cache_dtype(backend, "fp8")  # every backend of today reads it
    monkeypatch.setattr(attention, "FP8_KV_BACKENDS", ("reference", "cpu", "gpu"))
    with pytest.raises(
        ValueError, match="kv_cache_dtype='fp8' is not readable by attention_backend 'tpu'"
    ):
        attention.check_kv_cache_dtype("tpu", "fp8")
    attention.check_kv_cache_dtype("tpu", "auto")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' is not supported"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported"):
        attention.check_kv_cache_dtype("cpu", "int8")


def _engine(model, kv_cache_dtype, backend, **kw):
    # NOTE: one 16-token bucket: the prefill and the decodes run one program per engine
    kw = {"max_num_seqs": 2, "token_buckets": (16,), **kw}
    return LLMEngine(
        model,
        EngineConfig(
            page_size=4,
            max_model_len=64,
            max_num_batched_tokens=16,
            kv_cache_dtype=kv_cache_dtype,
            **kw,
        ),
        attention_backend=backend,
    )


@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("reference", marks=pytest.mark.slow),
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not cpu.available(), reason="the CPU attention kernel does not build here"
            ),
        ),
    ],
)
def test_engine_fp8_capacity_log_and_tokens(backend, caplog):
    from tests import engine_utils as eu

    # NOTE: greedy tokens compare exactly, so the random model must have no near-tie on these
    # prompts: seed 0's first token is a 0.16-logprob tie (fp8 noise flips it), seed 1's are not
    model = eu.tiny_model(eu.load_vocab(), seed=1)
    budget = 64 * 1024
    with caplog.at_level(logging.INFO, logger="jaxinfer.engine.core"):
        fp8 = _engine(model, "fp8", backend, kv_cache_memory=budget, max_num_seqs=64)
    f32 = _engine(model, "auto", backend, kv_cache_memory=budget, max_num_seqs=64)
    cfg = model.cfg
    d, rows = cfg.head_dim, 4 * 2 * cfg.num_kv_heads * cfg.num_layers  # rows of a page, all layers
    assert fp8.capacity().num_pages + 1 == budget // (rows * (d + 1))
    assert f32.capacity().num_pages + 1 == budget // (rows * 4 * d)
    assert fp8.capacity().num_pages > 3.5 * f32.capacity().num_pages
    assert (
        "fp8 e4m3" in caplog.text and f"{4 * d / (d + 1):.2f}x the tokens of float32" in caplog.text
    )
    assert isinstance(fp8.runner.kv_caches[0], Fp8KVCache)
    assert fp8.runner.kv_cache_bytes < f32.runner.kv_cache_bytes
    prompts = [[5, 300, 41, 7000, 12, 9], [88, 2, 61, 5, 190, 77, 1000, 3, 4]]
    want = eu.run(
        _engine(model, "auto", backend, num_pages=32),
        [(str(i), p, eu.greedy(6)) for i, p in enumerate(prompts)],
    )
    got = eu.run(
        _engine(model, "fp8", backend, num_pages=32),
        [(str(i), p, eu.greedy(6)) for i, p in enumerate(prompts)],
    )
    assert [got[str(i)][0].token_ids for i in range(2)] == [
        want[str(i)][0].token_ids for i in range(2)
    ]


def test_engine_rejects_fp8_on_a_backend_that_cannot_read_it(monkeypatch):
    from tests import engine_utils as eu

    model = eu.tiny_model(eu.load_vocab())
    monkeypatch.setattr(attention, "FP8_KV_BACKENDS", ("reference", "cpu", "gpu"))
    with pytest.raises(
        ValueError, match="kv_cache_dtype='fp8' is not readable by attention_backend 'tpu'"
    ):
        _engine(model, "fp8", "tpu", num_pages=8)
    if jax.device_count() >= 2:
        with pytest.raises(
            ValueError, match="kv_cache_dtype='fp8' is not supported with a pipeline"
        ):
            _engine(
                model,
                "fp8",
                "reference",
                num_pages=8,
                mesh=f"pipeline=2,tensor={jax.device_count() // 2}",
            )


@pytest.mark.parametrize("dtype_kv", ["auto", "fp8"])
def test_tpu_layout_write_is_the_reference_write(dtype_kv):
    """The TPU kernel's layout (`tpu_layout`) holds exactly the reference's rows after a write:
    the same values, the same fp8 rounding and exponents, padding tokens dropped."""
    rng = np.random.default_rng(3)
    want, k, v, slots = _filled(rng, dtype_kv)
    start = attention.new_kv_cache((P, PS, 2 * H, D), jnp.float32, dtype_kv)
    if dtype_kv == "auto":
        start = jnp.full((P, PS, 2 * H, D), jnp.nan, jnp.float32)
    got = tpu_layout.update_kv_cache(from_reference_cache(start), k, v, slots)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(from_reference_cache(want))):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    shape = attention.kv_cache_shape("tpu", P, PS, H, D)
    fresh = attention.new_kv_cache(shape, jnp.float32, dtype_kv, backend="tpu")
    assert jax.tree.map(lambda x: (x.shape, x.dtype), fresh) == jax.tree.map(
        lambda x: (x.shape, x.dtype), from_reference_cache(start)
    )
