"""Images in chat requests: OpenAI `image_url` content parts -> the front end's image inputs.

1. `ChatCompletionRequest.chat(placeholder)` writes the model's image placeholder
   (`<start_of_image>` for Gemma 3) where each image part sits; `image_urls(req)` lists the
   parts' URLs with the field each came from (`messages[i].content[j].image_url.url`).
2. `FrontEnd.tokenize_images` first has `ImageFetcher.fetch` read every `file://` /
   `http(s)://` URL (`jaxinfer.vision.media.MediaConnector`'s rules: `--allowed-local-media-path`,
   `--allowed-media-domains`, `VLLM_IMAGE_FETCH_TIMEOUT`, `--max-image-bytes`) concurrently on
   the fetcher's own threads, so a slow host never holds the event loop (nor the tokenizing
   threads) for other clients; any failure is a 400 / INVALID_ARGUMENT naming the part.
3. It then decodes them (`data:` URLs and fetched bytes), resizes them
   (`jaxinfer.vision.processor`, no JAX), expands the placeholders in the rendered chat and
   tokenizes it; the request then carries the images to the core (`ImageInput`s). gRPC sends
   encoded image bytes in `GenerateRequest.images` beside a prompt / chat holding placeholders.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from jaxinfer.vision.media import MediaConnector
from jaxinfer.vision.processor import ImageError
from serving.errors import InvalidArgument

FETCH_THREADS = 8  # URLs fetched / files read at once (beyond: they wait their turn)


class ImageFetcher:
    """`file://` and `http(s)://` image URLs -> their bytes, off the event loop."""

    def __init__(self, media: MediaConnector | None = None) -> None:
        self.media = media or MediaConnector()
        self._pool: ThreadPoolExecutor | None = None

    async def fetch(self, images: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """`(field, image)` pairs with every URL replaced by its bytes (others unchanged), all
        fetched at once; InvalidArgument naming the first failing field."""
        urls = [k for k, (_, im) in enumerate(images) if self.media.is_url(im)]
        if not urls:
            return images
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="image-fetch")
        loop = asyncio.get_running_loop()
        jobs = [loop.run_in_executor(self._pool, self.media.get, images[k][1], images[k][0])
                for k in urls]  # fmt: skip
        # NOTE: `get` checks its own deadline; this one also bounds a fetch waiting for a thread.
        done = await asyncio.gather(
            *(asyncio.wait_for(j, self.media.timeout + 1.0) for j in jobs), return_exceptions=True
        )
        out = list(images)
        for k, got in zip(urls, done):
            field = images[k][0]
            if isinstance(got, ImageError):
                raise InvalidArgument(str(got), got.field) from None
            if isinstance(got, asyncio.TimeoutError):
                raise InvalidArgument(
                    f"{field}: fetching the image timed out after {self.media.timeout:g} s "
                    f"(VLLM_IMAGE_FETCH_TIMEOUT)",
                    field,
                ) from None
            if isinstance(got, Exception):
                raise InvalidArgument(f"{field}: fetching the image failed ({got})", field)
            out[k] = (field, got)
        return out


def image_urls(req: Any) -> list[tuple[str, str]]:
    """(field, url) of every `image_url` part of a chat request, in order."""
    out = []
    for i, m in enumerate(req.messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type != "image_url":
                continue
            where = f"messages[{i}].content[{j}].image_url"
            url = part.image_url.get("url") if isinstance(part.image_url, dict) else None
            if not isinstance(url, str) or not url:
                raise InvalidArgument(f"{where} must be an object with a 'url' string", where)
            out.append((f"{where}.url", url))
    return out
