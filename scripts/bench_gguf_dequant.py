"""GGUF dequantization: our numpy kernels vs the `gguf` library's `gguf.quants`, per block type.

    python scripts/bench_gguf_dequant.py [--rows 1536] [--cols 1024] [--runs 5]

1. For every type both can dequantize, one tensor of `rows x cols` values: the library quantizes
   random weights where it can, random bytes with sane f16 super-block scales otherwise (the
   K-quants, which it only dequantizes).
2. Each dequantizer runs `runs` times on the same bytes; best time of each, and whether the two
   results are equal bit for bit.
3. Prints a table and a JSON line; `checkpoints.gguf_quants` keeps ours only where it is faster
   (`_OWN_KERNELS`) and uses the library for the rest (`LIBRARY_TYPES`).
"""

from __future__ import annotations

import argparse
import json
import time

import _path  # noqa: F401
import gguf
import numpy as np

from checkpoints.gguf_quants import (
    _OWN_KERNELS,
    LIBRARY_TYPES,
    _bits_per_plane,
    _f16,
    _float_kernel,
    _k4_scales_and_mins,
    _low_high_nibbles,
)

T = gguf.GGMLQuantizationType
# Byte offsets of the f16 super-block scales of the K-quants (random bytes elsewhere).
K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def stored(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F16:
        return w.astype(np.float16)
    if qtype not in K_SCALES:
        return gguf.quants.quantize(w, qtype)
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, block_bytes), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        d = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)
        raw[:, :, at : at + 2] = d[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(w.shape[0], -1)


def q5_k(blocks: np.ndarray) -> np.ndarray:  # u8[n_blocks, 176]
    n_blocks = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k4_scales_and_mins(blocks[:, 4:16])
    low = _low_high_nibbles(blocks[:, 48:176].reshape(n_blocks, 4, 32)).reshape(n_blocks, 8, 32)
    high = _bits_per_plane(blocks[:, 16:48])  # bit s of qh byte l: fifth bit of sub-block s
    q = (low | (high << 4)).astype(np.float32)
    y = (d * sc.astype(np.float32))[:, :, None] * q
    return (y - (dmin * mn.astype(np.float32))[:, :, None]).reshape(n_blocks, 256)


def best(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", type=int, default=1536)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((args.rows, args.cols)).astype(np.float32)
    types = (
        T.F16,
        T.BF16,
        T.Q4_0,
        T.Q4_1,
        T.Q5_0,
        T.Q5_1,
        T.Q8_0,
        T.Q2_K,
        T.Q3_K,
        T.Q4_K,
        T.Q5_K,
        T.Q6_K,
    )
    # Our F16 and Q5_K kernels are kept here (not in checkpoints.gguf_quants) to show why the library's
    # are used.
    own = {**_OWN_KERNELS, T.F16: _float_kernel("<f2"), T.Q5_K: q5_k}
    rows = []
    print(
        f"{'type':6s} {'ours ms':>8s} {'gguf ms':>8s} {'gguf/ours':>10s} {'equal':>6s} {'used':>8s}"
    )
    for qtype in types:
        raw = stored(w, qtype, rng)
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, block_bytes)

        def ours(kernel=own[qtype], blocks=blocks):
            return kernel(blocks)

        def lib(raw=raw, qtype=qtype):
            return gguf.quants.dequantize(raw, qtype)

        t_ours, t_lib = best(ours, args.runs), best(lib, args.runs)
        equal = np.array_equal(ours().reshape(w.shape), lib().reshape(w.shape), equal_nan=True)
        used = "library" if qtype in LIBRARY_TYPES else "ours"
        rows.append(
            {
                "type": qtype.name,
                "ours_ms": round(t_ours * 1e3, 2),
                "gguf_ms": round(t_lib * 1e3, 2),
                "equal": bool(equal),
                "used": used,
            }
        )
        print(
            f"{qtype.name:6s} {t_ours * 1e3:8.2f} {t_lib * 1e3:8.2f} {t_lib / t_ours:10.2f} "
            f"{str(equal):>6s} {used:>8s}"
        )
    print(
        json.dumps(
            {
                "bench": "gguf_dequant",
                "rows": args.rows,
                "cols": args.cols,
                "runs": args.runs,
                "types": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
