"""Weight-only quantization of one tensor: one scale (int4: and one offset) per group of input
channels.

1. `FORMATS` names the stored formats: "int8" (values in [-127, 127]), "fp8" (`float8_e4m3fn`,
   values in [-448, 448]) and "int4" (`uint4` codes u in [0, 15], stored two per byte, with an
   offset per group: value = u * scale + offset; one layout holds symmetric grids (offset = -8 *
   scale: GGUF Q4_0), asymmetric ones with integer zero points (offset = -zero * scale: GPTQ, AWQ,
   to the offset's f16 rounding) and GGUF Q4_1's scale + min blocks (offset = min) exactly). A name
   may add options: "int4-g32" (groups of 32 instead of 128), "int4-sym" (a symmetric grid, u - 8
   in [-7, 7]), "int8-g32"; `parse_format` splits them. `check_format(name, field)` rejects
   anything else naming the field; `check_requested` also lets a load be asked for vLLM's
   names of a GPTQ / AWQ checkpoint's or a GGUF file's own format (`CHECKPOINT_METHODS`).
   Under "int4" the linear weights are 4-bit and the embedding
   (also the tied LM head, contracted over its last axis) is int8 with the same group size: GGUF
   files keep their embedding in 8 bits (Q8_0) and GPTQ / AWQ keep it in 16. `SCALE_DTYPE` is the
   storage of the scales (and offsets) of every leaf of a format: f32 for int8 / fp8, f16 for int4
   (its int8 vocabulary leaves too), GGUF's own d and m: a Q4_0 / Q4_1 / Q8_0 block's f16 scale and
   min are kept exactly (-8 d too: a power-of-two multiple), in half the bytes of f32 (the default
   model's int4 weights 0.179x of f32 instead of 0.207x). The math widens them to f32 where it uses
   them.
2. `num_groups(k, fmt)` is how many scales a weight contracted over `k` input channels gets per
   output channel: int8 one per `GROUP_SIZE["int8"]` (128) consecutive input channels (the group
   size of GPTQ / AWQ checkpoints; gcd(k, 128) where k has no such factor, e.g. 64 for k = 576;
   one group when that would fall below `MIN_GROUP`), fp8 one per output channel (its 3-bit
   mantissa already keeps each value's relative precision, and a per-channel scale keeps the
   dot a plain fp8 GEMM on GPU). Groups pay on real weights: BENCHMARKS.md "simulate_quant".
3. `quantize(w, fmt, axis, groups)` cuts the contraction axis `axis` into `groups` groups of
   consecutive entries, reduces `|w|` over each to one absolute maximum per (group, output
   channel), stores `scale = absmax / qmax` (1 for an all-zero group) and `data = w / scale`
   rounded to the format (with `scale_dtype` f16 the scale is rounded to f16 first and the values
   divided by the rounded scale: the codes fit the stored scale). The scale has `w`'s shape with
   `axis` of size `groups` (1: one scale per output channel); `dequantize` broadcasts it back. It
   runs on numpy or JAX arrays (`xp`), so the host loaders and the on-device quantizer (a float
   orbax checkpoint restored then quantized) share one rule.
4. `requantize_rows(read_rows, rows, fmt, read_blocks, groups)` builds the same result for a
   tensor stored row by row in another quantized format (a GGUF block format) without holding it
   in float32: rows are read a chunk at a time (`ROW_CHUNK` rows) and requantized at once.
5. `fold_block_scales(ints, block_scales, fmt)` is the exact path for symmetric block formats
   whose blocks hold `d_b * q` with integer `q` (GGUF Q8_0 / Q4_0 / Q5_0): a group of blocks whose
   scales are all integer multiples of the group's smallest one, with the products in range, is
   stored as integers times that smallest scale, with no rounding at all; `requantize_rows`
   re-derives the other groups from their dequantized values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np

FORMATS = ("int8", "fp8", "int4")
QMAX = {"int8": 127.0, "fp8": 448.0, "int4": 15.0}
STORAGE = {
    "int8": np.dtype(np.int8),
    "fp8": np.dtype(ml_dtypes.float8_e4m3fn),
    "int4": np.dtype(ml_dtypes.uint4),
}
# Input channels per scale (None: one scale per output channel), and the smallest group used.
GROUP_SIZE: dict[str, int | None] = {"int8": 128, "fp8": None, "int4": 128}
GROUP_CHOICES = (16, 32, 64, 128, 256)
MIN_GROUP = 32
# Storage of each format's scales and int4's offsets (see the module docstring, step 1).
SCALE_DTYPE = {
    "int8": np.dtype(np.float32),
    "fp8": np.dtype(np.float32),
    "int4": np.dtype(np.float16),
}
# The int4 code of zero on a symmetric grid (GGUF Q4_0's q - 8).
INT4_MID = 8
ROW_CHUNK = 256


def parse_format(fmt: str) -> tuple[str, int | None, bool]:
    """(base format, input channels per group, symmetric) of a format name such as "int4-g32".
    "-act" (int8 / int4, `act_order`) is accepted here and read by `act_order`."""
    base, *opts = fmt.split("-")
    if base not in FORMATS:
        raise ValueError(fmt)
    size, symmetric, act = GROUP_SIZE[base], base != "int4", False
    for opt in opts:
        if opt == "sym" and base == "int4" and not symmetric:
            symmetric = True
        elif opt[:1] == "g" and opt[1:].isdigit() and int(opt[1:]) in GROUP_CHOICES and size:
            size = int(opt[1:])
        elif opt == "act" and size and not act:
            act = True
        else:
            raise ValueError(fmt)
    return base, size, symmetric


def act_order(fmt: str | None) -> bool:
    """Whether format `fmt` names act-order weights ("-act": GPTQ's `desc_act`): each linear weight
    stores its input rows sorted by scale group, with the permutation it reads x through
    (`jaxinfer.quantization.QArray.perm`). A checkpoint's own layout only: nothing quantizes to it."""
    return fmt is not None and "act" in fmt.split("-")[1:]


class Permuted(NamedTuple):
    """A source's quantized weight in act-order (`act_order`): `parts` (data [out, in], scale
    [out, G][, offset]) with the input rows sorted by group, and `perm` i32[in], the input channel
    of each stored row."""

    parts: tuple
    perm: np.ndarray


def format_name(base: str, size: int | None, act: bool = False) -> str:
    """The name `parse_format` and `act_order` read back as (base, size) and `act`."""
    name = base if size == GROUP_SIZE[base] else f"{base}-g{size}"
    return name + "-act" if act else name


def check_format(fmt: str | None, field: str = "quantization") -> str | None:
    """`fmt` when it is None or a format name (`FORMATS` with options); else a ValueError naming
    `field`."""
    if fmt is None:
        return fmt
    try:
        parse_format(fmt)
        return fmt
    except (ValueError, AttributeError):
        raise ValueError(
            f"{field}={fmt!r} is not supported; choose one of {FORMATS} (or None); int8 and int4 "
            f"take a group size suffix -g<n> (n in {GROUP_CHOICES}), int4 also -sym (-act names "
            "an act-order GPTQ checkpoint's own layout)"
        ) from None


# vLLM's `quantization` names for a checkpoint's own format -> the kind of checkpoint: a GPTQ /
# AWQ one's `quantization_config.quant_method` (the "_marlin" variants name GPU kernels for the
# same format; `checkpoints.hf_quant`), or "gguf" (a GGUF file in its own bits). Asking for one
# loads such a checkpoint as it is and refuses any other (`jaxinfer.loader`).
CHECKPOINT_METHODS = {
    "awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "gptq_marlin": "gptq",
    "gguf": "gguf",
}


# A load asked for FLOAT gets float weights of its dtype from a source stored in bits it can
# widen (a GGUF file's blocks dequantized); None is the source's own format, as in vLLM: a GGUF
# file in its own bits ("gguf"), a GPTQ / AWQ checkpoint packed, a float checkpoint as floats.
FLOAT = "none"


def check_requested(fmt: str | None, field: str = "quantization") -> str | None:
    """What a load may be asked for: `check_format`'s names, one of `CHECKPOINT_METHODS`, or
    FLOAT (else a ValueError naming `field` and all three)."""
    if fmt in CHECKPOINT_METHODS or fmt == FLOAT:
        return fmt
    try:
        return check_format(fmt, field)
    except ValueError as e:
        raise ValueError(
            f"{e}; a GPTQ / AWQ checkpoint or a GGUF file loads in its own format as "
            f"{tuple(CHECKPOINT_METHODS)} (vLLM's names), and {FLOAT!r} loads a GGUF file's "
            f"blocks as floats"
        ) from None


def base_format(fmt: str) -> str:
    return parse_format(fmt)[0]


def num_groups(k: int, fmt: str) -> int:
    """Scales per output channel of a weight of `fmt` contracted over `k` input channels."""
    size = parse_format(check_format(fmt))[1]
    if not size:
        return 1
    group = math.gcd(k, size)
    return k // group if group >= min(MIN_GROUP, size) else 1


def quantize(
    w: Any, fmt: str, axis: int, groups: int = 1, xp: Any = np, scale_dtype: Any = np.float32
) -> tuple[Any, Any]:
    """(data, scale): `w` [.., K, ..] as `fmt` (data of `w`'s shape) with scales of `scale_dtype`
    (f32; f16 for the int8 leaves of int4) [.., groups, ..]: one per `K // groups` consecutive
    entries along `axis` and output channel. int4: `quantize4` (it returns an offset too)."""
    fmt = base_format(check_format(fmt))
    if fmt == "int4":
        raise ValueError("int4 has offsets: use quantize4")
    shape = tuple(w.shape)
    k = shape[axis]
    if groups < 1 or k % groups:
        raise ValueError(f"{groups} groups do not divide the contraction axis ({k} of {shape})")
    wf = xp.reshape(xp.asarray(w).astype(xp.float32), _grouped(shape, axis, groups))
    absmax = xp.max(xp.abs(wf), axis=axis + 1)
    # NOTE: times the f32 reciprocal, not divided by qmax: XLA rewrites a division by a constant
    # that way, and the host and device quantizers must agree bit for bit.
    inv = np.float32(1.0) / np.float32(QMAX[fmt])
    scale = _rounded(xp.where(absmax > 0, absmax * inv, xp.float32(1.0)), scale_dtype, xp)
    scaled = wf / xp.expand_dims(scale, axis + 1)
    if fmt == "int8":
        data = xp.clip(xp.rint(scaled), -127, 127).astype(xp.int8)
    else:
        data = xp.clip(scaled, -QMAX[fmt], QMAX[fmt]).astype(STORAGE[fmt])
    return xp.reshape(data, shape), scale.astype(scale_dtype)


def _rounded(scale: Any, dtype: Any, xp: Any) -> Any:
    """f32 `scale` rounded to `dtype` (as f32 again); a scale that f16 flushes to 0 (a group of
    values within ~1e-7 of each other) becomes 1: the codes then round to the nearest whole."""
    if np.dtype(dtype) == np.float32:
        return scale.astype(xp.float32)
    r = scale.astype(dtype).astype(xp.float32)
    return xp.where(r > 0, r, xp.float32(1.0))


def quantize4(
    w: Any, axis: int, groups: int = 1, symmetric: bool = False, xp: Any = np
) -> tuple[Any, Any, Any]:
    """(codes uint4, scale f16, offset f16) of `w` on a 4-bit grid per group (shapes as `quantize`):
    value = code * scale + offset. Asymmetric: the group's [min, max] over 15 steps, offset = min
    (GGUF Q4_1's grid: the float offset need not be an integer zero point, so the range need not
    hold 0 as GPTQ's does); symmetric: scale = absmax / 7, offset = -8 * scale (codes 1..15).
    The scale and offset are rounded to f16 before the codes are chosen (the min rounded up may
    clip a group's lowest value by at most 2^-11 of it)."""
    shape = tuple(w.shape)
    k = shape[axis]
    if groups < 1 or k % groups:
        raise ValueError(f"{groups} groups do not divide the contraction axis ({k} of {shape})")
    wf = xp.reshape(xp.asarray(w).astype(xp.float32), _grouped(shape, axis, groups))
    hi, lo = xp.max(wf, axis=axis + 1), xp.min(wf, axis=axis + 1)
    if symmetric:
        span = xp.maximum(hi, -lo) * np.float32(2.0 / 14.0)
    else:
        span = (hi - lo) * (np.float32(1.0) / np.float32(QMAX["int4"]))
    f16 = SCALE_DTYPE["int4"]
    scale = _rounded(xp.where(span > 0, span, xp.float32(1.0)), f16, xp)
    offset = (-INT4_MID * scale if symmetric else lo.astype(f16)).astype(xp.float32)
    codes = xp.rint((wf - xp.expand_dims(offset, axis + 1)) / xp.expand_dims(scale, axis + 1))
    data = xp.clip(codes, 0, 15).astype(STORAGE["int4"])
    return xp.reshape(data, shape), scale.astype(f16), offset.astype(f16)


def dequantize(data: Any, scale: Any, axis: int, xp: Any = np, offset: Any = None) -> Any:
    """f32 `data * scale (+ offset)`, each of the scale's `scale.shape[axis]` groups broadcast over
    its consecutive entries along `axis` (f16 scales and offsets widened to f32 first)."""
    shape = tuple(data.shape)
    grouped = xp.reshape(data, _grouped(shape, axis, scale.shape[axis]))
    out = grouped.astype(xp.float32) * xp.expand_dims(scale.astype(xp.float32), axis + 1)
    if offset is not None:
        out = out + xp.expand_dims(offset.astype(xp.float32), axis + 1)
    return xp.reshape(out, shape)


def _grouped(shape: tuple[int, ...], axis: int, groups: int) -> tuple[int, ...]:
    """`shape` with its axis `axis` split into (groups, entries per group)."""
    return shape[:axis] + (groups, shape[axis] // groups) + shape[axis + 1 :]


def requantize_rows(
    read_rows: Callable[[int, int], np.ndarray],
    rows: int,
    fmt: str,
    read_blocks: Callable[[int, int], tuple[np.ndarray, np.ndarray]] | None = None,
    groups: int = 1,
) -> tuple[np.ndarray, np.ndarray]:
    """(data [rows, cols], scale f32[rows, groups]) of a row-major tensor stored in another
    quantized format, one chunk of `ROW_CHUNK` rows at a time (never the whole tensor in float32).

    Args:
      read_rows: (start, stop) -> f32[stop - start, cols], the rows dequantized.
      rows: the number of rows (output channels).
      fmt: "int8" | "fp8".
      read_blocks: for symmetric block formats, (start, stop) -> (ints i8[stop - start, blocks,
        block_size], block scales f32[stop - start, blocks]): groups that `fold_block_scales` can
        store exactly are taken from there, the others are re-derived from `read_rows`.
      groups: scales per row (`num_groups`); a group spans whole blocks for the exact path.
    """
    datas, scales = [], []
    for start in range(0, rows, ROW_CHUNK):
        stop = min(rows, start + ROW_CHUNK)
        n = stop - start
        folded = None
        if read_blocks is not None:
            ints, block_scales = read_blocks(start, stop)
            blocks, block_size = ints.shape[1:]
            if groups % blocks == 0 and block_size % (groups // blocks) == 0:
                # groups within blocks: each group a block of its own with its block's scale
                split = groups // blocks
                blocks, block_size = groups, block_size // split
                ints = ints.reshape(n, blocks, block_size)
                block_scales = np.repeat(block_scales, split, axis=1)
            if blocks % groups == 0:  # whole blocks per group: fold each group like a row
                folded = fold_block_scales(
                    ints.reshape(n * groups, blocks // groups, block_size),
                    block_scales.reshape(n * groups, -1),
                    fmt,
                )
        if folded is not None and folded[2].all():
            d, s = folded[0].reshape(n, -1), folded[1].reshape(n, groups)
        else:
            d, s = quantize(read_rows(start, stop), fmt, axis=1, groups=groups)
            if folded is not None:
                exact = folded[2].reshape(n, groups)
                cols = d.shape[1]
                d = np.where(
                    np.repeat(exact, cols // groups, axis=1), folded[0].reshape(n, cols), d
                )
                s = np.where(exact, folded[1].reshape(n, groups), s)
        datas.append(d)
        scales.append(s)
    return np.concatenate(datas), np.concatenate(scales)


def fold_block_scales(
    ints: np.ndarray, block_scales: np.ndarray, fmt: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
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
    if base_format(fmt) != "int8":  # "int8-g32" alike: the group size is the caller's
        return None
    used = np.any(ints != 0, axis=2) & (block_scales != 0)  # blocks of zeros constrain nothing
    base = np.where(used, np.abs(block_scales), np.inf).min(axis=1)  # f32[rows]
    base = np.where(np.isfinite(base), base, np.float32(1.0)).astype(np.float32)
    factor = np.where(used, np.rint(block_scales / base[:, None]), 0).astype(np.float32)
    out = ints.astype(np.int32) * factor.astype(np.int32)[:, :, None]
    exact = np.all(~used | (factor * base[:, None] == block_scales), axis=1) & (
        np.abs(out).max(axis=(1, 2), initial=0) <= 127
    )
    data = np.where(exact[:, None, None], out, 0).astype(np.int8)
    return data.reshape(ints.shape[0], -1), base, exact
