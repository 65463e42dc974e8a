"""Reads a PEFT LoRA checkpoint on the host into our weight layout (no JAX).

1. `adapter_config.json` is checked field by field: `peft_type` LORA, `r`, `lora_alpha`,
   `use_rslora` (scale alpha / sqrt(r) instead of alpha / r); `modules_to_save`, DoRA, LoRA
   biases, `fan_in_fan_out`, per-module rank/alpha patterns and targets outside the attention and
   MLP projections are refused by name.
2. `adapter_model.safetensors` holds `...layers.{i}.{self_attn|mlp}.{q,k,v,o,gate,up,down}_proj.
   lora_{A,B}.weight` (A `[r, in]`, B `[out, r]`); each pair lands on our fused targets (`TARGETS`):
   k/v on `kv` parts 0/1, gate/up on `gate_up` parts 0/1, transposed to A `[in, r]`, B `[r, out]`
   with the scaling folded into B. Any other tensor, a mis-shaped one or a layer out of range is
   refused naming it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxinfer.config import ModelConfig

# HF projection -> (our fused target, part)
MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("q", 0),
    "k_proj": ("kv", 0),
    "v_proj": ("kv", 1),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
TARGETS = ("q", "kv", "o", "gate_up", "down")
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$"
)


class LoRAError(ValueError):
    """A bad adapter or request for one; `field` names what is wrong (e.g. `modules_to_save`)."""

    def __init__(self, message: str, field: str = "lora") -> None:
        super().__init__(message)
        self.field = field


def target_dims(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """Our target -> (in, parts, out) for `cfg`'s dense layers."""
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    return {
        "q": (e, 1, cfg.num_heads * d),
        "kv": (e, 2, cfg.num_kv_heads * d),
        "o": (cfg.num_heads * d, 1, e),
        "gate_up": (e, 2, f),
        "down": (f, 1, e),
    }


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter on the host: `weights[(layer, target)] = (A f32[in, P, r], B f32[P, r, out])`
    (scaling folded into B; a fused target's missing part is zeros)."""

    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_config(path: str, max_lora_rank: int) -> tuple[int, float]:
    """Checks `path/adapter_config.json`; returns (rank, scaling)."""
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"no adapter_config.json in LoRA adapter directory {path!r}", "lora_path")
    with open(cfg_path) as f:
        conf = json.load(f)
    if conf.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {conf.get('peft_type')!r} is not supported (LORA only)")
    for name in ("modules_to_save", "rank_pattern", "alpha_pattern", "layer_replication"):
        if conf.get(name):
            raise LoRAError(f"LoRA adapter field {name}={conf[name]!r} is not supported", name)
    for name in ("use_dora", "fan_in_fan_out"):
        if conf.get(name):
            raise LoRAError(f"LoRA adapter field {name}=true is not supported", name)
    if conf.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter bias={conf['bias']!r} is not supported (none only)", "bias")
    targets = conf.get("target_modules") or []
    if isinstance(targets, list):
        bad = sorted(set(targets) - set(MODULES))
        if bad:
            raise LoRAError(
                f"LoRA target_modules {bad} not supported (only {sorted(MODULES)})",
                "target_modules",
            )
    rank = conf.get("r")
    if not isinstance(rank, int) or rank <= 0:
        raise LoRAError(f"LoRA adapter r={rank!r} must be a positive int", "r")
    if rank > max_lora_rank:
        raise LoRAError(
            f"LoRA adapter rank {rank} exceeds max_lora_rank {max_lora_rank}", "max_lora_rank"
        )
    alpha = float(conf.get("lora_alpha", 8))
    scaling = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
    return rank, scaling


def load_adapter(path: str, cfg: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """The PEFT checkpoint at `path` for a base model of `cfg` (see the module docstring)."""
    from safetensors.numpy import load_file

    rank, scaling = read_config(path, max_lora_rank)
    st_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(st_path):
        raise LoRAError(
            f"no adapter_model.safetensors in LoRA adapter directory {path!r}", "lora_path"
        )
    tensors = load_file(st_path)
    dims = target_dims(cfg)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in MODULES:
            raise LoRAError(f"LoRA adapter tensor {key!r} is not supported", "target_modules")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise LoRAError(
                f"LoRA adapter tensor {key!r}: layer {layer} out of range ({cfg.num_layers})",
                "lora_path",
            )
        pairs.setdefault((layer, m.group(2)), {})[m.group(3)] = value.astype(np.float32)
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for (layer, module), ab in sorted(pairs.items()):
        target, part = MODULES[module]
        d_in, parts, d_out = dims[target]
        name = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {name} lacks lora_{'AB'[('A' in ab)]}", "lora_path")
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise LoRAError(
                f"LoRA adapter {name}: lora_A {a.shape} / lora_B {b.shape}, expected "
                f"{(rank, d_in)} / {(d_out, rank)} for this base model",
                "lora_path",
            )
        if (layer, target) not in weights:
            weights[layer, target] = (
                np.zeros((d_in, parts, rank), np.float32),
                np.zeros((parts, rank, d_out), np.float32),
            )
        wa, wb = weights[layer, target]
        wa[:, part] = a.T
        wb[part] = b.T * np.float32(scaling)
    if not weights:
        raise LoRAError(f"LoRA adapter {path!r} holds no LoRA weights", "lora_path")
    return LoRAAdapter(rank, scaling, weights)
