"""GPTQ and AWQ checkpoints load as int4, 8-bit GPTQ as int8 (`checkpoints.hf_quant`).

1. A tiny random Llama is quantized to 4 bits per group of 32 (f16 scales, integer zero points;
   8-bit: symmetric, zero 128) and packed here from the formats' documented layouts (GPTQ v1:
   qweight packed along the input rows, qzeros minus one along the output columns, g_idx; AWQ
   GEMM: both packed along the output columns in AWQ's interleaved order); each loads through
   `load_model` with no quantization asked, as "int4-g32" ("int8-g32").
2. Every packed linear dequantizes to the packer's (code - zero) * scale up to the f16 rounding
   of its offset -zero * scale (int4 stores scales and offsets as f16: the scale is exact, the
   offset off by at most 2^-11 of itself, <= 1/128 of a quantization step; int8 exactly), and the
   model's logits equal the float model on its dequantized weights (the embedding is int8 on
   both sides) within 1e-4.
3. Anything else in `quantization_config` is refused by name, and so is an act-order g_idx whose
   groups are not consecutive rows and an 8-bit zero point that leaves codes outside int8.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from checkpoints.errors import CheckpointError
from checkpoints.hf_quant import AWQ_ORDER
from jaxinfer import params as params_lib
from jaxinfer import quantization
from jaxinfer.loader import load_model
from jaxinfer.models import llama
from tests.model_utils import make_hf_model, rel_err
from tests.test_quantization import _dequantized, _run

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize(w_kn: np.ndarray, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes u8[K, N], zeros u8[G, N], scales f16[G, N] per group of GROUP rows: 4 bits a min/max
    grid, 8 bits a symmetric one (zero 128, as GPTQ's sym=True)."""
    k, n = w_kn.shape
    g = w_kn.reshape(k // GROUP, GROUP, n)
    top = (1 << bits) - 1
    if bits == 8:
        scale = (np.abs(g).max(1) / 127).astype(np.float16)
        zero = np.full(scale.shape, 128.0, np.float32)
    else:
        lo, hi = np.minimum(g.min(1), 0), np.maximum(g.max(1), 0)
        scale = ((hi - lo) / top).astype(np.float16)
        zero = np.clip(np.rint(-lo / scale.astype(np.float32)), 0, top)
    s = scale.astype(np.float32)
    codes = np.clip(np.rint(g / s[:, None]) + zero[:, None], 0, top).reshape(k, n)
    return codes.astype(np.uint8), zero.astype(np.uint8), scale


def _pack(values: np.ndarray, axis: int, order=tuple(range(8)), bits: int = 4) -> np.ndarray:
    """i32 words of 32 / bits fields along `axis`: slot i of word j holds entry f j + order[i]."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)[..., list(order)[:per]]
    words = (v << (bits * np.arange(per, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def _write(root, config: dict, sd: dict, method: str, bits: int = 4, **qc) -> dict:
    """The packed checkpoint in `root`; returns the dequantized f32 [out, in] of each linear."""
    tensors, dequantized = {}, {}
    for name, w in sd.items():
        base = name.removesuffix(".weight")
        if not any(f".{p}." in name for p in LINEARS):
            tensors[name] = w
            continue
        codes, zero, scale = _quantize(w.T, bits)
        deq = (codes.reshape(-1, GROUP, codes.shape[1]).astype(np.float32) - zero[:, None]) * (
            scale.astype(np.float32)[:, None]
        )
        dequantized[name] = deq.reshape(codes.shape).T
        if method == "gptq":
            tensors[base + ".qweight"] = _pack(codes, 0, bits=bits)
            tensors[base + ".qzeros"] = _pack(
                (zero.astype(np.int32) - 1) & ((1 << bits) - 1), 1, bits=bits
            )
            tensors[base + ".g_idx"] = (np.arange(codes.shape[0]) // GROUP).astype(np.int32)
        else:
            tensors[base + ".qweight"] = _pack(codes, 1, AWQ_ORDER)
            tensors[base + ".qzeros"] = _pack(zero, 1, AWQ_ORDER)
        tensors[base + ".scales"] = np.ascontiguousarray(scale)
    extra = {"gptq": {"bits": bits, "desc_act": False}, "awq": {"bits": bits, "version": "gemm"}}
    qconf = {"quant_method": method, "group_size": GROUP, **extra[method], **qc}
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": qconf}))
    save_file(tensors, str(root / "model.safetensors"))
    return dequantized


@pytest.fixture(scope="module")
def tiny():
    model, config = make_hf_model("llama", intermediate_size=128)
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return config.to_dict(), sd


@pytest.mark.parametrize("method,bits", [("gptq", 4), ("awq", 4), ("gptq", 8)])
def test_packed_checkpoint_loads_quantized_and_matches_its_dequantized_weights(
    tmp_path, tiny, method, bits
):
    config, sd = tiny
    dequantized = _write(tmp_path, config, sd, method, bits)
    fmt = "int8-g32" if bits == 8 else "int4-g32"
    loaded = load_model(str(tmp_path), skip_tokenizer_init=True)
    assert loaded.quantization == fmt
    params, cfg = loaded.params, loaded.cfg
    assert quantization.quantization_of(params) == fmt
    specs = llama.param_specs(cfg, quantization=fmt)
    layer = params.layers[1]

    def offset_rounding(leaf) -> np.ndarray:  # the bound on |stored - exact| of each value
        if bits == 8:  # int8 codes - zero and the f16 scale widened to f32: exact
            assert leaf.offset is None and leaf.scale.dtype == np.float32
            return np.zeros(leaf.data.shape)
        assert leaf.scale.dtype == leaf.offset.dtype == np.float16
        offset = np.abs(np.asarray(leaf.offset, np.float32))
        return np.repeat(offset, GROUP, axis=0) * 2.0**-11 + 1e-7

    for leaf, name in ((layer.attn.o, "o_proj"), (layer.mlp.down, "down_proj")):
        want = dequantized[
            f"model.layers.1.{'self_attn' if name == 'o_proj' else 'mlp'}.{name}.weight"
        ]
        got = np.asarray(quantization.dequantize(leaf, 0))
        assert np.all(np.abs(got - want.T) <= offset_rounding(leaf)), name
    gu = np.asarray(quantization.dequantize(layer.mlp.gate_up, 0))  # fused [E, 2, F]
    up = dequantized["model.layers.1.mlp.up_proj.weight"].T
    assert np.all(np.abs(gu[:, 1] - up) <= offset_rounding(layer.mlp.gate_up)[:, 1])
    assert jax.tree.structure(params) == jax.tree.structure(
        jax.tree.map(lambda s: 0, specs, is_leaf=params_lib.is_spec)
    )
    got = _run(params, cfg)
    want = _run(_dequantized(cfg, params), cfg)
    assert max(rel_err(g, w) for g, w in zip(got, want)) <= 1e-4


@pytest.mark.parametrize(
    "qc,match",
    [
        ({"quant_method": "bitsandbytes"}, "quant_method='bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "awq", "bits": 8, "version": "gemm"}, "bits=8"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "group_size=-1"),
    ],
)
def test_other_quantization_configs_are_refused_by_name(tmp_path, tiny, qc, match):
    config, sd = tiny
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    save_file({k: v for k, v in sd.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=match):
        load_model(str(tmp_path), skip_tokenizer_init=True)


def test_act_order_groups_that_are_not_consecutive_are_refused(tmp_path, tiny):
    config, sd = tiny
    _write(tmp_path, config, sd, "gptq")
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.g_idx"
    tensors[name] = np.roll(tensors[name], 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="g_idx.*desc_act"):
        load_model(str(tmp_path), skip_tokenizer_init=True)


def test_asymmetric_8bit_zero_points_are_refused_by_name(tmp_path, tiny):
    config, sd = tiny
    _write(tmp_path, config, sd, "gptq", 8)
    from safetensors.numpy import load_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.qzeros"
    tensors[name] = _pack(np.full((4, 64), 9, np.uint8), 1, bits=8)  # zero 10 (v1: stored - 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="down_proj.weight.*zero points leave codes outside"):
        load_model(str(tmp_path), skip_tokenizer_init=True)
