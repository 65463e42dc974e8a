"""The runner's side of images: encoder outputs cached by image hash, laid into each step.

1. `place(scheduled, step)`: for every scheduled chunk that covers an image's placeholder
   positions, the image's encoder output (computed on first need, then cached by its hash while a
   request holding it is unfinished, so chunked prefill and a second request with the same image
   reuse it) supplies the rows of those positions; they go into `StepInputs.mm_embeds` f32[M, E]
   with their token rows in `mm_rows` i32[M]. M is padded to a power of two (>= 16) with rows
   past T (dropped by the model's scatter): a handful of programs, not one per image layout.
   With a `bidirectional` encoder (Gemma 3) the same steps carry `StepInputs.causal_bound`
   i32[T]: each token's position, an image token's its image's last position (the image's
   tokens attend to each other, as HF's `token_type_ids` mask has it; the scheduler never
   splits an image over two chunks). Qwen2.5-VL's text model attends causally: no bound.
2. `release(finished)` forgets the finished requests; an image no live request holds is dropped.

NOTE: token rows are the scheduled order's cumulative chunk lengths: the step is one ragged group
(images need data = pipeline = 1, which `ModelRunner` checks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from jaxinfer.engine.types import ScheduledRequest
from jaxinfer.step import StepInputs
from jaxinfer.vision.encoder import ImageEncoder


class ImageEmbeds:
    def __init__(self, encoder: ImageEncoder) -> None:
        self.encoder = encoder
        self._cache: dict[str, np.ndarray] = {}  # image hash -> f32[tokens, E]
        self._holders: dict[str, set[str]] = {}  # image hash -> request ids holding it

    def _embeds(self, rid: str, im) -> np.ndarray:
        out = self._cache.get(im.digest)
        if out is None:
            rgb = np.frombuffer(im.pixels, np.uint8).reshape(*im.shape, 3)
            out = self._cache[im.digest] = self.encoder.embeds(rgb)
        self._holders.setdefault(im.digest, set()).add(rid)
        return out

    def place(self, scheduled: Sequence[ScheduledRequest], step: StepInputs) -> StepInputs:
        """`step` with the image rows its chunks cover (unchanged when they cover none)."""
        rows, embeds = [], []
        bound = np.array(step.positions, np.int32)  # i32[T]
        t = 0
        for s in scheduled:
            lo, hi = s.start_pos, s.start_pos + len(s.token_ids) - s.num_spec_tokens
            for im in s.request.mm_inputs:
                a, b = max(lo, im.offset), min(hi, im.offset + im.length)
                if a < b:
                    e = self._embeds(s.request.request_id, im)
                    embeds.append(e[a - im.offset : b - im.offset])
                    rows.append(np.arange(t + a - lo, t + b - lo, dtype=np.int32))
                    end = im.offset + im.length
                    if b != end:  # NOTE: the scheduler keeps an image in one chunk
                        raise RuntimeError(f"image at {im.offset}:{end} split at {b}")
                    bound[rows[-1]] = end - 1
            t += len(s.token_ids)
        if not rows:
            return step
        m = sum(len(r) for r in rows)
        width = max(16, 1 << (m - 1).bit_length())
        t_rows = int(np.shape(step.token_ids)[-1])
        mm_rows = np.full(width, t_rows, np.int32)
        mm_rows[:m] = np.concatenate(rows)
        mm_embeds = np.zeros((width, embeds[0].shape[1]), np.float32)
        mm_embeds[:m] = np.concatenate(embeds)
        bound = bound if self.encoder.bidirectional else None
        return step.replace(
            mm_embeds=mm_embeds, mm_rows=mm_rows, causal_bound=bound, decode_only=False
        )

    def release(self, finished: Iterable[str]) -> None:
        done = set(finished)
        if not done or not self._holders:
            return
        for digest in list(self._holders):
            holders = self._holders[digest]
            holders -= done
            if not holders:
                del self._holders[digest]
                self._cache.pop(digest, None)
