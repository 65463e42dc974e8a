"""Block dequantizers for the GGUF formats the loader hands to `gguf.quants`, written out from
ggml's reference C (`dequantize_row_*` in ggml/src/ggml-quants.c, block structs in
ggml/src/ggml-common.h): a reference independent of both our loader and the `gguf` library.

1. Each `_<type>_block(b)` takes one block's bytes (u8[block_bytes]) and returns its f32 values,
   one value at a time in ggml's loop order, with ggml's f32 operations in ggml's order.
2. `set_scales(qtype, raw, block_bytes)` gives random bytes small finite f16 scales (a NaN/inf
   scale would hide the rest of its block) and each row's first bytes the format's edge codes.
3. `SPEC_BLOCKS` maps each type to its block function (tests/test_gguf.py runs them).

NOTE: the grid formats (IQ1_*, IQ2_*, IQ3_*) index large lattice tables (`iq2xxs_grid` ... in
ggml-common.h). Their *values* are taken from the installed `gguf.quants` classes (`_grid`), so
these references are independent in the bit unpacking, scales, signs and deltas, not in the table
values. The small tables (the IQ4 values, the FP4 values, the sign masks) are written out here.
"""

import gguf
import numpy as np

T = gguf.GGMLQuantizationType


def _f16(raw: np.ndarray) -> np.float32:
    return np.float32(raw[:2].view("<f2")[0])


def _u16(raw: np.ndarray, at: int) -> int:
    return int(raw[at]) | int(raw[at + 1]) << 8


def _u32(raw: np.ndarray, at: int) -> int:
    return _u16(raw, at) | _u16(raw, at + 2) << 16


def _half_from_bits(h: int) -> np.float32:
    """IEEE binary16 decoded from its bits by hand: sign, 5-bit exponent (bias 15), 10-bit mantissa."""
    sign = -1.0 if h & 0x8000 else 1.0
    exp, man = (h >> 10) & 0x1F, h & 0x3FF
    if exp == 0x1F:
        return np.float32(sign * np.inf if man == 0 else np.nan)
    if exp == 0:
        return np.float32(sign * man * 2.0**-24)
    return np.float32(sign * (1 + man / 1024) * 2.0 ** (exp - 15))


def _f16_value(b: np.ndarray) -> np.ndarray:
    """F16: one little-endian binary16 per 2-byte block."""
    return np.array([_half_from_bits(_u16(b, 0))], np.float32)


def _q5_k_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_q5_K for one 176-byte block: f16 d, f16 dmin, 12 bytes of packed
    6-bit sub-block scales and mins, 32 bytes of fifth bits, 128 bytes of low nibbles."""
    d, dmin, sc, qh, ql = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:48], b[48:176]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return int(sc[j] & 63), int(sc[j + 4] & 63)
        return int((sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4)), int(
            (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)
        )

    y = np.empty(256, np.float32)
    for j in range(4):
        (s1, m1), (s2, m2) = scale_min(2 * j), scale_min(2 * j + 1)
        d1, dm1, d2, dm2 = (
            d * np.float32(s1),
            dmin * np.float32(m1),
            d * np.float32(s2),
            dmin * np.float32(m2),
        )
        for l in range(32):
            q = ql[32 * j + l]
            lo = (q & 0xF) + (16 if qh[l] & (1 << (2 * j)) else 0)
            hi = (q >> 4) + (16 if qh[l] & (2 << (2 * j)) else 0)
            y[64 * j + l] = d1 * np.float32(lo) - dm1
            y[64 * j + 32 + l] = d2 * np.float32(hi) - dm2
    return y


def _tq2_0_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_tq2_0: 64 bytes of 2-bit values in {0, 1, 2} (-1 each), f16 d."""
    qs, d = b[:64], _f16(b[64:66])
    y = np.empty(256, np.float32)
    for j in range(2):
        for l in range(4):
            for m in range(32):
                q = (int(qs[32 * j + m]) >> (2 * l)) & 3
                y[128 * j + 32 * l + m] = d * np.float32(q - 1)
    return y


def _tq1_0_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_tq1_0 for one 54-byte block: 48 bytes of five base-3 digits each,
    4 bytes of four digits each, f16 d. A byte holds ceil(x * 256 / 243) for the base-3 number x
    whose first digit is the most significant: multiplying by 3^n (mod 256) brings digit n to the
    top, and (byte * 3) >> 8 reads it; each digit in {0, 1, 2} means digit - 1."""
    qs, qh, d = b[0:48], b[48:52], _f16(b[52:54])
    y = []

    def digit(byte: int, n: int) -> np.float32:
        return d * np.float32((((byte * 3**n) & 0xFF) * 3 >> 8) - 1)

    for start, width in ((0, 32), (32, 16)):
        for n in range(5):
            y += [digit(int(qs[start + m]), n) for m in range(width)]
    for n in range(4):
        y += [digit(int(qh[j]), n) for j in range(4)]
    return np.array(y, np.float32)


# The 16 non-linear IQ4 values: `kvalues_iq4nl` in ggml/src/ggml-common.h (shared by IQ4_NL/IQ4_XS).
_IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_nl_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq4_nl: f16 d, 16 bytes; low nibbles are values 0-15, high 16-31."""
    d, qs = _f16(b[0:2]), b[2:18]
    y = np.empty(32, np.float32)
    for j in range(16):
        y[j] = d * np.float32(_IQ4_VALUES[qs[j] & 0xF])
        y[j + 16] = d * np.float32(_IQ4_VALUES[qs[j] >> 4])
    return y


def _iq4_xs_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq4_xs for one 136-byte block: f16 d, u16 scales_h (2 high bits per
    32-value group), 4 bytes scales_l (a low nibble per group), 128 bytes of 4-bit indices; each
    group's scale is d * (6-bit scale - 32)."""
    d, scales_h, scales_l, qs = _f16(b[0:2]), _u16(b, 2), b[4:8], b[8:136]
    y = np.empty(256, np.float32)
    for ib in range(8):
        ls = ((scales_l[ib // 2] >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
        dl = d * np.float32(int(ls) - 32)
        for j in range(16):
            q = qs[16 * ib + j]
            y[32 * ib + j] = dl * np.float32(_IQ4_VALUES[q & 0xF])
            y[32 * ib + 16 + j] = dl * np.float32(_IQ4_VALUES[q >> 4])
    return y


# E2M1 (FP4) values doubled: `kvalues_mxfp4` / `kvalues_fp4` in ggml/src/ggml-common.h.
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _mxfp4_block(b: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling): a E8M0 exponent byte, then 16 bytes of two FP4 (E2M1) values;
    ggml halves the scale (2^(e-128)) because its value table is doubled."""
    d = np.ldexp(np.float32(1.0), int(b[0]) - 128).astype(np.float32)
    y = np.empty(32, np.float32)
    for j in range(16):
        y[j] = d * np.float32(_E2M1_X2[b[1 + j] & 0xF])
        y[j + 16] = d * np.float32(_E2M1_X2[b[1 + j] >> 4])
    return y


def _ue4m3_half(x: int) -> np.float32:
    """ggml_ue4m3_to_fp32: unsigned FP8 E4M3 (bias 7, subnormals below exponent 1; 0x7F, its NaN,
    reads as 0; the top bit is ignored), halved for the doubled FP4 table."""
    if x in (0, 0x7F):
        return np.float32(0.0)
    exp, man = (x >> 3) & 0xF, x & 0x7
    raw = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
    return np.float32(raw * 0.5)


def _nvfp4_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_nvfp4 (block_nvfp4, 64 values in 36 bytes): four UE4M3 scales, one
    per 16 values, then 32 bytes of FP4 pairs; in sub-block s, byte j's low nibble is value j and
    its high nibble value j + 8."""
    y = np.empty(64, np.float32)
    for s in range(4):
        d = _ue4m3_half(int(b[s]))
        for j in range(8):
            q = b[4 + 8 * s + j]
            y[16 * s + j] = np.float32(_E2M1_X2[q & 0xF]) * d
            y[16 * s + 8 + j] = np.float32(_E2M1_X2[q >> 4]) * d
    return y


def _grid(name: str) -> np.ndarray:
    """The lattice table of `gguf.quants.<name>` as [n_points, point_size] (see the NOTE above)."""
    cls = getattr(gguf.quants, name)
    cls.init_grid()
    return cls.grid.reshape(cls.grid_shape)


# `ksigns_iq2xs` in ggml-common.h: 7 stored sign bits, the 8th chosen so the minus count is even.
_KSIGNS = tuple(i | (bin(i).count("1") & 1) << 7 for i in range(128))


def _sign(signs: int, j: int) -> np.float32:
    return np.float32(-1.0 if signs & (1 << j) else 1.0)


def _iq2_xxs_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq2_xxs (66 bytes): f16 d, then per 32 values two u32: four grid
    indices (bytes), and four 7-bit sign indices plus a 4-bit scale in the top bits."""
    grid, d = _grid("IQ2_XXS"), _f16(b[0:2])
    y = np.empty(256, np.float32)
    for ib in range(8):
        aux1 = _u32(b, 2 + 8 * ib + 4)
        db = d * np.float32(0.5 + (aux1 >> 28)) * np.float32(0.25)
        for l in range(4):
            point, signs = grid[b[2 + 8 * ib + l]], _KSIGNS[(aux1 >> (7 * l)) & 127]
            for j in range(8):
                y[32 * ib + 8 * l + j] = db * point[j] * _sign(signs, j)
    return y


def _iq2_xs_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq2_xs (74 bytes): f16 d, 32 u16 (9-bit grid index, 7-bit sign
    index), 8 bytes of two 4-bit scales (one per 16 values)."""
    grid, d = _grid("IQ2_XS"), _f16(b[0:2])
    y = np.empty(256, np.float32)
    for ib in range(8):
        sc = b[66 + ib]
        db = [d * np.float32(0.5 + s) * np.float32(0.25) for s in (sc & 0xF, sc >> 4)]
        for l in range(4):
            q = _u16(b, 2 + 2 * (4 * ib + l))
            point, signs = grid[q & 511], _KSIGNS[q >> 9]
            for j in range(8):
                y[32 * ib + 8 * l + j] = db[l // 2] * point[j] * _sign(signs, j)
    return y


def _iq2_s_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq2_s (82 bytes): f16 d, 32 low grid-index bytes, 32 sign bytes,
    8 bytes of 2-bit high index parts, 8 bytes of two 4-bit scales."""
    grid, d = _grid("IQ2_S"), _f16(b[0:2])
    qs, signs, qh, scales = b[2:34], b[34:66], b[66:74], b[74:82]
    y = np.empty(256, np.float32)
    for ib in range(8):
        sc = scales[ib]
        db = [d * np.float32(0.5 + s) * np.float32(0.25) for s in (sc & 0xF, sc >> 4)]
        for l in range(4):
            point = grid[int(qs[4 * ib + l]) | ((int(qh[ib]) << (8 - 2 * l)) & 0x300)]
            for j in range(8):
                y[32 * ib + 8 * l + j] = db[l // 2] * point[j] * _sign(int(signs[4 * ib + l]), j)
    return y


def _iq3_xxs_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq3_xxs (98 bytes): f16 d, 64 grid-index bytes (4-value points),
    then per 32 values a u32 of four 7-bit sign indices and a 4-bit scale."""
    grid, d = _grid("IQ3_XXS"), _f16(b[0:2])
    qs = b[2:66]
    y = np.empty(256, np.float32)
    for ib in range(8):
        aux = _u32(b, 66 + 4 * ib)
        db = d * np.float32(0.5 + (aux >> 28)) * np.float32(0.5)
        for l in range(4):
            signs = _KSIGNS[(aux >> (7 * l)) & 127]
            p1, p2 = grid[qs[8 * ib + 2 * l]], grid[qs[8 * ib + 2 * l + 1]]
            for j in range(4):
                y[32 * ib + 8 * l + j] = db * p1[j] * _sign(signs, j)
                y[32 * ib + 8 * l + 4 + j] = db * p2[j] * _sign(signs, j + 4)
    return y


def _iq3_s_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq3_s (110 bytes): f16 d, 64 low grid-index bytes, 8 bytes of ninth
    index bits, 32 sign bytes, 4 bytes of two 4-bit scales (d * (1 + 2 * scale) per 32 values)."""
    grid, d = _grid("IQ3_S"), _f16(b[0:2])
    qs, qh, signs, scales = b[2:66], b[66:74], b[74:106], b[106:110]
    y = np.empty(256, np.float32)
    for ib in range(8):
        db = d * np.float32(1 + 2 * int((scales[ib // 2] >> (4 * (ib % 2))) & 0xF))
        h = int(qh[ib])
        for l in range(4):
            p1 = grid[int(qs[8 * ib + 2 * l]) | ((h << (8 - 2 * l)) & 256)]
            p2 = grid[int(qs[8 * ib + 2 * l + 1]) | ((h << (7 - 2 * l)) & 256)]
            s = int(signs[4 * ib + l])
            for j in range(4):
                y[32 * ib + 8 * l + j] = db * p1[j] * _sign(s, j)
                y[32 * ib + 8 * l + 4 + j] = db * p2[j] * _sign(s, j + 4)
    return y


_IQ1_DELTA = 0.125  # IQ1S_DELTA / IQ1M_DELTA in ggml-common.h


def _iq1_s_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq1_s (50 bytes): f16 d, 32 low grid-index bytes, 8 u16 each holding
    four 3-bit high index parts, a 3-bit scale (d * (2 * scale + 1)) and the delta's sign."""
    grid, d = _grid("IQ1_S"), _f16(b[0:2])
    qs = b[2:34]
    y = np.empty(256, np.float32)
    for ib in range(8):
        qh = _u16(b, 34 + 2 * ib)
        dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
        delta = np.float32(-_IQ1_DELTA if qh & 0x8000 else _IQ1_DELTA)
        for l in range(4):
            point = grid[int(qs[4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)]
            for j in range(8):
                y[32 * ib + 8 * l + j] = dl * (point[j] + delta)
    return y


def _iq1_m_scale_bits(b: np.ndarray) -> int:
    """IQ1_M's f16 super-block scale: the top nibbles of its four u16 scale words, first lowest."""
    return sum((_u16(b, 48 + 2 * k) >> 12) << (4 * k) for k in range(4))


def _iq1_m_block(b: np.ndarray) -> np.ndarray:
    """ggml's dequantize_row_iq1_m (56 bytes): 32 low grid-index bytes, 16 bytes each holding two
    3-bit high index parts and two delta signs, four u16 of 3-bit scales (one per 16 values)
    whose top nibbles together are the f16 d."""
    grid = _grid("IQ1_M")
    d = _half_from_bits(_iq1_m_scale_bits(b))
    qs, qh = b[0:32], b[32:48]
    y = np.empty(256, np.float32)
    for ib in range(8):
        sc = _u16(b, 48 + 2 * (ib // 2))
        dls = [d * np.float32(2 * ((sc >> (6 * (ib % 2) + k)) & 7) + 1) for k in (0, 3)]
        h0, h1 = int(qh[2 * ib]), int(qh[2 * ib + 1])
        high = ((h0 << 8) & 0x700, (h0 << 4) & 0x700, (h1 << 8) & 0x700, (h1 << 4) & 0x700)
        minus = (h0 & 0x08, h0 & 0x80, h1 & 0x08, h1 & 0x80)
        for l in range(4):
            point = grid[int(qs[4 * ib + l]) | high[l]]
            delta = np.float32(-_IQ1_DELTA if minus[l] else _IQ1_DELTA)
            for j in range(8):
                y[32 * ib + 8 * l + j] = dls[l // 2] * (point[j] + delta)
    return y


# Keyed by name: a type the installed `gguf` does not know (older versions lack NVFP4) drops out.
_BLOCKS_BY_NAME = {
    "F16": _f16_value,
    "Q5_K": _q5_k_block,
    "TQ1_0": _tq1_0_block,
    "TQ2_0": _tq2_0_block,
    "IQ4_NL": _iq4_nl_block,
    "IQ4_XS": _iq4_xs_block,
    "MXFP4": _mxfp4_block,
    "NVFP4": _nvfp4_block,
    "IQ2_XXS": _iq2_xxs_block,
    "IQ2_XS": _iq2_xs_block,
    "IQ2_S": _iq2_s_block,
    "IQ3_XXS": _iq3_xxs_block,
    "IQ3_S": _iq3_s_block,
    "IQ1_S": _iq1_s_block,
    "IQ1_M": _iq1_m_block,
}
SPEC_BLOCKS = {getattr(T, n): f for n, f in _BLOCKS_BY_NAME.items() if hasattr(T, n)}

# Byte offsets of each block's f16 scales, by type name (F16, MXFP4 and NVFP4 have none; IQ1_M's is split).
_F16_SCALES_AT = {
    "Q5_K": (0, 2),
    "TQ1_0": (52,),
    "TQ2_0": (64,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
}


# Codes placed at the start of each row: F16 inf, -inf, the smallest subnormal, -0; NVFP4's scale
# bytes 0, 0x7F (the E4M3 NaN code, read as 0), the smallest subnormal, a set (ignored) top bit.
_EDGE_BYTES = {
    "F16": np.array([0x7C00, 0xFC00, 0x0001, 0x8000], "<u2").view(np.uint8),
    "NVFP4": np.array([0x00, 0x7F, 0x01, 0xFF], np.uint8),
}


def set_scales(qtype: T, raw: np.ndarray, block_bytes: int) -> None:
    """Overwrite, in place, every block's f16 scale(s) in `raw` (u8[rows, blocks * block_bytes])
    with small finite values (a NaN scale would compare as NaN on both sides, checking nothing),
    and each row's first bytes with the format's edge codes (`_EDGE_BYTES`)."""
    for r in range(raw.shape[0]):
        edge = _EDGE_BYTES.get(qtype.name)
        if edge is not None:
            raw[r, : edge.size] = edge
        for k in range(raw.shape[1] // block_bytes):
            blk = raw[r, k * block_bytes : (k + 1) * block_bytes]
            for o in _F16_SCALES_AT.get(qtype.name, ()):
                blk[o : o + 2] = np.array([np.float16(0.01 * (o + 1 + k))]).view(np.uint8)
            if qtype.name == "IQ1_M":
                bits = int(np.array([np.float16(0.01 * (1 + k))]).view(np.uint16)[0])
                for n in range(4):  # nibble n of the scale is the top nibble of word n
                    at = 48 + 2 * n + 1
                    blk[at] = (blk[at] & 0x0F) | (((bits >> (4 * n)) & 0xF) << 4)
