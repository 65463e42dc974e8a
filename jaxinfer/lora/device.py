"""LoRA on the device: every slot's weights stacked at fixed shapes, one shrink and one expand per
projection input.

1. `empty_stacks(cfg, max_loras, max_lora_rank)` allocates, per layer and input group (`GROUPS`:
   the projections reading one input), `LoRAPair(a [in, P, N, R], b [Q, N, R, *out])` of zeros:
   N = max_loras slots, R = max_lora_rank. The group's A matrices are stacked along P (q/k/v: 3,
   gate/up: 2, o and down: 1) so one product shrinks them all; B holds the Q expand parts in the
   base output's layout: `qkv` is `llama.AttentionParams.qkv`'s `[Hkv, G+2, D]` (G query parts,
   part i holding query heads j*G+i of each KV group j, then K, then V), so the expand adds one
   delta to the fused QKV product before it is split; `gate_up` has Q = 2 parts of F.
2. `write_slot(stacks, slot, adapter)` lays an adapter's host weights out so (`slot_weights`:
   padded to R with zeros, q's B reordered into the G query parts) and writes them into slot
   `slot` (1..N) in one jitted update of fixed shapes (new arrays: a step still in flight reads
   the old ones). Nothing is concatenated per step: the layout is made here, at load time.
3. `attach(params, stacks)` puts each layer's stacks on `LayerParams.lora`; the model then calls
   `apply(pair, slots, x, y)` right after each group's dense product (`qkv` on the fused QKV
   product before its split, `o`, `gate_up`, `down`): `slots` i32[T] holds each token's slot (0 =
   no adapter), the shrink `x @ A` runs for every slot and part at once (XLA merges it into the
   base product's columns where it can), a one-hot mask keeps each token's own slot, the expand
   contracts (slot, rank) per part, batched over the parts, and the add fuses into the consumer.
   Same shapes whatever the mix of adapters: 0, 1 or N active adapters run the same program.
   Beside the GPU attention kernel (`adapter_hook`'s `attention_backend` "gpu": a GPU target, or
   interpret mode when named on the CPU) each group is instead one Pallas launch
   (`pallas_kernels.lora.gpu`: shrink, slot mask, expand and add; at one token down reads
   the gate_up output through its activation, `GATE_ACTS`); the CPU and TPU paths keep the einsums.
4. On a tensor-parallel mesh the stacks are split as their base weight is (`AXES`, `stack_specs`;
   `sharded.forward` adds them to the `shard_map` specs with `attach_specs`): column-split qkv /
   gate_up keep A replicated and split B along out (qkv's by KV group, as the fused weight; B
   stays replicated where the KV heads are), row-split o / down split A along in and keep B
   replicated: their product is a partial sum, added before the base output's all-reduce.

Einsum legend: t = token, i = in, p = shrink part, q = expand part, n = slot, r = rank, o = out,
h = KV group, d = head_dim.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import layers
from jaxinfer.config import ModelConfig
from jaxinfer.lora.adapter import LoRAAdapter
from jaxinfer.params import ParamSpec
from pallas_kernels.lora import gpu as lora_kernel
from pallas_kernels.paged_common import interpret_mode

# input group -> the adapter targets (`adapter.TARGETS`) it stacks, in shrink-part order
GROUPS = {"qkv": ("q", "kv"), "o": ("o",), "gate_up": ("gate_up",), "down": ("down",)}
# activations the GPU kernel computes from the gate_up output itself (erf has no Triton lowering)
GATE_ACTS = ("silu", "gelu_tanh")
# group -> logical axes of A's in dim and of B's out dims (the base weight's, `llama.param_specs`)
AXES = {
    "qkv": ("embed", ("kv_heads", None)),
    "o": ("q_heads", ("embed",)),
    "gate_up": ("embed", ("mlp",)),
    "down": ("mlp", ("embed",)),
}


@struct.dataclass
class LoRAPair:
    a: jax.Array  # [in, P, N, R]
    b: jax.Array  # [Q, N, R, *out]  scaling folded in


LayerStacks = dict[str, LoRAPair]


def group_shapes(cfg: ModelConfig, n: int, r: int) -> dict[str, tuple[tuple, tuple]]:
    """Group -> (A's shape, B's shape) for `n` slots of rank `r`."""
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_heads, cfg.num_kv_heads
    g = hq // hkv
    return {
        "qkv": ((e, 3, n, r), (g + 2, n, r, hkv, d)),
        "o": ((hq * d, 1, n, r), (1, n, r, e)),
        "gate_up": ((e, 2, n, r), (2, n, r, f)),
        "down": ((f, 1, n, r), (1, n, r, e)),
    }


def empty_stacks(
    cfg: ModelConfig, max_loras: int, max_lora_rank: int, dtype: Any = jnp.float32
) -> tuple[LayerStacks, ...]:
    shapes = group_shapes(cfg, max_loras, max_lora_rank)

    def pair(group: str) -> LoRAPair:
        a, b = shapes[group]
        return LoRAPair(jnp.zeros(a, dtype), jnp.zeros(b, dtype))

    return tuple({grp: pair(grp) for grp in GROUPS} for _ in range(cfg.num_layers))


def stack_specs(stacks: tuple[LayerStacks, ...]) -> tuple[dict[str, LoRAPair], ...]:
    """`ParamSpec` leaves of `stacks` (arrays or shape structs): A split along in, B along out,
    by the base weight's logical axes (`AXES`; the slot, part and rank dims replicated)."""

    def spec(group: str, pair: LoRAPair) -> LoRAPair:
        d_in, d_out = AXES[group]
        return LoRAPair(
            ParamSpec(tuple(pair.a.shape), pair.a.dtype, (d_in, None, None, None), "zeros"),
            ParamSpec(tuple(pair.b.shape), pair.b.dtype, (None, None, None, *d_out), "zeros"),
        )

    return tuple({grp: spec(grp, pair) for grp, pair in st.items()} for st in stacks)


def attach_specs(specs: Any, params: Any) -> Any:
    """`specs` (a family's `param_specs` tree) with the LoRA stacks' specs of `params` attached
    (unchanged when `params` carries none)."""
    layers = getattr(params, "layers", None)
    if not layers or getattr(layers[0], "lora", None) is None:
        return specs
    return attach(specs, stack_specs(tuple(layer.lora for layer in layers)))


def _group_weights(group: str, a: np.ndarray, b: np.ndarray, w: dict) -> None:
    """Fills one slot's `a [in, P, R]`, `b [Q, R, *out]` of `group` from the adapter's target
    weights `w` (target -> (A [in, P', r], B [P', r, out])), leaving missing targets zero."""
    if group != "qkv":
        if group in w:
            wa, wb = w[group]
            a[:, :, : wa.shape[-1]] = wa
            b[:, : wb.shape[1]] = wb
        return
    g, hkv, d = b.shape[0] - 2, b.shape[2], b.shape[3]
    if "q" in w:
        wa, wb = w["q"]
        r = wa.shape[-1]
        a[:, 0, :r] = wa[:, 0]
        # q's B [r, Hq*D]: head j*G+i -> part i, KV group j (the fused weight's order)
        b[:g, :r] = wb[0].reshape(r, hkv, g, d).transpose(2, 0, 1, 3)
    if "kv" in w:
        wa, wb = w["kv"]
        r = wa.shape[-1]
        a[:, 1:3, :r] = wa
        b[g:, :r] = wb.reshape(2, r, hkv, d)


def slot_weights(stacks: tuple[LayerStacks, ...], adapter: LoRAAdapter | None) -> tuple:
    """The adapter's host weights at one slot's shapes (`[in, P, R]`, `[Q, R, *out]` per layer
    and group), zero-padded; None: all zeros (a freed slot)."""
    out = []
    for layer, st in enumerate(stacks):
        row = {}
        for group, pair in st.items():
            d_in, p, _, r = pair.a.shape
            a = np.zeros((d_in, p, r), pair.a.dtype)
            b = np.zeros((pair.b.shape[0], r, *pair.b.shape[3:]), pair.b.dtype)
            if adapter is not None:
                w = {
                    t: adapter.weights[layer, t]
                    for t in GROUPS[group]
                    if (layer, t) in adapter.weights
                }
                _group_weights(group, a, b, w)
            row[group] = LoRAPair(a, b)
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
    n = stacks[0]["o"].a.shape[2]
    if not 1 <= slot <= n:
        raise ValueError(f"LoRA slot {slot} out of range 1..{n}")
    return _write(stacks, jnp.int32(slot - 1), slot_weights(stacks, adapter))


def attach(params: Any, stacks: tuple[LayerStacks, ...] | None) -> Any:
    """`params` with each layer's `lora` set to its stacks (None: detached)."""
    layers = params.layers
    stacks = stacks or (None,) * len(layers)
    return params.replace(layers=tuple(p.replace(lora=s) for p, s in zip(layers, stacks)))


def apply(
    pair: LoRAPair,
    slots: jax.Array,
    x: jax.Array,
    y: jax.Array,
    backend: str = "xla",
    gated: tuple[jax.Array, str] | None = None,
) -> jax.Array:
    """y [T, ...] (the group's dense output for x [T, in], in B's out layout) plus each token's
    adapter product; `backend` "gpu": the one-launch Pallas kernel (`pallas_kernels.lora.gpu`,
    interpreted off a GPU target), "xla": the einsums below. `gated` (down only): (the gate_up
    output [T, 2, F], the activation) x was computed from, which the kernel reads instead of x
    (`GATE_ACTS`; other activations read x)."""
    if backend == "gpu":
        with jax.named_scope("lora"):
            interpret = bool(interpret_mode("gpu"))
            # NOTE: the down kernel reads the gate_up output only for one token, where the base
            # product fuses the activation in; a GEMM's input (more tokens) is materialized anyway
            if gated is not None and gated[1] in GATE_ACTS and x.shape[0] == 1:
                act = functools.partial(layers.activation, gated[1])
                return lora_kernel.lora_apply(
                    gated[0], pair.a, pair.b, slots, y, gate_act=act, interpret=interpret
                )
            return lora_kernel.lora_apply(x, pair.a, pair.b, slots, y, interpret=interpret)
    t, (_, p, n, _), q = x.shape[0], pair.a.shape, pair.b.shape[0]
    mask = (slots[:, None] == jnp.arange(1, n + 1, dtype=slots.dtype)).astype(x.dtype)  # [T, N]
    with jax.named_scope("lora"):
        s = jnp.einsum("ti,ipnr->tpnr", x, pair.a) * mask[:, None, :, None]  # shrink
        if q != p:  # qkv: the G query parts all read the q shrink (part 0)
            s = jnp.concatenate([jnp.broadcast_to(s[:, :1], (t, q - 2, *s.shape[2:])), s[:, 1:]], 1)
        if pair.b.ndim == 5:  # qkv: [Q, N, R, Hkv, D] -> y's [T, Hkv, Q, D]
            d = jnp.einsum("tqnr,qnrhd->thqd", s, pair.b)
        else:
            d = jnp.einsum("tqnr,qnro->tqo", s, pair.b)  # expand
    return y + d.reshape(y.shape).astype(y.dtype)


def backend_for(attention_backend: str, in_dims: tuple[int, ...] = ()) -> str:
    """LoRA's backend beside attention backend `attention_backend` (resolved): "gpu" (the Pallas
    kernel) with the GPU attention kernel when every group's input dim (`in_dims`) suits it
    (`pallas_kernels.lora.gpu.supported`), else "xla" (the CPU and TPU paths)."""
    if attention_backend != "gpu":
        return "xla"
    return "gpu" if all(lora_kernel.supported(i) is None for i in in_dims) else "xla"


def adapter_hook(
    layer_stacks: LayerStacks | None, slots: jax.Array | None, attention_backend: str = "xla"
):
    """`hook(group, x, y) -> y'` for one layer (None when LoRA is off); the kernel follows the
    attention backend (`backend_for`)."""
    if layer_stacks is None or slots is None:
        return None
    dims = tuple(pair.a.shape[0] for pair in layer_stacks.values())
    backend = backend_for(attention_backend, dims)
    return lambda group, x, y, gated=None: apply(layer_stacks[group], slots, x, y, backend, gated)
