"""Weight-sized intermediates of a compiled step: a quantized weight converted before its product.

A weight-only quantized step is bound by the bytes of its weights; it keeps that advantage only
where the product reads the stored codes. When the compiler instead materializes a float copy of
a weight (a convert / multiply by the scales written to HBM, then read by the GEMM) or a
weight-sized f32 partial product (a decode step's per-group product turned into a multiply
then a reduce), that intermediate costs 2-8x the weight's own bytes twice over.

1. `weight_sized(text)` reads an optimized HLO module (`compiled.as_text()`): the ENTRY
   parameters holding quantized codes (`params...data`: s8 / u4 / s4 / f8 arrays), followed
   through free views (bitcast, reshape, get-tuple-element) in every computation that is not a
   fusion's body; it returns each materialized instruction that reads such a weight and writes a
   float array (f16 / bf16 / f32 / f64) of at least half that weight's elements
   (`Intermediate`: instruction, opcode, result shape, weight, JAX op name).
2. `bytes_accessed(text)` estimates the HBM traffic of one run of the module where XLA's cost
   analysis gives none (GPU): the operand and result bytes of every materialized top-level
   instruction (fusions, custom calls, copies; views, parameters and constants excluded).
   NOTE: an estimate - a fusion that reads a slice of an operand counts all of it - for
   comparing two compiles of one step, not for absolute numbers.
"""

from __future__ import annotations

import dataclasses
import math
import re

_HEAD = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[su](?:4|8|16|32|64)|f8\w*|bf16|f16|f32|f64)\[([\d,]*)\]")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CODES = re.compile(r"^(s4|u4|s8|u8|f8\w*)$")
_FLOATS = ("f16", "bf16", "f32", "f64")
_VIEWS = ("bitcast", "reshape", "get-tuple-element", "parameter", "tuple", "constant")
_BITS = {"pred": 8, "bf16": 16, "f16": 16, "f32": 32, "f64": 64}


@dataclasses.dataclass(frozen=True)
class Intermediate:
    """One materialized float array at least half a quantized weight's size, read from it."""

    name: str
    opcode: str
    shape: str  # e.g. "f32[32,4096,128]"
    weight: str  # the ENTRY parameter of the codes it reads
    op_name: str  # JAX's op name (named scopes)


@dataclasses.dataclass
class _Instr:
    name: str
    opcode: str
    arrays: list[tuple[str, int]]  # (element type, elements) of the result
    operands: list[str]
    line: str


def _computations(text: str) -> tuple[dict[str, list[_Instr]], str, set[str]]:
    """({computation: its instructions}, the ENTRY's name, the fusion bodies' names)."""
    comps: dict[str, list[_Instr]] = {}
    entry, current, fused = "", None, set()
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            current = head.group(2)
            comps[current] = []
            entry = current if head.group(1) else entry
            continue
        m = _INSTR.match(line) if current else None
        if not m:
            continue
        name, result, opcode, rest = m.groups()
        arrays = [
            (d, math.prod(int(x) for x in dims.split(",") if x))
            for d, dims in _ARRAY.findall(result)
        ]
        args = rest.split(")", 1)[0]
        comps[current].append(_Instr(name, opcode, arrays, _OPERAND.findall(args), line))
        if opcode == "fusion":
            fused.update(_CALLS.findall(line))
    return comps, entry, fused


def _weights(entry: list[_Instr]) -> dict[str, int]:
    """The ENTRY parameters holding quantized codes: name -> elements."""
    return {
        i.name: i.arrays[0][1]
        for i in entry
        if i.opcode == "parameter"
        and "data" in i.name
        and i.arrays
        and _CODES.match(i.arrays[0][0])
    }


def weight_sized(text: str) -> list[Intermediate]:
    """The weight-sized float intermediates of an optimized HLO module (module docstring, 1)."""
    comps, entry, fused = _computations(text)
    weights = _weights(comps.get(entry, []))
    out = []
    for cname, instrs in comps.items():
        if cname in fused:
            continue
        origin = {w: w for w in weights} if cname == entry else {}
        for i in instrs:
            read = [origin[o] for o in i.operands if o in origin]
            if not read:
                continue
            if i.opcode in _VIEWS:
                origin[i.name] = read[0]
                continue
            for w in read:
                big = [(d, n) for d, n in i.arrays if d in _FLOATS and 2 * n >= weights[w]]
                if big:
                    op = _OP_NAME.search(i.line)
                    shape = i.line.split("=", 1)[1].split(f" {i.opcode}(")[0].strip()
                    out.append(Intermediate(i.name, i.opcode, shape, w, op.group(1) if op else ""))
                    break
    return out


def bytes_accessed(text: str) -> int:
    """Operand + result bytes of the materialized top-level instructions (docstring, step 2)."""
    comps, _, fused = _computations(text)
    out = 0
    for cname, instrs in comps.items():
        if cname in fused:
            continue
        sizes = {i.name: sum(_bytes(d, n) for d, n in i.arrays) for i in instrs}
        for i in instrs:
            if i.opcode in _VIEWS:
                continue
            out += sizes[i.name] + sum(sizes.get(o, 0) for o in i.operands)
    return int(out)


def _bytes(dtype: str, elements: int) -> float:
    bits = _BITS.get(dtype) or (8 if dtype.startswith("f8") else int(dtype[1:]))
    return elements * bits / 8
