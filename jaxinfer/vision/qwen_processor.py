"""Qwen2.5-VL's image processing on Pillow + numpy (no JAX: the front end runs it).

1. `QwenVisionSpec.from_qwen(config, preprocessor)`: patch size, merge size, temporal patch size,
   min / max pixels, CLIP mean / std (`preprocessor_config.json`) and the image token ids.
2. `resize(image)` -> u8[H, W, 3]: `smart_resize` (both sides multiples of patch * merge, the
   pixel count within [min_pixels, max_pixels], the aspect ratio kept) then Pillow's bicubic
   filter, as HF's Qwen2-VL image processor; this is what travels to the engine core.
3. `image_run(rgb)`: `<|vision_start|>` + `<|image_pad|>` x (grid_h * grid_w / merge^2) +
   `<|vision_end|>`, which replaces each placeholder `<|vision_start|><|image_pad|><|vision_end|>`
   (what the chat template writes for an image part).
4. `patches(rgb, spec)` -> (f32[grid_h * grid_w, C * T * P * P], (1, grid_h, grid_w)): rescaled,
   normalized and cut into patches in HF's order (merge blocks row-major, the patches of a block
   row-major inside it, each patch's values (channel, time, y, x) with the image repeated over
   the `temporal_patch_size` frames): the encoder's input (`jaxinfer.vision.qwen2_5_vl`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxinfer.vision.processor import ImageError, VisionSpec

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with height * width within
    [min_pixels, max_pixels], the aspect ratio kept as closely as possible (HF's rule)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image aspect ratio {max(height, width) / min(height, width):.0f} > 200")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenVisionSpec(VisionSpec):
    image_size: int = 0  # unused: each image keeps its own (smart-resized) size
    tokens_per_image: int = 0  # unused: grid_h * grid_w / merge^2 per image
    image_token_id: int = 151655
    boi_token: str = "<|vision_start|><|image_pad|><|vision_end|>"  # the placeholder
    image_token: str = "<|image_pad|>"
    start_token: str = "<|vision_start|>"
    eoi_token: str = "<|vision_end|>"
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def from_qwen(cls, config: dict[str, Any], preprocessor: dict[str, Any] | None = None):
        vc, pre = config["vision_config"], preprocessor or {}
        size = pre.get("size") or {}
        return cls(
            image_token_id=int(config.get("image_token_id", 151655)),
            mean=tuple(pre.get("image_mean", CLIP_MEAN)),
            std=tuple(pre.get("image_std", CLIP_STD)),
            rescale=float(pre.get("rescale_factor", 1 / 255)),
            patch_size=int(pre.get("patch_size", vc.get("patch_size", 14))),
            merge_size=int(pre.get("merge_size", vc.get("spatial_merge_size", 2))),
            temporal_patch_size=int(
                pre.get("temporal_patch_size", vc.get("temporal_patch_size", 2))
            ),
            min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
            max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280),
        )

    def resize(self, image: Any) -> np.ndarray:
        from PIL import Image

        image = image.convert("RGB")
        try:
            h, w = smart_resize(
                image.height,
                image.width,
                self.patch_size * self.merge_size,
                self.min_pixels,
                self.max_pixels,
            )
        except ValueError as e:
            raise ImageError(f"image: {e}", "image") from None
        return np.asarray(image.resize((w, h), Image.Resampling.BICUBIC))

    def grid(self, rgb_shape: tuple[int, ...]) -> tuple[int, int]:
        """(grid_h, grid_w): patches down and across a resized image of shape (H, W, ...)."""
        return rgb_shape[0] // self.patch_size, rgb_shape[1] // self.patch_size

    def tokens_for(self, rgb: np.ndarray | None) -> int:
        if rgb is None:
            raise ValueError("a Qwen2.5-VL image run needs the resized image")
        gh, gw = self.grid(rgb.shape)
        return gh * gw // self.merge_size**2

    def image_run(self, rgb: np.ndarray | None = None) -> str:
        return f"{self.start_token}{self.image_token * self.tokens_for(rgb)}{self.eoi_token}"


def patches(rgb: np.ndarray, spec: QwenVisionSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """u8[H, W, 3] resized image -> (f32[gh * gw, 3 * T * P * P] normalized patches in HF's
    order, image_grid_thw (1, gh, gw))."""
    x = rgb.astype(np.float32) * np.float32(spec.rescale)
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    gh, gw = spec.grid(rgb.shape)
    x = x.transpose(2, 0, 1).reshape(3, gh // m, m, p, gw // m, m, p)
    x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, py, px)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], t, p, p))
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)
