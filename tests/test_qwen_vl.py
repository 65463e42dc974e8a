"""Qwen2.5-VL (`jaxinfer.vision.qwen2_5_vl`, `qwen_processor`, `mrope`): a tiny random
Qwen2_5_VLForConditionalGeneration against HF.

1. The processor's patches and grids equal HF's Qwen2-VL image processor's (PIL backend), and the
   windowed vision tower's merged tokens equal HF's image features (full and partial windows,
   the full-attention blocks in one query chunk or several).
2. The M-RoPE rows equal HF's `get_rope_index`.
3. `LLM.generate` with no image, one image and two images of different sizes (one batch, chunked
   prefill across the images): prompt logprobs, the next token's and two decoded tokens' (the
   request's rope delta) equal HF's.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from qwen_vl_utils import IMAGE_PAD, VISION_END, VISION_START, make_hf_qwen_vl, preprocessor_config
from vision_utils import png_bytes

from jaxinfer.sampling_params import SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

ENGINE = dict(max_model_len=96, max_num_seqs=3, max_num_batched_tokens=32, num_pages=48)
SIZES = {0: 100, 1: 60, 2: 24, 3: 140}  # seed -> side: grids 8x8, 4x4, 2x2, 6x8 patches


def _image(seed: int):
    return Image.open(io.BytesIO(png_bytes(seed, SIZES[seed])))


def _hf_processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(size=preprocessor_config()["size"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jaxinfer.llm import LLM

    path = str(tmp_path_factory.mktemp("qwen-vl"))
    model = make_hf_qwen_vl(path)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **ENGINE)
    return model, llm


def _prompt(llm, seeds: list[int]) -> list[int]:
    """Prompt ids with one `<|vision_start|> pad*N <|vision_end|>` run per image."""
    spec = llm.vision
    ids = [2, 17, 33]
    for i, seed in enumerate(seeds):
        n = spec.tokens_for(spec.resize(_image(seed)))
        ids += [VISION_START] + [IMAGE_PAD] * n + [VISION_END, 40 + i, 41]
    return ids + [9, 71]


def test_processor_and_encoder_match_hf(tiny):
    from jaxinfer.vision import qwen2_5_vl
    from jaxinfer.vision.processor import resized
    from jaxinfer.vision.qwen_processor import patches

    model, llm = tiny
    spec, encoder = llm.vision, llm.engine.core.runner.images.encoder
    hf = _hf_processor()
    for seed in (0, 3):
        img = _image(seed)
        want = hf(images=[img], return_tensors="pt")
        got, thw = patches(resized(img, spec), spec)
        assert list(thw) == want["image_grid_thw"][0].tolist()
        np.testing.assert_allclose(got, want["pixel_values"].numpy(), atol=1e-5)
        with torch.no_grad():
            feats = model.model.get_image_features(
                want["pixel_values"], want["image_grid_thw"]
            ).pooler_output[0]
        np.testing.assert_allclose(encoder.embeds(resized(img, spec)), feats.numpy(), atol=1e-4)
    # the full-attention blocks in query chunks of two windows (2 chunks of 32 patches)
    encoder.full_chunk = 32
    try:
        np.testing.assert_allclose(encoder.embeds(resized(img, spec)), feats.numpy(), atol=1e-4)
    finally:
        encoder.full_chunk = qwen2_5_vl.FULL_CHUNK


def _hf_inputs(ids: list[int], images: list) -> dict:
    kwargs = {"input_ids": torch.tensor([ids])}
    kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == IMAGE_PAD).int()
    if images:
        px = _hf_processor()(images=images, return_tensors="pt")
        kwargs.update(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
    return kwargs


def test_mrope_rows_match_hf(tiny):
    from jaxinfer.vision.processor import image_inputs

    model, llm = tiny
    images = [_image(0), _image(3)]
    ids = _prompt(llm, [0, 3])
    kw = _hf_inputs(ids, images)
    want, delta = model.model.get_rope_index(
        kw["input_ids"], kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"]
    )
    mm = image_inputs(ids, llm.vision, [llm.vision.resize(im) for im in images])
    mrope = llm.engine.core.runner.mrope

    class Req:
        request_id, mm_inputs = "r", tuple(mm)

    rows = np.concatenate([mrope.rows(Req, 0, 7), mrope.rows(Req, 7, len(ids) + 2 - 7)], 1)
    np.testing.assert_array_equal(rows[:, : len(ids)], want[:, 0].numpy())
    tail = np.broadcast_to(len(ids) + int(delta) + np.arange(2), (3, 2))
    np.testing.assert_array_equal(rows[:, len(ids) :], tail)
    mrope.release(["r"])


def test_logprobs_match_hf(tiny):
    """No image, one image, two images of different sizes, batched in one generate call; two
    decoded tokens after the prompt (positions + the rope delta)."""
    model, llm = tiny
    cases = [(_prompt(llm, s), [_image(i) for i in s]) for s in ([], [0], [1, 3])]
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        for ids, images in cases
    ]
    sp = SamplingParams(max_tokens=3, temperature=0.0, logprobs=2, prompt_logprobs=0)
    outs = llm.generate(prompts, sp)
    for (ids, images), out in zip(cases, outs, strict=True):
        full = ids + out.outputs[0].token_ids[:2]
        with torch.no_grad():
            logits = model(**_hf_inputs(full, images)).logits[0].float()
        ref = torch.log_softmax(logits, -1).numpy()
        for pos in range(1, len(ids)):  # each prompt token's logprob given the tokens before it
            (lp,) = out.prompt_logprobs[pos].values()
            assert abs(lp - ref[pos - 1, ids[pos]]) < 1e-3, (len(images), pos)
        for j, step in enumerate(out.outputs[0].logprobs):  # the next token, then two decodes
            row = len(ids) - 1 + j
            for tok, lp in step.items():
                assert abs(lp - ref[row, tok]) < 1e-3, (len(images), j)
            assert out.outputs[0].token_ids[j] == int(ref[row].argmax()), (len(images), j)
    # the two-image prompt again: a prefix-cache hit, the rest of its prefill and its decodes
    # on the rows of their own positions
    (again,) = llm.generate([prompts[2]], SamplingParams(max_tokens=3, temperature=0.0, logprobs=2))
    assert again.usage.cached_prompt_tokens > 0
    assert again.outputs[0].token_ids == outs[2].outputs[0].token_ids
    for got, want in zip(again.outputs[0].logprobs, outs[2].outputs[0].logprobs, strict=True):
        assert max(abs(got[t] - want[t]) for t in want) < 1e-4


def test_hub_config_layout_parses():
    """The hub's config.json (text fields at the top level, `rope_scaling` type "mrope") and the
    refusal of other vision architectures by name."""
    from jaxinfer.config import ModelConfig
    from jaxinfer.vision.processor import VisionSpec
    from jaxinfer.vision.qwen2_5_vl import QwenVisionConfig

    vision = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
              "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
              "spatial_merge_size": 2, "window_size": 112, "temporal_patch_size": 2,
              "fullatt_block_indexes": [7, 15, 23, 31]}  # fmt: skip
    hub = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
           "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
           "num_hidden_layers": 28, "num_key_value_heads": 4, "vocab_size": 152064,
           "max_position_embeddings": 128000, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
           "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
           "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": 32768,
           "image_token_id": 151655, "vision_config": vision}  # fmt: skip
    cfg = ModelConfig.from_hf(hub)
    assert cfg.mrope_section == (16, 24, 24) and cfg.rope.rope_type == "default"
    assert cfg.qkv_bias and not cfg.o_bias and cfg.rope.theta == 1e6 and cfg.head_dim == 128
    vcfg = QwenVisionConfig.from_hf(hub)
    assert vcfg.fullatt_blocks == (7, 15, 23, 31) and vcfg.patch_dim == 1176
    assert VisionSpec.from_hf(hub).image_token_id == 151655
    with pytest.raises(ValueError, match="qwen2_vl"):
        VisionSpec.from_hf({**hub, "model_type": "qwen2_vl"})
