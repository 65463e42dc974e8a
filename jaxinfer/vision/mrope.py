"""M-RoPE positions (Qwen2.5-VL) on the host: each token's (t, h, w) rotary position rows.

1. `rope_index(images, patch, merge)` (HF's `get_rope_index` for one prompt): text tokens take
   equal rows counting up; an image's tokens take (start, start + row, start + column) over its
   merged grid, where start is the next text position; the text after an image continues from
   start + max(grid rows, grid columns). It returns the rows of prompt positions [0, E) (E: the
   last image's end) and the request's `rope delta`: every later position p (the prompt's tail,
   decodes, speculative tokens) takes rows p + delta.
2. `MRopePositions.place(scheduled, step)` (the runner, after `ImageEmbeds.place`): when a
   scheduled request holds images, `StepInputs.mrope_positions` i32[3, T] = the plain positions on
   every row, with those requests' rows taken from their tables (computed once per request and
   kept while it lives, so any prefill chunk, a prefix-cache hit or a resumed request reads the
   rows of its own positions). Steps without images keep the field None (the plain program).
3. `release(finished)` forgets the finished requests' tables.

NOTE: token rows follow the scheduled order's cumulative chunk lengths, as in `ImageEmbeds`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from jaxinfer.vision.inputs import ImageInput


def rope_index(images: Sequence[ImageInput], patch: int, merge: int) -> tuple[np.ndarray, int]:
    """(i32[3, E] rows of prompt positions [0, E), E = the last image's end; delta)."""
    parts, cur, end = [], 0, 0
    for im in sorted(images, key=lambda im: im.offset):
        n_text = im.offset - end
        parts.append(np.broadcast_to(np.arange(cur, cur + n_text), (3, n_text)))
        cur += n_text
        gh, gw = im.shape[0] // patch // merge, im.shape[1] // patch // merge
        if gh * gw != im.length:
            raise ValueError(f"image at {im.offset}: {im.length} tokens for a {gh}x{gw} grid")
        hh, ww = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        parts.append(np.stack([np.zeros(gh * gw, np.int64), hh.ravel(), ww.ravel()]) + cur)
        cur += max(gh, gw)
        end = im.offset + im.length
    table = np.concatenate(parts, axis=1).astype(np.int32) if parts else np.zeros((3, 0), np.int32)
    return table, cur - end


class MRopePositions:
    def __init__(self, patch: int, merge: int) -> None:
        self.patch, self.merge = patch, merge
        self._tables: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (rows, delta)

    def rows(self, request, start: int, n: int) -> np.ndarray:
        """i32[3, n]: the M-RoPE rows of `request`'s positions [start, start + n)."""
        rid = request.request_id
        if rid not in self._tables:
            self._tables[rid] = rope_index(request.mm_inputs, self.patch, self.merge)
        table, delta = self._tables[rid]
        p = np.arange(start, start + n)
        inside = p < table.shape[1]
        out = np.broadcast_to(p + delta, (3, n)).astype(np.int32)
        if inside.any():
            out[:, inside] = table[:, p[inside]]
        return out

    def place(self, scheduled: Sequence, step):
        """`step` with `mrope_positions` when a scheduled request holds images (else unchanged)."""
        if not any(s.request.mm_inputs for s in scheduled):
            return step
        positions = np.asarray(step.positions)
        out = np.broadcast_to(positions, (3, positions.shape[-1])).copy()
        t = 0
        for s in scheduled:
            n = len(s.token_ids)
            if s.request.mm_inputs:
                out[:, t : t + n] = self.rows(s.request, s.start_pos, n)
            t += n
        return step.replace(mrope_positions=out)

    def release(self, finished: Iterable[str]) -> None:
        for rid in finished:
            self._tables.pop(rid, None)
