"""The GPU decode step's own kernels, compiled on a real GPU, against XLA / the reference.

    JAX_PLATFORMS=cuda python scripts/gpu_check.py [--runs 20] [--json-out FILE]
    python scripts/gpu_check.py --interpret --max-len 64 --runs 1   # a rehearsal on the CPU

The unit tests run these kernels in Pallas interpret mode on the CPU, where programs run one
after another; only a GPU shows a program reading a row another one is writing, or a Triton
lowering that interprets fine but compiles wrong. At Llama-3-8B's shapes (32 query / 8 KV
heads, head_dim 128, page 16, bf16), with the production block sizes:
  1. `gpu_decode_qkv.qkv_decode_attention` (RoPE + KV write + attention from the QKV product) at
     1, 8 and 64 decoding sequences of random lengths up to 2,048, against RoPE by
     `layers.apply_rope`, `reference.update_kv_cache` and the reference attention: the written
     cache bit for bit (NaN-poisoned pages elsewhere), the output within bf16 rounding; then
     its time against the unfused launches it replaces (RoPE, the write, `gpu` decode attention).
  2. `rms_norm.gpu.add_rms_norm` at 1 and 64 rows of 4,096 against XLA's add and RMSNorm.
  3. `linear.gpu.quantized_matmul` through `layers.dense` (int8 and int4, groups of 128) at 1
     and 16 rows of Llama-3-8B's qkv and down projections against XLA's dequantize-then-dot,
     and its time against XLA's.
Prints one JSON line per case ("ok" false on a mismatch) and exits 1 if any case failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import median_time  # noqa: E402

from checkpoints import quantize as qlib  # noqa: E402
from jaxinfer import layers  # noqa: E402
from jaxinfer.quantization import QArray  # noqa: E402
from pallas_kernels.ragged_paged_attention import gpu, gpu_decode_qkv, reference  # noqa: E402
from pallas_kernels.rms_norm import gpu as gpu_norm  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
RESULTS: list[dict] = []
OPTS = {"max_len": 2048, "interpret": False, "seqs": (1, 8, 64)}


def report(**row) -> None:
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def ms(fn, runs: int, *args) -> float:
    return round(median_time(functools.partial(fn, *args), runs) * 1e3, 4)


def decode_batch(n: int, seed: int):
    """n decoding sequences of random lengths: (qkv, cache, lens, table, num_seqs, slots, cos, sin)."""
    rng = np.random.default_rng(seed)
    max_len = OPTS["max_len"]
    pages_per_seq = max_len // PAGE
    num_pages = n * pages_per_seq + 2
    lens = rng.integers(1, max_len + 1, n).astype(np.int32)
    lens[0] = max_len if n > 1 else max_len // 2
    cache = np.full((num_pages, PAGE, 2 * HKV, D), np.nan, np.float32)
    free = list(rng.permutation(num_pages - 1))
    table = np.full((n, pages_per_seq), num_pages - 1, np.int32)  # the last page: all NaN
    for s, kv_len in enumerate(lens):
        for p in range(-(-int(kv_len) // PAGE)):
            table[s, p] = page = free.pop()
            fill = min(PAGE, int(kv_len) - p * PAGE)
            cache[page, :fill] = rng.standard_normal((fill, 2 * HKV, D))
    pos = lens - 1  # the new token's position; its slot is written by the step
    slots = table[np.arange(n), pos // PAGE] * PAGE + pos % PAGE
    cache.reshape(-1, 2 * HKV, D)[slots] = np.nan  # the slot holds nothing before the write
    qkv = rng.standard_normal((n, HKV, HQ // HKV + 2, D)).astype(np.float32)
    angles = pos[:, None] * (500000.0 ** (-np.arange(D // 2) / (D // 2)))[None, :]
    bf = jnp.bfloat16
    return (
        jnp.asarray(qkv, bf),
        jnp.asarray(cache, bf),
        jnp.asarray(lens),
        jnp.asarray(table),
        jnp.asarray([n], jnp.int32),
        jnp.asarray(slots.astype(np.int32)),
        jnp.asarray(np.cos(angles), jnp.float32),
        jnp.asarray(np.sin(angles), jnp.float32),
    )


def unfused(qkv, cache, lens, table, num_seqs, slots, cos, sin, *, attend):
    t, g = qkv.shape[0], HQ // HKV
    q = layers.apply_rope(qkv[:, :, :g].reshape(t, HQ, D), cos, sin)
    k, v = layers.apply_rope(qkv[:, :, g], cos, sin), qkv[:, :, g + 1]
    cache = reference.update_kv_cache(cache, k, v, slots)
    cu = jnp.arange(t + 1, dtype=jnp.int32)
    return attend(q, cache, lens, table, cu, num_seqs, sm_scale=D**-0.5), cache


def fused(qkv, cache, lens, table, num_seqs, slots, cos, sin):
    return gpu_decode_qkv.qkv_decode_attention(
        qkv, *gpu_decode_qkv.expand_rope(cos, sin), cache, slots, lens, table, num_seqs,
        sm_scale=D**-0.5, interpret=OPTS["interpret"],
    )  # fmt: skip


class Stepper:
    """Calls a step that donates its cache, feeding the written cache back."""

    def __init__(self, fn, args):
        self.fn, self.args, self.cache = fn, args, jnp.copy(args[1])

    def __call__(self):
        out, self.cache = self.fn(self.args[0], self.cache, *self.args[2:])
        return out


def check_qkv_attention(runs: int) -> None:
    ref_fn = jax.jit(functools.partial(unfused, attend=reference.ragged_paged_attention))
    attend = functools.partial(
        gpu.ragged_paged_attention, decode_only=True, interpret=OPTS["interpret"]
    )
    gpu_fn = jax.jit(functools.partial(unfused, attend=attend), donate_argnums=1)
    fused_fn = jax.jit(fused, donate_argnums=1)
    for n in OPTS["seqs"]:
        args = decode_batch(n, seed=n)
        want, want_cache = ref_fn(*args)
        got, got_cache = fused_fn(args[0], jnp.copy(args[1]), *args[2:])
        same_cache = np.asarray(got_cache).tobytes() == np.asarray(want_cache).tobytes()
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        err = float(np.abs(got - want).max() / np.abs(want).max())
        ok = bool(same_cache and np.isfinite(got).all() and err <= 2e-2)
        del got_cache, want_cache
        t_fused = median_time(Stepper(fused_fn, args), runs)
        t_unfused = median_time(Stepper(gpu_fn, args), runs)
        report(
            case="qkv_decode_attention", seqs=n, ok=ok, cache_bit_exact=same_cache,
            rel_err=round(err, 5), fused_ms=round(t_fused * 1e3, 4),
            unfused_ms=round(t_unfused * 1e3, 4),
        )  # fmt: skip


def check_add_rms_norm(runs: int) -> None:
    xla = jax.jit(lambda x, y, w: (x + y, layers.rms_norm(x + y, w, 1e-5, 0.0)))
    kernel = jax.jit(
        lambda x, y, w: gpu_norm.add_rms_norm(x, y, w, 1e-5, 0.0, interpret=OPTS["interpret"])
    )
    for t in (1, 64):
        kx, ky, kw = jax.random.split(jax.random.PRNGKey(t), 3)
        x, y = (jax.random.normal(k, (t, 4096), jnp.bfloat16) for k in (kx, ky))
        w = jax.random.normal(kw, (4096,), jnp.bfloat16)
        (h, out), (h_want, want) = kernel(x, y, w), xla(x, y, w)
        same_h = np.asarray(h).tobytes() == np.asarray(h_want).tobytes()
        out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
        err = float(np.abs(out - want).max() / np.abs(want).max())
        report(
            case="add_rms_norm", rows=t, ok=bool(same_h and err <= 1e-2), rel_err=round(err, 5),
            kernel_ms=ms(kernel, runs, x, y, w), xla_ms=ms(xla, runs, x, y, w),
        )  # fmt: skip


def check_dequant_matmul(runs: int) -> None:
    for fmt in ("int8", "int4"):
        for k, n in ((4096, 6144), (14336, 4096)):  # Llama-3-8B's qkv and down projections
            w = np.random.default_rng(k).standard_normal((k, n)).astype(np.float32)
            if fmt == "int4":
                data, scale, offset = qlib.quantize4(w, 0, k // 128)
                q = QArray(jnp.asarray(data), jnp.asarray(scale), jnp.asarray(offset))
            else:
                data, scale = qlib.quantize(w, "int8", 0, k // 128)
                q = QArray(jnp.asarray(data), jnp.asarray(scale))
            kernel = jax.jit(lambda x, q=q: layers.dense(x, q, backend="gpu")[0])
            xla = jax.jit(lambda x, q=q: layers.dense(x, q, backend="xla")[0])
            # NOTE: XLA:CPU has no bf16 x bf16 -> f32 dot: the rehearsal's x is f32
            dtype = jnp.float32 if OPTS["interpret"] else jnp.bfloat16
            for t in (1, 16):
                x = jax.random.normal(jax.random.PRNGKey(t), (t, k), dtype)
                got, want = np.asarray(kernel(x), np.float32), np.asarray(xla(x), np.float32)
                err = float(np.abs(got - want).max() / np.abs(want).max())
                report(
                    case="quantized_matmul", fmt=fmt, k=k, n=n, rows=t, ok=err <= 2e-2,
                    rel_err=round(err, 5),
                    kernel_ms=ms(kernel, runs, x), xla_ms=ms(xla, runs, x),
                )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--json-out", default=None)
    p.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    p.add_argument("--max-len", type=int, default=OPTS["max_len"])
    p.add_argument("--seqs", default="1,8,64")
    args = p.parse_args()
    OPTS.update(
        max_len=args.max_len,
        interpret=args.interpret,
        seqs=tuple(int(n) for n in args.seqs.split(",")),
    )
    print(json.dumps({"device": str(jax.devices()[0]), "jax": jax.__version__}), flush=True)
    for check in (check_qkv_attention, check_add_rms_norm, check_dequant_matmul):
        try:
            check(args.runs)
        except Exception as e:  # noqa: BLE001 - one broken kernel must not hide the others
            report(case=check.__name__, ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in RESULTS) else 1)


if __name__ == "__main__":
    main()
