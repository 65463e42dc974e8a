"""Qwen2.5-VL's image encoder: the windowed ViT with 2D rotary embeddings and the patch merger.

1. `QwenVisionConfig.from_hf(config)` reads `vision_config` (depth, width, heads, patch / merge /
   temporal patch sizes, `window_size`, `fullatt_block_indexes`, `out_hidden_size`).
2. `params_from_hf(vcfg, names, get_tensor)` maps `visual.*` (hub files and transformers' saves) or
   `model.visual.*` (transformers 5 in memory) onto `QwenVisionParams` (linear weights `[in, out]`;
   the Conv3d patch embedding flattened to one `[C*T*P*P, d]` matmul); `random_params` for
   `load_format="dummy"`.
3. On the host, `window_layout(vcfg, gh, gw)` places one image's merge blocks window by window
   (HF's windows: `window_size / patch / merge` blocks a side, row-major), each window padded to
   the same `window` rows (a partial window's missing blocks are padding), and gives each patch
   its (h, w) grid position.
4. `encode(params, vcfg, x, pos, valid, window)`: patches [N, C*T*P*P] in that layout -> patch
   embedding -> blocks of RMSNorm, attention with the 2D rotary embedding (the head's first half
   rotated by h, the second by w) within each window (a [windows, window, window] score block),
   or over the whole image in the `fullatt_block_indexes` blocks (query chunks of FULL_CHUNK
   rows), padding keys masked, RMSNorm, SwiGLU MLP -> the merger (RMSNorm, each 2x2 block's 4
   patches concatenated, GELU MLP) -> [N/4, text width].
5. `QwenImageEncoder.embeds(rgb)` patchifies (`qwen_processor.patches`), lays the patches out,
   pads the window count to a power of two (>= 64 patches: one program per bucket, not per image
   size), runs the jitted `encode` and gathers the merged tokens back in row-major order.

Einsum legend: n, m = patch, h = head, k = head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxinfer import layers
from jaxinfer.vision.mrope import MRopePositions
from jaxinfer.vision.qwen_processor import QwenVisionSpec, patches

MIN_BUCKET = 64  # fewest patch rows of a program
FULL_CHUNK = 2048  # most query rows of one score block in the full-attention blocks


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    hidden: int
    intermediate: int
    depth: int
    num_heads: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    window_size: int
    fullatt_blocks: tuple[int, ...]
    out_hidden: int
    rope_theta: float = 10000.0
    eps: float = 1e-6

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> QwenVisionConfig:
        vc = config["vision_config"]
        act = vc.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        if vc.get("in_channels", 3) != 3:
            raise ValueError("vision_config.in_channels must be 3")
        rope = vc.get("rope_parameters") or {}
        return cls(
            hidden=int(vc.get("hidden_size", 1280)),
            intermediate=int(vc.get("intermediate_size", 3420)),
            depth=int(vc.get("depth", 32)),
            num_heads=int(vc.get("num_heads", 16)),
            patch_size=int(vc.get("patch_size", 14)),
            merge_size=int(vc.get("spatial_merge_size", 2)),
            temporal_patch_size=int(vc.get("temporal_patch_size", 2)),
            window_size=int(vc.get("window_size", 112)),
            fullatt_blocks=tuple(int(i) for i in vc.get("fullatt_block_indexes", (7, 15, 23, 31))),
            out_hidden=int(vc.get("out_hidden_size", 3584)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
        )

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2


@struct.dataclass
class QwenVisionLayer:
    norm1: Any  # [d]
    qkv: Any  # [d, 3d]  columns (q|k|v, head, k)
    qkv_b: Any  # [3d]
    proj: Any  # [d, d]
    proj_b: Any  # [d]
    norm2: Any  # [d]
    gate: Any  # [d, f]
    gate_b: Any  # [f]
    up: Any  # [d, f]
    up_b: Any  # [f]
    down: Any  # [f, d]
    down_b: Any  # [d]


@struct.dataclass
class QwenVisionParams:
    patch: Any  # [C*T*P*P, d]  rows in the Conv3d weight's (channel, time, y, x) order
    layers: tuple[QwenVisionLayer, ...]
    merge_norm: Any  # [d]
    fc1: Any  # [4d, 4d]
    fc1_b: Any  # [4d]
    fc2: Any  # [4d, e]
    fc2_b: Any  # [e]


def params_from_hf(
    vcfg: QwenVisionConfig,
    names: Iterable[str],
    get_tensor: Callable[[str], np.ndarray],
    dtype: Any = jnp.float32,
) -> QwenVisionParams:
    """The `visual.*` tensors of a Qwen2.5-VL checkpoint -> `QwenVisionParams` (ValueError on a
    missing or mis-shaped tensor)."""
    full = {n.removeprefix("model."): n for n in names if ".visual." in f".{n}"}

    def get(name: str, shape: tuple[int, ...], fn=np.asarray) -> jax.Array:
        if "visual." + name not in full:
            raise ValueError(f"vision checkpoint tensor {'visual.' + name!r} is missing")
        x = fn(np.asarray(get_tensor(full["visual." + name]), np.float32))
        if x.shape != shape:
            raise ValueError(
                f"vision tensor {'visual.' + name!r}: shape {x.shape}, expected {shape}"
            )
        return jnp.asarray(x, dtype)

    d, f, e, t = vcfg.hidden, vcfg.intermediate, vcfg.out_hidden, np.transpose
    blocks = []
    for i in range(vcfg.depth):
        p = f"blocks.{i}."
        blocks.append(
            QwenVisionLayer(
                norm1=get(p + "norm1.weight", (d,)),
                qkv=get(p + "attn.qkv.weight", (d, 3 * d), t),
                qkv_b=get(p + "attn.qkv.bias", (3 * d,)),
                proj=get(p + "attn.proj.weight", (d, d), t),
                proj_b=get(p + "attn.proj.bias", (d,)),
                norm2=get(p + "norm2.weight", (d,)),
                gate=get(p + "mlp.gate_proj.weight", (d, f), t),
                gate_b=get(p + "mlp.gate_proj.bias", (f,)),
                up=get(p + "mlp.up_proj.weight", (d, f), t),
                up_b=get(p + "mlp.up_proj.bias", (f,)),
                down=get(p + "mlp.down_proj.weight", (f, d), t),
                down_b=get(p + "mlp.down_proj.bias", (d,)),
            )
        )
    m = d * vcfg.merge_size**2
    return QwenVisionParams(
        patch=get("patch_embed.proj.weight", (vcfg.patch_dim, d), lambda w: w.reshape(d, -1).T),
        layers=tuple(blocks),
        merge_norm=get("merger.ln_q.weight", (d,)),
        fc1=get("merger.mlp.0.weight", (m, m), t),
        fc1_b=get("merger.mlp.0.bias", (m,)),
        fc2=get("merger.mlp.2.weight", (m, e), t),
        fc2_b=get("merger.mlp.2.bias", (e,)),
    )


def random_params(vcfg: QwenVisionConfig, seed: int = 0, dtype: Any = jnp.float32):
    """Random weights of the declared shapes (`load_format="dummy"`): std 0.02, unit norms."""
    rng = np.random.default_rng(seed)
    d, f, e = vcfg.hidden, vcfg.intermediate, vcfg.out_hidden
    m = d * vcfg.merge_size**2

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(0, 0.02, shape).astype(np.float32), dtype)

    ones = jnp.ones((d,), dtype)
    blocks = tuple(
        QwenVisionLayer(
            ones,
            w(d, 3 * d),
            w(3 * d),
            w(d, d),
            w(d),
            ones,
            w(d, f),
            w(f),
            w(d, f),
            w(f),
            w(f, d),
            w(d),
        )  # fmt: skip
        for _ in range(vcfg.depth)
    )
    return QwenVisionParams(w(vcfg.patch_dim, d), blocks, ones, w(m, m), w(m), w(m, e), w(e))


@dataclasses.dataclass(frozen=True)
class Layout:
    """One image's patches laid out window by window, each window padded to `window` rows."""

    rows: np.ndarray  # i64[gh * gw]: padded row of each patch (HF's patch order)
    blocks: np.ndarray  # i64[gh * gw / m^2]: padded merged row of each merge block (row-major)
    pos: np.ndarray  # i32[gh * gw, 2]: each patch's (h, w) (HF's patch order)
    num_windows: int
    window: int  # padded rows per window (side^2 * m^2)


def window_layout(vcfg: QwenVisionConfig, gh: int, gw: int) -> Layout:
    """HF's windows of one gh x gw patch image (`side` = window_size / patch / merge merge blocks a
    side, row-major; the image's last row / column of windows may be partial): each merge block
    gets the slot of its place in its window, so a window is `window` consecutive rows (the
    missing blocks of a partial window are padding) and its m x m patches stay together."""
    m = vcfg.merge_size
    bh, bw = gh // m, gw // m
    side = max(1, vcfg.window_size // m // vcfg.patch_size)
    r, c = np.meshgrid(np.arange(bh), np.arange(bw), indexing="ij")
    per_row = -(-bw // side)
    blocks = ((r // side) * per_row + c // side) * side * side + (r % side) * side + c % side
    blocks = blocks.reshape(-1)
    rows = (blocks[:, None] * m * m + np.arange(m * m)).reshape(-1)
    hh, ww = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    hw = np.stack([hh, ww], -1).reshape(bh, m, bw, m, 2).transpose(0, 2, 1, 3, 4)
    pos = hw.reshape(-1, 2).astype(np.int32)
    return Layout(rows, blocks, pos, -(-bh // side) * per_row, side * side * m * m)


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
    return w * xf.astype(x.dtype)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, valid: jax.Array) -> jax.Array:
    """Softmax attention of q [..., n, h, k] over keys [..., m, h, k] where `valid` [..., m]."""
    att = jnp.einsum("...nhk,...mhk->...hnm", q, k).astype(jnp.float32) * (q.shape[-1] ** -0.5)
    att = jnp.where(valid[..., None, None, :], att, -1e30)
    att = jax.nn.softmax(att, axis=-1).astype(v.dtype)
    return jnp.einsum("...hnm,...mhk->...nhk", att, v)


def encode(
    params: QwenVisionParams,
    vcfg: QwenVisionConfig,
    x: jax.Array,
    pos: jax.Array,
    valid: jax.Array,
    window: int,
    full_chunk: int = FULL_CHUNK,
) -> jax.Array:
    """Patches f32[N, C*T*P*P] laid out by `window_layout` (N = windows x `window`), their (h, w)
    i32[N, 2] and bool[N] (False: padding) -> [N / m^2, e]. Window blocks attend within each
    `window` rows; full blocks over all valid rows, in query chunks of <= `full_chunk` rows (the
    scores of one chunk: heads x full_chunk x N)."""
    n, d, nh = x.shape[0], vcfg.hidden, vcfg.num_heads
    kd, nw = d // nh, n // window
    chunk = window * max(1, min(nw, full_chunk // window))
    while nw % (chunk // window):
        chunk -= window
    dtype = params.patch.dtype
    with jax.named_scope("patches"):
        h = x.astype(dtype) @ params.patch
    with jax.named_scope("rotary"):  # HF's axial rope: head_dim / 4 frequencies for h, then w
        quarter = kd // 2
        inv = 1.0 / vcfg.rope_theta ** (np.arange(0, quarter, 2, dtype=np.float32) / quarter)
        ang = (pos.astype(jnp.float32)[:, :, None] * jnp.asarray(inv)).reshape(n, -1)
        cos, sin = jnp.cos(ang), jnp.sin(ang)  # [N, kd / 2]
    for i, lp in enumerate(params.layers):
        with jax.named_scope(f"vision_block_{i}"):
            y = _rms(h, lp.norm1, vcfg.eps)
            qkv = (y @ lp.qkv + lp.qkv_b).reshape(n, 3, nh, kd)
            q = layers.apply_rope(qkv[:, 0], cos, sin)
            k = layers.apply_rope(qkv[:, 1], cos, sin)
            v = qkv[:, 2]
            if i in vcfg.fullatt_blocks:
                qs = q.reshape(n // chunk, chunk, nh, kd)
                y = jax.lax.map(lambda qc, k=k, v=v: _attend(qc, k, v, valid), qs)
            else:
                win = (nw, window, nh, kd)
                y = _attend(q.reshape(win), k.reshape(win), v.reshape(win), valid.reshape(nw, -1))
            h = h + y.reshape(n, d) @ lp.proj + lp.proj_b
            y = _rms(h, lp.norm2, vcfg.eps)
            y = jax.nn.silu(y @ lp.gate + lp.gate_b) * (y @ lp.up + lp.up_b)
            h = h + y @ lp.down + lp.down_b
    with jax.named_scope("merger"):
        y = _rms(h, params.merge_norm, vcfg.eps).reshape(n // vcfg.merge_size**2, -1)
        y = jax.nn.gelu(y @ params.fc1 + params.fc1_b, approximate=False)
        return y @ params.fc2 + params.fc2_b


def bucket(num_windows: int, window: int) -> int:
    """Padded windows of an image of `num_windows`: a power of two, >= MIN_BUCKET patches."""
    return max(-(-MIN_BUCKET // window), 1 << (num_windows - 1).bit_length())


class QwenImageEncoder:
    """The model's image encoder on the device: `embeds(rgb)` -> numpy [tokens, e]; `mrope`
    gives the runner each request's M-RoPE positions."""

    bidirectional = False  # the text model attends causally over image tokens, as HF's does

    def __init__(self, vcfg: QwenVisionConfig, params: QwenVisionParams, spec: QwenVisionSpec):
        self.vcfg, self.params, self.spec = vcfg, params, spec
        self._jit = jax.jit(encode, static_argnums=(1, 5, 6))
        self.full_chunk = FULL_CHUNK  # query rows per score block of the full-attention blocks
        self.mrope = MRopePositions(spec.patch_size, spec.merge_size)
        self.num_encoded = 0  # images run through the encoder (cache misses)
        self.buckets_used: set[int] = set()  # padded patch counts compiled so far

    def embeds(self, rgb: np.ndarray) -> np.ndarray:
        """u8[H, W, 3] smart-resized image -> f32[gh * gw / m^2, e] (one encoder call)."""
        x, (_, gh, gw) = patches(rgb, self.spec)
        lay = window_layout(self.vcfg, gh, gw)
        n = bucket(lay.num_windows, lay.window) * lay.window
        xp = np.zeros((n, x.shape[1]), np.float32)
        xp[lay.rows] = x
        pos = np.zeros((n, 2), np.int32)
        pos[lay.rows] = lay.pos
        valid = np.zeros(n, bool)
        valid[lay.rows] = True
        self.num_encoded += 1
        self.buckets_used.add(n)
        out = self._jit(self.params, self.vcfg, xp, pos, valid, lay.window, self.full_chunk)
        return np.asarray(out, np.float32)[lay.blocks]


def load_qwen_encoder(model: Any, spec: QwenVisionSpec, dtype: Any = jnp.float32):
    """`jaxinfer.vision.encoder.load_encoder` for Qwen2.5-VL (HF safetensors or dummy)."""
    from checkpoints.hf import HFCheckpoint

    vcfg = QwenVisionConfig.from_hf(model.hf_config)
    if model.source == "dummy":
        return QwenImageEncoder(vcfg, random_params(vcfg, dtype=dtype), spec)
    with HFCheckpoint(model.path) as ckpt:
        params = params_from_hf(vcfg, ckpt.tensor_names(), ckpt.tensor, dtype)
    return QwenImageEncoder(vcfg, params, spec)
