"""Tune and time the Pallas dequantizing matmul (`pallas_kernels.linear.gpu`) on a GPU.

    JAX_PLATFORMS=cuda python scripts/bench_linear_gpu.py [--fmt int4,int8] [--rows 1,32]
        [--shapes gate_up,down,qkv,o,lm_head] [--budget 240] [--tuned-out FILE] [--json-out FILE]
    python scripts/bench_linear_gpu.py --interpret --small      # a rehearsal on the CPU

Per code format and Llama-3-8B projection shape ([K, N]: qkv 4096 x 6144, o 4096 x 4096, gate_up
4096 x 28672, down 14336 x 4096, lm_head 4096 x 128256; groups of 128 input channels, as
`quantization="int4"` / `"int8"` store them):
1. Random codes, scales (and int4 offsets) made on the device, in as many copies as make >= 4x
   the L2 cache (60 MB on an H200), so a timed pass reads each weight from HBM; x random bf16.
2. Candidates (`pallas_kernels.linear.gpu.Blocks`): stage A every column block x K split leaving
   132..1056 programs, both forms at one row; stage B the best of A with other warp / pipeline
   stage counts and two tiles a loop step. Each candidate is compiled (in parallel threads),
   checked against the f32 product of the dequantized weight (relative error <= 2e-2 of the
   largest output, else dropped as wrong) and timed: one jitted call runs the product over every
   copy; median of `--runs` calls / copies = one product.
3. Beside them in the same process: XLA's product as the engine writes it (`layers._xla_dense`,
   per-group partial products for decode rows), XLA's bf16 dot of a bf16 weight of the same shape
   (cuBLAS: the 16-bit bar), and the device's copy bandwidth (read + written) as the roofline:
   weight bytes / copy bandwidth.
Prints a table (us and GB/s of weight bytes per product); `--tuned-out` writes the best `Blocks`
per (codes, K, N, rows) as JSON for `gpu.load_tuned` (`bench_step.py --linear-tuning FILE`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import time

import _path  # noqa: F401
import jax
import jax.numpy as jnp
from _timing import median_time

from jaxinfer import layers, quantization
from jaxinfer.quantization import QArray
from pallas_kernels.linear import gpu as gpu_linear

SHAPES = {
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 28672),
    "down": (14336, 4096),
    "lm_head": (4096, 128256),
}
SMALL = {"qkv": (256, 384), "down": (512, 256)}  # --small: interpret-mode rehearsal shapes
GROUP = 128
L2_BYTES = 60 << 20


def make_weights(fmt: str, k: int, n: int, copies: int, seed: int) -> list[QArray]:
    out = []
    for c in range(copies):
        kc, ks, ko = jax.random.split(jax.random.PRNGKey(seed * 1000 + c), 3)
        g = k // GROUP
        if fmt == "int4":
            data = jax.random.randint(kc, (k, n), 0, 16, jnp.int32).astype(jnp.uint4)
            scale = (jax.random.uniform(ks, (g, n), jnp.float32, 0.5, 1.5) / 16).astype(jnp.float16)
            offset = (jax.random.uniform(ko, (g, n), jnp.float32, -1, 0) / 2).astype(jnp.float16)
            out.append(QArray(data, scale, offset))
        else:
            data = jax.random.randint(kc, (k, n), -127, 128, jnp.int32).astype(jnp.int8)
            scale = jax.random.uniform(ks, (g, n), jnp.float32, 0.5, 1.5) / 127
            out.append(QArray(data, scale))
    return jax.block_until_ready(out)


def nbytes(w) -> int:
    """Stored bytes (uint4: two codes a byte; jax counts a byte each)."""
    return sum(a.size * jnp.dtype(a.dtype).itemsize * (0.5 if a.dtype == jnp.uint4 else 1)
               for a in jax.tree.leaves(w))  # fmt: skip


def kernel_fn(b: gpu_linear.Blocks, interpret: bool):
    def one(x, w: QArray):
        return gpu_linear.quantized_matmul(
            x, w.data, w.scale, w.offset, interpret=interpret, config=b
        )

    return jax.jit(lambda x, ws: tuple(one(x, w) for w in ws))


def xla_fn():
    return jax.jit(lambda x, ws: tuple(layers._xla_dense(x, w) for w in ws))


def candidates(t: int, k: int, n: int, fmt: str) -> list[gpu_linear.Blocks]:
    dtype = jnp.uint4 if fmt == "int4" else jnp.int8
    bk = gpu_linear.max_block_k(k, k // GROUP)
    forms = ("dot", "fma") if t == 1 else ("dot",)
    out = []
    for form in forms:
        for bn in (64, 128, 256):
            # "fma": its accumulators bound block_k (`FMA_TILE_FLOATS`), the K tile's bytes made
            # up by unrolling
            fk = min(bk, max(16, gpu_linear.FMA_TILE_FLOATS // bn)) if form == "fma" else bk
            for split in (1, 2, 4, 8, 16):
                b = gpu_linear.Blocks(bn, split, fk, unroll=bk // fk, form=form)
                progs = -(-n // bn) * split
                ok = gpu_linear.check_blocks(b, t, k, n, k // GROUP, dtype) is None
                if ok and (132 <= progs <= 1056 or (split == 1 and progs > 1056)):
                    out.append(b)
    default = gpu_linear.default_blocks(t, k, n, k // GROUP, fmt == "int4")
    return out + ([default] if default not in out else [])


def stage_b(best: gpu_linear.Blocks) -> list[gpu_linear.Blocks]:
    out = [best._replace(num_warps=w, num_stages=s) for w in (4, 8) for s in (2, 3, 4)]
    out.append(best._replace(unroll=2 * best.unroll))
    return [b for b in out if b != best]


class Case:
    """One (format, shape, rows): weights, x, the f32 reference and the timed candidates."""

    def __init__(self, fmt, name, k, n, t, weights, runs, interpret):
        self.fmt, self.name, self.k, self.n, self.t = fmt, name, k, n, t
        self.weights, self.runs, self.interpret = weights, runs, interpret
        # NOTE: XLA:CPU has no bf16 x bf16 -> f32 dot: the rehearsal's x is f32.
        dtype = jnp.float32 if interpret else jnp.bfloat16
        self.x = jax.random.normal(jax.random.PRNGKey(t), (t, k), dtype)
        self.want = jnp.dot(
            self.x.astype(jnp.float32),
            quantization.dequantize(weights[0], 0),
            precision=jax.lax.Precision.HIGHEST,
        )
        self.wbytes = nbytes(weights[0])
        self.results: dict[gpu_linear.Blocks, dict] = {}

    def compile(self, b):
        fn = kernel_fn(b, self.interpret)
        return fn.lower(self.x, self.weights).compile()

    def measure(self, fn) -> dict:
        got = fn(self.x, self.weights)[0].astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - self.want)) / jnp.max(jnp.abs(self.want)))
        sec = median_time(lambda: fn(self.x, self.weights), self.runs) / len(self.weights)
        return {"us": round(sec * 1e6, 2), "gbps": round(self.wbytes / sec / 1e9, 1), "err": err}

    def run(self, blist, pool) -> None:
        blist = [b for b in blist if b not in self.results]
        futures = {b: pool.submit(self.compile, b) for b in blist}
        for b in blist:
            try:
                r = self.measure(futures[b].result())
            except Exception as e:  # noqa: BLE001 - a configuration Triton refuses is a result
                r = {"error": f"{type(e).__name__}: {e}"[:300]}
            if "err" in r and not r["err"] <= 2e-2:
                r["error"] = f"wrong: relative error {r['err']:.3g}"
            self.results[b] = r

    def best(self) -> tuple[gpu_linear.Blocks, dict] | None:
        ok = [(b, r) for b, r in self.results.items() if "error" not in r]
        return min(ok, key=lambda br: br[1]["us"]) if ok else None


def write(args, bandwidth: float, rows: list[dict], tuned: list[dict]) -> None:
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"copy_gbps": bandwidth / 1e9, "rows": rows}, f, indent=1)
    if args.tuned_out:
        with open(args.tuned_out, "w") as f:
            json.dump(tuned, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fmt", default="int4,int8")
    p.add_argument("--rows", default="1,32")
    p.add_argument("--shapes", default="gate_up,down,qkv,o,lm_head")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--budget", type=float, default=240.0, help="seconds; later cases run stage A")
    p.add_argument("--threads", type=int, default=8, help="parallel compiles")
    p.add_argument("--tuned-out", default=None)
    p.add_argument("--json-out", default=None)
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--small", action="store_true", help="small shapes (with --interpret)")
    args = p.parse_args()
    t0 = time.perf_counter()
    shapes = SMALL if args.small else {s: SHAPES[s] for s in args.shapes.split(",")}
    copy = jax.jit(lambda a: a * 1.0001)
    buf = jnp.ones(((64 << 20) if args.small else (2 << 30)) // 4, jnp.float32)
    bandwidth = 2 * buf.nbytes / median_time(lambda b=buf: copy(b), 9)
    del buf
    print(json.dumps({"device": str(jax.devices()[0]), "copy_gbps": round(bandwidth / 1e9)}))
    rows, tuned = [], []
    pool = concurrent.futures.ThreadPoolExecutor(args.threads)
    for fmt in args.fmt.split(","):
        for name, (k, n) in shapes.items():
            wb = k * n * (0.5 if fmt == "int4" else 1)
            copies = max(2, min(16, math.ceil(4 * L2_BYTES / wb)))
            weights = make_weights(fmt, k, n, copies, seed=k + n)
            bf16 = [
                jax.random.normal(
                    jax.random.PRNGKey(c), (k, n), jnp.float32 if args.interpret else jnp.bfloat16
                )
                for c in range(max(2, min(16, math.ceil(4 * L2_BYTES / (2 * k * n)))))
            ]
            for t in (int(r) for r in args.rows.split(",")):
                case = Case(fmt, name, k, n, t, weights, args.runs, args.interpret)
                xla = case.measure(xla_fn())
                dot = jax.jit(lambda x, ws: tuple(x @ w for w in ws))
                b16 = median_time(lambda f=dot, x=case.x, w=bf16: f(x, w), args.runs) / len(bf16)
                case.run(candidates(t, k, n, fmt), pool)
                best = case.best()
                if best and time.perf_counter() - t0 < args.budget:
                    case.run(stage_b(best[0]), pool)
                    best = case.best()
                default = gpu_linear.default_blocks(t, k, n, k // GROUP, fmt == "int4")
                row = {
                    "fmt": fmt, "shape": name, "k": k, "n": n, "rows": t, "copies": copies,
                    "weight_bytes": case.wbytes,
                    "roofline_us": round(case.wbytes / bandwidth * 1e6, 2),
                    "xla": xla, "bf16_us": round(b16 * 1e6, 2),
                    "default": case.results.get(default),
                    "best": best and {"blocks": best[0]._asdict(), **best[1]},
                    "all": [{"blocks": b._asdict(), **r} for b, r in case.results.items()],
                }  # fmt: skip
                rows.append(row)
                if best:
                    tuned.append({"codes": jnp.dtype(case.weights[0].data.dtype).name, "k": k,
                                  "n": n, "rows": gpu_linear.row_class(t),
                                  "blocks": best[0]._asdict(), "us": best[1]["us"]})  # fmt: skip
                short = {k_: v for k_, v in row.items() if k_ != "all"}
                print(json.dumps(short), flush=True)
                write(args, bandwidth, rows, tuned)  # each case: a time box may end the run
            del weights, bf16
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; us per product (GB/s of weight bytes)")
    print(f"{'case':>22s} {'roofline':>9s} {'bf16 dot':>9s} {'xla':>16s} {'default':>16s} "
          f"{'best':>16s}  best blocks")  # fmt: skip
    for r in rows:
        cell = lambda d: f"{d['us']:8.1f} ({d['gbps']:5.0f})" if d and "us" in d else "-"  # noqa: E731
        b = r["best"]
        desc = "-" if not b else ",".join(str(v) for v in b["blocks"].values())
        print(
            f"{r['fmt'] + ' ' + r['shape'] + ' t' + str(r['rows']):>22s} {r['roofline_us']:9.1f} "
            f"{r['bf16_us']:9.1f} {cell(r['xla']):>16s} {cell(r['default']):>16s} "
            f"{cell(b):>16s}  {desc}"
        )
    print(f"done in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
