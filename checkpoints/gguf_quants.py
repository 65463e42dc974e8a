"""Our GGUF block dequantizers and requantizers (numpy), and which types use the `gguf` library's.

1. `dequantize(raw, ggml_type, shape)` checks the type is supported and the byte count matches the
   shape, views the bytes as `u8[n_blocks, block_bytes]` and runs the type's block kernel
   (`_KERNELS`) to f32.
2. The kernels are ours (numpy, below) for the formats where they measured faster than the `gguf`
   library's `gguf.quants` (`_OWN_KERNELS`), the library's for the others (`LIBRARY_TYPES`).
3. `requantize(by_row, qtype, cols, fmt, groups)` turns a block-quantized tensor into int8 / fp8
   with `groups` scales per row, a chunk of rows at a time (`checkpoints.quantize.requantize_rows`);
   the symmetric formats (Q4_0, Q5_0, Q8_0 and Q6_K's sub-blocks of 16: values are block scale x
   integer, `_SYMMETRIC`) hand over their integers so that groups whose block scales allow it are
   folded exactly (always, for groups of `SYMMETRIC_BLOCK` or fewer values).
4. `requantize4(by_row, qtype, cols, groups, symmetric)` is the same for int4 (codes, scales,
   offsets): Q4_0, Q4_1 and Q4_K with groups of 32 (one per block / sub-block) keep their codes
   (`_NATIVE4`: Q4_0's d * (q - 8) as code q, scale d, offset -8 d; Q4_1's d * q + m as code q,
   scale d, offset m, f16 d and m kept and -8 d exact; Q4_K's d * sc * q - dmin * m as code q,
   scale d * sc and offset -dmin * m rounded to f16), every other type / group size is
   requantized from its dequantized rows (`quantize.quantize4`, one rounding).

Layout: a quantized row of `ne[0]` values is packed into blocks of 32 or 256 values
(`gguf.GGML_QUANT_SIZES` gives the block size and its byte count).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gguf
import numpy as np

from checkpoints import quantize as qlib
from checkpoints.errors import GGUFError

GGMLType = gguf.GGMLQuantizationType


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:  # u8[n_blocks, block_bytes]
    """The little-endian float16 at byte `start` of every block, as f32[n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2").astype(np.float32)


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:  # u8[..., n]
    """u8[..., 2, n]: the low nibbles of `qs`, then the high nibbles."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _bits_per_plane(bytes_: np.ndarray) -> np.ndarray:  # u8[n_blocks, n]
    """u8[n_blocks, 8, n]: bit `b` of byte `l` lands at `[:, b, l]`."""
    bits = np.unpackbits(bytes_, axis=-1, bitorder="little")  # u8[n_blocks, 8 * n]
    return bits.reshape(bytes_.shape[0], bytes_.shape[1], 8).transpose(0, 2, 1)


def _two_bit_planes(qs: np.ndarray) -> np.ndarray:  # u8[n_blocks, 64]
    """The 2-bit values of Q2_K / Q3_K as u8[n_blocks, 16, 16], grouped by 16-value sub-block.

    Each 128-value half `n` uses 32 bytes; shift `2j` of byte `l` holds value `n*128 + j*32 + l`.
    """
    n_blocks = qs.shape[0]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    planes = (qs.reshape(n_blocks, 2, 1, 32) >> shifts) & 0x03  # [n_blocks, half, j, l]
    return planes.reshape(n_blocks, 16, 16)


def _k4_scales_and_mins(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # u8[n_blocks, 12]
    """Q4_K / Q5_K: eight 6-bit scales and eight 6-bit mins packed in 12 bytes, each u8[n_blocks, 8].

    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scale) and 4-7 (min); sub-blocks 4-7 take their
    low 4 bits from the nibbles of bytes 8-11 and their top 2 bits from the spare top bits of 0-7.
    """
    lo, mid, hi = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc, mn


def _dq_q4_0(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 18]
    d = _f16(blocks, 0)
    q = _low_high_nibbles(blocks[:, 2:18]).reshape(-1, 32).astype(np.int8) - 8
    return d * q.astype(np.float32)


def _dq_q4_1(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 20]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _low_high_nibbles(blocks[:, 4:20]).reshape(-1, 32)
    return d * q.astype(np.float32) + m


def _dq_q5_0(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 22]
    d = _f16(blocks, 0)
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")  # bit i of the u32 -> value i
    q = (_low_high_nibbles(blocks[:, 6:22]).reshape(-1, 32) | (high << 4)).astype(np.int8) - 16
    return d * q.astype(np.float32)


def _dq_q5_1(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 24]
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    high = np.unpackbits(blocks[:, 4:8], axis=1, bitorder="little")
    q = _low_high_nibbles(blocks[:, 8:24]).reshape(-1, 32) | (high << 4)
    return d * q.astype(np.float32) + m


def _dq_q8_0(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 34]
    d = _f16(blocks, 0)
    return d * np.ascontiguousarray(blocks[:, 2:34]).view(np.int8).astype(np.float32)


def _ints_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # u8[n_blocks, 18]
    return _f16(blocks, 0)[:, 0], _low_high_nibbles(blocks[:, 2:18]).reshape(-1, 32).astype(
        np.int8
    ) - 8


def _ints_q5_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # u8[n_blocks, 22]
    high = np.unpackbits(blocks[:, 2:6], axis=1, bitorder="little")
    q = (_low_high_nibbles(blocks[:, 6:22]).reshape(-1, 32) | (high << 4)).astype(np.int8) - 16
    return _f16(blocks, 0)[:, 0], q


def _ints_q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # u8[n_blocks, 34]
    return _f16(blocks, 0)[:, 0], np.ascontiguousarray(blocks[:, 2:34]).view(np.int8)


def _dq_q2_k(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 84]
    n_blocks = blocks.shape[0]
    scales = blocks[:, 0:16].reshape(n_blocks, 16, 1)  # low nibble scale, high nibble min
    d, dmin = _f16(blocks, 80)[:, :, None], _f16(blocks, 82)[:, :, None]
    q = _two_bit_planes(blocks[:, 16:80]).astype(np.float32)
    y = (d * (scales & 0x0F).astype(np.float32)) * q - dmin * (scales >> 4).astype(np.float32)
    return y.reshape(n_blocks, 256)


def _dq_q3_k(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 110]
    n_blocks = blocks.shape[0]
    low = _two_bit_planes(blocks[:, 32:96]).astype(np.int8)
    # Bit (n*4 + j) of hmask byte l is the third bit of value n*128 + j*32 + l; a clear bit means -4.
    high = _bits_per_plane(blocks[:, 0:32]).reshape(n_blocks, 16, 16).astype(np.int8)
    q = low - 4 * (1 - high)
    # Sixteen 6-bit scales: low 4 bits from the nibbles of bytes 0-7 (low nibbles first), top 2
    # bits from bytes 8-11, scale i using bits 2*(i // 4) of byte 8 + i % 4.
    packed = blocks[:, 96:108]
    low4 = np.concatenate([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=1)
    shifts = np.repeat(np.array([0, 2, 4, 6], dtype=np.uint8), 4)
    top2 = (np.tile(packed[:, 8:12], 4) >> shifts) & 0x03
    scales = ((low4 | (top2 << 4)).astype(np.int8) - 32).astype(np.float32)
    d = _f16(blocks, 108)
    return ((d * scales)[:, :, None] * q.astype(np.float32)).reshape(n_blocks, 256)


def _dq_q4_k(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 144]
    q, scale, offset = _native_q4_k(blocks)  # NOTE: x + (-y) is x - y exactly
    return (scale[:, None] * q.astype(np.float32) + offset[:, None]).reshape(-1, 256)


def _dq_q6_k(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 210]
    d, q = _ints_q6_k(blocks)
    return (d[:, None] * q.astype(np.float32)).reshape(-1, 256)


def _ints_q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # u8[n_blocks, 210]
    """Q6_K as symmetric sub-blocks of 16: (d * sc f32[n_blocks * 16], q - 32 i8[.., 16])."""
    n_blocks = blocks.shape[0]
    # Per 128-value half n: 64 ql bytes and 32 qh bytes. Group g (32 values) takes nibble g // 2 of
    # ql bytes 32 * (g % 2) + l, and bits 2g..2g+1 of qh byte l.
    ql = _low_high_nibbles(blocks[:, 0:128].reshape(n_blocks, 2, 2, 32))  # [n, half, g%2, g//2, l]
    ql = ql.swapaxes(2, 3)  # [n, half, g//2, g%2, l]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = (blocks[:, 128:192].reshape(n_blocks, 2, 1, 32) >> shifts) & 0x03  # [n, half, g, l]
    q = (ql.reshape(n_blocks, 2, 4, 32) | (qh << 4)).astype(np.int8) - 32
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    # NOTE: f16 d times an int8 scale is exact in f32 (11 + 8 significant bits)
    return (_f16(blocks, 208) * scales).reshape(-1), q.reshape(-1, 16)


def _dq_q8_k(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 292]
    d = np.ascontiguousarray(blocks[:, 0:4]).view("<f4")
    return d * np.ascontiguousarray(blocks[:, 4:260]).view(np.int8).astype(np.float32)


def _float_kernel(dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    def kernel(blocks: np.ndarray) -> np.ndarray:  # u8[n, itemsize]
        return np.ascontiguousarray(blocks).view(dtype).astype(np.float32)

    return kernel


def _dq_bf16(blocks: np.ndarray) -> np.ndarray:  # u8[n, 2]
    # bfloat16 is the top half of a float32.
    return (np.ascontiguousarray(blocks).view("<u2").astype(np.uint32) << 16).view(np.float32)


def _library_kernel(qtype: GGMLType) -> Callable[[np.ndarray], np.ndarray]:
    """`gguf.quants.dequantize` for one type, as a block kernel."""

    def kernel(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, block_bytes]
        return gguf.quants.dequantize(blocks, qtype).astype(np.float32, copy=False)

    return kernel


# NOTE: which dequantizer each type uses (scripts/bench_gguf_dequant.py, BENCHMARKS.md): ours where
# it measured faster than `gguf.quants` (1.2-7x on the block formats below, 4x on BF16), the
# library where ours was not faster (F16: equal; Q5_K: the library 1.2-1.5x faster) or where we
# have no kernel of our own (the IQ, TQ and FP4 families). Q8_K and F64 are ours alone: the
# library cannot dequantize them. Every LIBRARY_TYPES kernel is tested bit-exactly against ggml's
# reference dequantizer written out in tests/ggml_spec_blocks.py.
_OWN_KERNELS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    GGMLType.F32: _float_kernel("<f4"),
    GGMLType.F64: _float_kernel("<f8"),
    GGMLType.BF16: _dq_bf16,
    GGMLType.Q4_0: _dq_q4_0,
    GGMLType.Q4_1: _dq_q4_1,
    GGMLType.Q5_0: _dq_q5_0,
    GGMLType.Q5_1: _dq_q5_1,
    GGMLType.Q8_0: _dq_q8_0,
    GGMLType.Q2_K: _dq_q2_k,
    GGMLType.Q3_K: _dq_q3_k,
    GGMLType.Q4_K: _dq_q4_k,
    GGMLType.Q6_K: _dq_q6_k,
    GGMLType.Q8_K: _dq_q8_k,
}
LIBRARY_TYPES = tuple(
    getattr(GGMLType, name)
    for name in (
        "F16",
        "Q5_K",
        "IQ1_S",
        "IQ1_M",
        "IQ2_XXS",
        "IQ2_XS",
        "IQ2_S",
        "IQ3_XXS",
        "IQ3_S",
        "IQ4_NL",
        "IQ4_XS",
        "TQ1_0",
        "TQ2_0",
        "MXFP4",
        "NVFP4",
    )
    if hasattr(GGMLType, name)
)
_KERNELS: dict[GGMLType, Callable[[np.ndarray], np.ndarray]] = {
    **_OWN_KERNELS,
    **{t: _library_kernel(t) for t in LIBRARY_TYPES},
}
SUPPORTED_TYPES: frozenset[GGMLType] = frozenset(_KERNELS)
_FLOAT_TYPES = frozenset({GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.F64})
# Block formats whose values are d_b * (integer): (block scales f32[n_blocks], ints i8[n_blocks, 32]).
_SYMMETRIC: dict[GGMLType, Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]] = {
    GGMLType.Q4_0: _ints_q4_0,
    GGMLType.Q5_0: _ints_q5_0,
    GGMLType.Q8_0: _ints_q8_0,
    GGMLType.Q6_K: _ints_q6_k,
}
# Values each `_SYMMETRIC` scale covers: int8 groups of that many hold the type exactly.
SYMMETRIC_BLOCK = {GGMLType.Q4_0: 32, GGMLType.Q5_0: 32, GGMLType.Q8_0: 32, GGMLType.Q6_K: 16}


def _type_name(ggml_type: int | GGMLType) -> str:
    try:
        return GGMLType(int(ggml_type)).name
    except ValueError:
        return f"unknown GGML type id {int(ggml_type)}"


def dequantize(raw: np.ndarray, ggml_type: int | GGMLType, shape: tuple[int, ...]) -> np.ndarray:
    """Dequantize one tensor's bytes to float32.

    Args:
        raw: the tensor's data exactly as stored (any dtype and shape; its bytes are what count),
            e.g. `gguf.GGUFReader(...).tensors[i].data`.
        ggml_type: the GGML type of `raw`.
        shape: the numpy shape (slowest dimension first, i.e. the reversed GGUF shape).

    Returns:
        A new f32 array of `shape`.
    """
    try:
        qtype = GGMLType(int(ggml_type))
    except ValueError:
        raise GGUFError(f"cannot dequantize {_type_name(ggml_type)}") from None
    kernel = _KERNELS.get(qtype)
    if kernel is None:
        supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise GGUFError(f"cannot dequantize GGML type {qtype.name} (supported: {supported})")
    shape = tuple(int(s) for s in shape)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block_size:
        raise GGUFError(
            f"{qtype.name} tensor of shape {shape}: the last dimension is not a multiple of the "
            f"block size {block_size}"
        )
    n_blocks = math.prod(shape) // block_size
    data = np.ascontiguousarray(np.asarray(raw)).reshape(-1).view(np.uint8)
    if data.size != n_blocks * block_bytes:
        raise GGUFError(
            f"{qtype.name} tensor of shape {shape} needs {n_blocks * block_bytes} bytes, got {data.size}"
        )
    return kernel(data.reshape(n_blocks, block_bytes)).reshape(shape)


def _native_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, ...]:  # u8[n_blocks, 18]
    d = _f16(blocks, 0)[:, 0]
    return _low_high_nibbles(blocks[:, 2:18]).reshape(-1, 32), d, np.float32(-8.0) * d


def _native_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, ...]:  # u8[n_blocks, 20]
    return (
        _low_high_nibbles(blocks[:, 4:20]).reshape(-1, 32),
        _f16(blocks, 0)[:, 0],
        _f16(blocks, 2)[:, 0],
    )


def _native_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, ...]:  # u8[n_blocks, 144]
    """Q4_K's eight sub-blocks of 32 as groups: scale d * sc, offset -dmin * m (f32, exact)."""
    n_blocks = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k4_scales_and_mins(blocks[:, 4:16])
    # 64-value chunk j uses bytes 32j..32j+31: low nibbles are sub-block 2j, high ones 2j+1.
    q = _low_high_nibbles(blocks[:, 16:144].reshape(n_blocks, 4, 32)).reshape(-1, 32)
    scale = (d * sc.astype(np.float32)).reshape(-1)
    return q, scale, -(dmin * mn.astype(np.float32)).reshape(-1)


# Block formats an int4 layout with groups of `NATIVE4_GROUP` holds: (codes u8[n_groups, 32] in
# 0..15, scale f32[n_groups], offset f32[n_groups]); value = code * scale + offset. Q4_0 / Q4_1
# exactly (their f16 d and m); Q4_K's sub-block products d * sc and dmin * m round to int4's f16
# scales and offsets (half an f16 ulp each: <= 2**-11 relative).
NATIVE4_GROUP = 32
_NATIVE4: dict[GGMLType, Callable[[np.ndarray], tuple[np.ndarray, ...]]] = {
    GGMLType.Q4_0: _native_q4_0,
    GGMLType.Q4_1: _native_q4_1,
    GGMLType.Q4_K: _native_q4_k,
}


def requantize4(
    by_row: np.ndarray, qtype: GGMLType, cols: int, groups: int, symmetric: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # u8[rows, row_bytes]
    """(codes uint4[rows, cols], scale f16[rows, groups], offset f16[rows, groups]) of a
    block-quantized 2-D tensor: Q4_0 / Q4_1 / Q4_K in groups of 32 as stored (`_NATIVE4`), others
    requantized from their dequantized rows a chunk at a time."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = by_row.shape[0]
    if qtype in _NATIVE4 and cols // groups == NATIVE4_GROUP:
        codes, d, m = _NATIVE4[qtype](by_row.reshape(-1, block_bytes))
        # NOTE: f16 d and m (and -8 d, a power-of-two multiple) narrow back to f16 exactly;
        # Q4_K's products round once.
        f16 = qlib.SCALE_DTYPE["int4"]
        return (
            codes.reshape(rows, cols).astype(qlib.STORAGE["int4"]),
            d.reshape(rows, groups).astype(f16),
            m.reshape(rows, groups).astype(f16),
        )
    parts = [
        qlib.quantize4(
            dequantize(by_row[start : start + qlib.ROW_CHUNK], qtype, (stop - start, cols)),
            1,
            groups,
            symmetric,
        )
        for start in range(0, rows, qlib.ROW_CHUNK)
        for stop in [min(rows, start + qlib.ROW_CHUNK)]
    ]
    return tuple(np.concatenate(x) for x in zip(*parts))


def requantize(
    by_row: np.ndarray, qtype: GGMLType, cols: int, fmt: str, groups: int
) -> tuple[np.ndarray, np.ndarray]:  # u8[rows, row_bytes]
    """(data [rows, cols], scale f32[rows, groups]) of a block-quantized 2-D tensor requantized to
    `fmt` ("int8" | "fp8"), a chunk of rows at a time, never whole in float32. Groups of symmetric
    blocks (Q8_0, Q4_0, Q5_0, Q6_K's sub-blocks) fold their block scales exactly into int8 where
    they can (`checkpoints.quantize.fold_block_scales`).
    """
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]

    def read_rows(start: int, stop: int) -> np.ndarray:
        return dequantize(by_row[start:stop], qtype, (stop - start, cols))

    read_blocks = None
    if qtype in _SYMMETRIC:

        def read_blocks(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
            d, ints = _SYMMETRIC[qtype](by_row[start:stop].reshape(-1, block_bytes))
            n = stop - start
            return ints.reshape(n, -1, ints.shape[-1]), d.reshape(n, -1)

    return qlib.requantize_rows(read_rows, by_row.shape[0], fmt, read_blocks, groups)
