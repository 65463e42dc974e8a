"""LoRA on the device: every slot's weights stacked at fixed shapes, applied per token.

1. `empty_stacks(cfg, max_loras, max_lora_rank)` allocates, per layer and target (`adapter.TARGETS`),
   `LoRAPair(a [in, P, N, R], b [P, N, R, out])` of zeros: N = max_loras slots, R = max_lora_rank,
   P = 1 or 2 fused parts (k/v, gate/up). Stored in the layout the contractions want (in leading
   for the shrink, (N, R) contracted for the expand), so nothing is transposed in the step.
2. `write_slot(stacks, slot, adapter)` pads an adapter's host weights to R (zeros: a missing target
   or a lower rank adds nothing) and writes them into slot `slot` (1..N) in one jitted update of
   fixed shapes (new arrays: a step still in flight reads the old ones).
3. `attach(params, stacks)` puts each layer's stacks on `LayerParams.lora`; the model then calls
   `apply(pair, slots, x, y)` right after each dense projection (q and kv on their slices of the
   fused QKV product, `llama.AttentionParams.qkv`): `slots` i32[T] holds each token's
   slot (0 = no adapter), the shrink `x @ A` runs for every slot at once, a one-hot mask keeps each
   token's own slot, the expand contracts (slot, rank) together. Same shapes whatever the mix of
   adapters: 0, 1 or N active adapters run the same compiled program.
4. On a tensor-parallel mesh the stacks are split as their base weight is (`AXES`, `stack_specs`;
   `sharded.forward` adds them to the `shard_map` specs with `attach_specs`): column-split q / kv /
   gate_up keep A replicated and split B along out (with the base weight's output columns; B stays
   replicated where the KV heads are), row-split o / down split A along in and keep B replicated:
   their product is a partial sum, added before the base output's all-reduce.

Einsum legend: t = token, i = in, p = fused part, n = slot, r = rank, o = out.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer.config import ModelConfig
from jaxinfer.lora.adapter import TARGETS, LoRAAdapter, target_dims
from jaxinfer.params import ParamSpec

# target -> logical axes of its (in, out) dims: the base weight's (`llama.param_specs`)
AXES = {
    "q": ("embed", "q_heads"),
    "kv": ("embed", "kv_heads"),
    "o": ("q_heads", "embed"),
    "gate_up": ("embed", "mlp"),
    "down": ("mlp", "embed"),
}


@struct.dataclass
class LoRAPair:
    a: jax.Array  # [in, P, N, R]
    b: jax.Array  # [P, N, R, out]  scaling folded in


LayerStacks = dict[str, LoRAPair]


def empty_stacks(
    cfg: ModelConfig, max_loras: int, max_lora_rank: int, dtype: Any = jnp.float32
) -> tuple[LayerStacks, ...]:
    dims = target_dims(cfg)
    n, r = max_loras, max_lora_rank

    def pair(target: str) -> LoRAPair:
        d_in, p, d_out = dims[target]
        return LoRAPair(jnp.zeros((d_in, p, n, r), dtype), jnp.zeros((p, n, r, d_out), dtype))

    return tuple({t: pair(t) for t in TARGETS} for _ in range(cfg.num_layers))


def stack_specs(stacks: tuple[LayerStacks, ...]) -> tuple[dict[str, LoRAPair], ...]:
    """`ParamSpec` leaves of `stacks` (arrays or shape structs): A split along in, B along out,
    by the base weight's logical axes (`AXES`; the slot, part and rank dims replicated)."""

    def spec(target: str, pair: LoRAPair) -> LoRAPair:
        d_in, d_out = AXES[target]
        return LoRAPair(
            ParamSpec(tuple(pair.a.shape), pair.a.dtype, (d_in, None, None, None), "zeros"),
            ParamSpec(tuple(pair.b.shape), pair.b.dtype, (None, None, None, d_out), "zeros"),
        )

    return tuple({t: spec(t, pair) for t, pair in st.items()} for st in stacks)


def attach_specs(specs: Any, params: Any) -> Any:
    """`specs` (a family's `param_specs` tree) with the LoRA stacks' specs of `params` attached
    (unchanged when `params` carries none)."""
    layers = getattr(params, "layers", None)
    if not layers or getattr(layers[0], "lora", None) is None:
        return specs
    return attach(specs, stack_specs(tuple(layer.lora for layer in layers)))


def slot_weights(stacks: tuple[LayerStacks, ...], adapter: LoRAAdapter | None) -> tuple:
    """The adapter's host weights at one slot's shapes (`[in, P, R]`, `[P, R, out]` per layer and
    target), zero-padded; None: all zeros (a freed slot)."""
    out = []
    for layer, st in enumerate(stacks):
        row = {}
        for target, pair in st.items():
            d_in, p, _, r = pair.a.shape
            a = np.zeros((d_in, p, r), pair.a.dtype)
            b = np.zeros((p, r, pair.b.shape[-1]), pair.b.dtype)
            w = adapter.weights.get((layer, target)) if adapter is not None else None
            if w is not None:
                a[:, :, : w[0].shape[-1]] = w[0]
                b[:, : w[1].shape[1]] = w[1]
            row[target] = LoRAPair(a, b)
        out.append(row)
    return tuple(out)


@jax.jit  # NOTE: not donated: a step still in flight may read the old stacks
def _write(stacks: tuple, index: jax.Array, new: tuple) -> tuple:
    def put(pair: LoRAPair, w: LoRAPair) -> LoRAPair:
        return LoRAPair(
            jax.lax.dynamic_update_index_in_dim(pair.a, w.a.astype(pair.a.dtype), index, 2),
            jax.lax.dynamic_update_index_in_dim(pair.b, w.b.astype(pair.b.dtype), index, 1),
        )

    return jax.tree.map(put, stacks, new, is_leaf=lambda x: isinstance(x, LoRAPair))


def write_slot(
    stacks: tuple[LayerStacks, ...], slot: int, adapter: LoRAAdapter | None
) -> tuple[LayerStacks, ...]:
    """`stacks` with slot `slot` (1..N) holding `adapter` (None: zeros)."""
    n = stacks[0][TARGETS[0]].a.shape[2]
    if not 1 <= slot <= n:
        raise ValueError(f"LoRA slot {slot} out of range 1..{n}")
    return _write(stacks, jnp.int32(slot - 1), slot_weights(stacks, adapter))


def attach(params: Any, stacks: tuple[LayerStacks, ...] | None) -> Any:
    """`params` with each layer's `lora` set to its stacks (None: detached)."""
    layers = params.layers
    stacks = stacks or (None,) * len(layers)
    return params.replace(layers=tuple(p.replace(lora=s) for p, s in zip(layers, stacks)))


def apply(pair: LoRAPair, slots: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    """y [T, ...] (the dense output for x [T, in]) plus each token's adapter product."""
    _, _, n, _ = pair.a.shape
    mask = (slots[:, None] == jnp.arange(1, n + 1, dtype=slots.dtype)).astype(x.dtype)  # [T, N]
    with jax.named_scope("lora"):
        s = jnp.einsum("ti,ipnr->tpnr", x, pair.a) * mask[:, None, :, None]  # shrink
        d = jnp.einsum("tpnr,pnro->tpo", s, pair.b)  # expand
    return y + d.reshape(y.shape).astype(y.dtype)


def adapter_hook(layer_stacks: LayerStacks | None, slots: jax.Array | None):
    """`hook(target, x, y) -> y'` for one layer (None when LoRA is off)."""
    if layer_stacks is None or slots is None:
        return None
    return lambda target, x, y: apply(layer_stacks[target], slots, x, y)
