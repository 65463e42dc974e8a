"""What the engine's step programs do on an accelerator this machine does not have.

    python scripts/aot_report.py --target h100 --config scripts/configs/llama-3-8b --tokens 1,64
    python scripts/aot_report.py --target v5e:2x2 --mesh tensor=4 --config scripts/configs/llama-3-8b
    python scripts/aot_report.py --target h100x8 --mesh tensor=8 --config scripts/configs/llama-3-70b
    python scripts/aot_report.py --target h100x8 --mesh expert=8 --config scripts/configs/mixtral-8x7b

1. JAX starts on the CPU platform (`JAX_PLATFORMS=cpu`, which deviceless compiles need; libtpu
   may be loaded by several processes at once) with the CUDA plugin / libtpu installed
   (`pip install -e '.[aot]'`).
2. `jaxinfer.aot.compile_step` builds the engine's runner over abstract weights of `--config` (a
   model directory, a GGUF file or a config.json; `--layers N` keeps N layers) on `--target`
   (`h100`, `h100x8`, `v5e:1x1`, `v6e:2x2`, `v5e:2x4`, ...) with `--mesh` as `serve.py` takes it,
   and compiles the step program of each `--tokens` bucket; a model that cannot fit the target's
   HBM is refused before compiling (exit status 2, the numbers in the message).
3. Prints one table row per program (compile time, per-device weight / KV / temp / peak bytes
   against the HBM, flops and bytes accessed (TPU), Pallas calls, GPU launches, collectives per
   layer), the GPU launch breakdown (per layer, per named scope) and the collectives (with
   `--quantization`: the float intermediates of a quantized weight's size and the HLO's operand +
   result bytes, `jaxinfer.aot.intermediates`), then one
   JSON line with every number, the command and the jax / jaxlib / libtpu / CUDA plugin versions
   (`--json-out PATH` also writes it to a file).
4. `--compare REF` (a file holding such a JSON line: `--json-out`'s, or a saved stdout) adds a
   before/after table of the GPU launch counts per token bucket: kernels per step, per layer
   (median), outside the layers, the sampler group (sampler + penalty state + logits: every
   kernel, and those outside conditionals), loops/conditionals and host-level launches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from importlib import metadata
from typing import Any

os.environ["JAX_PLATFORMS"] = "cpu"  # NOTE: deviceless compiles need the CPU platform
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import _path  # noqa: E402,F401  (repo root on sys.path)

VERSIONED = ("jax", "jaxlib", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt")


def versions() -> dict[str, str]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="h100, h100x8, v5e:1x1, v6e:2x2, v5e:2x4, ...")
    p.add_argument(
        "--config",
        "--model",
        dest="config",
        required=True,
        help="model directory, GGUF file or config.json",
    )
    p.add_argument("--tokens", default="1", help="token buckets to compile, e.g. 1,64")
    p.add_argument("--layers", type=int, default=None, help="keep the first N layers")
    p.add_argument("--mesh", default="", help='as serve.py: e.g. "tensor=8" or "expert=8"')
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quantization", default=None, help="int8, fp8, int4 (-g<n>, -sym)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="default: sized as the engine does on the target (85%% of free HBM)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--page-bucket", type=int, default=None, help="default: the largest")
    p.add_argument(
        "--attention-backend",
        default=None,
        choices=["auto", "reference", "gpu", "tpu"],
        help="default: the engine's default on the target's platform",
    )
    p.add_argument("--linear-backend", default=None)
    p.add_argument("--all-logits", action="store_true", help="the prompt-logprobs program")
    p.add_argument(
        "--decode",
        action="store_true",
        help="each bucket's pure-decode program (every sequence decodes one token; gpu attention)",
    )
    p.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=1,
        help="N > 1: each bucket's multi-step program (N decode steps in one program; no data / pipeline axes)",
    )
    p.add_argument(
        "--max-loras", type=int, default=0, help="N > 0: an engine with enable_lora, N slots"
    )
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--dump-dir", default=None, help="keep XLA's dumps here")
    p.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    p.add_argument(
        "--compare", default=None, help="a JSON line of an earlier run: print a before/after table"
    )
    return p.parse_args(argv)


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def row(r) -> list[str]:
    lau = r.launches
    per_layer = (
        ", ".join(
            f"{k} {v['per_layer']}" + ("~" if v.get("per_layer_estimated") else "")
            for k, v in r.collectives.items()
            if v["per_layer"]
        )
        or "-"
    )
    return [
        r.target,
        ",".join(f"{k}={v}" for k, v in r.mesh.items()) or "1 device",
        str(r.tokens),
        str(r.seqs),
        f"{r.compile_s:.1f}",
        gib(r.weight_bytes),
        gib(r.kv_cache_bytes),
        gib(r.memory["temp"]),
        f"{gib(r.peak_bytes)}/{gib(r.hbm_bytes)}" + ("" if r.fits else " NO FIT"),
        f"{r.cost['flops'] / 1e9:.1f}" if "flops" in r.cost else "-",
        f"{r.cost['bytes accessed'] / 2**30:.2f}" if "bytes accessed" in r.cost else "-",
        str(r.pallas_calls),
        "-" if lau is None else f"{lau.kernels} ({lau.memory_ops}, {lau.loops}/{lau.conditionals})",
        "-" if lau is None else str(lau.host_launches),
        per_layer,
    ]


HEADER = [
    "target",
    "mesh",
    "tokens",
    "seqs",
    "compile s",
    "weights GiB",
    "KV GiB",
    "temp GiB",
    "peak/HBM GiB",
    "GFLOP",
    "GiB accessed",
    "Pallas",
    "GPU kernels (mem ops, loops/conds)",
    "host launches",
    "collectives per layer",
]
SAMPLER_GROUP = ("sampler", "penalty_state", "logits")  # outside the layers


def launch_counts(launches: dict[str, Any]) -> dict[str, int]:
    """The compared numbers of one program's `Launches` (as a dict, from JSON or `as_dict`)."""
    layers = sorted(v for k, v in launches["per_layer"].items() if k.startswith("layer_")) or [0]

    def group(per_scope: dict[str, int]) -> int:
        return sum(per_scope.get(f"{s} (outside layers)", 0) for s in SAMPLER_GROUP)

    return {
        "kernels": launches["kernels"],
        "per layer (median)": layers[len(layers) // 2],
        "per layer (max)": layers[-1],
        "outside layers": launches["per_layer"].get("(outside layers)", 0),
        "sampler+penalties+logits": group(launches["per_scope"]),
        "  outside conditionals": group(launches.get("per_scope_unconditional", {})),
        "loops": launches["loops"],
        "conditionals": launches["conditionals"],
        "host launches": launches.get("host_launches", -1),
    }


def read_reports(path: str) -> list[dict[str, Any]]:
    """The `reports` of the last JSON line in `path` (aot_report's output or --json-out)."""
    with open(path) as f:
        lines = [ln for ln in f if ln.lstrip().startswith("{")]
    if not lines:
        raise ValueError(f"{path}: no JSON line of scripts/aot_report.py in it")
    return json.loads(lines[-1])["reports"]


def compare(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> str:
    """A markdown before/after table of the GPU launch counts, one column pair per bucket."""
    old = {r["tokens"]: r for r in before if r.get("launches")}
    new = {r["tokens"]: r for r in after if r.get("launches")}
    buckets = sorted(set(old) & set(new))
    if not buckets:
        return "no token bucket with GPU launches in both runs"
    counts = {
        t: (launch_counts(old[t]["launches"]), launch_counts(new[t]["launches"])) for t in buckets
    }
    head = ["launches"] + [f"{t} token{'s' * (t > 1)}: before -> after" for t in buckets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in counts[buckets[0]][0]:
        cells = [f"{counts[t][0][key]} -> {counts[t][1][key]}" for t in buckets]
        lines.append(
            f"| {key.strip()}{' (of those)' if key.startswith(' ') else ''} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def details(r) -> list[str]:
    out = []
    if r.launches is not None:
        layers = {k: v for k, v in r.launches.per_layer.items() if k.startswith("layer_")}
        counts = sorted(layers.values()) or [0]
        top = max(layers, key=layers.get) if layers else "-"
        out.append(
            f"tokens {r.tokens}: {r.launches.kernels} kernels ({r.launches.nested_kernels} inside "
            f"loops/conditionals); per layer median {counts[len(counts) // 2]}, min {counts[0]}, "
            f"max {counts[-1]} ({top}) over {len(layers)} layers; "
            f"{r.launches.per_layer.get('(outside layers)', 0)} outside layers"
        )
        out.append(
            "  kernels by scope (all layers): "
            + ", ".join(f"{k} {v}" for k, v in r.launches.per_scope.items())
        )
        out.append(
            f"  host launches {r.launches.host_launches} (top-level thunks after command-buffer "
            "conversion): " + ", ".join(f"{k} {v}" for k, v in r.launches.host_thunks.items())
        )
    for kind, c in r.collectives.items():
        out.append(
            f"tokens {r.tokens}: {kind} x{c['count']} ({c['per_layer']} per layer"
            f"{', spread evenly: no op names' if c.get('per_layer_estimated') else ''}), "
            f"{c['bytes'] / 2**20:.2f} MiB in all, largest {c['max_bytes'] / 2**10:.1f} KiB"
        )
    return out


def weight_sized(steps) -> list[str]:
    from jaxinfer.aot import intermediates

    out = []
    for s in steps:
        text = s.compiled.as_text()
        found = intermediates.weight_sized(text)
        out.append(
            f"tokens {s.report.tokens}: {len(found)} weight-sized float intermediates of quantized "
            f"weights; HLO bytes accessed (operands + results, estimate) "
            f"{intermediates.bytes_accessed(text) / 1e9:.3f} GB"
        )
        out += [f"  {i.shape} {i.opcode} of {i.weight} ({i.op_name})" for i in found]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from jaxinfer import aot

    tokens = tuple(int(t) for t in args.tokens.split(",") if t.strip())
    try:
        steps = aot.compile_step(
            args.config,
            args.target,
            tokens=tokens,
            layers=args.layers,
            dtype=args.dtype,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
            page_size=args.page_size,
            num_pages=args.num_pages,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            page_bucket=args.page_bucket,
            mesh=args.mesh,
            attention_backend=args.attention_backend,
            linear_backend=args.linear_backend,
            all_logits=args.all_logits,
            decode_only=args.decode,
            num_scheduler_steps=args.num_scheduler_steps,
            lora=(args.max_loras, args.max_lora_rank) if args.max_loras else None,
            dump_dir=args.dump_dir,
        )
    except aot.DoesNotFit as e:
        print(f"refused: {e}", file=sys.stderr)
        return 2
    reports = [s.report for s in steps]
    print(table([row(r) for r in reports]))
    for r in reports:
        for line in details(r):
            print(line)
    for line in weight_sized(steps) if args.quantization else ():
        print(line)
    line = json.dumps(
        {
            "command": "python scripts/aot_report.py "
            + " ".join(sys.argv[1:] if argv is None else argv),
            "date": datetime.date.today().isoformat(),
            "versions": versions(),
            "reports": [r.as_dict() for r in reports],
        }
    )
    if args.compare:
        print(f"compared with {args.compare}:")
        print(compare(read_reports(args.compare), json.loads(line)["reports"]))
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
