"""Building blocks shared by the model families: norms, rotary embeddings, gated MLP, logits.

Einsum legend: t = token, e = embed (hidden), f = MLP hidden, v = vocab, h = head, d = head_dim.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from checkpoints import quantize as qlib
from jaxinfer import quantization
from jaxinfer.config import ModelConfig, RopeConfig
from jaxinfer.quantization import QArray
from pallas_kernels import target
from pallas_kernels.linear import cpu as cpu_linear
from pallas_kernels.linear import gpu as gpu_linear
from pallas_kernels.paged_common import interpret_mode
from pallas_kernels.rms_norm import gpu as gpu_norm

log = logging.getLogger(__name__)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32; Gemma scales by (offset + w) with offset = 1."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def add_rms_norm(
    x: jax.Array,
    y: jax.Array,
    weight: jax.Array,
    eps: float,
    offset: float = 0.0,
    gpu: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """(h = x + y, rms_norm(h, weight)) for the residual stream x [T, E]. With `gpu` (the layer
    runs the GPU attention backend) one Pallas launch (`pallas_kernels.rms_norm.gpu`) where XLA
    launches 2-3 kernels; the same values (h bit-exact, the norm up to its sum's order)."""
    if gpu and gpu_norm.supported(x):
        return gpu_norm.add_rms_norm(x, y, weight, eps, offset, interpret=interpret_mode("gpu"))
    h = x + y
    return h, rms_norm(h, weight, eps, offset)


def rope_frequencies(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[np.ndarray, float]:
    """Inverse frequencies f32[head_dim // 2] and the cos/sin scale (YaRN's attention factor).

    Computed in float32 like the reference implementations, so angles match to the last bit.
    """
    dim = head_dim
    base = np.float32(rope.theta)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (np.float32(1.0) / (base**exponents)).astype(np.float32)
    scale = 1.0
    kind = rope.rope_type
    if kind == "linear":
        inv_freq = inv_freq / np.float32(rope.get("factor"))
    elif kind == "llama3":
        factor = rope.get("factor")
        low, high = rope.get("low_freq_factor"), rope.get("high_freq_factor")
        old_len = rope.get("original_max_position_embeddings")
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "yarn":
        inv_freq, scale = _yarn(rope, dim, base, max_position_embeddings)
    return inv_freq.astype(np.float32), float(scale)


def _yarn(rope: RopeConfig, dim: int, base: np.float32, max_pos: int) -> tuple[np.ndarray, float]:
    factor = float(rope.get("factor"))
    orig = rope.get("original_max_position_embeddings") or max_pos
    beta_fast, beta_slow = rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0)

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = (
            mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
        )

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (np.float32(factor) * pos_freqs)
    keep = (1 - ramp).astype(np.float32)
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq.astype(np.float32), attention_factor


def rope_cos_sin(
    cfg: ModelConfig,
    positions: jax.Array,
    rope: RopeConfig | None = None,
    head_dim: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """cos/sin f32[T, rotary_dim // 2] for the given absolute positions i32[T].

    `rope` defaults to `cfg.rope`, the rotated width to `cfg.head_dim` (DeepSeek's MLA rotates
    only its `qk_rope_head_dim` slice; Gemma 3's local layers have their own `cfg.local_rope`).
    """
    inv_freq, scale = rope_frequencies(
        rope or cfg.rope, head_dim or cfg.head_dim, cfg.max_position_embeddings
    )
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def mrope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Qwen2.5-VL's M-RoPE: cos/sin f32[T, D/2] for position rows i32[3, T] (t, h, w): rotary
    pair j takes its angle from the row `cfg.mrope_section` assigns it (the first section's
    pairs from t, the next from h, the rest from w). Equal rows give `rope_cos_sin`'s tables."""
    cos, sin = rope_cos_sin(cfg, positions.reshape(-1))
    rows = np.repeat(np.arange(3), cfg.mrope_section)[None, None, :]  # [1, 1, D/2]
    t = positions.shape[-1]

    def pick(x: jax.Array) -> jax.Array:
        x = x.reshape(3, t, -1)
        return jnp.take_along_axis(x, jnp.broadcast_to(rows, (1, t, x.shape[-1])), axis=0)[0]

    return pick(cos), pick(sin)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates halves (x1, x2) of x [T, H, D] (the Hugging Face layout)."""
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    if name == "silu":
        return jax.nn.silu(x)
    if name == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.gelu(x, approximate=False)


def gated_mlp(
    x: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    act: str,
    backend: str = "xla",
    lora: Callable | None = None,
) -> jax.Array:
    """x [T, E]; gate_up [E, 2, F] (gate at 0, up at 1); down [F, E] -> [T, E]. `lora(target, x,
    y, gated=None) -> y'` adds each token's adapter product to a projection
    (`jaxinfer.lora.device`; `gated`: down's input as (gate_up output, activation))."""
    (gu,) = dense(x, gate_up, backend=backend)  # [T, 2, F]
    if lora is not None:
        gu = lora("gate_up", x, gu)
    hidden = activation(act, gu[:, 0]) * gu[:, 1]
    (out,) = dense(hidden, down, backend=backend)
    return out if lora is None else lora("down", hidden, out, gated=(gu, act))


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)


LINEAR_BACKENDS = ("auto", "xla", "cpu", "gpu")


def resolve_linear_backend(backend: str | None, platform: str | None = None) -> str:
    """The concrete dense-product backend: "xla" (XLA's dot), "cpu" (the compiled CPU kernel for
    steps of few token rows, `pallas_kernels.linear.cpu`) or "gpu" (quantized weights of steps of
    few token rows through the Pallas dequantizing matmul, `pallas_kernels.linear.gpu`; interpreted
    off a GPU target). None / "auto" picks "cpu" on a CPU platform when the kernel builds there,
    `GPU_AUTO` ("gpu") on a GPU, else "xla"."""
    platform = platform or target.platform()
    backend = backend or "auto"
    if backend not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend {backend!r} is not one of {LINEAR_BACKENDS}")
    if backend == "cpu" and platform != "cpu":
        raise ValueError(f"linear_backend 'cpu' runs on the CPU platform only, not {platform!r}")
    if backend == "cpu":
        cpu_linear.library()  # raises naming why it cannot build
    if backend != "auto":
        return backend
    if platform == "gpu":
        return GPU_AUTO
    return "cpu" if platform == "cpu" and _cpu_linear_builds() else "xla"


# NOTE: measured 2026-11-26 on an H200 (BENCHMARKS.md "The dequantizing matmul tuned"): with its
# blocks tuned (`gpu_linear.TUNED`: K split across programs, one-row products as f32 FMAs), the
# Pallas dequantizing matmul beats XLA's products at every Llama-3-8B projection, 1 and 32 rows;
# the 8B decode step: int4 4.60 ms at 1 row (XLA's products 6.21), 8.06 at 32 rows (18.55);
# int8 4.42 (4.51) and 6.15 (9.11). Steps of more rows than `gpu_linear.MAX_ROWS` run XLA's.
GPU_AUTO = "gpu"


@functools.cache
def _cpu_linear_builds() -> bool:
    reason = cpu_linear.unavailable_reason()
    if reason is not None:
        log.warning(
            "linear_backend 'auto': the CPU linear kernel is unavailable, using XLA's dot (%s)",
            reason,
        )
    return reason is None


def dense(
    x: jax.Array, *weights: jax.Array | QArray, backend: str = "xla"
) -> tuple[jax.Array, ...]:
    """x [T, E] times each weight [E, ...] (contracting E) -> ([T, ...], ...).

    A weight may be a `QArray` (int8 / fp8 / int4 data with scales [G, ...]: one per output channel
    and group of E // G input channels; int4 also offsets [G, ...]): the product runs on the stored
    values, each group's scales applied to that group's share of the product, plus x's group sums
    times the offsets (see `_xla_dense`). With backend "cpu" a step of at most
    `cpu_linear.MAX_ROWS` float32 rows (`MAX_ROWS_INT4` for int4's integer products) runs every
    weight in one call of the compiled kernel (int8 / int4 weights; float32 ones where
    `cpu_linear.float_pays()`), and more rows times int4's own layout take XLA's dot on the weight
    the kernel dequantized (`_dequantized_dense`); with backend "gpu" an int8 / int4 weight and at
    most `gpu_linear.MAX_ROWS` rows run the Pallas dequantizing matmul (the weight read in its
    stored bits: no converted copy in HBM); anything else is XLA's dot (same contraction as
    `einsum("te,e...->t...")`). On a TPU target, fewer than `TPU_MIN_ROWS` rows times a quantized
    weight run padded to that many (see `_tpu_pad`). An act-order weight (`QArray.perm`, GPTQ's
    desc_act) reads x's channels through its permutation, one product per such weight: the GPU
    kernel loads x through it, XLA's and the CPU kernel's paths take x gathered first.
    """
    if backend == "gpu":  # the Pallas kernel reads x through an act-order weight's perm itself
        return tuple(_gpu_dense(x, w) for w in weights)
    if any(isinstance(w, QArray) and w.perm is not None for w in weights):
        return tuple(
            dense(x, w, backend=backend)[0]
            if not isinstance(w, QArray) or w.perm is None
            else dense(jnp.take(x, w.perm, axis=-1), w.replace(perm=None), backend=backend)[0]
            for w in weights
        )
    pad = _tpu_pad(x, weights)
    if pad:
        ys = dense(jnp.pad(x, ((0, pad), (0, 0))), *weights, backend=backend)
        return tuple(y[: x.shape[0]] for y in ys)
    if backend == "cpu" and _kernel_fits(x, weights, axis=0):
        if _int4_products(x, weights):
            if len({w.tiled for w in weights}) > 1:  # one call per layout
                return tuple(dense(x, w, backend=backend)[0] for w in weights)
            # int4's own layout to the kernel's integer products: f16 scales and offsets as stored.
            flat = [w.data.reshape(w.shape[0], -1) for w in weights]
            scales = tuple(w.scale.reshape(w.scale.shape[0], -1) for w in weights)
            offsets = tuple(w.offset.reshape(w.offset.shape[0], -1) for w in weights)
            tiled = weights[0].tiled
            outs = cpu_linear.linear(x, *flat, scales=scales, offsets=offsets, tiled=tiled)
        elif isinstance(weights[0], QArray):
            flat = [quantization.codes(w).reshape(w.shape[0], -1) for w in weights]
            scales = [_f32(w.scale).reshape(w.scale.shape[0], -1) for w in weights]  # f32[G, N]
            outs = cpu_linear.linear(x, *flat, scales=tuple(scales))
            outs = [_add_offsets(x, y, w) for y, w in zip(outs, weights)]
        else:
            outs = cpu_linear.linear(x, *(w.reshape(w.shape[0], -1) for w in weights))
        return tuple(y.reshape(x.shape[0], *w.shape[1:]) for y, w in zip(outs, weights))
    if backend == "cpu" and x.ndim == 2 and x.dtype == jnp.float32 and _int4_products(x, weights):
        return tuple(_dequantized_dense(x, w) for w in weights)
    return tuple(_xla_dense(x, w) for w in weights)


def _dequantized_dense(x: jax.Array, w: QArray) -> jax.Array:
    """x [T, E] times int4's own layout for more rows than the kernel's products take (prefill):
    the kernel writes the weight out as f32 (`cpu_linear.dequantize`, untiling tiled codes on the
    way; XLA's conversion of uint4 codes took as long as the product itself: BENCHMARKS.md "int4
    prefill"), and XLA's dot takes it as a float weight. The conversion reads x (unused) so that
    each layer's copy is made when that layer runs, as `_tie` does for XLA's."""
    groups = w.scale.shape[0]
    weight = cpu_linear.dequantize(
        x,
        w.data.reshape(w.shape[0], -1),
        w.scale.reshape(groups, -1),
        w.offset.reshape(groups, -1),
        tiled=w.tiled,
    )
    return jnp.dot(x, weight).reshape(x.shape[0], *w.shape[1:])


# NOTE: XLA:TPU turns a quantized product of fewer token rows than a sublane tile (8) into a
# matrix-vector form that first converts the whole weight to f32 in HBM (4x int8's bytes, 8x
# int4's: measured with the deviceless v5e compile, `jaxinfer.aot.intermediates.weight_sized`);
# from 8 rows on it fuses the conversion into its products. The MXU takes 8 rows for the time of 1.
TPU_MIN_ROWS = 8


def _tpu_pad(x: jax.Array, weights: tuple[jax.Array | QArray, ...]) -> int:
    """Rows to add to x so a TPU target's quantized product reads its codes in place (0 off TPU,
    for float weights, or with >= `TPU_MIN_ROWS` rows)."""
    if x.ndim != 2 or x.shape[0] >= TPU_MIN_ROWS or target.platform() != "tpu":
        return 0
    return TPU_MIN_ROWS - x.shape[0] if any(isinstance(w, QArray) for w in weights) else 0


def _per_group_products(x: jax.Array, e: int, groups: int) -> bool:
    """Whether x [T, e] times a weight of `groups` scale groups is best done as one product per
    group (partial sums [T, G, N] f32, scaled and summed): when those partial sums take no more
    memory than a 16-bit copy of the scaled weight [e, N] would (T * G * 4 <= e * 2), i.e. for
    decode-sized T; larger T (prefill) dequantizes the weight into the dot's operand instead."""
    return x.shape[0] * groups * 2 <= e


def _gpu_refuses(x: jax.Array, w: QArray) -> bool:
    """Whether the Pallas kernel does not take x [T, E] times `w` (`gpu_linear.supported`)."""
    data = quantization.codes(w)
    n = data.size // data.shape[0]
    return gpu_linear.supported(x.shape[0], x.shape[1], n, w.scale.shape[0], data.dtype) is not None


def _gpu_dense(x: jax.Array, w: jax.Array | QArray) -> jax.Array:
    """The Pallas kernel where it takes x times the quantized `w` (fused layouts such as qkv
    [E, Hkv, G+2, D] and gate_up [E, 2, F] seen as [E, N]), else `_xla_dense`."""
    if not isinstance(w, QArray) or x.ndim != 2 or _gpu_refuses(x, w):
        if isinstance(w, QArray) and w.perm is not None:  # XLA's product on the gathered x
            x, w = jnp.take(x, w.perm, axis=-1), w.replace(perm=None)
        return _xla_dense(x, w)
    t, e = x.shape
    groups = w.scale.shape[0]
    data = quantization.codes(w).reshape(e, -1)
    offset = None if w.offset is None else w.offset.reshape(groups, -1)
    y = gpu_linear.quantized_matmul(
        x,
        data,
        w.scale.reshape(groups, -1),
        offset,
        perm=w.perm,
        interpret=bool(interpret_mode("gpu")),
    )
    return y.reshape(t, *w.shape[1:])


def _xla_dense(x: jax.Array, w: jax.Array | QArray) -> jax.Array:
    if not isinstance(w, QArray):
        return jnp.tensordot(x, w, axes=1)
    t, e = x.shape
    groups = w.scale.shape[0]
    codes = quantization.codes(w)  # NOTE: tiled int4 codes (decode's CPU kernel) untiled here
    if groups > 1 and _per_group_products(x, e, groups):
        # t: token rows, G: scale groups, g: input channels of a group, n...: output dims.
        # NOTE: the codes keep their output dims (only the contraction axis is split, a free view
        # in every layout): flattening a fused weight (qkv [E, Hkv, G+2, D]) to [E, N] is a
        # relayout on TPU's tiled layouts, which XLA did after converting the codes to f32.
        n = "abcdef"[: len(w.shape) - 1]
        xg = x.reshape(t, groups, -1)
        parts = jnp.einsum(
            f"tGg,Gg{n}->tG{n}",
            xg,
            _tie(codes.reshape(groups, -1, *w.shape[1:]).astype(x.dtype), x),
            preferred_element_type=jnp.float32,
        )
        y = jnp.einsum(f"tG{n},G{n}->t{n}", parts, _f32(w.scale))
        if w.offset is not None:
            y = y + jnp.einsum(f"tG,G{n}->t{n}", xg.sum(-1, dtype=jnp.float32), _f32(w.offset))
        return y.astype(x.dtype)
    data = codes.reshape(e, -1)  # [E, N]
    scale = _f32(w.scale).reshape(groups, -1)  # f32[G, N]
    out_shape = (t, *w.shape[1:])
    offset = None if w.offset is None else _f32(w.offset).reshape(groups, -1)  # f32[G, N]
    # int4 offsets: sum_k x[t, k] * offset[k // g, n] = (x's per-group sums) @ offset.
    shift = (
        0.0
        if offset is None
        else jnp.dot(x.reshape(t, groups, -1).sum(-1, dtype=jnp.float32), offset)
    )
    if groups == 1:
        # NOTE: the stored values are converted to x's dtype right at the dot, whose f32 output is
        # then scaled per output channel: on GPU XLA fuses that convert into the GEMM (no converted
        # weight in memory); XLA:CPU materializes it (measured: BENCHMARKS.md), which is why
        # decode rows take the CPU kernel.
        y = jnp.dot(x, _tie(data.astype(x.dtype), x), preferred_element_type=jnp.float32)
        return (y * scale[0] + shift).astype(x.dtype).reshape(out_shape)
    weight = _tie(qlib.dequantize(data, scale, 0, xp=jnp, offset=offset).astype(x.dtype), x)
    return jnp.dot(x, weight, preferred_element_type=jnp.float32).astype(x.dtype).reshape(out_shape)


def _tie(weight: jax.Array, x: jax.Array) -> jax.Array:
    """The converted (float) weight of a product with x, made to depend on x's values on a CPU
    target: plus a zero computed from x's first element (0 * that element, or 0 where it is not
    finite: the weight's values unchanged, NaN or inf in x included), fused into the conversion.

    NOTE: XLA:CPU materializes a quantized weight's converted copy before its dot; a conversion
    that reads only parameters may run anywhere, and its scheduler ran every layer's conversion
    before the first layer: a step's temp memory held all of them (~4x the int8 weights: 35 GB
    for the 34-layer 4B Gemma 3; BENCHMARKS.md "Quantized steps' temp memory on XLA:CPU"). Tied
    to its input, each layer's copy is made when that layer runs and its buffer reused by the
    next. (`jax.lax.optimization_barrier` does not do it: XLA:CPU expands barriers away before
    scheduling.) GPU and TPU convert inside their GEMMs: left as they are."""
    if target.platform() != "cpu":
        return weight
    first = x.reshape(-1)[0].astype(jnp.float32)
    zero = jnp.where(jnp.isfinite(first), first, 0.0) * 0.0
    return weight + zero.astype(weight.dtype)


def dense_transposed(x: jax.Array, w: jax.Array | QArray, backend: str = "xla") -> jax.Array:
    """x [T, E] times w [N, E] contracting E -> [T, N] (a tied embedding used as LM head; quantized:
    scales [N, G]; few rows padded on a TPU target like `dense`)."""
    pad = _tpu_pad(x, (w,))
    if pad:
        return dense_transposed(jnp.pad(x, ((0, pad), (0, 0))), w, backend)[: x.shape[0]]
    if backend == "cpu" and _kernel_fits(x, (w,), axis=1):
        if isinstance(w, QArray):
            # NOTE: f16 scales (int4's tied embedding) as stored: the kernel widens them itself.
            scale = w.scale if w.scale.dtype == jnp.float16 else _f32(w.scale)
            return cpu_linear.linear(x, w.data, transposed=True, scales=(scale,))[0]
        return cpu_linear.linear(x, w, transposed=True)[0]
    if not isinstance(w, QArray):
        return jnp.einsum("te,ne->tn", x, w)
    t, e = x.shape
    groups = w.scale.shape[1]
    scale = _f32(w.scale)  # [N, G]
    if groups == 1:
        codes = _tie(w.data.astype(x.dtype), x)
        y = jnp.einsum("te,ne->tn", x, codes, preferred_element_type=jnp.float32)
        return (y * scale[:, 0]).astype(x.dtype)
    if _per_group_products(x, e, groups):
        # t: token rows, n: vocab rows, G: scale groups, g: embedding channels of a group.
        parts = jnp.einsum(
            "tGg,nGg->tnG",
            x.reshape(t, groups, -1),
            _tie(w.data.reshape(w.shape[0], groups, -1).astype(x.dtype), x),
            preferred_element_type=jnp.float32,
        )
        return jnp.einsum("tnG,nG->tn", parts, scale).astype(x.dtype)
    weight = _tie(qlib.dequantize(w.data, scale, 1, xp=jnp).astype(x.dtype), x)
    return jnp.einsum("te,ne->tn", x, weight, preferred_element_type=jnp.float32).astype(x.dtype)


def embed_rows(embed: jax.Array | QArray, ids: jax.Array, dtype: jax.typing.DTypeLike) -> jax.Array:
    """Rows `ids` i32[T] of an embedding [V, E] (quantized: scales [V, G]) -> [T, E] of `dtype`."""
    if isinstance(embed, QArray):
        offset = None if embed.offset is None else jnp.take(embed.offset, ids, axis=0)
        return qlib.dequantize(
            jnp.take(embed.data, ids, axis=0),
            jnp.take(embed.scale, ids, axis=0),
            1,
            xp=jnp,
            offset=offset,
        ).astype(dtype)
    return jnp.take(embed, ids, axis=0)


def _add_offsets(x: jax.Array, y: jax.Array, w: QArray) -> jax.Array:
    """y [T, N] plus int4's offsets term (x's per-group sums) @ offset [G, N]; y without offsets."""
    if w.offset is None:
        return y
    offset = _f32(w.offset).reshape(w.offset.shape[0], -1)
    return y + jnp.dot(x.reshape(x.shape[0], offset.shape[0], -1).sum(-1), offset)


def _f32(scale: jax.Array) -> jax.Array:
    """Scales or offsets as f32 (int4 stores them as f16: widened where they are used)."""
    return scale.astype(jnp.float32)


def _kernel_fits(x: jax.Array, weights: tuple[jax.Array | QArray, ...], axis: int) -> bool:
    """Whether the compiled kernel takes x times `weights` (contracted over their axis `axis`)."""
    if x.ndim != 2:
        return False
    rows = cpu_linear.MAX_ROWS
    if axis == 1 and all(isinstance(w, QArray) for w in weights):
        rows = cpu_linear.MAX_ROWS_HEAD  # a quantized tied LM head: XLA's product is far slower
    elif axis == 0 and _int4_products(x, weights):
        rows = cpu_linear.MAX_ROWS_INT4
    if not (
        x.shape[0] <= rows and x.dtype == jnp.float32 and len(weights) <= cpu_linear.MAX_WEIGHTS
    ):
        return False
    if all(isinstance(w, QArray) for w in weights):
        return all(
            (w.data.dtype == jnp.int8 or _packed_int4(w, axis))
            and cpu_linear.groups_fit(x.shape[1], w.scale.shape[axis])
            for w in weights
        )
    # NOTE: float32 weights only where the kernel beats XLA's dot on them (its AVX-512 build).
    return cpu_linear.float_pays() and all(
        not isinstance(w, QArray) and w.dtype == jnp.float32 for w in weights
    )


def _int4_products(x: jax.Array, weights: tuple[jax.Array | QArray, ...]) -> bool:
    """Whether the kernel takes these int4 weights in its integer products (f16 scales and offsets
    read as stored, x quantized to 15 bits per 32 channels: `cpu_linear.linear(..., offsets=)`)."""
    return all(
        isinstance(w, QArray)
        and w.offset is not None
        and w.data.dtype == jnp.uint4
        and w.scale.dtype == w.offset.dtype == jnp.float16
        and cpu_linear.offsets_fit(x.shape[1], w.scale.shape[0])
        for w in weights
    )


def _packed_int4(w: QArray, axis: int) -> bool:
    """Whether the kernel reads `w`'s uint4 codes as they are: [K, N] (axis 0) with N even."""
    return w.data.dtype == jnp.uint4 and axis == 0 and (w.data.size // w.shape[0]) % 2 == 0
