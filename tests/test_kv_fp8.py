"""The fp8 KV cache (`kv_cache_dtype="fp8"`).

1. The write: each (token, K-or-V head) row stored as float8_e4m3fn with a power-of-two scale
   (int8 exponent) that brings its absolute max under 448; round trip within e4m3's precision,
   zero rows stay zero, padding tokens are dropped.
2. Attention: the reference over an fp8 cache equals the reference over the float cache holding
   the same (dequantized) values; the compiled CPU kernel equals the reference on fp8 caches.
3. Backends that cannot read it are refused naming the field; bad values are refused.
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
from pallas_kernels.ragged_paged_attention import cpu, reference
from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache

P, PS, H, D, HQ = 16, 4, 2, 64, 8


def _filled(rng, dtype_kv: str):
    t = 12
    k = jnp.asarray(rng.standard_normal((t, H, D)) * 3, jnp.float32)
    v = jnp.asarray(rng.standard_normal((t, H, D)), jnp.float32)
    k = k.at[3, 1].set(0.0)  # an all-zero row
    slots = jnp.asarray(np.r_[np.arange(0, 7), np.arange(20, 24), -1], jnp.int32)  # one padding token
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
        rows = np.asarray(reference.dequantize_kv_rows(cache.data[page, off], cache.exponent[page, off]))
        want = np.asarray(kv[t])
        np.testing.assert_allclose(rows, want, rtol=2.0**-4, atol=2.0**-9 * np.abs(want).max())
        scaled = np.abs(np.asarray(cache.data[page, off], np.float32)).max(axis=-1)
        live = np.abs(want).max(axis=-1) > 0
        assert np.all(scaled[live] > 448 / 2 - 16) and np.all(scaled <= 448)  # the range is used
    assert int(cache.exponent[0, 3, 2]) == 0 and not np.any(np.asarray(cache.data[0, 3, 2], np.float32))
    untouched = np.asarray(cache.data[5:], np.float32)  # slot 23 is page 5; the padding token wrote nothing
    assert not np.any(untouched[1:])


def _attend(backend, cache, q):
    kv_lens = jnp.array([7, 4], jnp.int32)
    pages = jnp.array([[0, 1, 2, 3], [5, 6, 7, 8]], jnp.int32)
    cu = jnp.array([0, 7, 11], jnp.int32)
    return attention.KERNELS[backend](q, cache, kv_lens, pages, cu, jnp.array([2], jnp.int32), sm_scale=D**-0.5)


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
    assert 0 < np.abs(got - exact).max() <= 0.1 * np.abs(exact).max()  # fp8's rounding, bounded


def test_unreadable_backends_and_bad_values_are_named():
    for backend in ("gpu", "tpu"):
        with pytest.raises(ValueError, match=f"kv_cache_dtype='fp8' is not readable by attention_backend '{backend}'"):
            attention.check_kv_cache_dtype(backend, "fp8")
    attention.check_kv_cache_dtype("reference", "fp8")
    attention.check_kv_cache_dtype("tpu", "auto")
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' is not supported"):
        EngineConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' is not supported"):
        attention.check_kv_cache_dtype("cpu", "int8")


def _engine(model, kv_cache_dtype, backend, **kw):
    kw = {"max_num_seqs": 2, **kw}
    return LLMEngine(model, EngineConfig(page_size=4, max_model_len=64, max_num_batched_tokens=16,
                                         kv_cache_dtype=kv_cache_dtype, **kw),
                     attention_backend=backend)


@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow), pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu.available(), reason="the CPU attention kernel does not build here"))])
def test_engine_fp8_capacity_log_and_tokens(backend, caplog):
    from tests import engine_utils as eu

    model = eu.tiny_model(eu.load_vocab())
    budget = 64 * 1024
    with caplog.at_level(logging.INFO, logger="jaxinfer.engine.core"):
        fp8 = _engine(model, "fp8", backend, kv_cache_memory=budget, max_num_seqs=64)
    f32 = _engine(model, "auto", backend, kv_cache_memory=budget, max_num_seqs=64)
    cfg = model.cfg
    d, rows = cfg.head_dim, 4 * 2 * cfg.num_kv_heads * cfg.num_layers  # rows of a page, all layers
    assert fp8.capacity()["num_pages"] + 1 == budget // (rows * (d + 1))
    assert f32.capacity()["num_pages"] + 1 == budget // (rows * 4 * d)
    assert fp8.capacity()["num_pages"] > 3.5 * f32.capacity()["num_pages"]
    assert "fp8 e4m3" in caplog.text and f"{4 * d / (d + 1):.2f}x the tokens of float32" in caplog.text
    assert isinstance(fp8.runner.kv_caches[0], Fp8KVCache)
    assert fp8.runner.kv_cache_bytes < f32.runner.kv_cache_bytes
    prompts = [[5, 300, 41, 7000, 12, 9], [88, 2, 61, 5, 190, 77, 1000, 3, 4]]
    want = eu.run(_engine(model, "auto", backend, num_pages=32),
                  [(str(i), p, eu.greedy(6)) for i, p in enumerate(prompts)])
    got = eu.run(_engine(model, "fp8", backend, num_pages=32),
                 [(str(i), p, eu.greedy(6)) for i, p in enumerate(prompts)])
    assert [got[str(i)][0].token_ids for i in range(2)] == [want[str(i)][0].token_ids for i in range(2)]


def test_engine_rejects_fp8_on_a_backend_that_cannot_read_it():
    from tests import engine_utils as eu

    model = eu.tiny_model(eu.load_vocab())
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not readable by attention_backend 'tpu'"):
        _engine(model, "fp8", "tpu", num_pages=8)
    assert jax.default_backend() == "cpu"
