"""Ragged paged attention speed per backend, against the machine's own copy and matmul rates.

    python scripts/bench_attention.py [--small] [--backends reference,cpu,gpu,tpu] [--runs 10]
                                      [--seqs N] [--context N] [--heads N] [--kv-heads N]
    python scripts/bench_attention.py --table        # issue 15's GPU table (Llama-3-8B heads)
    python scripts/bench_attention.py --table --decode-programs 264   # split-K tuning

1. Roofline probes: memory bandwidth from a large on-device elementwise copy (bytes read +
   written / time) and the matmul rate of a large square matmul in the benchmark dtype.
2. Batches over one paged cache (pages handed out in shuffled order): decode-heavy (every
   sequence decodes one token at `--context`), prefill-heavy (whole `--context`-token prompts) and
   mixed (decodes plus a few 512-token chunked-prefill chunks). Defaults: 64 sequences x 2k
   context, 32 query / 8 KV heads, head_dim 128, page 16, bf16; `--small` shrinks it for CPU;
   `--seqs/--context/--heads/--kv-heads` override either (e.g. SmolLM2's 9/3 heads). `--table`
   runs issue 15's rows instead: decode 1 x 4096, 8 x 2048, 64 x 1024, 256 x 2048, 64 x 100..4000
   (ragged), prefill 1 x 2048 (causal), mixed 63 decodes at 1024 + one 512-token prompt.
3. Each backend's jitted `ragged_paged_attention` is timed (median of `--runs` after a warm-up):
   achieved KV bytes/s (each sequence's visible K and V read once) vs the copy rate, and FLOP/s
   (4 * D per visible (query head, key) pair) vs the matmul rate, and its max error against the
   reference's output (`err`). Of `--backends` (default reference,cpu,gpu,tpu; cpu only on a CPU
   platform) the reference and the platform's own kernel (the compiled C++ kernel on CPU) are
   timed; the others get a tiny interpret-mode sanity run (interpret timings mean nothing).
   `--decode-programs N` overrides the GPU kernel's split-K program target (block_sizes.py's
   `DECODE_PROGRAMS_PER_CORE` x SMs; 0: no split) to tune it.
4. Peers on a GPU, on the same data in the same run: JAX's
   `jax.experimental.pallas.ops.gpu.paged_attention` on every decode-only batch (`jax-paged`; the
   cache is split into its `[Hkv, P, page, D]` K and V pages, the page table padded to its
   k_splits multiple and q pre-scaled, outside the timed region) and cuDNN flash attention
   (`jax.nn.dot_product_attention(..., implementation="cudnn")`, `cudnn`) on every prefill-only
   batch (K/V gathered into dense `[B, S, Hkv, D]` outside the timed region). Elsewhere they are
   skipped with a line saying so.
Prints a table and one JSON line for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import platform

import _path  # noqa: F401
import jax
import jax.numpy as jnp
import numpy as np
from _timing import median_time

from jaxinfer.attention import resolve_backend
from pallas_kernels.paged_common import interpret_mode
from pallas_kernels.ragged_paged_attention import KERNELS, block_sizes, tpu_layout


@dataclasses.dataclass(frozen=True)
class Batch:
    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]


def measure_roofline(dtype, small: bool, runs: int) -> tuple[float, float]:
    """(copy bytes/s, matmul FLOP/s) of the default device."""
    n = (1 << 24) if small else (1 << 28)  # f32/bf16 elements
    x = jnp.ones((n,), dtype)
    copy = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
    bw = 2 * x.nbytes / median_time(lambda: copy(x), runs)
    m = 1024 if small else 8192
    a = jnp.ones((m, m), dtype)
    mm = jax.jit(lambda u, v: jnp.dot(u, v, preferred_element_type=jnp.float32))
    flops = 2 * m**3 / median_time(lambda: mm(a, a), runs)
    return bw, flops


def make_inputs(
    batch: Batch,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    pages_per_seq: int,
    dtype,
    seed: int = 0,
):
    rng = np.random.default_rng(seed)
    n = len(batch.q_lens)
    need = [-(-k // page_size) for k in batch.kv_lens]
    num_pages = sum(need) + 1
    perm = rng.permutation(num_pages)
    table = np.zeros((n, pages_per_seq), np.int32)
    i = 0
    for s, k in enumerate(need):
        table[s, :k] = perm[i : i + k]
        i += k
    t = sum(batch.q_lens)
    key = jax.random.PRNGKey(seed)
    kq, kc = jax.random.split(key)
    q = jax.random.normal(kq, (t, heads, head_dim), dtype)
    cache = jax.random.normal(kc, (num_pages, page_size, 2 * kv_heads, head_dim), dtype)
    cu = np.concatenate([[0], np.cumsum(batch.q_lens)]).astype(np.int32)
    return (
        q,
        cache,
        jnp.asarray(batch.kv_lens, jnp.int32),
        jnp.asarray(table),
        jnp.asarray(cu),
        jnp.asarray([n], jnp.int32),
    )


def work(
    batch: Batch, *, heads: int, kv_heads: int, head_dim: int, itemsize: int
) -> tuple[int, int]:
    """(KV bytes read once, attention FLOPs) of a batch under the causal mask."""
    kv_bytes = sum(batch.kv_lens) * kv_heads * 2 * head_dim * itemsize
    pairs = sum(q * (k - q) + q * (q + 1) // 2 for q, k in zip(batch.q_lens, batch.kv_lens))
    return kv_bytes, 4 * head_dim * heads * pairs


def in_layout(backend: str, inputs):
    """`inputs` with the cache in `backend`'s layout (the TPU kernel's own `tpu_layout`)."""
    if backend != "tpu":
        return inputs
    q, cache, *meta = inputs
    return (q, tpu_layout.from_reference_cache(cache), *meta)


def kernel_options(backend: str, args, inputs) -> dict:
    """`blocks=` for the GPU kernel when --decode-programs overrides the table's split-K target."""
    if backend != "gpu" or args.decode_programs is None:
        return {}
    q, cache, _, table, _, _ = inputs
    blocks = block_sizes.get_block_sizes(
        "gpu",
        head_dim=q.shape[2],
        page_size=cache.shape[1],
        dtype=cache.dtype,
        group=q.shape[1] // (cache.shape[2] // 2),
        pages_per_seq=table.shape[1],
        pow2=True,
    )
    return {"blocks": dataclasses.replace(blocks, decode_programs=args.decode_programs)}


def table_batches() -> list[Batch]:
    """Issue 15's rows (Llama-3-8B attention on an H100), for `--table`."""
    ragged = tuple(int(x) for x in np.linspace(100, 4000, 64))
    return [
        Batch("decode_1x4096", (1,), (4096,)),
        Batch("decode_8x2048", (1,) * 8, (2048,) * 8),
        Batch("decode_64x1024", (1,) * 64, (1024,) * 64),
        Batch("decode_256x2048", (1,) * 256, (2048,) * 256),
        Batch("decode_64x100-4000", (1,) * 64, ragged),
        Batch("prefill_1x2048", (2048,), (2048,)),
        Batch("mixed_63+512", (1,) * 63 + (512,), (1024,) * 63 + (512,)),
    ]


def batches(seqs: int, context: int, prefill_tokens: int, chunk: int) -> list[Batch]:
    n_prefill = max(1, prefill_tokens // context)
    n_chunks = min(4, seqs // 2)
    return [
        Batch("decode", (1,) * seqs, (context,) * seqs),
        Batch("prefill", (context,) * n_prefill, (context,) * n_prefill),
        Batch("mixed", (1,) * (seqs - n_chunks) + (chunk,) * n_chunks, (context,) * seqs),
    ]


PEER_K_SPLITS = 16  # paged_attention's default: its page table width must be a multiple


def peer_paged_attention(inputs, sm_scale: float):
    """`jax.experimental.pallas.ops.gpu.paged_attention` on a decode batch (its own layout; it
    applies no softmax scale, so q is pre-scaled outside the timing)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    q, cache, kv_lens, table, _, _ = inputs
    k_pages = jnp.moveaxis(cache[:, :, 0::2], 2, 0)  # [Hkv, P, page, D], made outside the timing
    v_pages = jnp.moveaxis(cache[:, :, 1::2], 2, 0)
    ppcb = 8
    # width: a multiple of k_splits, and each split's pages a multiple of the compute block
    step = PEER_K_SPLITS * (ppcb if table.shape[1] > PEER_K_SPLITS * ppcb else 1)
    width = -(-table.shape[1] // step) * step
    table = jnp.pad(table, ((0, 0), (0, width - table.shape[1])))  # page 0: masked by length
    fn = jax.jit(
        functools.partial(
            jax_paged.paged_attention, k_splits=PEER_K_SPLITS, pages_per_compute_block=ppcb
        )
    )
    q = (q * sm_scale).astype(q.dtype)
    jax.block_until_ready((q, k_pages, v_pages, table))
    return lambda: fn(q, k_pages, v_pages, table, kv_lens)


def peer_cudnn(inputs, batch: Batch, sm_scale: float):
    """cuDNN flash attention (`jax.nn.dot_product_attention`) on a prefill batch of equal prompts,
    K/V gathered from the pages into dense [B, S, Hkv, D] outside the timing; out [T, Hq, D]."""
    q, cache, _, table, _, _ = inputs
    n, length = len(batch.q_lens), batch.q_lens[0]
    _, page_size, h2, d = cache.shape
    pages = -(-length // page_size)
    kv = cache[table[:, :pages]].reshape(n, pages * page_size, h2, d)[:, :length]
    k, v = kv[:, :, 0::2], kv[:, :, 1::2]  # [B, S, Hkv, D]
    qb = q.reshape(n, length, q.shape[1], d)
    fn = jax.jit(
        functools.partial(
            jax.nn.dot_product_attention, is_causal=True, scale=sm_scale, implementation="cudnn"
        )
    )
    jax.block_until_ready((qb, k, v))
    return lambda: fn(qb, k, v).reshape(q.shape)


def sanity_interpret(kernel_backends, dtype) -> dict[str, float]:
    """Tiny interpret-mode runs of the kernels on CPU: max |kernel - reference| / max |reference|."""
    batch = Batch("sanity", (1, 1, 5), (9, 30, 12))
    inputs = make_inputs(
        batch, heads=4, kv_heads=2, head_dim=64, page_size=8, pages_per_seq=4, dtype=dtype
    )
    ref = np.asarray(KERNELS["reference"](*inputs, sm_scale=0.125), np.float32)
    errs = {}
    for b in kernel_backends:
        interpret = interpret_mode(b, "cpu")
        out = KERNELS[b](*in_layout(b, inputs), sm_scale=0.125, interpret=interpret)
        out = np.asarray(out, np.float32)
        errs[b] = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    return errs


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--small", action="store_true", help="CPU-sized problem (8 x 256, 8/2 heads, d=64)"
    )
    p.add_argument("--backends", default=None, help="comma list; default by platform")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default bfloat16 (float32 with --small: bf16 is the slow path on CPU)",
    )
    p.add_argument("--runs", type=int, default=10)
    p.add_argument(
        "--decode-programs",
        type=int,
        default=None,
        help="GPU kernel: split-K decode program target (0: no split; default: table)",
    )
    p.add_argument(
        "--table",
        action="store_true",
        help="issue 15's rows (8B heads, page 16) instead of decode/prefill/mixed",
    )
    for flag in ("seqs", "context", "heads", "kv-heads"):
        p.add_argument(f"--{flag}", type=int, default=None)
    args = p.parse_args()
    plat = jax.default_backend()
    dtype = jnp.dtype(args.dtype or ("float32" if args.small else "bfloat16"))
    if args.small:
        seqs, context, heads, kv_heads, head_dim, page_size, prefill_tokens, chunk = (
            8,
            256,
            8,
            2,
            64,
            16,
            512,
            64,
        )
    else:
        seqs, context, heads, kv_heads, head_dim, page_size, prefill_tokens, chunk = (
            64,
            2048,
            32,
            8,
            128,
            16,
            8192,
            512,
        )
    if args.table:
        heads, kv_heads, head_dim, page_size = 32, 8, 128, 16
    seqs, context = args.seqs or seqs, args.context or context
    heads, kv_heads = args.heads or heads, args.kv_heads or kv_heads
    native = resolve_backend("auto")
    default = ["reference", "cpu", "gpu", "tpu"] if plat == "cpu" else ["reference", "gpu", "tpu"]
    backends = args.backends.split(",") if args.backends else default
    on_device = [b for b in backends if b in ("reference", native)]
    interpreted = [b for b in backends if b not in on_device]

    bw, mm = measure_roofline(dtype, args.small, args.runs)
    print(
        f"device {jax.devices()[0].device_kind} ({plat}), {dtype.name}: copy {bw / 1e9:.1f} GB/s, "
        f"matmul {mm / 1e12:.2f} TFLOP/s"
    )
    dims = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    todo = table_batches() if args.table else batches(seqs, context, prefill_tokens, chunk)
    if plat != "gpu":
        print(
            f"peers skipped: JAX's pallas paged_attention and cuDNN flash attention need a GPU "
            f"(platform {plat})"
        )
    sm_scale = head_dim**-0.5
    rows = []
    print(
        f"{'batch':18s} {'backend':10s} {'tokens':>6s} {'ms':>9s} {'KV GB/s':>8s} {'%copy':>6s} "
        f"{'TFLOP/s':>8s} {'%mm':>6s} {'err':>8s}"
    )
    for batch in todo:
        pages_per_seq = -(-max(batch.kv_lens) // page_size)
        inputs = make_inputs(
            batch, page_size=page_size, pages_per_seq=pages_per_seq, dtype=dtype, **dims
        )
        kv_bytes, flops = work(batch, itemsize=dtype.itemsize, **dims)
        runs = {
            b: functools.partial(
                jax.jit(
                    functools.partial(
                        KERNELS[b], sm_scale=sm_scale, **kernel_options(b, args, inputs)
                    )
                ),
                *in_layout(b, inputs),
            )
            for b in on_device
        }
        if plat == "gpu" and set(batch.q_lens) == {1}:
            runs["jax-paged"] = peer_paged_attention(inputs, sm_scale)
        if plat == "gpu" and batch.q_lens == batch.kv_lens and len(set(batch.q_lens)) == 1:
            runs["cudnn"] = peer_cudnn(inputs, batch, sm_scale)
        ref = None
        for name, fn in runs.items():
            try:
                sec = median_time(fn, args.runs)
                out = np.asarray(fn(), np.float32)
            except Exception as e:  # e.g. a peer's shape constraints
                print(f"{batch.name:18s} {name:10s} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            if name == "reference":
                ref = out
            err = (
                float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))) if ref is not None else None
            )
            row = dict(
                batch=batch.name,
                backend=name,
                tokens=sum(batch.q_lens),
                ms=sec * 1e3,
                kv_gbs=kv_bytes / sec / 1e9,
                pct_copy=100 * kv_bytes / sec / bw,
                tflops=flops / sec / 1e12,
                pct_mm=100 * flops / sec / mm,
                err=err,
            )
            rows.append(row)
            print(
                f"{row['batch']:18s} {name:10s} {row['tokens']:6d} {row['ms']:9.3f} "
                f"{row['kv_gbs']:8.2f} {row['pct_copy']:6.1f} {row['tflops']:8.4f} "
                f"{row['pct_mm']:6.1f} {'-' if err is None else f'{err:8.1e}':>8s}"
            )
    sanity = sanity_interpret(interpreted, dtype) if interpreted else {}
    for b, err in sanity.items():
        print(f"interpret-mode sanity {b}: max error / max |ref| = {err:.2e}")
    print(
        json.dumps(
            {
                "bench": "attention",
                "device": jax.devices()[0].device_kind,
                "platform": plat,
                "machine": platform.machine(),
                "dtype": dtype.name,
                "small": args.small,
                "table": args.table,
                "jax": jax.__version__,
                "decode_programs": args.decode_programs,
                "seqs": seqs,
                "context": context,
                "heads": heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                "page_size": page_size,
                "copy_gbs": round(bw / 1e9, 2),
                "matmul_tflops": round(mm / 1e12, 3),
                "rows": [
                    {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in r.items()}
                    for r in rows
                ],
                "interpret_sanity": sanity,
            }
        )
    )


if __name__ == "__main__":
    main()
