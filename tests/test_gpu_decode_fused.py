"""The GPU decode step's fused kernels (issue 31), in Pallas interpret mode on CPU.

1. `gpu_decode_qkv.qkv_decode_attention` (RoPE + KV write + attention from the QKV product)
   against the unfused op: RoPE by `layers.apply_rope`, `reference.update_kv_cache`, then the
   reference attention: the written cache bit for bit (NaN-poisoned elsewhere, so a stray read
   or write shows), the output within bf16 rounding; with and without split-K, a sliding window,
   soft-cap and sinks, a group of 3 heads.
2. `rms_norm.gpu.add_rms_norm` against XLA's add and `layers.rms_norm`.
3. A 2-layer llama decode step on the "gpu" backend takes both (the QKV product reaches the
   kernel; residual adds ride in the norms) and matches the "reference" backend's logits and
   caches.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import layers
from jaxinfer.config import ModelConfig
from jaxinfer.models import llama
from jaxinfer.params import init_random
from pallas_kernels.ragged_paged_attention import block_sizes, gpu_decode_qkv, reference
from pallas_kernels.rms_norm import gpu as gpu_norm
from tests.model_utils import PagedStepper, hf_config_dict
from tests.test_kernels import Shape, make_batch

SHAPE = Shape(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=4, num_tokens=4, max_seqs=4)
CASES = {  # name -> (kv_lens, blocks, kwargs, q heads)
    "split": ([30, 5, 17], dict(decode_programs=24), {}, 4),
    "one_split_window": ([31, 1, 9], dict(decode_programs=0), dict(sliding_window=6), 4),
    "softcap_sinks": (
        [25, 17, 3],
        dict(decode_programs=16),
        dict(soft_cap=2.0, sinks=jnp.linspace(-1.0, 2.0, 6)),
        6,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_qkv_decode_matches_rope_write_then_attend(case):
    kv_lens, over, kw, hq = CASES[case]
    shape = dataclasses.replace(SHAPE, num_q_heads=hq)
    blocks = block_sizes.KernelBlocks(block_q=8, decode_block_q=4, **{"pages_per_block": 2, **over})
    _, cache, lens, table, cu, n = make_batch(
        shape, [1] * len(kv_lens), kv_lens, seed=3, dtype=jnp.bfloat16
    )
    t, hkv, g, d = shape.num_tokens, shape.num_kv_heads, hq // shape.num_kv_heads, shape.head_dim
    rng = np.random.default_rng(1)
    qkv = jnp.asarray(rng.standard_normal((t, hkv, g + 2, d)), jnp.bfloat16)
    pos = np.maximum(np.asarray(lens)[:t] - 1, 0)
    live = np.arange(t) < len(kv_lens)
    tbl = np.asarray(table)
    slots = np.where(live, tbl[np.arange(t) % tbl.shape[0], pos // 4] * 4 + pos % 4, -1)
    angles = pos[:, None] * (0.5 ** np.arange(d // 2))[None, :]
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    q = layers.apply_rope(qkv[:, :, :g].reshape(t, hq, d), cos, sin)
    k, v = layers.apply_rope(qkv[:, :, g], cos, sin), qkv[:, :, g + 1]
    want_cache = reference.update_kv_cache(cache, k, v, jnp.asarray(slots, jnp.int32))
    want = reference.ragged_paged_attention(q, want_cache, lens, table, cu, n, sm_scale=0.125, **kw)
    out, new_cache = gpu_decode_qkv.qkv_decode_attention(
        qkv,
        *gpu_decode_qkv.expand_rope(cos, sin),
        cache,
        jnp.asarray(slots, jnp.int32),
        lens,
        table,
        n,
        kw.get("sinks"),
        sm_scale=0.125,
        sliding_window=kw.get("sliding_window"),
        soft_cap=kw.get("soft_cap"),
        interpret=True,
        blocks=blocks,
    )
    assert np.asarray(new_cache).tobytes() == np.asarray(want_cache).tobytes()
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all() and not out[len(kv_lens) :].any()
    np.testing.assert_allclose(out[: len(kv_lens)], want[: len(kv_lens)], rtol=0, atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_add_rms_norm_kernel_matches_xla(dtype):
    kx, ky, kw = jax.random.split(jax.random.PRNGKey(0), 3)
    x, y = (jax.random.normal(k, (3, 128), dtype) for k in (kx, ky))
    w = jax.random.normal(kw, (128,), dtype)
    h, out = gpu_norm.add_rms_norm(x, y, w, 1e-6, 1.0, interpret=True)
    assert np.asarray(h).tobytes() == np.asarray(x + y).tobytes()
    want = layers.rms_norm(x + y, w, 1e-6, 1.0)
    np.testing.assert_allclose(
        np.asarray(out, np.float32),
        np.asarray(want, np.float32),
        rtol=1e-2 if dtype != jnp.float32 else 1e-6,
        atol=1e-6,
    )


def test_llama_gpu_decode_step_takes_the_fused_kernels(monkeypatch):
    cfg = ModelConfig.from_hf({**hf_config_dict("llama"), "num_hidden_layers": 2})
    params = init_random(llama.param_specs(cfg, jnp.bfloat16), jax.random.PRNGKey(0))
    calls = []
    kernel = gpu_decode_qkv.qkv_decode_attention
    monkeypatch.setattr(
        gpu_decode_qkv, "qkv_decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k)
    )
    decode = {"on": False}

    def forward(params, cfg, step, kv_caches, attention_backend="reference"):
        step = step.replace(decode_only=decode["on"])
        return llama.forward(params, cfg, step, kv_caches, attention_backend=attention_backend)

    monkeypatch.setattr(
        llama, "forward_jit", jax.jit(forward, static_argnames=("cfg", "attention_backend"))
    )
    ref = PagedStepper(params, cfg, dtype=jnp.bfloat16, attention_backend="reference", seed=1)
    gpu = PagedStepper(params, cfg, dtype=jnp.bfloat16, attention_backend="gpu", seed=1)
    prompts = [(0, [3, 17, 101, 9, 44]), (1, [88, 2, 61])]
    ref.step(prompts)
    gpu.caches, gpu.pages, gpu.lens, gpu.free = (
        ref.caches,
        dict(ref.pages),
        dict(ref.lens),
        list(ref.free),
    )
    decode["on"] = True
    want = ref.step([(0, [7]), (1, [250])])
    got = gpu.step([(0, [7]), (1, [250])])
    assert len(calls) == cfg.num_layers  # each layer's attention took the fused kernel
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= 2e-2 * np.abs(w).max()
    for c_gpu, c_ref in zip(gpu.caches, ref.caches):
        written = ~np.isnan(np.asarray(c_ref, np.float32))
        np.testing.assert_allclose(
            np.asarray(c_gpu, np.float32)[written],
            np.asarray(c_ref, np.float32)[written],
            atol=3e-2,
        )
