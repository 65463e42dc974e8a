"""Weight-only quantization of one tensor: symmetric, one scale per output channel.

1. `FORMATS` names the stored formats: "int8" (values in [-127, 127]) and "fp8" (`float8_e4m3fn`,
   values in [-448, 448]). `check_format(name, field)` rejects anything else naming the field.
2. `quantize(w, fmt, axis)` reduces `|w|` over the contraction axis `axis` to one absolute maximum
   per output channel, stores `scale = absmax / qmax` (1 for an all-zero channel) and
   `data = w / scale` rounded to the format; `w ~= data * scale` with the scale broadcast back
   over `axis`. It runs on numpy or JAX arrays (`xp`), so the host loaders and the on-device
   quantizer (a float orbax checkpoint restored then quantized) share one rule.
3. `requantize_rows(read_rows, rows, fmt, read_blocks)` builds the same result for a tensor stored
   row by row in another quantized format (a GGUF block format) without holding it in float32:
   rows are read a chunk at a time (`ROW_CHUNK` rows) and requantized at once.
4. `fold_block_scales(ints, block_scales, fmt)` is the exact path for symmetric block formats
   whose blocks hold `d_b * q` with integer `q` (GGUF Q8_0 / Q4_0 / Q5_0): a row whose block
   scales are all integer multiples of its smallest one, with the products in range, is stored
   as integers times that smallest scale, with no rounding at all; `requantize_rows` re-derives
   the other rows from their dequantized values.
5. `quantize_groups(w, fmt, axis, group_size)` is the same rule with one scale per group of
   `group_size` consecutive input channels instead of one per output channel (the scale keeps
   `axis`, of size K / group_size): what `scripts/simulate_quant.py` measures against the
   per-channel scales on a real model (BENCHMARKS.md). The model's kernels, specs and loaders
   take the per-channel layout only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

FORMATS = ("int8", "fp8")
QMAX = {"int8": 127.0, "fp8": 448.0}
STORAGE = {"int8": np.dtype(np.int8), "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}
ROW_CHUNK = 256


def check_format(fmt: str | None, field: str = "quantization") -> str | None:
    """`fmt` when it is None or one of `FORMATS`; else a ValueError naming `field`."""
    if fmt is None or fmt in FORMATS:
        return fmt
    raise ValueError(f"{field}={fmt!r} is not supported; choose one of {FORMATS} (or None)")


def quantize(w: Any, fmt: str, axis: int, xp: Any = np) -> tuple[Any, Any]:
    """(data, scale): `w` [..] as `fmt` with f32 scales of `w`'s shape without `axis`."""
    check_format(fmt)
    wf = xp.asarray(w).astype(xp.float32)
    absmax = xp.max(xp.abs(wf), axis=axis)
    # NOTE: times the f32 reciprocal, not divided by qmax: XLA rewrites a division by a constant
    # that way, and the host and device quantizers must agree bit for bit.
    inv = np.float32(1.0) / np.float32(QMAX[fmt])
    scale = xp.where(absmax > 0, absmax * inv, xp.float32(1.0)).astype(xp.float32)
    scaled = wf / xp.expand_dims(scale, axis)
    if fmt == "int8":
        data = xp.clip(xp.rint(scaled), -127, 127).astype(xp.int8)
    else:
        data = xp.clip(scaled, -QMAX[fmt], QMAX[fmt]).astype(STORAGE[fmt])
    return data, scale


def quantize_groups(w: Any, fmt: str, axis: int, group_size: int, xp: Any = np) -> tuple[Any, Any]:
    """(data, scale): `w` [.., K, ..] as `fmt`, one f32 scale per `group_size` consecutive entries
    along the contraction axis `axis` (scale [.., K // group_size, ..]); `group_size` = K is
    `quantize` with the scale's `axis` kept at size 1."""
    shape = tuple(w.shape)
    k = shape[axis]
    if group_size < 1 or k % group_size:
        raise ValueError(f"group_size={group_size} does not divide the contraction axis ({k} of {shape})")
    grouped = xp.reshape(xp.asarray(w), shape[:axis] + (k // group_size, group_size) + shape[axis + 1:])
    data, scale = quantize(grouped, fmt, axis + 1, xp)
    return xp.reshape(data, shape), scale


def dequantize_groups(data: Any, scale: Any, axis: int, xp: Any = np) -> Any:
    """f32 `data * scale` for `quantize_groups`' layout (scale [.., K // group_size, ..])."""
    shape = tuple(data.shape)
    groups = scale.shape[axis]
    grouped = xp.reshape(data, shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1:])
    return xp.reshape(dequantize(grouped, scale, axis + 1, xp), shape)


def dequantize(data: Any, scale: Any, axis: int, xp: Any = np) -> Any:
    """f32 `data * scale` with the scale broadcast over `axis`."""
    return data.astype(xp.float32) * xp.expand_dims(scale, axis)


def requantize_rows(read_rows: Callable[[int, int], np.ndarray], rows: int, fmt: str,
                    read_blocks: Callable[[int, int], tuple[np.ndarray, np.ndarray]] | None = None,
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(data [rows, cols], scale f32[rows]) of a row-major tensor stored in another quantized
    format, one chunk of `ROW_CHUNK` rows at a time (never the whole tensor in float32).

    Args:
      read_rows: (start, stop) -> f32[stop - start, cols], the rows dequantized.
      rows: the number of rows (output channels).
      fmt: "int8" | "fp8".
      read_blocks: for symmetric block formats, (start, stop) -> (ints i8[stop - start, blocks,
        block_size], block scales f32[stop - start, blocks]): rows that `fold_block_scales` can
        store exactly are taken from there, the others are re-derived from `read_rows`.
    """
    datas, scales = [], []
    for start in range(0, rows, ROW_CHUNK):
        stop = min(rows, start + ROW_CHUNK)
        folded = fold_block_scales(*read_blocks(start, stop), fmt) if read_blocks else None
        if folded is not None and folded[2].all():
            d, s = folded[0], folded[1]
        else:
            d, s = quantize(read_rows(start, stop), fmt, axis=1)
            if folded is not None:
                exact = folded[2]
                d = np.where(exact[:, None], folded[0], d)
                s = np.where(exact, folded[1], s)
        datas.append(d)
        scales.append(s)
    return np.concatenate(datas), np.concatenate(scales)


def fold_block_scales(ints: np.ndarray, block_scales: np.ndarray,
                      fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows of symmetric blocks stored exactly as int8 times one scale, where that is possible.

    Args:
      ints: i8[rows, blocks, block_size], the integer values of each block (value = d_b * int).
      block_scales: f32[rows, blocks], each block's scale `d_b`.
      fmt: only "int8" folds (None otherwise: fp8 has no integer grid wide enough).

    Returns:
      (data i8[rows, blocks * block_size], scale f32[rows], exact bool[rows]): a row is exact when
      every block scale is an integer multiple of the row's smallest (nonzero-block) one and the
      products stay in [-127, 127]; then data * scale equals the blocks bit for bit. The data and
      scale of the other rows are meaningless.
    """
    if fmt != "int8":
        return None
    used = np.any(ints != 0, axis=2) & (block_scales != 0)  # blocks of zeros constrain nothing
    base = np.where(used, np.abs(block_scales), np.inf).min(axis=1)  # f32[rows]
    base = np.where(np.isfinite(base), base, np.float32(1.0)).astype(np.float32)
    factor = np.where(used, np.rint(block_scales / base[:, None]), 0).astype(np.float32)
    out = ints.astype(np.int32) * factor.astype(np.int32)[:, :, None]
    exact = (np.all(~used | (factor * base[:, None] == block_scales), axis=1)
             & (np.abs(out).max(axis=(1, 2), initial=0) <= 127))
    data = np.where(exact[:, None, None], out, 0).astype(np.int8)
    return data.reshape(ints.shape[0], -1), base, exact
