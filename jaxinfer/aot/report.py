"""What a compiled step program does on its target, read from the compiler's own output.

1. `hlo_ops(text)`: every instruction of the optimized HLO (`compiled.as_text()`) with its opcode,
   result bytes and the op name JAX gave it (the named scopes: `layer_3/attention/...`).
2. `scope_of(op_name)`: ("layer_3" | None, "attention/paged_attention" | "sampler" | ...).
3. GPU: `launches(dump_dir, ops)` parses XLA's `*.thunk_sequence.txt` (one line per thunk, loops
   and conditionals nested) and `*.thunk_metadata.txt` (thunk id -> HLO instruction) into
   `Launches`: kernels, memory ops (copies, memsets), loops/conditionals and collectives, the
   kernels per layer and per scope (a kernel XLA left without an op name - its Triton GEMM
   fusions - counts in the scope of its nearest user: `scoped_op_names`). NOTE: counts are static - every branch of a conditional and
   one trip of a loop body count once - so a decode step launches at most `kernels`;
   `per_scope_unconditional` counts only the kernels outside loops and conditionals (what a
   step launches when every conditional skips). `host_launches` reads
   `*.thunk_sequence_after_thunk_passes.txt`: the top-level thunks after XLA turned runs of
   kernels into command buffers (CUDA graphs), i.e. what the host issues per step (a loop or a
   conditional stays on the host and splits the graph around it).
4. Every target: `collectives(ops)` groups all-reduces, all-gathers, all-to-alls,
   reduce-scatters and permutes by kind: count, bytes, and count per layer; `custom_calls(ops)`
   counts Pallas kernels (Mosaic on TPU, Triton on GPU).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
from typing import Any

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_ARRAY = re.compile(
    r"\b(pred|s4|u4|s8|u8|s16|u16|s32|u32|s64|u64|f8e4m3fn|f8e5m2|bf16|f16|f32|f64)\[([\d,]*)\]"
)
_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1}
_BYTES.update({"s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4})
_BYTES.update({"s64": 8, "u64": 8, "f64": 8})
_LAYER = re.compile(r"^layer_(\d+)$")
_FRAMES = ("shard_map", "cond", "while", "body", "scan")
COLLECTIVES = {
    "all-reduce": "all-reduce",
    "all-reduce-start": "all-reduce",
    "all-gather": "all-gather",
    "all-gather-start": "all-gather",
    "all-to-all": "all-to-all",
    "all-to-all-start": "all-to-all",
    "ragged-all-to-all": "ragged-all-to-all",
    "ragged-all-to-all-start": "ragged-all-to-all",
    "reduce-scatter": "reduce-scatter",
    "reduce-scatter-start": "reduce-scatter",
    "collective-permute": "collective-permute",
    "collective-permute-start": "collective-permute",
}
_THUNK = re.compile(r"^(\s*)(\d+):\s+(k\w+)")
_MEMORY_THUNKS = ("Copy", "Memset", "Memzero")
_CONTROL_THUNKS = ("kWhile", "kConditional")
_COLLECTIVE_THUNKS = ("Nccl", "AllReduce", "AllGather", "AllToAll", "ReduceScatter", "Collective")
_STRUCTURE_THUNKS = ("kSequential", "kCommandBuffer", "kWaitForStreams")


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    opcode: str
    bytes: int  # the largest array of the result
    op_name: str
    target: str  # custom_call_target ("" otherwise)
    operands: tuple[str, ...] = ()  # the instructions it reads


def hlo_ops(text: str) -> list[Op]:
    """The instructions of an HLO module's text (step 1 of the module docstring)."""
    ops = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        name, result, opcode = m.groups()
        sizes = [int(_BYTES[d] * _prod(dims)) for d, dims in _ARRAY.findall(result) if d in _BYTES]
        op_name = _OP_NAME.search(line)
        target = _TARGET.search(line)
        args = line[m.end() :].split(")", 1)[0]
        ops.append(
            Op(
                name,
                opcode,
                max(sizes, default=0),
                op_name.group(1) if op_name else "",
                target.group(1) if target else "",
                tuple(_OPERAND.findall(args)),
            )
        )
    return ops


def scoped_op_names(ops: list[Op], depth: int = 4) -> dict[str, str]:
    """instruction -> its op name, or for one without (XLA drops it on the Triton GEMM fusions it
    builds, split-K ones included) the op name of the nearest producer that has one (the
    activation it multiplies; weights come in without), else of the nearest user, at most
    `depth` steps away: the down projection counts in its layer's `mlp`, not outside the
    layers."""
    names = {op.name: op.op_name for op in ops}
    producers = {op.name: list(op.operands) for op in ops}
    users: dict[str, list[str]] = collections.defaultdict(list)
    for op in ops:
        for arg in op.operands:
            users[arg].append(op.name)

    def nearest(start: list[str], edges) -> str:
        frontier = start
        for _ in range(depth):
            found = next((names[u] for u in frontier if names.get(u)), "")
            if found:
                return found
            frontier = [v for u in frontier for v in edges.get(u, [])]
        return ""

    out = dict(names)
    for op in ops:
        if not op.op_name:
            out[op.name] = nearest(list(op.operands), producers) or nearest(
                users.get(op.name, []), users
            )
    return out


def _prod(dims: str) -> int:
    n = 1
    for d in dims.split(","):
        if d:
            n *= int(d)
    return n


def scope_of(op_name: str) -> tuple[str | None, str]:
    """(layer or None, scope): two named scopes inside a layer, the first one outside (JAX's own
    frames - `jit(...)`, `shard_map` - skipped; the last part, the primitive, dropped)."""
    parts = [p for p in op_name.split("/")[:-1] if p and p not in _FRAMES and "(" not in p]
    for i, part in enumerate(parts):
        if _LAYER.match(part):
            return part, "/".join(parts[i + 1 : i + 3]) or "(layer)"
    return None, parts[0] if parts else "(top)"


@dataclasses.dataclass
class Launches:
    """A GPU program's thunks (step 3 of the module docstring)."""

    kernels: int = 0
    memory_ops: int = 0
    loops: int = 0
    conditionals: int = 0
    collectives: int = 0
    nested_kernels: int = 0  # inside a loop body or a conditional branch
    per_layer: dict[str, int] = dataclasses.field(default_factory=dict)  # kernels
    per_scope: dict[str, int] = dataclasses.field(default_factory=dict)  # kernels, all layers
    # kernels outside loops and conditionals, by scope ("sampler (outside layers)", ...)
    per_scope_unconditional: dict[str, int] = dataclasses.field(default_factory=dict)
    host_launches: int = 0  # top-level thunks after command-buffer conversion (-1: no dump)
    host_thunks: dict[str, int] = dataclasses.field(default_factory=dict)  # their kinds

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def launches(dump_dir: str, ops: list[Op]) -> Launches:
    """Parses the thunk sequence XLA dumped into `dump_dir` (one program per dump)."""
    seq = _one(dump_dir, "*.thunk_sequence.txt")
    meta = _thunk_names(_one(dump_dir, "*.thunk_metadata.txt"))
    op_names = scoped_op_names(ops)
    out = Launches()
    per_layer: collections.Counter[str] = collections.Counter()
    per_scope: collections.Counter[str] = collections.Counter()
    unconditional: collections.Counter[str] = collections.Counter()
    base = None
    with open(seq) as f:
        for line in f:
            m = _THUNK.match(line)
            if not m:
                continue
            indent, thunk_id, kind = len(m.group(1)), int(m.group(2)), m.group(3)
            base = indent if base is None else min(base, indent)
            if kind in _STRUCTURE_THUNKS:
                continue
            if kind == "kWhile":
                out.loops += 1
            elif kind == "kConditional":
                out.conditionals += 1
            elif any(s in kind for s in _COLLECTIVE_THUNKS):
                out.collectives += 1
            elif any(s in kind for s in _MEMORY_THUNKS):
                out.memory_ops += 1
            else:
                out.kernels += 1
                out.nested_kernels += indent > base
                layer, scope = scope_of(op_names.get(meta.get(thunk_id, ""), ""))
                per_layer[layer or "(outside layers)"] += 1
                key = scope if layer else f"{scope} (outside layers)"
                per_scope[key] += 1
                unconditional[key] += indent == base
    out.per_layer = dict(sorted(per_layer.items(), key=lambda kv: _layer_key(kv[0])))
    out.per_scope = dict(per_scope.most_common())
    out.per_scope_unconditional = {k: v for k, v in unconditional.most_common() if v}
    out.host_thunks = host_thunks(dump_dir)
    out.host_launches = sum(out.host_thunks.values()) if out.host_thunks else -1
    return out


def host_thunks(dump_dir: str) -> dict[str, int]:
    """kind -> count of the top-level thunks after XLA's thunk passes (command buffers, loops,
    conditionals, kernels left outside a graph); {} where XLA dumped no such file."""
    found = sorted(glob.glob(os.path.join(dump_dir, "*.thunk_sequence_after_thunk_passes.txt")))
    if not found:
        return {}
    kinds: collections.Counter[str] = collections.Counter()
    with open(found[-1]) as f:
        for line in f:
            m = _THUNK.match(line)
            if m and not m.group(1):
                kinds[m.group(3)] += 1
    return dict(kinds.most_common())


def _layer_key(name: str) -> tuple[int, str]:
    m = re.match(r"layer_(\d+)$", name)
    return (int(m.group(1)), "") if m else (1 << 30, name)


def _one(dump_dir: str, pattern: str) -> str:
    found = sorted(glob.glob(os.path.join(dump_dir, pattern)))
    if not found:
        raise FileNotFoundError(f"no {pattern} in {dump_dir} (was xla_dump_to set?)")
    return found[-1]


def _thunk_names(path: str) -> dict[int, str]:
    """thunk id -> the HLO instruction it runs (`profile_annotation`)."""
    names, annotation = {}, None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("profile_annotation:"):
                annotation = line.split(":", 1)[1].strip().strip('"')
            elif line.startswith("thunk_id:") and annotation is not None:
                names[int(line.split(":", 1)[1])] = annotation
                annotation = None
            elif line.startswith("thunk_metadata"):
                annotation = None
    return names


def collectives(ops: list[Op], num_layers: int = 0) -> dict[str, dict[str, Any]]:
    """kind -> {"count", "bytes" (summed result bytes), "max_bytes", "per_layer" (count in one
    layer: the largest), "unscoped" (ops without an op name)} over the program's collectives.

    NOTE: XLA drops the op name of some collectives (GPU ragged-all-to-alls); where no op of a
    kind has a layer scope and at least `num_layers` have none, `per_layer` is their count spread
    evenly over the layers, rounded down, and "per_layer_estimated" is True."""
    found: dict[str, dict[str, Any]] = {}
    layers: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for op in ops:
        kind = COLLECTIVES.get(op.opcode)
        if kind is None:
            continue
        entry = found.setdefault(kind, {"count": 0, "bytes": 0, "max_bytes": 0, "unscoped": 0})
        entry["count"] += 1
        entry["unscoped"] += not op.op_name
        entry["bytes"] += op.bytes
        entry["max_bytes"] = max(entry["max_bytes"], op.bytes)
        layer, _ = scope_of(op.op_name)
        if layer:
            layers[kind][layer] += 1
    for kind, entry in found.items():
        entry["per_layer"] = max(layers[kind].values(), default=0)
        entry["per_layer_estimated"] = not layers[kind] and entry["unscoped"] >= max(num_layers, 1)
        if entry["per_layer_estimated"] and num_layers:
            entry["per_layer"] = entry["count"] // num_layers
    return found


PALLAS_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton")


def pallas_calls(ops: list[Op]) -> int:
    """Pallas kernel calls: Mosaic (`tpu_custom_call`) and Triton (`__gpu$xla.gpu.triton`)."""
    return sum(op.opcode == "custom-call" and op.target in PALLAS_TARGETS for op in ops)


def custom_calls(ops: list[Op]) -> dict[str, int]:
    """custom_call_target -> count (Pallas: `tpu_custom_call`, `__gpu$xla.gpu.triton`)."""
    return dict(collections.Counter(op.target for op in ops if op.opcode == "custom-call"))
