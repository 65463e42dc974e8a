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
