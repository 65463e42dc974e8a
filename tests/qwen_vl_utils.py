"""Tiny Qwen2.5-VL checkpoints for the image tests (`tests/test_qwen_vl.py`)."""

from __future__ import annotations

import json

from model_utils import BASE

IMAGE_PAD, VISION_START, VISION_END = 250, 251, 252  # inside the tiny vocab (256)
PATCH, MERGE, WINDOW = 14, 2, 56  # windows of 2x2 merged tokens (4x4 patches)
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=PATCH,
    spatial_merge_size=MERGE,
    temporal_patch_size=2,
    window_size=WINDOW,
    fullatt_block_indexes=[1],
    out_hidden_size=BASE["hidden_size"],
)
MIN_PIXELS, MAX_PIXELS = 28 * 28, 28 * 28 * 16  # up to 16 merged tokens per image


def qwen_vl_config() -> dict:
    text = {k: v for k, v in BASE.items()}
    text.update(
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        model_type="qwen2_5_vl_text",
    )
    return dict(
        text_config=text,
        vision_config={**VISION, "model_type": "qwen2_5_vl"},
        image_token_id=IMAGE_PAD,
        video_token_id=253,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
    )


def preprocessor_config() -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS,
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }


def make_hf_qwen_vl(path: str, seed: int = 0):
    """A random f32 Qwen2_5_VLForConditionalGeneration saved at `path` (with its
    preprocessor_config.json); returns the torch model."""
    import torch
    import transformers

    config = transformers.Qwen2_5_VLConfig(**qwen_vl_config())
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name or name.endswith("ln_q.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    with open(f"{path}/preprocessor_config.json", "w") as f:
        json.dump(preprocessor_config(), f)
    return model


def tiny_qwen_vl_dir(root) -> str:
    """`served_utils.tiny_model_dir` (the SmolLM2 tokenizer) made a tiny Qwen2.5-VL for
    `--load-format dummy`: its config replaced, the three image tokens added after the vocab."""
    from served_utils import tiny_model_dir

    d = tiny_model_dir(root)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = 49152  # the SmolLM2 vocabulary; the image tokens follow it
    for i, s in enumerate(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"]):
        tok["added_tokens"].append(
            {"id": vocab + i, "content": s, "single_word": False, "lstrip": False,
             "rstrip": False, "normalized": False, "special": True}
        )  # fmt: skip
    (d / "tokenizer.json").write_text(json.dumps(tok))
    cfg = {"model_type": "qwen2_5_vl", "architectures": ["Qwen2_5_VLForConditionalGeneration"]}
    cfg.update(qwen_vl_config(), image_token_id=vocab)
    cfg.update(vision_start_token_id=vocab + 1, vision_end_token_id=vocab + 2)
    cfg["text_config"] = {**cfg["text_config"], "vocab_size": vocab + 3, "eos_token_id": 2}
    (d / "config.json").write_text(json.dumps(cfg))
    pre = {**preprocessor_config(), "min_pixels": 56 * 56}  # >= a 4x4 patch grid
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    return str(d)
