"""Building blocks shared by the model families: norms, rotary embeddings, gated MLP, logits.

Einsum legend: t = token, e = embed (hidden), f = MLP hidden, v = vocab, h = head, d = head_dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import ModelConfig, RopeConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in f32; Gemma scales by (offset + w) with offset = 1."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)


def rope_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[np.ndarray, float]:
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
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

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


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin f32[T, head_dim // 2] for the given absolute positions i32[T]."""
    inv_freq, scale = rope_frequencies(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


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


def gated_mlp(x: jax.Array, gate_up: jax.Array, down: jax.Array, act: str) -> jax.Array:
    """x [T, E]; gate_up [E, 2, F] (gate at 0, up at 1); down [F, E] -> [T, E]."""
    gu = jnp.einsum("te,ecf->tcf", x, gate_up)
    return jnp.einsum("tf,fe->te", activation(act, gu[:, 0]) * gu[:, 1], down)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else cap * jnp.tanh(x / cap)
