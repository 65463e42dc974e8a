"""Weight-only quantization (`quantization="int8" | "fp8" | "int4"`).

0. int4: uint4 codes with per-group scales and offsets (symmetric and asymmetric grids) round
   trip within half a step, numpy == JAX; its specs (int8 embedding, offsets like scales) and
   format names with group sizes; int4 orbax saves are refused by name.

1. The quantizer: round trips within half a grid step (int8) / fp8's relative precision, numpy
   and JAX agree bit for bit, all-zero channels, bad formats named; group-wise scales beat
   per-channel ones on outlier rows and keep a GGUF Q8_0 tensor's values; `num_groups` picks
   int8 groups of 128 (gcd with K) and fp8 one group.
2. GGUF: block formats requantized row chunk by row chunk equal quantizing the `gguf` library's
   own dequantization; Q8_0 / Q4_0 rows whose block scales allow it fold exactly (bit for bit
   the library's values); a tiny GGUF loads quantized through the model loader; one of Q4_0 /
   Q4_1 weights and a Q8_0 embedding loads "int4" as "int4-g32", every leaf bit for bit.
3. Specs: a quantized leaf is (data, scale), the scale's contraction axis cut to G groups (named
   like the weight's when G > 1, replicated when G = 1; MoE experts G = 1); abstract trees,
   shardings and random init follow; groups a mesh cannot split are named at load. The tiny
   models' K is below 128, so `small_groups` sets groups of 16 to run the model tests grouped.
4. The model: int8 / fp8 logits stay within a bound of the float logits on tiny dense and MoE
   families and DeepSeek (MLA; its HF tensors quantize at load like the device quantizer, and its
   latent cache refuses kv_cache_dtype='fp8' by name); the compiled CPU kernel on int8 weights equals XLA's dot on them; sharded quantized
   params on a virtual mesh equal one device; an orbax round trip keeps them bit for bit, and a
   float orbax checkpoint loaded with `quantization=` equals the host quantizer.
5. The lowered step scales after the dot: no weight-sized multiply, the converted weight feeds
   the dot directly (what lets XLA:GPU fuse the convert into the GEMM).
6. The compiled CPU step's temp memory does not grow with the layer count (each layer's converted
   weight made when that layer runs, `layers._tie`), int8 and int4.
"""

from __future__ import annotations

import dataclasses
import re

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from checkpoints import quantize as qlib
from checkpoints.gguf import read_gguf
from checkpoints.orbax_io import restore_params, save_params
from jaxinfer import layers, quantization
from jaxinfer import params as params_lib
from jaxinfer import sharding as shd
from jaxinfer.config import EngineConfig, ModelConfig
from jaxinfer.convert import convert
from jaxinfer.loader import load_from_source, load_model
from jaxinfer.model_info import open_source
from jaxinfer.models import deepseek, family_of, llama
from jaxinfer.quantization import QArray
from jaxinfer.tokenizer import Tokenizer
from pallas_kernels.linear import cpu as cpu_linear
from tests.model_utils import PagedStepper, hf_config_dict, rel_err
from tests.script_utils import script

T = gguf.GGMLQuantizationType
# Max logit error relative to the logit scale, quantized vs float, on the tiny random families at
# init scale (measured 2026-11-25: int8 <= 0.016, fp8 <= 0.058; random weights amplify weight
# error layer after layer, so these bound the tiny models, not real checkpoints: see
# scripts/eval_quant.py and BENCHMARKS.md for the default model).
BOUND = {"int8": 0.03, "fp8": 0.1, "int4": 0.25}
# Tiny models that amplify weight error more, measured 2026-11-25: DeepSeek chains more quantized
# matrices per layer (q_a, q_b, kv_a, o, shared and routed experts; v3 int8 <= 0.026, fp8 <= 0.105),
# Gemma 3's tiny config int8 <= 0.035, fp8 <= 0.116.
# int4 (2026-11-25, default / small groups): llama-likes <= 0.19, DeepSeek <= 0.2, Gemma 2 / 3 0.39
# / 0.37 (their tiny configs amplify most).
WIDE_BOUND = {"int8": 0.045, "fp8": 0.15, "int4": 0.45}
# Mixtral's tiny router flips a top-2 choice under int8 noise on some random draws (2026-11-26,
# small groups, seeds 0-2 of the weights: int8 0.008-0.045 before and after the fused QKV leaf).
FAMILY_BOUND = {
    "mixtral": {**BOUND, "int8": 0.06},
    "gemma2": WIDE_BOUND,
    "gemma3": WIDE_BOUND,
    "deepseek_v2": WIDE_BOUND,
    "deepseek_v3": WIDE_BOUND,
}


def test_round_trip_int8_and_fp8():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 3, 40)).astype(np.float32)
    w[:, 1, 7] = 0.0  # an all-zero output channel
    for fmt in ("int8", "fp8"):
        data, scale = qlib.quantize(w, fmt, axis=0)
        assert data.dtype == qlib.STORAGE[fmt] and data.shape == w.shape
        assert scale.dtype == np.float32 and scale.shape == (1, 3, 40)
        assert scale[0, 1, 7] == 1.0 and not np.any(data[:, 1, 7].astype(np.float32))
        back = qlib.dequantize(data, scale, axis=0)
        err = np.abs(back - w)
        if fmt == "int8":
            assert np.all(err <= 0.5 * scale + 1e-7)
            assert np.abs(data.astype(np.int32)).max() == 127
        else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 (normal range)
            assert np.all(err <= 2.0**-4 * np.abs(w) + scale * 2.0**-9)
        jd, js = jax.jit(lambda x, f=fmt: qlib.quantize(x, f, 0, xp=jnp))(w)
        np.testing.assert_array_equal(np.asarray(js), scale)
        np.testing.assert_array_equal(np.asarray(jd).astype(np.float32), data.astype(np.float32))


def test_group_scales_beat_channel_scales_on_outliers():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 48)).astype(np.float32)  # [K, N], contracted over K (axis 0)
    w[rng.choice(256, 6, replace=False)] *= 12.0  # a few outlier input channels
    for fmt in ("int8", "fp8"):
        per_channel = qlib.dequantize(*qlib.quantize(w, fmt, 0), 0)
        data, scale = qlib.quantize(w, fmt, 0, groups=8)
        assert data.dtype == qlib.STORAGE[fmt] and data.shape == w.shape and scale.shape == (8, 48)
        grouped = qlib.dequantize(data, scale, 0)
        assert np.square(grouped - w).sum() < 0.5 * np.square(per_channel - w).sum()
        first = qlib.dequantize(*qlib.quantize(w[:32], fmt, 0), 0)  # group 0 alone, one scale
        np.testing.assert_array_equal(grouped[:32], first)
        jd, js = jax.jit(lambda x, f=fmt: qlib.quantize(x, f, 0, 8, xp=jnp))(w)
        np.testing.assert_array_equal(np.asarray(js), scale)
        np.testing.assert_array_equal(np.asarray(jd).astype(np.float32), data.astype(np.float32))
    with pytest.raises(ValueError, match="24 groups do not divide"):
        qlib.quantize(w, "int8", 0, 24)


@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_round_trip_groups_and_offsets(symmetric):
    """int4: uint4 codes, per-group scale and offset (value = code * scale + offset) within half a
    step of the weight; asymmetric: the group's range over 15 steps from its min; symmetric:
    offset = -8 * scale; scale and offset stored as f16 (the codes chosen against the rounded
    pair); numpy == JAX bit for bit."""
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((256, 24)) + 0.7).astype(np.float32)  # [K, N], skewed positive
    w[:, 3] = 0.0
    data, scale, offset = qlib.quantize4(w, 0, 2, symmetric)
    assert data.dtype == ml_dtypes.uint4 and data.shape == w.shape
    assert scale.shape == offset.shape == (2, 24) and scale[0, 3] == 1.0
    assert scale.dtype == offset.dtype == np.float16
    back = qlib.dequantize(data, scale, 0, offset=offset)
    assert np.all(np.abs(back - w) <= 0.5 * np.repeat(scale, 128, 0) + 1e-6)
    groups = w.reshape(2, 128, 24)
    if symmetric:
        np.testing.assert_allclose(-offset / scale, 8.0, rtol=1e-6)
    else:  # the group's min and range, offset not tied to an integer zero point
        np.testing.assert_array_equal(offset, groups.min(1).astype(np.float16))
        span = groups.max(1) - groups.min(1)
        np.testing.assert_array_equal(scale[:, :3], (span[:, :3] / 15).astype(np.float16))
    jd, js, jo = jax.jit(lambda x: qlib.quantize4(x, 0, 2, symmetric, xp=jnp))(w)
    np.testing.assert_array_equal(np.asarray(js), scale)
    np.testing.assert_array_equal(np.asarray(jo), offset)
    np.testing.assert_array_equal(np.asarray(jd).astype(np.int32), data.astype(np.int32))
    assert qlib.parse_format("int4-g32-sym") == ("int4", 32, True)
    assert qlib.num_groups(576, "int4") == 9 and qlib.num_groups(576, "int4-g32") == 18
    cfg = ModelConfig.from_hf(hf_config_dict("smollm2"))
    specs = llama.param_specs(cfg, quantization="int4-g16")
    assert specs.layers[0].attn.o.data.dtype == jnp.uint4 and specs.embed.data.dtype == jnp.int8
    assert specs.layers[0].attn.o.offset.logical_axes == specs.layers[0].attn.o.scale.logical_axes
    assert specs.layers[0].attn.o.offset.dtype == specs.embed.scale.dtype == jnp.float16
    assert specs.embed.offset is None
    assert quantization.quantization_of(specs) == "int4-g16"
    assert quantization.quantization_of(llama.param_specs(cfg, quantization="int4")) == "int4"


def test_num_groups():
    """int8: one scale per 128 input channels (gcd(K, 128) when K lacks that factor, one group
    below 32 channels); fp8: one per output channel."""
    assert [qlib.num_groups(k, "int8") for k in (576, 1536, 4096, 64, 128, 1000, 96)] == [
        9,
        12,
        32,
        1,
        1,
        1,
        3,
    ]
    assert qlib.num_groups(4096, "fp8") == 1


def test_group_scales_of_gguf_q8_0_blocks_keep_their_values():
    """A Q8_0 block is 32 int8 values (one at +-127) times one scale: int8 groups of 32 along the
    rows hold it again, to f32 rounding of the scale (per-channel scales round it a second time)."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((16, 128)) * rng.uniform(0.1, 3.0, (16, 4)).repeat(32, 1)).astype(
        np.float32
    )
    stored = gguf.quants.dequantize(
        gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
    ).astype(np.float32)
    grouped = qlib.dequantize(*qlib.quantize(stored, "int8", 1, groups=4), 1)
    np.testing.assert_allclose(grouped, stored, rtol=2e-7, atol=0)
    per_channel = qlib.dequantize(*qlib.quantize(stored, "int8", 1), 1)
    assert np.abs(per_channel - stored).max() > 100 * np.abs(grouped - stored).max()


@pytest.mark.parametrize("bad", ["int3", "int4-g7", "fp8-g32", "int8-sym", "FP8", ""])
def test_bad_quantization_is_named(bad):
    with pytest.raises(ValueError, match=f"quantization={bad!r} is not supported"):
        qlib.check_format(bad)
    with pytest.raises(ValueError, match=f"quantization={bad!r} is not supported"):
        EngineConfig(quantization=bad)
    with pytest.raises(ValueError, match=f"quantization={bad!r} is not supported"):
        load_model("/nonexistent/path", quantization=bad)  # fails before the path is looked at


# Byte offsets of the f16 super-block scales (d, dmin) of the K-quants, which the library can
# dequantize but not quantize: their test tensors are random bytes with these set to sane values.
_K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def _stored_bytes(w: np.ndarray, qtype: T) -> np.ndarray:
    if qtype not in _K_SCALES:
        return gguf.quants.quantize(w, qtype)
    rng = np.random.default_rng(int(qtype))
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, block_bytes), dtype=np.uint8)
    for at in _K_SCALES[qtype]:
        d = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)
        raw[:, :, at : at + 2] = d[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(w.shape[0], -1)


@pytest.mark.parametrize(
    "qtype", [T.Q8_0, T.Q4_0, T.Q5_0, T.Q4_1, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
)
def test_gguf_block_formats_requantize_like_the_library(tmp_path, monkeypatch, qtype):
    """Every GGUF block format -> int8 / fp8 with 1 or 2 scales per row: equal to quantizing the
    library's own dequantization of the same bytes (exactly, or exactly folded for symmetric
    formats, group by group); -> int4: Q4_0 / Q4_1 in groups of 32 equal the library's values,
    Q4_K's within the f16 rounding of its sub-block scales and mins, everything else equals
    `quantize4` of them."""
    from tests.test_gguf import _gguf_name, _tiny_hf_weights, _tiny_kv, _write_gguf

    hf = _tiny_hf_weights(seed=3)
    rng = np.random.default_rng(1)
    # 256-wide rows so the K-quants (256-value blocks) fit; 300 rows span two row chunks.
    hf["model.layers.0.mlp.down_proj.weight"] = rng.standard_normal((64, 256)).astype(np.float32)
    tensors = {_gguf_name(n): (w, T.F32) for n, w in hf.items()}
    name = "model.layers.0.mlp.down_proj.weight"
    w = hf[name]
    # Rows 0-31: every 32-block of a 128-column group peaks at the same value (so the symmetric
    # formats give them one block scale) and the two groups' peaks differ by a non-integer ratio:
    # those rows fold exactly with two groups per row, not with one.
    w[:32] *= 0.1
    w[:32, ::32] = np.repeat(np.array([[3.0, 3.0 * 1.37]], np.float32), 4, axis=1)
    tensors[_gguf_name(name)] = (w, qtype)
    kv = _tiny_kv("qwen2")  # qwen2: no Q/K row permutation to undo
    kv["qwen2.feed_forward_length"] = 256
    for n in list(hf):
        if "gate_proj" in n or "up_proj" in n:
            tensors[_gguf_name(n)] = (rng.standard_normal((256, 64)).astype(np.float32), T.F32)
    stored = _stored_bytes(w, qtype)
    quantize = gguf.quants.quantize
    monkeypatch.setattr(
        gguf.quants, "quantize", lambda a, t: stored if t == qtype else quantize(a, t)
    )
    ckpt = read_gguf(_write_gguf(tmp_path / "q.gguf", "qwen2", kv, tensors))
    lib = gguf.quants.dequantize(stored, qtype)
    assert ckpt.quantized("model.norm.weight", "int8") is None  # 1-D: read as float
    assert ckpt.quantized("model.layers.0.self_attn.q_proj.weight", "int8") is None  # stored F32
    for groups in (1, 2, 8):  # int4: 8 groups of 32 keep Q4_0 / Q4_1 / Q4_K, others requantize
        codes, scale, offset = ckpt.quantized(name, "int4", groups)
        assert scale.dtype == offset.dtype == np.float16  # GGUF's own f16 d and m
        back = qlib.dequantize(codes, scale, 1, offset=offset)
        if groups == 8 and qtype in (T.Q4_0, T.Q4_1):
            np.testing.assert_array_equal(back, lib)
        elif groups == 8 and qtype == T.Q4_K:
            # half an f16 ulp of the scale (times codes <= 15) and of the offset, per group
            s32, o32 = (np.abs(x.astype(np.float32)) for x in (scale, offset))
            bound = 2.0**-11 * (15 * s32 + o32) * 1.001 + 1e-7
            err = np.abs(back - lib).reshape(64, 8, 32).max(axis=2)
            assert np.all(err <= bound) and err.max() > 0, (err / bound).max()
        else:
            want = qlib.quantize4(lib, 1, groups)
            np.testing.assert_array_equal(codes.astype(np.int32), want[0].astype(np.int32))
            np.testing.assert_array_equal(scale, want[1])
    for fmt, groups in [(f, g) for f in ("int8", "fp8") for g in (1, 2)]:
        data, scale = ckpt.quantized(name, fmt, groups)
        assert (
            data.dtype == qlib.STORAGE[fmt]
            and data.shape == w.shape
            and scale.shape == (64, groups)
        )
        back = qlib.dequantize(data, scale, axis=1)
        want_d, want_s = qlib.quantize(lib, fmt, axis=1, groups=groups)
        if fmt == "int8" and qtype in (T.Q8_0, T.Q4_0, T.Q5_0):
            d = _block_scales(ckpt, name, 64)  # f32[64, 8]: four blocks of 32 per group of 128
            ints = np.rint(lib.reshape(64, -1, 32) / d[:, :, None]).astype(np.int8)
            folded = qlib.fold_block_scales(
                ints.reshape(64 * groups, -1, 32), d.reshape(64 * groups, -1), fmt
            )[2].reshape(64, groups)  # bool[row, group]
            assert folded[:32].all() == (groups == 2) and not folded[32:].any()
            cols = np.repeat(folded, 256 // groups, axis=1)
            np.testing.assert_array_equal(back[cols], lib[cols])  # folded groups: exact
            np.testing.assert_array_equal(data[~cols], want_d[~cols])
            np.testing.assert_array_equal(scale[~folded], want_s[~folded])
        else:
            np.testing.assert_array_equal(scale, want_s)
            np.testing.assert_array_equal(data.astype(np.float32), want_d.astype(np.float32))


def _block_scales(ckpt, name: str, rows: int) -> np.ndarray:
    """The f16 block scales `d` (bytes 0-1 of every block) of a 32-block tensor as f32[rows, blocks]."""
    entry = ckpt._entries[name]
    raw = np.asarray(ckpt._reader.tensors[entry.index].data).reshape(-1).view(np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[entry.qtype][1])
    return blocks[:, :2].copy().view("<f2").astype(np.float32).reshape(rows, -1)


def test_fold_block_scales_exact_and_refused():
    ints = np.array([[[3, -5], [1, 2]], [[7, 0], [0, 0]], [[1, 1], [100, 1]]], np.int8)
    scales = np.array([[0.5, 1.5], [0.25, 0.0], [0.5, 1.0]], np.float32)
    data, base, exact = qlib.fold_block_scales(ints, scales, "int8")
    assert exact.tolist() == [True, True, False]  # row 2: 100 * 2 overflows int8
    np.testing.assert_array_equal(data[0] * base[0], (ints[0] * scales[0][:, None]).reshape(-1))
    np.testing.assert_array_equal(data[1] * base[1], (ints[1] * scales[1][:, None]).reshape(-1))
    _, _, exact = qlib.fold_block_scales(ints, np.array([[0.5, 0.7]] * 3, np.float32), "int8")
    assert not exact[0]  # 0.7 is no integer multiple of 0.5
    assert qlib.fold_block_scales(ints, scales, "fp8") is None


def test_gguf_loads_quantized(tmp_path, monkeypatch):
    """A tiny llama GGUF (Q/K permuted, mixed block types) through the loader: int8 leaves whose
    values are the float load's within one grid step; fused q/kv and gate/up slots in place."""
    from tests.test_gguf import (
        _gguf_name,
        _permute_like_llama_cpp,
        _tiny_hf_weights,
        _tiny_kv,
        _type_for,
        _write_gguf,
    )

    hf = _tiny_hf_weights()
    tensors = {}
    for name, w in hf.items():
        stored = w
        if ".q_proj." in name:
            stored = _permute_like_llama_cpp(w, 4)
        elif ".k_proj." in name:
            stored = _permute_like_llama_cpp(w, 2)
        qtype = T.Q8_0 if ".k_proj." in name else _type_for(name)
        tensors[_gguf_name(name)] = (stored, qtype)
    path = _write_gguf(tmp_path / "tiny.gguf", "llama", _tiny_kv("llama"), tensors)
    # The tiny file's toy vocabulary is no real tokenizer: only the params are compared.
    monkeypatch.setattr(Tokenizer, "from_gguf_metadata", classmethod(lambda cls, *a, **k: None))
    floats = _load_params(path, "none")
    quant = _load_params(path, "int8")
    assert quantization.quantization_of(quant) == "int8"
    specs = llama.param_specs(ModelConfig.from_hf(read_gguf(path).hf_config()))
    flat_f = jax.tree.leaves(floats)
    flat_q = jax.tree.leaves(quant, is_leaf=quantization.is_quantized)
    flat_s = jax.tree.leaves(specs, is_leaf=params_lib.is_spec)
    for f, q, s in zip(flat_f, flat_q, flat_s, strict=True):
        if s.quant_axis is None:
            np.testing.assert_array_equal(np.asarray(q), np.asarray(f))
            continue
        back = np.asarray(quantization.dequantize(q, s.quant_axis))
        step = qlib.dequantize(np.ones(q.data.shape, np.int8), np.asarray(q.scale), s.quant_axis)
        assert np.all(np.abs(back - np.asarray(f)) <= 0.5 * step + 1e-6)


def test_gguf_q4_blocks_load_exactly_as_int4(tmp_path, monkeypatch):
    """A tiny llama GGUF of Q4_0 / Q4_1 linear weights and a Q8_0 embedding loads "int4" (and
    "gguf", vLLM's name for its own bits) as "int4-g32": every quantized leaf dequantizes to the
    float load bit for bit (Q4 blocks as codes + f16 scale + f16 offset, the Q8_0 embedding as
    int8 groups of 32 with f16 scales); "int4-g128" requantizes."""
    from tests.test_gguf import (
        _gguf_name,
        _permute_like_llama_cpp,
        _tiny_hf_weights,
        _tiny_kv,
        _write_gguf,
    )

    hf = _tiny_hf_weights()
    tensors = {}
    for name, w in hf.items():
        stored, qtype = w, (T.Q4_0 if ".q_proj." in name or "down" in name else T.Q4_1)
        if ".q_proj." in name:
            stored = _permute_like_llama_cpp(w, 4)
        elif ".k_proj." in name:
            stored = _permute_like_llama_cpp(w, 2)
        if "embed_tokens" in name or "lm_head" in name:
            qtype = T.Q8_0
        elif w.ndim == 1:
            qtype = T.F32
        tensors[_gguf_name(name)] = (stored, qtype)
    path = _write_gguf(tmp_path / "q4.gguf", "llama", _tiny_kv("llama"), tensors)
    monkeypatch.setattr(Tokenizer, "from_gguf_metadata", classmethod(lambda cls, *a, **k: None))
    floats = _load_params(path, "none")
    quant = _load_params(path, "int4")
    assert quantization.quantization_of(quant) == "int4-g32"
    # vLLM's name for the file's own bits, and what a GGUF file loads as when nothing is asked
    for asked in ("gguf", None):
        own = _load_params(path, asked)
        for got, want in zip(jax.tree.leaves(own), jax.tree.leaves(quant), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert quantization.quantization_of(floats) is None
    for asked in ("int4", "gguf", None):  # random weights in the groups the real load takes
        dummy = load_model(str(path), quantization=asked, load_format="dummy")
        assert quantization.quantization_of(dummy.params) == dummy.quantization == "int4-g32"
    assert quant.layers[0].attn.qkv.data.dtype == jnp.uint4 and quant.embed.data.dtype == jnp.int8
    # f16 scales and offsets (GGUF's own d and m), also the int8 embedding's under int4
    assert quant.layers[0].attn.qkv.offset.dtype == quant.embed.scale.dtype == jnp.float16
    _assert_dequantizes_to(quant, floats, path)
    # The bytes are the file's own (Q4_1 / Q8_0 blocks: codes + f16 d (+ f16 m), 4-bit codes two
    # per byte as XLA stores them), plus an f16 offset per Q4_0 block (-8 d: int4 always has one).
    # NOTE: no exact layout without entropy coding goes below the file's bytes: the default
    # model's Q4_1 + Q8_0 file is 0.179x of its f32 bytes, which its int4 load reaches.
    reader = gguf.GGUFReader(path)
    q4_0_blocks = sum(int(t.n_elements) // 32 for t in reader.tensors if t.tensor_type == T.Q4_0)
    ours = sum(x.size // 2 if x.dtype == jnp.uint4 else x.nbytes for x in jax.tree.leaves(quant))
    assert ours == sum(int(t.n_bytes) for t in reader.tensors) + 2 * q4_0_blocks
    coarse = _load_params(path, "int4-g128")  # K = 64: one group, requantized from the blocks
    assert coarse.layers[0].attn.o.scale.shape[0] == 1
    back = quantization.dequantize(coarse.layers[0].attn.o, 0)
    assert np.abs(np.asarray(back) - np.asarray(floats.layers[0].attn.o)).max() > 0


def _k_quant_llama(tmp_path, monkeypatch, kinds: dict, default) -> object:
    """A tiny llama GGUF with 256-wide MLP rows (the K-quants' 256-value blocks): each linear
    tensor of the type `kinds` maps a name fragment to (else `default`), Q8_0 embedding and LM
    head, F32 norms; K-quant bytes are random blocks (the library cannot quantize to them)."""
    from tests.test_gguf import (
        _gguf_name,
        _permute_like_llama_cpp,
        _tiny_hf_weights,
        _tiny_kv,
        _write_gguf,
    )

    hf = _tiny_hf_weights()
    rng = np.random.default_rng(5)
    for i in range(2):
        p = f"model.layers.{i}.mlp."
        hf[p + "gate_proj.weight"] = rng.standard_normal((256, 64)).astype(np.float32)
        hf[p + "up_proj.weight"] = rng.standard_normal((256, 64)).astype(np.float32)
        hf[p + "down_proj.weight"] = rng.standard_normal((64, 256)).astype(np.float32)
    tensors = {}
    for name, w in hf.items():
        qtype = next((t for k, t in kinds.items() if k in name), default)
        if "embed_tokens" in name or "lm_head" in name:
            qtype = T.Q8_0
        elif w.ndim == 1:
            qtype = T.F32
        heads = 4 if ".q_proj." in name else 2 if ".k_proj." in name else 0
        tensors[_gguf_name(name)] = (_permute_like_llama_cpp(w, heads) if heads else w, qtype)
    quantize = gguf.quants.quantize
    monkeypatch.setattr(
        gguf.quants, "quantize", lambda a, t: _stored_bytes(a, t) if t in _K_SCALES else quantize(a, t)
    )  # fmt: skip
    monkeypatch.setattr(Tokenizer, "from_gguf_metadata", classmethod(lambda cls, *a, **k: None))
    kv = _tiny_kv("llama", **{"llama.feed_forward_length": 256})
    return _write_gguf(tmp_path / "k.gguf", "llama", kv, tensors)


def test_gguf_q4_k_file_keeps_its_sub_blocks_as_int4_groups(tmp_path, monkeypatch):
    """A Q4_K_M-like llama GGUF (Q4_K and Q4_0 / Q4_1 linear weights, one Q6_K down projection,
    Q8_0 embedding and LM head) loads "int4" as "int4-g32": Q4_K's sub-blocks of 32 are groups
    (codes as stored; d * sc and dmin * m rounded once to f16), the Q4 blocks exact, the Q6_K
    tensor requantized to 4 bits in groups of 32 (named by `int4_requantized`)."""
    kinds = {"layers.0.mlp.down": T.Q4_K, "layers.1.mlp.down": T.Q6_K, "up_proj": T.Q4_1}
    path = _k_quant_llama(tmp_path, monkeypatch, kinds, T.Q4_0)
    assert read_gguf(path).int4_requantized() == ["model.layers.1.mlp.down_proj.weight"]
    assert read_gguf(path).native_int8_groups() is None  # Q4_1 / Q4_K have mins
    assert read_gguf(path).native_int4_share() > 0.5  # so "gguf" loads it as int4 too
    floats = _load_params(path, "none")
    quant = _load_params(path, "int4")
    assert quantization.quantization_of(quant) == "int4-g32"
    deq = lambda q: np.asarray(quantization.dequantize(q, 0))  # noqa: E731
    # Q4_K: within half an f16 ulp of each group's scale (times codes <= 15) and offset
    q4k, want = quant.layers[0].mlp.down, np.asarray(floats.layers[0].mlp.down)
    s32, o32 = (np.abs(np.asarray(x, np.float32)) for x in (q4k.scale, q4k.offset))  # [8, 64]
    bound = 2.0**-11 * (15 * s32 + o32) * 1.001 + 1e-7
    err = np.abs(deq(q4k) - want).reshape(8, 32, 64).max(axis=1)
    assert np.all(err <= bound) and err.max() > 0
    # Q6_K: 4-bit codes in groups of 32 of its values, within half a step
    q6k, want = quant.layers[1].mlp.down, np.asarray(floats.layers[1].mlp.down)
    step = np.repeat(np.asarray(q6k.scale, np.float32), 32, axis=0)
    assert np.all(np.abs(deq(q6k) - want) <= 0.5 * step * 1.001 + 1e-6)
    np.testing.assert_array_equal(deq(quant.layers[0].mlp.gate_up), floats.layers[0].mlp.gate_up)
    np.testing.assert_array_equal(deq(quant.layers[1].attn.qkv), floats.layers[1].attn.qkv)


def test_gguf_symmetric_blocks_load_exactly_as_int8(tmp_path, monkeypatch):
    """A GGUF of symmetric blocks only (Q6_K down projections, Q5_0 / Q4_0 / Q8_0 elsewhere)
    loads "int8" as "int8-g16" (Q6_K's sub-blocks of 16; the 32-value blocks split in two
    groups of one scale): every quantized leaf dequantizes to the float load bit for bit."""
    kinds = {"down": T.Q6_K, "up_proj": T.Q5_0, "gate_proj": T.Q4_0}
    path = _k_quant_llama(tmp_path, monkeypatch, kinds, T.Q8_0)
    assert read_gguf(path).native_int8_groups() == 16
    floats = _load_params(path, "none")
    quant = _load_params(path, "int8")
    assert quantization.quantization_of(quant) == "int8-g16"
    # "gguf" (its own bits): int8 too, its one Q4_0 tensor a minority of the layers' values
    assert read_gguf(path).native_int4_share() < 0.5
    assert quantization.quantization_of(_load_params(path, "gguf")) == "int8-g16"
    _assert_dequantizes_to(quant, floats, path)
    coarse = _load_params(path, "int8-g128")  # asked for: Q6_K's 16 sub-block scales fold rarely
    back = quantization.dequantize(coarse.layers[0].mlp.down, 0)
    assert np.abs(np.asarray(back) - np.asarray(floats.layers[0].mlp.down)).max() > 0


def _assert_dequantizes_to(quant, floats, path) -> None:
    """Every leaf of the quantized load dequantizes to the float load's, bit for bit."""
    specs = llama.param_specs(ModelConfig.from_hf(read_gguf(path).hf_config()))
    leaves = zip(
        jax.tree.leaves(floats),
        jax.tree.leaves(quant, is_leaf=quantization.is_quantized),
        jax.tree.leaves(specs, is_leaf=params_lib.is_spec),
        strict=True,
    )
    for f, q, s in leaves:
        got = q if s.quant_axis is None else quantization.dequantize(q, s.quant_axis)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(f))


def _load_params(path, fmt):
    kind, handle = open_source(str(path))
    return load_from_source(str(path), kind, handle, quantization=fmt).params


@pytest.fixture
def small_groups(monkeypatch):
    """int8 scales per 16 input channels (the tiny models' K of 64-128 are below the real 128):
    G = 4 for K = 64, 8 for K = 128, divisible by 4 shards of a contraction axis."""
    monkeypatch.setitem(qlib.GROUP_SIZE, "int8", 16)
    monkeypatch.setitem(qlib.GROUP_SIZE, "int4", 16)
    monkeypatch.setattr(qlib, "MIN_GROUP", 16)


def test_specs_declare_data_and_scale(monkeypatch):
    cfg = ModelConfig.from_hf(hf_config_dict("mixtral"))
    specs = llama.param_specs(cfg, quantization="int8")
    q = specs.layers[0].attn.qkv  # [E, Hkv, G+2, D]: 2 KV groups of 2 query heads, K, V
    assert isinstance(q, QArray) and q.data.dtype == jnp.int8 and q.data.shape == (64, 2, 4, 16)
    assert q.scale.shape == (1, 2, 4, 16)
    assert q.scale.logical_axes == (None, "kv_heads", None, None)
    e = specs.embed
    assert e.scale.shape == (cfg.vocab_size, 1) and e.scale.logical_axes == ("vocab", None)
    gu = specs.layers[0].mlp.gate_up
    assert gu.scale.shape == (8, 1, 2, 64) and gu.scale.logical_axes == (
        "experts",
        None,
        None,
        "expert_mlp",
    )
    monkeypatch.setitem(qlib.GROUP_SIZE, "int8", 32)  # groups of 32 of the tiny K = 64
    grouped = llama.param_specs(cfg, quantization="int8")
    assert grouped.layers[0].attn.qkv.scale.shape == (2, 2, 4, 16)
    assert grouped.layers[0].attn.o.scale.logical_axes == (
        "q_heads",
        "embed",
    )  # split like o's rows
    assert grouped.embed.scale.shape == (cfg.vocab_size, 2)
    assert grouped.embed.scale.logical_axes == ("vocab", "embed")
    assert grouped.layers[0].mlp.gate_up.scale.shape == (8, 1, 2, 64)  # experts: per channel
    fp8 = llama.param_specs(cfg, quantization="fp8")
    assert fp8.layers[0].attn.qkv.scale.shape == (1, 2, 4, 16)
    assert not isinstance(specs.layers[0].mlp.router, QArray)  # the router stays float
    assert not isinstance(specs.final_norm, QArray)
    assert quantization.quantization_of(specs) == "int8"
    assert quantization.quantization_of(llama.param_specs(cfg)) is None
    params = params_lib.init_random(llama.param_specs(cfg, quantization="fp8"), jax.random.key(0))
    assert quantization.quantization_of(params) == "fp8"
    data = np.asarray(params.layers[0].attn.qkv.data).astype(np.float32)
    assert np.isfinite(data).all() and data.std() > 0.5
    ints = params_lib.init_random(specs, jax.random.key(0)).layers[0].attn.qkv.data
    assert np.abs(np.asarray(ints, np.int32)).max() <= 127


# NOTE: the fewest layers that keep each kind of layer (half the program size): Gemma 2 one
# sliding-window and one global layer, Gemma 3 two sliding and its global one, Qwen3-MoE a sparse
# and its dense (mlp_only_layers=[1]) layer, DeepSeek its dense first layer and one MoE layer.
# The errors stay within the same bounds (measured at these sizes).
FEWER_LAYERS = {"gemma2": 2, "gemma3": 3, "qwen3_moe": 2, "deepseek_v2": 2, "deepseek_v3": 2}


def _family_params(family: str, fmt: str | None, mult: float = 6.0, layers: int | None = None):
    """A tiny family's random params (times `mult`: 6 puts logits far from flat), quantized;
    `layers`: fewer decoder layers than its tiny config's."""
    hf = hf_config_dict(family)
    cfg = ModelConfig.from_hf({**hf, "num_hidden_layers": layers or hf["num_hidden_layers"]})
    specs = family_of(cfg).param_specs(cfg)
    params = params_lib.init_random(specs, jax.random.key(0))
    params = jax.tree.map(lambda x: x * mult, params)
    return cfg, quantization.quantize_params(params, specs, fmt)


def _dequantized(cfg: ModelConfig, params):
    """The float params holding exactly the values a quantized tree represents."""
    return jax.tree.map(
        lambda s, x: quantization.dequantize(x, s.quant_axis) if isinstance(x, QArray) else x,
        family_of(cfg).param_specs(cfg),
        params,
        is_leaf=params_lib.is_spec,
    )


_FORWARDS: dict[tuple[str, str], object] = {}


def _forward_jit(family, linear_backend: str):
    """One jitted forward per (family, linear backend) for the whole module: float, quantized and
    dequantized params of one family share its in-memory programs (a float run and a dequantized
    run trace and compile once, not once per `_run`)."""
    key = (family.__name__, linear_backend)
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(
            lambda p, c, s, kv: family.forward(p, c, s, kv, linear_backend=linear_backend),
            static_argnames=("c",),
        )
    return _FORWARDS[key]


def _run(params, cfg, linear_backend="xla") -> list[np.ndarray]:
    # NOTE: the "cpu" backend's decode step runs 8 rows, the kernel's few-row path (16 would
    # take XLA's dot and compare XLA with XLA)
    few = 8 if linear_backend == "cpu" else 16
    stepper = PagedStepper(params, cfg, page_size=4, num_pages=64, seed=1, min_tokens=few)
    family = family_of(cfg)
    orig = family.forward_jit
    family.forward_jit = _forward_jit(family, linear_backend)
    try:
        out = [np.concatenate(stepper.step([(0, [3, 17, 101, 9, 44, 250, 7]), (1, [88, 2, 61])]))]
        out.append(np.concatenate(stepper.step([(0, [5]), (1, [6])])))  # a decode step
    finally:
        family.forward_jit = orig
    return out


@pytest.mark.parametrize(
    "family",
    ["smollm2", "mixtral", "deepseek_v3"]
    + [
        pytest.param(f, marks=pytest.mark.slow)
        for f in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "qwen3_moe", "deepseek_v2")
    ],
)
@pytest.mark.parametrize("groups", ["default", "small"])
def test_quantized_logits_within_bound_of_float(family, groups, request):
    """Quantized math == the float model on the dequantized weights (1e-4: scales applied after
    the dot change only the rounding), and within `BOUND` (`FAMILY_BOUND`) of the float model;
    with the tiny models' default (one group) and with int8 groups of 16."""
    if groups == "small":
        request.getfixturevalue("small_groups")
    layers = FEWER_LAYERS.get(family)
    cfg, ref = _family_params(family, None, mult=1.0, layers=layers)
    want = _run(ref, cfg)
    for fmt in qlib.FORMATS:
        _, params = _family_params(family, fmt, mult=1.0, layers=layers)
        k = params.layers[0].attn.o.data.shape[0]
        want_groups = k // 16 if groups == "small" and fmt != "fp8" else 1
        assert params.layers[0].attn.o.scale.shape[0] == want_groups
        got = _run(params, cfg)
        errs = [rel_err(g, w) for g, w in zip(got, want)]
        assert 0 < max(errs) <= FAMILY_BOUND.get(family, BOUND)[fmt], (family, fmt, errs)
        exact = _run(_dequantized(cfg, params), cfg)
        assert max(rel_err(g, w) for g, w in zip(got, exact)) <= 1e-4, (family, fmt)


def test_deepseek_hf_tensors_quantize_at_load_and_fp8_latent_cache_is_refused():
    """DeepSeek through the family dispatch: its HF tensors quantized on the host as they are read
    (kv_a's permuted columns, fused gate/up slots, experts) equal quantizing the float load on
    device; w_uk / w_uv, norms and the router stay float; kv_cache_dtype='fp8' is refused by name
    (the latent cache is kept in the model dtype)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from jaxinfer.engine.core import EngineCore
    from tests.model_utils import make_hf_model

    model, _ = make_hf_model("deepseek_v3")
    cfg = ModelConfig.from_hf(hf_config_dict("deepseek_v3"))
    sd = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    floats = deepseek.params_from_hf(cfg, sd.keys(), sd.__getitem__)
    want = quantization.quantize_params(floats, deepseek.param_specs(cfg), "int8")
    got = deepseek.params_from_hf(cfg, sd.keys(), sd.__getitem__, quantization="int8")
    moe_layer = got.layers[-1]
    assert isinstance(moe_layer.attn.kv_a, QArray) and isinstance(moe_layer.mlp.gate_up, QArray)
    assert isinstance(moe_layer.shared.down, QArray) and isinstance(got.lm_head, QArray)
    assert not isinstance(moe_layer.attn.w_uk, QArray) and not isinstance(
        moe_layer.mlp.router, QArray
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype
        # NOTE: host and device divisions may round a value on a half step differently.
        exact = a.dtype != jnp.int8
        np.testing.assert_allclose(
            np.asarray(a, np.float32),
            np.asarray(b, np.float32),
            rtol=1e-6 if exact else 0,
            atol=0 if exact else 1,
        )
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported for deepseek_v3"):
        EngineCore(
            cfg,
            got,
            EngineConfig(
                page_size=4,
                num_pages=16,
                max_model_len=32,
                max_num_seqs=2,
                max_num_batched_tokens=8,
                kv_cache_dtype="fp8",
            ),
        )


@pytest.mark.skipif(not cpu_linear.available(), reason="the CPU linear kernel does not build here")
@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "smollm2"])
@pytest.mark.parametrize("groups", ["default", "small"])
def test_cpu_kernel_on_int8_matches_xla(
    family, groups, request
):  # untied head; tied (transposed) head
    if groups == "small":
        request.getfixturevalue("small_groups")
    cfg, params = _family_params(family, "int8")
    for w, g in zip(_run(params, cfg, "xla"), _run(params, cfg, "cpu")):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5 * np.abs(w).max())


def test_dense_uses_the_kernel_for_int8_only_on_few_float32_rows():
    fp8 = QArray(jnp.ones((64, 2, 48), jnp.float8_e4m3fn), jnp.ones((1, 2, 48), jnp.float32))
    text = (
        jax.jit(lambda x, w: layers.dense(x, w, backend="cpu"))
        .lower(jnp.ones((1, 64)), fp8)
        .as_text()
    )
    assert cpu_linear.KERNEL.target not in text  # fp8 weights take XLA's dot on the CPU
    # NOTE: "cpu" reaches `dense` only once `resolve_linear_backend` has built the kernel (it
    # raises otherwise); without AVX2 + FMA there is no kernel whose use to check.
    if not cpu_linear.available():
        pytest.skip(f"the CPU linear kernel is unavailable: {cpu_linear.unavailable_reason()}")
    q = QArray(jnp.ones((64, 2, 48), jnp.int8), jnp.ones((1, 2, 48), jnp.float32))
    for t, dtype, want in [
        (1, jnp.float32, True),
        (8, jnp.float32, True),
        (9, jnp.float32, False),
        (4, jnp.bfloat16, False),
    ]:
        x = jnp.ones((t, 64), dtype)
        text = jax.jit(lambda x, w: layers.dense(x, w, backend="cpu")).lower(x, q).as_text()
        assert (cpu_linear.KERNEL.target in text) == want, (t, dtype)
    for n, want in [(48, True), (47, False)]:  # int4 codes [K, N] as stored (packed: N even)
        i4 = QArray(
            jnp.ones((64, n), jnp.uint4),
            jnp.ones((4, n), jnp.float16),
            jnp.ones((4, n), jnp.float16),
        )
        text = (
            jax.jit(lambda x, w: layers.dense(x, w, backend="cpu"))
            .lower(jnp.ones((1, 64)), i4)
            .as_text()
        )
        assert (cpu_linear.KERNEL.target in text) == want, n
    for groups, want in [(2, True), (4, True), (8, False)]:  # the kernel's groups are 16k channels
        g = QArray(jnp.ones((64, 2, 48), jnp.int8), jnp.ones((groups, 2, 48), jnp.float32))
        text = (
            jax.jit(lambda x, w: layers.dense(x, w, backend="cpu"))
            .lower(jnp.ones((1, 64)), g)
            .as_text()
        )
        assert (cpu_linear.KERNEL.target in text) == want, groups


@pytest.mark.parametrize("fmt", qlib.FORMATS)
def test_scales_apply_after_the_dot(fmt):
    """Lowered HLO of a quantized dense: the stored weight is converted straight into the dot (the
    pattern XLA:GPU fuses into its GEMM) and every multiply has the output's shape, never the
    weight's: no scaled weight copy is built."""
    x = jnp.ones((16, 512), jnp.bfloat16)
    q = QArray(jnp.ones((512, 1024), quantization.STORAGE[fmt]), jnp.ones((1, 1024), jnp.float32))
    text = jax.jit(lambda x, w: layers.dense(x, w)[0]).lower(x, q).as_text()
    assert re.search(
        r"stablehlo.convert %arg1 : \(tensor<512x1024x\w+>\) -> tensor<512x1024xbf16>", text
    )
    assert re.search(
        r"dot_general %\w+, %\w+.*tensor<512x1024xbf16>\) -> tensor<16x1024xf32>", text
    )
    multiplies = re.findall(r"stablehlo.multiply .* : tensor<([0-9x]+)x\w+>", text)
    assert multiplies and all(shape == "16x1024" for shape in multiplies), multiplies


def test_group_scales_of_decode_rows_apply_to_partial_sums():
    """Grouped int8 scales (G = 4 of 128 channels) on decode-sized rows: one product per group
    (a dot batched over the groups, on the converted weight), the scales applied to its [T, G, N]
    partial sums: no weight-sized multiply. Prefill-sized rows scale the weight into the dot's
    operand instead (partial sums would outgrow a weight copy). Both equal the dequantized dot."""
    rng = np.random.default_rng(0)
    q = QArray(
        jnp.asarray(rng.integers(-127, 128, (512, 1024)), jnp.int8),
        jnp.asarray(rng.uniform(1e-3, 1e-2, (4, 1024)), jnp.float32),
    )
    weight = quantization.dequantize(q, 0)
    for t, batched in [(16, True), (256, False)]:
        x = jnp.asarray(rng.standard_normal((t, 512)), jnp.float32)
        text = jax.jit(lambda x, w: layers.dense(x, w)[0]).lower(x, q).as_text()
        multiplies = re.findall(r"stablehlo.multiply .* : tensor<([0-9x]+)x\w+>", text)
        weight_sized = [
            m for m in multiplies if np.prod([int(d) for d in m.split("x")]) == 512 * 1024
        ]
        assert bool(weight_sized) != batched, (t, multiplies)
        assert (
            bool(re.search(r"dot_general .*batching_dims.*tensor<4x128x1024x", text)) == batched
        ), t
        ref = x @ weight
        np.testing.assert_allclose(
            layers.dense(x, q)[0], ref, rtol=0, atol=1e-5 * np.abs(ref).max()
        )
    qt = QArray(q.data.T, q.scale.T)  # the tied-head layout [N, K], scales [N, G]
    for t in (3, 256):
        x = jnp.asarray(rng.standard_normal((t, 512)), jnp.float32)
        ref = x @ weight
        np.testing.assert_allclose(
            layers.dense_transposed(x, qt), ref, rtol=0, atol=1e-5 * np.abs(ref).max()
        )
    rows = layers.embed_rows(qt, jnp.asarray([5, 0, 1023]), jnp.float32)
    np.testing.assert_array_equal(rows, weight.T[np.array([5, 0, 1023])])


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec,family,groups,fmt",
    [
        ("tensor=4", "llama", "default", "int8"),
        ("tensor=4", "llama", "small", "int8"),
        ("expert=2,tensor=2", "mixtral", "small", "int8"),
        ("tensor=4", "llama", "small", "int4"),
    ],
)
def test_sharded_quantized_equals_single_device(spec, family, groups, fmt, request):
    """Also with int8 / int4 groups split over the shards of o_proj's and down_proj's input
    channels (int4: offsets sharded like the scales)."""
    if groups == "small":
        request.getfixturevalue("small_groups")
    from jaxinfer.step import StepInputs
    from tests.test_parallel import _steps, mesh_of

    cfg = ModelConfig.from_hf({**hf_config_dict(family), "num_key_value_heads": 4})
    specs = llama.param_specs(cfg)
    params = quantization.quantize_params(
        jax.tree.map(lambda x: x * 4.0, params_lib.init_random(specs, jax.random.key(0))),
        specs,
        fmt,
    )
    mesh = mesh_of(spec, 4)
    par = shd.Parallel.from_mesh(mesh)
    rules = shd.model_rules(cfg, par)
    qspecs = llama.param_specs(cfg, quantization=fmt)
    sharded = jax.device_put(params, params_lib.shardings(qspecs, mesh, rules))
    qkv = sharded.layers[0].attn.qkv  # whole KV groups per shard, scales alike
    by_group = jax.sharding.PartitionSpec(None, shd.dense_axes(cfg, par), None, None)
    assert qkv.data.sharding.spec == by_group and qkv.scale.sharding.spec == by_group
    o = sharded.layers[0].attn.o.scale
    if fmt == "int4":
        assert sharded.layers[0].attn.o.offset.sharding.spec == o.sharding.spec
    assert o.shape[0] == (4 if groups == "small" else 1)
    assert o.sharding.spec == jax.sharding.PartitionSpec(
        shd.dense_axes(cfg, par) if groups == "small" else None, None
    )
    gshape = (16, 4, 2 * cfg.num_kv_heads, cfg.head_dim)
    caches = tuple(
        jax.device_put(
            jnp.zeros(gshape), jax.sharding.NamedSharding(mesh, llama.kv_cache_spec(cfg, par))
        )
        for _ in range(cfg.num_layers)
    )
    ref_caches = tuple(jnp.zeros(gshape) for _ in range(cfg.num_layers))
    for (arrays,) in _steps(1):
        step = StepInputs(**{k: jnp.asarray(v) for k, v in arrays.items()})
        ref, ref_caches = llama.forward_jit(params, cfg, step, ref_caches)
        got, caches = llama.forward_jit(sharded, cfg, step, caches, mesh=mesh)
        assert rel_err(np.asarray(got), np.asarray(ref)) <= 1e-4


def test_orbax_round_trip_and_float_checkpoint_quantized_at_load(tmp_path):
    cfg, floats = _family_params("smollm2", None)
    specs = llama.param_specs(cfg)
    with pytest.raises(ValueError, match="quantization='int4'.*cannot be saved to orbax"):
        convert(None, tmp_path / "int4", quantization="int4")
    for fmt in ("int8", "fp8"):
        params = quantization.quantize_params(floats, specs, fmt)
        save_params(tmp_path / fmt, params)
        target = params_lib.abstract(llama.param_specs(cfg, quantization=fmt), shd.make_mesh(None))
        back = restore_params(tmp_path / fmt, target)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(
                np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32)
            )
    # Host quantizer (HF/GGUF loads) == device quantizer (float orbax checkpoints + quantization=).
    host_d, host_s = qlib.quantize(np.asarray(floats.layers[1].mlp.down), "fp8", 0)
    dev = quantization.quantize_params(floats, specs, "fp8").layers[1].mlp.down
    np.testing.assert_array_equal(np.asarray(dev.scale), host_s)
    assert np.asarray(dev.data).view(np.uint8).tobytes() == host_d.view(np.uint8).tobytes()
    assert dev.data.dtype == ml_dtypes.float8_e4m3fn


def test_orbax_round_trip_of_grouped_int8(tmp_path, small_groups):
    cfg, floats = _family_params("smollm2", None)
    params = quantization.quantize_params(floats, llama.param_specs(cfg), "int8")
    assert params.layers[0].mlp.down.scale.shape == (8, 64)
    save_params(tmp_path / "g", params)
    back = restore_params(
        tmp_path / "g",
        params_lib.abstract(llama.param_specs(cfg, quantization="int8"), shd.make_mesh(None)),
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    host_d, host_s = qlib.quantize(np.asarray(floats.layers[1].mlp.down), "int8", 0, groups=8)
    np.testing.assert_array_equal(np.asarray(params.layers[1].mlp.down.scale), host_s)
    np.testing.assert_allclose(
        np.asarray(params.layers[1].mlp.down.data, np.int32), host_d, rtol=0, atol=1
    )


@pytest.mark.slow
def test_quantized_engine_greedy_tokens_match_float():
    """The engine end to end on a tiny int8 model: the same whole greedy sequences as its float
    model (they agree on these prompts; a drift that flips any token fails here)."""
    from tests import engine_utils as eu

    tok = eu.load_vocab()
    model = eu.tiny_model(tok)
    specs = llama.param_specs(model.cfg)
    qmodel = dataclasses.replace(
        model, params=quantization.quantize_params(model.params, specs, "int8"), quantization="int8"
    )
    prompts = [[5, 300, 41, 7000, 12, 9], [88, 2, 61, 5, 190, 77, 1000, 3, 4]]
    # NOTE: one token bucket (the 15-token prefill and the decodes): one step program per engine
    _, want = eu.greedy_ids_on_backends(model, prompts, 6, token_buckets=(16,))
    engine, got = eu.greedy_ids_on_backends(qmodel, prompts, 6, token_buckets=(16,))
    assert quantization.quantization_of(engine.runner.params) == "int8"
    assert got == want  # whole sequences


def test_serve_flags_reach_the_core_and_dummy_weights_quantize(tmp_path, capsys):
    """`serve.py --quantization int8 --kv-cache-dtype fp8` travels in `EngineArgs` (plain data,
    picklable for the engine-core process) and builds a core with int8 leaves and an fp8 cache;
    `load_format="dummy"` creates the int8 leaves directly (random grid values, positive scales)."""
    import json
    import pickle

    from pallas_kernels.ragged_paged_attention.reference import Fp8KVCache

    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict("smollm2")))
    serve = script("serve")
    args = serve.build_parser().parse_args(
        [
            "--model",
            str(tmp_path),
            "--load-format",
            "dummy",
            "--quantization",
            "int8",
            "--kv-cache-dtype",
            "fp8",
            "--page-size",
            "4",
            "--num-pages",
            "16",
            "--max-model-len",
            "32",
            "--max-num-seqs",
            "2",
            "--max-num-batched-tokens",
            "8",
        ]
    )
    assert {"quantization", "kv_cache_dtype"} <= set(serve.ENGINE_FLAGS)
    from serving.launch import build_core

    eargs = pickle.loads(pickle.dumps(serve.engine_args(args)))
    core = build_core(eargs)
    assert core.config.quantization == "int8" and core.config.kv_cache_dtype == "fp8"
    assert core.info().quantization == "int8" and core.info().kv_cache_dtype == "fp8"
    assert quantization.quantization_of(core.runner.params) == "int8"
    assert all(isinstance(c, Fp8KVCache) for c in core.runner.kv_caches)
    down = core.runner.params.layers[0].mlp.down
    data = np.asarray(down.data)
    assert data.dtype == np.int8 and np.abs(data).max() == 127 and data.std() > 30
    assert np.all(np.asarray(down.scale) > 0)
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--quantization", "int3"])
    assert "--quantization='int3' is not supported" in capsys.readouterr().err
    for name in ("int4-g32", "int4-sym", "int8-g64", "gptq_marlin", "awq", "gguf", "none"):
        assert serve.build_parser().parse_args(["--quantization", name]).quantization == name


def test_scale_groups_that_do_not_split_over_the_mesh_are_named(monkeypatch):
    from tests.test_parallel import mesh_of

    cfg = ModelConfig.from_hf({**hf_config_dict("llama"), "num_key_value_heads": 4})
    mesh = mesh_of("tensor=4", 4)
    rules = shd.model_rules(cfg, shd.Parallel.from_mesh(mesh))
    quantization.check_group_splits(
        llama.param_specs(cfg, quantization="int8"), mesh, rules
    )  # G = 1
    monkeypatch.setitem(qlib.GROUP_SIZE, "int8", 32)  # o_proj: 2 groups of 32 over 4 shards
    with pytest.raises(
        ValueError, match=r"\.attn\.o has 2 scale groups .* mesh axes \('tensor',\) of size 4"
    ):
        quantization.check_group_splits(llama.param_specs(cfg, quantization="int8"), mesh, rules)


def _step_temp_bytes(fmt: str, num_layers: int, tokens: int) -> tuple[int, int]:
    """(temp bytes, int8/int4 bytes of one decoder layer) of the engine's compiled CPU step program
    of `tokens` rows over abstract weights (compile only, nothing runs)."""
    from jaxinfer.engine.runner import ModelRunner

    hf = {
        **hf_config_dict("llama"),
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": num_layers,
    }
    cfg = ModelConfig.from_hf(hf)
    specs = llama.param_specs(cfg, jnp.float32, fmt)
    params = params_lib.abstract(specs)
    runner = ModelRunner(
        cfg,
        params,
        page_size=16,
        num_pages=8,
        max_model_len=64,
        max_num_seqs=1,
        max_num_batched_tokens=tokens,
        dtype="float32",
        linear_backend="xla",
        token_buckets=(tokens,),
        abstract=True,
    )
    mem = runner.lower(tokens).compile().memory_analysis()
    layer = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params.layers[0]))
    return mem.temp_size_in_bytes, layer


@pytest.mark.parametrize("fmt,tokens", [("int8", 64), ("int4", 128)])
def test_quantized_step_temp_does_not_grow_with_layers(fmt, tokens):
    """XLA:CPU materializes a quantized weight's float copy before a prefill-sized dot; those
    conversions read only parameters, and its scheduler ran all layers' first: temp grew by ~4x a
    layer's codes per layer (35 GB for the 34-layer 4B Gemma 3). `layers._tie` makes each copy wait
    for its layer's input: going from 1 to 3 layers adds less than one layer's codes to the temp.
    (int8 at 64 rows takes the per-group products, int4 at 128 the dequantized dot.)"""
    one, layer = _step_temp_bytes(fmt, 1, tokens)
    three, _ = _step_temp_bytes(fmt, 3, tokens)
    assert three - one < layer, (one, three, layer)
