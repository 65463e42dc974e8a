"""Which weights cost a quantized model its accuracy, and what finer scales would buy: simulated.

    python scripts/simulate_quant.py [--model PATH] [--format int8|fp8] [--tokens 32] [--markdown]
        [--variants all:channel,embed:channel,layers:channel,attn:channel,mlp:channel,all:mse,...]

1. One unquantized `LLM` (the reference of `scripts/eval_quant.py`, same `PROMPTS` and `TEXT`)
   generates its greedy continuations and scores them.
2. Each variant `scope:scheme` replaces the weights `scope` selects ("all", "embed" (with a tied
   LM head), "layers", "attn", "mlp") by `dequantize(quantize(w))` under `scheme`, in the model's
   float dtype, and runs eval_quant's measurements on them (greedy agreement in the first 8 and
   all tokens, logprob drift of the reference continuations, perplexity of `TEXT`):
   - "channel": one absmax scale per output channel, `checkpoints.quantize.quantize` with one
     group (what `quantization=` stored before 2026-11-24's group-wise int8, and still stores
     for fp8 and the MoE experts);
   - "mse": one scale per output channel, `r * absmax` with the clip ratio r in [0.5, 1] (step
     0.01) that minimizes the channel's squared rounding error;
   - "g<N>": one scale per group of consecutive input channels, of N channels where N divides the
     weight's K, else of gcd(N, K) (the embedding's K = 576 takes g128 as 64); "g128" is what
     `quantization="int8"` stores now (`checkpoints.quantize.num_groups`).
3. Prints one row per variant (`--markdown`: the table for BENCHMARKS.md) with the weights'
   relative RMS rounding error, plus a JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import _path  # noqa: F401
import jax
import numpy as np
from eval_quant import evaluate

from checkpoints import quantize as qlib
from jaxinfer import LLM, models
from jaxinfer.params import is_spec

SCOPES = {
    "all": lambda name: True,
    "embed": lambda name: name.startswith(".embed"),
    "layers": lambda name: name.startswith(".layers"),
    "attn": lambda name: ".attn." in name,
    "mlp": lambda name: ".mlp." in name,
}
CLIP_RATIOS = np.round(np.arange(0.5, 1.0001, 0.01), 2)


def _grid(v: np.ndarray, fmt: str) -> np.ndarray:
    """`v` (already divided by its scale) rounded to `fmt`'s grid, as f32."""
    if fmt == "int8":
        return np.clip(np.rint(v), -127, 127)
    return np.clip(v, -qlib.QMAX[fmt], qlib.QMAX[fmt]).astype(qlib.STORAGE[fmt]).astype(np.float32)


def _mse_channel(w: np.ndarray, fmt: str, axis: int) -> np.ndarray:
    """Per-output-channel scales clipped to the ratio of absmax with the least squared error."""
    rows = np.moveaxis(w, axis, -1)
    flat = rows.reshape(-1, rows.shape[-1])  # f32[channels, K]
    absmax = np.abs(flat).max(axis=1, keepdims=True)
    best, best_err = None, np.full((flat.shape[0], 1), np.inf, np.float32)
    for r in CLIP_RATIOS:
        scale = np.where(absmax > 0, absmax * np.float32(r / qlib.QMAX[fmt]), np.float32(1.0))
        dq = _grid(flat / scale, fmt) * scale
        err = np.square(dq - flat).sum(axis=1, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = dq if best is None else np.where(better, dq, best)
    return np.moveaxis(best.reshape(rows.shape), -1, axis)


def simulate(w: np.ndarray, fmt: str, axis: int, scheme: str) -> np.ndarray:
    """f32 `w` [.., K, ..] after a quantize / dequantize round trip under `scheme`."""
    w = np.asarray(w, np.float32)
    if scheme == "channel":
        return qlib.dequantize(*qlib.quantize(w, fmt, axis), axis)
    if scheme == "mse":
        return _mse_channel(w, fmt, axis)
    if scheme.startswith("g") and scheme[1:].isdigit():
        groups = w.shape[axis] // math.gcd(int(scheme[1:]), w.shape[axis])
        return qlib.dequantize(*qlib.quantize(w, fmt, axis, groups), axis)
    raise ValueError(f"scheme {scheme!r} is not 'channel', 'mse' or 'g<group size>'")


def _parse(variant: str) -> tuple[str, str]:
    scope, _, scheme = variant.partition(":")
    if scope not in SCOPES or not scheme:
        raise ValueError(f"variant {variant!r} is not scope:scheme with scope in {sorted(SCOPES)}")
    return scope, scheme


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=None)
    p.add_argument("--format", default="int8", choices=qlib.FORMATS)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument(
        "--variants",
        default="all:channel,embed:channel,layers:channel,attn:channel,"
        "mlp:channel,all:mse,all:g128,all:g64,all:g32",
    )
    p.add_argument("--markdown", action="store_true", help="also print the BENCHMARKS.md table")
    args = p.parse_args()
    variants = [_parse(v) for v in args.variants.split(",") if v]
    llm = LLM(
        args.model,
        quantization=None,
        max_num_seqs=12,
        max_model_len=256,
        max_num_batched_tokens=256,
    )
    runner = llm.engine.runner
    specs = models.family_of(runner.cfg).param_specs(runner.cfg)
    reference = runner.params
    host = jax.tree.map(np.asarray, reference)
    ref_conts, _, ref_ppl = evaluate(llm, args.tokens, None)
    _, ref_lps, _ = evaluate(llm, args.tokens, ref_conts)
    rows = []
    for scope, scheme in variants:
        start = time.perf_counter()
        err2, norm2 = [0.0], [0.0]

        def one(path, spec, w, scope=scope, scheme=scheme, err2=err2, norm2=norm2):
            if spec.quant_axis is None or not SCOPES[scope](jax.tree_util.keystr(path)):
                return w
            sim = simulate(w, args.format, spec.quant_axis, scheme)
            err2[0] += float(np.square(sim - w.astype(np.float32)).sum())
            norm2[0] += float(np.square(w.astype(np.float32)).sum())
            return sim.astype(w.dtype)

        simulated = jax.tree_util.tree_map_with_path(one, specs, host, is_leaf=is_spec)
        runner.params = jax.tree.map(
            lambda x, ref: jax.device_put(x, ref.sharding), simulated, reference
        )
        conts, lps, ppl = evaluate(llm, args.tokens, ref_conts)
        runner.params = reference
        drift = np.concatenate(
            [np.abs(np.asarray(a) - np.asarray(b)) for a, b in zip(lps, ref_lps)]
        )
        rows.append(
            {
                "variant": f"{scope}:{scheme}",
                "weight_rel_rms_err": round(float(np.sqrt(err2[0] / max(norm2[0], 1e-30))), 5),
                "agree_first8": sum(c[:8] == r[:8] for c, r in zip(conts, ref_conts)),
                "agree_all": sum(c == r for c, r in zip(conts, ref_conts)),
                "differ_first8": [
                    i for i, (c, r) in enumerate(zip(conts, ref_conts)) if c[:8] != r[:8]
                ],
                "prompts": len(ref_conts),
                "logprob_drift_mean": round(float(drift.mean()), 4),
                "logprob_drift_max": round(float(drift.max()), 4),
                "perplexity": round(ppl, 3),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
        r = rows[-1]
        print(
            f"{r['variant']:16s} err {100 * r['weight_rel_rms_err']:6.3f}%  first 8 "
            f"{r['agree_first8']:2d}/{r['prompts']}  all {r['agree_all']:2d}/{r['prompts']}  drift "
            f"{r['logprob_drift_mean']:.4f} / {r['logprob_drift_max']:.4f}  ppl {r['perplexity']:.3f}"
            f"  (reference ppl {ref_ppl:.3f})",
            flush=True,
        )
    if args.markdown:
        print(
            f"\n| {args.format} weights (simulated) | weight rel. RMS error | greedy first 8 equal | "
            f"all {args.tokens} equal | logprob drift mean | max | perplexity |"
        )
        print("|---|---|---|---|---|---|---|")
        print(
            f"| none (reference) | 0 | {len(ref_conts)}/{len(ref_conts)} | {len(ref_conts)}/{len(ref_conts)} "
            f"| 0.0000 | 0.0000 | {ref_ppl:.3f} |"
        )
        for r in rows:
            print(
                f"| {r['variant']} | {100 * r['weight_rel_rms_err']:.3f}% | {r['agree_first8']}/{r['prompts']} | "
                f"{r['agree_all']}/{r['prompts']} | {r['logprob_drift_mean']:.4f} | "
                f"{r['logprob_drift_max']:.4f} | {r['perplexity']:.3f} |"
            )
    print(
        json.dumps(
            {
                "bench": "simulate_quant",
                "model": args.model or "default",
                "format": args.format,
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "tokens": args.tokens,
                "reference_perplexity": round(ref_ppl, 3),
                "rows": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
