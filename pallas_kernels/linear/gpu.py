"""Weight-only dequantizing matmul as one Pallas GPU kernel (Triton lowering), for few token rows.

`quantized_matmul(x, data, scale, offset)` computes `x @ dequantize(data, scale, offset)`:
x [T, K] (bf16 / f16 / f32) times a weight stored as int8 codes (`jaxinfer.quantization`'s
int8 layout, scales [G, N]) or uint4 codes (int4: scales and offsets [G, N], value = code *
scale + offset), G groups of K / G consecutive input channels, -> [T, N] of x's dtype. The
weight is read from HBM in its stored bits and never written back converted.

1. Trace-time views: an int4 weight (`uint4[K, N]`, packed two per byte by XLA along N, the first
   of each pair in the low nibble) is bitcast to `uint8[K, N/2]` (free: the same bytes); int8
   stays `int8[K, N]`.
2. `Blocks` (see `blocks`: the measured `TUNED` table, else a rule) fixes the grid
   `(column blocks, K splits, token blocks)`: a program owns `block_n` output columns of `block_t`
   token rows and one of `split` equal runs of K, which it walks in tiles of `block_k` input
   channels (a divisor of the group size, so a tile has one scale row), `unroll` tiles a loop
   iteration. Per tile, in registers, one of two forms:
   - "dot" (any rows, padded to Triton's 16 by clamping the row index): the code tile converted to
     x's dtype (int4: low and high nibbles as two int8 tiles, the even and odd output columns;
     Triton widens int8 to bf16 with byte permutes), a tensor-core product with x's tile (f32
     accumulate), scaled by the tile's group scales, plus x's tile row sums times the group
     offsets (int4: `sum_k x_k (u_k s + o) = s (x . u) + o sum_k x_k`);
   - "fma" (one row, the decode GEMV): x's column times the codes as exact floats added into a
     [block_k, W] f32 sum (`_code_fma`: on a GPU one inline PTX block per 4 codes, a `prmt`
     that makes the code an f32 denormal and an `fma` a code, x and the sums scaled by powers
     of two to keep the products normal), a group's tiles at a time (`fma_window`); then that
     group's scales (and int4's offsets times the window's x sums) applied once per element
     into a second [block_k, W] accumulator, summed over K at the end: no layout change through
     shared memory, no tensor-core padding, no per-code scale arithmetic. int4's f16 scales and
     offsets are read as u32 pairs (an even and an odd column: one vectorizable load).
   Neither form converts an integer to a float with a conversion instruction: those issue at a
   fraction of the FMA rate and bounded the kernel on an H200 (BENCHMARKS.md "The dequantizing
   matmul tuned"; `tests/test_linear_gpu.py` reads the compiled PTX).
   An act-order weight (`perm=`, GPTQ's desc_act: code row k multiplies x's channel perm[k])
   loads each tile's x through the tile's perm entries: no gathered copy of x, no extra launch.
3. One split: the f32 sum is stored in x's dtype (int4: even and odd columns by strided stores).
   Several: each program stores its f32 partial into `[split * T, N]`, summed over the splits by
   XLA (a small reduce: split x T x N floats) and cast to x's dtype.

NOTE: for few rows only (`MAX_ROWS`: decode and short chunks). Every token block reads the whole
weight again, so a prefill of many rows is left to XLA's dequantize + GEMM (compute bound there:
the converted weight is a small share of its time). `supported()` names what the kernel refuses.

Legend: T token rows, K input channels (contracted), N output channels, G scale groups, W code
columns a program reads (block_n, or block_n / 2 bytes of int4 pairs).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MAX_ROWS = 64  # token rows the kernel takes (one token block: every row block rereads W)
MAX_BLOCK_K = 128
# "fma" form: floats of each of its two [block_k, block_n] f32 accumulators (code sums, scaled
# sums) at most: 32 a thread at 4 warps; block_k = FMA_TILE_FLOATS // block_n (>= 16)
FMA_TILE_FLOATS = 4096
MIN_PROGRAMS = 200  # programs wanted for a decode GEMV: ~1.5 waves of an H100's / H200's 132 SMs
# "fma" form: K split further while the programs stay <= FMA_PROGRAMS and each run keeps
# >= FMA_RUN_TILES tiles (the 2026-11-27 H200 sweep's best one-row splits: 256-1,002 programs)
FMA_PROGRAMS = 1024
FMA_RUN_TILES = 32
CODE_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.uint4))
FORMS = ("dot", "fma")


class Blocks(NamedTuple):
    """One launch configuration (see the module docstring, step 2)."""

    block_n: int = 128  # output columns a program owns (int4: >= 32)
    split: int = 1  # K runs, one per program, summed by XLA when > 1
    block_k: int = 128  # input channels a tile (<= the group size; a power of two >= 16)
    unroll: int = 1  # tiles a loop iteration
    form: str = "dot"  # "dot" or "fma" (one row only)
    num_warps: int = 4
    num_stages: int = 3


# Measured best `Blocks` per (code dtype name, K, N, row class), row class 1 (one row) or the
# padded token block (16, 32, 64): `scripts/bench_linear_gpu.py --tuned-out` on a GPU writes them
# (`load_tuned` adds such a file). `blocks` takes the entry of the nearest row class that can run
# the step's rows, else `default_blocks`.
# NOTE: measured 2026-11-27 on an H200 (jax 0.11.2) at Llama-3-8B's projections, groups of 128
# (BENCHMARKS.md "The one-row dequantizing matmul timed"), with the "fma" form's inline-PTX body;
# the comment gives the product's time in the sweep (one jitted call over several weight copies,
# launch gaps included). The LM head's rows are int8 only: an int4 model keeps its
# vocabulary-sized weights int8.
TUNED: dict[tuple[str, int, int, int], Blocks] = {
    ("uint4", 4096, 28672, 1): Blocks(256, 8, 16, 8, "fma", 4, 4),  # gate_up 51 us
    ("uint4", 4096, 28672, 32): Blocks(256, 2, 128, 1, "dot", 4, 3),  # gate_up 117 us
    ("uint4", 14336, 4096, 1): Blocks(256, 16, 16, 8, "fma", 4, 3),  # down 38 us
    ("uint4", 14336, 4096, 32): Blocks(256, 16, 128, 1, "dot", 4, 4),  # down 71 us
    ("uint4", 4096, 6144, 1): Blocks(256, 8, 16, 16, "fma", 4, 3),  # qkv 27 us
    ("uint4", 4096, 6144, 32): Blocks(256, 8, 128, 1, "dot", 4, 2),  # qkv 48 us
    ("uint4", 4096, 4096, 1): Blocks(256, 16, 16, 8, "fma", 8, 4),  # o 24 us
    ("uint4", 4096, 4096, 32): Blocks(128, 8, 128, 2, "dot", 4, 3),  # o 34 us
    ("int8", 4096, 28672, 1): Blocks(256, 8, 16, 16, "fma", 4, 3),  # gate_up 72 us
    ("int8", 4096, 28672, 32): Blocks(128, 1, 128, 1, "dot", 4, 4),  # gate_up 106 us
    ("int8", 14336, 4096, 1): Blocks(256, 16, 16, 8, "fma", 8, 4),  # down 48 us
    ("int8", 14336, 4096, 32): Blocks(128, 8, 128, 1, "dot", 4, 4),  # down 66 us
    ("int8", 4096, 6144, 1): Blocks(128, 8, 32, 4, "fma", 4, 3),  # qkv 31 us
    ("int8", 4096, 6144, 32): Blocks(128, 8, 128, 1, "dot", 4, 3),  # qkv 38 us
    ("int8", 4096, 4096, 1): Blocks(128, 8, 32, 4, "fma", 4, 3),  # o 21 us
    ("int8", 4096, 4096, 32): Blocks(128, 8, 128, 1, "dot", 4, 3),  # o 36 us
    ("int8", 4096, 128256, 1): Blocks(256, 1, 16, 8, "fma", 4, 3),  # lm_head 225 us
    ("int8", 4096, 128256, 32): Blocks(256, 1, 128, 1, "dot", 4, 3),  # lm_head 331 us
}  # fmt: skip


def load_tuned(entries: list[dict]) -> None:
    """Adds `scripts/bench_linear_gpu.py --tuned-out` entries ({"codes", "k", "n", "rows",
    "blocks"}) to `TUNED`."""
    for e in entries:
        TUNED[(e["codes"], e["k"], e["n"], e["rows"])] = Blocks(**e["blocks"])


def _pow2_at_least(n: int, lo: int = 16) -> int:
    return max(lo, 1 << max(n - 1, 0).bit_length())


def row_class(t: int) -> int:
    return 1 if t == 1 else _pow2_at_least(t)


def max_block_k(k: int, groups: int) -> int:
    """The largest power of two <= MAX_BLOCK_K dividing the group size K / G."""
    g = k // groups
    return min(MAX_BLOCK_K, g & -g)


def default_blocks(t: int, k: int, n: int, groups: int, int4: bool) -> Blocks:
    """The rule for shapes `TUNED` lacks, read off the H200 sweeps (BENCHMARKS.md "The
    dequantizing matmul tuned", "The one-row dequantizing matmul timed"). More rows: "dot" over
    128-channel tiles, 128 output columns a program (fewer for narrow weights), K split in halves
    until >= MIN_PROGRAMS programs (each run >= 4 tiles). One row: "fma" with 256 columns a program
    over tiles of FMA_TILE_FLOATS / 256 = 16 channels (its code sums and scaled sums are two
    [block_k, W] accumulators), up to 8 tiles a loop step within a group, K split as for "dot" and
    then further while the programs stay <= FMA_PROGRAMS and each run keeps >= FMA_RUN_TILES
    tiles: 256 / 16 / 8 won 8 of the 10 one-row cases of the 2026-11-27 sweep, and these splits
    are its best in 4 of the 5 int4 ones (qkv's is 16 against its best 8: 33 vs 29 us)."""
    fma = t == 1
    bk = max_block_k(k, groups)
    lo = 32 if int4 else 16
    bn = max(lo, min(256 if fma else 128, _pow2_at_least(-(-n // 8), lo)))
    unroll = 1
    if fma:
        bk = max(16, min(bk, FMA_TILE_FLOATS // bn))
        per = (k // groups) // bk
        unroll = next(
            u for u in (8, 4, 2, 1) if (k // bk) % u == 0 and max(per, u) % min(per, u) == 0
        )
    tiles, split = k // bk, 1

    def more(split: int) -> bool:
        if tiles % (2 * split * unroll):
            return False
        programs, run = -(-n // bn) * split, tiles // (2 * split)
        few = programs < MIN_PROGRAMS and run >= 4
        return few or (fma and 2 * programs <= FMA_PROGRAMS and run >= FMA_RUN_TILES)

    while more(split):
        split *= 2
    return Blocks(block_n=bn, split=split, block_k=bk, unroll=unroll, form="fma" if fma else "dot")


def blocks(t: int, k: int, n: int, groups: int, dtype) -> Blocks:
    """The launch configuration of x [t, k] times codes of `dtype` [k, n] in `groups` groups."""
    name, rc = jnp.dtype(dtype).name, row_class(t)
    # The tuned row class nearest to t's (log scale; the smaller on a tie) that can run t rows.
    tuned = sorted(
        (abs(math.log2(key[3] / rc)), key[3], b)
        for key, b in TUNED.items()
        if key[:3] == (name, k, n)
    )
    for _, _, b in tuned:
        if check_blocks(b, t, k, n, groups, dtype) is None:
            return b
    return default_blocks(t, k, n, groups, jnp.dtype(dtype) == jnp.uint4)


def check_blocks(b: Blocks, t: int, k: int, n: int, groups: int, dtype) -> str | None:
    """None when `b` can run x [t, k] times codes of `dtype` [k, n], else why not."""
    int4 = jnp.dtype(dtype) == jnp.uint4
    if b.form not in FORMS:
        return f"form {b.form!r} is not one of {FORMS}"
    if b.form == "fma" and t != 1:
        return f"form 'fma' takes one row, not {t}"
    if b.block_k > max_block_k(k, groups) or b.block_k < 16 or b.block_k & (b.block_k - 1):
        return f"block_k {b.block_k} does not divide the group size {k // groups}"
    if b.block_n & (b.block_n - 1) or b.block_n < (32 if int4 else 16):
        return f"block_n {b.block_n} is not a power of two >= {32 if int4 else 16}"
    tiles = k // b.block_k
    if b.split < 1 or tiles % (b.split * b.unroll):
        return f"{tiles} K tiles do not split into {b.split} runs of {b.unroll}-tile steps"
    per = (k // groups) // b.block_k
    if b.form == "fma" and max(per, b.unroll) % min(per, b.unroll):
        return f"form 'fma': {b.unroll} tiles a step do not align with {per}-tile groups"
    return None


def codes_per_thread(b: Blocks) -> int:
    """Codes one thread takes a loop step of the "fma" form: `block_n` codes a tile row (int4:
    block_n / 2 bytes of pairs), block_k rows a tile, `unroll` tiles, over the program's threads."""
    return b.unroll * b.block_k * b.block_n // (32 * b.num_warps)


def fma_window(b: Blocks, k: int, groups: int) -> int:
    """Tiles the "fma" form sums before it applies their group's scales: a group's tiles, at
    most a loop step's (`check_blocks` makes the one divide the other)."""
    return min(b.unroll, (k // groups) // b.block_k)


def supported(t: int, k: int, n: int, groups: int, dtype: jnp.dtype) -> str | None:
    """None when the kernel takes x [t, k] times codes of `dtype` [k, n] with `groups` scale
    groups, else why not."""
    dtype = jnp.dtype(dtype)
    if dtype not in CODE_DTYPES:
        return f"quantized matmul kernel: codes {dtype} are not int8 or uint4"
    if t > MAX_ROWS:
        return f"quantized matmul kernel: {t} rows > {MAX_ROWS}"
    if groups < 1 or k % groups:
        return f"quantized matmul kernel: {groups} groups do not split {k} input channels"
    if max_block_k(k, groups) < 16:
        return f"quantized matmul kernel: group size {k // groups} is not a multiple of 16"
    if dtype == jnp.uint4 and n % 2:
        return f"quantized matmul kernel: int4 needs an even output width, got {n}"
    return None


# The "fma" form's codes as floats with no arithmetic: a code's byte alone in the low byte of a
# 32-bit word is the f32 denormal code * 2**-149 (exact), and an `fma` with a denormal operand
# runs at full rate on NVIDIA GPUs (IEEE: no flush without `.ftz`). x is scaled by 2**X_SHIFT
# so that x' * code * 2**-149 = x * code * 2**-SUM_SHIFT lands in the normal range (|x| up to
# 2**64, products down to 2**-41 keep every bit); the sums stay scaled by 2**-SUM_SHIFT until
# the program's output, scaled back once (powers of two: exact).
X_SHIFT = 64
SUM_SHIFT = 149 - X_SHIFT

# One PTX block per 4 codes of one sum (Triton packs 4 bytes of a thread's elements into one
# register, element j in byte j; JAX lowers one result an asm, so int4's low and high nibbles
# take one block each): the 4 codes made one a byte (the nibble; int8: plus 128), then per code
# a `prmt` that keeps its byte alone and an `fma` that adds x' times it: 2.25-2.5 instructions
# a code.
_CODES = {
    "lo": "and.b32 c, $4, 0x0F0F0F0F;",
    "hi": "shr.u32 c, $4, 4; and.b32 c, c, 0x0F0F0F0F;",
    "int8": "xor.b32 c, $4, 0x80808080;",
}


def _asm_block(codes: str) -> str:
    """Operands: $0-$3 the new sums, $4 the 4 packed codes, $5-$8 x', $9-$12 the sums."""
    each = " ".join(
        f"prmt.b32 f, c, z, 0x444{j}; fma.rn.f32 ${j}, ${5 + j}, f, ${9 + j};" for j in range(4)
    )
    return f"{{ .reg .b32 c, f, z; mov.b32 z, 0; {codes} {each} }}"


_ASM = {kind: _asm_block(c) for kind, c in _CODES.items()}


def _code_fma(codes, xs, sums, int4: bool, asm: bool):
    """`sums` (int4: the even and odd output columns' [BK, W] f32 sums, int8: one) plus x's
    column times the codes [BK, W] (uint8 int4 pairs, the first in the low nibble, or int8 plus
    128), all scaled by 2**-SUM_SHIFT; `xs` is x's column [BK, 1] scaled by 2**X_SHIFT on a GPU
    (one inline PTX block per 4 codes, `_ASM`: the codes are denormals), by 2**-SUM_SHIFT
    interpreted (XLA:CPU flushes denormals: there the codes are converted)."""
    shape = codes.shape
    x = jnp.broadcast_to(xs, shape)
    if asm:
        out = [jax.ShapeDtypeStruct(shape, jnp.float32)]
        return tuple(
            plgpu.elementwise_inline_asm(
                _ASM[kind], args=[codes, x, jnp.broadcast_to(acc, shape)],
                constraints="=r,=r,=r,=r," + ",".join(["r"] * 9), pack=4, result_shape_dtypes=out,
            )[0]
            for kind, acc in zip(("lo", "hi") if int4 else ("int8",), sums)
        )  # fmt: skip
    c = codes.astype(jnp.int32)
    halves = ((c & 15), (c >> 4) & 15) if int4 else ((c + 128),)
    return tuple(acc + x * h.astype(jnp.float32) for acc, h in zip(sums, halves))


# int4 pairs' low and high nibbles, 4 bytes a register: one `and` (`shr` + `and`) per 4 codes,
# where Triton extracts, masks and repacks each byte.
_NIBBLES = (
    "and.b32 $0, $1, 0x0F0F0F0F;",
    "{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }",
)


def _nibbles(codes, asm: bool):
    """uint8 int4 pairs [BK, W] -> their low and high nibbles as int8 (the even and odd output
    columns' codes)."""
    if not asm:
        return (codes & 15).astype(jnp.int8), (codes >> 4).astype(jnp.int8)
    out = [jax.ShapeDtypeStruct(codes.shape, jnp.int8)]
    return tuple(
        plgpu.elementwise_inline_asm(
            a, args=[codes], constraints="=r,r", pack=4, result_shape_dtypes=out
        )[0]
        for a in _NIBBLES
    )


def _fma(a, b, c, asm: bool):
    """a * b + c in f32, one rounding on a GPU (XLA's Triton emits separate `mul.rn` /
    `add.rn`, which ptxas may not contract)."""
    if not asm:
        return a * b + c
    [y] = plgpu.elementwise_inline_asm(
        "fma.rn.f32 $0, $1, $2, $3;",
        args=[a, b, c],
        constraints="=r,r,r,r",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return y


def _kernel(
    x_ref,  # [T, K]
    q_ref,  # i8[K, N] | u8[K, N/2] (int4 pairs)
    s_ref,  # [G, N] f32 | f16, or u32[G, N/2]: int4's f16 pairs (paired)
    *rest,  # (o_ref, as s_ref)? (perm_ref, i32[K])? then out_ref [T, N] (x's dtype) | [split * T, N] f32
    b: Blocks,
    block_t: int,
    int4: bool,
    paired: bool,
    permuted: bool,
    dot_dtype: jnp.dtype,
    interpret: bool,
):
    o_ref = rest[0] if int4 else None
    perm_ref = rest[int(int4)] if permuted else None
    out_ref = rest[-1]
    t, k_dim = x_ref.shape
    n_dim = out_ref.shape[1]
    group = k_dim // s_ref.shape[0]
    j, sp, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    width = b.block_n // 2 if int4 else b.block_n  # code columns a program reads
    code_cols = n_dim // 2 if int4 else n_dim
    fma = b.form == "fma"

    def meta(ref, g):  # group g's scales (offsets) of the accumulators' columns, f32 [W] each
        if not paired:
            return tuple(ref[g, cols].astype(jnp.float32) for cols in outs)
        pair = ref[g, cc]  # u32 [W]: one load for an even and an odd column
        return tuple(
            jax.lax.bitcast_convert_type(h.astype(jnp.uint16), jnp.float16).astype(jnp.float32)
            for h in (pair & 0xFFFF, pair >> 16)
        )

    def span(start, size: int, limit: int):  # indices start.., clamped into range if needed
        idx = start + jax.lax.broadcasted_iota(jnp.int32, (size,), 0)
        return idx if limit % size == 0 else jnp.minimum(idx, limit - 1)

    rows = span(i * block_t, block_t, t)  # i32[BT]
    cc = span(j * width, width, code_cols)  # i32[W]: code columns
    # The output columns each accumulator holds: int4 even (low nibbles) and odd (high) ones.
    outs = (2 * cc, 2 * cc + 1) if int4 else (cc,)
    steps = k_dim // b.block_k // b.split // b.unroll
    first = sp * steps * b.unroll  # the run's first K tile
    lane = jax.lax.broadcasted_iota(jnp.int32, (b.block_k,), 0)
    asm = not interpret

    def codes_at(kt):
        ks = kt * b.block_k + lane
        return ks, q_ref[ks[:, None], cc[None, :]]  # [BK, W]

    def x_channels(ks):  # the channels of x that code rows ks read (act-order: through perm)
        return perm_ref[ks] if permuted else ks

    def tile(kt, accs):  # the "dot" form: one tensor-core product a tile
        ks, codes = codes_at(kt)
        g = kt * b.block_k // group
        if int4:  # NOTE: int8 values: Triton converts int8 to bf16 with byte permutes
            halves = _nibbles(codes, asm)
        else:
            halves = (codes,)
        xk = x_ref[rows[:, None], x_channels(ks)[None, :]].astype(dot_dtype)  # [BT, BK]
        if int4:
            xsum = jnp.sum(xk.astype(jnp.float32), axis=1)[:, None]  # [BT, 1]
        new = []
        offsets = meta(o_ref, g) if int4 else (None,)
        for acc, h, scale, off in zip(accs, halves, meta(s_ref, g), offsets):
            part = jax.lax.dot(xk, h.astype(xk.dtype), preferred_element_type=jnp.float32)
            shape = part.shape
            if int4:  # acc + xsum * off first, then + part * scale: two FMAs an element
                wide = jnp.broadcast_to(off[None, :], shape)
                acc = _fma(jnp.broadcast_to(xsum, shape), wide, acc, asm)
            new.append(_fma(part, jnp.broadcast_to(scale[None, :], shape), acc, asm))
        return tuple(new)

    def window(kt0, accs):  # the "fma" form: `per` tiles of one group, then their scales
        # Sums scaled by 2**-SUM_SHIFT (see `_code_fma`), as is xg, the window's x sum per lane.
        g = kt0 * b.block_k // group
        tiles = [codes_at(kt0 + u) for u in range(per)]
        xcols = [
            x_ref[(0 * ks)[:, None], x_channels(ks)[:, None]].astype(jnp.float32) for ks, _ in tiles
        ]
        xg = functools.reduce(jnp.add, xcols) * 2.0**-SUM_SHIFT  # [BK, 1]
        # int8 codes come as code + 128: their sums start at -128 x's window sum
        sums = (jnp.zeros_like(xg),) * 2 if int4 else (-128.0 * xg,)
        for (_, codes), xcol in zip(tiles, xcols):
            xs = xcol * 2.0 ** (X_SHIFT if asm else -SUM_SHIFT)
            sums = _code_fma(codes, xs, sums, int4, asm)
        new = []
        offsets = meta(o_ref, g) if int4 else (None,)
        for acc, part, scale, off in zip(accs, sums, meta(s_ref, g), offsets):
            acc = _fma(part, jnp.broadcast_to(scale[None, :], part.shape), acc, asm)
            if int4:  # sum_k x_k o = (the window's x sum per lane) o, summed over lanes later
                wide = jnp.broadcast_to(off[None, :], part.shape)
                acc = _fma(jnp.broadcast_to(xg, part.shape), wide, acc, asm)
            new.append(acc)
        return tuple(new)

    per = fma_window(b, k_dim, s_ref.shape[0]) if fma else 1

    def step(it, accs):
        kt = first + it * b.unroll
        if fma:
            for u in range(0, b.unroll, per):
                accs = window(kt + u, accs)
            return accs
        for u in range(b.unroll):
            accs = tile(kt + u, accs)
        return accs

    shape = (b.block_k, width) if fma else (block_t, width)
    accs = jax.lax.fori_loop(0, steps, step, (jnp.zeros(shape, jnp.float32),) * len(outs))
    split_rows = sp * t + rows  # this run's rows of the [split * T, N] partials
    for acc, cols in zip(accs, outs):
        if fma:
            y = jnp.sum(acc, axis=0) * 2.0**SUM_SHIFT  # [W]
            out_ref[(0 * cols + sp), cols] = y.astype(out_ref.dtype)
        else:
            out_ref[split_rows[:, None], cols[None, :]] = acc.astype(out_ref.dtype)


def quantized_matmul(
    x: jax.Array,
    data: jax.Array,
    scale: jax.Array,
    offset: jax.Array | None = None,
    *,
    perm: jax.Array | None = None,
    interpret: bool = False,
    config: Blocks | None = None,
) -> jax.Array:
    """x [T, K] @ the weight `data` [K, N] (int8 or uint4 codes) with `scale` [G, N] (and `offset`
    [G, N] for uint4) -> [T, N] in x's dtype; see the module docstring. `perm` (i32[K], an
    act-order weight's `QArray.perm`): code row k multiplies x's channel perm[k], read through it
    in the kernel (no gathered copy of x). `config`: the launch configuration (default:
    `blocks`)."""
    t, k_dim = x.shape
    n_dim = data.shape[1]
    groups = scale.shape[0]
    reason = supported(t, k_dim, n_dim, groups, data.dtype)
    if reason is not None:
        raise ValueError(reason)
    b = config or blocks(t, k_dim, n_dim, groups, data.dtype)
    reason = check_blocks(b, t, k_dim, n_dim, groups, data.dtype)
    if reason is not None:
        raise ValueError(f"quantized matmul kernel: {reason}")
    int4 = jnp.dtype(data.dtype) == jnp.uint4
    if int4 != (offset is not None):
        raise ValueError("quantized matmul kernel: uint4 codes need offsets, int8 codes none")
    if int4:  # NOTE: the bytes XLA stores; the first of each pair in the low nibble
        data = jax.lax.bitcast_convert_type(data.reshape(k_dim, n_dim // 2, 2), jnp.uint8)
    # int4's f16 scales and offsets as u32 pairs (an even and an odd column, the codes' byte
    # pairs): one load for both, and loads that vectorize (per column they are 2 elements apart).
    paired = int4 and scale.dtype == offset.dtype == jnp.float16
    if paired:
        pairs = lambda v: jax.lax.bitcast_convert_type(  # noqa: E731
            v.reshape(groups, n_dim // 2, 2), jnp.uint32
        )
        scale, offset = pairs(scale), pairs(offset)
    block_t = 1 if b.form == "fma" else _pow2_at_least(t)
    grid = (pl.cdiv(n_dim, b.block_n), b.split, pl.cdiv(t, block_t))
    out_dtype = jnp.dtype(x.dtype if b.split == 1 else jnp.float32)
    if perm is not None and perm.shape != (k_dim,):
        raise ValueError(f"quantized matmul kernel: perm must be i32[{k_dim}], got {perm.shape}")
    operands = (x, data, scale) + ((offset,) if int4 else ())
    operands += () if perm is None else (perm.astype(jnp.int32),)
    size = lambda v: v.size * v.dtype.itemsize  # noqa: E731
    cost = pl.CostEstimate(
        flops=2 * t * k_dim * n_dim,
        transcendentals=0,
        bytes_accessed=sum(size(v) for v in operands) + b.split * t * n_dim * out_dtype.itemsize,
    )
    y = pl.pallas_call(
        functools.partial(
            _kernel,
            b=b,
            block_t=block_t,
            int4=int4,
            paired=paired,
            permuted=perm is not None,
            # NOTE: XLA:CPU runs no bf16 x bf16 -> f32 dot: interpreted, the operands are widened
            # (exactly: their products are exact in f32, summed in f32 as on the tensor cores).
            dot_dtype=jnp.float32 if interpret else x.dtype,
            interpret=interpret,
        ),
        grid=grid,
        out_shape=jax.ShapeDtypeStruct((b.split * t, n_dim), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=b.num_warps, num_stages=b.num_stages),
        cost_estimate=cost,
        interpret=interpret,
        name="int4_matmul" if int4 else "int8_matmul",
    )(*operands)
    if b.split == 1:
        return y
    return jnp.sum(y.reshape(b.split, t, n_dim), axis=0).astype(x.dtype)
