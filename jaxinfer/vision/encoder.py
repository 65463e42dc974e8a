"""Gemma 3's image encoder: the SigLIP vision tower, average pooling, the multimodal projector.

1. `VisionConfig.from_hf(config)` reads `vision_config` (SigLIP) and the projector's numbers.
2. `params_from_hf(vcfg, names, get_tensor)` maps the checkpoint's `vision_tower.*` and
   `multi_modal_projector.*` tensors (with or without transformers 5's `model.` prefix) onto
   `VisionParams` (linear weights stored `[in, out]`); `random_params` for `load_format="dummy"`.
3. `encode(params, vcfg, pixels)`: f32[B, 3, H, W] -> [B, tokens_per_image, E]: patches (the
   stride-P convolution as one matmul over flattened patches) + learned positions -> pre-norm
   encoder layers (bidirectional attention, tanh-GELU MLP) -> post LayerNorm -> average pooling of
   the patch grid to `tokens_per_side`^2 -> Gemma RMSNorm (1 + w) -> projection to the text width.
   `ImageEncoder` jits it once per model (the image size is fixed: one program, B = 1).

Einsum legend: b = image, n = patch, d = vision width, h = head, k = head dim, e = text width.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from checkpoints.hf import HFCheckpoint
from jaxinfer.vision.processor import VisionSpec, pixel_values, vision_spec

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    patch_size: int
    image_size: int
    eps: float
    tokens_per_image: int
    text_hidden: int
    act: str = "gelu_tanh"

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> VisionConfig:
        vc, tc = config["vision_config"], config["text_config"]
        act = vc.get("hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu"):
            raise ValueError(f"vision_config.hidden_act={act!r} is not supported")
        return cls(
            hidden=int(vc.get("hidden_size", 1152)),
            intermediate=int(vc.get("intermediate_size", 4304)),
            num_layers=int(vc.get("num_hidden_layers", 27)),
            num_heads=int(vc.get("num_attention_heads", 16)),
            patch_size=int(vc.get("patch_size", 14)),
            image_size=int(vc.get("image_size", 896)),
            eps=float(vc.get("layer_norm_eps", 1e-6)),
            tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
            text_hidden=int(tc["hidden_size"]),
            act="gelu_tanh" if act == "gelu_pytorch_tanh" else "gelu",
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size


@struct.dataclass
class VisionLayer:
    ln1_w: Any  # [d]
    ln1_b: Any  # [d]
    qkv: Any  # [d, 3, d]  q, k, v fused
    qkv_b: Any  # [3, d]
    o: Any  # [d, d]
    o_b: Any  # [d]
    ln2_w: Any  # [d]
    ln2_b: Any  # [d]
    fc1: Any  # [d, f]
    fc1_b: Any  # [f]
    fc2: Any  # [f, d]
    fc2_b: Any  # [d]


@struct.dataclass
class VisionParams:
    patch: Any  # [3*P*P, d]  rows in (channel, y, x) order, as the conv weight flattens
    patch_b: Any  # [d]
    pos: Any  # [n, d]
    layers: tuple[VisionLayer, ...]
    post_w: Any  # [d]
    post_b: Any  # [d]
    proj_norm: Any  # [d]  Gemma RMSNorm weight (scales by 1 + w)
    proj: Any  # [d, e]


def _layer_names(i: int) -> dict[str, tuple[str, Callable[[np.ndarray], np.ndarray]]]:
    p = f"vision_tower.encoder.layers.{i}."
    t = np.transpose
    return {
        "ln1_w": (p + "layer_norm1.weight", np.asarray),
        "ln1_b": (p + "layer_norm1.bias", np.asarray),
        "o": (p + "self_attn.out_proj.weight", t),
        "o_b": (p + "self_attn.out_proj.bias", np.asarray),
        "ln2_w": (p + "layer_norm2.weight", np.asarray),
        "ln2_b": (p + "layer_norm2.bias", np.asarray),
        "fc1": (p + "mlp.fc1.weight", t),
        "fc1_b": (p + "mlp.fc1.bias", np.asarray),
        "fc2": (p + "mlp.fc2.weight", t),
        "fc2_b": (p + "mlp.fc2.bias", np.asarray),
    }


def params_from_hf(
    vcfg: VisionConfig,
    names: Iterable[str],
    get_tensor: Callable[[str], np.ndarray],
    dtype: Any = jnp.float32,
) -> VisionParams:
    """The vision tensors of a Gemma 3 checkpoint -> `VisionParams` (ValueError on a missing or
    mis-shaped tensor)."""
    full = {}
    for (
        n
    ) in names:  # hub files: vision_tower.vision_model.*; transformers 5: [model.]vision_tower.*
        short = n.removeprefix("model.").replace("vision_tower.vision_model.", "vision_tower.")
        full[short] = n

    def get(name: str, shape: tuple[int, ...], fn=np.asarray) -> jax.Array:
        if name not in full:
            raise ValueError(f"vision checkpoint tensor {name!r} is missing")
        x = fn(np.asarray(get_tensor(full[name]), np.float32))
        if x.shape != shape:
            raise ValueError(f"vision tensor {name!r}: shape {x.shape}, expected {shape}")
        return jnp.asarray(x, dtype)

    d, f, p = vcfg.hidden, vcfg.intermediate, vcfg.patch_size
    emb = "vision_tower.embeddings."
    layers = []
    for i in range(vcfg.num_layers):
        pre = f"vision_tower.encoder.layers.{i}.self_attn."
        qkv = [get(pre + f"{k}_proj.weight", (d, d), np.transpose) for k in "qkv"]
        qkv_b = [get(pre + f"{k}_proj.bias", (d,)) for k in "qkv"]
        shapes = dict(o=(d, d), fc1=(d, f), fc1_b=(f,), fc2=(f, d))
        rest = {k: get(name, shapes.get(k, (d,)), fn) for k, (name, fn) in _layer_names(i).items()}
        layers.append(VisionLayer(qkv=jnp.stack(qkv, 1), qkv_b=jnp.stack(qkv_b), **rest))
    n = vcfg.patches_per_side**2
    return VisionParams(
        patch=get(emb + "patch_embedding.weight", (3 * p * p, d), lambda w: w.reshape(d, -1).T),
        patch_b=get(emb + "patch_embedding.bias", (d,)),
        pos=get(emb + "position_embedding.weight", (n, d)),
        layers=tuple(layers),
        post_w=get("vision_tower.post_layernorm.weight", (d,)),
        post_b=get("vision_tower.post_layernorm.bias", (d,)),
        proj_norm=get("multi_modal_projector.mm_soft_emb_norm.weight", (d,)),
        proj=get("multi_modal_projector.mm_input_projection_weight", (d, vcfg.text_hidden)),
    )


def random_params(vcfg: VisionConfig, seed: int = 0, dtype: Any = jnp.float32) -> VisionParams:
    """Random weights of the declared shapes (`load_format="dummy"`): std 0.02, unit norms."""
    rng = np.random.default_rng(seed)
    d, f, p = vcfg.hidden, vcfg.intermediate, vcfg.patch_size

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(0, 0.02, shape).astype(np.float32), dtype)

    ones, zeros = jnp.ones((d,), dtype), jnp.zeros((d,), dtype)
    layers = tuple(
        VisionLayer(
            ones,
            zeros,
            w(d, 3, d),
            w(3, d),
            w(d, d),
            zeros,
            ones,
            zeros,
            w(d, f),
            w(f),
            w(f, d),
            zeros,
        )  # fmt: skip
        for _ in range(vcfg.num_layers)
    )
    n = vcfg.patches_per_side**2
    return VisionParams(
        w(3 * p * p, d), zeros, w(n, d), layers, ones, zeros, zeros, w(d, vcfg.text_hidden)
    )


def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + eps) * w + b


def encode(params: VisionParams, vcfg: VisionConfig, pixels: jax.Array) -> jax.Array:
    """f32[b, 3, H, W] normalized pixels -> [b, tokens_per_image, e] soft-token embeddings."""
    b = pixels.shape[0]
    g, p, d, nh = vcfg.patches_per_side, vcfg.patch_size, vcfg.hidden, vcfg.num_heads
    x = pixels.astype(params.patch.dtype)
    with jax.named_scope("patches"):  # [b, 3, g, P, g, P] -> [b, g*g, 3*P*P] in (c, y, x) order
        x = x.reshape(b, 3, g, p, g, p).transpose(0, 2, 4, 1, 3, 5).reshape(b, g * g, 3 * p * p)
        h = x @ params.patch + params.patch_b + params.pos
    kd = d // nh
    for i, lp in enumerate(params.layers):
        with jax.named_scope(f"vision_layer_{i}"):
            y = _layer_norm(h, lp.ln1_w, lp.ln1_b, vcfg.eps)
            qkv = jnp.einsum("bnd,dsf->bnsf", y, lp.qkv) + lp.qkv_b
            q, k, v = (qkv[:, :, s].reshape(b, g * g, nh, kd) for s in range(3))
            att = jnp.einsum("bnhk,bmhk->bhnm", q, k) * (kd**-0.5)
            att = jax.nn.softmax(att.astype(jnp.float32), axis=-1).astype(v.dtype)
            y = jnp.einsum("bhnm,bmhk->bnhk", att, v).reshape(b, g * g, d)
            h = h + y @ lp.o + lp.o_b
            y = _layer_norm(h, lp.ln2_w, lp.ln2_b, vcfg.eps)
            y = jax.nn.gelu(y @ lp.fc1 + lp.fc1_b, approximate=vcfg.act == "gelu_tanh")
            h = h + y @ lp.fc2 + lp.fc2_b
    h = _layer_norm(h, params.post_w, params.post_b, vcfg.eps)
    with jax.named_scope("projector"):
        t = int(round(vcfg.tokens_per_image**0.5))
        k = g // t
        h = h.reshape(b, t, k, t, k, d).mean(axis=(2, 4)).reshape(b, t * t, d)
        hf = h.astype(jnp.float32)
        hf = hf * jax.lax.rsqrt(jnp.mean(hf * hf, -1, keepdims=True) + vcfg.eps)
        h = (hf * (1.0 + params.proj_norm.astype(jnp.float32))).astype(h.dtype)
        return h @ params.proj


class ImageEncoder:
    """The model's image encoder on the device: `embeds(rgb)` -> numpy [tokens_per_image, e]."""

    # Gemma 3: the text model attends bidirectionally within each image (HF's token_type_ids)
    bidirectional = True

    def __init__(self, vcfg: VisionConfig, params: VisionParams, spec: VisionSpec) -> None:
        self.vcfg, self.params, self.spec = vcfg, params, spec
        self._jit = jax.jit(encode, static_argnums=1)
        self.num_encoded = 0  # images run through the encoder (cache misses)

    def embeds(self, rgb: np.ndarray) -> np.ndarray:
        """u8[H, W, 3] resized image -> f32[tokens_per_image, e] (one encoder call)."""
        px = pixel_values(rgb, self.spec)[None]
        self.num_encoded += 1
        return np.asarray(self._jit(self.params, self.vcfg, px)[0], np.float32)


def load_encoder(model: Any, *, dtype: Any = None) -> ImageEncoder | None:
    """The image encoder of a loaded vision-language model (`jaxinfer.loader.LoadedModel`): its
    weights from the HF safetensors, random ones with `load_format="dummy"`, in `dtype` (default:
    the language model's, `model.dtype`); None for a text-only model or a source without the
    vision tensors (orbax, GGUF: served as text only)."""
    spec = vision_spec(model.path, model.hf_config or {})
    if spec is None:
        return None
    dtype = jnp.dtype(dtype or model.dtype)
    if model.source not in ("hf", "dummy"):
        log.warning(
            "%s: %s source has no vision tensors: images are refused", model.path, model.source
        )
        return None
    if model.hf_config.get("model_type") == "qwen2_5_vl":
        from jaxinfer.vision.qwen2_5_vl import load_qwen_encoder

        return load_qwen_encoder(model, spec, dtype)
    vcfg = VisionConfig.from_hf(model.hf_config)
    if model.source == "dummy":
        return ImageEncoder(vcfg, random_params(vcfg, dtype=dtype), spec)
    with HFCheckpoint(model.path) as ckpt:
        params = params_from_hf(vcfg, ckpt.tensor_names(), ckpt.tensor, dtype)
    return ImageEncoder(vcfg, params, spec)
