"""Images in (`jaxinfer.vision`): a tiny random Gemma3ForConditionalGeneration against HF.

1. The processor's pixel values equal HF's Gemma3 image processor's (PIL backend).
2. `LLM.generate({"prompt_token_ids": ..., "multi_modal_data": {"image": ...}})`: prompt and
   next-token logprobs with one image, two images and none (one batch, chunked) equal HF's run
   with the processor's `token_type_ids` (an image's tokens attend to each other, also in the
   sliding-window layers), on the compiled CPU kernel and the reference backend; a prompt whose
   image straddles the token budget is cut before the image (never split over two chunks);
   `max_num_encoder_input_tokens` of one image spreads a step's images over steps.
3. Bad images raise `ImageError` naming the field; chat content parts place the placeholders.
4. The language model on a `tensor=2` mesh (the encoder on one device) and with int8 weights:
   the unsharded f32 engine's greedy tokens, logprobs within 1e-4 / the int8 bound.
5. `load_encoder(model)` builds the tower in the loaded model's dtype (bf16 for a bf16 model).
(The prefix cache's image keys: `tests/test_served_vision.py`.)
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from vision_utils import BOI, EOI, IMAGE_TOKEN, TOKENS_PER_IMAGE, make_hf_vlm, png_bytes

from jaxinfer.sampling_params import SamplingParams
from jaxinfer.vision.processor import ImageError, VisionSpec, pixel_values, resized

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")

# one image's encoder tokens per step: the two-image prompt's images go in two steps
ENGINE = dict(
    max_model_len=64,
    max_num_seqs=3,
    max_num_batched_tokens=32,
    num_pages=32,
    max_num_encoder_input_tokens=TOKENS_PER_IMAGE,
)


def _image(seed: int):
    return Image.open(io.BytesIO(png_bytes(seed)))


def _run(n_images: int, start: int = 2, text: int = 3) -> list[int]:
    """Prompt ids with `n_images` image runs (`<boi> soft*4 <eoi>`) after `text` text tokens."""
    ids = [start, 17, 33] + [60 + i % 50 for i in range(text - 3)]
    for i in range(n_images):
        ids += [BOI] + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [EOI, 40 + i]
    return ids + [9, 71]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from jaxinfer.llm import LLM

    path = str(tmp_path_factory.mktemp("gemma3-vlm"))
    model = make_hf_vlm(path)
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, **ENGINE)
    return model, llm, path


def test_pixel_values_match_hf():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    spec = VisionSpec(image_size=16, tokens_per_image=4, image_token_id=IMAGE_TOKEN)
    hf = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
    img = _image(3)
    want = hf(images=[img], return_tensors="np")["pixel_values"][0]
    got = pixel_values(resized(img, spec), spec)
    assert got.shape == want.shape == (3, 16, 16)
    np.testing.assert_allclose(got, want, atol=1e-5)


def _hf_logprobs(model, ids: list[int], images: list) -> np.ndarray:
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    kwargs = {"token_type_ids": torch.tensor([[int(t == IMAGE_TOKEN) for t in ids]])}
    if images:
        hf = Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
        px = hf(images=images, return_tensors="np")["pixel_values"]
        kwargs["pixel_values"] = torch.tensor(px)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), **kwargs).logits[0].float()
    return torch.log_softmax(logits, -1).numpy()


def test_logprobs_match_hf(tiny):
    """No image, one and two images, batched in one generate call."""
    model, llm, _ = tiny
    cases = [(_run(n), [_image(i) for i in range(n)]) for n in (0, 1, 2)]
    prompts = [
        {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids
        for ids, images in cases
    ]
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, prompt_logprobs=0)
    encoder = llm.engine.core.runner.images.encoder
    encoded = encoder.num_encoded
    outs = llm.generate(prompts, sp)
    # image 0 is in two prompts (one step or two: one image's encoder tokens a step): encoded
    # once (by its hash), then reused
    assert encoder.num_encoded - encoded == 2
    for (ids, images), out in zip(cases, outs, strict=True):
        _assert_matches_hf(model, ids, images, out)


def _assert_matches_hf(model, ids: list[int], images: list, out) -> None:
    ref = _hf_logprobs(model, ids, images)
    for pos in range(1, len(ids)):  # each prompt token's logprob given the tokens before it
        (lp,) = out.prompt_logprobs[pos].values()
        assert abs(lp - ref[pos - 1, ids[pos]]) < 1e-3, (len(images), pos)
    for tok, lp in out.outputs[0].logprobs[0].items():
        assert abs(lp - ref[-1, tok]) < 1e-3, len(images)
    assert out.outputs[0].token_ids[0] == int(ref[-1].argmax())


def test_an_image_straddling_the_budget_goes_whole_in_the_next_chunk(tiny):
    """The image's tokens are positions 29..32 of a 36-token prompt and the budget is 32 tokens:
    the first chunk ends at 29, before the image (its tokens attend to each other). A prefix-cache
    hit that ends inside the image computes the rest of it in one chunk."""
    model, llm, _ = tiny
    ids = _run(1, text=28)
    assert ids[29:33] == [IMAGE_TOKEN] * TOKENS_PER_IMAGE
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5, prompt_logprobs=0)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": [_image(4)]}}
    (out,) = llm.generate([prompt], sp)
    _assert_matches_hf(model, ids, [_image(4)], out)
    # again, without prompt logprobs: its first 2 pages (32 tokens) hit the prefix cache, so it
    # starts inside the image (tokens 29..31 cached, computed seeing the whole image)
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    (again,) = llm.generate([prompt], sp)
    assert again.usage.cached_prompt_tokens == 32
    ref = _hf_logprobs(model, ids, [_image(4)])
    for tok, lp in again.outputs[0].logprobs[0].items():
        assert abs(lp - ref[-1, tok]) < 1e-3


def test_bad_images_are_refused(tiny, monkeypatch):
    _, llm, _ = tiny
    sp = SamplingParams(max_tokens=1)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)  # 24 x 29 px: over 2x, a "bomb"
    with pytest.raises(ImageError, match="decompression bomb"):
        llm.generate({"prompt_token_ids": _run(1), "multi_modal_data": {"image": png_bytes(0)}}, sp)
    monkeypatch.undo()
    with pytest.raises(ImageError, match="not a decodable image") as e:
        llm.generate({"prompt_token_ids": _run(1), "multi_modal_data": {"image": b"nope"}}, sp)
    assert e.value.field == "multi_modal_data.image[0]"
    with pytest.raises(ImageError, match="without --allowed-local-media-path") as e:
        llm.generate({"prompt_token_ids": _run(1), "multi_modal_data": {"image": "file:///x"}}, sp)
    assert e.value.field == "multi_modal_data.image[0]"
    with pytest.raises(ImageError, match="image token run"):  # 2 images, 1 run
        llm.generate(
            {"prompt_token_ids": _run(1), "multi_modal_data": {"image": [_image(0)] * 2}}, sp
        )


def test_file_urls_under_the_allowed_local_media_path(tiny, tmp_path, monkeypatch):
    """`LLM(allowed_local_media_path=DIR)`'s connector: a `file://` URL under DIR is the image
    its bytes are (the same tokens and logprobs); one leaving DIR through `..` is refused."""
    from jaxinfer.vision.media import MediaConnector

    _, llm, _ = tiny
    (tmp_path / "media").mkdir()
    (tmp_path / "media" / "a.png").write_bytes(png_bytes(3))
    monkeypatch.setattr(llm, "media", MediaConnector(tmp_path / "media"))
    sp = SamplingParams(max_tokens=2, temperature=0.0, logprobs=2)
    url, raw = f"file://{tmp_path}/media/a.png", png_bytes(3)
    by_url, by_bytes = llm.generate(
        [{"prompt_token_ids": _run(1), "multi_modal_data": {"image": im}} for im in (url, raw)], sp
    )
    assert by_url.outputs[0].token_ids == by_bytes.outputs[0].token_ids
    # NOTE: one image a step (ENGINE's encoder budget): the second prompt runs in a later step,
    # on the first one's cached pages, so its logprobs may differ in the last f32 bits
    for a, b in zip(by_url.outputs[0].logprobs, by_bytes.outputs[0].logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-5 for t in a)
    with pytest.raises(ImageError, match="outside --allowed-local-media-path"):
        image = f"file://{tmp_path}/media/../media/../a.png"
        llm.generate({"prompt_token_ids": _run(1), "multi_modal_data": {"image": image}}, sp)


def test_chat_parts_place_the_images():
    """`LLM.chat`'s content parts: each image part becomes the placeholder where it sits."""
    from vision_utils import data_url

    from jaxinfer.vision.processor import chat_parts, expand_prompt

    spec = VisionSpec(image_size=16, tokens_per_image=2, image_token_id=IMAGE_TOKEN)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "A: "},
            {"type": "image_url", "image_url": {"url": data_url(0)}},
            {"type": "text", "text": " B: "},
            {"type": "image_pil", "image_pil": _image(1)},
        ]},
    ]  # fmt: skip
    flat, images = chat_parts(msgs, spec)
    assert flat[1]["content"] == "A: <start_of_image> B: <start_of_image>" and len(images) == 2
    run = "\n\n<start_of_image><image_soft_token><image_soft_token><end_of_image>\n\n"
    assert expand_prompt(flat[1]["content"], spec, 2) == f"A: {run} B: {run}"
    with pytest.raises(ImageError) as e:
        chat_parts(msgs, None)
    assert e.value.field == "messages[1].content[1]"


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, tol", [({"mesh": "tensor=2"}, 1e-4), ({"quantization": "int8"}, 0.05)]
)
def test_tensor_parallel_and_int8_language_model_with_images(tiny, monkeypatch, options, tol):
    """One and two images: a `tensor=2` mesh (the vision tower runs on the mesh's first device,
    its rows enter the sharded step) gives the one-device f32 tokens and logprobs within 1e-4;
    int8 weights (the language model's; the tower stays f32) the same tokens, logprobs within
    0.05 (int8 on the tiny Gemma 3: <= 0.035 of the logit scale, tests/test_quantization.py)."""
    import jax

    from jaxinfer.llm import LLM

    _, llm, path = tiny
    devices = jax.devices()
    # NOTE: LLM(mesh=) spans every device; the suite has 8 virtual ones, this mesh takes 2
    monkeypatch.setattr(jax, "devices", lambda *a, **k: devices[:2])
    other = LLM(path, dtype="float32", skip_tokenizer_init=True, **ENGINE, **options)
    prompts = [
        {"prompt_token_ids": _run(n, start=2 + n), "multi_modal_data": {"image": images}}
        for n, images in ((1, [_image(3)]), (2, [_image(4), _image(5)]))
    ]
    sp = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3)
    for want, got in zip(llm.generate(prompts, sp), other.generate(prompts, sp), strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for w, g in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
            assert max(abs(w[t] - g[t]) for t in w.keys() & g.keys()) < tol, options
    from jaxinfer.quantization import quantization_of

    core = other.engine.core
    assert core.mesh.shape["tensor"] == (2 if "mesh" in options else 1)
    assert quantization_of(core.runner.params) == options.get("quantization")


def test_the_encoder_runs_in_the_language_models_dtype(tiny):
    """`load_encoder(model)` (what the engine and `scripts/serve.py` call) builds the tower in the
    loaded model's dtype: bfloat16 weights for a bfloat16 model, whose image rows stay within
    bfloat16's precision of the f32 tower's; an explicit dtype still wins."""
    import jax.numpy as jnp

    from jaxinfer.loader import load_model
    from jaxinfer.vision.encoder import load_encoder

    _, llm, path = tiny
    model = load_model(path, dtype="bfloat16", skip_tokenizer_init=True)
    encoder = load_encoder(model)
    assert encoder.params.patch.dtype == jnp.bfloat16
    assert load_encoder(model, dtype=jnp.float32).params.patch.dtype == jnp.float32
    f32 = llm.engine.core.runner.images.encoder
    assert f32.params.patch.dtype == jnp.float32
    rgb = np.asarray(resized(_image(6).convert("RGB"), f32.spec))
    want, got = f32.embeds(rgb), encoder.embeds(rgb)
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=0.05 * np.abs(want).max())
