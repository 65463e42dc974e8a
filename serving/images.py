"""Images in chat requests: OpenAI `image_url` content parts -> the front end's image inputs.

1. `ChatCompletionRequest.chat(placeholder)` writes the model's image placeholder
   (`<start_of_image>` for Gemma 3) where each image part sits; `image_urls(req)` lists the
   parts' URLs with the field each came from (`messages[i].content[j].image_url.url`).
2. `FrontEnd.tokenize_images` decodes them (`data:` URLs only: the server fetches nothing
   and reads no files; anything else is a 400 naming the field), resizes them
   (`jaxinfer.vision.processor`, no JAX), expands the placeholders in the rendered chat and
   tokenizes it; the request then carries the images to the core (`ImageInput`s). gRPC sends
   encoded image bytes in `GenerateRequest.images` beside a prompt / chat holding placeholders.
"""

from __future__ import annotations

from typing import Any

from serving.errors import InvalidArgument


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
