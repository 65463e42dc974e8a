"""Count the GPU instructions of the Pallas dequantizing matmul's loop, deviceless (no GPU).

    python scripts/kernel_sass.py --nvdisasm PATH [--fmt int4] [--k 4096] [--n 28672]
        [--groups 32] [--rows 1] [--blocks 128,1,32,4,fma,4,3]

The kernel (`pallas_kernels.linear.gpu.quantized_matmul`) is compiled for an H100 with the
deviceless CUDA plugin (`jaxinfer.aot`), its PTX taken from XLA's dump, assembled by the plugin's
own `ptxas` (`nvidia-cuda-nvcc-cu12`: registers and spills) and disassembled by `nvdisasm`, which
no dependency ships: `pip download --no-deps nvidia-cuda-nvdisasm` and unzip the wheel
(`nvidia/cu13/bin/nvdisasm`). Prints the SASS opcodes of each loop (a backward branch to a
label) and the instructions per code of the loop body: a GPU issues one instruction per clock
per scheduler, so a memory-bound GEMV needs few enough per byte it reads (BENCHMARKS.md "The
one-row dequantizing matmul in fewer instructions"). Without `--blocks`, the configuration
`gpu.blocks` picks for those rows and shapes.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import tempfile

import _path  # noqa: F401
import jax
import jax.numpy as jnp

from jaxinfer import aot
from pallas_kernels.linear import gpu

_INSTR = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"\s*\.(L_x_\d+):")


def loops(sass: str) -> list[collections.Counter]:
    """Opcode counts (modifiers dropped) of each loop in nvdisasm's text: the instructions
    from a label to a branch back to it."""
    at: dict[str, int] = {}
    ops: list[tuple[str, str]] = []
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            at[m.group(1)] = len(ops)
        elif m := _INSTR.match(line):
            ops.append((m.group(1).split(".")[0], m.group(2)))
    out = []
    for i, (op, args) in enumerate(ops):
        target = re.search(r"(L_x_\d+)", args) if op == "BRA" else None
        if target and at.get(target.group(1), i + 1) < i:
            out.append(collections.Counter(o for o, _ in ops[at[target.group(1)] : i + 1]))
    return out


def kernel_ptx(fmt: str, rows: int, k: int, n: int, groups: int, b, where: pathlib.Path) -> str:
    """The PTX of the kernel for x bf16[rows, k] times [k, n] codes of `fmt` ("int4" / "int8")
    in `groups` scale groups with blocks `b`, from the deviceless H100 compile (XLA's dump goes
    to `where`; needs `aot.available("gpu")`)."""
    s = jax.ShapeDtypeStruct
    int4 = fmt == "int4"
    meta = s((groups, n), jnp.float16 if int4 else jnp.float32)
    codes = s((k, n), jnp.uint4 if int4 else jnp.int8)
    args = (s((rows, k), jnp.bfloat16), codes, meta) + ((meta,) * int4)
    aot.compile_function(
        gpu.quantized_matmul, args, "h100", static_kwargs={"config": b},
        compiler_options={"xla_dump_to": str(where)},
    )  # fmt: skip
    kernel = [q.read_text() for q in where.glob("*.ptx") if f"{fmt}_matmul" in q.read_text()]
    if len(kernel) != 1:
        raise RuntimeError(f"{len(kernel)} PTX files of the {fmt} kernel in {where}, not one")
    return kernel[0]


def _ptxas() -> pathlib.Path:
    import nvidia.cuda_nvcc  # the deviceless plugin's assembler (`.[aot]`)

    return pathlib.Path(nvidia.cuda_nvcc.__path__[0]) / "bin" / "ptxas"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nvdisasm", required=True)
    p.add_argument("--fmt", choices=("int4", "int8"), default="int4")
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=28672)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--blocks", help="block_n,split,block_k,unroll,form,warps,stages")
    a = p.parse_args()
    reason = aot.available("gpu")
    if reason is not None:
        raise SystemExit(f"no deviceless GPU compiler: {reason}")
    int4 = a.fmt == "int4"
    codes = jnp.uint4 if int4 else jnp.int8
    if a.blocks:
        f = a.blocks.split(",")
        b = gpu.Blocks(*map(int, f[:4]), f[4], *map(int, f[5:]))
    else:
        b = gpu.blocks(a.rows, a.k, a.n, a.groups, codes)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = pathlib.Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel_ptx(a.fmt, a.rows, a.k, a.n, a.groups, b, pathlib.Path(tmp)))
        cubin = pathlib.Path(tmp) / "k.cubin"
        r = subprocess.run(
            [_ptxas(), "-arch=sm_90a", "-v", "-o", cubin, ptx], capture_output=True, text=True
        )
        info = [x.split(":", 1)[-1].strip() for x in r.stderr.splitlines() if "Used" in x]
        sass = subprocess.run([a.nvdisasm, "-c", cubin], capture_output=True, text=True).stdout
    print(f"{a.fmt} [{a.k}, {a.n}] x {a.rows} rows, {a.groups} groups: {b}; {'; '.join(info)}")
    per = gpu.codes_per_thread(b) if b.form == "fma" else None
    for c in loops(sass):
        total = sum(c.values())
        rate = f", {total / per:.2f} a code ({per} codes a thread a step)" if per else ""
        ops = ", ".join(f"{o} {n}" for o, n in c.most_common())
        print(f"loop of {total} instructions{rate}: {ops}")


if __name__ == "__main__":
    main()
