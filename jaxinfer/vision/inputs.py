"""`ImageInput`: one image of a request as the engine core receives it (plain data, no JAX).

NOTE: `offset` / `length` are prompt positions: the request's tokens there are placeholders whose
embeddings the runner replaces by the image's encoder output rows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple


class ImageInput(NamedTuple):
    offset: int  # first placeholder position in the prompt
    length: int  # placeholder tokens (= encoder output rows)
    digest: str  # sha256 of the resized pixels: the encoder cache and prefix-cache key
    pixels: bytes  # u8[height, width, 3] resized RGB
    shape: tuple[int, int]  # (height, width)

    def to_wire(self) -> list:
        return [self.offset, self.length, self.digest, self.pixels, list(self.shape)]

    @classmethod
    def from_wire(cls, w: Sequence) -> ImageInput:
        return cls(int(w[0]), int(w[1]), str(w[2]), bytes(w[3]), (int(w[4][0]), int(w[4][1])))


def images_salt(cache_salt: str | None, images: Sequence[ImageInput]) -> str | None:
    """The prefix-cache salt of a request with `images`: its own salt and every image's hash and
    place, so two prompts share pages only with the same images at the same positions."""
    if not images:
        return cache_salt
    h = hashlib.sha256((cache_salt or "").encode())
    for im in images:
        h.update(f"|{im.offset}:{im.length}:{im.digest}".encode())
    return "mm:" + h.hexdigest()


def fit_images(
    images: Sequence[ImageInput], start: int, n: int, encoder_left: int
) -> tuple[int, int]:
    """(tokens, encoder tokens): a prefill chunk of tokens [start, start + n) cut so that no image
    is split over two chunks (its tokens attend to each other, so the later ones' K/V must be
    written in the step the earlier ones run) and the images it covers need at most
    `encoder_left` encoder tokens; the chunk then ends before the first image that does not fit
    (0 tokens: none fit this step)."""
    used = 0
    for im in images:
        end = im.offset + im.length
        if end <= start or im.offset >= start + n:
            continue
        if end > start + n or used + im.length > encoder_left:
            return max(im.offset - start, 0), used
        used += im.length
    return n, used


def check_image_budget(images: Sequence[ImageInput], sched) -> None:
    """Raises naming image i when its tokens exceed what one step of scheduler `sched` can
    compute or encode (`max_num_batched_tokens`, `long_prefill_token_threshold`,
    `max_num_encoder_input_tokens`)."""
    from jaxinfer.sampling_params import FieldError

    for i, im in enumerate(images):
        for name in (
            "max_num_batched_tokens",
            "long_prefill_token_threshold",
            "max_num_encoder_input_tokens",
        ):
            limit = getattr(sched, name)
            if limit and im.length > limit:
                raise FieldError(
                    f"multi_modal_data.image[{i}]",
                    f": the image's {im.length} tokens must be computed in one step, more than "
                    f"{name}={limit}; raise {name}",
                )
