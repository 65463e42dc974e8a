"""Tiny Gemma 3 vision-language checkpoints for the image tests (`tests/test_vision.py`,
`tests/test_served_vision.py`)."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from model_utils import hf_config_dict

IMAGE_TOKEN, BOI, EOI = 250, 251, 252  # inside the tiny vocab (256)
VISION = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=16,
    patch_size=4,
)
TOKENS_PER_IMAGE = 4  # a 4x4 patch grid pooled 2x2


def gemma3_vlm_config() -> dict:
    text = {k: v for k, v in hf_config_dict("gemma3").items() if k != "model_type"}
    return dict(
        text_config={**text, "model_type": "gemma3_text"},
        vision_config={**VISION, "model_type": "siglip_vision_model"},
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=IMAGE_TOKEN,
        boi_token_index=BOI,
        eoi_token_index=EOI,
    )


def make_hf_vlm(path: str, seed: int = 0):
    """A random f32 Gemma3ForConditionalGeneration saved at `path` (weights scaled so logits and
    image features are far from flat); returns the torch model."""
    import torch
    import transformers

    config = transformers.Gemma3Config(**gemma3_vlm_config())
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and "language_model" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif p.ndim == 1 and "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return model


def tiny_vlm_dir(root) -> str:
    """`served_utils.tiny_model_dir` (the SmolLM2 tokenizer) made a tiny Gemma 3 VLM for
    `--load-format dummy`: its config replaced, the three image tokens added after the vocab."""
    from served_utils import tiny_model_dir

    d = tiny_model_dir(root)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = 49152  # the SmolLM2 vocabulary; the image tokens follow it
    for i, s in enumerate(["<image_soft_token>", "<start_of_image>", "<end_of_image>"]):
        tok["added_tokens"].append(
            {"id": vocab + i, "content": s, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    cfg.update(gemma3_vlm_config(), image_token_index=vocab, boi_token_index=vocab + 1)
    cfg["eoi_token_index"] = vocab + 2
    cfg["text_config"] = {**cfg["text_config"], "vocab_size": vocab + 3, "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def png_bytes(seed: int, size: int = 24) -> bytes:
    """A random RGB PNG."""
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (size, size + 5, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed)).decode()
