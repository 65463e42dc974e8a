"""Dense products of a decode step: the compiled CPU kernel against XLA's dot, on the model's shapes.

    python scripts/bench_linear.py [--rows 1,2,4,8,16] [--runs 15] [--layers 30]

1. A chain shaped like one decode step of SmolLM2-135M (E=576, Hq*D=576, 2*Hkv*D=384, F=1536,
   V=49152, tied LM head): per layer q and k/v from one input, o, gate/up, down, with residual adds
   between, then the LM head over the [V, E] embedding. Every layer has its own random f32 weights
   (538 MB in all, far beyond the caches), so each step streams every weight once, as decode does.
2. The chain is jitted once per backend through `jaxinfer.layers.dense` / `dense_transposed`
   ("xla": XLA's dot; "cpu": the kernel for up to `linear.cpu.MAX_ROWS` rows, XLA's dot above);
   the backends alternate run by run, medians reported.
3. The machine's read bandwidth in the same run (a jitted row reduction over twice the weights'
   bytes) gives the weight-read floor of one step.
Prints a table (ms per step, GB/s of weights, GFLOP/s) and one JSON line for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import _path  # noqa: F401
import jax
import jax.numpy as jnp
from bench_generate import read_bandwidth

from jaxinfer import layers

E, QD, KVD, F, V = 576, 576, 384, 1536, 49152


def make_weights(num_layers: int, seed: int = 0):
    keys = iter(jax.random.split(jax.random.key(seed), 5 * num_layers + 1))

    def w(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * 0.02

    layer_ws = [
        dict(qkv=w(E, QD + KVD), o=w(QD, E), gate_up=w(E, 2, F), down=w(F, E))
        for _ in range(num_layers)
    ]
    return layer_ws, w(V, E)


def chain(backend: str):
    def step(x, layer_ws, embed):  # x [T, E]
        h = x
        for p in layer_ws:
            (qkv,) = layers.dense(h, p["qkv"], backend=backend)
            (o,) = layers.dense(qkv[:, :QD], p["o"], backend=backend)
            h = h + o + qkv[:, -1:]  # keeps the k/v product live
            (gu,) = layers.dense(h, p["gate_up"], backend=backend)
            (d,) = layers.dense(gu[:, 0] * gu[:, 1], p["down"], backend=backend)
            h = h + d
        return layers.dense_transposed(h, embed, backend=backend)

    return jax.jit(step)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="1,2,4,8,16", help="token rows per step, comma-separated")
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    layer_ws, embed = make_weights(args.layers)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(layer_ws)) + embed.nbytes
    backends = ("xla", "cpu")
    fns = {b: chain(b) for b in backends}
    results = {}
    print(f"{'rows':>5s} {'backend':>8s} {'ms/step':>9s} {'GB/s':>7s} {'GFLOP/s':>8s}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jax.random.normal(jax.random.key(rows), (rows, E), jnp.float32)
        for f in fns.values():
            f(x, layer_ws, embed).block_until_ready()
        times = {b: [] for b in backends}
        for _ in range(args.runs):
            for b, f in fns.items():
                t = time.perf_counter()
                f(x, layer_ws, embed).block_until_ready()
                times[b].append(time.perf_counter() - t)
        for b in backends:
            s = statistics.median(times[b])
            results.setdefault(str(rows), {})[b] = round(s * 1e3, 2)
            print(
                f"{rows:5d} {b:>8s} {s * 1e3:9.2f} {nbytes / s / 1e9:7.1f} {2 * rows * nbytes / 4 / s / 1e9:8.1f}"
            )
    bandwidth = read_bandwidth(2 * nbytes)
    print(
        f"weight-read floor: {nbytes / bandwidth * 1e3:.2f} ms/step ({nbytes / 1e6:.0f} MB at the "
        f"measured {bandwidth / 1e9:.1f} GB/s)"
    )
    print(
        json.dumps(
            {
                "bench": "linear",
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "weight_bytes": nbytes,
                "ms_per_step": results,
                "read_gb_s": round(bandwidth / 1e9, 1),
                "floor_ms": round(nbytes / bandwidth * 1e3, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
