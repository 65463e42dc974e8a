"""Image preprocessing and prompt placeholders on Pillow + numpy (no JAX: the front end runs it).

1. `VisionSpec.from_hf(config, preprocessor)`: what a vision-language checkpoint needs from its
   `config.json` (and `preprocessor_config.json`): image size, soft tokens per image, the
   placeholder token ids and strings, mean / std (Qwen2.5-VL: `qwen_processor.QwenVisionSpec`,
   whose resize and image runs depend on the image's size). None for a text-only model; another
   vision architecture is refused by name.
2. `load_image(obj, field, media)`: a PIL image, raw bytes, a `data:image/...;base64,` URL or a
   `file://` / `http(s)://` URL (read by `media`, a `jaxinfer.vision.media.MediaConnector`, under
   its rules) -> an RGB PIL image (`ImageError` naming `field` when it is not one).
3. `resized(image, spec)` -> u8[H, W, 3]: the HF image processor's resize (`spec.resize`: Gemma 3's
   bilinear square; Qwen2.5-VL's smart resize, bicubic) (what travels
   to the engine core); `pixel_values(u8, spec)` -> f32[3, H, W]: rescaled and normalized (the
   core does this before the encoder).
4. `expand_prompt(text, spec, n)`: each of the first `n` image placeholders (`<start_of_image>`)
   becomes the model's whole image run (`\\n\\n<start_of_image>` + soft tokens +
   `<end_of_image>\\n\\n`), as HF's Gemma3Processor writes it; `image_inputs(ids, spec, images)`
   finds each run of soft tokens in the tokenized prompt and makes its `ImageInput`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import json
import os
from typing import Any

import numpy as np

from jaxinfer.vision.inputs import ImageInput

SUPPORTED = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",  # `jaxinfer.vision.qwen_processor`
}
# Vision-language architectures we know by name but do not serve (yet).
REFUSED = ("qwen2_vl", "qwen3_vl", "llava", "mllama", "paligemma", "idefics3", "internvl")


class ImageError(ValueError):
    """A bad image: not decodable, not a data URL, too many. `field` names the request field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    image_size: int  # square side the image is resized to
    tokens_per_image: int  # soft tokens (embeddings) of one image
    image_token_id: int  # `<image_soft_token>`: one per embedding row
    boi_token: str = "<start_of_image>"  # the placeholder a prompt / chat template writes
    image_token: str = "<image_soft_token>"
    eoi_token: str = "<end_of_image>"
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale: float = 1 / 255

    @classmethod
    def from_hf(cls, config: dict[str, Any], preprocessor: dict[str, Any] | None = None):
        """The spec of a vision-language `config.json` (None: a text-only model)."""
        mt = config.get("model_type")
        if mt in REFUSED:
            raise ValueError(f"vision architecture model_type={mt!r} is not supported yet")
        if mt not in SUPPORTED or not isinstance(config.get("vision_config"), dict):
            return None
        if mt == "qwen2_5_vl":
            from jaxinfer.vision.qwen_processor import QwenVisionSpec

            return QwenVisionSpec.from_qwen(config, preprocessor)
        vc = config["vision_config"]
        pre = preprocessor or {}
        size = pre.get("size") or {}
        side = int(size.get("height", vc.get("image_size", 224)))
        return cls(
            image_size=side,
            tokens_per_image=int(config.get("mm_tokens_per_image", 256)),
            image_token_id=int(config.get("image_token_index", config.get("image_token_id", 0))),
            mean=tuple(pre.get("image_mean", (0.5, 0.5, 0.5))),
            std=tuple(pre.get("image_std", (0.5, 0.5, 0.5))),
            rescale=float(pre.get("rescale_factor", 1 / 255)),
        )

    def image_run(self, rgb: np.ndarray | None = None) -> str:
        """The text one image (u8[H, W, 3] resized) becomes in the prompt (HF Gemma3Processor's
        `full_image_sequence`)."""
        soft = self.image_token * self.tokens_for(rgb)
        return f"\n\n{self.boi_token}{soft}{self.eoi_token}\n\n"

    def tokens_for(self, rgb: np.ndarray | None) -> int:
        """Soft tokens of one resized image (fixed for Gemma 3)."""
        return self.tokens_per_image

    def resize(self, image: Any) -> np.ndarray:
        """u8[H, W, 3]: the image bilinearly resized to the model's square (the HF processor's)."""
        from PIL import Image

        side = self.image_size
        return np.asarray(image.convert("RGB").resize((side, side), Image.Resampling.BILINEAR))


def load_image(obj: Any, field: str, media: Any = None) -> Any:
    """A PIL image, bytes, a `data:` URL, or a `file://` / `http(s)://` URL read by `media` (a
    `MediaConnector`; None: the default one, which fetches http(s) and reads no files) -> an RGB
    PIL image (ImageError naming `field`)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ImageError(
            f"{field}: images need Pillow (pip install 'jaxinfer[vision]')", field
        ) from None

    if isinstance(obj, Image.Image):
        return obj.convert("RGB")
    if isinstance(obj, str) and not obj.startswith("data:"):
        if media is None:
            from jaxinfer.vision.media import MediaConnector

            media = MediaConnector()
        obj = media.get(obj, field)
    if isinstance(obj, str):
        head, sep, payload = obj.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ImageError(f"{field}: a data URL must be data:<mime>;base64,<data>", field)
        try:
            obj = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{field}: the data URL's base64 payload is invalid", field) from None
    if not isinstance(obj, (bytes, bytearray)):
        raise ImageError(f"{field}: expected an image, got {type(obj).__name__}", field)
    try:
        image = Image.open(io.BytesIO(obj))
        image.load()
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as e:
        raise ImageError(f"{field}: not a decodable image ({e})", field) from None
    return image.convert("RGB")


def resized(image: Any, spec: VisionSpec) -> np.ndarray:
    """u8[H, W, 3]: the image resized as the model's HF image processor does (`spec.resize`)."""
    return spec.resize(image)


def pixel_values(rgb: np.ndarray, spec: VisionSpec) -> np.ndarray:
    """f32[3, H, W] from u8[H, W, 3]: rescaled to [0, 1], normalized by mean / std."""
    x = rgb.astype(np.float32) * np.float32(spec.rescale)
    x = (x - np.asarray(spec.mean, np.float32)) / np.asarray(spec.std, np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1))


def expand_prompt(
    text: str,
    spec: VisionSpec,
    num_images: int,
    field: str = "prompt",
    images: list[np.ndarray] | None = None,
) -> str:
    """Each image placeholder of `text` -> the model's image run (sized by the resized `images`
    where the run depends on the image: Qwen2.5-VL); their count must be `num_images`
    (ImageError naming `field`)."""
    found = text.count(spec.boi_token)
    if found != num_images:
        raise ImageError(
            f"{field}: {num_images} image(s) given but the prompt holds {found} "
            f"{spec.boi_token} placeholder(s)",
            field,
        )
    pieces = text.split(spec.boi_token)
    runs = [spec.image_run(images[i] if images else None) for i in range(num_images)]
    return pieces[0] + "".join(run + piece for run, piece in zip(runs, pieces[1:]))


def image_inputs(
    ids: list[int], spec: VisionSpec, images: list[np.ndarray], field: str = "prompt"
) -> list[ImageInput]:
    """The `ImageInput` of each image: the runs of `image_token_id` in `ids`, in order, paired
    with the resized images (ImageError naming `field` when they do not match)."""
    arr = np.asarray(ids, np.int64)
    is_img = arr == spec.image_token_id
    starts = np.flatnonzero(is_img & ~np.concatenate([[False], is_img[:-1]]))
    ends = np.flatnonzero(is_img & ~np.concatenate([is_img[1:], [False]])) + 1
    want = [spec.tokens_for(rgb) for rgb in images]
    if len(starts) != len(images) or list(ends - starts) != want:
        raise ImageError(
            f"{field}: the tokenized prompt holds {len(starts)} image token run(s) of "
            f"{(ends - starts).tolist()} tokens for {len(images)} image(s) of {want} tokens",
            field,
        )
    out = []
    for lo, n, rgb in zip(starts.tolist(), want, images):
        rgb = np.ascontiguousarray(rgb, np.uint8)
        digest = hashlib.sha256(rgb.tobytes()).hexdigest()
        out.append(ImageInput(lo, n, digest, rgb.tobytes(), rgb.shape[:2]))
    return out


def with_images(
    prompt: str | list[int],
    images: Any,
    spec: VisionSpec | None,
    encode: Any,
    *,
    field: str = "multi_modal_data.image",
    limit: int | None = None,
    media: Any = None,
) -> tuple[list[int], list[ImageInput]]:
    """A prompt (text with one placeholder per image, or ids already holding each image's run of
    soft tokens) and its images (one or a list: PIL, bytes, URLs read by `media`) -> (prompt
    ids, their `ImageInput`s); `encode(text) -> ids` tokenizes. ImageError naming `field` when the model
    takes no images, there are more than `limit`, or one is bad."""
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if spec is None:
        raise ImageError(f"{field}: this model takes no images", field)
    if limit is not None and len(images) > limit:
        raise ImageError(
            f"{field}: {len(images)} images exceed the limit of {limit} per prompt "
            f"(--limit-mm-per-prompt)",
            field,
        )
    rgb = [resized(load_image(im, f"{field}[{i}]", media), spec) for i, im in enumerate(images)]
    if isinstance(prompt, str):
        ids = list(encode(expand_prompt(prompt, spec, len(rgb), field, rgb)))
    else:
        ids = list(prompt)
    return ids, image_inputs(ids, spec, rgb, field)


def vision_spec(path: str, hf_config: dict[str, Any]) -> VisionSpec | None:
    """A checkpoint's `VisionSpec` (its `preprocessor_config.json` read when present)."""
    pre = os.path.join(path, "preprocessor_config.json") if os.path.isdir(path) else ""
    preprocessor = None
    if pre and os.path.exists(pre):
        with open(pre) as f:
            preprocessor = json.load(f)
    return VisionSpec.from_hf(hf_config, preprocessor)


def chat_parts(
    messages: list[dict[str, Any]], spec: VisionSpec | None, media: Any = None
) -> tuple[list[dict[str, Any]], list[Any]]:
    """Chat messages whose `content` may be a list of parts (vLLM's: `text`, `image_url` with a
    URL read by `load_image(..., media)`, `image_pil`) -> messages with string content (each image part the model's
    placeholder) and their images in order (ImageError naming the part)."""
    flat, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            flat.append(m)
            continue
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                texts.append(str(part.get("text", "")))
                continue
            if kind not in ("image_url", "image_pil"):
                raise ImageError(f"{where}: unsupported content part type {kind!r}", where)
            if spec is None:
                raise ImageError(f"{where}: this model takes no images", where)
            image = part.get(kind)
            if kind == "image_url":
                image = image.get("url") if isinstance(image, dict) else image
            texts.append(spec.boi_token)
            images.append(load_image(image, where, media))
        flat.append({**m, "content": "".join(texts)})
    return flat, images
