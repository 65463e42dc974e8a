"""GPTQ / AWQ checkpoints packed from the formats' documented layouts, for the tests that load
them (`tests/test_hf_quant.py`) and serve them (`tests/test_served_mesh_quant.py`).

`write_packed(root, config, sd, method, bits, act_order)` quantizes each linear weight of a HF
state dict per group of `GROUP` input channels (GPTQ's act-order: consecutive in a random order
of them; 4 bits: a min/max grid with integer zero points; 8 bits: symmetric, zero 128, as GPTQ's
sym=True), packs it (GPTQ v1: qweight along the input rows, qzeros minus one
along the output columns, g_idx; AWQ GEMM: both along the output columns in AWQ's interleaved
order), writes `config.json` with the `quantization_config` and `model.safetensors`, and returns
the dequantized f32 [out, in] of each linear.
"""

from __future__ import annotations

import json

import numpy as np
from safetensors.numpy import save_file

from checkpoints.hf_quant import AWQ_ORDER

GROUP = 32
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(w_kn: np.ndarray, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def pack(values: np.ndarray, axis: int, order=tuple(range(8)), bits: int = 4) -> np.ndarray:
    """i32 words of 32 / bits fields along `axis`: slot i of word j holds entry f j + order[i]."""
    per = 32 // bits
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], -1, per)[..., list(order)[:per]]
    words = (v << (bits * np.arange(per, dtype=np.uint32))).sum(-1, dtype=np.uint32)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view(np.int32)


def _input_group(name: str) -> str:
    """Linears that read the same input (q / k / v, gate / up) share GPTQ's act-order."""
    for part, group in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj")):
        name = name.replace(part, group)
    return name


def write_packed(
    root, config: dict, sd: dict, method: str, bits: int = 4, act_order: bool = False, **qc
) -> dict:
    """The packed checkpoint in `root`; returns the dequantized f32 [out, in] of each linear.

    `act_order` (GPTQ's desc_act=True): each input's channels are quantized in a random order
    (one order for the linears that read the same input), groups of GROUP consecutive channels of
    that order; qweight keeps the rows in input order and g_idx names each row's group."""
    tensors, dequantized = {}, {}
    for name, w in sd.items():
        base = name.removesuffix(".weight")
        if not any(f".{p}." in name for p in LINEARS):
            tensors[name] = w
            continue
        k = w.shape[1]
        order = np.arange(k)
        if act_order:
            seed = sum(map(ord, _input_group(name)))
            order = np.random.default_rng(seed).permutation(k)
        codes_o, zero, scale = quantize(w.T[order], bits)  # rows in act order
        codes = np.empty_like(codes_o)
        codes[order] = codes_o
        g_idx = np.empty(k, np.int32)
        g_idx[order] = np.arange(k) // GROUP
        deq = (codes.astype(np.float32) - zero[g_idx]) * scale.astype(np.float32)[g_idx]
        dequantized[name] = deq.T
        if method == "gptq":
            tensors[base + ".qweight"] = pack(codes, 0, bits=bits)
            tensors[base + ".qzeros"] = pack(
                (zero.astype(np.int32) - 1) & ((1 << bits) - 1), 1, bits=bits
            )
            tensors[base + ".g_idx"] = g_idx
        else:
            tensors[base + ".qweight"] = pack(codes, 1, AWQ_ORDER)
            tensors[base + ".qzeros"] = pack(zero, 1, AWQ_ORDER)
        tensors[base + ".scales"] = np.ascontiguousarray(scale)
    extra = {
        "gptq": {"bits": bits, "desc_act": act_order},
        "awq": {"bits": bits, "version": "gemm"},
    }
    qconf = {"quant_method": method, "group_size": GROUP, **extra[method], **qc}
    (root / "config.json").write_text(json.dumps({**config, "quantization_config": qconf}))
    save_file(tensors, str(root / "model.safetensors"))
    return dequantized
