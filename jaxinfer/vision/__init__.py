"""Images in, text out: vision-language models (Gemma 3, Qwen2.5-VL).

1. `processor` (numpy + Pillow, no JAX: the front end imports it): an image (PIL, bytes, a
   `data:` URL, or a `file://` / `http(s)://` URL that `media.MediaConnector` reads under its
   rules) -> the model's resized RGB bytes, the prompt's image placeholders expanded to the
   model's soft-token run, and each image's `ImageInput` (where its tokens sit, its hash).
2. `ImageInput`s ride with the request to the engine core (`CoreRequest.mm_inputs`); their hashes
   salt the request's prefix-cache root, so prompts with different images never share pages.
3. `encoder` (JAX): the vision tower (SigLIP for Gemma 3, average-pooled and projected to the text
   model's width) runs as its own jitted program, one image per call; `ImageEmbeds` in the runner
   caches each image's output by hash while a request holding it lives, and lays the rows a step
   needs into `StepInputs.mm_embeds` / `mm_rows`, which the model scatters over the text
   embeddings.
4. Qwen2.5-VL: `qwen_processor` (smart resize, patches in HF's order, one image run per image
   size), `qwen2_5_vl` (the windowed ViT + patch merger, bucketed patch counts) and `mrope` (the
   text model's (t, h, w) positions from the images' grids, `StepInputs.mrope_positions`).
"""
